"""The collector against a fake trace server: retries, integrity, resume, manifest, pack."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_collector_support import POLICIES, FakeServer, small_config

from collector import documents as D
from collector.cli import _split_policies
from collector.cli import collect as collect_cmd
from collector.cli import pack as pack_cmd
from collector.collect import (
    CollectConfig,
    Collector,
    collect,
    derive_seed,
    prepare_run,
    request_body,
)
from collector.journal import ManifestMismatch
from collector.pack import PackError, pack_run
from protocols import read_stream

_cfg = small_config


def _journal_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "requests").glob("*.ndjson"))}


def test_collect_then_pack(fake_server: FakeServer, docs_file: Path, tmp_path: Path) -> None:
    result = collect(_cfg([fake_server.url], docs_file, tmp_path / "run"))
    assert result.ok and result.completed == 6 and result.skipped == 0 and result.tokens > 0
    files = _journal_bytes(tmp_path / "run")
    assert len(files) == 6 and not list((tmp_path / "run" / "requests").glob("*.part"))
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["params"]["policies"] == POLICIES and manifest["model"] == "fake-model"
    body = fake_server.requests[0]
    assert body["kind"] == "residual" and body["replicates"] == 2 and body["window"] == 4
    assert body["parameters"]["seed"] == derive_seed(7, body["doc_id"], body["candidate"])
    assert body["messages"][0]["content"].endswith("Summarise the text above in a few sentences.")
    ds = pack_run(tmp_path / "run", progress=False)
    assert list(ds["doc"].values) == ["doc0", "doc1", "doc2"]
    assert list(ds["policy"].values) == POLICIES
    assert ds.attrs["prompt_template"] == "summarise" and ds.attrs["kind"] == "residual"


def test_retries_every_fault_and_never_keeps_a_corrupt_stream(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer() as clean:
        collect(_cfg([clean.url], docs_file, tmp_path / "clean"))
    with FakeServer() as flaky:
        flaky.faults = ["429", "500", "drop", "truncate", "bad_digest", "error", "429"]
        result = collect(_cfg([flaky.url], docs_file, tmp_path / "flaky", max_attempts=8))
        assert result.ok and result.retries == 7 and len(flaky.requests) == 13
    # Every retried stream is byte-identical to the clean run's: nothing corrupt was kept.
    assert _journal_bytes(tmp_path / "flaky") == _journal_bytes(tmp_path / "clean")
    for data in _journal_bytes(tmp_path / "flaky").values():
        read_stream(data.splitlines(keepends=True))


def test_persistent_failure_is_reported_and_left_incomplete(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer() as server:
        server.faults_for = {("doc0", "snapkv@0.5"): ["drop"] * 3, ("doc1", "recent@0.5"): ["422"]}
        cfg = _cfg([server.url], docs_file, tmp_path / "run", max_attempts=3, concurrency=1)
        result = collect(cfg)
    assert not result.ok and len(result.failed) == 2 and result.completed == 4
    reasons = " | ".join(result.failed.values())
    assert "after 3 attempts" in reasons and "HTTP 422" in reasons and "unknown policy" in reasons
    assert len(_journal_bytes(tmp_path / "run")) == 4
    with pytest.raises(PackError, match="2 of 3 documents lack complete requests"):
        pack_run(tmp_path / "run", progress=False)
    ds = pack_run(tmp_path / "run", drop_incomplete=True, progress=False)
    assert ds.sizes["doc"] == 1


async def _collect_until(cfg: CollectConfig, stop_after: int) -> None:
    journal, docs = prepare_run(cfg)
    task = asyncio.create_task(Collector(cfg, docs, journal).run())
    while len(list(journal.requests.glob("*.ndjson"))) < stop_after:
        await asyncio.sleep(0.005)
    task.cancel()  # as a Ctrl-C or a killed process would: mid-way through later requests
    with pytest.raises(asyncio.CancelledError):
        await task


def test_interrupted_run_resumes_to_the_uninterrupted_result(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer(delay_s=0.01) as server:
        collect(_cfg([server.url], docs_file, tmp_path / "whole"))
        asyncio.run(_collect_until(_cfg([server.url], docs_file, tmp_path / "cut"), stop_after=2))
        done = len(_journal_bytes(tmp_path / "cut"))
        assert 2 <= done < 6
        time.sleep(0.3)  # let the server log the cancelled in-flight request before counting anew
        server.requests.clear()
        result = collect(_cfg([server.url], docs_file, tmp_path / "cut"))
        assert result.skipped == done and result.completed == 6 - done
        assert len(server.requests) == 6 - done  # complete requests were not asked again
    assert _journal_bytes(tmp_path / "cut") == _journal_bytes(tmp_path / "whole")
    a, b = pack_run(tmp_path / "cut", progress=False), pack_run(tmp_path / "whole", progress=False)
    assert a.identical(b)


def test_resume_with_other_parameters_is_refused(fake_server: FakeServer, docs_file: Path, tmp_path: Path) -> None:
    collect(_cfg([fake_server.url], docs_file, tmp_path / "run"))
    with pytest.raises(ManifestMismatch, match="replicates: manifest has 2, this run asks for 3"):
        collect(_cfg([fake_server.url], docs_file, tmp_path / "run", replicates=3))
    # Servers and concurrency may change between runs (a restarted server, a new port).
    again = collect(_cfg([fake_server.url + "/"], docs_file, tmp_path / "run", concurrency=3))
    assert again.ok and again.skipped == 6 and again.completed == 0


def test_requests_spread_over_servers(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer(delay_s=0.01) as a, FakeServer(delay_s=0.01) as b:
        result = collect(_cfg([a.url, b.url], docs_file, tmp_path / "run", concurrency=1))
        assert result.ok and a.requests and b.requests and len(a.requests) + len(b.requests) == 6


def test_a_server_with_another_model_is_refused(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer() as a:
        collect(_cfg([a.url], docs_file, tmp_path / "run", policies=["snapkv@0.5"]))
    with FakeServer(model="other-model") as b:
        result = collect(_cfg([b.url], docs_file, tmp_path / "run", policies=["snapkv@0.5"]))
    assert result.ok  # everything was already complete: nothing asked of the other model
    (tmp_path / "run" / "requests").joinpath(next(iter(_journal_bytes(tmp_path / "run")))).unlink()
    with FakeServer(model="other-model") as b:
        result = collect(_cfg([b.url], docs_file, tmp_path / "run", policies=["snapkv@0.5"]))
    assert not result.ok and "other-model" in next(iter(result.failed.values()))


def test_stop_reason_ends_the_run_at_once(docs_file: Path, tmp_path: Path) -> None:
    with FakeServer() as server:
        server.faults = ["500"] * 100
        start = time.monotonic()
        result = collect(_cfg([server.url], docs_file, tmp_path / "run", max_attempts=50, backoff_s=1.0),
                         stop_reason=lambda: "server process exited")
    assert time.monotonic() - start < 5 and len(server.requests) == 1
    assert result.failed == {f"doc{i} × {p}": "server process exited" for i in range(3) for p in POLICIES}


def test_authentication_failure_stops_everything(fake_server: FakeServer, docs_file: Path, tmp_path: Path) -> None:
    fake_server.faults = ["401"] * 10
    result = collect(_cfg([fake_server.url], docs_file, tmp_path / "run"))
    assert len(result.failed) == 6 and len(fake_server.requests) == 1
    assert all("--api-key" in reason for reason in result.failed.values())


def test_seeds_and_bodies() -> None:
    assert derive_seed(1, "d", "p") == derive_seed(1, "d", "p")
    assert len({derive_seed(1, "d", p) for p in POLICIES} | {derive_seed(2, "d", "snapkv@0.5")}) == 3
    assert 0 <= derive_seed(123, "x", "y") < 2**31
    cfg = _cfg(["http://x"], Path("d.jsonl"), Path("o"), top_k=5, template="qa", temperature=0.0)
    body = request_body(cfg, D.Document("d", "t"), "recent@0.5")
    assert body["parameters"]["top_k"] == 5 and body["parameters"]["do_sample"] is False
    assert "top_p" not in body["parameters"] and "Question:" in body["messages"][0]["content"]
    with pytest.raises(ValueError, match="--window"):
        _cfg(["http://x"], Path("d"), Path("o"), window=7)
    assert _split_policies("snapkv@0.5:window_size=64,n_sink=0, recent@0.5,snapkv#128") == [
        "snapkv@0.5:window_size=64,n_sink=0", "recent@0.5", "snapkv#128"]


def test_cli_collect_and_pack(fake_server: FakeServer, docs_file: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["--server", fake_server.url, "--docs", str(docs_file), "--policies", ",".join(POLICIES),
            "--kind", "coupled", "-R", "2", "-T", "5", "--seed", "1", "--out", str(run), "--no-progress"]
    res = CliRunner().invoke(collect_cmd, args)
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(collect_cmd, [*args[:-5], "--seed", "2", "--out", str(run)])
    assert res.exit_code != 0 and "seed: manifest has 1, this run asks for 2" in res.output
    res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(tmp_path / "t.nc")])
    assert res.exit_code == 0, res.output
    import protocols

    ds = protocols.open_traces(tmp_path / "t.nc")
    assert ds.attrs["kind"] == "coupled" and ds.sizes["step"] == 5 and ds.sizes["doc"] == 3
    res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(tmp_path / "t.zarr")])
    assert res.exit_code == 0, res.output
    assert protocols.open_traces(tmp_path / "t.zarr").identical(ds)
    next((run / "requests").glob("doc1--recent*.ndjson")).unlink()
    res = CliRunner().invoke(pack_cmd, [str(run), "-o", str(tmp_path / "u.nc")])
    assert res.exit_code != 0 and "doc1: recent@0.5" in res.output


def test_progress_counts_records_streamed_not_only_finished_requests() -> None:
    from collector.progress import Progress

    bar = Progress(total=3, initial=1, enabled=True)   # one request skipped (already complete)
    for _ in range(2):
        bar.record("a", "step", 4, 2)           # coupled: 1/T of a request per step
    assert bar.bar.n == pytest.approx(1.5)
    bar.record("b", "shared_step", 4, 2)        # residual: survival half, then branches half
    bar.record("b", "branch", 4, 2)
    bar.record("b", "header", 4, 2)             # not work
    assert bar.bar.n == pytest.approx(1.5 + 0.125 + 0.25)
    for _ in range(9):
        bar.record("b", "branch", 4, 2)         # more records than expected: capped below done
    assert bar.bar.n == pytest.approx(1.5 + 0.99)
    bar.undo("b")                               # a failed attempt's records are not work done
    bar.done("a")
    assert bar.bar.n == pytest.approx(2.0)
    bar.close()


def test_collection_progress_moves_before_any_request_ends(fake_server: FakeServer, docs_file: Path,
                                                           tmp_path: Path, monkeypatch) -> None:
    import collector.collect as C

    seen: list[tuple[float, int]] = []

    class Watched(C.Progress):
        def record(self, *args):
            super().record(*args)
            seen.append((self.bar.n, done[0]))

        def done(self, key):
            done[0] += 1
            super().done(key)
            final[0] = self.bar.n

    done, final = [0], [0.0]
    monkeypatch.setattr(C, "Progress", Watched)
    result = collect(_cfg([fake_server.url], docs_file, tmp_path / "run", progress=True))
    assert result.ok and result.completed == 6
    assert any(n > 0 and d == 0 for n, d in seen)   # the bar moved before the first request ended
    assert final[0] == pytest.approx(6)
