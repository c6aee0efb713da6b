"""Collection over many servers: bounded requests per server, servers joining and leaving through a
re-read servers file, servers that stop answering, no server at all, per-server throughput.

Twenty fake servers (test_collector_support.FakeServer, one uvicorn thread each) run in
this process; the collection's packed dataset must equal a single-server run's.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_collector_support import FakeServer

from collector import documents as D
from collector.cli import collect as collect_cmd
from collector.collect import CollectConfig, collect
from collector.errors import ConfigError
from collector.pack import pack_run
from collector.servers import ServerPool, read_servers_file

POLICIES = ["snapkv@0.5", "recent@0.5", "snapkv@0.9"]


class CountingServer(FakeServer):
    """A FakeServer that records the most requests it ever had in flight, and when each arrived."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.in_flight = self.max_in_flight = 0
        self.arrivals: list[float] = []

    async def _stream(self, body, fault):
        with self.lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.arrivals.append(time.monotonic())
        try:
            async for line in super()._stream(body, fault):
                yield line
        finally:
            with self.lock:
                self.in_flight -= 1


def _docs(tmp_path: Path, n: int) -> Path:
    docs = [D.Document(f"doc{i}", f"Paragraph {i} of the test set.\n\nSecond paragraph {i}.") for i in range(n)]
    return D.write_jsonl(docs, tmp_path / "docs.jsonl")


def _cfg(docs_file: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=[], docs_file=docs_file, policies=POLICIES, out=out, kind="residual", replicates=2,
                max_new_tokens=6, window=4, seed=7, progress=False, backoff_s=0.01, backoff_max_s=0.05,
                max_attempts=4, concurrency=2, servers_poll_s=0.05, server_backoff_s=0.1,
                server_backoff_max_s=0.4, wait_for_servers_s=5.0, request_timeout_s=10.0)
    base.update(kw)
    return CollectConfig.flat(**base)


def _write(path: Path, urls: list[str]) -> None:
    tmp = path.with_suffix(".tmp")  # as an operator would: write, then rename over the old list
    tmp.write_text("# trace servers\n" + "".join(f"{u}\n" for u in urls))
    tmp.replace(path)


def _stop_all(servers: list[FakeServer]) -> None:
    for server in servers:
        server.server.should_exit = True


def _assert_same_data(a, b) -> None:
    assert list(a.data_vars) == list(b.data_vars) and a.attrs == b.attrs
    for name in a.data_vars:
        x, y = a[name], b[name]
        assert x.dims == y.dims and x.dtype == y.dtype, name
        assert np.array_equal(x.values, y.values, equal_nan=x.dtype.kind == "f"), name
    for name in a.coords:
        assert np.array_equal(a[name].values, b[name].values), name


@pytest.fixture(scope="module")
def single_server_run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("single")
    docs_file = _docs(tmp, 12)
    with FakeServer() as server:
        assert collect(_cfg(docs_file, tmp / "run", servers=[server.url], concurrency=4)).ok
    return docs_file.read_bytes(), pack_run(tmp / "run", progress=False)


@pytest.mark.timeout(120)
def test_twenty_servers_joining_and_leaving_pack_the_single_server_dataset(tmp_path: Path,
                                                                             single_server_run) -> None:
    docs_bytes, reference = single_server_run
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_bytes(docs_bytes)
    servers_file = tmp_path / "servers.txt"
    with ExitStack() as stack:
        servers = [stack.enter_context(CountingServer(delay_s=0.02)) for _ in range(20)]
        urls = [s.url for s in servers]
        stack.callback(_stop_all, servers)  # runs first: the twenty shut down together, not one by one
        first, leaving, joining, dying = urls[:6], urls[:3], urls[6:], servers[5]
        _write(servers_file, first)
        cfg = _cfg(docs_file, tmp_path / "run", servers_file=servers_file)
        box: dict = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", collect(cfg)))
        worker.start()
        run = tmp_path / "run" / "requests"
        while len(list(run.glob("*.ndjson"))) < 6 and worker.is_alive():
            time.sleep(0.01)
        _write(servers_file, urls[3:])          # three leave, twelve join
        left_at = time.monotonic()
        dying.__exit__(None, None, None)        # one stops answering while still listed
        worker.join(60)
        assert not worker.is_alive()
        result = box["result"]
    assert result.ok, result.summary()
    assert result.completed == 36 and not result.failed
    # Every server was kept within its bound, and the joining servers took work.
    assert max(s.max_in_flight for s in servers) <= cfg.pool.concurrency
    assert sum(bool(s.arrivals) for s, url in zip(servers, urls, strict=True) if url in joining) >= 10
    # Servers that left got nothing once the file was re-read (one poll and a dispatch later).
    late = [t for s, url in zip(servers, urls, strict=True) if url in leaving for t in s.arrivals
            if t > left_at + 0.5]
    assert not late
    # Per-server throughput accounts for every request, on the servers that served them.
    assert set(result.servers) == set(urls)
    assert sum(s.requests for s in result.servers.values()) == 36
    for s, url in zip(servers, urls, strict=True):  # the dying server may have dropped a request it had started
        served = result.servers[url].requests
        assert served <= len(s.arrivals) if s is dying else served == len(s.arrivals)
    assert all(st.tokens_per_s > 0 for st in result.servers.values() if st.requests)
    assert "tokens/s" in result.summary() and urls[19] in result.summary()
    _assert_same_data(pack_run(tmp_path / "run", progress=False), reference)


