"""The coupled loop (docs/statistics.md §1–§2): both models decode their own tokens, each
step maximally coupled, all R replicates as rows of one batch per model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gen_service.engine.context import LoopContext
from gen_service.engine.coupling import absorb_eos, maximal_coupling, probs
from gen_service.engine.sides import Forward, Prefilled
from gen_service.engine.top_logprobs import PendingLogits
from protocols import step_record

__all__ = ["coupled"]


def coupled(ctx: LoopContext, p0: Prefilled, q0: Prefilled) -> Iterator[dict[str, Any] | list[Forward]]:
    """Yield step records, and the P and Q forwards each next step needs (send back their logits)."""
    job = ctx.job
    R, T = job.replicates, job.horizon
    ps, qs = p0.side, q0.side
    ps.rows(R)
    qs.rows(R)
    lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
    x_end, y_end = ctx.running(R), ctx.running(R)   # the EOS id each row ended on, -1 while running
    # P and Q are penalised by their own histories (prompt + x_<t, prompt + y_<t)
    hp = hq = ctx.history(job.prompt_ids + job.question_ids, R, lp.shape[-1])
    # TV and tokens stay on the device, read back every k steps (gen_service.engine.readback)
    logits = PendingLogits(job.top_logprobs)    # their logit traces, likewise (none unless asked for)
    out = ctx.readback(lambda t, tv, x, y: step_record(t, tv, [int(v) for v in x], [int(v) for v in y],
                                                      logits.wire(t)))
    for t in range(1, T + 1):
        ctx.check()
        lp, lq = ctx.finite(t, f"step {t}", lp, lq)
        p = absorb_eos(probs(lp, job.sampling, hp), x_end >= 0, x_end)
        q = absorb_eos(probs(lq, job.sampling, hq), y_end >= 0, y_end)
        d = maximal_coupling(p, q, ctx.gen)
        if hp is not None:
            hp, hq = hp.add(d.x), hq.add(d.y)
        logits.keep(t, p, q)
        yield from out.emit(t, d.tv, d.x, d.y, last=t == T)
        x_end, y_end = ctx.ended(x_end, d.x), ctx.ended(y_end, d.y)
        if t < T:
            lp, lq = yield [Forward(ps, d.x, ctx.pos(ps, R, t)), Forward(qs, d.y, ctx.pos(qs, R, t))]
