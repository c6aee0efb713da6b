"""Continuous batching across ``/v1/traces`` requests: one decoding batch on the model thread.

With ``--max-batch-requests N`` above 1 a trace request does not run alone on the model
thread. Its work is its steps (:meth:`gen_service.engine.facade.Engine.trace_steps`: records,
and one :class:`~gen_service.engine.scheduler.Ask` per decoding step) and
:class:`BatchLoop` advances the steps of up to N requests together, as TGI's and
vLLM's schedulers do: every live request is advanced to its next ask (a request
admitted this step runs its prefills and sends its headers first), all the asks are
merged into one :func:`~gen_service.engine.scheduler.run_forwards` (shared-prompt
sides stacked, P rows with P rows, Q with Q, across requests exactly as across the
candidates of one request; a request with a side that cannot stack runs its forwards
as alone), and the logits go back to each request. New requests are
admitted at step boundaries while the memory budget holds their estimates with the
live ones'; finished requests leave without stalling the rest.

What stays the request's own: its seeds and generators (each loop draws the same
random numbers in the same order as alone), its records and their order (sent to its
own :class:`~gen_service.serving.service.WorkStream`, whose writer holds its digest), its
cancellation and deadline (checked after each of its records and between its steps),
and its errors: a request whose prefill or loop fails ends with its error and the
others go on. A stacked forward that fails has written part of every cache in it, so
every request in that forward ends with the error (as the candidates of one request
do). Stacking changes only the batch of the row-wise matmuls, so a request's trace
equals its trace alone to floating-point rounding (tests/test_service_batching.py).

The loop runs on the service's one model thread and leaves it when no request is
live, so other model work (``/generate``, chat) waits at most for the live requests
to finish: while such work waits, no new trace request is admitted.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

from gen_service.attention.shared_cache import stackable
from gen_service.engine.scheduler import Ask, Runner, run_forwards
from gen_service.errors import Cancelled
from gen_service.serving.admission import TRIM_BYTES, return_freed_memory
from gen_service.serving.memory import TraceSize, batch_bytes

# ``--max-batch-requests`` when the flag is not given, by the device type the model runs
# on: (requests, why). Batching must never make a collection slower than one request at
# a time, so a device keeps 1 until a measurement on it says otherwise.
BATCH_DEFAULTS: dict[str, tuple[int, str]] = {
    "cpu": (1, "CPU default: continuous batching measured 0.77x one request at a time on a 2-core CPU "
               "(8 documents x 4 policies + control, SmolLM2, R=4, T=8; docs/service.md): a CPU step is "
               "compute-bound, and merging pads every prompt to the batch's longest"),
    "cuda": (8, "CUDA default: a decoding step is bound by launches and weight reads, which merged "
                "requests share"),
}
_UNMEASURED = (1, "default for a device type without a measurement: one request at a time is never slower")


@dataclass(frozen=True)
class BatchingChoice:
    """How many ``/v1/traces`` requests decode in one batch, and why (``/info``).

    Examples
    --------
    >>> BatchingChoice.for_device("cpu", None).max_requests
    1
    >>> BatchingChoice.for_device("cpu", 8).why
    '--max-batch-requests 8'
    """

    max_requests: int
    why: str

    @classmethod
    def for_device(cls, device_type: str, flag: int | None) -> BatchingChoice:
        """The flag when given, else the device type's row of :data:`BATCH_DEFAULTS`."""
        if flag is not None:
            return cls(flag, f"--max-batch-requests {flag}")
        return cls(*BATCH_DEFAULTS.get(device_type, _UNMEASURED))

    def info(self) -> dict[str, Any]:
        return {"max_batch_requests": self.max_requests, "max_batch_requests_why": self.why}


def merged_bytes(entries: list[BatchEntry]) -> int:
    """What these requests hold decoded together: the sized ones each at the batch's
    longest prompt and largest T (:func:`gen_service.serving.memory.batch_bytes`: the stacked
    forwards pad to both), plus the fixed costs."""
    sized = [e.cost for e in entries if isinstance(e.cost, TraceSize)]
    return batch_bytes(sized) + sum(e.cost or 0 for e in entries if not isinstance(e.cost, TraceSize))


