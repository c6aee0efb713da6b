"""The control's TV is exactly 0, and a request's records do not depend on its batch-mates.

A grouped request with 4 stacked candidates and the ``full`` control, 8 such requests
decoded together by the batch loop (``--max-batch-requests 8``), fuse on and off,
float32 and bfloat16: the control's TV is 0.0 at every step (its P and Q rows sit in
batches of the same make-up). And one request run alone and merged with 7 others gives
the same records bit for bit, tokens and TV: the pooled prompts are padded to a whole
number of the CPU attention kernel's key blocks (``shared_cache.CPU_KEY_BLOCK``), so a
group's keys fall in the same blocks whatever the longest prompt beside it
(docs/server-design.md, "Batch invariance and the control").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from test_service_batching import Inline, Stream, _batch

from gen_service.attention.cascade import _prompt_part
from gen_service.attention.shared_cache import pooled_length
from gen_service.engine.facade import Engine
from gen_service.engine.jobs import Sampling, TraceJob
from gen_service.models.loading import load_model
from gen_service.serving.batching import BatchEntry, BatchLoop
from gen_service.serving.service import Metrics

CANDIDATES = ["snapkv@0.5", "recent@0.5", "snapkv@0.9", "recent@0.3", "full"]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def lm(request):
    return load_model("tiny:llama", dtype=request.param)


def _job(i: int, candidates: list[str] = CANDIDATES) -> TraceJob:
    """Request i: its own prompt length (50 + 6i tokens) and seeds."""
    return TraceJob(prompt_ids=list(range(10 + 7 * i, 60 + 13 * i)), candidate="", candidates=candidates,
                    seeds=[10 * i + k for k in range(len(candidates))], horizon=4, replicates=2,
                    sampling=Sampling(), request_id=f"r{i}")


def _run(lm, jobs: list[TraceJob], fuse: str) -> list[list]:
    engine = Engine(lm)
    engine.fuse = fuse
    engine.make_batch_invariant()     # as a service decoding requests together does
    streams, _ = _batch(engine, jobs, max_requests=8)
    assert all(s.ended == [None] for s in streams)
    return [s.items for s in streams]


@pytest.mark.parametrize("fuse", ["on", "off"])
def test_control_tv_is_exactly_zero_in_a_merged_batch(lm, fuse):
    out = _run(lm, [_job(i) for i in range(8)], fuse)
    control = [x for items in out for rec in items if isinstance(rec, dict) and rec.get("candidate") == "full"
               and "tv" in rec for x in rec["tv"]]
    assert len(control) == 8 * 4 * 2
    assert all(x == 0.0 for x in control)
    # the candidates beside it do diverge: the check is not vacuous
    assert any(x > 0 for items in out for rec in items if isinstance(rec, dict)
               and rec.get("candidate") not in ("full", None) and "tv" in rec for x in rec["tv"])


@pytest.mark.parametrize("candidates", [CANDIDATES, ["snapkv@0.5"]], ids=["5 candidates", "one candidate"])
@pytest.mark.parametrize("fuse", ["on", "off"])
def test_a_request_alone_and_merged_with_seven_is_bitwise_equal(lm, fuse, candidates):
    """One candidate with fuse off: alone, P's and Q's forwards are a group of one each
    (2 rows): with the engine batch-invariant they go through the stacked path too, and
    every linear product takes at least 16 rows (gen_service.models.row_padding); either
    missing, TV differed by ~5e-7."""
    jobs = [_job(i, candidates) for i in range(8)]
    merged = _run(lm, jobs, fuse)[0]
    alone = _run(lm, jobs[:1], fuse)[0]
    steps = [(a, b) for a, b in zip(alone, merged, strict=True) if isinstance(a, dict) and "tv" in a]
    assert len(alone) == len(merged) and steps
    for a, b in steps:
        assert a == b          # tokens and TV, every field, exactly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("own, longest", [(100, 160), (100, 600), (700, 1200)])
def test_the_prompt_part_does_not_see_a_longer_pool_mate(dtype, own, longest):
    """The CPU kernel on a prompt padded to the pool's key blocks gives the bits of the
    prompt alone padded the same way; padded only to the longest mate it need not."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 12, 16, dtype=dtype)
    k, v = torch.randn(2, 1, 2, own, 16, dtype=dtype)

    def pooled(slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.zeros(2, 2, slots, 16, dtype=dtype)
        vals = torch.zeros_like(keys)
        keys[0, :, :own], vals[0, :, :own] = k[0], v[0]
        keys[1], vals[1] = torch.randn(2, 2, slots, 16, dtype=dtype)
        pad = (torch.arange(slots)[None, :] >= torch.tensor([own, longest])[:, None])[:, None, :]
        out, lse = _prompt_part(torch.cat([q, torch.randn_like(q)]), keys, vals, 0.25, hidden=pad)
        return out[:1], lse[:1]

    def block(n: int) -> int:
        return pooled_length(n, torch.device("cpu"))

    alone = _prompt_part(q, torch.cat([k, k.new_zeros(1, 2, block(own) - own, 16)], 2),
                         torch.cat([v, v.new_zeros(1, 2, block(own) - own, 16)], 2), 0.25,
                         hidden=(torch.arange(block(own)) >= own)[None, None])
    for a, b in zip(alone, pooled(block(longest)), strict=True):
        assert torch.equal(a, b)


def test_a_linear_row_gives_the_same_bits_alone_and_among_many():
    from gen_service.models.row_padding import MIN_ROWS, pad_linear_rows

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(640, 2048), torch.nn.Linear(2048, 640))
    plain = [torch.nn.Linear(640, 2048)]
    plain[0].load_state_dict(model[0].state_dict())
    assert pad_linear_rows(model) == 2 and pad_linear_rows(model) == 2     # idempotent
    x = torch.randn(40, 640)
    for rows in (1, 2, 5, 11, MIN_ROWS, 40):
        for at in sorted({0, rows - 1}):
            batch = torch.randn(rows, 640)
            batch[at] = x[0]
            assert torch.equal(model(batch)[at], model(x)[0]), (rows, at)
            assert torch.allclose(model[0](batch)[at], plain[0](batch)[at], atol=1e-5)
    assert model[0](x[:3, None]).shape == (3, 1, 2048)


