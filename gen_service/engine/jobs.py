"""What a trace request asks for, and what the engine says back besides records.

:class:`TraceJob` is the checked ``/v1/traces`` request; the rest are the signals the
drivers give the HTTP layer: a client gone (:class:`~gen_service.errors.Cancelled`), a candidate failed in
prefill (:class:`~gen_service.errors.CandidateError`, before anything streams) or while decoding
(:class:`CandidateFailed`, the others go on), a candidate's records all out
(:class:`CandidateDone`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gen_service.engine.coupling import Sampling
from gen_service.errors import Cancelled

__all__ = ["PRODUCER", "CandidateDone", "CandidateFailed", "TraceJob", "check", "draw_seed", "seeded"]

PRODUCER = "kvdiv.gen_service"


@dataclass(frozen=True)
class CandidateDone:
    """Yielded by :meth:`Engine.trace` (multi-candidate) when a candidate's records are all out."""

    policy: str


@dataclass(frozen=True)
class CandidateFailed:
    """Yielded by :meth:`Engine.trace` (multi-candidate) when one candidate fails while decoding;
    the other candidates go on."""

    policy: str
    error: BaseException


@dataclass
class TraceJob:
    """A validated ``/v1/traces`` request."""

    prompt_ids: list[int]                 # the context: the part a press compresses
    candidate: str
    reference: str = "full"
    kind: str = "coupled"
    horizon: int = 32
    replicates: int = 1
    window: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None
    doc: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    question_ids: list[int] = field(default_factory=list)   # prefilled after compression, never compressed
    # several candidates in one request (records tagged with ``candidate``); ``seeds`` parallel,
    # None where the server draws one; ``candidate`` is then unused
    candidates: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=list)
    # logit traces: P's and Q's top-k and KL/entropy at every step (0: none; gen_service.engine.top_logprobs)
    top_logprobs: int = 0

    @property
    def prompt_len(self) -> int:
        """Positions taken by the prompt (context + question)."""
        return len(self.prompt_ids) + len(self.question_ids)


def check(cancelled: Callable[[], bool]) -> None:
    """Raise :class:`Cancelled` once the client has gone (called between steps)."""
    if cancelled():
        raise Cancelled()


def draw_seed() -> int:
    """A seed for a request that gave none (torch's global generator)."""
    return int(torch.randint(0, 2**31 - 1, ()).item())


def seeded(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: one per candidate (its draws are its own)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return gen
