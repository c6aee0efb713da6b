"""On a CUDA device (``-m gpu``; skipped without one): the memory estimate bounds what a
request really allocates, measured by torch's allocator. Run by benchmarks/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("kind", ["coupled", "residual"])
@pytest.mark.parametrize("shared", [True, False])
def test_estimate_bounds_the_allocated_peak(kind, shared):
    from gen_service.engine.facade import Engine
    from gen_service.engine.jobs import TraceJob
    from gen_service.models.loading import load_model
    from gen_service.serving.admission import MemoryGate

    engine = Engine(load_model("random:llama-1b", device="cuda", dtype="bfloat16"), shared_prompt=shared)
    text = "A block is a piece of Python program text that is executed as a unit. " * 100
    ids = list(engine.lm.tokenizer(text).input_ids)[:1500]
    R, T = 64, 16
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    job = TraceJob(prompt_ids=ids, candidate="snapkv@0.5", kind=kind, horizon=T, replicates=R, seed=0)
    for _ in engine.trace(job):
        pass
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    est = MemoryGate.for_engine(engine, 1 << 40).estimate(R, len(ids), T, kind)
    assert peak <= est.total, f"measured {peak / 2**20:.0f} MiB > estimate {est.describe()}"
    print(f"{kind} shared={shared}: measured peak {peak / 2**20:.0f} MiB, estimate {est.describe()}")