class WorkStream(Protocol):
    """What the loop needs of a request's :class:`gen_service.serving.service.WorkStream` (a
    protocol, not an import: the service imports this module)."""

    def stopped(self) -> bool: ...
    def put(self, item: Any) -> None: ...
    def end(self, exc: BaseException | None) -> None: ...


class Metrics(Protocol):
    """The gauges and histogram of :class:`gen_service.serving.service.Metrics` the loop sets."""

    batch_requests: Any
    batch_rows: Any
    batch_waiting: Any
    batch_occupancy: Any

__all__ = ["BatchLoop", "BatchEntry", "BatchingChoice", "BATCH_DEFAULTS", "merged_bytes"]

log = logging.getLogger("kvdiv.service")


@dataclass(eq=False)
class BatchEntry:
    """One request in the batch: its stream, how to make its steps, what it costs.

    ``cost`` is its memory: a :class:`gen_service.serving.memory.TraceSize`, counted at
    the merged batch's longest prompt and largest T
    (:func:`~gen_service.serving.memory.batch_bytes`), or fixed bytes; ``rows`` its
    decoding rows (R × candidates) for ``/metrics``."""

    stream: WorkStream
    make: Callable[[Callable[[], bool]], Iterator[Any]]
    cost: TraceSize | int | None = 0
    rows: int = 0
    steps: Iterator[Any] | None = None
    answer: Any = None


@dataclass
class _State:
    pending: deque[BatchEntry] = field(default_factory=deque)
    running: bool = False
    plain_waiting: int = 0


