"""``kvdiv analyze --out`` and ``divstats.analyze``: outputs never destroy what kvdiv did not write.

Also the descriptive report (no plan) and the shipped plan read as package data.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

import divstats
from divstats.cli.analyze import analyze
from divstats.errors import DivstatsError, OutputError, PlanError
from divstats.report.analysis import compute
from divstats.report.results import load_results
from divstats.report.write import OUTPUT_FILES, is_report_dir, publish_report, write_report
from divstats.truth.studies import PolicyEffect, simulate_study

POLICIES = {"a": PolicyEffect(0.05), "b": PolicyEffect(0.15), "c": PolicyEffect(0.1, growth=0.5)}


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    from protocols import save_traces

    ds = simulate_study(6, POLICIES, horizon=8, replicates=4, kind="coupled", seed=3)
    path = tmp_path_factory.mktemp("traces") / "traces.nc"
    save_traces(ds, path)
    return path


@pytest.fixture(scope="module")
def analysis(traces):
    from protocols import open_traces

    return compute(open_traces(traces), None, n_resamples=99, progress=False)


@pytest.fixture(scope="module")
def cli_report(traces, tmp_path_factory):
    """One ``kvdiv analyze`` run (no plan) and its folder: the report the tests below find in place.

    Copies of it stand for "a report kvdiv wrote earlier" (``is_report_dir`` reads the files,
    not where they were written), so each such test no longer reruns the whole analysis."""
    parent = tmp_path_factory.mktemp("cli_report")
    out = parent / "report"
    return _run(traces, out), out


def _copy_report(cli_report, dest: Path) -> Path:
    import shutil

    shutil.copytree(cli_report[1], dest)
    return dest


def _run(traces: Path, out: Path, *extra: str):
    return CliRunner().invoke(analyze, [str(traces), "--out", str(out), "-q", "--n-resamples", "99", *extra])


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_descriptive_report_without_a_plan(cli_report):
    result, out = cli_report
    assert result.exit_code == 0, result.output
    assert "no plan: descriptive report" in result.stdout
    assert sorted(os.listdir(out)) == sorted(OUTPUT_FILES)       # no temporary left behind
    assert [p.name for p in out.parent.iterdir()] == ["report"]
    html = (out / "report.html").read_text()
    assert "every comparison is exploratory" in html and "Plan results" not in html
    assert "data:image/png;base64," in html
    res = load_results(out / "results.nc")
    assert not [v for v in res.data_vars if str(v).startswith("plan_")]
    assert res.attrs["plan_sha256"] == "" and "no plan" in res.attrs["exploratory"]
    assert set(res["comparison_a"].values) == {"b", "c"}
    assert all(res[v].attrs["status"].startswith("exploratory") for v in res.data_vars)
    assert (out / "summary.md").read_text().startswith("# kvdiv summary: descriptive (no plan)")


def test_aliases_without_a_plan_are_refused(traces, tmp_path):
    result = _run(traces, tmp_path / "out", "--policy-alias", "x=a")
    assert result.exit_code != 0 and "needs --plan" in result.output


def test_existing_output_is_refused_then_replaced_only_with_overwrite(traces, tmp_path, cli_report):
    out = _copy_report(cli_report, tmp_path / "report")
    before = _tree(out)
    refused = _run(traces, out, "--seed", "1")
    assert refused.exit_code != 0 and "--overwrite" in refused.output
    assert _tree(out) == before
    replaced = _run(traces, out, "--seed", "1", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert load_results(out / "results.nc").attrs["option_seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]   # old copy and temporary removed


def test_overwrite_never_replaces_a_folder_kvdiv_did_not_write(traces, tmp_path, cli_report):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    result = _run(traces, precious, "--overwrite")
    assert result.exit_code != 0 and "refusing to replace" in result.output
    assert _tree(precious) == {"notes.txt": b"mine"}
    # A report folder with a foreign file added is not kvdiv's either.
    out = _copy_report(cli_report, tmp_path / "report")
    assert is_report_dir(out)                        # kvdiv's own, until the foreign file below
    (out / "traces.nc").write_bytes(b"keep me")
    assert _run(traces, out, "--overwrite").exit_code != 0
    assert (out / "traces.nc").read_bytes() == b"keep me"
    # Nor a results.nc that kvdiv did not write.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "results.nc").write_bytes(b"not netCDF")
    assert _run(traces, fake, "--overwrite").exit_code != 0
    assert (fake / "results.nc").read_bytes() == b"not netCDF"


def test_never_writes_through_a_symlink(traces, tmp_path, analysis, cli_report):
    target = _copy_report(cli_report, tmp_path / "target")
    assert is_report_dir(target)                     # so --overwrite would replace it were it not a link
    before = _tree(target)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    result = _run(traces, link, "--overwrite", "--seed", "2")
    assert result.exit_code != 0 and "symlink" in result.output
    assert _tree(target) == before and link.is_symlink()
    # The Python entry point refuses a symlinked output file too.
    d = tmp_path / "run"
    d.mkdir()
    victim = tmp_path / "victim.html"
    victim.write_text("precious")
    (d / "report.html").symlink_to(victim)
    with pytest.raises(OutputError, match="symlink"):
        write_report(analysis, d)
    assert victim.read_text() == "precious" and sorted(os.listdir(d)) == ["report.html"]


def test_python_analyze_writes_beside_other_files_and_replaces_only_its_own(traces, analysis, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "traces.nc").write_bytes(b"data")
    write_report(analysis, run)
    write_report(analysis, run)                      # its own files: replaced
    assert sorted(os.listdir(run)) == sorted([*OUTPUT_FILES, "traces.nc"])
    assert (run / "traces.nc").read_bytes() == b"data"
    assert not is_report_dir(run)                    # so the CLI would never replace this folder
    (run / "summary.md").write_text("my own notes")
    with pytest.raises(OutputError, match="not written by kvdiv"):
        write_report(analysis, run)
    assert (run / "summary.md").read_text() == "my own notes"


def test_publish_is_atomic_when_rendering_fails(analysis, tmp_path, monkeypatch):
    out = tmp_path / "report"
    publish_report(analysis, out)
    before = _tree(out)
    import divstats.report.write as R

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(R, "render_markdown", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        publish_report(analysis, out, overwrite=True)
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]


def test_every_divstats_error_shares_one_base():
    assert issubclass(PlanError, DivstatsError) and issubclass(OutputError, DivstatsError)
    assert issubclass(divstats.NotIdentified, PlanError) and issubclass(PlanError, ValueError)
    with pytest.raises(DivstatsError):
        divstats.load_plan("no-such-plan")


def test_the_shipped_plan_is_package_data(tmp_path, monkeypatch):
    import hashlib

    assert "paper" in divstats.shipped_plans()
    shipped = divstats.shipped_plan("paper")
    plan = divstats.load_plan("paper")
    assert plan.source == "paper" and plan.sha256 == hashlib.sha256(shipped.read_bytes()).hexdigest()
    assert Path(str(shipped)).resolve().parent == Path(divstats.__file__).resolve().parent / "shipped_plans"
    # A file named like a shipped plan does not shadow it; ./paper reads the file.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "paper").write_text("not toml [")
    assert divstats.load_plan("paper").sha256 == plan.sha256
    with pytest.raises(PlanError, match="not valid TOML"):
        divstats.load_plan("./paper")
    with pytest.raises(PlanError, match="shipped plans: \\[.*'paper'"):
        divstats.load_plan("papr")
