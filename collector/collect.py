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
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.checks import RunLedger, audit_document, derive_seed, header_problems
from collector.config import CollectConfig, PoolConfig, RetryConfig, RoundConfig, Sampling
from collector.documents import Document, file_sha256, read_jsonl, render_messages
from collector.errors import ConfigError, DocumentsError, PermanentError, RetryableError
from collector.grouped import CandidateSplitter, group_body, groupable, max_candidates
from collector.journal import DOCUMENTS, Journal, RequestWriter
from collector.servers import Server, ServerPool, ServerStats, read_servers_file
from collector.transport import Refused, map_errors, ndjson_lines, refusal
from protocols.kinds import Kind
from protocols.stream import StreamError, StreamReader

__all__ = [
    "CollectConfig", "CollectResult", "Collector", "PermanentError", "PoolConfig", "RetryConfig", "RetryableError",
    "RoundConfig", "Sampling", "collect", "collect_async", "derive_seed", "prepare_run", "request_body",
]


@dataclass
class CollectResult:
    """What a collection did: counts, failures (request -> last error), throughput.

    Attributes
    ----------
    total, skipped, completed : int
        Requests in the run, already complete before, collected now.
    failed : dict
        ``"doc × policy"`` -> the reason it failed.
    set_aside : dict
        ``"doc × policy"`` -> why its journal file was set aside for recollection.
    retries, tokens : int
        Attempts repeated, tokens received.
    elapsed_s : float
        Wall time.
    servers : dict
        url -> :class:`collector.servers.ServerStats` (requests, failures, tokens/s),
        for every server that was listed during the run.
    """

    total: int
    skipped: int
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    set_aside: dict[str, str] = field(default_factory=dict)
    retries: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    servers: dict[str, ServerStats] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def server_table(self) -> str:
        """Per-server throughput: requests completed, failed attempts, tokens, tokens/s while busy."""
        if not self.servers:
            return ""
        width = max(len("server"), *(len(url) for url in self.servers))
        lines = [f"  {'server':<{width}}  requests  failures    tokens  tokens/s"]
        lines += [f"  {s.url:<{width}}  {s.requests:>8}  {s.failures:>8}  {s.tokens:>8}  {s.tokens_per_s:>8.1f}"
                  for s in self.servers.values()]
        return "\n".join(lines)

    def summary(self) -> str:
        rate = self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        text = (f"{self.completed} requests collected, {self.skipped} already complete, "
                f"{len(self.failed)} failed, {self.retries} retries; {self.tokens} tokens in "
                f"{self.elapsed_s:.1f} s ({rate:.1f} tokens/s)")
        if self.servers:
            text += "\n" + self.server_table()
        for key, reason in sorted(self.set_aside.items()):
            text += f"\n  SET ASIDE {key}: {reason}"
        for key, reason in sorted(self.failed.items()):
            text += f"\n  FAILED {key}: {reason}"
        return text


@dataclass
class _Job:
    doc: Document
    policy: str
    attempts: int = 0
    tokens: int = 0   # received in the current attempt
    solo: bool = False   # never grouped again: its group's request was refused as a whole

    @property
    def key(self) -> str:
        return f"{self.doc.id} × {self.policy}"


# --------------------------------------------------------------------------- requests


def request_body(cfg: CollectConfig, doc: Document, policy: str) -> dict[str, Any]:
    """The ``/v1/traces`` JSON for one (document, policy).

    Parameters
    ----------
    cfg : CollectConfig
        The run.
    doc : Document
        The document (rendered with ``cfg.template``).
    policy : str
        The candidate policy id.

    Returns
    -------
    dict
        The request body (docs/service.md); its seed is :func:`derive_seed`.

    Examples
    --------
    >>> cfg = CollectConfig(servers=["http://x"], docs_file="d.jsonl", policies=["snapkv@0.5"], out="o")
    >>> request_body(cfg, Document("d1", "Text."), "snapkv@0.5")["doc_id"]
    'd1'
    """
    s = cfg.sampling
    parameters: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens, "temperature": s.temperature,
        "do_sample": s.temperature > 0,
        "seed": derive_seed(s.seed, doc.id, None if s.common_random_numbers else policy, cfg.round.index),
    }
    if s.top_k is not None:
        parameters["top_k"] = s.top_k
    if s.top_p is not None:
        parameters["top_p"] = s.top_p
    body = {
        "messages": render_messages(doc, cfg.template), "parameters": parameters,
        "candidate": policy, "reference": "full", "kind": cfg.kind,
        "replicates": cfg.replicates_for(doc.id, policy), "window": cfg.effective_window, "doc_id": doc.id,
    }
    if cfg.kind == Kind.REFERENCE:
        del body["window"]   # a server refuses a window for reference traces (they have none)
    if cfg.top_logprobs:   # only when asked, so a server without logit traces still serves the rest
        body["top_logprobs"] = cfg.top_logprobs
    return body



