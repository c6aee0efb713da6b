"""kvpress's evaluation output → an ``answers`` dataset whose accuracies are kvpress's own metrics.json.

The fixture (tests/data/kvpress_results, described in tests/data/README.md) is a results tree in
kvpress's layout whose metrics.json files were computed by kvpress's own calculate_metrics.
"""

from __future__ import annotations

import csv as csv_module
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from protocols.converters import ConversionError, from_kvpress_results
from protocols.kvpress_results import KvpressFolder, from_answer_rows, parse_answer_cell, read_kvpress_results
from protocols.leaderboard_scoring import UnscorableError, kvpress_scorer
from protocols.scoring import score
from protocols.validate import validate

TREE = Path(__file__).resolve().parent / "data" / "kvpress_results"


@pytest.fixture(scope="module")
def ds():
    return from_kvpress_results(TREE)


def _folder_scores(ds, path: Path):
    """Each task's scores of one folder's run (P's for the no-press run), in the file's row order."""
    folder = KvpressFolder(path)
    sub = ds.sel(doc=[d for d in ds.doc.values if d.startswith(folder.label + "/")])
    order = np.argsort([int(d.rsplit("/", 1)[1]) for d in sub.doc.values], kind="stable")
    sub = sub.isel(doc=order)
    if folder.press == "no_press":
        scores = sub.x_score.isel(policy=0, replicate=0)
    else:
        scores = sub.y_score.sel(policy=folder.policy_id()).isel(replicate=0)
    return {str(t): scores.values[sub.task.values == t] for t in np.unique(sub.task.values)}


def test_the_tree_converts_to_a_valid_answers_dataset(ds):
    validate(ds)
    assert ds.attrs["kind"] == "answers" and ds.attrs["model"] == "my-org/tiny-llama"
    assert ds.policy.values.tolist() == ["snapkv@0.5", "streaming_llm@0.75"]
    assert ds.retention.values.tolist() == [0.5, 0.75]
    assert ds.sizes == {"doc": 30 + 8 + 6 * 12, "policy": 2, "replicate": 1}
    assert not np.isnan(ds.x_score).any() and not np.isnan(ds.y_score).any()
    # P is the one no-press run: the same score and text under every policy
    assert (ds.x_score.isel(policy=0) == ds.x_score.isel(policy=1)).all()
    assert (ds.x_text.isel(policy=0) == ds.x_text.isel(policy=1)).all()


@pytest.mark.parametrize("folder", sorted(p.name for p in TREE.iterdir()))
def test_accuracies_equal_kvpress_metrics_json(ds, folder):
    path = TREE / folder
    metrics = json.loads((path / "metrics.json").read_text())
    scores = _folder_scores(ds, path)
    means = {t: float(np.mean(v)) for t, v in scores.items()}
    dataset = folder.split("__")[0]
    if dataset == "ruler":       # {task: {"string_match": percent, 2 decimals}}
        assert {t: round(100 * m, 2) for t, m in means.items()} == {t: v["string_match"] for t, v in metrics.items()}
    elif dataset == "longbench":  # one task per folder: a percent, 2 decimals
        (mean,) = means.values()
        assert round(100 * mean, 2) == metrics
    elif dataset == "infinitebench":  # a fraction
        (mean,) = means.values()
        assert math.isclose(mean, metrics, rel_tol=1e-12)
    elif dataset == "needle_in_haystack":  # one ROUGE dict per row: kvdiv's score is ROUGE-L F
        (row_scores,) = scores.values()
        assert row_scores.tolist() == pytest.approx([m["rouge-l"]["f"] for m in metrics], abs=1e-12)
    else:                        # aime25, math500
        (mean,) = means.values()
        assert math.isclose(mean, metrics["accuracy"], rel_tol=1e-12)


def test_rows_keep_both_predictions_and_the_answers(ds):
    rows = read_kvpress_results(TREE)
    row = next(r for r in rows if r["doc"] == "ruler/4096/niah_multivalue/13" and r["policy"] == "snapkv@0.5")
    assert len(row["answers"]) == 4 and row["scorer"] == "ruler_all"
    path = TREE / "ruler__4096__my-org--tiny-llama__snapkv__0.50" / "predictions.csv"
    assert row["source"] == f"{path}:{_start_line(path, 13)}"
    assert ds.y_text.sel(doc=row["doc"], policy="snapkv@0.5").item() == row["prediction"]
    assert ds.x_text.sel(doc=row["doc"], policy="snapkv@0.5").item() == row["reference_prediction"]
    assert json.loads(ds.answers.sel(doc=row["doc"]).item()) == row["answers"]
    assert {r["doc"].split("/")[0] for r in rows} == {"ruler", "longbench", "infinitebench", "aime25", "math500",
                                                      "needle_in_haystack"}
    depths = ds.needle_depth.sel(doc=[f"needle_in_haystack/{i}" for i in range(6)]).values
    assert depths.tolist() == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]   # kvpress's percent as a fraction
    again = from_answer_rows(rows, model="my-org/tiny-llama")   # the plain form gives the same dataset
    assert (again.y_score == ds.y_score).all() and (again.x_score == ds.x_score).all()


def _start_line(path: Path, i: int) -> int:
    """The line row i starts on, found by its (unique, first-column) answer cell: a quoted prediction
    may span lines, so rows and lines differ."""
    with path.open(newline="") as fh:
        cell = list(csv_module.DictReader(fh))[i]["answer"]
    text = path.read_text()
    return text[:text.index("\n" + cell)].count("\n") + 2


