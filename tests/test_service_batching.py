"""Continuous batching across ``/v1/traces`` requests (gen_service/serving/batching.py).

Requests decoded in one batch must each give the trace they give alone: the same
tokens, TV to floating-point rounding (stacking changes only the batch of the
row-wise matmuls). A request cancelled, or failing, ends alone; the memory budget
and ``max_requests`` bound the batch; ``--max-batch-requests 1`` is the unbatched
path; ``/info`` and ``/metrics`` report the batch.
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: busy-waiting threads collapse on shared cores (see docs/service.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from service_live import PROMPT, LiveServer

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import CandidateDone, Sampling, TraceJob
from gen_service.errors import Cancelled, ConfigError
from gen_service.models.loading import load_model
from gen_service.serving.batching import BatchEntry, BatchingChoice, BatchLoop
from gen_service.serving.service import Metrics, ServiceConfig
from protocols import assemble, read_stream

DECODING = "kvpress:DecodingPress(KnormPress):compression_interval=4,target_size=64"


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _job(prompt: range, kind: str = "coupled", **kw: Any) -> TraceJob:
    kw.setdefault("candidate", "snapkv@0.5")
    return TraceJob(prompt_ids=list(prompt), horizon=8, replicates=4, sampling=Sampling(), kind=kind,
                    window=7 if kind == "residual" else None, request_id="r", **kw)


# Different prompts (lengths 100, 60, 80, 40), a multi-candidate request, the full control
# alone and as a candidate, a decoding-time press (its Q side cannot stack: that request
# runs its forwards as alone), different seeds.
JOBS = [
    dict(prompt=range(10, 110), candidate="snapkv@0.5", seed=1),
    dict(prompt=range(200, 260), candidate="recent@0.5", seed=2),
    dict(prompt=range(5, 85), candidate="", candidates=["snapkv@0.5", "recent@0.5", "full"], seeds=[3, 4, 5]),
    dict(prompt=range(10, 110), candidate="full", seed=6),
    dict(prompt=range(60, 100), candidate=DECODING, seed=7),
]


class Stream:
    """What the batch loop needs of a :class:`~gen_service.serving.service.WorkStream`, recording it."""

    def __init__(self, stop_after: int | None = None):
        self.items: list[Any] = []
        self.ended: list[BaseException | None] = []
        self.stop_after = stop_after

    def stopped(self) -> bool:
        return self.stop_after is not None and len(self.items) >= self.stop_after

    def put(self, item: Any) -> None:
        self.items.append(item)

    def end(self, exc: BaseException | None) -> None:
        self.ended.append(exc)


class Inline:
    """An executor that runs what it was given when drained (the model thread, in the test's thread)."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []

    def submit(self, fn: Callable[[], None]) -> None:
        self.queue.append(fn)

    def drain(self) -> None:
        while self.queue:
            self.queue.pop(0)()


def _batch(engine: Engine, jobs: list[TraceJob], streams: list[Stream] | None = None, max_requests: int = 8,
           budget: int = 1 << 50, costs: list[int] | None = None) -> tuple[list[Stream], Metrics]:
    """Every job submitted before the loop starts, then the loop run to the end."""
    executor, metrics = Inline(), Metrics()
    loop = BatchLoop(executor, engine.runner, max_requests, budget, metrics)
    streams = streams or [Stream() for _ in jobs]
    for i, (job, stream) in enumerate(zip(jobs, streams, strict=True)):
        loop.submit(BatchEntry(stream, lambda c, job=job: engine.trace_steps(job, c),
                               costs[i] if costs else 0, job.replicates))
    executor.drain()
    return streams, metrics


def _assert_same(a: list[Any], b: list[Any], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b, strict=True):
        if not isinstance(ra, dict):
            assert ra == rb
            continue
        assert ra.keys() == rb.keys()
        for key, va in ra.items():
            if key == "tv":
                assert all((x is None and y is None) or math.isclose(x, y, abs_tol=tol)
                           for x, y in zip(va, rb[key], strict=True))
            else:
                assert va == rb[key], key


def _alone(lm: Any, job: TraceJob) -> list[Any]:
    engine = Engine(lm)
    engine.fuse = "off"
    return list(engine.trace(job))


def _counting(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record how many forwards each stacked forward runs."""
    sizes: list[int] = []
    stacked = engine._forward_stacked
    monkeypatch.setattr(engine, "_forward_stacked", lambda fs: sizes.append(len(fs)) or stacked(fs))
    return sizes


@pytest.mark.parametrize("kind", ["coupled", "residual"])
def test_requests_batched_equal_each_alone(lm, kind, monkeypatch):
    engine = Engine(lm)
    engine.fuse = "off"
    sizes = _counting(engine, monkeypatch)
    jobs = [_job(kind=kind, **j) for j in JOBS]
    streams, metrics = _batch(engine, jobs)
    for job, stream in zip(jobs, streams, strict=True):
        assert stream.ended == [None]
        _assert_same(stream.items, _alone(lm, job))
    # P's rows of the four stackable requests (six candidates) in one forward
    assert max(sizes) == 6
    # the control's P and Q rows sit in batches of the same make-up: TV exactly 0
    control = [rec for rec in streams[3].items[1:] + streams[2].items
               if isinstance(rec, dict) and rec.get("candidate", "full") == "full" and "tv" in rec]
    assert control and all(x in (0.0, None) for rec in control for x in rec["tv"])
    occupancy = metrics.batch_occupancy.collect()[0].samples
    assert {s.name: s.value for s in occupancy if s.labels.get("le") == "3.0"}["kvdiv_batch_occupancy_bucket"] < \
        {s.name: s.value for s in occupancy if s.name == "kvdiv_batch_occupancy_count"}["kvdiv_batch_occupancy_count"]


def test_a_cancelled_request_leaves_the_others_as_alone(lm):
    engine = Engine(lm)
    engine.fuse = "off"
    jobs = [_job(**j) for j in JOBS[:3]]
    streams = [Stream(), Stream(stop_after=3), Stream()]   # the second: header and two steps, then gone
    _batch(engine, jobs, streams)
    assert len(streams[1].items) == 3 and isinstance(streams[1].ended[0], Cancelled)
    for i in (0, 2):
        assert streams[i].ended == [None]
        _assert_same(streams[i].items, _alone(lm, jobs[i]))


def test_a_failing_request_leaves_the_others_as_alone(lm, monkeypatch):
    engine = Engine(lm)
    engine.fuse = "off"
    decode = engine._decode

    def flaky(job, p0, q0, seed, cancelled):
        loop = decode(job, p0, q0, seed, cancelled)
        if job.seed != 2:
            return loop

        def broken() -> Iterator[Any]:
            answer = None
            for _ in range(4):
                answer = yield loop.send(answer)
            raise RuntimeError("boom")
        return broken()

    monkeypatch.setattr(engine, "_decode", flaky)
    jobs = [_job(**j) for j in JOBS]
    jobs.append(_job(range(10, 50), candidate="nosuchpolicy@0.5", seed=9))   # fails building its policy
    streams, _ = _batch(engine, jobs)
    assert "boom" in str(streams[1].ended[0]) and streams[5].items == [] and streams[5].ended[0] is not None
    for i in (0, 2, 3, 4):
        assert streams[i].ended == [None]
        _assert_same(streams[i].items, _alone(lm, jobs[i]))
    assert any(isinstance(item, CandidateDone) for item in streams[2].items)


def test_the_budget_and_max_requests_bound_the_batch(lm, monkeypatch):
    engine = Engine(lm)
    engine.fuse = "off"
    sizes = _counting(engine, monkeypatch)
    jobs = [_job(**j) for j in JOBS[:2] + JOBS[3:4]]   # three single-candidate requests
    # each costs 10 of a budget of 25: two live at once, the third joins when one leaves
    streams, _ = _batch(engine, jobs, costs=[10, 10, 10], budget=25)
    assert max(sizes) == 2 and all(s.ended == [None] for s in streams)
    sizes.clear()
    _batch(engine, jobs, max_requests=2)
    assert max(sizes) == 2
    sizes.clear()
    # a request larger than the whole budget alone still runs once the batch is empty
    # (the gate's 422 refuses those that can never fit)
    streams, _ = _batch(engine, jobs, costs=[30, 30, 30], budget=25)
    assert sizes == [] and all(s.ended == [None] for s in streams)   # one at a time: nothing stacked


def test_max_batch_requests_config():
    with pytest.raises(ConfigError, match="--max-batch-requests"):
        ServiceConfig(max_batch_requests=0)
    assert ServiceConfig().max_batch_requests is None   # chosen by device when the server starts


@pytest.mark.parametrize("device, flag, expected, why", [
    ("cpu", None, 1, "0.77x"),          # measured slower batched on CPU: one at a time
    ("cuda", None, 8, "CUDA default"),
    ("mps", None, 1, "without a measurement"),
    ("cpu", 8, 8, "--max-batch-requests 8"),   # the flag wins
])
def test_max_batch_requests_default_by_device(device, flag, expected, why):
    choice = BatchingChoice.for_device(device, flag)
    assert choice.max_requests == expected and why in choice.why
    assert choice.info() == {"max_batch_requests": expected, "max_batch_requests_why": choice.why}


@pytest.mark.service
def test_a_cpu_server_runs_one_request_at_a_time_by_default():
    from gen_service.api.cli import build_service

    _, service = build_service("tiny:llama")
    assert service.batch is None and service.batching == BatchingChoice.for_device("cpu", None)
    with pytest.raises(ValueError, match="max_requests"):
        BatchLoop(Inline(), lambda: None, 0, 1, Metrics())


# ---------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    s = LiveServer(max_new_tokens=64, max_replicates=16, max_batch_requests=4)
    yield s
    s.stop()


@pytest.mark.service
def test_http_concurrent_requests_each_equal_alone(server):
    bodies = [{"inputs": PROMPT * (1 + i % 2), "candidate": pol, "kind": "residual", "replicates": 3, "doc_id": f"d{i}",
               "parameters": {"max_new_tokens": 6, "seed": 10 + i}}
              for i, pol in enumerate(["snapkv@0.5", "recent@0.5", "snapkv@0.9", DECODING])]
    out: dict[int, list[bytes]] = {}

    def post(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            r = c.post("/v1/traces", json=bodies[i])
            assert r.status_code == 200, r.text
            out[i] = [line + b"\n" for line in r.content.split(b"\n") if line]

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.get("/info").json()["kvdiv"]["max_batch_requests"] == 4
        metrics = c.get("/metrics").text
        assert "kvdiv_batch_requests" in metrics and "kvdiv_batch_rows" in metrics
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith("kvdiv_batch_occupancy_")}
        # steps decoded more than one request at once: the requests were batched
        assert values["kvdiv_batch_occupancy_sum"] > values["kvdiv_batch_occupancy_count"] > 0
        for i, body in enumerate(bodies):
            read_stream(out[i])   # its own digest and order
            r = c.post("/v1/traces", json=body)   # alone now: nothing else is running
            alone = assemble([line + b"\n" for line in r.content.split(b"\n") if line])
            ds = assemble(out[i])
            for var in ds.data_vars:
                if var.endswith("token") or var == "branch_step":
                    assert (ds[var].values == alone[var].values).all(), (i, var)
                elif var.endswith("tv"):
                    assert float(abs(ds[var].fillna(0) - alone[var].fillna(0)).max()) < 1e-5, (i, var)
        # a plain generation gets the model thread between trace requests
        assert c.post("/generate", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).status_code == 200


@pytest.mark.service
def test_http_max_batch_requests_1_runs_each_request_alone():
    s = LiveServer(max_new_tokens=64, max_batch_requests=1)
    try:
        assert s.service.batch is None   # the unbatched path: Engine.trace alone on the model thread
        with httpx.Client(base_url=s.url, timeout=60) as c:
            info = c.get("/info").json()["kvdiv"]
            assert info["max_batch_requests"] == 1 and info["max_batch_requests_why"] == "--max-batch-requests 1"
            r = c.post("/v1/traces", json={"inputs": PROMPT, "candidate": "snapkv@0.5", "replicates": 2,
                                           "parameters": {"max_new_tokens": 4, "seed": 3}})
            assert r.status_code == 200
            read_stream([line + b"\n" for line in r.content.split(b"\n") if line])
    finally:
        s.stop()
