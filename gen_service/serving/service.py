"""The service's state: configuration, admission, metrics, the model thread and the
text pool, shared by every handler (``request.app.state.service``).

All model work runs on one worker thread, so the event loop (``/health``,
``/metrics``, admission) stays responsive while a request decodes. Tokenising and
chat templating run on a small separate pool, after the input byte limit has been
checked, so a large prompt neither blocks the loop nor waits behind decoding.
Admission is a bounded count of queued + running requests; beyond it the answer is
429 with ``Retry-After``. A client that disconnects, or a request that runs past
``--max-request-seconds``, sets the request's cancel flag, which the engine checks
between decoding steps. Trace requests share the model thread's decoding batch
(``--max-batch-requests``, :mod:`gen_service.serving.batching`); every other piece of model
work runs alone on the thread, in turns with the batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gen_service.engine.facade import Engine
from gen_service.errors import ApiError, Cancelled, ConfigError, PolicyError, RequestTimeout, invalid
from gen_service.models.loading import context_question_ids
from gen_service.presses.registry import ModelInfo
from gen_service.serving.admission import TRIM_BYTES, MemoryGate, return_freed_memory
from gen_service.serving.batching import BatchEntry, BatchingChoice, BatchLoop
from gen_service.serving.intake import (
    Intake,
    Job,
    Message,
    StepCost,
    prior_step_seconds,
    request_seconds_limit,
    row_steps,
)
from gen_service.serving.limits import MAX_CANDIDATES, BodyLimits, RequestLimits
from gen_service.serving.memory import TraceSize
from gen_service.serving.self_check import SelfCheck

__all__ = ["ServiceConfig", "Admission", "Ticket", "Metrics", "WorkStream", "Service", "failure_error"]

log = logging.getLogger("kvdiv.service")


@dataclass(frozen=True)
class ServiceConfig:
    """The server's limits and options (``kvdiv serve`` flags).

    Raises
    ------
    ConfigError
        For an empty API key: ``--api-key "$KEY"`` with ``KEY`` unset must not run open.
    """

    eviction: str = "full"              # default policy for TGI requests
    max_new_tokens: int = 1024          # T limit
    max_replicates: int = 1024          # R limit; the memory budget may allow fewer
    memory_budget: float | None = None  # bytes, or a fraction of free memory (None: serving/admission.py's default)
    max_queue: int = 16                 # queued + running requests
    max_body_bytes: int = 1 << 20
    max_input_bytes: int = 1 << 20      # text of inputs / messages, checked before tokenising
    body_timeout_s: float = 10.0        # time to receive a request body
    max_request_seconds: float | None = None  # wall time of one request's model work (None: by device; inf: none)
    api_key: str | None = None
    retry_after_s: int = 1              # Retry-After on 429
    max_candidates: int = 64            # candidates in one /v1/traces request (1: `candidates` off)
    batch_candidates: bool = True       # stack the candidates' forwards (False: bit-identical to separate requests)
    fuse: str = "auto"                  # P's and Q's forwards as one: auto (measured per shape), on, off
    cuda_graphs: bool = False           # stacked decoding forwards as CUDA graphs (CUDA only)
    max_batch_requests: int | None = None  # traces decoded in one batch (1: one at a time; None: by device)

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty (is the variable passed to --api-key / KVDIV_API_KEY set?); "
                              "omit --api-key to run without authentication")
        if self.max_request_seconds is not None and not self.max_request_seconds > 0:
            raise ConfigError("--max-request-seconds must be > 0")
        if self.fuse not in ("auto", "on", "off"):
            raise ConfigError(f"--fuse must be auto, on or off, not {self.fuse!r}")
        if self.max_batch_requests is not None and self.max_batch_requests < 1:
            raise ConfigError("--max-batch-requests must be >= 1")
        if not 1 <= self.max_candidates <= MAX_CANDIDATES:
            raise ConfigError(f"--max-candidates must be in 1..{MAX_CANDIDATES}")

    def limits(self) -> RequestLimits:
        return RequestLimits(max_new_tokens=self.max_new_tokens, max_replicates=self.max_replicates,
                      max_input_bytes=self.max_input_bytes, default_eviction=self.eviction,
                      max_candidates=self.max_candidates)

    def body_limits(self) -> BodyLimits:
        return BodyLimits(max_bytes=self.max_body_bytes, timeout_s=self.body_timeout_s)


class Admission:
    """Bounded admission: at most ``limit`` requests queued or running."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0
        self._lock = threading.Lock()

    def try_enter(self, own: bool = False) -> bool:
        """Take a slot if one is free; ``own`` work (the server's start-up self-check,
        before any client can call) always gets one."""
        with self._lock:
            if self.count >= self.limit and not own:
                return False
            self.count += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.count -= 1


