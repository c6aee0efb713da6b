"""Host synchronisations of the decoding loops: at most one per k steps in steady state.

On CPU an instrumented counter (gen_service.engine.readback.HostReads) counts every
host read of a tensor made by gen_service's code while a request decodes; on CUDA
(marked gpu) torch's sync debug mode counts every synchronisation, whoever makes it.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

import gen_service
from gen_service.engine.coupling import absorb_eos
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.engine.readback import HostReads, Readback
from gen_service.models.loading import load_model

ROOT = os.path.dirname(gen_service.__file__)
T, R = 16, 4


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny:llama")


def _job(**kw) -> TraceJob:
    base = dict(prompt_ids=list(range(10, 70)), horizon=T, replicates=R, seed=7, sampling=Sampling(),
                candidate="snapkv@0.5")
    base.update(kw)
    return TraceJob(**base)


def _decoding_reads(engine: Engine, job: TraceJob, headers: int = 1) -> tuple[int, list]:
    stream = engine.trace(job)
    records = [next(stream) for _ in range(headers)]
    with HostReads([ROOT]) as reads:
        records += list(stream)
    return reads.count, records


@pytest.mark.parametrize("kind", ["coupled", "reference"])
@pytest.mark.parametrize("every", [1, 4, 8])
def test_coupled_reads_the_host_once_per_k_steps(lm, every, kind):
    engine = Engine(lm)
    engine.readback_every = every
    count, records = _decoding_reads(engine, _job(kind=kind))
    assert count == math.ceil(T / every)
    assert [r["step"] for r in records[1:]] == list(range(1, T + 1))    # in order, none lost


def test_residual_survival_once_per_k_steps_branches_at_their_end(lm):
    engine = Engine(lm)
    engine.readback_every = 8
    count, records = _decoding_reads(engine, _job(kind="residual"))
    # two survival copies, then one for the branch points and one for all branch draws
    assert count <= T // 8 + 2
    assert any(r["type"] == "branch" for r in records)


def test_multi_candidate_request_reads_once_per_k_steps_per_candidate(lm):
    engine = Engine(lm)
    engine.readback_every = 8
    job = _job(kind="coupled", candidate="", candidates=["snapkv@0.5", "recent@0.5", "snapkv#30"])
    count, _ = _decoding_reads(engine, job, headers=3)
    assert count == 3 * (T // 8)


@pytest.mark.parametrize("kind", ["coupled", "residual", "reference"])
def test_the_readback_interval_does_not_change_the_trace(lm, kind):
    traces = []
    for every in (1, 5):
        engine = Engine(lm)
        engine.readback_every = every
        traces.append(list(engine.trace(_job(kind=kind, horizon=11))))
    assert traces[0][1:] == traces[1][1:]     # the header holds no step values


def test_branchless_eos_absorption_equals_replacing_the_done_rows():
    p = torch.softmax(torch.randn(4, 6, generator=torch.Generator().manual_seed(0)), -1)
    done = torch.tensor([True, False, True, False])
    ends = torch.tensor([5, -1, 2, -1])
    out = absorb_eos(p, done, ends)
    expect = p.clone()
    expect[0], expect[2] = torch.eye(6)[5], torch.eye(6)[2]
    assert torch.equal(out, expect)
    assert torch.equal(absorb_eos(p, torch.zeros(4, dtype=torch.bool), 3), p)


def test_readback_refuses_a_zero_interval():
    with pytest.raises(ValueError, match="at least 1 step"):
        Readback(0, lambda t: t)


def test_the_counter_sees_reads_of_the_loop_modules_only():
    with HostReads([ROOT]) as reads:
        torch.zeros(3).tolist()          # this file is not under gen_service/
        bool(torch.ones(()))
    assert reads.count == 0
    assert torch.Tensor.tolist is not None and "counted" not in torch.Tensor.tolist.__qualname__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_synchronisations_per_step():
    lm = load_model("tiny:llama", device="cuda")
    engine = Engine(lm)
    engine.fuse = "off"         # the fused forward's measurement synchronises to time its first step
    engine.readback_every = 8
    stream = engine.trace(_job(kind="coupled"))
    next(stream)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            list(stream)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    # one-time copies when the loop starts (the EOS ids, engine/context.py: pinned and
    # asynchronous, so none is expected) are not the per-step waits this counts
    once = [w for w in syncs if w.filename.endswith("engine/context.py")]
    steps = [w for w in syncs if w not in once]
    assert len(once) <= 1, [f"{w.filename}:{w.lineno}" for w in once]
    assert len(steps) <= T // 8, [f"{w.filename}:{w.lineno} {w.message}" for w in steps[:5]]
