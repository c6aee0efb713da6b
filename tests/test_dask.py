"""divstats on dask-backed traces: every entry point equals its in-memory result, chunk by chunk."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr

import divstats as D
from divstats.plans.run import run_plan
from divstats.traces.chunked import map_docs_many
from divstats.truth.studies import PolicyEffect, simulate_study
from protocols import open_traces, save_traces
from protocols.chunks import dask_client, doc_chunks, doc_slices, is_lazy

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "plans" / "paper.toml"
POLICIES = {"snapkv@0.5": PolicyEffect(0.04), "snapkv#512": PolicyEffect(0.12),
            "recent@0.5": PolicyEffect(0.12), "snapkv@0.9": PolicyEffect(0.03, growth=1.0)}
TOL = dict(rtol=1e-12, atol=1e-12)


def same(a: xr.Dataset, b: xr.Dataset) -> None:
    """Equal values (to 1e-12), coordinates, variable attrs and global attrs."""
    assert not is_lazy(b), "the chunked result should be in memory"
    xr.testing.assert_allclose(a, b, **TOL)
    assert list(a.data_vars) == list(b.data_vars)
    assert a.attrs == b.attrs
    for name in a.data_vars:
        assert a[name].attrs == b[name].attrs, name


@pytest.fixture(scope="module")
def study_paths(tmp_path_factory):
    """kind -> the Zarr store of that kind's study, simulated once per module (the cluster test reuses it)."""
    paths: dict[str, Path] = {}

    def path_of(kind: str) -> Path:
        if kind not in paths:
            ds = simulate_study(11, POLICIES, horizon=36, replicates=6, kind=kind, seed=3)
            paths[kind] = tmp_path_factory.mktemp("dask") / "traces.zarr"
            save_traces(ds, paths[kind])
        return paths[kind]

    return path_of


@pytest.fixture(scope="module")
def report_in_memory():
    """kind -> the paper plan's results computed in memory (n_resamples 199), computed once per module."""
    from divstats.report.analysis import compute
    from divstats.report.results import results_dataset

    done: dict[str, xr.Dataset] = {}

    def of(kind: str, mem: xr.Dataset) -> xr.Dataset:
        if kind not in done:
            done[kind] = results_dataset(compute(mem, PAPER, n_resamples=199, progress=False))
        return done[kind]

    return of


@pytest.fixture(scope="module", params=["residual", "coupled"])
def traces(request, study_paths):
    """(in memory, lazy from Zarr in 4 chunks of 3/3/3/2 documents)."""
    path = study_paths(request.param)
    mem = open_traces(path)
    lazy = open_traces(path, chunks=3)
    assert is_lazy(lazy) and len(doc_slices(lazy)) == 4
    return mem, lazy


@pytest.mark.parametrize("call", [
    lambda ds: D.estimate(ds),
    lambda ds: D.estimate(ds, window=5),
    lambda ds: D.branch_tv(ds, window=5),
    lambda ds: D.survival(ds),
    lambda ds: D.branch_tv(ds),
    lambda ds: D.branch_tv_window(ds, 2, 9),
    lambda ds: D.sharp_interval(ds),
    lambda ds: D.sharp_interval(ds, window=3),
    lambda ds: D.interval_by_window(ds, [0, 4, 20]),
], ids=["estimate", "estimate-W5", "branch_tv-W5", "survival", "branch_tv", "branch_tv_window", "sharp_interval",
        "sharp_interval-W3", "interval_by_window"])
def test_per_document_estimators_equal_in_memory(traces, call):
    mem, lazy = traces
    same(call(mem), call(lazy))


def test_aggregate_of_lazy_estimates(traces):
    mem, lazy = traces
    est = D.estimate(mem)
    same(D.aggregate(est), D.aggregate(D.estimate(lazy)))
    same(D.aggregate(est), D.aggregate(est.chunk(doc=2)))   # dask-backed estimates are reduced too


def test_variance_check_equal_in_memory(traces):
    mem, lazy = traces
    if mem.attrs["kind"] != "residual":
        pytest.skip("variance_check needs residual traces")
    same(D.variance_check(mem), D.variance_check(lazy))