class Ticket:
    """One admission slot. Released exactly once: by the worker when the request's
    model work ends, or by the handler when the request fails before any work starts."""

    def __init__(self, service: Service):
        self._service, self._held = service, True
        self.owned_by_worker = False

    def release(self, cancelled: bool = False) -> None:
        if self._held:
            self._held = False
            self._service.finished(cancelled)


class Metrics:
    """The Prometheus registry of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvdiv_requests", "HTTP responses by route and status", ["route", "status"],
                                registry=r)
        self.tokens = Counter("kvdiv_generated_tokens", "tokens generated by /generate* and /v1/*completions",
                              registry=r)
        self.row_steps = Counter("kvdiv_trace_row_steps", "replicate-steps decoded by /v1/traces", registry=r)
        self.queue = Gauge("kvdiv_queue_size", "requests queued or running", registry=r)
        self.duration = Histogram("kvdiv_request_duration_seconds", "request wall time", ["route"],
                                  registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.cancelled = Counter("kvdiv_cancelled", "requests cancelled by client disconnect", registry=r)
        self.timeouts = Counter("kvdiv_timeouts", "requests stopped by --max-request-seconds", registry=r)
        # continuous batching (gen_service/serving/batching.py): how full the decoding batch is
        self.batch_requests = Gauge("kvdiv_batch_requests", "trace requests in the decoding batch", registry=r)
        self.batch_rows = Gauge("kvdiv_batch_rows", "decoding rows (R x candidates) of the batch's requests",
                                registry=r)
        self.batch_waiting = Gauge("kvdiv_batch_waiting", "trace requests waiting to join the batch", registry=r)
        self.batch_occupancy = Histogram("kvdiv_batch_occupancy", "trace requests per decoding step",
                                         registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))


def failure_error(exc: BaseException, field: str, policies: tuple[str, ...]) -> ApiError:
    """The error answered for work that failed before its first item was sent.

    A prefill that fails under a compressing policy is the request's policy failing
    on this prompt (a press parameter kvpress rejects, a press that cannot run here):
    a 422 naming the policy field. Anything else is TGI's 424 generation error, with
    the exception type only; the details go to the server log.

    Parameters
    ----------
    exc : BaseException
        What the work raised.
    field : str
        The request field naming the policy (``candidate``, ``parameters.eviction``).
    policies : tuple of str
        The request's policy ids.

    Returns
    -------
    ApiError

    Raises
    ------
    None

    Examples
    --------
    >>> failure_error(RuntimeError("x"), "candidate", ("full",)).status
    424
    >>> failure_error(ValueError("bad"), "candidate", ("snapkv@0.5",)).message
    'candidate: policy cannot run on this prompt (ValueError: bad)'
    """
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestTimeout):
        return ApiError(424, str(exc), "timeout")
    oom = type(exc).__name__ == "OutOfMemoryError"
    if isinstance(exc, PolicyError) and exc.permanent:
        return invalid(field, str(exc), permanent=True)
    if isinstance(exc, PolicyError) or (not oom and any(p.strip() != "full" for p in policies)):
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        return invalid(field, f"policy cannot run on this prompt ({type(exc).__name__}: {first_line})")
    return ApiError(424, f"generation failed ({type(exc).__name__}); see the server log", "generation")


class WorkStream:
    """One request's work on the model thread, its items relayed to the event loop.

    The work is submitted at construction, so the admission slot is released by the
    worker itself (in ``finally``) whatever the client does. Closing the async
    iterator (the client went away) sets ``cancel``; the engine checks it between
    decoding steps and stops. Past ``deadline`` (monotonic seconds) the work stops
    the same way and the stream ends with :class:`RequestTimeout`."""

    def __init__(self, service: Service, make: Callable[[Callable[[], bool]], Iterator[Any]], ticket: Ticket,
                 deadline: float | None = None, batch: BatchLoop | None = None, cost: int | TraceSize = 0,
                 rows: int = 0, meter: Callable[[Any], int] | None = None, trim: bool = False):
        self.loop = asyncio.get_running_loop()
        # a trace's row-steps so far (``meter``: an item's) and when its first item came (its
        # prefills done), for the service's step cost (:class:`gen_service.serving.intake.StepCost`)
        self.meter, self.row_steps, self.began = meter, 0, None
        self.trim = trim   # give the heap's free pages back when the work ends (a large trace alone)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancel = threading.Event()
        self.deadline = deadline
        self._service, self._make, self._ticket = service, make, ticket
        ticket.owned_by_worker = True
        self._first: list[Any] = []
        if batch is None:
            service.executor.submit(self._work)
        else:   # ``make`` gives the request's steps; the batch loop runs them with others'
            batch.submit(BatchEntry(self, make, cost, rows))

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def stopped(self) -> bool:
        """Whether the work must stop: the client went away or the deadline passed."""
        return self.cancel.is_set() or self.expired()

    def _put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # loop closed: nobody is listening any more
            pass

    def put(self, item: Any) -> None:
        """Relay one item to the event loop (model thread)."""
        if self.meter is not None:
            self.row_steps += self.meter(item)
            self.began = self.began or time.monotonic()
        self._put("item", item)

    def _work(self) -> None:
        self._service.model_work_started()
        try:
            if self.stopped():
                raise Cancelled()
            for item in self._make(self.stopped):
                self.put(item)
                if self.stopped():
                    raise Cancelled()
        except BaseException as exc:  # forwarded to the event loop side
            self.end(exc)
        else:
            self.end(None)
        if self.trim:   # a large trace's caches are garbage now: their pages back to the OS
            return_freed_memory()

    def end(self, exc: BaseException | None) -> None:
        """The work ended (model thread): ``done``, or its error (a stop past the deadline
        as :class:`RequestTimeout`); the admission slot is released here, exactly once."""
        cancelled = False
        if self.began is not None and (exc is None or isinstance(exc, Cancelled)):
            self._service.step_cost.observe(time.monotonic() - self.began, self.row_steps)
        try:
            if exc is None:
                self._put("done", None)
            elif isinstance(exc, Cancelled) and self.expired() and not self.cancel.is_set():
                self._service.metrics.timeouts.inc()
                self._put("error", RequestTimeout(f"request exceeded --max-request-seconds "
                                                  f"({self._service.max_request_seconds:g} s)"))
            else:
                cancelled = isinstance(exc, Cancelled)
                # a stop's traceback would hold the engine's frames, and their caches, until the
                # event loop drops it: nothing in it is wanted
                self._put("error", exc.with_traceback(None) if cancelled else exc)
        finally:
            self._ticket.release(cancelled)

    async def first(self) -> Any:
        """Wait for the first item (raising the work's error, if it failed first), so a
        handler can still answer with an error status before it sends any byte."""
        kind, value = await self.queue.get()
        if kind == "error":
            raise value
        if kind == "done":
            self.queue.put_nowait((kind, value))
            return None
        self._first.append(value)
        return value

    async def __aiter__(self) -> AsyncIterator[Any]:
        try:
            while self._first:
                yield self._first.pop(0)
            while True:
                kind, value = await self.queue.get()
                if kind == "item":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            self.cancel.set()


class Service:
    """Holds the engine, the worker thread, the text pool and the admission state.

    Parameters
    ----------
    engine : Engine
        The loaded model and its policy registry.
    config : ServiceConfig, optional
        RequestLimits and options; ``max_batch_requests`` above 1 runs trace requests in
        one decoding batch (:class:`gen_service.serving.batching.BatchLoop`).

    Raises
    ------
    PolicyError
        When ``config.eviction`` is not a servable policy id (fail at start).
    """

    def __init__(self, engine: Engine, config: ServiceConfig | None = None):
        self.engine = engine
        self.config = config or ServiceConfig()
        self.limits = self.config.limits()
        self.body_limits = self.config.body_limits()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvdiv-model")
        self.text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvdiv-text")
        self.admission = Admission(self.config.max_queue)
        self.memory = MemoryGate.for_engine(engine, self.config.memory_budget)
        # --max-request-seconds in force (by device when not given) and the step cost it is held against
        self.max_request_seconds = request_seconds_limit(self.config.max_request_seconds, engine.lm.device.type)
        parameters = sum(p.numel() for p in engine.model.parameters())
        self.step_cost = StepCost(prior_step_seconds(parameters, engine.lm.device.type))
        self.metrics = Metrics()
        self.batching = BatchingChoice.for_device(engine.lm.device.type, self.config.max_batch_requests)
        # --max-batch-requests 1: every request alone on the model thread, as before batching
        self.batch = (BatchLoop(self.executor, engine.runner, self.batching.max_requests, self.memory.budget,
                                self.metrics) if self.batching.max_requests > 1 else None)
        if self.batch is not None:
            # requests decoded together: a request's bits must not depend on its batch-mates
            engine.make_batch_invariant()
        self.created = int(time.time())
        self.tokenizer = engine.lm.tokenizer
        self.special_ids = frozenset(self.tokenizer.all_special_ids)  # a property that rebuilds a list per access
        self.self_check: SelfCheck | None = None     # the start-up self-check's result (None: skipped)
        # every check a request meets before its work starts (gen_service/serving/intake.py)
        self.intake = Intake(engine.registry, ModelInfo.of(engine.lm), engine.lm.vocab_size, engine.lm.max_context,
                             self.memory, self.step_cost, self.max_request_seconds)
        engine.registry.build(self.config.eviction, self.intake.info)  # fail at start on a bad --eviction

    # ------------------------------------------------------------------ model thread

    @contextlib.asynccontextmanager
    async def admitted(self, own: bool = False) -> AsyncIterator[Ticket]:
        """Hold an admission slot (429 with Retry-After when full) from before the
        prompt is tokenised; the slot goes to the worker with :meth:`start`, or is
        released here if the request fails first. ``own``: the server's own work (the
        start-up self-check), never refused by ``--max-queue``."""
        if not self.admission.try_enter(own):
            raise ApiError(429, "Model is overloaded: request queue is full", "overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        self.metrics.queue.set(self.admission.count)
        ticket = Ticket(self)
        try:
            yield ticket
        finally:
            if not ticket.owned_by_worker:
                ticket.release()

    def start(self, make: Callable[[Callable[[], bool]], Iterator[Any]], ticket: Ticket,
              own: bool = False) -> WorkStream:
        """Queue a request's work on the model thread now; the worker releases ``ticket``."""
        if self.batch is not None:
            self.batch.plain_work(1)   # the batch loop admits no trace request while this waits
        return WorkStream(self, make, ticket, self._deadline(own))

    def start_trace(self, job: Job, ticket: Ticket, own: bool = False) -> WorkStream:
        """Queue an admitted ``/v1/traces`` request (:meth:`Intake.admit`): alone on the model
        thread (``--max-batch-requests 1``), or into the decoding batch
        (:mod:`gen_service.serving.batching`) with its memory size counted against the budget
        with the live requests' (the merged batch's estimate,
        :func:`gen_service.serving.memory.batch_bytes`). Its model time and row-steps update
        :attr:`step_cost` when it ends. ``own``: the server's own work (the start-up
        self-check), without ``--max-request-seconds``' deadline: a client's limit, which a slow
        machine's check must not trip."""
        trace = job.trace
        meter = partial(row_steps, replicates=trace.replicates)
        if self.batch is None:
            return WorkStream(self, lambda cancelled: self.engine.trace(trace, cancelled), ticket, self._deadline(own),
                              meter=meter, trim=job.memory.total >= TRIM_BYTES)
        return WorkStream(self, lambda cancelled: self.engine.trace_steps(trace, cancelled), ticket,
                          self._deadline(own), batch=self.batch, cost=job.memory, rows=trace.rows, meter=meter)

    def _deadline(self, own: bool = False) -> float | None:
        limit = None if own else self.max_request_seconds
        return None if limit is None else time.monotonic() + limit

    def model_work_started(self) -> None:
        """Called on the model thread as non-batched work starts (see :meth:`start`)."""
        if self.batch is not None:
            self.batch.plain_work(-1)

    def finished(self, cancelled: bool) -> None:
        """Called on the model thread when a request's work ends, however it ends."""
        self.admission.leave()
        self.metrics.queue.set(self.admission.count)
        if cancelled:
            self.metrics.cancelled.inc()

    async def on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one short model call (e.g. prompt log-probs) on the model thread."""
        if self.batch is not None:
            self.batch.plain_work(1)

        def call() -> Any:
            self.model_work_started()
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self.executor, call)

    # ------------------------------------------------------------------ text (off the loop)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run text work (tokenising, templating, large JSON) on the text pool."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    def encode_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of raw text and their character offsets, as TGI tokenises ``inputs``.

        The fast tokenizer's backend is called directly: transformers' ``__call__``
        adds seconds of Python per token on a 1 MB input. ``encode_batch`` of one text,
        not ``encode``: measured on a 1 MB input, ``encode`` sometimes held the
        interpreter lock for its whole 1.8 s (the event loop stalled with it), while
        ``encode_batch`` releases it while it works (loop stalls ≤ 0.07 s)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            enc = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            return enc.ids, enc.offsets
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(enc.input_ids), list(enc.offset_mapping)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of raw text (see :meth:`encode_offsets`)."""
        return self.encode_offsets(text, add_special_tokens)[0]

    def encode_chat(self, messages: tuple[Message, ...]) -> list[int]:
        """Token ids of a chat through the model's template. ``tokenize=True``:
        tokenising the rendered string again would add a second BOS."""
        out = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                                 tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if not isinstance(out, list) else out)

    def encode_context(self, context: str, question: str = "") -> tuple[list[int], list[int]]:
        """Token ids of ``context`` (what a press compresses) and of ``question`` with the
        chat template's tail (prefilled after compression), split as kvpress's pipeline
        splits them (:func:`gen_service.models.loading.context_question_ids`)."""
        return context_question_ids(self.tokenizer, context, question)

    def chat_text(self, messages: tuple[Message, ...]) -> str:
        """The chat rendered by the model's template (``/chat_tokenize``)."""
        return self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages],
                                                  tokenize=False, add_generation_prompt=True)

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    #: Tokens of context before each token whose text :meth:`token_ends` decodes.
    END_WINDOW = 8

    def token_ends(self, ids: list[int], length: int, skip_special_tokens: bool = True) -> list[int]:
        """Where each token's text ends in the decoded ``ids`` (``/detokenize``'s ``ends``),
        capped at ``length`` (the whole text's).

        A token's text is what it adds to the length of the decoding of the
        :attr:`END_WINDOW` tokens before it (as TGI streams text), so a row costs two short
        decodes per token rather than a decoding of every prefix. A window starting mid-text
        loses its leading space in both decodings alike; a character split over two tokens
        counts at the first (as a replacement character) and adds nothing at the second.

        Examples
        --------
        >>> class Chars(Service):
        ...     def __init__(self): pass
        ...     def decode(self, ids, skip_special_tokens=True): return "".join(map(chr, ids))
        >>> Chars().token_ends([104, 105, 33], 3)
        [1, 2, 3]
        """
        ends, at = [], 0
        for k in range(len(ids)):
            lo = max(0, k - self.END_WINDOW)
            before = self.decode(ids[lo:k], skip_special_tokens) if k > lo else ""
            at += max(0, len(self.decode(ids[lo:k + 1], skip_special_tokens)) - len(before))
            ends.append(min(at, length))
        return ends
