"""The collector sending a document's policies as one multi-candidate request (collector/grouped.py).

Against a live in-process server (tiny model): grouped and one-request-per-policy runs
write the same journal files and pack to the same traces (tokens equal, TV to rounding);
a server without ``trace_candidates`` gets one request per policy; a candidate failing
mid-stream leaves the others complete; a group refused as a whole (a 422 naming one
candidate) is resent policy by policy so only the bad policy fails.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from service_live import LiveServer

from collector import documents as D
from collector.collect import CollectConfig, collect
from collector.errors import RetryableError
from collector.grouped import CandidateSplitter, group_body
from collector.pack import pack_run
from protocols.stream import StreamError

pytestmark = pytest.mark.service

POLICIES = ["snapkv@0.5", "recent@0.5", "streaming@0.5"]
RUN_SPECIFIC = ["request_id", "elapsed_s", "stream_sha256"]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = LiveServer(max_new_tokens=64, max_replicates=16)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = D.select(D.pydoc_documents(None, target_tokens=60), 3)
    return D.write_jsonl(docs, tmp_path_factory.mktemp("docs") / "docs.jsonl")


def _cfg(url: str, docs_file: Path, out: Path, **kw) -> CollectConfig:
    base = dict(servers=[url], docs_file=docs_file, policies=POLICIES, out=out, kind="residual", replicates=3,
                max_new_tokens=6, window=4, seed=7, progress=False, concurrency=1, backoff_s=0.01,
                backoff_max_s=0.05)
    return CollectConfig.flat(**{**base, **kw})


def _traces_requests(server: LiveServer) -> float:
    return server.service.metrics.registry.get_sample_value(
        "kvdiv_requests_total", {"route": "/v1/traces", "status": "200"}) or 0.0


def _assert_close(a, b) -> None:
    a, b = a.drop_vars(RUN_SPECIFIC), b.drop_vars(RUN_SPECIFIC)
    assert set(a.data_vars) == set(b.data_vars)
    for var in a.data_vars:
        if np.issubdtype(a[var].dtype, np.floating):
            np.testing.assert_allclose(a[var].values, b[var].values, atol=1e-5, equal_nan=True, err_msg=var)
        else:
            assert (a[var].values == b[var].values).all(), var


def test_grouped_run_equals_one_request_per_policy(server: LiveServer, docs_file: Path, tmp_path: Path) -> None:
    before = _traces_requests(server)
    grouped = collect(_cfg(server.url, docs_file, tmp_path / "grouped"))
    assert grouped.ok and grouped.completed == 9
    assert _traces_requests(server) - before == 3            # one request per document
    assert grouped.servers[server.url].requests == 9          # each policy counts as a request
    single = collect(_cfg(server.url, docs_file, tmp_path / "single", group_candidates=False))
    assert single.ok and _traces_requests(server) - before == 3 + 9
    names = sorted(p.name for p in (tmp_path / "grouped" / "requests").glob("*.ndjson"))
    assert names == sorted(p.name for p in (tmp_path / "single" / "requests").glob("*.ndjson")) and len(names) == 9
    _assert_close(pack_run(tmp_path / "grouped", progress=False), pack_run(tmp_path / "single", progress=False))
    # a resume finds every grouped file complete
    again = collect(_cfg(server.url, docs_file, tmp_path / "grouped"))
    assert again.ok and again.skipped == 9 and again.completed == 0


def test_server_without_candidates_gets_one_request_per_policy(docs_file: Path, tmp_path: Path) -> None:
    old = LiveServer(max_new_tokens=64, max_replicates=16, max_candidates=1)
    try:
        result = collect(_cfg(old.url, docs_file, tmp_path / "run", policies=POLICIES[:2]))
        assert result.ok and result.completed == 6
        assert _traces_requests(old) == 6
    finally:
        old.stop()


def test_a_failing_candidate_fails_alone(server: LiveServer, docs_file: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    engine = server.service.engine
    decode = engine._decode

    def flaky(job, p0, q0, seed, cancelled):
        loop = decode(job, p0, q0, seed, cancelled)
        if job.candidate != "recent@0.5":
            return loop

        def broken():
            answer = None
            for _ in range(3):
                answer = yield loop.send(answer)
            raise RuntimeError("boom")
        return broken()

    monkeypatch.setattr(engine, "_decode", flaky)
    result = collect(_cfg(server.url, docs_file, tmp_path / "run", max_attempts=2))
    assert result.completed == 6 and sorted(result.failed) == sorted(f"{d} × recent@0.5" for d in
                                                                      _doc_ids(docs_file))
    assert all("generation" in why for why in result.failed.values())


def test_a_refused_group_is_resent_policy_by_policy(server: LiveServer, docs_file: Path, tmp_path: Path) -> None:
    result = collect(_cfg(server.url, docs_file, tmp_path / "run", policies=["snapkv@0.5", "bogus@0.5"]))
    assert result.completed == 3
    assert sorted(result.failed) == sorted(f"{d} × bogus@0.5" for d in _doc_ids(docs_file))
    assert all("candidate: " in why for why in result.failed.values())   # the one-policy request's 422


def test_candidates_committed_before_a_cut_stay_complete(server: LiveServer, docs_file: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import collector.collect as C

    lines, bodies = C.ndjson_lines, []
    cut = {"done": False}

    async def cut_after_first_end(chunks):
        async for raw in lines(chunks):
            yield raw
            if not cut["done"] and b'"type":"end"' in raw.replace(b" ", b""):
                cut["done"] = True       # the connection drops once, after one candidate's end
                raise RetryableError("connection lost (cut by the test)")

    def recording(group):
        bodies.append(list(group_body(group)["candidates"]))
        return group_body(group)

    monkeypatch.setattr(C, "ndjson_lines", cut_after_first_end)
    monkeypatch.setattr(C, "group_body", recording)
    result = collect(_cfg(server.url, docs_file, tmp_path / "run", policies=POLICIES[:3]))
    assert cut["done"] and result.ok and result.completed == 9
    first, *rest = bodies
    # the retry of the cut document asks only for the candidates that had not ended
    retried = [b for b in rest if len(b) < len(first)]
    assert len(retried) == 1 and len(retried[0]) == len(first) - 1
    assert len(list((tmp_path / "run" / "requests").glob("*.ndjson"))) == 9


def _doc_ids(docs_file: Path) -> list[str]:
    return [d.id for d in D.read_jsonl(docs_file)]


def test_group_body_and_splitter() -> None:
    a = {"messages": [], "candidate": "a", "parameters": {"seed": 1, "max_new_tokens": 3}, "replicates": 2}
    b = {**a, "candidate": "b", "parameters": {"seed": 9, "max_new_tokens": 3}}
    body = group_body([a, b])
    assert body["candidates"] == ["a", "b"] and body["seeds"] == [1, 9] and "candidate" not in body
    with pytest.raises(ValueError, match="differ"):
        group_body([a, {**b, "replicates": 3}])
    with pytest.raises(ValueError, match="twice"):
        group_body([a, a])
    split = CandidateSplitter(["a", "b"])
    assert split.route(b"\n") is None
    for bad in (b'{"type":"step","step":1}', b'{"type":"step","candidate":"c"}', b'{"type":"header"}', b"{oops"):
        with pytest.raises(StreamError):
            split.route(bad)
