"""Task answers in the contract: the scorers against the benchmarks' definitions, the answer
variables and the ``answers`` kind, their validation rules, files, and ``kvdiv validate`` / ``info``."""

from __future__ import annotations

import json
import math
import re
import string
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

from protocols import TraceValidationError, answer_variables, answers_dataset, validate
from protocols.cli import info as info_cmd
from protocols.cli import validate as validate_cmd
from protocols.examples import example_dataset
from protocols.io import open_traces, save_traces
from protocols.scoring import (
    SCORERS,
    UnknownScorerError,
    answer_span,
    get_scorer,
    parse_answers,
    score,
    scorer_names,
)

# ----------------------------------------------------------------------------- oracles
# Written from the benchmarks' published definitions, independently of protocols.scoring:
# RULER (scripts/eval/synthetic/constants.py) as kvpress applies it
# (evaluation/benchmarks/ruler/calculate_metrics.py), and SQuAD v1.1's evaluate script.


def kvpress_ruler(preds: list[str], refs: list[list[str]], part: bool) -> float:
    """kvpress's per-task RULER metric: 100 x mean over rows, rounded to 2 places."""
    cleaned = [re.sub(r"[\x00-\x1f]", "", p.strip()).strip() for p in preds]
    rows = []
    for pred, ref in zip(cleaned, refs, strict=True):
        hits = [float(r.lower() in pred.lower()) for r in ref]
        rows.append(max(hits) if part else sum(hits) / len(ref))
    return round(100 * sum(rows) / len(rows), 2)


