"""Streaming pack (collector.pack.pack_to, `kvdiv pack`): document by document, the same file as the
in-memory pack; `--append` adds documents collected since; nothing half-written is ever left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xarray as xr
from click.testing import CliRunner
from test_collector_support import FakeServer

import protocols
from collector import documents as D
from collector.cli import pack as pack_cmd
from collector.collect import CollectConfig, collect
from collector.pack import PackError, pack_run, pack_to

POLICIES = ["snapkv@0.5", "recent@0.5"]
LAST = ("doc3", "recent@0.5")


def _cfg(server: str, docs_file: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=[server], docs_file=docs_file, policies=POLICIES, out=out, kind="residual", replicates=2,
                max_new_tokens=6, window=4, seed=7, progress=False, backoff_s=0.01, backoff_max_s=0.05,
                max_attempts=2, concurrency=2)
    base.update(kw)
    return CollectConfig.flat(**base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A complete run, and the same run with one request still missing (then completed by a rerun)."""
    tmp = tmp_path_factory.mktemp("runs")
    docs = [D.Document(f"doc{i}", f"Paragraph {i} of the test set.\n\nSecond paragraph {i}.") for i in range(4)]
    docs_file = D.write_jsonl(docs, tmp / "docs.jsonl")
    with FakeServer() as server:
        assert collect(_cfg(server.url, docs_file, tmp / "whole")).ok
        server.faults_for = {LAST: ["422"]}
        assert not collect(_cfg(server.url, docs_file, tmp / "partial")).ok
    return {"whole": tmp / "whole", "partial": tmp / "partial", "docs": docs_file}


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_streaming_pack_writes_the_in_memory_dataset(runs: dict[str, Path], tmp_path: Path, suffix: str) -> None:
    reference = pack_run(runs["whole"], progress=False)
    for batch_mib in (0.0, 4.0):  # one document per write, and several
        out = tmp_path / f"t{batch_mib:g}{suffix}"
        result = pack_to(runs["whole"], out, batch_mib=batch_mib, progress=False)
        assert (result.written, result.kept, result.dropped) == (4, 0, ())
        xr.testing.assert_identical(protocols.open_traces(out), reference)
    assert not _leftovers(tmp_path)


@pytest.mark.parametrize("suffix", [".zarr", ".nc"])
def test_append_adds_the_documents_collected_since(runs: dict[str, Path], tmp_path: Path, suffix: str) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(runs["partial"], partial)
    out = tmp_path / f"t{suffix}"
    with pytest.raises(PackError, match=r"doc3: recent@0\.5"):
        pack_to(partial, out, progress=False)
    assert not out.exists() and not _leftovers(tmp_path)
    first = pack_to(partial, out, drop_incomplete=True, progress=False)
    assert first.written == 3 and first.dropped == ("doc3",)
    with FakeServer() as server:  # the collection goes on: the missing request completes
        assert collect(_cfg(server.url, runs["docs"], partial)).ok
    again = pack_to(partial, out, append=True, progress=False)
    assert (again.written, again.kept, again.total) == (1, 3, 4)
    got = protocols.open_traces(out)
    assert list(got["doc"].values) == ["doc0", "doc1", "doc2", "doc3"]
    xr.testing.assert_identical(got, pack_run(runs["whole"], progress=False))
    assert pack_to(partial, out, append=True, progress=False).written == 0  # nothing new: the file is kept
    xr.testing.assert_identical(protocols.open_traces(out), got)
    assert not _leftovers(tmp_path)