def test_decompose_equal_in_memory(traces):
    mem, lazy = traces
    a, b = D.decompose(mem, "snapkv@0.5", "snapkv#512"), D.decompose(lazy, "snapkv@0.5", "snapkv#512")
    for name in ("gap", "first", "exposure", "rate"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), **TOL)
    c = D.decompose(D.estimate(mem).chunk(doc=4), "snapkv@0.5", "snapkv#512")   # dask-backed estimates
    np.testing.assert_allclose(a.gap, c.gap, **TOL)
    ca = a.confidence_interval(0.9, n_resamples=199, seed=1)
    cb = b.confidence_interval(0.9, n_resamples=199, seed=1)
    np.testing.assert_allclose(np.array(ca.low), np.array(cb.low), **TOL)
    np.testing.assert_allclose(np.array(ca.high), np.array(cb.high), **TOL)


def test_run_plan_equal_in_memory(traces):
    mem, lazy = traces
    a = run_plan(mem, PAPER, n_resamples=199, seed=4).table
    b = run_plan(lazy, PAPER, n_resamples=199, seed=4).table
    num = a.select_dtypes("number").columns
    np.testing.assert_allclose(a[num].to_numpy(float), b[num].to_numpy(float), **TOL)
    assert a.drop(columns=num).equals(b.drop(columns=num))


def test_report_results_equal_in_memory(traces, report_in_memory):
    from divstats.report.analysis import compute
    from divstats.report.results import results_dataset

    mem, lazy = traces
    a = report_in_memory(mem.attrs["kind"], mem)
    b = results_dataset(compute(lazy, PAPER, n_resamples=199, progress=False))
    xr.testing.assert_allclose(a, b, **TOL)


def test_report_reads_each_chunk_once(traces, monkeypatch):
    from divstats.report.analysis import compute
    from protocols.chunks import DocChunk

    _, lazy = traces
    reads = []
    load = DocChunk.load
    monkeypatch.setattr(DocChunk, "load", lambda self: reads.append(self.start) or load(self))
    compute(lazy, PAPER, n_resamples=99, progress=False)
    assert sorted(reads) == [0, 3, 6, 9]


def test_report_notes_a_skipped_variance_check_as_in_memory(tmp_path):
    from divstats.report.analysis import compute
    from divstats.report.results import results_dataset

    ds = simulate_study(5, POLICIES, horizon=12, replicates=4, kind="residual", window=3, seed=1)
    save_traces(ds, tmp_path / "t.zarr")
    mem, lazy = open_traces(tmp_path / "t.zarr"), open_traces(tmp_path / "t.zarr", chunks=2)
    a = compute(mem, n_resamples=99, progress=False)
    b = compute(lazy, n_resamples=99, progress=False)
    assert a.variance is None and b.variance is None
    assert any(n.startswith("Variance check skipped") for n in a.notes) and a.notes == b.notes
    xr.testing.assert_allclose(results_dataset(a), results_dataset(b), **TOL)


def test_one_pass_for_several_estimators(traces):
    mem, lazy = traces
    out = map_docs_many({"est": (D.estimate, {}), "si": (D.sharp_interval, {"window": 2})}, lazy)
    same(D.estimate(mem), out["est"])
    same(D.sharp_interval(mem, window=2), out["si"])


@pytest.mark.parametrize("fn", [D.estimate, D.branch_tv, D.survival, D.sharp_interval])
def test_concat_docs_is_xarray_concat(traces, fn):
    from divstats.traces.chunked import concat_docs

    mem, _ = traces
    parts = [fn(mem.isel(doc=sl)) for sl in (slice(0, 4), slice(4, 5), slice(5, 11))]
    ref = xr.concat(parts, dim="doc", data_vars="minimal", coords="minimal", compat="override", join="exact",
                    combine_attrs="override")
    out = concat_docs(parts)
    xr.testing.assert_identical(out.drop_attrs(), ref.drop_attrs())
    assert list(out.variables) == list(ref.variables)
    for name, var in out.variables.items():
        assert var.dtype == ref[name].dtype, name