def _tokens_in(record: Mapping[str, Any]) -> int:
    """Tokens a record reports (progress only): survival-path or coupled tokens, branch tokens."""
    values = record.get("token") or record.get("x_token") or []
    return sum(v is not None for v in values)


class _RequestCheck:
    """Checks a stream's header against its request and the run (model, each document's prompt)."""

    def __init__(self, cfg: CollectConfig, journal: Journal, params: dict[str, Any], ledger: RunLedger) -> None:
        self.cfg, self.journal, self.params, self.ledger = cfg, journal, params, ledger

    def __call__(self, job: _Job, header: dict[str, Any]) -> None:
        problems = header_problems(header, self.params, job.doc.id, job.policy)
        if problems:
            raise PermanentError("the stream answers another request: " + "; ".join(problems))
        problems = self.ledger.problems(header, job.doc.id)
        if any(p.startswith("prompt") for p in problems):
            # Which prompt is right is unknown: the document's requests are all recollected.
            aside = [self.journal.set_aside(job.doc.id, p) for p in self.cfg.policies]
            self.ledger.forget(job.doc.id)
            names = ", ".join(a.name for a in aside if a is not None) or "none yet"
            problems.append(f"set aside for recollection: {names}")
        if problems:
            raise PermanentError("; ".join(problems))

    def record(self, job: _Job, header: dict[str, Any]) -> None:
        if self.ledger.model is None:  # the first complete request fixes the run's model
            manifest = self.journal.read_manifest() or {}
            manifest["model"] = header.get("model")
            self.journal.write_manifest(manifest)
        self.ledger.record(header, job.doc.id)


# The share of one request's work a streamed record stands for, by record type: a
# residual request's survival steps and its branches take about as long each
# (docs/service.md), and it sends one branch record per replicate at most.
_RECORD_SHARE: dict[str, Callable[[int, int], float]] = {
    "step": lambda steps, replicates: 1 / steps,
    "reference_step": lambda steps, replicates: 1 / steps,
    "shared_step": lambda steps, replicates: 0.5 / steps,
    "branch": lambda steps, replicates: 0.5 / replicates,
}
_UNFINISHED_CAP = 0.99   # a request's bar share before its end record (it may send fewer records)


class _Progress:
    """tqdm on stderr: requests' work done (records streamed, in requests), tokens/s,
    retries, servers busy, ETA.

    The bar moves with every step record, not only when a request ends: with many
    requests decoded together, all of them end late and at once."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="collect", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1,
                        bar_format="{l_bar}{bar}| {n:.1f}/{total} req [{elapsed}<{remaining}{postfix}]")
        self.shares: dict[str, float] = {}   # request key -> its share counted so far, in requests
        self.start = time.monotonic()
        self.tokens = 0
        self.retries = 0
        self.server_note = ""

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._postfix()

    def record(self, key: str, record_type: str, steps: int, replicates: int) -> None:
        """A record of request ``key`` arrived: move the bar by the share of work it stands for."""
        share = _RECORD_SHARE.get(record_type)
        if share is None:
            return
        before = self.shares.get(key, 0.0)
        after = min(before + share(steps, replicates), _UNFINISHED_CAP)
        self.shares[key] = after
        self.bar.update(after - before)

    def done(self, key: str) -> None:
        self.bar.update(1 - self.shares.pop(key, 0.0))
        self._postfix()

    def undo(self, key: str) -> None:
        """A request's attempt failed: what it streamed is not work done."""
        self.bar.update(-self.shares.pop(key, 0.0))

    def retry(self) -> None:
        self.retries += 1
        self._postfix()

    def servers(self, pool: ServerPool) -> None:
        listed = pool.listed
        busy = sum(s.in_flight > 0 for s in listed)
        self.server_note = f", {busy}/{len(listed)} servers busy"
        self._postfix()

    def _postfix(self) -> None:
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, {self.retries} retries{self.server_note}", refresh=False)

    def close(self) -> None:
        self.bar.close()


# --------------------------------------------------------------------------- one response's streams


@dataclass
class _Stream:
    """One (document, policy) stream of a response: its request, its journal file and its reader."""

    job: _Job
    writer: RequestWriter
    reader: StreamReader = field(default_factory=StreamReader)