def test_append_refuses_another_collection_and_keeps_the_file(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "t.zarr"
    pack_to(runs["partial"], out, drop_incomplete=True, progress=False)
    before = protocols.open_traces(out)
    other = tmp_path / "other"
    with FakeServer() as server:
        assert collect(_cfg(server.url, runs["docs"], other, seed=8)).ok
    with pytest.raises(PackError, match="another collection's traces.*seed: the file has 7, the run 8"):
        pack_to(other, out, append=True, progress=False)
    with pytest.raises(PackError, match="no traces file to append to"):
        pack_to(other, tmp_path / "none.zarr", append=True, progress=False)
    xr.Dataset({"a": ("x", [1, 2])}).to_netcdf(tmp_path / "foreign.nc", engine="h5netcdf")
    (tmp_path / "text.nc").write_text("not a traces file")
    with pytest.raises(PackError, match="no 'collection' attribute"):
        pack_to(other, tmp_path / "foreign.nc", append=True, progress=False)
    with pytest.raises(PackError, match="text.nc: cannot be read as a traces file"):
        pack_to(other, tmp_path / "text.nc", append=True, progress=False)
    with pytest.raises(PackError, match="exists; pass --overwrite"):
        pack_to(runs["whole"], out, progress=False)
    xr.testing.assert_identical(protocols.open_traces(out), before)


@pytest.mark.parametrize("append", [False, True])
def test_an_untrusted_file_late_in_the_run_leaves_nothing_written(runs: dict[str, Path], tmp_path: Path,
                                                                   append: bool) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["whole"], run)
    out = tmp_path / "t.zarr"
    if append:  # a store holding doc0 already
        pack_to(run, out, progress=False)
        store = protocols.open_traces(out)
        shutil.rmtree(out)
        protocols.save_traces(store.isel(doc=[0]), out)
    before = protocols.open_traces(out) if append else None
    victim = next((run / "requests").glob("doc3--recent*.ndjson"))
    lines = victim.read_bytes().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["horizon"] += 1  # damaged after the run (its digest no longer holds)
    victim.write_bytes(json.dumps(header).encode() + b"\n" + b"".join(lines[1:]))
    with pytest.raises(PackError, match=r"cannot be trusted:\n  doc3--recent"):
        pack_to(run, out, append=append, batch_mib=0.0, progress=False)
    if append:
        xr.testing.assert_identical(protocols.open_traces(out), before)
    else:
        assert not out.exists()
    assert not _leftovers(tmp_path)


def test_cli_pack_streams_and_appends(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "t.zarr"
    res = CliRunner().invoke(pack_cmd, [str(runs["partial"]), "-o", str(out), "--drop-incomplete"])
    assert res.exit_code == 0 and "3 documents × 2 policies; 1 incomplete documents left out" in res.output
    res = CliRunner().invoke(pack_cmd, [str(runs["whole"]), "-o", str(out), "--append"])
    assert res.exit_code == 0 and "4 documents × 2 policies (1 appended to 3)" in res.output  # same collection
    res = CliRunner().invoke(pack_cmd, [str(runs["partial"]), "-o", str(out), "--append", "--overwrite"])
    assert res.exit_code != 0 and "choose one" in res.output
    res = CliRunner().invoke(pack_cmd, [str(runs["whole"]), "-o", str(out), "--overwrite"])
    assert res.exit_code == 0 and "4 documents × 2 policies" in res.output


def test_drop_policy_packs_the_other_policies_and_records_it(runs: dict[str, Path], tmp_path: Path) -> None:
    # the partial run lacks (doc3, recent@0.5): without that policy every document is complete
    out = tmp_path / "t.nc"
    res = CliRunner().invoke(pack_cmd, [str(runs["partial"]), "-o", str(out), "--drop-policy", "recent@0.5"])
    assert res.exit_code == 0, res.output
    assert "4 documents × 1 policies; policies left out: recent@0.5" in res.output
    ds = protocols.open_traces(out)
    assert ds.policy.values.tolist() == ["snapkv@0.5"] and ds.sizes["doc"] == 4
    assert json.loads(ds.attrs["dropped_policies"]) == ["recent@0.5"]
    full = pack_run(runs["whole"], progress=False)
    xr.testing.assert_equal(ds.shared_token, full.shared_token.sel(policy=["snapkv@0.5"]))
    packs = json.loads((runs["partial"] / "manifest.json").read_text())["packs"]
    assert packs[-1]["out"] == str(out) and packs[-1]["dropped_policies"] == ["recent@0.5"]
    assert packs[-1]["policies"] == ["snapkv@0.5"] and packs[-1]["documents"] == 4
    assert "dropped_policies" not in pack_run(runs["whole"], progress=False).attrs


def test_drop_policy_refuses_a_policy_the_run_lacks_and_dropping_every_policy(runs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    out = tmp_path / "t.nc"
    res = CliRunner().invoke(pack_cmd, [str(runs["whole"]), "-o", str(out), "--drop-policy", "snapkv@0.3"])
    assert res.exit_code == 1 and "--drop-policy snapkv@0.3: not a policy of the run" in res.output
    assert "snapkv@0.5, recent@0.5" in res.output
    with pytest.raises(PackError, match="leaves none of the run's policies"):
        pack_to(runs["whole"], out, drop_policies=POLICIES, progress=False)
    assert not out.exists()
