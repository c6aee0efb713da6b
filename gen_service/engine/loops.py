"""The decoding loop of one candidate, chosen by the job's kind.

:data:`LOOPS` is the table (kind -> loop); :func:`decode` builds the candidate's
:class:`~gen_service.engine.context.LoopContext` and starts its loop. Every loop is a
generator of records and of the :class:`~gen_service.engine.sides.Forward` lists it
needs run (the scheduler runs them). A new streamed trace kind is one loop module and
one row here (docs/architecture.md, "Adding things").
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from gen_service.engine.context import LoopContext
from gen_service.engine.coupled import coupled
from gen_service.engine.jobs import TraceJob
from gen_service.engine.readback import READBACK_EVERY
from gen_service.engine.reference import reference
from gen_service.engine.residual import residual
from gen_service.engine.sides import Prefilled
from protocols import Kind

__all__ = ["LOOPS", "decode"]

Loop = Callable[[LoopContext, Prefilled, Prefilled, bool], Iterator[Any]]

#: kind -> its loop (ctx, p0, q0, force_replay); only the residual loop replays branches.
LOOPS: dict[Kind, Loop] = {
    Kind.COUPLED: lambda ctx, p0, q0, force_replay: coupled(ctx, p0, q0),
    Kind.RESIDUAL: residual,
    Kind.REFERENCE: lambda ctx, p0, q0, force_replay: reference(ctx, p0, q0),
}


def decode(job: TraceJob, p0: Prefilled, q0: Prefilled, gen: torch.Generator, eos: Collection[int],
           device: torch.device, cancelled: Callable[[], bool] = lambda: False, *,
           readback_every: int = READBACK_EVERY, force_replay: bool = False) -> Iterator[Any]:
    """One candidate's decoding loop for ``job.kind``: records, and the forwards it needs run.

    Parameters
    ----------
    job : TraceJob
        The request (its ``kind`` picks the loop).
    p0, q0 : Prefilled
        P's and Q's prompt states.
    gen : torch.Generator
        The candidate's generator, seeded with its seed.
    eos : collection of int
        The model's EOS ids.
    device : torch.device
        Where the loop's tensors live.
    cancelled : callable
        True once the client went away.
    readback_every : int
        Decoding steps between the records' host copies.
    force_replay : bool
        Replay residual branches even where they could be prefixes of the survival caches.

    Returns
    -------
    iterator
        The loop (a generator: nothing runs until it is advanced).
    """
    ctx = LoopContext(job, gen, eos, device, cancelled, readback_every)
    return LOOPS.get(job.kind, residual)(ctx, p0, q0, force_replay)
