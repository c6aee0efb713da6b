"""The collector: drive trace servers over HTTP into a journal, then pack a dataset.

``collect`` sends one ``POST /v1/traces`` per (document, policy) to one or more
servers (httpx, async), ``concurrency`` requests in flight per server, from one
shared queue: whenever a server has a free slot it gets the next request, so a
faster server simply takes more work. The servers may change during the run
(``servers_file``, re-read every few seconds); a server that stops answering is
taken out of rotation with a backoff (``collector.servers.ServerPool``); when no
server answers the run waits, up to ``wait_for_servers_s``, then stops with the
requests left incomplete for a rerun. Every stream is written
to the journal as it arrives, read once by ``protocols.StreamReader`` (limits,
digest, order, shapes), and becomes complete only after its header answers the
request (``collector.checks``) and its dataset assembles and validates. Transient
failures (429, 5xx, dropped connections, a request past its deadline, truncated,
altered or malformed streams, server error records) are retried with exponential
backoff and jitter, on whichever server is free; a request that still fails after
``max_attempts`` is reported and left incomplete. Permanent failures (a 4xx, a
header that answers another request, a digested stream that does not assemble)
end the request at once. No failure of one request escapes its worker: the run
always finishes and reports.

Determinism: each request's seed is derived from (seed, document, policy), never from
the order of completion, so a resumed run produces the same traces as an
uninterrupted one on the same server hardware. With ``common_random_numbers`` it is
derived from (seed, document): every policy of a document draws the same random
numbers, which correlates their traces and shrinks the variance of paired
differences (docs/design.md); each policy's estimates stay unbiased.

Rounds: a config with ``round_index`` k >= 1 and an ``allocation`` (doc -> policy ->
replicates) collects one later round of an adaptive collection (``kvdiv collect
--target-se``, driven by ``kvdiv.adaptive``): only the allocated (document, policy)
pairs, each with its own R, seeds derived with the round, into the round's own
journal folder (``collector.journal``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.checks import RunLedger, asked_replicates, audit_document, derive_seed, header_problems
from collector.documents import TEMPLATES, Document, file_sha256, read_jsonl, render_messages
from collector.errors import ConfigError, DocumentsError, PermanentError, RetryableError
from collector.grouped import CandidateSplitter, group_body, groupable, max_candidates
from collector.journal import DOCUMENTS, Journal, RequestWriter
from collector.servers import Server, ServerPool, ServerStats, read_servers_file
from protocols import WIRE_KINDS, Kind
from protocols.stream import STREAM_LIMITS, StreamError, StreamReader

__all__ = [
    "CollectConfig", "CollectResult", "Collector", "PermanentError", "RetryableError", "collect", "collect_async",
    "derive_seed", "prepare_run", "request_body",
]

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass
class CollectConfig:
    """Everything ``collect`` needs; the fields in :meth:`params` are the resume contract.

    Attributes
    ----------
    servers : list of str
        Trace server URLs; requests are spread over them.
    servers_file : Path, optional
        A file of server URLs, one a line, re-read every ``servers_poll_s`` seconds
        during the run (servers may join and leave); used with ``servers``.
    docs_file, out : Path
        The JSONL documents and the run directory.
    policies : list of str
        Candidate policy ids (the reference is ``full``).
    kind, replicates, max_new_tokens, window : str, int, int, int or None
        Trace kind, R, T and W (W defaults to T).
    temperature, top_k, top_p, seed, template
        Sampling, the run seed and the prompt template.
    api_key, concurrency, max_attempts, backoff_s, backoff_max_s
        Authentication, requests in flight per server, tries per request and the
        exponential backoff.
    read_timeout_s, request_timeout_s : float
        Longest silence while reading, and longest whole request (None: no limit).
    wait_for_servers_s : float
        How long the run waits while no listed server answers before it stops
        (the requests left stay incomplete for a rerun).
    server_backoff_s, server_backoff_max_s : float
        First and longest time a server that stops answering is out of rotation.
    progress : bool
        Show a progress bar on stderr.
    round_index : int
        0 for the run's first (or only) round; k >= 1 for a later round of an
        adaptive collection, which needs ``allocation``.
    allocation : mapping, optional
        doc id -> policy -> replicates for round ``round_index`` (0 or absent: no
        request for that pair); recorded in the journal before the round starts.
    group_candidates : bool
        Send a document's policies as the candidates of one request to a server that
        advertises ``trace_candidates`` (collector/grouped.py); the journal gets the
        same per-(document, policy) files. Off: one request per (document, policy).

    Raises
    ------
    ConfigError
        Listing every parameter that cannot work.

    Examples
    --------
    >>> cfg = CollectConfig(servers=["http://127.0.0.1:8080/"], docs_file="d.jsonl", policies=["snapkv@0.5"],
    ...                     out="runs/x", max_new_tokens=8)
    >>> cfg.servers, cfg.effective_window
    (['http://127.0.0.1:8080'], 8)
    """

    servers: list[str]
    docs_file: Path
    policies: list[str]
    out: Path
    kind: str = "residual"
    replicates: int = 8
    max_new_tokens: int = 32
    window: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    common_random_numbers: bool = False
    template: str = "summarise"
    api_key: str | None = None
    concurrency: int = 1
    max_attempts: int = 6
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0
    read_timeout_s: float = 600.0
    request_timeout_s: float | None = 3600.0
    progress: bool = True
    servers_file: Path | None = None
    servers_poll_s: float = 2.0
    wait_for_servers_s: float = 300.0
    server_backoff_s: float = 1.0
    server_backoff_max_s: float = 60.0
    round_index: int = 0
    allocation: Mapping[str, Mapping[str, int]] | None = None
    group_candidates: bool = True

    def __post_init__(self) -> None:
        self.servers = [s.rstrip("/") for s in self.servers]
        self.docs_file, self.out = Path(self.docs_file), Path(self.out)
        self.servers_file = Path(self.servers_file) if self.servers_file is not None else None
        problems = self._problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def _problems(self) -> list[str]:
        problems = []
        if not self.servers and self.servers_file is None:
            problems.append("at least one --server or a --servers-file is needed")
        if not self.policies:
            problems.append("at least one policy is needed")
        if len(set(self.policies)) != len(self.policies):
            problems.append(f"duplicate policies in {self.policies}")
        if self.kind not in WIRE_KINDS:
            problems.append(f"--kind must be one of {WIRE_KINDS}, not {self.kind!r}")
        if self.template not in TEMPLATES:
            problems.append(f"--template must be one of {sorted(TEMPLATES)}, not {self.template!r}")
        if self.replicates < 1 or self.max_new_tokens < 1 or self.concurrency < 1 or self.max_attempts < 1:
            problems.append("--replicates, --max-new-tokens, --concurrency and attempts must be >= 1")
        if self.window is not None and not 1 <= self.window <= self.max_new_tokens:
            problems.append(f"--window must be in 1..{self.max_new_tokens}, not {self.window}")
        if self.kind == Kind.COUPLED and self.window not in (None, self.max_new_tokens):
            problems.append("--window applies to residual traces (coupled traces run to the horizon)")
        if self.temperature < 0:
            problems.append("--temperature must be >= 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            problems.append("--request-timeout must be > 0 seconds")
        problems += self._round_problems()
        if not self.wait_for_servers_s >= 0 or not self.servers_poll_s > 0 or not self.server_backoff_s > 0:
            problems.append("--wait-for-servers must be >= 0 seconds, the servers file's poll interval and the "
                            "server backoff > 0")
        return problems

    def _round_problems(self) -> list[str]:
        if self.round_index < 0:
            return [f"round_index must be >= 0, not {self.round_index}"]
        if (self.round_index > 0) != (self.allocation is not None):
            return ["a later round (round_index >= 1) needs an allocation, and only a later round takes one"]
        if self.allocation is None:
            return []
        unknown = sorted({p for row in self.allocation.values() for p in row} - set(self.policies))
        bad = [f"{d} × {p}: {r!r}" for d, row in self.allocation.items() for p, r in row.items()
               if not isinstance(r, int) or isinstance(r, bool) or r < 0]
        return ([f"the allocation names policies not in the run: {unknown}"] if unknown else []) + (
            [f"allocated replicates must be integers >= 0: {', '.join(bad[:5])}"] if bad else [])

    def round_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The run's parameters as this round's requests must answer them (round and allocation added)."""
        if not self.round_index:
            return dict(params)
        return {**params, "round": self.round_index,
                "allocation": {d: dict(row) for d, row in (self.allocation or {}).items()}}

    def replicates_for(self, doc_id: str, policy: str) -> int:
        """R asked of (doc_id, policy) in this round (0: not requested)."""
        return asked_replicates(self.round_params({"replicates": self.replicates}), doc_id, policy)

    def params(self, docs_sha256: str) -> dict[str, Any]:
        """The parameters that decide the traces' values (compared on resume and by ``pack``)."""
        return {
            "policies": list(self.policies), "kind": self.kind, "replicates": self.replicates,
            "max_new_tokens": self.max_new_tokens, "window": self.effective_window,
            "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
            "seed": self.seed, "template": self.template, "docs_sha256": docs_sha256,
            "reference": "full",
            # only when on, so journals written before the option existed still resume
            **({"common_random_numbers": True} if self.common_random_numbers else {}),
        }

    @property
    def effective_window(self) -> int:
        return self.max_new_tokens if self.window is None else self.window


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
    parameters: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "do_sample": cfg.temperature > 0,
        "seed": derive_seed(cfg.seed, doc.id, None if cfg.common_random_numbers else policy, cfg.round_index),
    }
    if cfg.top_k is not None:
        parameters["top_k"] = cfg.top_k
    if cfg.top_p is not None:
        parameters["top_p"] = cfg.top_p
    return {
        "messages": render_messages(doc, cfg.template), "parameters": parameters,
        "candidate": policy, "reference": "full", "kind": cfg.kind,
        "replicates": cfg.replicates_for(doc.id, policy), "window": cfg.effective_window, "doc_id": doc.id,
    }


