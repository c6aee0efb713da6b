"""``kvdiv convert`` on each input kind, its one-line errors, and the pointer to it from validate/info/analyze."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import protocols
from kvdiv.cli import main
from protocols.converters import from_eval_logs, from_kvpress_results

DATA = Path(__file__).resolve().parent / "data"
EVAL_ROWS = [
    {"doc": "q1", "tokens": [5, 9, 2], "logp_full": [-0.3, -1.2, -0.1], "logp_evicted": [-0.3, -2.0, -0.2]},
    {"doc": "q2", "tokens": [4, 4, 4, 4], "logp_full": [-0.2] * 4, "logp_evicted": [-0.25, -0.2, -0.1, -0.3]},
]


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_line_error(res, *parts: str) -> str:
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)   # no traceback
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


def test_convert_an_evaluation_log(tmp_path):
    src = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    out = tmp_path / "eval.nc"
    res = _run("convert", src, "-o", out, "--vocab-size", 10, "--eos-token-id", 2, "--policy", "snapkv@0.5")
    assert res.exit_code == 0, res.output
    assert "ok: wrote" in res.output
    assert "reference, 2 docs × 1 policies × 1 replicates × T=4 (from eval-log)" in res.output
    expected = from_eval_logs(src, vocab_size=10, eos_token_ids=[2], policy="snapkv@0.5")
    ds = protocols.open_traces(out)
    assert (ds.x_logq == expected.x_logq).all() and ds.policy.values.tolist() == ["snapkv@0.5"]
    assert _run("validate", out).exit_code == 0


def test_convert_openai_format_responses(tmp_path):
    out = tmp_path / "oa.nc"
    res = _run("convert", DATA / "openai_logprobs_smollm2.json", "-o", out)
    assert res.exit_code == 0, res.output
    assert "reference, 2 docs × 2 policies × 2 replicates × T=24 (from openai)" in res.output
    ds = protocols.open_traces(out)
    assert ds.policy.values.tolist() == ["snapkv@0.5", "recent@0.5"] and ds.attrs["vocab_size"] == 49157


def test_convert_kvpress_results_and_their_answer_rows(tmp_path):
    out, rows = tmp_path / "kvp.nc", tmp_path / "kvp.jsonl"
    res = _run("convert", DATA / "kvpress_results", "-o", out, "--jsonl", rows)
    assert res.exit_code == 0, res.output
    assert "answers, 110 docs × 2 policies × 1 replicates (from kvpress)" in res.output
    ds = protocols.open_traces(out)
    expected = from_kvpress_results(DATA / "kvpress_results")
    assert (ds.y_score == expected.y_score).all() and (ds.x_score == expected.x_score).all()
    first = json.loads(rows.read_text().splitlines()[0])
    assert {"doc", "policy", "prediction", "answers", "reference_prediction", "scorer"} <= set(first)
    res = _run("convert", rows, "-o", tmp_path / "again.nc")      # the plain form converts to the same scores
    assert res.exit_code == 0 and "(from answers)" in res.output, res.output
    assert (protocols.open_traces(tmp_path / "again.nc").y_score == ds.y_score).all()


def test_bad_evaluation_log_row_is_one_line_naming_file_line_and_field(tmp_path):
    rows = [EVAL_ROWS[0], {**EVAL_ROWS[1], "logp_full": [-0.2, 0.7, -0.2, -0.2]}]
    src = _jsonl(tmp_path / "bad_eval.jsonl", rows)
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.nc", "--vocab-size", 10),
                    "bad_eval.jsonl: line 2: logp_full[1] = 0.7 is > 0")
    assert not (tmp_path / "x.nc").exists()


def test_bad_openai_response_is_one_line_naming_the_response(tmp_path):
    bundle = json.loads((DATA / "openai_logprobs_smollm2.json").read_text())
    del bundle["samples"]["tea"][1]["choices"][0]["logprobs"]
    src = tmp_path / "bad_openai.json"
    src.write_text(json.dumps(bundle))
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.nc"),
                    "bad_openai.json: samples['tea'][1]: no logprobs.content")


def test_kvpress_press_without_a_no_press_run_is_one_line(tmp_path):
    name = "ruler__4096__my-org--tiny-llama__snapkv__0.50"
    shutil.copytree(DATA / "kvpress_results" / name, tmp_path / "results" / name)
    _one_line_error(_run("convert", tmp_path / "results", "-o", tmp_path / "x.nc"),
                    f"{name}: press 'snapkv' on ruler/4096 has no 'no_press' run")


def test_answer_row_missing_a_field_is_one_line(tmp_path):
    good = {"doc": "d", "policy": "p", "prediction": "1", "reference_prediction": "1", "answers": ["1"],
            "scorer": "exact"}
    src = _jsonl(tmp_path / "bad_answers.jsonl", [good, {k: v for k, v in good.items() if k != "answers"}])
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.nc"), "bad_answers.jsonl: line 2: missing field 'answers'")


@pytest.mark.parametrize("text, parts", [
    ("not json\n", ["bad.jsonl: line 1: not valid JSON"]),
    ('{"hello": 1}\n', ["bad.jsonl: line 1: neither an evaluation-log row", "--from"]),
    ('{"doc": "q", "tokens": [1]}\n', ["bad.jsonl: line 1: missing field(s) ['logp_full', 'logp_evicted']"]),
])
def test_other_bad_inputs_are_one_line(tmp_path, text, parts):
    src = tmp_path / "bad.jsonl"
    src.write_text(text)
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.nc", "--vocab-size", 4), *parts)


def test_eval_log_without_vocab_size_and_a_bad_output_suffix(tmp_path):
    src = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.nc"), "eval.jsonl: an evaluation log needs --vocab-size")
    _one_line_error(_run("convert", src, "-o", tmp_path / "x.csv", "--vocab-size", 10), "must end in .nc or .zarr")


@pytest.mark.parametrize("command", ["validate", "info"])
def test_validate_and_info_on_a_jsonl_point_at_convert(tmp_path, command):
    src = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    res = _run(command, src)
    assert res.exit_code == 1
    assert "eval.jsonl: not a trace file (.nc or .zarr)" in res.output and "`kvdiv convert " in res.output
    assert "unknown extension" not in res.output


def test_opening_a_jsonl_as_traces_points_at_convert(tmp_path):
    src = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    with pytest.raises(ValueError, match=r"not a trace file .* `kvdiv convert .*eval.jsonl -o eval.nc`"):
        protocols.open_traces(src)


def test_analyze_on_a_jsonl_points_at_convert(tmp_path):
    src = _jsonl(tmp_path / "eval.jsonl", EVAL_ROWS)
    res = _run("analyze", src, "--out", tmp_path / "report", "-q")
    assert res.exit_code != 0 and "`kvdiv convert " in res.output and "Traceback" not in res.output
    assert not (tmp_path / "report").exists()
