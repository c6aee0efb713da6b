"""The collector against a live tiny:llama service over HTTP: resume equals a whole run."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import xarray as xr
from service_live import LiveServer

from collector import documents as D
from collector.collect import CollectConfig, Collector, collect
from collector.pack import pack_run
from collector.prepare import prepare_run

pytestmark = pytest.mark.service

# Per-request values a server legitimately changes between runs (ids, timing, and the
# digest of a stream that carries them); every trace value must match.
RUN_SPECIFIC = ["request_id", "elapsed_s", "stream_sha256"]


@pytest.fixture(scope="module")
def tiny_server() -> Iterator[str]:
    # served in a thread of this process: the collector only sees HTTP, and a `kvdiv serve`
    # child would add an interpreter start (~10 s); that child is tested in test_demo.py
    server = LiveServer()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture()
def docs_file(tmp_path: Path) -> Path:
    docs = D.select(D.pydoc_documents(None, target_tokens=60), 3)
    return D.write_jsonl(docs, tmp_path / "docs.jsonl")


def _cfg(url: str, docs_file: Path, out: Path) -> CollectConfig:
    return CollectConfig.flat(servers=[url], docs_file=docs_file, policies=["snapkv@0.5", "recent@0.5"], out=out,
                              kind="residual", replicates=3, max_new_tokens=8, window=5, seed=11, progress=False,
                              concurrency=2, backoff_s=0.05,
                              # bit-identical resume needs each request decoded the same way: a policy grouped
                              # with others in one run and alone in the other matches only to rounding
                              # (tests/test_collector_grouped.py)
                              group_candidates=False)


async def _cancel_after(cfg: CollectConfig, k: int) -> None:
    journal, docs = prepare_run(cfg)
    task = asyncio.create_task(Collector(cfg, docs, journal).run())
    while len(list(journal.requests.glob("*.ndjson"))) < k and not task.done():
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_killed_and_resumed_collection_equals_an_uninterrupted_one(tiny_server: str, docs_file: Path,
                                                                   tmp_path: Path) -> None:
    whole = collect(_cfg(tiny_server, docs_file, tmp_path / "whole"))
    assert whole.ok and whole.completed == 6
    asyncio.run(_cancel_after(_cfg(tiny_server, docs_file, tmp_path / "cut"), k=2))
    resumed = collect(_cfg(tiny_server, docs_file, tmp_path / "cut"))
    assert resumed.ok and resumed.skipped >= 2 and resumed.skipped + resumed.completed == 6
    a = pack_run(tmp_path / "whole", progress=False).drop_vars(RUN_SPECIFIC)
    b = pack_run(tmp_path / "cut", progress=False).drop_vars(RUN_SPECIFIC)
    # the server decodes the requests in flight in one batch (--max-batch-requests), with
    # whichever others are there: the same tokens, TV to rounding (docs/service.md)
    for var in a.data_vars:
        if a[var].dtype.kind == "f":
            xr.testing.assert_allclose(a[var], b[var], atol=1e-5, rtol=0)
        else:
            xr.testing.assert_identical(a[var], b[var])
    assert a.attrs == b.attrs and a.coords.equals(b.coords)
    assert a.attrs["model"] == "tiny:llama" and a.sizes["replicate"] == 3
