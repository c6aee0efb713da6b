"""The residual loop (docs/statistics.md §5): survival on a shared history, then branches.

1. survival: both models decode the shared history z for T steps; each step records
   δ_t, draws z_t from min(p, q)/(1 − δ_t) and also draws the residual pair
   X ~ (p − q)⁺/δ, Y ~ (q − p)⁺/δ;
2. the branch point t* ~ π_t/(1 − S_T) is drawn *online* by weighted reservoir
   sampling (replace the current candidate with probability π_t / Σ_{s≤t} π_s), so
   the residual pair at t* is already in hand without storing (R, T, V) distributions;
3. branches (:mod:`gen_service.engine.branches`): as prefixes of the survival caches
   where decoding never changes the prompt's part, else replayed from a snapshot taken
   right after prefill (:func:`needs_replay`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gen_service.coupling import absorb_eos, maximal_coupling, probs
from gen_service.engine.branches import Branches, prefix_branches, replay_branches
from gen_service.engine.context import LoopContext
from gen_service.engine.sides import Forward, Prefilled, cache_lengths
from gen_service.quantized import is_quantized
from protocols import shared_step_record

__all__ = ["needs_replay", "residual"]


def needs_replay(p0: Prefilled, q0: Prefilled) -> bool:
    """Branch caches are prefixes of the survival caches only when no press acts while
    decoding, no cache is quantized while decoding, and every layer of each side keeps
    the same number of prompt slots."""
    return any(pre.side.press is not None or is_quantized(pre.cache) or len(set(cache_lengths(pre.cache))) != 1
               for pre in (p0, q0))


def residual(ctx: LoopContext, p0: Prefilled, q0: Prefilled,
             force_replay: bool = False) -> Iterator[dict[str, Any] | list[Forward]]:
    """Yield shared-step records, then branch records, and the forwards each step needs."""
    job, eos, dev, gen = ctx.job, ctx.eos, ctx.device, ctx.gen
    R, T = job.replicates, job.horizon
    W = job.window or T
    replay = force_replay or needs_replay(p0, q0)
    start = (p0.side.snapshot(), q0.side.snapshot()) if replay else None
    ps, qs = p0.side, q0.side
    ps.rows(R)
    qs.rows(R)
    lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
    z_done = torch.zeros(R, dtype=torch.bool, device=dev)
    alive = torch.ones(R, dtype=torch.bool, device=dev)       # survival path not stopped
    surv = torch.ones(R, dtype=torch.float64, device=dev)     # S_{t-1}
    mass = torch.zeros(R, dtype=torch.float64, device=dev)    # Σ_{s≤t} π_s
    t_star = torch.zeros(R, dtype=torch.long, device=dev)
    x0 = torch.zeros(R, dtype=torch.long, device=dev)
    y0 = torch.zeros(R, dtype=torch.long, device=dev)
    tv_star = torch.zeros(R, dtype=torch.float64, device=dev)
    shared: list[torch.Tensor] = []                          # z_t, kept for replayed branches
    # history penalties: both sides share prompt + z_<t; each row keeps its counts
    # at t* so its two branches continue from their own histories
    h0 = hz = ctx.history(job.prompt_ids + job.question_ids, R, lp.shape[-1])
    h_star = None if hz is None else torch.zeros_like(hz.counts)
    for t in range(1, T + 1):
        ctx.check()
        p = absorb_eos(probs(lp, job.sampling, hz), z_done, eos)
        q = absorb_eos(probs(lq, job.sampling, hz), z_done, eos)
        d = maximal_coupling(p, q, gen)
        delta = d.tv.double()
        pi = torch.where(alive, surv * delta, torch.zeros_like(surv))
        mass += pi
        # weighted reservoir sampling of t* ~ π / Σπ, one candidate per row
        u = torch.rand(R, generator=gen, device=dev, dtype=torch.float64)
        take = (pi > 0) & (u * mass < pi)
        t_star = torch.where(take, t, t_star)
        x0 = torch.where(take, d.x_res, x0)
        y0 = torch.where(take, d.y_res, y0)
        tv_star = torch.where(take, delta, tv_star)
        if hz is not None:
            h_star = torch.where(take[:, None], hz.counts, h_star)
            hz = hz.add(d.overlap)
        # The step where a path stops keeps its TV (1) but has no token: min(p, q) is
        # empty, so there is no Z to draw; later steps are null altogether.
        shown, has_token = alive.tolist(), (alive & ~d.stop).tolist()
        yield shared_step_record(
            t, [v if a else None for v, a in zip(d.tv.tolist(), shown, strict=True)],
            [v if a else None for v, a in zip(d.overlap.tolist(), has_token, strict=True)])
        surv = torch.where(alive, surv * (1.0 - delta), surv)
        alive &= ~d.stop
        if eos is not None:
            z_done |= d.overlap == eos
        shared.append(d.overlap)
        if t < T:
            lp, lq = yield [Forward(ps, d.overlap, ctx.pos(ps, R, t)), Forward(qs, d.overlap, ctx.pos(qs, R, t))]
    branch = Branches(t_star, x0, y0, tv_star, W, T)
    if branch.rows and start is not None:
        yield from replay_branches(ctx, start, torch.stack(shared, 1), branch, h0)
    elif branch.rows:
        yield from prefix_branches(ctx, ps, qs, p0.kept_slots, q0.kept_slots, branch, h_star)
    yield from branch.records()