class BatchLoop:
    """The batch loop over concurrent trace requests, run on the model thread.

    Parameters
    ----------
    executor : concurrent.futures.Executor
        The service's one-thread model executor (the loop runs there, in turns with
        other model work).
    runner : callable
        Returns the scheduler's :class:`~gen_service.engine.scheduler.Runner`, read
        once per step (the engine's settings may change on a live engine).
    max_requests : int
        Requests decoded together at most (``--max-batch-requests``).
    budget : int
        Bytes the live requests' estimates may add up to (the memory gate's budget);
        one request is always admitted into an empty batch (the gate refused those
        that can never fit).
    metrics : Metrics
        The server's Prometheus metrics (batch occupancy).

    Raises
    ------
    ValueError
        For ``max_requests`` < 1.
    """

    def __init__(self, executor: Executor, runner: Callable[[], Runner], max_requests: int, budget: int,
                 metrics: Metrics):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, not {max_requests}")
        self.executor, self.runner = executor, runner
        self.max_requests, self.budget, self.metrics = max_requests, budget, metrics
        self._lock = threading.Lock()
        self._state = _State()
        self._garbage = 0   # bytes of the requests admitted since the heap was last trimmed

    # ------------------------------------------------------------------ event-loop side

    def submit(self, entry: BatchEntry) -> None:
        """Queue a request; it joins the batch at the next step boundary the budget allows."""
        with self._lock:
            self._state.pending.append(entry)
            self.metrics.batch_waiting.set(len(self._state.pending))
            if not self._state.running:
                self._state.running = True
                self.executor.submit(self._run)

    def plain_work(self, delta: int) -> None:
        """Count model work other than traces waiting for the thread (+1 queued, -1 started):
        while any waits, no trace request is admitted, so the loop yields the thread."""
        with self._lock:
            self._state.plain_waiting += delta

    def occupancy(self) -> dict[str, int]:
        """Requests waiting to join the batch (``/metrics`` has the live ones)."""
        with self._lock:
            return {"waiting": len(self._state.pending)}

    # ------------------------------------------------------------------ model thread

    def _admit(self, live: list[BatchEntry]) -> bool:
        """Move pending requests into ``live`` while the limits allow; False once the loop
        should give the thread back (nothing live, and nothing admissible now)."""
        with self._lock:
            st = self._state
            while st.pending and len(live) < self.max_requests and not st.plain_waiting:
                if live and merged_bytes([*live, st.pending[0]]) > self.budget:
                    break
                live.append(st.pending.popleft())
                cost = live[-1].cost
                self._garbage += cost.total if isinstance(cost, TraceSize) else cost or 0
            self.metrics.batch_waiting.set(len(st.pending))
            if live:
                return True
            if st.pending:   # other model work waits: run it first, then come back for these
                self.executor.submit(self._run)
            else:
                st.running = False
            return False

    def _run(self) -> None:
        live: list[BatchEntry] = []
        try:
            while self._admit(live):
                self._step(live)
        except BaseException as exc:  # the loop itself failed: no request may hang on it
            log.exception("batch loop failed")
            for entry in live:
                self._retire(entry, exc)
            live.clear()
            with self._lock:
                self._state.running = False
                for entry in self._state.pending:
                    entry.stream.end(exc)
                self._state.pending.clear()
        finally:
            self.metrics.batch_requests.set(0)
            self.metrics.batch_rows.set(0)
            live.clear()
            if self._garbage >= TRIM_BYTES:   # the batch's caches are garbage now: their pages back to the OS
                self._garbage = 0
                return_freed_memory()

    def _step(self, live: list[BatchEntry]) -> None:
        """Advance every live request to its next ask, run all the asks' forwards together,
        hand each request its logits; retire the requests that ended."""
        asks: dict[int, Ask] = {}
        for entry in list(live):
            try:
                ask = self._advance(entry)
            except BaseException as exc:  # this request's own failure: the others go on
                live.remove(entry)
                self._retire(entry, exc)
                continue
            if ask is None:
                live.remove(entry)
                self._retire(entry, None)
            else:
                asks[id(entry)] = ask
        self.metrics.batch_requests.set(len(asks))
        self.metrics.batch_rows.set(sum(e.rows for e in live if id(e) in asks))
        if not asks:
            return
        self.metrics.batch_occupancy.observe(len(asks))
        runner = self.runner()
        answers: dict[int, dict[int, Any]] = {key: {} for key in asks}
        # A request with a side that cannot stack runs its forwards as alone: the others'
        # P stack and Q stack then hold the same requests' rows in the same order, so a
        # control candidate (Q = P) sees P's batch exactly and keeps TV = 0 bit for bit.
        merged = {key: ask for key, ask in asks.items() if self._stacks(ask)}
        parts = [(list(merged), {(key, i): fs for key, ask in merged.items() for i, fs in ask.forwards.items()})]
        parts += [([key], {(key, i): fs for i, fs in ask.forwards.items()})
                  for key, ask in asks.items() if key not in merged]
        for keys, forwards in parts:
            if not forwards:
                continue
            try:
                out = run_forwards(forwards, runner)
            except Exception as exc:  # a shared forward: every cache in it is part-written
                log.error("a forward of %d request(s) failed", len(keys), exc_info=exc)
                for entry in [e for e in live if id(e) in keys]:
                    live.remove(entry)
                    self._retire(entry, exc)
                continue
            for (key, i), logits in out.items():
                answers[key][i] = logits
        for entry in live:
            entry.answer = answers.get(id(entry))

    @staticmethod
    def _stacks(ask: Ask) -> bool:
        """Whether every forward of the ask may share a batch (:func:`gen_service.attention.shared_cache.stackable`)."""
        return all(stackable(f.side) for fs in ask.forwards.values() for f in fs)

    @staticmethod
    def _advance(entry: BatchEntry) -> Ask | None:
        """Send the request its logits and relay its records up to its next ask (None: its
        steps ended). Raises what its steps raise, or :class:`Cancelled` once it stopped."""
        stream = entry.stream
        if entry.steps is None:   # joins now: its prefills and headers run here
            if stream.stopped():
                raise Cancelled()
            entry.steps = entry.make(stream.stopped)
        answer, entry.answer = entry.answer, None
        while True:
            try:
                item = entry.steps.send(answer)
            except StopIteration:
                return None
            answer = None
            if isinstance(item, Ask):
                return item
            stream.put(item)
            if stream.stopped():
                raise Cancelled()

    @staticmethod
    def _retire(entry: BatchEntry, exc: BaseException | None) -> None:
        if entry.steps is not None and exc is not None:
            try:
                entry.steps.close()   # its loops' finally blocks run now, not at garbage collection
            except Exception:
                log.exception("closing a failed request's steps")
        entry.stream.end(exc)
