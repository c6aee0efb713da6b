"""protocols.converters: probabilities -> coupled/residual, eval logs -> reference; errors name the row."""

from __future__ import annotations

import json

import numpy as np
import pytest

from protocols import TraceValidationError
from protocols.converters import (
    ConversionError,
    _validate_naming_rows,
    from_eval_logs,
    from_probabilities,
    residual_from_probabilities,
    tv_from_probabilities,
)


def coupled_inputs(seed=0, R=3, T=5, V=4):
    """Random laws per step; tokens agree except replicate 1 diverges at step 3 on disjoint residual supports."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), size=(2, 2, R, T))
    q = rng.dirichlet(np.ones(V), size=(2, 2, R, T))
    m = np.minimum(p, q)
    x = m.argmax(-1)
    y = x.copy()
    rp, rq = np.clip(p - q, 0, None), np.clip(q - p, 0, None)
    x[:, :, 1, 2:] = rp[:, :, 1, 2:].argmax(-1)
    y[:, :, 1, 2:] = rq[:, :, 1, 2:].argmax(-1)
    return p, q, x, y


def test_from_probabilities():
    p, q, x, y = coupled_inputs()
    ds = from_probabilities(p, q, x, y, docs=["a", "b"], policies=["snapkv@0.5", "recent@0.5"], model="m")
    assert ds.attrs["kind"] == "coupled" and ds.attrs["vocab_size"] == 4
    np.testing.assert_allclose(ds.tv.values, 1 - np.minimum(p, q).sum(-1), atol=1e-6)
    np.testing.assert_allclose(ds.x_logp.values, np.log(np.take_along_axis(p, x[..., None], -1)[..., 0]), rtol=1e-6)
    assert ds.y_logp.dtype == np.float32


def test_from_probabilities_single_cell_and_no_logp():
    p, q, x, y = coupled_inputs()
    ds = from_probabilities(p[0, 0], q[0, 0], x[0, 0], y[0, 0], logp=False)
    assert ds.sizes["doc"] == 1 and "x_logp" not in ds


def test_tv_from_probabilities_float32_identical_rows_give_zero():
    p = np.random.default_rng(1).dirichlet(np.ones(1000), size=50).astype(np.float32)
    assert (tv_from_probabilities(p, p) == 0).all()
    assert np.isnan(tv_from_probabilities(np.full((2, 3), np.nan), np.full((2, 3), np.nan))).all()


def test_probability_row_error_names_the_row():
    p, q, x, y = coupled_inputs()
    p[0, 1, 2, 3] *= 0.9
    with pytest.raises(ConversionError, match=r"p_probs\[doc=0, policy=1, replicate=2, step=4\]: sums to 0\.9"):
        from_probabilities(p, q, x, y)


def test_token_with_zero_probability_names_the_row():
    p, q, x, y = coupled_inputs()
    q[1, 0, 0, 0] = [1, 0, 0, 0]
    p[1, 0, 0, 0] = [1, 0, 0, 0]
    x[1, 0, 0, 0] = y[1, 0, 0, 0] = 2
    with pytest.raises(ConversionError, match=r"x_token\[doc=1, policy=0, replicate=0, step=1\] = 2 has probability 0"):
        from_probabilities(p, q, x, y)


def test_mismatch_at_equal_laws_fails_validation():
    p, q, x, y = coupled_inputs()
    q[0, 0, 1, 2] = p[0, 0, 1, 2]                      # TV 0 at the divergence step
    with pytest.raises(TraceValidationError, match=r"tv\[doc='doc0', policy='candidate', replicate=1, step=3\]"):
        from_probabilities(p, q, x, y)


def test_shape_mismatch():
    p, q, x, y = coupled_inputs()
    with pytest.raises(ConversionError, match="shapes disagree"):
        from_probabilities(p, q[..., :3], x, y)


def test_residual_from_probabilities():
    nan = [np.nan] * 3
    sp = np.array([[[.5, .5, 0], [.6, .4, 0], [1, 0, 0]]])
    sq = np.array([[[.5, .5, 0], [.4, .6, 0], [0, 1, 0]]])
    bp = np.array([[[.6, .4, 0], [.3, .7, 0], nan]])
    bq = np.array([[[.4, .6, 0], [.3, .7, 0], nan]])
    ds = residual_from_probabilities(sp, sq, [[0, 1, -1]], [2], bp, bq, [[0, 1, -1]], [[1, 1, -1]], window=3)
    np.testing.assert_allclose(ds.shared_tv.values[0, 0, 0], [0, .2, 1], atol=1e-7)
    np.testing.assert_allclose(ds.branch_tv.values[0, 0, 0, :2], [.2, 0], atol=1e-7)
    assert np.isnan(ds.branch_tv.values[0, 0, 0, 2])
    bp[0, 2, 1] = 0.5
    with pytest.raises(ConversionError, match=r"branch_p\[doc=0, policy=0, replicate=0, age=2\]: some entries"):
        residual_from_probabilities(sp, sq, [[0, 1, -1]], [2], bp, bq, [[0, 1, -1]], [[1, 1, -1]], window=3)


def write(tmp_path, rows):
    path = tmp_path / "log.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"doc": "a", "policy": "snapkv@0.5", "tokens": [3, 1, 2, 1, 2], "logp_full": [-.5, -.4, -.3, -.2, -.1],
     "logp_evicted": [-.6, float("-inf"), -.3, -.1, -.1], "split": "confirmatory", "prompt_tokens": 40},
    {"doc": "a", "policy": "snapkv@0.5", "tokens": [3, 0], "logp_full": [-.5, -.7], "logp_evicted": [-.5, -.9]},
    {"doc": "b", "policy": "snapkv@0.5", "tokens": [1, 1, 1, 1, 1, 1], "logp_full": [-.1] * 6,
     "logp_evicted": [-.2] * 6},
    {"doc": "b", "policy": "snapkv@0.5", "tokens": [2, 2, 0], "logp_full": [-.1] * 3, "logp_evicted": [-.2] * 3},
]


def test_from_eval_logs(tmp_path):
    ds = from_eval_logs(write(tmp_path, ROWS), vocab_size=5, eos_token_id=0, horizon=5, model="m")
    assert ds.attrs["kind"] == "reference" and ds.attrs["window"] == 0 and ds.sizes["step"] == 5
    assert list(ds.doc.values) == ["a", "b"] and ds.sizes["replicate"] == 2
    np.testing.assert_array_equal(ds.x_token.values[0, 0, 1], [3, 0, 0, 0, 0])      # padded with EOS
    np.testing.assert_array_equal(ds.x_logq.values[0, 0, 1], np.float32([-.5, -.9, 0, 0, 0]))
    assert ds.x_logq.values[0, 0, 0, 1] == -np.inf
    np.testing.assert_array_equal(ds.x_token.values[1, 0, 0], [1] * 5)               # cut to the horizon
    assert ds.source_row.values.tolist() == [[[1, 2]], [[3, 4]]]
    assert list(ds.split.values) == ["confirmatory", ""] and ds.prompt_tokens.values[0] == 40


def test_eval_logs_from_records_and_default_horizon():
    rows = [{k: v for k, v in r.items() if k not in ("doc", "policy")} | {"id": f"q{i}"}
            for i, r in enumerate(ROWS[1:])]
    ds = from_eval_logs(rows, vocab_size=5, eos_token_id=0, policy="streaming@0.5")
    assert ds.sizes["step"] == 6 and list(ds.doc.values) == ["q0", "q1", "q2"]
    assert list(ds.policy.values) == ["streaming@0.5"]


def test_eval_logs_without_doc_ids_are_one_doc_per_row():
    rows = [{k: v for k, v in r.items() if k != "doc"} for r in ROWS[2:]]
    ds = from_eval_logs(rows, vocab_size=5, eos_token_id=0)
    assert list(ds.doc.values) == ["row1", "row2"]


@pytest.mark.parametrize("row, needle", [
    ({"tokens": [1, 9], "logp_full": [-1, -1], "logp_evicted": [-1, -1]}, r"line 5: tokens\[1\] = 9 is not a token"),
    ({"tokens": [1, 2], "logp_full": [-1], "logp_evicted": [-1, -1]}, "line 5: tokens, logp_full and logp_evicted"),
    ({"tokens": [1, 2], "logp_full": [-1, None], "logp_evicted": [-1, -1]}, r"line 5: logp_full\[1\] = None"),
    ({"tokens": [1, 2], "logp_full": [-1, -1], "logp_evicted": [-1, 0.5]}, r"line 5: logp_evicted\[1\] = 0.5"),
    ({"tokens": [1, 2], "logp_full": [-1, -1]}, r"line 5: missing field\(s\) \['logp_evicted'\]"),
    ({"tokens": [1, 2], "logp_full": [-1, -1], "logp_evicted": [-1, -1]}, "line 5 .*not EOS 0; only rows"),
    ({"tokens": [0, 2, 0], "logp_full": [-1, -1, 0], "logp_evicted": [-1, -1, 0]}, "line 5 .*token 1 = 2 follows EOS"),
    ({"doc": "a", "policy": "snapkv@0.5", "replicate": 1, "tokens": [0], "logp_full": [-1], "logp_evicted": [-1]},
     "line 5: doc 'a', policy 'snapkv@0.5', replicate 1 already given by line 2"),
    ({"doc": "a", "policy": "other", "tokens": [0], "logp_full": [-1], "logp_evicted": [-1]},
     r"doc 'a', policy 'other': replicates \[0\], expected 0..1 \(first row: line 5\)"),
    ({"doc": "a", "split": "exploratory", "policy": "snapkv@0.5", "replicate": 2, "tokens": [0], "logp_full": [-1],
      "logp_evicted": [-1]}, "line 5: doc 'a' has split 'exploratory', but line 1 gave 'confirmatory'"),
    ('{"tokens": [1, 2], "logp_full"', "line 5: not valid JSON"),
])
def test_eval_log_errors_name_the_row(tmp_path, row, needle):
    with pytest.raises(ConversionError, match=needle):
        from_eval_logs(write(tmp_path, ROWS + [row]), vocab_size=5, eos_token_id=0, horizon=5)


def test_missing_doc_policy_cell():
    rows = [dict(ROWS[2], doc="a", policy="p1"), dict(ROWS[2], doc="a", policy="p2"),
            dict(ROWS[2], doc="b", policy="p1")]
    with pytest.raises(ConversionError, match="doc 'b' has no rows for policy 'p2'"):
        from_eval_logs(rows, vocab_size=5)


def test_short_row_without_eos_is_refused(tmp_path):
    with pytest.raises(ConversionError, match=r"line 2 \(doc 'a'\): 2 tokens, fewer than the horizon 5.*eos_token_id="):
        from_eval_logs(write(tmp_path, ROWS), vocab_size=5, horizon=5)


def test_validation_problems_get_the_input_row(tmp_path):
    ds = from_eval_logs(write(tmp_path, ROWS), vocab_size=5, eos_token_id=0, horizon=5)
    ds.x_logp.values[1, 0, 1, 0] = 0.5
    with pytest.raises(TraceValidationError, match=r"x_logp\[doc='b', .*replicate=1, step=1\] = 0.5 .*\(input row 4\)"):
        _validate_naming_rows(ds)


def test_missing_log_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        from_eval_logs(tmp_path / "nope.jsonl", vocab_size=5)
