"""EOS as a set of ids in ``kvdiv.trace/1`` (issue 21 item 1): builders, validation,
files, the wire, combining, converters and the collector's header check.

The absorbing rule: a side that emits any EOS id has ended and keeps emitting *that*
id. Sides that ended on the same id agree from then on (both laws its point mass,
TV 0); sides that ended on different ids differ at every later step (TV 1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from collector.checks import header_problems
from protocols import (
    CombineError,
    ConversionError,
    StreamError,
    StreamWriter,
    TraceValidationError,
    assemble,
    combine,
    coupled_dataset,
    dataset_lines,
    eos_ids,
    from_eval_logs,
    header_record,
    open_traces,
    save_traces,
    validate,
)

EOS = [2, 7, 9]
V, T = 10, 5


def _coupled(x, y, tv, **kw):
    kw.setdefault("eos_token_ids", EOS)
    return coupled_dataset(np.asarray(tv, dtype=np.float32), np.asarray(x), np.asarray(y), vocab_size=V, **kw)


# rows: both end on 9 (TV 0 after); x ends on 7, y on 9 (TV 1 after); no EOS
X = [[1, 9, 9, 9, 9], [1, 7, 7, 7, 7], [1, 3, 4, 5, 6]]
Y = [[1, 9, 9, 9, 9], [1, 9, 9, 9, 9], [1, 3, 4, 5, 6]]
TV = [[0.5, 0.5, 0, 0, 0], [0.5, 0.5, 1, 1, 1], [0.3] * 5]


def test_builder_records_the_set_and_its_first() -> None:
    ds = validate(_coupled(X, Y, TV))
    assert ds.attrs["eos_token_id"] == 2 and ds.attrs["eos_token_ids"] == EOS and eos_ids(ds.attrs) == (2, 7, 9)
    one = _coupled(X, Y, TV, eos_token_ids=None, eos_token_id=9)
    assert "eos_token_ids" not in one.attrs and eos_ids(one.attrs) == (9,)      # the old layout
    with pytest.raises(ValueError, match="not one of eos_token_ids"):
        _coupled(X, Y, TV, eos_token_id=5)


def _problems(ds) -> list[str]:
    with pytest.raises(TraceValidationError) as err:
        validate(ds)
    return [str(p) for p in err.value.problems]


def test_every_id_is_absorbing_with_its_own_id() -> None:
    x = [row[:] for row in X]
    x[1][3] = 9                               # ended on 7, then another EOS id
    assert any(p.startswith("x_token: 1 value(s) not EOS after an earlier EOS") for p in _problems(_coupled(x, Y, TV)))
    x[1][3] = 3                               # ended on 7, then a plain token
    assert any(p.startswith("x_token: 1 value(s)") for p in _problems(_coupled(x, Y, TV)))
    tv = [row[:] for row in TV]
    tv[0][3] = 0.2                            # both ended on 9: both laws are its point mass
    assert any(p.startswith("tv: 1 value(s) nonzero after both sides emitted the same EOS")
               for p in _problems(_coupled(X, Y, tv)))
    # with 9 alone, the 7 row is an ordinary token and nothing is wrong either
    validate(_coupled(X, Y, TV, eos_token_ids=None, eos_token_id=9))


def test_attribute_checks() -> None:
    ds = _coupled(X, Y, TV)
    assert any("eos_token_ids': [12] outside" in p for p in _problems(ds.assign_attrs(eos_token_ids=[2, 7, 12])))
    assert any("is not one of eos_token_ids" in p for p in _problems(ds.assign_attrs(eos_token_id=3)))
    assert any("repeats an id" in p for p in _problems(ds.assign_attrs(eos_token_ids=[2, 7, 9, 7])))
    assert any("not a non-empty list of integers" in p for p in _problems(ds.assign_attrs(eos_token_ids=["a"])))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_files_keep_the_set_and_old_files_still_open(tmp_path, suffix: str) -> None:
    back = open_traces(save_traces(_coupled(X, Y, TV), tmp_path / f"multi{suffix}"))
    assert eos_ids(back.attrs) == (2, 7, 9) and back.attrs["eos_token_id"] == 2
    old = _coupled(X, Y, [[0.5, 0.5, 0, 0, 0], [0.5] * 5, [0.3] * 5], eos_token_ids=None, eos_token_id=9)
    back = open_traces(save_traces(old, tmp_path / f"single{suffix}"))
    assert "eos_token_ids" not in back.attrs and eos_ids(back.attrs) == (9,)


def _with_header(lines: list[bytes], header: dict) -> list[bytes]:
    """The stream re-encoded with another header (a fresh digest for the end record)."""
    w = StreamWriter()
    out = [w.line(header)] + [w.line(json.loads(line)) for line in lines[1:-1]]
    end = json.loads(lines[-1])
    return out + [w.end(end["steps"], end["replicates"], end["elapsed_s"])]


def test_wire_round_trip_and_header_checks() -> None:
    ds = _coupled(X, Y, TV)
    lines = dataset_lines(ds, doc=str(ds.doc.values[0]))
    header = json.loads(lines[0])
    assert header["eos_token_ids"] == EOS and header["eos_token_id"] == 2
    back = assemble(lines)
    assert back.attrs["eos_token_ids"] == EOS
    with pytest.raises(StreamError, match="not one of eos_token_ids"):
        assemble(_with_header(lines, {**header, "eos_token_id": 3}))
    # a header from before the list: eos_token_id alone
    old = {k: v for k, v in header.items() if k != "eos_token_ids"}
    lines_old = dataset_lines(_coupled(X, Y, [[0.5, 0.5, 0, 0, 0], [0.5] * 5, [0.3] * 5],
                                       eos_token_ids=None, eos_token_id=9))
    old.update(eos_token_id=9)
    assert eos_ids(assemble(_with_header(lines_old, old)).attrs) == (9,)
    rec = header_record(kind="coupled", horizon=4, window=4, model="m", eos_token_id=None, eos_token_ids=[7, 9],
                        sampling={}, candidate={"policy": "full"}, seed=1, prompt_tokens=3, retained_tokens=3,
                        replicates=1, vocab_size=10)
    assert rec["eos_token_id"] == 7 and rec["eos_token_ids"] == [7, 9]


def test_collector_header_check() -> None:
    params = dict(kind="coupled", replicates=2, max_new_tokens=4, window=4, temperature=1.0, top_k=None,
                  top_p=None, seed=0, reference="full")
    from collector.checks import derive_seed

    header = dict(kind="coupled", replicates=2, horizon=4, window=4, doc="d", candidate={"policy": "full"},
                  reference={"policy": "full"}, sampling={"temperature": 1.0}, seed=derive_seed(0, "d", "full"),
                  prompt_tokens=9, prompt_sha256="0" * 64, eos_token_id=2)
    assert header_problems(header, params, "d", "full") == []                      # older servers: no list
    assert header_problems({**header, "eos_token_ids": EOS}, params, "d", "full") == []
    assert header_problems({**header, "eos_token_ids": [7, 9]}, params, "d", "full") == [
        "eos_token_id is 2, not one of eos_token_ids [7, 9]"]
    assert header_problems({**header, "eos_token_ids": "2"}, params, "d", "full") == [
        "eos_token_ids is '2', not a list of token ids"]


def test_combine_keeps_per_model_sets() -> None:
    a = _coupled(X, Y, TV, model="llama")
    b = _coupled(X, Y, [[0.5, 0.5, 0, 0, 0], [0.5] * 5, [0.3] * 5], eos_token_ids=None, eos_token_id=9,
                 model="other")
    both = combine([a, b], dim="model")
    assert both.eos_token_ids.dims == ("model", "eos")
    assert both.eos_token_ids.values.tolist() == [[2, 7, 9], [9, -1, -1]]
    assert both.attrs["eos_token_id"] == -1 and "eos_token_ids" not in both.attrs
    # row 1 of model "other": 7 is no EOS there, so 7 then 7 is fine and x != y needs TV > 0 (0.5)
    validate(both)
    same = combine([a, a.assign_attrs(model="twin")], dim="model")
    assert same.attrs["eos_token_ids"] == EOS
    with pytest.raises(CombineError, match="EOS ids"):
        combine([a, a.assign_coords(doc=["other"]).assign_attrs(eos_token_ids=[2, 7])], dim="doc")


def test_eval_logs_pad_with_the_id_a_row_ended_on() -> None:
    rows = [json.dumps({"doc": "d", "tokens": t, "logp_full": [-0.5] + [0.0] * (len(t) - 1),
                        "logp_evicted": [-0.7] + [0.0] * (len(t) - 1)}) for t in ([3, 7], [3, 9, 9], [3, 1, 4])]
    ds = from_eval_logs(rows[:2] + [json.dumps({"doc": "d", "tokens": [3, 1, 4], "logp_full": [-0.5] * 3,
                                                "logp_evicted": [-0.7] * 3})], vocab_size=V, eos_token_ids=EOS)
    assert ds.x_token.values[0, 0].tolist() == [[3, 7, 7], [3, 9, 9], [3, 1, 4]]
    assert ds.attrs["eos_token_ids"] == EOS
    bad = json.dumps({"doc": "d", "tokens": [3, 7, 9], "logp_full": [-0.5, 0.0, 0.0],
                      "logp_evicted": [-0.7, 0.0, 0.0]})
    with pytest.raises(ConversionError, match="follows EOS 7"):
        from_eval_logs([bad], vocab_size=V, eos_token_ids=EOS)
    with pytest.raises(ConversionError, match="not one of eos_token_ids"):
        from_eval_logs(rows[:1], vocab_size=V, eos_token_id=5, eos_token_ids=EOS)