@pytest.mark.timeout(60)
def test_no_server_waits_then_stops_keeping_everything_and_resume_completes(tmp_path: Path) -> None:
    docs_file = _docs(tmp_path, 3)
    servers_file = tmp_path / "servers.txt"
    servers_file.write_text("")
    with FakeServer() as server:
        # Nobody listed: the run waits, says why, and stops at the deadline; nothing is lost.
        start = time.monotonic()
        result = collect(_cfg(docs_file, tmp_path / "run", servers_file=servers_file, wait_for_servers_s=0.5))
        assert time.monotonic() - start < 4
        assert not result.ok and len(result.failed) == 9 and result.completed == 0
        assert all("no server is listed in" in r and "--wait-for-servers" in r for r in result.failed.values())
        # A server appears in the file while the run waits: the run goes on.
        threading.Timer(0.3, _write, (servers_file, [server.url])).start()
        result = collect(_cfg(docs_file, tmp_path / "run", servers_file=servers_file, wait_for_servers_s=10))
        assert result.ok and result.completed == 9
    assert len(list((tmp_path / "run" / "requests").glob("*.ndjson"))) == 9


@pytest.mark.timeout(60)
def test_servers_that_stop_answering_are_retried_later_then_the_run_stops(tmp_path: Path) -> None:
    docs_file = _docs(tmp_path, 2)
    with FakeServer() as server:
        url = server.url
        assert collect(_cfg(docs_file, tmp_path / "run", servers=[url], policies=POLICIES[:1])).ok
    # Its port is closed now: every connection is refused. A refused request never reached a
    # server, so it does not use up attempts; the server is probed with a doubling backoff.
    next((tmp_path / "run" / "requests").glob("*.ndjson")).unlink()
    start = time.monotonic()
    result = collect(_cfg(docs_file, tmp_path / "run", servers=[url], policies=POLICIES[:1],
                          wait_for_servers_s=1.0, max_attempts=1))
    took = time.monotonic() - start
    assert 1.0 <= took < 5 and not result.ok and result.skipped == 1
    (reason,) = result.failed.values()
    assert "none of the 1 listed servers is answering for 1 s" in reason
    stats = result.servers[url]
    assert stats.requests == 0 and 2 <= stats.failures <= 6  # probes at 0.1, 0.2, 0.4 s intervals


def test_servers_file_and_pool_rules(tmp_path: Path) -> None:
    f = tmp_path / "servers.txt"
    f.write_text("# cluster\nhttp://a:1/\n\nhttp://b:1  # second\nb:1\nhttp://a:1\nhttp://c:1 http://d:1\n")
    urls, problems = read_servers_file(f)
    assert urls == ["http://a:1", "http://b:1"]
    assert [p.split(": ", 1)[0] for p in problems] == [f"{f}:5", f"{f}:7"]
    now = [0.0]
    said: list[str] = []
    pool = ServerPool(["http://s:1"], f, concurrency=2, backoff_s=1.0, backoff_max_s=3.0, poll_s=10,
                      say=said.append, clock=lambda: now[0])
    assert [s.url for s in pool.listed] == ["http://s:1", "http://a:1", "http://b:1"]
    picks = []
    for _ in range(6):  # the least loaded first: every server gets one before any gets two
        server = pool.pick()
        pool.started(server)
        picks.append(server.url)
    assert sorted(picks[:3]) == sorted(picks[3:]) == ["http://a:1", "http://b:1", "http://s:1"]
    assert pool.pick() is None  # every slot taken
    a = pool.servers["http://a:1"]
    for _ in range(2):
        pool.finished(a, unreachable=True)
    assert pool.capacity(a) == 0 and pool.next_change() == pytest.approx(2.0)  # 1 s, then 2 s
    now[0] = 2.5
    assert pool.capacity(a) == 1  # probed alone
    pool.started(a)
    pool.finished(a, tokens=10)
    assert pool.capacity(a) == 2 and "answers again" in said[-1]
    f.write_text("http://b:1\nhttp://e:1\n")
    pool.refresh(force=False)  # not yet: poll_s has not passed
    assert "http://e:1" not in pool.servers
    now[0] = 11.0
    pool.refresh(force=False)
    assert [s.url for s in pool.listed] == ["http://s:1", "http://b:1", "http://e:1"]  # --server stays
    assert pool.capacity(pool.servers["http://a:1"]) == 0 and any("left the servers file" in m for m in said)
    f.unlink()
    now[0] = 22.0
    pool.refresh(force=False)  # unreadable: the last list stays
    assert len(pool.listed) == 3 and "cannot read" in said[-1]
    stats = pool.stats()
    assert stats["http://a:1"].requests == 1 and stats["http://a:1"].failures == 2
    assert stats["http://a:1"].tokens == 10


def test_cli_servers_file_reports_each_server(tmp_path: Path) -> None:
    docs_file = _docs(tmp_path, 2)
    with FakeServer() as a, FakeServer() as b:
        urls = [a.url, b.url]
        (tmp_path / "servers.txt").write_text("".join(f"{u}\n" for u in urls))
        args = ["--servers-file", str(tmp_path / "servers.txt"), "--docs", str(docs_file), "--policies",
                ",".join(POLICIES), "-R", "2", "-T", "4", "--seed", "1", "--out", str(tmp_path / "run"),
                "--no-progress"]
        res = CliRunner().invoke(collect_cmd, args)
    assert res.exit_code == 0, res.output
    assert "requests  failures    tokens  tokens/s" in res.output and all(u in res.output for u in urls)
    res = CliRunner().invoke(collect_cmd, [*args[2:], "--servers-file", str(tmp_path / "nope.txt")])
    assert res.exit_code == 1 and "nope.txt: cannot read the servers file" in res.output
    res = CliRunner().invoke(collect_cmd, args[2:])
    assert res.exit_code == 1 and "at least one --server or a --servers-file" in res.output
    with pytest.raises(ConfigError, match="--wait-for-servers"):
        _cfg(docs_file, tmp_path / "x", servers=["http://x"], wait_for_servers_s=-1)
