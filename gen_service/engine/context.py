"""What every decoding loop of one candidate reads: the job, its generator and the model facts.

One frozen record instead of an engine: the loops (:mod:`~gen_service.engine.coupled`,
:mod:`~gen_service.engine.residual`, :mod:`~gen_service.engine.branches`) are
functions of it and of their sides, and never run a forward themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gen_service.engine.coupling import History, ended_on
from gen_service.engine.jobs import Sampling, TraceJob, check
from gen_service.engine.readback import READBACK_EVERY, FiniteGuard, Readback
from gen_service.engine.sides import Side

__all__ = ["LoopContext", "history"]


@dataclass(frozen=True)
class LoopContext:
    """One candidate's decoding: its job, generator, EOS ids, device and cancellation.

    ``eos`` holds every EOS id of the model (empty: none); each is absorbing, and an
    ended row keeps emitting the id it ended on (:func:`~gen_service.engine.coupling.ended_on`).
    """

    job: TraceJob
    gen: torch.Generator
    eos: tuple[int, ...]
    device: torch.device
    cancelled: Callable[[], bool]
    #: steps between the records' host copies (:class:`~gen_service.engine.readback.Readback`)
    readback_every: int = READBACK_EVERY
    #: ``eos`` on the device, made once (not a host-to-device copy every step)
    eos_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    #: the loop's non-finite logits guard (its flags ride in the readback's host copies)
    guard: FiniteGuard = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.eos:
            ids = torch.tensor(self.eos, dtype=torch.long)
            if self.device.type == "cuda":   # from pinned memory, asynchronously: no host synchronisation
                ids = ids.pin_memory()
            object.__setattr__(self, "eos_ids", ids.to(self.device, non_blocking=True))
        object.__setattr__(self, "guard", FiniteGuard(self.device))

    def running(self, rows: int) -> torch.Tensor:
        """Per-row EOS ids before any step: -1, every row still running."""
        return torch.full((rows,), -1, dtype=torch.long, device=self.device)

    def ended(self, end: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``end`` after a step's ``tokens``: rows that emitted an EOS id now hold it."""
        return ended_on(end, tokens, self.eos_ids)

    def readback(self, build: Callable[..., Any]) -> Readback:
        """A :class:`~gen_service.engine.readback.Readback` building records with ``build``
        (and reading the guard's flags in the same copies)."""
        return Readback(self.readback_every, build, self.guard)

    def finite(self, t: int | None, label: str, lp: torch.Tensor, lq: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """P's and Q's logits of one step with non-finite rows made safe to sample and
        flagged (:class:`~gen_service.engine.readback.FiniteGuard`); before any sampling."""
        return self.guard(t, label, lp, lq)

    def check(self) -> None:
        """Stop between steps once the client has gone."""
        check(self.cancelled)

    def pos(self, side: Side, rows: int, t: int) -> torch.Tensor:
        """Positions of the step-t input (the token drawn at step t) for every row."""
        return torch.full((rows,), side.next_pos + t - 1, dtype=torch.long, device=self.device)

    def history(self, prompt_ids: Sequence[int], rows: int, vocab: int) -> History | None:
        """Each side's token counts for the history penalties; None (free) when none is set."""
        return history(self.job.sampling, prompt_ids, rows, vocab, self.device)


def history(sampling: Sampling, prompt_ids: Sequence[int], rows: int, vocab: int,
            device: torch.device) -> History | None:
    """The prompt's counts on ``rows`` rows when a penalty is set, else None."""
    if not sampling.uses_history:
        return None
    return History.start(list(prompt_ids), rows, vocab, device)
