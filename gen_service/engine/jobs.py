"""What a trace request asks for, and what the engine says back besides records. Torch-free:
parsing and admitting a request (gen_service/api/records.py, gen_service/serving/intake.py) import
this module and no torch.

:class:`TraceJob` is the ``/v1/traces`` request: its fields and their defaults, held once for
the parser, the intake and the engine; the intake fills in the prompt's tokens and the policies
it built (:class:`Built`), which the engine runs without building them again. :class:`Sampling`
is the kernels' sampling transform. The rest are the signals the drivers give the HTTP layer: a
client gone (:class:`~gen_service.errors.Cancelled`), a candidate failed in prefill
(:class:`~gen_service.errors.CandidateError`, before anything streams) or while decoding
(:class:`CandidateFailed`, the others go on), a candidate's records all out (:class:`CandidateDone`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gen_service.errors import Cancelled

if TYPE_CHECKING:
    from gen_service.presses.registry import Policy, PressPlan

__all__ = ["PRODUCER", "Built", "CandidateDone", "CandidateFailed", "Policies", "Sampling", "TraceJob", "check"]

PRODUCER = "kvdiv.gen_service"


@dataclass(frozen=True)
class Sampling:
    """Sampling transform applied identically to the P and Q logits (docs/statistics.md §1).

    The order is TGI's: the history penalties (repetition, then frequency and
    presence) on the raw logits, then temperature, top-k, top-p and typical-p. The
    penalties read each side's own history (prompt + tokens decoded so far on that
    side, see :class:`History`), so in a coupled trace P and Q are penalised by
    different histories once they have diverged.

    Examples
    --------
    >>> Sampling(temperature=0.0).greedy
    True
    >>> Sampling(repetition_penalty=1.2).uses_history
    True
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool = True
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    typical_p: float | None = None

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether the law depends on the tokens seen so far (a penalty is active)."""
        return (self.repetition_penalty not in (None, 1.0) or self.frequency_penalty not in (None, 0.0)
                or self.presence_penalty not in (None, 0.0))

    def as_dict(self) -> dict:
        out = {"temperature": 0.0 if self.greedy else float(self.temperature),
               "top_k": self.top_k, "top_p": self.top_p, "do_sample": not self.greedy}
        # the penalties appear only when set, so headers of plain requests keep their shape
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "typical_p"):
            if getattr(self, name) is not None:
                out[name] = float(getattr(self, name))
        return out


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


class Built:
    """One policy of a job, built once for the job's prompt (by the intake,
    :mod:`gen_service.serving.intake`): the checked :class:`~gen_service.presses.registry.Policy`
    and its plan for the context (``prepared``, which the intake sizes the request's memory with).

    The first prefill of this policy takes ``prepared`` (:meth:`plan`); a plan is used once,
    since its press holds one run's state, so a second prefill of the same policy (a compressing
    reference, prefilled once per candidate) gets a fresh plan from the policy.

    Parameters
    ----------
    id : str
        The policy id as the request gave it.
    policy : Policy
        What :meth:`gen_service.presses.registry.PolicyRegistry.build` returned.
    context_tokens : int
        The tokens its press compresses (the context; not a question).
    """

    def __init__(self, id: str, policy: Policy, context_tokens: int):
        self.id, self.policy, self.context_tokens = id, policy, context_tokens
        self.prepared: PressPlan = policy.plan(context_tokens)
        self._taken = False

    def plan(self, prompt_len: int) -> PressPlan:
        """The plan for a prefill of ``prompt_len`` tokens: ``prepared`` the first time."""
        if not self._taken and prompt_len == self.context_tokens:
            self._taken = True
            return self.prepared
        return self.policy.plan(prompt_len)

    def describe(self) -> dict[str, Any]:
        """The header's description of the policy (:meth:`Policy.describe`)."""
        return self.policy.describe()

    @property
    def press_name(self) -> str:
        return self.policy.press_name


@dataclass(frozen=True)
class Policies:
    """A job's policies, built once: the reference (P) and each candidate (Q), in request order."""

    reference: Built
    candidates: tuple[Built, ...]


@dataclass
class TraceJob:
    """A ``/v1/traces`` request: its fields and their defaults (docs/service.md).

    The parser (:func:`gen_service.api.records.parse_trace`) fills the fields a body sets;
    the intake (:func:`gen_service.serving.intake.Intake.admit`) the prompt's tokens and the
    built ``policies``. ``candidates`` (several policies in one request, each with its seed in
    ``seeds``, None where the server draws one) is empty for a one-candidate request, whose
    policy is ``candidate``. ``top_logprobs`` (k <= 64; 0: none) asks for the logit traces at
    every step. A job built without ``policies`` (tests and benchmarks driving the engine
    directly) has them built by :meth:`gen_service.engine.facade.Engine.policies`.
    """

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
    # the policies, built once for this prompt (gen_service.serving.intake); None: not built yet
    policies: Policies | None = None

    @property
    def prompt_len(self) -> int:
        """Positions taken by the prompt (context + question)."""
        return len(self.prompt_ids) + len(self.question_ids)

    @property
    def policy_ids(self) -> tuple[str, ...]:
        """The candidates' policy ids in request order (``(candidate,)`` for one)."""
        return tuple(self.candidates) or (self.candidate,)

    @property
    def rows(self) -> int:
        """Decoding rows: R per candidate."""
        return self.replicates * len(self.policy_ids)


def check(cancelled: Callable[[], bool]) -> None:
    """Raise :class:`Cancelled` once the client has gone (called between steps)."""
    if cancelled():
        raise Cancelled()
