"""The numerical control (``collect --control``) and the noise floor it measures (issue 21 item 3).

Against a live in-process server (tiny model, fp32 on CPU): ``--control`` adds ``full`` to
every document's grouped request, pack keeps it (marked as the control, with the
header's numerics), and its full-vs-full TV is ~0. Pack refuses traces whose numerics
differ (one request recollected after the server switched to fused P+Q forwards) and
accepts them with ``allow_mixed_numerics``. The report (simulated data) shows the
noise-floor section, warns when a policy is within the floor, says "no control
collected" without one, and keeps the control out of comparisons and hypotheses.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

import divstats
from collector.cli import collect_config
from collector.cli import pack as pack_command
from collector.config import CollectConfig
from collector.errors import PackError
from divstats.errors import PlanError
from divstats.estimation.noise_floor import NO_CONTROL, NOISE_FLOOR_FACTOR
from divstats.report.analysis import compute
from divstats.report.render import render_html, render_markdown
from divstats.report.results import results_dataset
from divstats.truth.studies import PolicyEffect, simulate_study
from protocols import header_record


def _cfg(url: str, docs_file: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=[url], docs_file=docs_file, policies=["snapkv@0.5"], out=out, kind="residual",
                replicates=3, max_new_tokens=6, window=4, seed=7, progress=False, concurrency=1, backoff_s=0.01,
                backoff_max_s=0.05, control=True)
    return CollectConfig.flat(**{**base, **kw})


# --------------------------------------------------------------------------- config and header (no server)

def test_control_appends_full_once_and_is_recorded() -> None:
    cfg = CollectConfig.flat(servers=["http://x"], docs_file="d.jsonl", policies=["snapkv@0.5"], out="o", control=True)
    assert cfg.policies == ["snapkv@0.5", "full"]
    assert cfg.params("0" * 64)["control"] == "full"
    again = CollectConfig.flat(servers=["http://x"], docs_file="d.jsonl", policies=["full", "a"], out="o",
                               control=True)
    assert again.policies == ["full", "a"]
    off = CollectConfig.flat(servers=["http://x"], docs_file="d.jsonl", policies=["a"], out="o")
    assert off.policies == ["a"] and "control" not in off.params("0" * 64)   # old journals still resume
    via_cli = collect_config(servers=("http://x",), servers_file=None, wait_for_servers=1.0, docs_file=Path("d"),
                             policies="a", kind="residual", replicates=2, max_new_tokens=4, window=None,
                             temperature=1.0, top_k=None, top_p=None, seed=0, crn=False, out=Path("o"), api_key=None,
                             concurrency=1, template="summarise", max_attempts=2, request_timeout=10.0,
                             progress=False, control=True)
    assert via_cli.policies == ["a", "full"]


def test_header_numerics_are_optional_fields() -> None:
    base = dict(kind="coupled", horizon=4, window=4, model="m", eos_token_id=None, sampling={},
                candidate={"policy": "full"}, seed=1, prompt_tokens=9, retained_tokens=9, replicates=2, vocab_size=10)
    assert not {"dtype", "fused", "device", "fuse"} & set(header_record(**base))
    rec = header_record(**base, dtype="bfloat16", fused=True, device="cuda", fuse="on")
    assert (rec["dtype"], rec["fused"], rec["device"], rec["fuse"]) == ("bfloat16", True, "cuda", "on")


# --------------------------------------------------------------------------- live server

@pytest.fixture(scope="module")
def server() -> Iterator[object]:
    from service_live import LiveServer

    s = LiveServer(max_new_tokens=64, max_replicates=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from collector import documents as D

    docs = D.select(D.pydoc_documents(None, target_tokens=60), 2)
    return D.write_jsonl(docs, tmp_path_factory.mktemp("docs") / "docs.jsonl")


@pytest.mark.service
def test_collect_control_packs_full_with_a_zero_floor(server, docs_file: Path, tmp_path: Path) -> None:
    from collector.collect import collect
    from collector.pack import pack_run

    server.service.engine.fuse = "auto"
    result = collect(_cfg(server.url, docs_file, tmp_path / "run"))
    assert result.ok and result.completed == 4                  # 2 documents × (snapkv, full)
    ds = pack_run(tmp_path / "run", progress=False)
    assert [str(p) for p in ds["policy"].values] == ["snapkv@0.5", "full"]
    assert ds.attrs["control_policy"] == "full"
    numerics = json.loads(ds.attrs["numerics"])
    assert numerics == {"device": "cpu", "dtype": "float32", "fuse": "auto", "fused": None}
    extra = json.loads(str(ds["header_extra"].sel(policy="full").values[0]))
    assert extra["dtype"] == "float32" and extra["device"] == "cpu"
    nf = divstats.noise_floor(ds, n_resamples=99)
    assert nf.attrs["control"] == "full"
    assert float(nf["aggregate_max_tv"]) <= 1e-5                # fp32 on CPU: the floor is numerical only
    assert float(nf["aggregate_occurrence"]) == 0.0


@pytest.mark.service
def test_pack_refuses_mixed_numerics_unless_allowed(server, docs_file: Path, tmp_path: Path) -> None:
    from collector.collect import collect
    from collector.pack import pack_run, pack_to

    run = tmp_path / "run"
    try:
        server.service.engine.fuse = "off"
        assert collect(_cfg(server.url, docs_file, run)).ok
        victim = sorted((run / "requests").glob("*.ndjson"))[0]
        victim.unlink()
        server.service.engine.fuse = "on"                      # a second server setting: fused P+Q forwards
        again = collect(_cfg(server.url, docs_file, run))
        assert again.ok and again.completed == 1
    finally:
        server.service.engine.fuse = "auto"
    with pytest.raises(PackError, match="numerics differ") as err:
        pack_run(run, progress=False)
    assert "fused: False" in str(err.value) and "True" in str(err.value) and "--allow-mixed-numerics" in str(err.value)
    assert not (tmp_path / "t.nc").exists()
    with pytest.raises(PackError, match="numerics differ"):
        pack_to(run, tmp_path / "t.nc", progress=False)
    assert not (tmp_path / "t.nc").exists()                    # nothing written
    refused = CliRunner().invoke(pack_command, [str(run), "-o", str(tmp_path / "t.nc")])
    assert refused.exit_code == 1 and "numerics differ" in refused.output
    ok = CliRunner().invoke(pack_command, [str(run), "-o", str(tmp_path / "t.nc"), "--allow-mixed-numerics"])
    assert ok.exit_code == 0, ok.output
    ds = pack_run(run, progress=False, allow_mixed_numerics=True)
    assert ds.attrs["numerics"] == "mixed"


# --------------------------------------------------------------------------- the report (simulated data)

def _study(n: int = 12):
    """Policies a (strong), full (the control, weak) and b: the control's own traces under another name,
    so b's divergence is exactly the floor's."""
    import xarray as xr

    ds = simulate_study(n, {"a": PolicyEffect(0.6), "full": PolicyEffect(0.02)}, horizon=6, replicates=4)
    b = ds.sel(policy=["full"]).assign_coords(policy=["b"])
    return xr.concat([ds, b], "policy")


def test_report_shows_the_floor_and_warns_within_it() -> None:
    an = compute(_study(), n_resamples=199, progress=False)
    warnings = [n for n in an.notes if n.startswith("Noise floor:")]
    assert len(warnings) == 1 and warnings[0].startswith("Noise floor: b's")
    assert f"{NOISE_FLOOR_FACTOR:g}×" in warnings[0]
    md = render_markdown(an)
    section = md[md.index("## Noise floor"):]
    assert "full (control)" in section and "⚠" in section
    rows = {line.split("|")[1].strip(): line for line in section.splitlines() if line.startswith("| ")}
    assert "⚠" in rows["b"] and "⚠" not in rows["a"]
    assert "Noise floor" in render_html(an, {})
    # the control is shown but is no comparison
    assert all("full" not in (r.a, r.b) for r, _ in an.decompositions)
    assert results_dataset(an).attrs["noise_floor"] == "full"
    nf = an.noise_floor
    assert {"occurrence", "max_tv", "mismatch_fraction", "aggregate_occurrence_low",
            "aggregate_occurrence_high"} <= set(nf.data_vars)


def test_report_without_control_says_so() -> None:
    ds = _study(n=4).sel(policy=["a", "b"])
    an = compute(ds, n_resamples=99, progress=False)
    assert an.noise_floor.attrs["note"] == NO_CONTROL
    assert NO_CONTROL in render_markdown(an) and "no control collected" in render_html(an, {})
    assert not [n for n in an.notes if n.startswith("Noise floor:")]
    assert results_dataset(an).attrs["noise_floor"] == NO_CONTROL


def test_plan_may_not_name_the_control() -> None:
    ds = _study(n=4)
    hyp = {"id": "h", "family": "f", "metric": "occurrence", "compare": ["b", "full"], "split": "all",
           "test": "bootstrap-t", "direction": "less"}
    plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [hyp]}
    with pytest.raises(PlanError, match="numerical control"):
        compute(ds, plan, n_resamples=99, progress=False)


@pytest.mark.service
def test_append_refuses_documents_with_other_numerics(server, docs_file: Path, tmp_path: Path) -> None:
    from collector.collect import collect
    from collector.pack import pack_to

    run, out = tmp_path / "run", tmp_path / "t.nc"
    try:
        server.service.engine.fuse = "off"
        assert collect(_cfg(server.url, docs_file, run)).ok
        files = sorted((run / "requests").glob("*.ndjson"))
        last_doc = [p for p in files if p.name.startswith(files[-1].name.split("--")[0] + "--")]
        assert 0 < len(last_doc) < len(files)
        for p in last_doc:
            p.unlink()
        assert pack_to(run, out, drop_incomplete=True, progress=False).written == 1
        server.service.engine.fuse = "on"
        assert collect(_cfg(server.url, docs_file, run)).ok
    finally:
        server.service.engine.fuse = "auto"
    with pytest.raises(PackError, match="numerics"):
        pack_to(run, out, append=True, progress=False)
    assert pack_to(run, out, append=True, progress=False, allow_mixed_numerics=True).written == 1


def test_the_control_may_be_side_b_of_a_test_at_a_margin() -> None:
    ds = _study(n=4)
    hyp = {"id": "ni", "family": "f", "metric": "occurrence", "compare": ["b", "full"], "split": "all",
           "test": "bootstrap-t", "direction": "noninferiority", "margin": 0.05}
    plan = {"plan": {"name": "p", "salt": "s"}, "hypothesis": [hyp]}
    an = compute(ds, plan, n_resamples=99, progress=False)
    assert an.plan_result is not None and list(an.plan_result.table["id"]) == ["ni"]
    with pytest.raises(PlanError, match="side B"):   # but never side A
        compute(ds, {**plan, "hypothesis": [{**hyp, "compare": ["full", "b"]}]}, n_resamples=99, progress=False)
