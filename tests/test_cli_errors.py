"""Every ``kvdiv`` subcommand answers bad input with one line naming the file and the
problem, and a non-zero exit: never a traceback.

Bad inputs are what a user really hands over: a missing path, a file of random bytes,
a netCDF file of something else, a text file, an empty folder, a stream nested
100,000 deep, a half-written manifest, an output that already exists.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from click.testing import CliRunner

from kvdiv.cli import main
from protocols import dataset_lines, save_traces
from protocols.examples import example_dataset

PLAN = Path(__file__).resolve().parents[1] / "plans" / "paper.toml"


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    rng = np.random.default_rng(0)
    files = {
        "missing.nc": None,
        "garbage.nc": rng.bytes(4096),
        "garbage.zarr": None,
        "notes.txt": b"just some notes\n",
        "deep.ndjson": b"[" * 100_000 + b"]" * 100_000 + b"\n",
        "truncated.ndjson": b"".join(dataset_lines(example_dataset(docs=1, policies=1))[:3]),
        "binary.jsonl": b"\xff\xfe\x00garbage\n",
        "deep.jsonl": b'{"id": "a", "text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "noid.jsonl": b'{"text": "no id"}\n',
        "bad.toml": b"this is = = not toml [[[\n",
    }
    paths = {}
    for name, data in files.items():
        paths[name] = d / name
        if data is not None:
            (d / name).write_bytes(data)
    (d / "garbage.zarr").mkdir()
    (d / "garbage.zarr" / "zarr.json").write_text("{not json")
    paths["empty.zarr"] = d / "empty.zarr"
    paths["empty.zarr"].mkdir()
    paths["foreign.nc"] = d / "foreign.nc"
    xr.Dataset({"temperature": ("x", np.arange(3.0))}).to_netcdf(paths["foreign.nc"], engine="h5netcdf")
    paths["traces.nc"] = save_traces(example_dataset(docs=4, policies=2), d / "traces.nc")
    paths["folder"] = d / "folder"
    paths["folder"].mkdir()
    (paths["folder"] / "precious.txt").write_text("mine")
    run = d / "run"
    (run / "requests").mkdir(parents=True)
    (run / "manifest.json").write_text('{"format": "kvdiv.collection/1", "par')
    (run / "documents.jsonl").write_text(json.dumps({"id": "a", "text": "t"}) + "\n")
    paths["run"] = run
    return paths


def _run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    text = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"kvdiv {' '.join(map(str, args))} raised {result.exception!r}:\n{text}")
    assert "Traceback" not in text, text
    return result.exit_code, text


def _case(args: list[str], names: str) -> None:
    code, text = _run(args)
    assert code != 0, f"kvdiv {' '.join(map(str, args))} exited 0:\n{text}"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert lines and names in text, f"expected {names!r} named in:\n{text}"


TRACE_INPUTS = ["missing.nc", "garbage.nc", "garbage.zarr", "empty.zarr", "foreign.nc", "notes.txt",
                "deep.ndjson", "truncated.ndjson"]


@pytest.mark.parametrize("command", ["validate", "info"])
@pytest.mark.parametrize("name", TRACE_INPUTS)
def test_validate_and_info(command: str, name: str, bad: dict[str, Path]) -> None:
    _case([command, bad[name]], name)


@pytest.mark.parametrize("name", ["missing.nc", "garbage.nc", "garbage.zarr", "empty.zarr", "foreign.nc",
                                  "notes.txt"])
def test_analyze_traces(name: str, bad: dict[str, Path], tmp_path: Path) -> None:
    _case(["analyze", bad[name], "--plan", PLAN, "--out", tmp_path / "out", "-q"], name)


def test_analyze_plan_and_out(bad: dict[str, Path], tmp_path: Path) -> None:
    _case(["analyze", bad["traces.nc"], "--plan", bad["bad.toml"], "--out", tmp_path / "out", "-q"], "bad.toml")
    _case(["analyze", bad["traces.nc"], "--plan", PLAN, "--out", bad["notes.txt"], "-q"], "notes.txt")


@pytest.mark.parametrize("name", ["missing.nc", "garbage.nc", "foreign.nc", "binary.jsonl", "deep.jsonl",
                                  "noid.jsonl", "notes.txt"])
def test_split(name: str, bad: dict[str, Path]) -> None:
    _case(["split", bad[name], "--plan", PLAN], name)


def test_split_plan(bad: dict[str, Path]) -> None:
    _case(["split", bad["traces.nc"], "--plan", bad["bad.toml"]], "bad.toml")


COLLECT = ["--server", "http://127.0.0.1:9", "--policies", "snapkv@0.5", "--seed", "1", "--no-progress",
           "--max-attempts", "1"]


@pytest.mark.parametrize("name", ["missing.nc", "binary.jsonl", "deep.jsonl", "noid.jsonl", "notes.txt"])
def test_collect_documents(name: str, bad: dict[str, Path], tmp_path: Path) -> None:
    _case(["collect", *COLLECT, "--docs", bad[name], "--out", tmp_path / "run"], name)


def test_collect_out_and_options(bad: dict[str, Path], tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": "a", "text": "t"}) + "\n")
    _case(["collect", *COLLECT, "--docs", docs, "--out", bad["run"]], "manifest.json")
    _case(["collect", *COLLECT, "--docs", docs, "--out", bad["folder"]], "folder")
    _case(["collect", *COLLECT, "--docs", docs, "--out", bad["notes.txt"]], "notes.txt")
    _case(["collect", *COLLECT, "--docs", docs, "--out", tmp_path / "r", "-T", "4", "-W", "9"], "--window")
    assert (bad["folder"] / "precious.txt").read_text() == "mine"


def test_pack(bad: dict[str, Path], tmp_path: Path) -> None:
    _case(["pack", bad["run"], "-o", tmp_path / "t.nc"], "manifest.json")
    _case(["pack", bad["folder"], "-o", tmp_path / "t.nc"], "folder")
    _case(["pack", bad["missing.nc"], "-o", tmp_path / "t.nc"], "missing.nc")
    _case(["pack", bad["run"], "-o", bad["notes.txt"]], "notes.txt")
    _case(["pack", bad["run"], "-o", bad["traces.nc"]], "traces.nc")
    assert (bad["folder"] / "precious.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["missing.nc", "binary.jsonl", "deep.jsonl", "noid.jsonl", "empty.zarr"])
def test_docs(name: str, bad: dict[str, Path], tmp_path: Path) -> None:
    _case(["docs", "--source", bad[name], "-o", tmp_path / "d.jsonl", "--tokenizer", "approx"], name)


def test_docs_output(bad: dict[str, Path]) -> None:
    _case(["docs", "--source", "pydoc", "-o", bad["notes.txt"] / "d.jsonl", "--tokenizer", "approx",
           "--count", "2"], "notes.txt")


def test_wrong_options_are_usage_errors(bad: dict[str, Path]) -> None:
    for args in (["validate"], ["info", "--nope"], ["analyze", bad["traces.nc"]], ["split"], ["collect"],
                 ["pack"], ["docs"], ["demo", "--docs-count", "1"], ["nonsense"]):
        code, text = _run(args)
        assert code == 2 and "Error" in text, (args, text)