def _copy(tmp_path: Path, *names: str) -> Path:
    root = tmp_path / "results"
    for name in names:
        shutil.copytree(TREE / name, root / name)
    return root


RULER = "ruler__4096__my-org--tiny-llama__{}"


def test_a_press_without_a_no_press_run_is_named(tmp_path):
    root = _copy(tmp_path, RULER.format("snapkv__0.50"))
    with pytest.raises(ConversionError, match=r"snapkv__0.50: press 'snapkv' on ruler/4096 has no 'no_press' run"):
        from_kvpress_results(root)


def test_a_folder_without_predictions_is_named(tmp_path):
    root = _copy(tmp_path, RULER.format("no_press__0.00"), RULER.format("snapkv__0.50"))
    (root / RULER.format("snapkv__0.50") / "predictions.csv").unlink()
    with pytest.raises(ConversionError, match=r"snapkv__0.50: a kvpress result folder without predictions.csv"):
        from_kvpress_results(root)


def test_rows_that_do_not_pair_name_the_file_and_line(tmp_path):
    root = _copy(tmp_path, RULER.format("no_press__0.00"), RULER.format("snapkv__0.50"))
    csv = root / RULER.format("snapkv__0.50") / "predictions.csv"
    text = csv.read_text()
    line = _start_line(csv, 2)
    csv.write_text(text.replace("item-niah_single_1-2?", "item-niah_single_1-X?"))
    with pytest.raises(ConversionError, match=rf"snapkv__0.50/predictions.csv: line {line}: column 'question' is "):
        from_kvpress_results(root)
    header, *rows = text.splitlines(keepends=True)
    csv.write_text(header + "".join(rows[:3]))
    with pytest.raises(ConversionError, match=r"predictions.csv: [0-9] rows, but the no_press run .* has 30"):
        from_kvpress_results(root)


def test_a_metric_kvdiv_does_not_compute_is_refused_naming_it():
    with pytest.raises(UnscorableError, match="trec.*classification"):
        kvpress_scorer("longbench", "trec")
    with pytest.raises(UnscorableError, match="loogle"):
        kvpress_scorer("loogle", "shortdep_qa")


def test_answer_cells_as_pandas_writes_them():
    assert parse_answer_cell("['a b' 'c']") == ["a b", "c"]
    assert parse_answer_cell("['it''s' \"x's\"]".replace("''", "\\'")) == ["it's", "x's"]
    assert parse_answer_cell("['first'\n 'second']") == ["first", "second"]
    assert parse_answer_cell("[]") == [] and parse_answer_cell("[1 2]") == ["1", "2"]


def test_leaderboard_scorers_on_hand_worked_rows():
    assert score("boxed_last", "\\boxed{1} no, \\boxed{42}", ["42"]) == 1.0
    assert score("boxed_first", "\\boxed{1} \\boxed{42}", ["42"]) == 0.0
    assert score("boxed_first", "no box", ["no box"]) == 0.0 and score("boxed_last", "42", ["42"]) == 1.0  # AIME: all
    assert score("longbench_count", "3 and 5 and 3", ["3"]) == pytest.approx(2 / 3)
    assert score("longbench_retrieval", "Paragraph 4, or 12", ["Paragraph 4"]) == 0.5
    assert score("first_int", "key: 00123 then 5", ["00123"]) == 1.0 and score("first_int", "none", ["1"]) == 0.0
    assert score("kv_retrieval", '"ab-12".', ["ab-12"]) == 1.0 and score("kv_retrieval", "xab-12", ["ab-12"]) == 0.0
    assert score("choice_letter", "The answer is B", ["B"]) == 1.0 and score("choice_letter", "D", ["A"]) == 0.0
    assert score("f1_first_line", "\n Paris\nand Lyon", ["Paris"]) == 1.0
    # ROUGE-L F by hand: LCS words {a, c, d} of 4 and 4 words -> p = r = 0.75 (the package adds 1e-8)
    assert score("rouge_l", "a b c d", ["a c d e"]) == pytest.approx(2 * 0.75 * 0.75 / (1.5 + 1e-8), abs=1e-15)
    # two reference sentences: the union of their LCS words {a, b} (3 hypothesis, 4 reference words)
    assert score("rouge_l", "a b x", ["a . b y z"]) == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5 + 1e-8))
    assert score("rouge_l", "", ["a"]) == 0.0                      # the package raises: LongBench scores 0
    assert score("code_sim", "# comment\nreturn x", ["return x"]) == 1.0
    assert score("code_sim", "retrun x", ["return x"]) == round(100 * 14 / 16) / 100   # difflib: 7 of 8 match


def test_answer_rows_errors_name_the_line(tmp_path):
    good = {"doc": "d1", "policy": "snapkv@0.5", "prediction": "42", "reference_prediction": "41",
            "answers": ["42"], "scorer": "exact"}
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "policy": "x", "answers": "42"}) + "\n")
    with pytest.raises(ConversionError, match=r"line 2: field 'answers' = '42' is not a list"):
        from_answer_rows(path)
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "policy": "x", "reference_prediction": "40"}))
    with pytest.raises(ConversionError, match=r"line 2: doc 'd1' has field 'reference_prediction'"):
        from_answer_rows(path)
    path.write_text(json.dumps({**good, "scorer": "bleu"}) + "\n")
    with pytest.raises(ConversionError, match=r"line 1: field 'scorer': unknown scorer 'bleu'"):
        from_answer_rows(path)
    path.write_text(json.dumps(good) + "\n")
    one = from_answer_rows(path)
    assert (one.x_score.item(), one.y_score.item()) == (0.0, 1.0)
