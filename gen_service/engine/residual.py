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
from dataclasses import dataclass
from typing import Any

import torch

from gen_service.engine.branches import Branches, prefix_branches, replay_branches
from gen_service.engine.context import LoopContext
from gen_service.engine.coupling import CoupledDraw, History, absorb_eos, maximal_coupling, probs
from gen_service.engine.sides import Forward, Prefilled, cache_lengths
from gen_service.engine.top_logprobs import LogitFields, at_steps, logit_fields
from gen_service.presses.quantized import is_quantized
from protocols import shared_step_record, wire_logits

__all__ = ["needs_replay", "residual"]


def needs_replay(p0: Prefilled, q0: Prefilled) -> bool:
    """Branch caches are prefixes of the survival caches only when no press acts while
    decoding, no cache is quantized while decoding, and every layer of each side keeps
    the same number of prompt slots."""
    return any(pre.side.press is not None or is_quantized(pre.cache) or len(set(cache_lengths(pre.cache))) != 1
               for pre in (p0, q0))


@dataclass(frozen=True)
class _Survival:
    """The survival path's per-row state after step t, and the branch point drawn so far
    by weighted reservoir sampling: ``t_star`` (0 = none yet) with its residual pair
    (``x0``, ``y0``), its TV and its history counts (``h_star``)."""

    alive: torch.Tensor      # survival path not stopped
    surv: torch.Tensor       # S_t
    mass: torch.Tensor       # Σ_{s≤t} π_s
    t_star: torch.Tensor
    x0: torch.Tensor
    y0: torch.Tensor
    tv_star: torch.Tensor
    h_star: torch.Tensor | None

    @classmethod
    def start(cls, R: int, dev: torch.device, hz: History | None) -> _Survival:
        zeros = torch.zeros(R, dtype=torch.float64, device=dev)
        return cls(torch.ones(R, dtype=torch.bool, device=dev), torch.ones(R, dtype=torch.float64, device=dev),
                   zeros.clone(), torch.zeros(R, dtype=torch.long, device=dev),
                   torch.zeros(R, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.long, device=dev),
                   zeros.clone(), None if hz is None else torch.zeros_like(hz.counts))

    def after(self, t: int, d: CoupledDraw, gen: torch.Generator, hz: History | None) -> _Survival:
        """Step t's draw ``d`` taken in; ``hz`` is the shared history before z_t."""
        delta = d.tv.double()
        pi = torch.where(self.alive, self.surv * delta, torch.zeros_like(self.surv))
        mass = self.mass + pi
        # weighted reservoir sampling of t* ~ π / Σπ, one candidate per row
        u = torch.rand(pi.shape[0], generator=gen, device=pi.device, dtype=torch.float64)
        take = (pi > 0) & (u * mass < pi)
        h_star = None if hz is None else torch.where(take[:, None], hz.counts, self.h_star)
        return _Survival(self.alive & ~d.stop, torch.where(self.alive, self.surv * (1.0 - delta), self.surv), mass,
                         torch.where(take, t, self.t_star), torch.where(take, d.x_res, self.x0),
                         torch.where(take, d.y_res, self.y0), torch.where(take, delta, self.tv_star), h_star)


def _record(t: int, tv: list[float], overlap: list[float], alive: list[float],
            has_token: list[float], logits: dict[str, list] | None = None) -> dict[str, Any]:
    """Step t's shared-step record from its host values (flags as 0.0/1.0). The step where
    a path stops keeps its TV (1) but has no token: min(p, q) is empty, so there is no Z
    to draw; later steps are null altogether. ``logits``: the step's logit traces per row
    (host lists), shown where the TV is."""
    shown = [bool(a) for a in alive]
    return shared_step_record(t, [v if a else None for v, a in zip(tv, shown, strict=True)],
                              [int(z) if a else None for z, a in zip(overlap, has_token, strict=True)],
                              None if logits is None else wire_logits(logits, shown))


def residual(ctx: LoopContext, p0: Prefilled, q0: Prefilled,
             force_replay: bool = False) -> Iterator[dict[str, Any] | list[Forward]]:
    """Yield shared-step records, then branch records, and the forwards each step needs."""
    job, gen = ctx.job, ctx.gen
    R, T = job.replicates, job.horizon
    replay = force_replay or needs_replay(p0, q0)
    start = (p0.side.snapshot(), q0.side.snapshot()) if replay else None
    ps, qs = p0.side, q0.side
    ps.rows(R)
    qs.rows(R)
    lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
    z_end = ctx.running(R)                                  # the EOS id the shared path ended on
    shared: list[torch.Tensor] = []                          # z_t, kept for replayed branches
    shared_logits: list[LogitFields] = []                    # each step's logit traces (device): age 0
    # history penalties: both sides share prompt + z_<t; each row keeps its counts
    # at t* so its two branches continue from their own histories
    h0 = hz = ctx.history(job.prompt_ids + job.question_ids, R, lp.shape[-1])
    state = _Survival.start(R, ctx.device, hz)
    # the records' values stay on the device between host copies, and so do their logit traces
    out = ctx.readback(lambda t, *values: _record(t, *values, shared_logits[t - 1].host() if job.top_logprobs
                                                  else None))
    for t in range(1, T + 1):
        ctx.check()
        lp, lq = ctx.finite(t, f"step {t}", lp, lq)
        p = absorb_eos(probs(lp, job.sampling, hz), z_end >= 0, z_end)
        q = absorb_eos(probs(lq, job.sampling, hz), z_end >= 0, z_end)
        d = maximal_coupling(p, q, gen)
        if job.top_logprobs:
            shared_logits.append(logit_fields(p, q, job.top_logprobs))
        records = out.emit(t, d.tv, d.overlap, state.alive, state.alive & ~d.stop, last=t == T)
        state = state.after(t, d, gen, hz)
        if hz is not None:
            hz = hz.add(d.overlap)
        yield from records
        z_end = ctx.ended(z_end, d.overlap)
        shared.append(d.overlap)
        if t < T:
            lp, lq = yield [Forward(ps, d.overlap, ctx.pos(ps, R, t)), Forward(qs, d.overlap, ctx.pos(qs, R, t))]
    branch = Branches(state.t_star, state.x0, state.y0, state.tv_star, job.window or T, T,
                      at_steps(shared_logits, state.t_star) if job.top_logprobs else None)
    if branch.rows and start is not None:
        yield from replay_branches(ctx, start, torch.stack(shared, 1), branch, h0)
    elif branch.rows:
        yield from prefix_branches(ctx, ps, qs, p0.kept_slots, q0.kept_slots, branch, state.h_star)
    yield from branch.records(ctx.guard)
