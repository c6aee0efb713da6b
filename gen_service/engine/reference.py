"""The reference loop (docs/statistics.md §7): P samples, Q scores P's token on the same history.

Each replicate is one path drawn from P. Q decodes along that path with its own
compressed cache (a press acting while decoding compresses along it too) and is never
sampled: at each step it is asked only how likely P's token was. The records carry the
token, log p and log q of it and the TV between the two laws, which is what the
importance-weighted estimators of §7 and the self-speculative acceptance rates
min(1, q/p) read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from gen_service.engine.context import LoopContext
from gen_service.engine.coupling import absorb_eos, categorical, probs, tv
from gen_service.engine.sides import Forward, Prefilled
from gen_service.engine.top_logprobs import PendingLogits
from protocols import reference_step_record

__all__ = ["reference", "token_logprob"]


def token_logprob(law: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log law(token) per row, in float64 (-inf where the law gives the token no mass).

    Parameters
    ----------
    law : torch.Tensor
        (rows, V) a processed next-token law (:func:`gen_service.engine.coupling.probs`).
    tokens : torch.Tensor
        (rows,) token ids.

    Returns
    -------
    torch.Tensor
        (rows,) float64.

    Examples
    --------
    >>> token_logprob(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([2])).tolist()
    [-inf]
    """
    return law.gather(-1, tokens[:, None]).squeeze(-1).double().log()


def reference(ctx: LoopContext, p0: Prefilled, q0: Prefilled) -> Iterator[dict[str, Any] | list[Forward]]:
    """Yield reference-step records, and the P and Q forwards each next step needs (send back their logits).

    Both sides are fed P's token, so both laws are on the same history x_<t: the
    history penalties count that one path for both, and once P ends on an EOS id both
    laws are its point mass (log p = log q = 0, TV 0).
    """
    job = ctx.job
    R, T = job.replicates, job.horizon
    ps, qs = p0.side, q0.side
    ps.rows(R)
    qs.rows(R)
    lp, lq = p0.logits.expand(R, -1), q0.logits.expand(R, -1)
    x_end = ctx.running(R)          # the EOS id each path ended on, -1 while running
    hist = ctx.history(job.prompt_ids + job.question_ids, R, lp.shape[-1])
    # the records' values (and logit traces) stay on the device, read back every k steps
    # (gen_service.engine.readback)
    logits = PendingLogits(job.top_logprobs)
    out = ctx.readback(lambda t, d, x, lpx, lqx: reference_step_record(t, d, [int(v) for v in x], lpx, lqx,
                                                                     logits.wire(t)))
    for t in range(1, T + 1):
        ctx.check()
        done = x_end >= 0
        lp, lq = ctx.finite(t, f"step {t}", lp, lq)
        p = absorb_eos(probs(lp, job.sampling, hist), done, x_end)
        q = absorb_eos(probs(lq, job.sampling, hist), done, x_end)
        x = categorical(p, ctx.gen)
        logits.keep(t, p, q)
        yield from out.emit(t, tv(p, q), x, token_logprob(p, x), token_logprob(q, x), last=t == T)
        if hist is not None:
            hist = hist.add(x)
        x_end = ctx.ended(x_end, x)
        if t < T:
            lp, lq = yield [Forward(ps, x, ctx.pos(ps, R, t)), Forward(qs, x, ctx.pos(qs, R, t))]
