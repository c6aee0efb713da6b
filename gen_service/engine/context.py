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

from gen_service.engine.coupling import History, Sampling, ended_on
from gen_service.engine.jobs import TraceJob, check
from gen_service.engine.readback import READBACK_EVERY, Readback
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

    def __post_init__(self) -> None:
        if self.eos:
            object.__setattr__(self, "eos_ids", torch.tensor(self.eos, dtype=torch.long, device=self.device))

    def running(self, rows: int) -> torch.Tensor:
        """Per-row EOS ids before any step: -1, every row still running."""
        return torch.full((rows,), -1, dtype=torch.long, device=self.device)

    def ended(self, end: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``end`` after a step's ``tokens``: rows that emitted an EOS id now hold it."""
        return ended_on(end, tokens, self.eos_ids)

    def readback(self, build: Callable[..., Any]) -> Readback:
        """A :class:`~gen_service.engine.readback.Readback` building records with ``build``."""
        return Readback(self.readback_every, build)

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