class _Exchange:
    """One response's streams, one per request sent, and how each ended (``ends``: policy -> None
    when complete, or its error).

    A response to one policy is that policy's stream alone: every line is its own (blank ones
    included, as its journal file has always kept them), its failure is the response's, and it
    completes when the response ends, so that a line after its ``end`` is still read and refused.
    A multi-candidate response multiplexes several (collector/grouped.py): each line goes to the
    candidate it names (a blank one to none), and each stream completes at its own ``end``, or
    fails alone; a stream's lines after it ended are dropped.
    """

    def __init__(self, jobs: Sequence[_Job], journal: Journal, ends: dict[str, Exception | None]) -> None:
        self.streams = {job.policy: _Stream(job, journal.open_request(job.doc.id, job.policy)) for job in jobs}
        self.shared = len(jobs) > 1
        self.splitter = CandidateSplitter(list(self.streams)) if self.shared else None
        # The caller's dict, so that the candidates already committed stay complete when the
        # response as a whole fails afterwards (a dropped connection, a stray line).
        self.ends = ends

    def route(self, raw: bytes) -> _Stream | None:
        """The stream a line belongs to (None: a blank line, or a stream that has ended)."""
        if self.splitter is None:
            return next(iter(self.streams.values()))
        try:
            policy = self.splitter.route(raw)
        except StreamError as exc:   # a line for no candidate asked: nothing in this response is trusted
            raise RetryableError(str(exc)) from None
        return None if policy is None or policy in self.ends else self.streams[policy]

    @contextmanager
    def outcome(self, stream: _Stream) -> Iterator[None]:
        """A stream's failure: the whole response's when it is the only stream, else that stream's end."""
        try:
            yield
        except (RetryableError, PermanentError) as exc:
            if not self.shared:
                raise
            self.ends[stream.job.policy] = exc

    def unended(self) -> list[_Stream]:
        return [s for policy, s in self.streams.items() if policy not in self.ends]

    def close(self) -> None:
        for stream in self.streams.values():
            stream.writer.abort()   # nothing for the committed ones


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
        self.check = _RequestCheck(cfg, journal, params, ledger)
        self.ready: deque[_Job] = deque()       # requests waiting for a free server slot
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

    def _resume(self, params: dict[str, Any], ledger: RunLedger) -> tuple[list[_Job], dict[str, str]]:
        """Requests still to do: those without a complete file, and those whose file fails its checks
        (set aside, never deleted, so a resume never counts a wrong or damaged file complete)."""
        todo: list[_Job] = []
        set_aside: dict[str, str] = {}
        for doc in self.docs:
            asked = [p for p in self.cfg.policies if self.cfg.replicates_for(doc.id, p) > 0]
            complete, rejected = audit_document(self.journal, doc.id, asked, params, ledger)
            for policy, problem in rejected.items():
                where = self.journal.set_aside(doc.id, policy)
                set_aside[f"{doc.id} × {policy}"] = f"{problem} (kept as {where.name if where else '?'})"
            todo += [_Job(doc, p) for p in asked if p not in complete]
        for key, reason in set_aside.items():
            print(f"set aside {key}: {reason}", file=sys.stderr)
        return todo, set_aside

    async def run(self) -> CollectResult:
        import httpx

        start = time.monotonic()
        self.progress = _Progress(self.result.total, self.result.skipped, self.cfg.progress)
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

    def _take_ready(self) -> list[_Job]:
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

    def _put_back(self, jobs: Sequence[_Job]) -> None:
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

    async def _run_jobs(self, client: Any, server: Server, jobs: list[_Job]) -> None:
        """Run ``jobs`` (one document's requests) as one request: all of them where the server takes
        candidates (up to its maximum), else the first alone; the rest go back to the queue."""
        size = await self._group_size(client, server.url) if len(jobs) > 1 else 0
        size = max(size, 1)
        self._put_back(jobs[size:])
        await self._run(client, server, jobs[:size])

    # ----------------------------------------------------------------------- one attempt

    async def _run(self, client: Any, server: Server, jobs: list[_Job]) -> None:
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

    def _resend_alone(self, jobs: list[_Job], exc: Refused) -> None:
        """A multi-candidate request refused as a whole (e.g. a 422 naming one candidate): each
        policy goes back alone, so that it names its own error; the attempt does not count."""
        self._say(f"{jobs[0].doc.id}: grouped request refused ({exc}); sending its policies one by one")
        for job in jobs:
            job.attempts -= 1
            job.solo = True
        self._put_back(jobs)

    async def _attempt(self, client: Any, server: str, jobs: list[_Job], ends: dict[str, Exception | None]) -> None:
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

    async def _receive(self, response: Any, jobs: list[_Job], ends: dict[str, Exception | None]) -> None:
        """Journal and check the response's streams as its lines arrive (:class:`_Exchange`),
        recording in ``ends`` how each ended."""
        exchange = _Exchange(jobs, self.journal, ends)
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

    def _feed(self, stream: _Stream, raw: bytes) -> None:
        """Journal one line of ``stream`` and read it."""
        stream.writer.write(raw)
        try:
            record = stream.reader.feed(raw)
        except StreamError as exc:
            raise _stream_failure(exc) from None
        if record is not None and record["type"] in ("step", "shared_step", "branch", "reference_step"):
            n = _tokens_in(record)
            stream.job.tokens += n
            self.progress.add_tokens(n)
            job = stream.job
            self.progress.record(job.key, record["type"], self.cfg.max_new_tokens,
                                 self.cfg.replicates_for(job.doc.id, job.policy))

    def _complete(self, stream: _Stream) -> None:
        """Check the whole stream and its header, assemble it, then make the request complete."""
        from protocols import TraceValidationError, assemble_stream

        job = stream.job
        try:
            whole = stream.reader.finish()
        except StreamError as exc:
            raise _stream_failure(exc) from None
        self.check(job, whole.header)
        try:
            assemble_stream(whole, doc=job.doc.id)
        except (StreamError, TraceValidationError) as exc:
            # The digest held: the server sent exactly this, and would again.
            raise PermanentError(f"the stream does not assemble: {exc}") from None
        stream.writer.commit()
        self.check.record(job, whole.header)

    # ----------------------------------------------------------------------- outcomes

    def _settle(self, job: _Job, error: Exception | None) -> None:
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

    def _retry(self, job: _Job, exc: RetryableError) -> None:
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

    def _finish(self, job: _Job, failure: str | None) -> None:
        if self.unfinished.pop(job.key, None) is None:
            return  # already accounted for by _abort
        if failure is not None:
            self.result.failed[job.key] = failure
            self._say(f"request {job.key} failed: {failure}")
        self.pending -= 1
        self.wake.set()

    def _requeue_later(self, job: _Job, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            if job.key in self.unfinished:
                self.ready.append(job)
                self.wake.set()

        task = asyncio.create_task(later())
        self.timers.add(task)
        task.add_done_callback(self.timers.discard)


def _stream_failure(exc: StreamError) -> RetryableError | PermanentError:
    """A stream the reader refused: a server's validation error is permanent, the rest may pass next time."""
    if exc.reason == "failed" and (exc.record or {}).get("error_type") == "validation":
        return PermanentError(str(exc))
    return RetryableError(str(exc))


# --------------------------------------------------------------------------- entry points


def prepare_run(cfg: CollectConfig) -> tuple[Journal, list[Document]]:
    """Create or check the run directory: copy the documents and write/compare the manifest.

    Parameters
    ----------
    cfg : CollectConfig
        The run.

    Returns
    -------
    (Journal, list of Document)
        The journal of the config's round and the run's documents.

    Raises
    ------
    DocumentsError
        An unreadable or empty documents file.
    ManifestMismatch
        A resume with other trace-deciding parameters (each difference named), or a
        later round whose recorded allocation differs from the config's.
    JournalError
        An unreadable manifest, or an ``--out`` folder that is not a run.
    ConfigError
        An unreadable ``servers_file``.
    """
    servers_file = cfg.pool.servers_file
    if servers_file is not None:  # a typo in the path is refused now, not after a wait for servers
        try:
            read_servers_file(servers_file)
        except OSError as exc:
            raise ConfigError(f"{servers_file}: cannot read the servers file ({exc.strerror or exc})") from None
    journal = Journal(cfg.out)
    docs = read_jsonl(cfg.docs_file)
    if not docs:
        raise DocumentsError(f"{cfg.docs_file}: no documents")
    digest = file_sha256(cfg.docs_file)
    journal.start(cfg.params(digest), {
        "servers": cfg.servers, "servers_file": str(servers_file) if servers_file else None,
        "concurrency": cfg.pool.concurrency, "docs_file": str(cfg.docs_file),
        "documents": DOCUMENTS, "n_docs": len(docs),
    })
    copy = journal.dir / DOCUMENTS
    if not copy.exists() or file_sha256(copy) != digest:
        copy.write_bytes(Path(cfg.docs_file).read_bytes())  # pack reads the run dir alone
    if cfg.round.index:  # a later round: its allocation is recorded (or checked) before any request
        unknown = sorted(set(cfg.round.allocation or {}) - {doc.id for doc in docs})
        if unknown:
            raise ConfigError(f"round {cfg.round.index}'s allocation names documents not in "
                              f"{cfg.docs_file}: {', '.join(unknown[:5])}")
        journal = journal.for_round(cfg.round.index)
        journal.write_allocation(cfg.round.allocation or {})
    return journal, docs


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