def squad_normalize(s: str) -> str:
    s = s.lower()
    s = "".join(c for c in s if c not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def squad_f1(pred: str, gold: str) -> float:
    p, g = squad_normalize(pred).split(), squad_normalize(gold).split()
    common = Counter(p) & Counter(g)
    n = sum(common.values())
    if n == 0:
        return 0.0
    prec, rec = n / len(p), n / len(g)
    return 2 * prec * rec / (prec + rec)


RULER_CASES = [
    ("The special magic number is 48213.", ["48213"]),
    ("  \n48213\n", ["48213"]),
    ("keys: 111, 222", ["111", "222", "333"]),
    ("NOTHING here", ["abc", "Nothing"]),
    ("4821\n3", ["48213"]),                 # a control character inside: kvpress drops it, so it matches
    ("", ["1"]),
    ("VAR X1 = VAR Y2", ["x1", "y2", "z3", "w4"]),
]


@pytest.mark.parametrize("part", [False, True])
def test_ruler_scores_equal_kvpress_metric(part):
    name = "ruler_part" if part else "ruler_all"
    mine = [score(name, p, r) for p, r in RULER_CASES]
    preds, refs = [p for p, _ in RULER_CASES], [r for _, r in RULER_CASES]
    assert round(100 * sum(mine) / len(mine), 2) == kvpress_ruler(preds, refs, part)
    for pred, ref in RULER_CASES:   # and row by row
        assert round(100 * score(name, pred, ref), 2) == kvpress_ruler([pred], [ref], part)


def test_ruler_values():
    assert score("ruler_all", "keys: 111, 222", ["111", "222", "333"]) == pytest.approx(2 / 3)
    assert score("ruler_part", "keys: 111, 222", ["111", "222", "333"]) == 1.0
    assert score("ruler_all", "4821\n3", ["48213"]) == 1.0   # kvpress removes the newline


SQUAD_CASES = [
    ("The Eiffel Tower!", ["eiffel tower"]),
    ("It is in Paris, France.", ["Paris", "Lyon"]),
    ("an apple a day", ["apple day"]),
    ("", ["x"]),
    ("42", ["forty two", "42"]),
    ("the the the", ["cat"]),
]


@pytest.mark.parametrize(("pred", "golds"), SQUAD_CASES)
def test_exact_and_f1_equal_squad(pred, golds):
    assert score("exact", pred, golds) == max(float(squad_normalize(pred) == squad_normalize(g)) for g in golds)
    assert score("f1", pred, golds) == pytest.approx(max(squad_f1(pred, g) for g in golds))


def test_f1_partial_overlap():
    # 2 of 3 predicted words match 2 of 2 gold words: precision 2/3, recall 1
    assert score("f1", "Paris France capital", ["paris france"]) == pytest.approx(0.8)


def test_contains_is_whole_words():
    assert score("contains", "The answer is Paris, France.", ["paris"]) == 1.0
    assert score("contains", "Parisian cafes", ["paris"]) == 0.0
    assert score("ruler_part", "Parisian cafes", ["paris"]) == 1.0   # substring match differs


@pytest.mark.parametrize(("out", "answers", "want"), [
    ("The pass key is 48213.", ["48213"], 1.0),
    ("48213 and 99999", ["99999"], 0.0),        # the first number only
    ("It costs 1,024 units", ["1024"], 1.0),
    ("x = -3.50", ["-3.5"], 1.0),
    ("no digits", ["1"], 0.0),
    ("7", ["seven"], 0.0),
])
def test_number(out, answers, want):
    assert score("number", out, answers) == want


def test_scores_lie_in_unit_interval_and_binary_flag():
    rng = np.random.default_rng(0)
    words = ["a", "the", "48213", "Paris", "x1", "1,000", "!", "\n"]
    for _ in range(200):
        out = " ".join(rng.choice(words, size=rng.integers(0, 6)))
        ans = list(rng.choice(words, size=rng.integers(1, 3)))
        for s in SCORERS:
            v = score(s.name, out, ans)
            assert 0.0 <= v <= 1.0
            if s.binary:
                assert v in (0.0, 1.0)


def test_no_answers_is_nan_and_unknown_scorer_names_the_known():
    assert math.isnan(score("exact", "x", []))
    with pytest.raises(UnknownScorerError, match="unknown scorer 'rouge9'.*ruler_all"):
        get_scorer("rouge9")
    assert scorer_names()[:6] == ["ruler_all", "ruler_part", "exact", "contains", "f1", "number"]


def test_entry_point_scorers(monkeypatch):
    from importlib.metadata import EntryPoint

    import protocols.scoring as scoring

    eps = [EntryPoint("halfway", "tests.test_protocols_answers:halfway_scorer", "kvdiv.scorers"),
           EntryPoint("broken", "no_such_module_xyz:f", "kvdiv.scorers"),
           EntryPoint("exact", "tests.test_protocols_answers:halfway_scorer", "kvdiv.scorers")]
    monkeypatch.setattr(scoring, "entry_points", lambda group: eps if group == scoring.ENTRY_POINT_GROUP else [])
    scoring._plugins.cache_clear()
    try:
        assert score("halfway", "anything", ["x"]) == 0.5
        assert "halfway" in scorer_names() and "broken" not in scorer_names()
        assert score("exact", "x", ["x"]) == 1.0          # a plugin cannot replace a built-in
        assert get_scorer("halfway").description == "Half a point for anything."
    finally:
        scoring._plugins.cache_clear()


def halfway_scorer(output, answers):
    """Half a point for anything."""
    return 0.5


def test_plugin_score_outside_unit_interval_is_refused(monkeypatch):
    import protocols.scoring as scoring

    monkeypatch.setattr(scoring, "_plugins", lambda: {"bad": scoring.Scorer("bad", lambda o, a: 1.5, "bad")})
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        score("bad", "x", ["x"])


def test_parse_answers_and_span():
    assert parse_answers('["a", "b"]') == ["a", "b"]
    for bad in ("[1]", "not json", '{"a": 1}', '"a"'):
        with pytest.raises(ValueError):
            parse_answers(bad)
    assert answer_span("Key: ABC then abc", ["abc"]) == 5
    assert answer_span("xyz", ["abc", ""]) == -1


# ----------------------------------------------------------------------------- the contract


def scored_coupled():
    ds = example_dataset(docs=2, policies=2, replicates=3, horizon=6)
    shape = (2, 2, 3)
    x = np.ones(shape)
    y = np.where(np.arange(3) == 1, 0.0, 1.0) * np.ones(shape)
    return ds.assign(answer_variables(*shape, x_score=x, y_score=y, x_text=np.full(shape, "48213", dtype=object),
                                      y_text=np.full(shape, "", dtype=object), x_answer_start=np.zeros(shape, int),
                                      answers=[["48213"], ["11"]], scorer="ruler_all", task="passkey",
                                      needle_depth=[0.0, 1.0]))


def answers_base():
    return answers_dataset([[1.0, 0.0], [np.nan, 1.0]], [[0.0, 0.0], [np.nan, 1.0]], docs=["q1", "q2"],
                           policies=["snapkv@0.5", "recent@0.5"], answers=[["4711"], ["x"]], scorer="ruler_all",
                           x_text=[[["4711"], ["no"]], [[""], ["x"]]], model="m", producer="test")


def test_valid_datasets_pass():
    validate(scored_coupled())
    validate(answers_base())


def test_answers_kind_needs_only_its_attrs_and_scores():
    ds = answers_base()
    assert set(ds.attrs) == {"schema", "kind", "model", "producer"}
    with pytest.raises(TraceValidationError) as err:
        validate(ds.drop_vars("y_score").assign_attrs(model=3))
    text = str(err.value)
    assert "variable 'y_score' is missing (required for kind 'answers')" in text
    assert "attribute 'model' = 3 is not a string" in text
    assert "horizon" not in text


def test_every_answer_problem_is_reported_at_once():
    ds = scored_coupled()
    bad = ds.assign(
        x_score=ds.x_score.where(ds.replicate != 0, 1.5),
        y_score=ds.y_score.where(ds.replicate != 1, -np.inf),
        needle_depth=ds.needle_depth + 1.0,
        x_answer_start=ds.x_answer_start.where(ds.replicate != 2, 6),
        answers=ds.answers.copy(data=np.array(['["ok"]', "[3]"], dtype=object)),
    )
    with pytest.raises(TraceValidationError) as err:
        validate(bad)
    problems = err.value.problems
    assert len(problems) == 5
    assert problems[-5:] == [
        "x_score: 4 value(s) outside [0, 1] (NaN = not scored), "
        "e.g. x_score[doc='doc000', policy='snapkv@0.5', replicate=0] = 1.5",
        "y_score: 4 value(s) outside [0, 1] (NaN = not scored), "
        "e.g. y_score[doc='doc000', policy='snapkv@0.5', replicate=1] = -inf",
        "needle_depth: 1 value(s) outside [0, 1] (NaN = no needle), e.g. needle_depth[doc='doc001'] = 2",
        "x_answer_start: 4 value(s) outside -1..5 (a step index, -1 = not located), "
        "e.g. x_answer_start[doc='doc000', policy='snapkv@0.5', replicate=2] = 6",
        "answers: 1 value(s) not a JSON list of strings, e.g. answers[doc='doc001'] = '[3]'",
    ]


def test_dims_dtypes_and_empty_answers():
    ds = answers_base()
    bad = ds.assign(x_text=(("doc", "policy"), np.full((2, 2), "a", dtype=object)),
                    scorer=("doc", np.array([1, 2])), needle_depth=("doc", np.array([0.5, 0.5], dtype=np.float32)),
                    answers=ds.answers.copy(data=np.array(["[]", '["x"]'], dtype=object)))
    with pytest.raises(TraceValidationError) as err:
        validate(bad)
    text = "\n".join(err.value.problems)
    assert "variable 'x_text' has dims ('doc', 'policy'), expected ('doc', 'policy', 'replicate')" in text
    assert "variable 'scorer' has dtype int64, expected strings (object or unicode)" in text
    assert "variable 'needle_depth' has dtype float32, expected float64" in text
    assert ("x_score: 2 value(s) scored where the document's answers are [] (nothing to score against: NaN), "
            "e.g. x_score[doc='q1', policy='snapkv@0.5', replicate=0] = 1") in text


def test_non_string_in_a_text_variable():
    ds = answers_base()
    texts = ds.x_text.values.copy()
    texts[1, 1, 0] = None
    with pytest.raises(TraceValidationError, match="x_text: 1 value\\(s\\) not a string"):
        validate(ds.assign(x_text=ds.x_text.copy(data=texts)))


def test_answer_variables_shapes_are_checked():
    with pytest.raises(ValueError, match="x_score: expected shape \\(1, 1, 2\\)"):
        answer_variables(1, 1, 2, x_score=np.zeros((1, 2)))
    with pytest.raises(ValueError, match="x_score, y_score"):
        answers_dataset(np.zeros((2, 2)), np.zeros((2, 3)))


@pytest.mark.parametrize("suffix", [".nc", ".zarr"])
def test_files_round_trip(tmp_path, suffix):
    for ds in (scored_coupled(), answers_base()):
        path = save_traces(ds, tmp_path / f"{ds.attrs['kind']}{suffix}")
        back = open_traces(path)
        for name in ("x_score", "y_score", "x_text", "answers", "scorer"):
            assert back[name].dims == ds[name].dims
            np.testing.assert_array_equal(back[name].values, ds[name].values)
        assert back.x_score.dtype == np.float64
        assert json.loads(str(back.answers.values[0])) == json.loads(str(ds.answers.values[0]))


def test_cli_validate_and_info_read_an_answers_file(tmp_path):
    path = save_traces(answers_base(), tmp_path / "a.nc")
    out = CliRunner().invoke(validate_cmd, [str(path)])
    assert out.exit_code == 0 and out.output.strip() == "ok: answers, 2 docs × 2 policies × 1 replicates (a.nc)"
    out = CliRunner().invoke(info_cmd, [str(path)])
    assert out.exit_code == 0
    assert "answers (task scores without tokens)" in out.output
    assert "scorer ruler_all; mean score P 0.667, Q 0.333" in out.output
    assert "horizon" not in out.output and out.output.splitlines()[-1].endswith("yes")
