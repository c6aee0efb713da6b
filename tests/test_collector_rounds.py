"""Later rounds of an adaptive collection in the collector: per-pair replicates, fresh seeds, own journal folder."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
from test_collector_support import FakeServer, small_config

from collector.checks import derive_seed
from collector.collect import CollectConfig, Collector, collect, prepare_run
from collector.errors import ConfigError, ManifestMismatch
from collector.journal import Journal
from collector.pack import PackError, pack_run, pack_to

ALLOCATION = {"doc0": {"snapkv@0.5": 3, "recent@0.5": 0}, "doc1": {"snapkv@0.5": 1, "recent@0.5": 4},
              "doc2": {"snapkv@0.5": 2, "recent@0.5": 2}}


_cfg = small_config


def _round_files(run: Path, k: int) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Journal(run, k).requests.glob("*.ndjson"))}


def test_a_later_round_asks_each_pair_its_own_replicates_with_fresh_seeds(fake_server: FakeServer, docs_file: Path,
                                                                          tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert collect(_cfg([fake_server.url], docs_file, run)).ok
    fake_server.requests.clear()
    result = collect(_cfg([fake_server.url], docs_file, run, round_index=1, allocation=ALLOCATION))
    assert result.ok and result.total == 5 and result.completed == 5  # doc0 × recent@0.5 has 0: not asked
    asked = {(b["doc_id"], b["candidate"]): b for b in fake_server.requests}
    assert set(asked) == {(d, p) for d, row in ALLOCATION.items() for p, r in row.items() if r}
    for (doc, policy), body in asked.items():
        assert body["replicates"] == ALLOCATION[doc][policy]
        assert body["parameters"]["seed"] == derive_seed(7, doc, policy, 1) != derive_seed(7, doc, policy)
    assert len(_round_files(run, 1)) == 5 and len(_round_files(run, 0)) == 6
    record = json.loads((run / "rounds" / "1" / "allocation.json").read_text())
    assert record["round"] == 1 and record["replicates"] == ALLOCATION
    assert Journal(run).rounds() == [1]
    # a finished round resumes to nothing; another allocation for it is refused, naming the pair
    assert collect(_cfg([fake_server.url], docs_file, run, round_index=1, allocation=ALLOCATION)).completed == 0
    other = {**ALLOCATION, "doc2": {"snapkv@0.5": 5, "recent@0.5": 2}}
    with pytest.raises(ManifestMismatch, match="doc2 × snapkv@0.5: 2 written, 5 asked"):
        collect(_cfg([fake_server.url], docs_file, run, round_index=1, allocation=other))


def test_round_config_errors_are_named(docs_file: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs an allocation"):
        _cfg(["http://x"], docs_file, tmp_path / "r", round_index=1)
    with pytest.raises(ConfigError, match="not in the run"):
        _cfg(["http://x"], docs_file, tmp_path / "r", round_index=1, allocation={"doc0": {"h2o@0.5": 1}})
    with pytest.raises(ConfigError, match="integers >= 0"):
        _cfg(["http://x"], docs_file, tmp_path / "r", round_index=1, allocation={"doc0": {"recent@0.5": -1}})
    with pytest.raises(ConfigError, match="documents not in"):
        prepare_run(_cfg(["http://x"], docs_file, tmp_path / "r", round_index=1, allocation={"docX": {}}))


async def _collect_until(cfg: CollectConfig, stop_after: int) -> None:
    journal, docs = prepare_run(cfg)
    task = asyncio.create_task(Collector(cfg, docs, journal).run())
    while len(list(journal.requests.glob("*.ndjson"))) < stop_after:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_an_interrupted_round_resumes_to_the_uninterrupted_result(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer(delay_s=0.01) as server:
        for run in ("whole", "cut"):
            collect(_cfg([server.url], docs_file, tmp_path / run))
        collect(_cfg([server.url], docs_file, tmp_path / "whole", round_index=1, allocation=ALLOCATION))
        cut = _cfg([server.url], docs_file, tmp_path / "cut", round_index=1, allocation=ALLOCATION)
        asyncio.run(_collect_until(cut, stop_after=2))
        done = len(_round_files(tmp_path / "cut", 1))
        assert 2 <= done < 5
        time.sleep(0.3)
        server.requests.clear()
        result = collect(cut)
        assert result.skipped == done and result.completed == 5 - done and len(server.requests) == 5 - done
    assert _round_files(tmp_path / "cut", 1) == _round_files(tmp_path / "whole", 1)
    assert _round_files(tmp_path / "cut", 0) == _round_files(tmp_path / "whole", 0)


def test_pack_stacks_the_rounds_along_replicate_with_a_round_coordinate(fake_server: FakeServer, docs_file: Path,
                                                                         tmp_path: Path) -> None:
    import protocols

    run = tmp_path / "run"
    collect(_cfg([fake_server.url], docs_file, run))
    plain = pack_run(run, progress=False)
    collect(_cfg([fake_server.url], docs_file, run, round_index=1, allocation=ALLOCATION))
    ds = pack_run(run, progress=False)
    assert ds.sizes["replicate"] == 2 + 4 and ds["round"].values.tolist() == [0, 0, 1, 1, 1, 1]
    # round 0 is the plain run's data, unchanged; a later round's block holds its own request, then absent slots
    xr.testing.assert_identical(ds.isel(replicate=[0, 1]).drop_vars(
        ["round", "request_round", "round_replicates", "round_seed", "round_elapsed_s"]).drop_attrs(deep=False),
        plain.drop_attrs(deep=False))
    one = protocols.assemble(Journal(run, 1).read_lines("doc1", "snapkv@0.5"), doc="doc1")
    cell = ds.sel(doc="doc1", policy="snapkv@0.5")
    np.testing.assert_array_equal(cell["shared_tv"].values[2:3], one["shared_tv"].values[0, 0])
    assert np.isnan(cell["shared_tv"].values[3:]).all() and (cell["branch_step"].values[3:] == 0).all()
    assert ds["round_replicates"].sel(doc="doc1").values.tolist() == [[2, 1], [2, 4]]
    assert ds["round_seed"].sel(doc="doc0", policy="recent@0.5").values.tolist()[1] == -1  # not asked in round 1
    assert int(ds["round_seed"].sel(doc="doc0", policy="snapkv@0.5", request_round=1)) == derive_seed(
        7, "doc0", "snapkv@0.5", 1)
    assert json.loads(ds.attrs["collection"])["round_replicates"] == [2, 4]
    # the streaming writer gives the same file; a missing round-1 request is named with its round
    out = pack_to(run, tmp_path / "t.zarr", progress=False)
    assert out.total == 3 and protocols.open_traces(tmp_path / "t.zarr").load().identical(ds)
    next(Journal(run, 1).requests.glob("doc2--recent*.ndjson")).unlink()
    with pytest.raises(PackError, match=r"doc2: recent@0.5 \(round 1\)"):
        pack_run(run, progress=False)


def test_a_later_round_must_see_round_0s_prompt(fake_server: FakeServer, docs_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    collect(_cfg([fake_server.url], docs_file, run))
    fake_server.faults_for = {("doc0", "snapkv@0.5"): ["rewrite_prompt"]}  # doc0's only request of round 1
    cfg = _cfg([fake_server.url], docs_file, run, round_index=1, allocation=ALLOCATION)
    result = collect(cfg)
    assert list(result.failed) == ["doc0 × snapkv@0.5"] and "prompt" in result.failed["doc0 × snapkv@0.5"]
    assert collect(cfg).ok and pack_run(run, progress=False).sizes["replicate"] == 6