def _error_message(status: int, body: bytes) -> str:
    try:
        obj = json.loads(body)
        detail = obj.get("error") or obj.get("detail") or obj
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        detail = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {detail}"


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers.get("retry-after", ""))
    except ValueError:
        return None


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


class _Progress:
    """tqdm on stderr: requests done, tokens/s, retries, servers busy, ETA."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="collect", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.start = time.monotonic()
        self.tokens = 0
        self.retries = 0
        self.server_note = ""

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._postfix()

    def done(self) -> None:
        self.bar.update(1)
        self._postfix()

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


# --------------------------------------------------------------------------- the loop


class Collector:
    """One collection run: the queue of requests, the servers, the dispatcher and the journal."""

    def __init__(self, cfg: CollectConfig, docs: Sequence[Document], journal: Journal,
                 stop_reason: Callable[[], str | None] | None = None) -> None:
        self.cfg, self.docs, self.journal = cfg, list(docs), journal
        # Asked after each failed attempt: a reason to give up on everything now (e.g. the
        # demo's server process has exited) instead of retrying into a dead socket.
        self.stop_reason = stop_reason
        manifest = journal.read_manifest() or {}
        params = cfg.round_params(manifest.get("params") or cfg.params(file_sha256(cfg.docs_file)))
        ledger = RunLedger(model=manifest.get("model"))
        if cfg.round_index:  # a later round asks for the prompts round 0 saw
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
        cfg = self.cfg
        self.pool = ServerPool(cfg.servers, cfg.servers_file, concurrency=cfg.concurrency,
                               backoff_s=cfg.server_backoff_s, backoff_max_s=cfg.server_backoff_max_s,
                               poll_s=cfg.servers_poll_s, say=self._say)
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        timeout = httpx.Timeout(30.0, read=cfg.read_timeout_s)
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
        if self.pool.healthy:
            if since is not None:
                self._say(f"servers available again ({len(self.pool.listed)} listed); collecting")
            return None
        now = time.monotonic()
        if since is None:
            self._say(f"{self.pool.describe()}; waiting up to {self.cfg.wait_for_servers_s:g} s for one "
                      "(--wait-for-servers); complete requests are kept")
            return now
        if now - since > self.cfg.wait_for_servers_s and not self.running:
            self._abort(f"{self.pool.describe()} for {self.cfg.wait_for_servers_s:g} s (--wait-for-servers)")
        return since

    async def _sleep_until_change(self) -> None:
        timeout = self.cfg.servers_poll_s
        if not self.pool.healthy:  # check the wait for servers often enough to keep its deadline
            timeout = min(timeout, max(self.cfg.wait_for_servers_s, 0.01))
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

    async def _run_job(self, client: Any, server: Server, job: _Job) -> None:
        """One attempt of ``job`` on ``server`` (whose slot the dispatcher took), and what follows from it."""
        self.progress.servers(self.pool)
        job.attempts += 1
        job.tokens = 0
        outcome: dict[str, Any] = {}
        try:
            await self._attempt(client, server.url, job)
        except asyncio.CancelledError:  # the run is ending: not the server's failure
            outcome["counted"] = False
            raise
        except RetryableError as exc:
            outcome["unreachable"] = exc.unreachable
            self._retry(job, exc)
        except PermanentError as exc:
            self._abort(str(exc)) if exc.fatal else self._finish(job, str(exc))
        except Exception as exc:  # a bug or an unforeseen failure: this request ends, the run goes on
            self._finish(job, f"unexpected {type(exc).__name__}: {exc}")
        else:
            outcome["tokens"] = job.tokens
            self.result.completed += 1
            self.progress.done()
            self._finish(job, None)
        finally:  # also on cancellation: the slot is free again
            self.pool.finished(server, **outcome)
            self.progress.servers(self.pool)
            self.wake.set()

    def _retry(self, job: _Job, exc: RetryableError) -> None:
        """Put a failed attempt back on the queue (after a backoff), or end the request."""
        reason = self.stop_reason() if self.stop_reason else None
        if reason:
            self._abort(reason)
        elif not exc.sent:  # never reached the server: another server takes it at once, attempt not counted
            job.attempts -= 1
            self.ready.appendleft(job)
        elif job.attempts >= self.cfg.max_attempts:
            self._finish(job, f"{exc} (after {job.attempts} attempts)")
        else:
            self.progress.retry()
            self._requeue_later(job, self._backoff(job.attempts, exc.retry_after))

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

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        # Full jitter: spreads retries of requests that failed together (one 429 burst).
        cap = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempt - 1))
        delay = random.uniform(0.5 * cap, cap)
        return max(delay, retry_after or 0.0)

    def _requeue_later(self, job: _Job, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            if job.key in self.unfinished:
                self.ready.append(job)
                self.wake.set()

        task = asyncio.create_task(later())
        self.timers.add(task)
        task.add_done_callback(self.timers.discard)

    async def _attempt(self, client: Any, server: str, job: _Job) -> None:
        """One try, within the whole-request deadline; raises Retryable/Permanent errors on failure."""
        try:
            async with asyncio.timeout(self.cfg.request_timeout_s):
                await self._request(client, server, job)
        except TimeoutError:
            raise RetryableError(f"no complete answer within --request-timeout {self.cfg.request_timeout_s:g} s "
                                 f"from {server}") from None

    async def _request(self, client: Any, server: str, job: _Job) -> None:
        import httpx

        body = request_body(self.cfg, job.doc, job.policy)
        try:
            async with client.stream("POST", f"{server}/v1/traces", json=body,
                                     headers={"Accept": "application/x-ndjson"}) as response:
                if response.status_code != 200:
                    message = _error_message(response.status_code, await response.aread())
                    if response.status_code in RETRY_STATUS:
                        raise RetryableError(message, _retry_after(response.headers))
                    if response.status_code in (401, 403):
                        raise PermanentError(f"{message} (check --api-key)", fatal=True)
                    raise PermanentError(message)
                await self._receive(response, job)
        except httpx.HTTPError as exc:  # refused, reset, dropped mid-stream, timed out, undecodable body
            # A refused connection never reached the server; a silent one may be down: both take the
            # server out of rotation for a while.
            unreachable = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout))
            raise RetryableError(f"{type(exc).__name__} from {server}: {exc or 'connection lost'}",
                                 unreachable=unreachable, sent=not isinstance(exc, httpx.ConnectError)) from None
        except OSError as exc:  # the journal's disk (full, removed): worth another attempt
            raise RetryableError(f"{type(exc).__name__}: {exc}") from None

    async def _receive(self, response: Any, job: _Job) -> None:
        writer = self.journal.open_request(job.doc.id, job.policy)
        reader = StreamReader()
        try:
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    self._take(writer, reader, raw + b"\n", job)
                if len(buffer) > STREAM_LIMITS.line_bytes:
                    raise RetryableError(f"a line longer than {STREAM_LIMITS.line_bytes} bytes")
            if buffer.strip():
                self._take(writer, reader, buffer, job)  # a final line without newline: kept, so truncation is seen
            self._complete(writer, reader, job)
        finally:
            writer.abort()

    def _take(self, writer: RequestWriter, reader: StreamReader, raw: bytes, job: _Job) -> None:
        writer.write(raw)
        try:
            record = reader.feed(raw)
        except StreamError as exc:
            raise _stream_failure(exc) from None
        if record is not None and record["type"] in ("step", "shared_step", "branch"):
            n = _tokens_in(record)
            job.tokens += n
            self.progress.add_tokens(n)

    def _complete(self, writer: RequestWriter, reader: StreamReader, job: _Job) -> None:
        """Check the whole stream and its header, assemble it, then make the request complete."""
        from protocols import TraceValidationError, assemble_stream

        try:
            stream = reader.finish()
        except StreamError as exc:
            raise _stream_failure(exc) from None
        self.check(job, stream.header)
        try:
            assemble_stream(stream, doc=job.doc.id)
        except (StreamError, TraceValidationError) as exc:
            # The digest held: the server sent exactly this, and would again.
            raise PermanentError(f"the stream does not assemble: {exc}") from None
        writer.commit()
        self.check.record(job, stream.header)


    # ----------------------------------------------------------------------- grouped requests

    def _take_ready(self) -> list[_Job]:
        """The next ready request and, when grouping, the ready requests of the same document
        whose bodies differ only in policy and seed (looked for near the queue's front)."""
        first = self.ready.popleft()
        if not self.cfg.group_candidates or first.solo:
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
        """Run ``jobs`` (one document's requests) as one grouped request where the server takes it."""
        size = await self._group_size(client, server.url) if len(jobs) > 1 else 0
        if size < 2:
            self._put_back(jobs[1:])
            await self._run_job(client, server, jobs[0])
            return
        self._put_back(jobs[size:])
        await self._run_group(client, server, jobs[:size])

    async def _run_group(self, client: Any, server: Server, jobs: list[_Job]) -> None:
        """One attempt of a document's requests as one multi-candidate request; each request then
        completes, retries or fails on its own, as if it had been sent alone."""
        self.progress.servers(self.pool)
        for job in jobs:
            job.attempts += 1
            job.tokens = 0
        outcome: dict[str, Any] = {}
        ends: dict[str, Exception | None] = {}
        try:
            ends = await self._attempt_group(client, server.url, jobs)
        except asyncio.CancelledError:
            outcome["counted"] = False
            raise
        except _GroupRefused as exc:   # e.g. a 422 naming one candidate: each policy alone names its own
            self._say(f"{jobs[0].doc.id}: grouped request refused ({exc}); sending its policies one by one")
            for job in jobs:
                job.attempts -= 1
                job.solo = True
            self._put_back(jobs)
        except (RetryableError, PermanentError) as exc:
            outcome["unreachable"] = getattr(exc, "unreachable", False)
            ends = {job.policy: exc for job in jobs}
        except Exception as exc:
            ends = {job.policy: PermanentError(f"unexpected {type(exc).__name__}: {exc}") for job in jobs}
        finally:
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

    def _settle(self, job: _Job, error: Exception | None) -> None:
        """What one request of a group comes to: complete, retried or failed."""
        if error is None:
            self.result.completed += 1
            self.progress.done()
            self._finish(job, None)
        elif isinstance(error, RetryableError):
            self._retry(job, error)
        elif isinstance(error, PermanentError) and error.fatal:
            self._abort(str(error))
        else:
            self._finish(job, str(error))

    async def _attempt_group(self, client: Any, server: str, jobs: list[_Job]) -> dict[str, Exception | None]:
        """One grouped try, within the requests' deadlines together: policy -> None (complete) or its error."""
        import httpx

        body = group_body([request_body(self.cfg, job.doc, job.policy) for job in jobs])
        limit = None if self.cfg.request_timeout_s is None else self.cfg.request_timeout_s * len(jobs)
        try:
            async with asyncio.timeout(limit):
                async with client.stream("POST", f"{server}/v1/traces", json=body,
                                         headers={"Accept": "application/x-ndjson"}) as response:
                    if response.status_code != 200:
                        self._refused(response.status_code, await response.aread(), response.headers)
                    return await self._receive_group(response, jobs)
        except TimeoutError:
            raise RetryableError(f"no complete answer within {limit:g} s (--request-timeout per policy) "
                                 f"from {server}") from None
        except httpx.HTTPError as exc:
            unreachable = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout))
            raise RetryableError(f"{type(exc).__name__} from {server}: {exc or 'connection lost'}",
                                 unreachable=unreachable, sent=not isinstance(exc, httpx.ConnectError)) from None
        except OSError as exc:
            raise RetryableError(f"{type(exc).__name__}: {exc}") from None

    def _refused(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        message = _error_message(status, body)
        if status in RETRY_STATUS:
            raise RetryableError(message, _retry_after(headers))
        if status in (401, 403):
            raise PermanentError(f"{message} (check --api-key)", fatal=True)
        raise _GroupRefused(message)

    async def _receive_group(self, response: Any, jobs: list[_Job]) -> dict[str, Exception | None]:
        """Split the response into the jobs' journal files; complete each one at its ``end``."""
        group = _Group(jobs, {job.policy: self.journal.open_request(job.doc.id, job.policy) for job in jobs})
        try:
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    self._take_grouped(group, raw + b"\n")
                if len(buffer) > STREAM_LIMITS.line_bytes:
                    raise RetryableError(f"a line longer than {STREAM_LIMITS.line_bytes} bytes")
            if buffer.strip():
                self._take_grouped(group, buffer)
        finally:
            for writer in group.writers.values():
                writer.abort()   # nothing for the committed ones
        for job in jobs:
            group.ends.setdefault(job.policy, RetryableError(f"the response ended before {job.policy}'s end record"))
        return group.ends

    def _take_grouped(self, group: _Group, raw: bytes) -> None:
        try:
            policy = group.splitter.route(raw)
        except StreamError as exc:   # a line for no candidate asked: nothing in this response is trusted
            raise RetryableError(str(exc)) from None
        if policy is None or policy in group.ends:
            return
        job, writer, reader = group.jobs[policy], group.writers[policy], group.readers[policy]
        try:
            self._take(writer, reader, raw, job)
            if reader.end is not None:
                self._complete(writer, reader, job)
                group.ends[policy] = None
        except (RetryableError, PermanentError) as exc:
            group.ends[policy] = exc


class _GroupRefused(Exception):
    """A grouped request refused as a whole (a 4xx): its policies are sent one by one."""


@dataclass
class _Group:
    """One grouped request's per-policy state: journal writers, stream readers and outcomes."""

    jobs_list: list[_Job]
    writers: dict[str, RequestWriter]
    jobs: dict[str, _Job] = field(default_factory=dict)
    readers: dict[str, StreamReader] = field(default_factory=dict)
    ends: dict[str, Exception | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.jobs = {job.policy: job for job in self.jobs_list}
        self.readers = {policy: StreamReader() for policy in self.jobs}
        self.splitter = CandidateSplitter(list(self.jobs))


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
    if cfg.servers_file is not None:  # a typo in the path is refused now, not after a wait for servers
        try:
            read_servers_file(cfg.servers_file)
        except OSError as exc:
            raise ConfigError(f"{cfg.servers_file}: cannot read the servers file ({exc.strerror or exc})") from None
    journal = Journal(cfg.out)
    docs = read_jsonl(cfg.docs_file)
    if not docs:
        raise DocumentsError(f"{cfg.docs_file}: no documents")
    digest = file_sha256(cfg.docs_file)
    journal.start(cfg.params(digest), {
        "servers": cfg.servers, "servers_file": str(cfg.servers_file) if cfg.servers_file else None,
        "concurrency": cfg.concurrency, "docs_file": str(cfg.docs_file),
        "documents": DOCUMENTS, "n_docs": len(docs),
    })
    copy = journal.dir / DOCUMENTS
    if not copy.exists() or file_sha256(copy) != digest:
        copy.write_bytes(Path(cfg.docs_file).read_bytes())  # pack reads the run dir alone
    if cfg.round_index:  # a later round: its allocation is recorded (or checked) before any request
        unknown = sorted(set(cfg.allocation or {}) - {doc.id for doc in docs})
        if unknown:
            raise ConfigError(f"round {cfg.round_index}'s allocation names documents not in "
                              f"{cfg.docs_file}: {', '.join(unknown[:5])}")
        journal = journal.for_round(cfg.round_index)
        journal.write_allocation(cfg.allocation or {})
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
    >>> result = collect(CollectConfig(servers=["http://127.0.0.1:8080"], docs_file="docs.jsonl",
    ...                                policies=["snapkv@0.5"], out="runs/x", seed=1))  # doctest: +SKIP
    >>> print(result.summary())                                                       # doctest: +SKIP
    """
    return asyncio.run(collect_async(cfg, stop_reason))
