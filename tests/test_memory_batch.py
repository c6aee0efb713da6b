"""Memory admitted is memory allocated, for a merged decoding batch (gen_service/memory.py
``batch_bytes``, gen_service/batching.py).

Requests decoded together pad every prompt to the batch's longest and size every row's
buffer for the largest T: the batch's estimate must bound what torch allocates on the
CPU while the batch runs, where the sum of each request's own estimate did not.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
from test_memory import _peak_bytes
from test_service_batching import Inline, Stream

from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.loading import load_model
from gen_service.serving.admission import MemoryGate, batch_bytes
from gen_service.serving.batching import BatchEntry, BatchLoop, merged_bytes
from gen_service.serving.service import Metrics


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _jobs(specs: list[tuple[int, int, str]], rows: int, kind: str) -> list[TraceJob]:
    return [TraceJob(prompt_ids=[10 + (i * 7 + j) % 250 for j in range(length)], candidate=policy, kind=kind,
                     horizon=T, replicates=rows, sampling=Sampling(), seed=i, request_id=f"r{i}",
                     window=T if kind == "residual" else None)
            for i, (length, T, policy) in enumerate(specs)]


def _run_batch(engine: Engine, jobs: list[TraceJob], sizes) -> list[Stream]:
    executor = Inline()
    loop = BatchLoop(executor, engine.runner, 8, 1 << 50, Metrics())
    streams = [Stream() for _ in jobs]
    for job, stream, size in zip(jobs, streams, sizes, strict=True):
        loop.submit(BatchEntry(stream, lambda c, job=job: engine.trace_steps(job, c), size, job.replicates))
    executor.drain()
    return streams


@pytest.mark.model
@pytest.mark.parametrize(("specs", "kind"), [
    # seven short requests and one long one (the shape, shortened for the CPU)
    ([(40, 16, "snapkv@0.5")] * 7 + [(40, 64, "snapkv@0.5")], "coupled"),
    # seven short prompts and one long one, mixed policies, residual
    ([(40, 16, "recent@0.5")] * 4 + [(40, 16, "full")] * 3 + [(320, 16, "snapkv@0.5")], "residual"),
])
def test_the_batch_estimate_bounds_what_a_merged_batch_allocates(lm, specs, kind):
    engine = Engine(lm)
    engine.fuse = "off"
    gate = MemoryGate.for_engine(engine, 1 << 40)
    rows = 8
    jobs = _jobs(specs, rows, kind)
    sizes = [gate.size(rows, len(j.prompt_ids), j.horizon, kind) for j in jobs]
    streams: list[Stream] = []
    # earlier tests' garbage freed by a collection during the run would count as negative
    # allocations and lower the peak: collect it first, and none during the run
    gc.collect()
    gc.disable()
    try:
        peak = _peak_bytes(lambda: streams.extend(_run_batch(engine, jobs, sizes)))
    finally:
        gc.enable()
    assert all(s.ended == [None] for s in streams)
    own = sum(s.total for s in sizes)         # each request at its own prompt and T (the old count)
    merged = batch_bytes(sizes)
    mib = 1 << 20
    print(f"\n{kind}: measured {peak / mib:.1f} MiB, own estimates {own / mib:.1f}, merged {merged / mib:.1f}")
    assert merged == merged_bytes([BatchEntry(s, None, size) for s, size in zip(streams, sizes, strict=True)])
    assert peak <= merged, f"measured {peak / mib:.1f} MiB > the batch's estimate {merged / mib:.1f} MiB"
    assert merged <= 4 * peak, f"the estimate {merged / mib:.1f} MiB is over 4x the {peak / mib:.1f} MiB measured"


def test_a_request_joins_only_while_the_merged_batch_fits(lm):
    engine = Engine(lm)
    gate = MemoryGate.for_engine(engine, 1 << 40)
    short = [gate.size(4, 40, 8)] * 3
    long = gate.size(4, 40, 200)
    budget = sum(s.total for s in short + [long]) + 1     # the sum of own estimates fits...
    assert batch_bytes(short + [long]) > budget               # ...the merged batch does not
    jobs = _jobs([(40, 8, "snapkv@0.5")] * 3 + [(40, 200, "snapkv@0.5")], 4, "coupled")
    executor, seen = Inline(), []
    loop = BatchLoop(executor, engine.runner, 8, budget, Metrics())
    step = loop._step
    loop._step = lambda live: seen.append(len(live)) or step(live)   # requests decoded per step
    for job, size in zip(jobs, short + [long], strict=True):
        loop.submit(BatchEntry(Stream(), lambda c, job=job: engine.trace_steps(job, c), size, job.replicates))
    executor.drain()
    assert max(seen) == 3   # the long one waited for the others to leave
