"""The intake: a parsed request becomes one admitted job, every check in one place.

A ``/v1/traces`` body is parsed by :func:`gen_service.api.records.parse_trace` into a
:class:`TraceRequest` (the prompt's texts and a :class:`~gen_service.engine.jobs.TraceJob`
holding every other field). :meth:`Intake.admit` then, in this order and before any byte of a
response is sent:

1. tokenises the prompt (``inputs``, ``messages`` or ``context`` + ``question``);
2. checks it against the model's context (the prompt's field);
3. builds each policy once for this prompt (``candidate`` or ``candidates[i]``, then
   ``reference``; an id given twice, as the full control and the reference, once):
   :meth:`gen_service.presses.registry.PolicyRegistry.build` checks the id and every
   parameter, and its plan fits the press to the context
   (:class:`~gen_service.engine.jobs.Built`, which the engine's prefill takes);
4. checks ``top_logprobs`` against the vocabulary;
5. sizes the request's memory from the built policies' plans and refuses what can never fit
   the budget (``replicates``, :class:`~gen_service.serving.admission.MemoryGate`);
6. sizes its time (row-steps x the seconds per row-step measured on this server,
   :class:`StepCost`) and refuses what cannot finish within ``--max-request-seconds``
   (``replicates``).

Every refusal is a 422 naming its field (one error type per field, as the parser's); the
admitted :class:`Job` holds the built policies, its memory size and its time estimate, and the
engine runs it without building anything again. A plain generation (``/generate``, the OpenAI
routes) goes through :meth:`Intake.admit_generate`: its context, its policy and its memory.

This module imports no torch: parsing and admitting a request need none (tests/test_intake.py).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gen_service.engine.jobs import Built, Policies, TraceJob
from gen_service.errors import ApiError, PolicyError, RequestTooLarge, invalid
from gen_service.presses.registry import ModelInfo, PolicyRegistry
from gen_service.presses.traits import wants_eager
from gen_service.serving.admission import MemoryGate
from gen_service.serving.memory import TraceSize
from protocols import Kind

__all__ = ["CPU_REQUEST_SECONDS", "Encoder", "Generation", "Intake", "Job", "Message", "StepCost", "TraceRequest",
           "prior_step_seconds", "request_seconds_limit", "row_steps", "row_steps_of"]

#: ``--max-request-seconds`` when the flag is not given on a CPU server: a request that would hold
#: the one model thread longer is refused up front (docs/service.md, "The intake"). On CUDA the
#: default is no limit: a GPU step is 10-100x cheaper and collections there run large requests.
CPU_REQUEST_SECONDS = 600.0
#: Floating-point operations per second assumed before any request was timed (the prior of
#: :class:`StepCost`). A refusal is for good, so the estimate should err short rather than refuse
#: what would finish (the deadline still stops what runs long): SmolLM2-135M on a 2-core CPU
#: measured 3.8 ms per row-step at R = 1024, and this prior gives 5.4 ms.
PRIOR_FLOPS = {"cpu": 1e11, "cuda": 1e13}


@dataclass(frozen=True)
class Message:
    """One chat message (text content only)."""

    role: str
    content: str


@dataclass(frozen=True)
class TraceRequest:
    """A parsed ``/v1/traces`` body: the prompt's texts and the job's other fields.

    The prompt is ``inputs``, ``messages`` (all of it compressed) or ``context`` +
    ``question`` (only the context is compressed; the question is prefilled after).
    ``job`` holds every other field with its default (:class:`~gen_service.engine.jobs.TraceJob`,
    the one record of a request's fields); its prompt is tokenised by :meth:`Intake.admit`.
    """

    job: TraceJob
    inputs: str | None = None
    messages: tuple[Message, ...] | None = None
    context: str | None = None
    question: str = ""
    add_special_tokens: bool = True

    @property
    def prompt_field(self) -> str:
        """The request field holding the prompt (named by a context refusal)."""
        if self.context is not None:
            return "context"
        return "messages" if self.messages is not None else "inputs"


@dataclass(frozen=True)
class Job:
    """An admitted ``/v1/traces`` request.

    Attributes
    ----------
    trace : TraceJob
        The request with its prompt's tokens and its policies built once (``trace.policies``).
    memory : TraceSize
        Its memory as the decoding batch counts it (:mod:`gen_service.serving.memory`).
    row_steps : int
        Rows x decoding steps it runs at most (:func:`row_steps_of`).
    seconds : float
        Its estimated model time (``row_steps`` x :attr:`StepCost.seconds`).
    """

    trace: TraceJob
    memory: TraceSize
    row_steps: int
    seconds: float


@dataclass(frozen=True)
class Generation:
    """An admitted plain generation: its prompt, its policy built once and its length."""

    ids: list[int]
    policy: Built
    new_tokens: int


class Encoder(Protocol):
    """What the intake tokenises with (:class:`gen_service.serving.service.Service`)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_chat(self, messages: tuple[Message, ...]) -> list[int]: ...
    def encode_context(self, context: str, question: str = "") -> tuple[list[int], list[int]]: ...


def row_steps(record: Any, replicates: int) -> int:
    """Rows x steps one streamed record stands for: R for a step of the coupled, residual
    (shared) or reference loop, a branch's rows for a residual branch, 0 for anything else.

    Parameters
    ----------
    record : Any
        An item of a trace's work (a record dict, or a candidate's end marker).
    replicates : int
        The request's R.

    Returns
    -------
    int

    Raises
    ------
    None

    Examples
    --------
    >>> row_steps({"type": "step"}, 8), row_steps({"type": "branch", "tv": [0.1, 0.2, 0.0]}, 8)
    (8, 2)
    """
    if not isinstance(record, dict):
        return 0
    kind = record.get("type")
    if kind in ("step", "shared_step", "reference_step"):
        return replicates
    if kind == "branch":
        return len(record["tv"]) - 1
    return 0


def row_steps_of(job: TraceJob) -> int:
    """The most rows x steps ``job`` decodes: R x T per candidate, twice that for a residual
    request (its branches continue up to T past the survival steps).

    Parameters
    ----------
    job : TraceJob

    Returns
    -------
    int

    Raises
    ------
    None

    Examples
    --------
    >>> row_steps_of(TraceJob([1], "full", candidates=["full", "snapkv@0.5"], replicates=4, horizon=8))
    64
    """
    return job.rows * job.horizon * (2 if job.kind == Kind.RESIDUAL else 1)


def prior_step_seconds(parameters: int, device_type: str) -> float:
    """Seconds per row-step before any request was timed: P's and Q's forwards, 2 flops per
    parameter each, at the low throughput :data:`PRIOR_FLOPS` assumes for the device.

    Parameters
    ----------
    parameters : int
        The model's parameter count.
    device_type : str
        ``"cpu"`` or ``"cuda"`` (others as the CPU).

    Returns
    -------
    float

    Raises
    ------
    None

    Examples
    --------
    >>> round(prior_step_seconds(134_515_008, "cpu") * 1000, 1)
    5.4
    """
    return 4.0 * parameters / PRIOR_FLOPS.get(device_type, PRIOR_FLOPS["cpu"])


def request_seconds_limit(flag: float | None, device_type: str) -> float | None:
    """``--max-request-seconds`` in force: the flag, or by device when it is not given
    (:data:`CPU_REQUEST_SECONDS` on the CPU, none elsewhere); ``inf`` for no limit.

    Parameters
    ----------
    flag : float or None
        ``--max-request-seconds`` as given (None: not given).
    device_type : str
        The model's device type.

    Returns
    -------
    float or None
        Seconds, or None for no limit.

    Raises
    ------
    None

    Examples
    --------
    >>> request_seconds_limit(None, "cpu"), request_seconds_limit(None, "cuda"), request_seconds_limit(30, "cuda")
    (600.0, None, 30)
    >>> request_seconds_limit(float("inf"), "cpu") is None
    True
    """
    if flag is None:
        return CPU_REQUEST_SECONDS if device_type == "cpu" else None
    return None if math.isinf(flag) else flag


class StepCost:
    """Seconds per row-step on this server: a prior, moved by every trace request it runs (its
    decoding time over its row-steps), each by a weight that grows with its size.

    A request of ``n`` row-steps moves the mean by ``1 - exp(-n / scale)``: the start-up
    self-check's requests (64 row-steps each) barely, a request of ``scale`` row-steps by 63 %.
    Small requests pay a step's fixed costs over few rows and measure several times more per
    row-step than large ones; the large ones, the only ones a limit can refuse, set the rate.
    A request is timed from its first record (its prefills done) to its end, cancelled ones
    included: the estimate leaves the prefill out and errs short.

    Parameters
    ----------
    prior : float
        Seconds per row-step before any measurement (:func:`prior_step_seconds`).
    scale : float
        The row-steps of a request that moves the mean by 63 %.

    Examples
    --------
    >>> cost = StepCost(prior=0.02)
    >>> cost.observe(seconds=2.0, steps=64); round(cost.seconds, 4)     # a self-check's request
    0.0201
    >>> cost.observe(seconds=40.0, steps=20_000); round(cost.seconds, 4), cost.measured
    (0.0044, 2)
    """

    def __init__(self, prior: float, scale: float = 10_000):
        self.prior = self.seconds = float(prior)
        self.scale, self.measured = float(scale), 0
        self._lock = threading.Lock()

    def observe(self, seconds: float, steps: int) -> None:
        """One request's decoding time over the row-steps it decoded (ignored without any)."""
        if steps <= 0 or seconds <= 0:
            return
        with self._lock:
            weight = 1.0 - math.exp(-steps / self.scale)
            self.seconds = (1 - weight) * self.seconds + weight * seconds / steps
            self.measured += 1

    def info(self) -> dict[str, Any]:
        """What /info reports."""
        return {"seconds_per_row_step": self.seconds, "prior": self.prior, "requests_timed": self.measured}


class Intake:
    """Admits requests for one served model: every check a request meets before its work starts.

    Parameters
    ----------
    registry : PolicyRegistry
        Builds the policies.
    info : ModelInfo
        What every policy is built against.
    vocab_size, max_context : int
        The model's vocabulary and context.
    memory : MemoryGate
        The memory budget.
    cost : StepCost
        The seconds per row-step the time estimate uses.
    max_seconds : float or None
        ``--max-request-seconds`` in force (:func:`request_seconds_limit`); None: no time limit.
    """

    def __init__(self, registry: PolicyRegistry, info: ModelInfo, vocab_size: int, max_context: int,
                 memory: MemoryGate, cost: StepCost, max_seconds: float | None = None):
        self.registry, self.info, self.memory, self.cost = registry, info, memory, cost
        self.vocab_size, self.max_context, self.max_seconds = vocab_size, max_context, max_seconds

    # ------------------------------------------------------------------ traces

    def admit(self, request: TraceRequest, encoder: Encoder) -> Job:
        """Tokenise the request's prompt and admit it (:meth:`admit_job`).

        Raises
        ------
        ApiError
            422 naming the field, in the order of the module's docstring.
        """
        question: list[int] = []   # prefilled after compression, never compressed
        if request.context is not None:
            ids, question = encoder.encode_context(request.context, request.question)
        elif request.messages is not None:
            ids = encoder.encode_chat(request.messages)
        else:
            ids = encoder.encode(request.inputs or "", request.add_special_tokens)
        job = replace(request.job, prompt_ids=list(ids), question_ids=list(question))
        return self.admit_job(job, request.prompt_field)

    def admit_job(self, job: TraceJob, prompt_field: str = "inputs", own: bool = False) -> Job:
        """Check a tokenised job, build its policies once, size its memory and time.

        Parameters
        ----------
        job : TraceJob
            With its prompt's tokens; its ``policies`` are built here.
        prompt_field : str
            The field a context refusal names.
        own : bool
            The server's own work (the start-up self-check): no time limit.

        Returns
        -------
        Job

        Raises
        ------
        ApiError
            422 naming the field.
        """
        self.check_context(job.prompt_ids + job.question_ids, job.horizon, prompt_field)
        # the press compresses the context only: policies are fitted to its length
        fields = [f"candidates[{i}]" for i in range(len(job.candidates))] if job.candidates else ["candidate"]
        built: dict[str, Built] = {}   # an id given twice (the full control and the reference) is built once
        for field, policy in [*zip(fields, job.policy_ids, strict=True), ("reference", job.reference)]:
            if policy not in built:
                built[policy] = self.build(field, policy, len(job.prompt_ids))
        job = replace(job, policies=Policies(built[job.reference], tuple(built[p] for p in job.policy_ids)))
        if job.top_logprobs > self.vocab_size:
            raise invalid("top_logprobs", f"must be <= the vocabulary size {self.vocab_size}")
        steps = row_steps_of(job)
        seconds = steps * self.cost.seconds
        # memory and time both bound R: one 422 on ``replicates`` says every bound it breaks
        why = [self._memory_refusal(job), None if own else self._time_refusal(job, steps, seconds)]
        if any(why):
            raise invalid("replicates", "; and it ".join(w for w in why if w) + ". Refused for good on this "
                          "server (not a load condition; do not retry)")
        return Job(job, self._size(job), steps, seconds)

    def _sides(self, job: TraceJob) -> tuple:
        """:meth:`MemoryGate.admit`'s arguments: each candidate's sides described from its plan
        and the reference's, so a side that stores per-row copies of the prompt counts them."""
        assert job.policies is not None
        ref = job.policies.reference.prepared
        sides = [self.memory.describe(c.id, ref, c.prepared, job.kind) for c in job.policies.candidates]
        return job.replicates, job.prompt_len, job.horizon, job.kind, len(sides), sides, job.top_logprobs

    def _memory_refusal(self, job: TraceJob) -> str | None:
        """Why the request's memory can never fit the budget, or None."""
        try:
            self.memory.admit(*self._sides(job))
        except RequestTooLarge as exc:
            return str(exc)
        return None

    def _size(self, job: TraceJob) -> TraceSize:
        return self.memory.size(*self._sides(job))

    def _time_refusal(self, job: TraceJob, steps: int, seconds: float) -> str | None:
        """Why the request cannot finish within ``--max-request-seconds``, or None."""
        if self.max_seconds is None or seconds <= self.max_seconds:
            return None
        per = self.cost.seconds
        fit = int(self.max_seconds / (per * steps / job.replicates))
        n = self.cost.measured
        source = f"a prior of {self.cost.prior * 1e3:.3g} ms from the model's size" + (
            f", moved by the {n} request{'s' if n != 1 else ''} this server timed" if n else ": nothing timed yet")
        n = len(job.policy_ids)
        return (f"needs an estimated {seconds:.0f} s ({steps} row-steps: R={job.replicates} x T={job.horizon}"
                + (f" x {n} candidates" if n > 1 else "")
                + (" x 2 for the branches" if job.kind == Kind.RESIDUAL else "")
                + f", at {per * 1e3:.3g} ms per row-step, {source}); the limit is --max-request-seconds "
                f"{self.max_seconds:g} s: " + (f"at most R={fit} fits at this T" if fit else "shorten T"))

    # ------------------------------------------------------------------ shared checks

    def check_context(self, ids: list[int], new_tokens: int, field: str) -> None:
        """422 on ``field`` for an empty prompt, or one that with ``new_tokens`` overflows the context."""
        if not ids:
            raise invalid(field, "empty input")
        if len(ids) + new_tokens > self.max_context:
            raise invalid(field, f"prompt of {len(ids)} tokens + {new_tokens} new tokens exceeds the "
                                 f"model context of {self.max_context}")

    def build(self, field: str, policy_id: str, context_tokens: int) -> Built:
        """Build a policy once and fit it to this prompt, a bad id a 422 on ``field`` before any
        byte is sent: :meth:`PolicyRegistry.build` parses it and checks every parameter (types,
        ranges, server-side options, budgets against the model's context); its plan
        constructs the press for ``context_tokens`` (what the press compresses: the context,
        not a question)."""
        try:
            return Built(policy_id, self.registry.build(policy_id, self.info), context_tokens)
        except PolicyError as exc:   # a designed refusal on this model is marked permanent
            raise invalid(field, str(exc), permanent=exc.permanent) from None
        except ApiError:
            raise
        except (TypeError, ValueError, AssertionError) as exc:  # a press rejecting its parameters
            raise invalid(field, f"policy cannot be built ({type(exc).__name__}: {exc})") from None

    # ------------------------------------------------------------------ plain generation

    def admit_generate(self, ids: list[int], new_tokens: int, policy_id: str, field: str, policy_field: str,
                       prompt_logprobs: bool = False) -> Generation:
        """Admit a plain generation: its context (``field``), its policy built once
        (``policy_field``) and its memory: its cache, its prefill (eager attention for a press
        scoring with the attention weights) and, with ``prompt_logprobs``, the prompt's (L, V)
        float32 logits (a refusal names ``parameters.decoder_input_details`` then, else ``field``).

        Raises
        ------
        ApiError
            422 naming the field.
        """
        self.check_context(ids, new_tokens, field)
        policy = self.build(policy_field, policy_id, len(ids))
        try:
            self.memory.admit_generate(len(ids), new_tokens, wants_eager(policy.prepared.press), prompt_logprobs)
        except RequestTooLarge as exc:
            raise invalid("parameters.decoder_input_details" if prompt_logprobs else field, str(exc)) from exc
        return Generation(ids, policy, new_tokens)