def test_concat_docs_refuses_parts_that_differ():
    from divstats.traces.chunked import concat_docs

    a = xr.Dataset({"x": (("doc", "age"), [[1.0, 2.0]])}, coords={"doc": ["a"], "age": [0, 1]})
    b = xr.Dataset({"x": (("doc", "age"), [[3.0, 4.0]])}, coords={"doc": ["b"], "age": [0, 2]})
    with pytest.raises(ValueError, match="differ along 'age'"):
        concat_docs([a, b])
    with pytest.raises(ValueError, match="differ in their variables"):
        concat_docs([a, a.assign(y=a["x"])])


def test_a_task_reads_its_own_chunk(traces):
    import dask

    _, lazy = traces
    chunk = doc_chunks(lazy)[1]
    task = dask.delayed(lambda c: c.load())(chunk)
    assert len(task.dask) == 1          # no separate read tasks whose results would travel between workers
    part = task.compute()
    assert not is_lazy(part) and part.sizes["doc"] == 3 and chunk.start == 3


def test_chunks_must_hold_whole_documents(traces):
    _, lazy = traces
    with pytest.raises(ValueError, match="chunked along 'replicate'"):
        D.estimate(lazy.chunk(doc=3, replicate=2))
    with pytest.raises(ValueError, match="along 'doc' only"):
        D.estimate(xr.merge([lazy["shared_tv" if "shared_tv" in lazy else "tv"].chunk(doc=2),
                             lazy.drop_vars(["shared_tv", "tv"], errors="ignore")],
                            compat="override").assign_attrs(lazy.attrs))


def test_open_traces_chunk_arguments(traces, tmp_path):
    mem, _ = traces
    path = tmp_path / "t.nc"
    save_traces(mem, path)
    assert doc_slices(open_traces(path, chunks={"doc": 5})) == [slice(0, 5), slice(5, 10), slice(10, 11)]
    assert len(doc_slices(open_traces(path, chunks="auto"))) == 1          # small file: one chunk
    xr.testing.assert_identical(open_traces(path, chunks=4).compute(), mem)
    for bad in (0, "big", {"replicate": 2}, True):
        with pytest.raises(ValueError, match="chunks="):
            open_traces(path, chunks=bad)


@pytest.mark.slow
def test_cli_analyze_on_a_local_cluster_writes_the_same_results(tmp_path, study_paths, report_in_memory):
    # The in-memory side is the module's shared computation of the same study (the CLI's
    # results.nc is that Dataset: test_divstats_report checks the round trip), so only the
    # cluster run is paid here; chunks of 4 documents give 4/4/3 over two worker processes.
    pytest.importorskip("distributed")
    from click.testing import CliRunner

    from divstats.cli.analyze import analyze
    from divstats.report.results import load_results

    path = study_paths("residual")
    out = tmp_path / "cluster"
    res = CliRunner().invoke(analyze, [str(path), "--plan", str(PAPER), "--quiet", "--n-resamples", "199",
                                       "--out", str(out), "--workers", "2", "--chunk-docs", "4"])
    assert res.exit_code == 0, res.output
    xr.testing.assert_allclose(report_in_memory("residual", open_traces(path)), load_results(out / "results.nc"),
                               **TOL)
    with pytest.raises(ValueError, match="not both"), dask_client(workers=1, scheduler="tcp://x:1"):
        pass


def _worker_settings() -> tuple[dict[str, str | None], object]:
    import os

    import dask

    from protocols.chunks import WORKER_MALLOC

    return {k: os.environ.get(k) for k in WORKER_MALLOC}, dask.config.get("distributed.worker.profile.enabled")


@pytest.mark.slow
def test_local_workers_get_the_malloc_settings_and_no_profiler():
    pytest.importorskip("distributed")
    from protocols.chunks import WORKER_MALLOC

    with dask_client(workers=1) as client:
        (env, profile), = client.run(_worker_settings).values()
    assert env == {k: str(v) for k, v in WORKER_MALLOC.items()}
    assert profile is False