def test_a_service_is_batch_invariant_only_when_it_merges_requests():
    from gen_service.serving.service import Service, ServiceConfig

    for merged, want in ((1, 0), (8, 14)):      # 2 layers x (q, k, v, o, gate, up, down)
        engine = Engine(load_model("tiny:llama"))
        Service(engine, ServiceConfig(max_batch_requests=merged))
        assert engine.padded_linears == want and engine.batch_invariant == (merged > 1)
        assert engine.runner().invariant == (merged > 1)

    engine = Engine(load_model("tiny:llama"))
    engine.device = torch.device("cuda")         # unmeasured there: nothing changes
    engine.make_batch_invariant()
    assert not engine.batch_invariant and engine.padded_linears == 0 and not engine.runner().invariant


class _AdmitsAfter(Stream):
    """A stream that, once it holds ``after`` step records, calls ``then`` (once)."""

    def __init__(self, after: int, then):
        super().__init__()
        self.after, self.then = after, then

    def put(self, item) -> None:
        super().put(item)
        if self.then is not None and sum(isinstance(r, dict) and "tv" in r for r in self.items) >= self.after:
            then, self.then = self.then, None
            then()


@pytest.mark.parametrize("fuse", ["on", "off"])
def test_requests_admitted_at_different_steps_are_bitwise_equal_to_alone(lm, fuse, monkeypatch):
    """B joins while A is already some steps in, so the batch's rows' own part spans A's
    longer fill (``StackedPromptCache.seen`` = max(fills) + 1) and B's rows attend
    masked slots they would not have alone: B's records, and A's, must still be the bits
    of each alone."""
    from dataclasses import replace

    from gen_service.attention.shared_cache import StackedPromptCache

    a_job, b_job = replace(_job(0, ["snapkv@0.5"]), horizon=12), _job(1, ["snapkv@0.5", "full"])
    alone = [_run(lm, [job], fuse)[0] for job in (a_job, b_job)]

    fills: list[list[int]] = []
    plan = StackedPromptCache._plan

    def spy(self, caches, rows, masks):
        fills.append([c.layers[0].filled for c in caches])
        return plan(self, caches, rows, masks)

    monkeypatch.setattr(StackedPromptCache, "_plan", spy)
    engine = Engine(lm)
    engine.fuse = fuse
    engine.make_batch_invariant()
    executor, b_stream = Inline(), Stream()
    loop = BatchLoop(executor, engine.runner, 8, 1 << 50, Metrics())
    entry = lambda job, stream: BatchEntry(stream, lambda c: engine.trace_steps(job, c), 0, job.replicates)  # noqa: E731
    a_stream = _AdmitsAfter(2, lambda: loop.submit(entry(b_job, b_stream)))
    loop.submit(entry(a_job, a_stream))
    executor.drain()
    assert a_stream.ended == [None] and b_stream.ended == [None]
    assert any(len(set(f)) > 1 for f in fills)          # rows at different steps did share forwards
    for got, want in zip((a_stream.items, b_stream.items), alone, strict=True):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert a == b
