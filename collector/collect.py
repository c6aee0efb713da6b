"""The collector: drive trace servers over HTTP into a journal, then pack a dataset.

``collect`` sends one ``POST /v1/traces`` per (document, policy) to one or more
servers (httpx, async), or one per document with its policies as ``candidates``
where a server takes them (``collector.grouped``): a single policy is a request of
one, sent, streamed, journaled, checked and retried by the same code. Each server
has ``pool.concurrency`` requests in flight, from one shared queue: whenever a
server has a free slot it gets the next request, so a faster server simply takes
more work. The servers may change during the run (``pool.servers_file``, re-read
every few seconds); a server that stops answering is taken out of rotation with a
backoff (``collector.servers.ServerPool``); when no server answers the run waits, up
to ``pool.wait_for_servers_s``, then stops with the requests left incomplete for a
rerun. HTTP failures are mapped to the collector's errors by one table
(``collector.transport``), which also frames the NDJSON lines. Every stream is written
to the journal as it arrives, read once by ``protocols.StreamReader`` (limits,
digest, order, shapes), and becomes complete only after its header answers the
request (``collector.checks``) and its dataset assembles and validates. Transient
failures (429, 5xx, dropped connections, a request past its deadline, truncated,
altered or malformed streams, server error records) are retried with exponential
backoff and jitter, on whichever server is free; a request that still fails after
``retry.max_attempts`` is reported and left incomplete. Permanent failures (a 4xx, a
header that answers another request, a digested stream that does not assemble)
end the request at once. No failure of one request escapes its worker: the run
always finishes and reports.

Determinism: each request's seed is derived from (seed, document, policy), never from
the order of completion, so a resumed run produces the same traces as an
uninterrupted one on the same server hardware. With ``sampling.common_random_numbers`` it is
derived from (seed, document): every policy of a document draws the same random
numbers, which correlates their traces and shrinks the variance of paired
differences (docs/design.md); each policy's estimates stay unbiased.

Rounds: a config with ``round.index`` k >= 1 and a ``round.allocation`` (doc -> policy ->
replicates) collects one later round of an adaptive collection (``kvdiv collect
--target-se``, driven by ``kvdiv.adaptive``): only the allocated (document, policy)
pairs, each with its own R, seeds derived with the round, into the round's own
journal folder (``collector.journal``).

The parameters are ``collector.config.CollectConfig`` and its records (re-exported here).
This module is the collection loop (:class:`Collector`) and its entry points; the parts
it drives live beside it: ``collector.jobs`` (a request's job, body and header check),
``collector.exchange`` (one response's streams and when each is finished),
``collector.progress`` (the progress bar), ``collector.result`` (``CollectResult``) and
``collector.prepare`` (``prepare_run``, the run directory).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

from collector.answers import decode_answers, has_answers
from collector.checks import RunLedger, audit_document, derive_seed
from collector.config import CollectConfig, PoolConfig, RetryConfig, RoundConfig, Sampling
from collector.documents import Document, file_sha256
from collector.errors import PermanentError, RetryableError
from collector.exchange import Exchange, Stream, stream_failure
from collector.grouped import group_body, groupable, max_candidates
from collector.jobs import Job, RequestCheck, request_body
from collector.journal import Journal
from collector.prepare import prepare_run
from collector.progress import Progress, tokens_in
from collector.result import CollectResult
from collector.servers import Server, ServerPool
from collector.transport import Refused, map_errors, ndjson_lines, refusal
from protocols.stream import StreamError

__all__ = [
    "CollectConfig", "CollectResult", "Collector", "PermanentError", "PoolConfig", "RetryConfig", "RetryableError",
    "RoundConfig", "Sampling", "collect", "collect_async", "derive_seed", "prepare_run", "request_body",
]


# --------------------------------------------------------------------------- the loop


class Collector:
    """One collection run: the queue of requests, the servers, the dispatcher and the journal.

    A request carries one document's policies: one of them (the body names a ``candidate``),
    or several where the server takes ``candidates`` (collector/grouped.py). Either way it is
    sent, streamed, journaled and checked by the same code (:meth:`_run`), and each policy then
    completes, is retried or fails on its own.
    """

    def __init__(self, cfg: CollectConfig, docs: Sequence[Document], journal: Journal,
                 stop_reason: Callable[[], str | None] | None = None) -> None:
        self.cfg, self.docs, self.journal = cfg, list(docs), journal
        # Asked after each failed attempt: a reason to give up on everything now (e.g. the
        # demo's server process has exited) instead of retrying into a dead socket.
        self.stop_reason = stop_reason
        manifest = journal.read_manifest() or {}
        params = cfg.round_params(manifest.get("params") or cfg.params(file_sha256(cfg.docs_file)))
        ledger = RunLedger(model=manifest.get("model"))
        if cfg.round.index:  # a later round asks for the prompts round 0 saw
            ledger.learn_prompts(journal.for_round(0), [doc.id for doc in self.docs], cfg.policies)
        self.check = RequestCheck(cfg, journal, params, ledger)
        self.ready: deque[Job] = deque()       # requests waiting for a free server slot
        self.wake = asyncio.Event()             # something changed: a slot freed, a request is ready
        self.timers: set[asyncio.Task[None]] = set()
        self.running: set[asyncio.Task[None]] = set()
        self.group_sizes: dict[str, int] = {}   # server -> candidates it takes per request (its /info)
        todo, set_aside = self._resume(params, ledger)
        total = sum(cfg.replicates_for(doc.id, p) > 0 for doc in self.docs for p in cfg.policies)
        self.result = CollectResult(total=total, skipped=total - len(todo), set_aside=set_aside)
        self.ready.extend(todo)
        self.pending = len(todo)
        self.unfinished = {job.key: job for job in todo}

    def _resume(self, params: dict[str, Any], ledger: RunLedger) -> tuple[list[Job], dict[str, str]]:
        """Requests still to do: those without a complete file, and those whose file fails its checks
        (set aside, never deleted, so a resume never counts a wrong or damaged file complete)."""
        todo: list[Job] = []
        set_aside: dict[str, str] = {}
        for doc in self.docs:
            asked = [p for p in self.cfg.policies if self.cfg.replicates_for(doc.id, p) > 0]
            complete, rejected = audit_document(self.journal, doc.id, asked, params, ledger)
            for policy, problem in rejected.items():
                where = self.journal.set_aside(doc.id, policy)
                set_aside[f"{doc.id} × {policy}"] = f"{problem} (kept as {where.name if where else '?'})"
            todo += [Job(doc, p) for p in asked if p not in complete]
        for key, reason in set_aside.items():
            print(f"set aside {key}: {reason}", file=sys.stderr)
        return todo, set_aside

    async def run(self) -> CollectResult:
        import httpx

        start = time.monotonic()
        self.progress = Progress(self.result.total, self.result.skipped, self.cfg.progress)
        pool = self.cfg.pool
        self.pool = ServerPool(self.cfg.servers, pool.servers_file, concurrency=pool.concurrency,
                               backoff_s=pool.server_backoff_s, backoff_max_s=pool.server_backoff_max_s,
                               poll_s=pool.servers_poll_s, say=self._say)
        headers = {"Authorization": f"Bearer {pool.api_key}"} if pool.api_key else {}
        timeout = httpx.Timeout(30.0, read=self.cfg.retry.read_timeout_s)
        # The pool bounds requests per server; the client must not queue them a second time.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        try:
            async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
                try:
                    await self._dispatch(client)
                    await self._decode_answers(client)
                finally:
                    for task in [*self.running, *self.timers]:
                        task.cancel()
                    await asyncio.gather(*self.running, *self.timers, return_exceptions=True)
        finally:
            self.progress.close()
            self.result.tokens = self.progress.tokens
            self.result.retries = self.progress.retries
            self.result.elapsed_s = time.monotonic() - start
            self.result.servers = self.pool.stats()
        return self.result

    async def _decode_answers(self, client: Any) -> None:
        """Decode the complete requests' answers when the documents carry some (collector.answers):
        a coupled run's round 0 only, on any listed server."""
        if self.cfg.kind != "coupled" or self.cfg.round.index or not has_answers(self.docs):
            return
        urls = [s.url for s in self.pool.listed] or list(self.cfg.servers)
        n = await decode_answers(client, self.journal, self.docs, self.cfg.policies, urls, self._say)
        if n:
            self._say(f"answers: decoded {n} requests' answers")

    # ----------------------------------------------------------------------- dispatching

    async def _dispatch(self, client: Any) -> None:
        """Hand each ready request to the least loaded server with a free slot, until none is left."""
        waiting_since: float | None = None
        while self.pending:
            self.wake.clear()
            self.pool.refresh(force=False)
            waiting_since = self._watch_servers(waiting_since)
            if not self.pending:
                break  # the wait for servers ran out
            server = self.pool.pick() if self.ready else None
            if server is None:
                await self._sleep_until_change()
                continue
            self.pool.started(server)  # before the task runs: the next pick must see the slot taken
            task = asyncio.create_task(self._run_jobs(client, server, self._take_ready()))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    def _watch_servers(self, since: float | None) -> float | None:
        """Track how long no listed server has answered; stop the run once that exceeds the wait."""
        wait_s = self.cfg.pool.wait_for_servers_s
        if self.pool.healthy:
            if since is not None:
                self._say(f"servers available again ({len(self.pool.listed)} listed); collecting")
            return None
        now = time.monotonic()
        if since is None:
            self._say(f"{self.pool.describe()}; waiting up to {wait_s:g} s for one "
                      "(--wait-for-servers); complete requests are kept")
            return now
        if now - since > wait_s and not self.running:
            self._abort(f"{self.pool.describe()} for {wait_s:g} s (--wait-for-servers)")
        return since

    async def _sleep_until_change(self) -> None:
        timeout = self.cfg.pool.servers_poll_s
        if not self.pool.healthy:  # check the wait for servers often enough to keep its deadline
            timeout = min(timeout, max(self.cfg.pool.wait_for_servers_s, 0.01))
        soon = self.pool.next_change()
        if soon is not None:
            timeout = min(timeout, soon)
        try:
            async with asyncio.timeout(max(timeout, 0.001)):
                await self.wake.wait()
        except TimeoutError:
            pass

    def _say(self, message: str) -> None:
        bar = getattr(self, "progress", None)
        if bar is not None:
            bar.bar.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)

    def _take_ready(self) -> list[Job]:
        """The next ready request and, when grouping, the ready requests of the same document
        whose bodies differ only in policy and seed (looked for near the queue's front)."""
        first = self.ready.popleft()
        if not self.cfg.pool.group_candidates or first.solo:
            return [first]
        body = request_body(self.cfg, first.doc, first.policy)
        near = list(itertools.islice(self.ready, 4 * len(self.cfg.policies)))
        mates = [j for j in near if j.doc.id == first.doc.id and not j.solo
                 and groupable(body, request_body(self.cfg, j.doc, j.policy))]
        for job in mates:
            self.ready.remove(job)
        return [first, *mates]

    def _put_back(self, jobs: Sequence[Job]) -> None:
        self.ready.extendleft(reversed(jobs))
        self.wake.set()

    async def _group_size(self, client: Any, server: str) -> int:
        """Candidates ``server`` takes per request (its ``/info``; remembered once answered)."""
        if server not in self.group_sizes:
            try:
                r = await client.get(f"{server}/info")
                if r.status_code != 200:
                    return 0
                self.group_sizes[server] = max_candidates(r.json())
            except Exception:  # an unreachable or odd server: ask again next time
                return 0
        return self.group_sizes[server]

    async def _run_jobs(self, client: Any, server: Server, jobs: list[Job]) -> None:
        """Run ``jobs`` (one document's requests) as one request: all of them where the server takes
        candidates (up to its maximum), else the first alone; the rest go back to the queue."""
        size = await self._group_size(client, server.url) if len(jobs) > 1 else 0
        size = max(size, 1)
        self._put_back(jobs[size:])
        await self._run(client, server, jobs[:size])

    # ----------------------------------------------------------------------- one attempt

    async def _run(self, client: Any, server: Server, jobs: list[Job]) -> None:
        """One attempt of ``jobs`` on ``server`` (whose slot the dispatcher took); each request then
        completes, retries or fails on its own, as if it had been sent alone."""
        self.progress.servers(self.pool)
        for job in jobs:
            job.attempts += 1
            job.tokens = 0
        outcome: dict[str, Any] = {}
        ends: dict[str, Exception | None] = {}
        try:
            await self._attempt(client, server.url, jobs, ends)
        except asyncio.CancelledError:  # the run is ending: not the server's failure
            outcome["counted"] = False
            raise
        except (RetryableError, PermanentError) as exc:
            if isinstance(exc, Refused) and len(jobs) > 1:
                self._resend_alone(jobs, exc)
            else:
                outcome["unreachable"] = getattr(exc, "unreachable", False)
                # Candidates committed before the response failed are complete (their files are
                # whole and checked); only the others share its error.
                ends = {job.policy: None if job.policy in ends and ends[job.policy] is None else exc for job in jobs}
        except Exception as exc:  # a bug or an unforeseen failure: these requests end, the run goes on
            ends = {job.policy: PermanentError(f"unexpected {type(exc).__name__}: {exc}") for job in jobs}
        finally:  # also on cancellation: the slot is free again
            done = [job for job in jobs if job.policy in ends and ends[job.policy] is None]
            if done:
                outcome["tokens"] = sum(job.tokens for job in done)
            self.pool.finished(server, **outcome)
            server.requests += max(len(done) - 1, 0)   # each completed policy counts as a request
            self.progress.servers(self.pool)
            self.wake.set()
        for job in jobs:
            if job.policy in ends:
                self._settle(job, ends[job.policy])

    def _resend_alone(self, jobs: list[Job], exc: Refused) -> None:
        """A multi-candidate request refused as a whole (e.g. a 422 naming one candidate): each
        policy goes back alone, so that it names its own error; the attempt does not count."""
        self._say(f"{jobs[0].doc.id}: grouped request refused ({exc}); sending its policies one by one")
        for job in jobs:
            job.attempts -= 1
            job.solo = True
        self._put_back(jobs)

    async def _attempt(self, client: Any, server: str, jobs: list[Job], ends: dict[str, Exception | None]) -> None:
        """One try of ``jobs`` as one request, within their deadlines together: fills ``ends``
        (policy -> None when complete, or its error) as streams end; raises Retryable/Permanent
        errors for the response as a whole."""
        bodies = [request_body(self.cfg, job.doc, job.policy) for job in jobs]
        per_policy = self.cfg.retry.request_timeout_s
        limit = None if per_policy is None else per_policy * len(jobs)
        if limit is None:
            deadline = "no deadline"
        elif len(jobs) == 1:
            deadline = f"--request-timeout {limit:g} s"
        else:
            deadline = f"{limit:g} s (--request-timeout per policy)"
        with map_errors(server, deadline):
            async with asyncio.timeout(limit):
                async with client.stream("POST", f"{server}/v1/traces",
                                         json=bodies[0] if len(jobs) == 1 else group_body(bodies),
                                         headers={"Accept": "application/x-ndjson"}) as response:
                    if response.status_code != 200:
                        raise refusal(response.status_code, await response.aread(), response.headers)
                    await self._receive(response, jobs, ends)

    async def _receive(self, response: Any, jobs: list[Job], ends: dict[str, Exception | None]) -> None:
        """Journal and check the response's streams as its lines arrive (:class:`Exchange`),
        recording in ``ends`` how each ended."""
        exchange = Exchange(jobs, self.journal, ends)
        try:
            async with aclosing(ndjson_lines(response.aiter_bytes())) as lines:
                async for raw in lines:
                    stream = exchange.route(raw)
                    if stream is None:
                        continue
                    with exchange.outcome(stream):
                        self._feed(stream, raw)
                        if exchange.shared and stream.reader.end is not None:
                            self._complete(stream)   # a candidate completes at its own end
                            exchange.ends[stream.job.policy] = None
            for stream in exchange.unended():
                with exchange.outcome(stream):
                    if exchange.shared:
                        raise RetryableError(f"the response ended before {stream.job.policy}'s end record")
                    self._complete(stream)   # the reader names a truncation
                    exchange.ends[stream.job.policy] = None
        finally:
            exchange.close()

    def _feed(self, stream: Stream, raw: bytes) -> None:
        """Journal one line of ``stream`` and read it."""
        stream.writer.write(raw)
        try:
            record = stream.reader.feed(raw)
        except StreamError as exc:
            raise stream_failure(exc) from None
        if record is not None and record["type"] in ("step", "shared_step", "branch", "reference_step"):
            n = tokens_in(record)
            stream.job.tokens += n
            self.progress.add_tokens(n)
            job = stream.job
            self.progress.record(job.key, record["type"], self.cfg.max_new_tokens,
                                 self.cfg.replicates_for(job.doc.id, job.policy))

    def _complete(self, stream: Stream) -> None:
        """Check the whole stream and its header, assemble it, then make the request complete."""
        from protocols import TraceValidationError, assemble_stream

        job = stream.job
        try:
            whole = stream.reader.finish()
        except StreamError as exc:
            raise stream_failure(exc) from None
        self.check(job, whole.header)
        try:
            assemble_stream(whole, doc=job.doc.id)
        except (StreamError, TraceValidationError) as exc:
            # The digest held: the server sent exactly this, and would again.
            raise PermanentError(f"the stream does not assemble: {exc}") from None
        stream.writer.commit()
        self.check.record(job, whole.header)

    # ----------------------------------------------------------------------- outcomes

    def _settle(self, job: Job, error: Exception | None) -> None:
        """What one request's attempt comes to: complete, retried or failed."""
        if error is not None:   # what the attempt streamed is not work done
            self.progress.undo(job.key)
        if error is None:
            self.result.completed += 1
            self.progress.done(job.key)
            self._finish(job, None)
        elif isinstance(error, RetryableError):
            self._retry(job, error)
        elif isinstance(error, PermanentError) and error.fatal:
            self._abort(str(error))
        else:
            self._finish(job, str(error))

    def _retry(self, job: Job, exc: RetryableError) -> None:
        """Put a failed attempt back on the queue (after a backoff), or end the request."""
        reason = self.stop_reason() if self.stop_reason else None
        if reason:
            self._abort(reason)
        elif not exc.sent:  # never reached the server: another server takes it at once, attempt not counted
            job.attempts -= 1
            self.ready.appendleft(job)
        elif job.attempts >= self.cfg.retry.max_attempts:
            self._finish(job, f"{exc} (after {job.attempts} attempts)")
        else:
            self.progress.retry()
            self._requeue_later(job, self.cfg.retry.backoff(job.attempts, exc.retry_after))

    def _abort(self, reason: str) -> None:
        """Give up on every unfinished request (left incomplete; a rerun resumes them)."""
        for key in self.unfinished:
            self.result.failed[key] = reason
        self.unfinished.clear()
        self.ready.clear()
        self.pending = 0
        self._say(f"collection stopped: {reason}")
        self.wake.set()

    def _finish(self, job: Job, failure: str | None) -> None:
        if self.unfinished.pop(job.key, None) is None:
            return  # already accounted for by _abort
        if failure is not None:
            self.result.failed[job.key] = failure
            self._say(f"request {job.key} failed: {failure}")
        self.pending -= 1
        self.wake.set()

    def _requeue_later(self, job: Job, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            if job.key in self.unfinished:
                self.ready.append(job)
                self.wake.set()

        task = asyncio.create_task(later())
        self.timers.add(task)
        task.add_done_callback(self.timers.discard)


# --------------------------------------------------------------------------- entry points


async def collect_async(cfg: CollectConfig, stop_reason: Callable[[], str | None] | None = None) -> CollectResult:
    """:func:`collect` inside a running event loop."""
    journal, docs = prepare_run(cfg)
    return await Collector(cfg, docs, journal, stop_reason).run()


def collect(cfg: CollectConfig, stop_reason: Callable[[], str | None] | None = None) -> CollectResult:
    """Run a collection to completion (or until every remaining request has failed).

    Parameters
    ----------
    cfg : CollectConfig
        The run; rerunning with the same ``cfg`` resumes it.
    stop_reason : callable, optional
        Consulted after each failed attempt; a non-empty answer stops the whole
        collection at once (the requests stay incomplete for a rerun).

    Returns
    -------
    CollectResult
        Counts, failures and throughput; ``ok`` when every request is complete.

    Raises
    ------
    CollectorError
        Only for the run as a whole (documents, manifest, ``--out``); a failure of
        one request is reported in the result, never raised.

    Examples
    --------
    >>> result = collect(CollectConfig.flat(servers=["http://127.0.0.1:8080"], docs_file="docs.jsonl",
    ...                                     policies=["snapkv@0.5"], out="runs/x", seed=1))  # doctest: +SKIP
    >>> print(result.summary())                                                       # doctest: +SKIP
    """
    return asyncio.run(collect_async(cfg, stop_reason))
