"""The collector: drive trace servers over HTTP into a journal, then pack a dataset.

``collect`` sends one ``POST /v1/traces`` per (document, policy) to one or more
servers (httpx, async), ``concurrency`` requests in flight per server, pulling from
one shared queue so a faster server simply takes more work. Every stream is written
to the journal as it arrives and becomes complete only after its sha256 and its
structure (``protocols.assemble``) check out. Transient failures (429, 5xx, dropped
connections, truncated or altered streams, server error records) are retried with
exponential backoff and jitter, on whichever server is free; a request that still
fails after ``max_attempts`` is reported and left incomplete.

Determinism: each request's seed is derived from (seed, document, policy), never from
the order of completion, so a resumed run produces the same traces as an
uninterrupted one on the same server hardware. With ``common_random_numbers`` it is
derived from (seed, document): every policy of a document draws the same random
numbers, which correlates their traces and shrinks the variance of paired
differences (docs/design.md); each policy's estimates stay unbiased.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collector.documents import TEMPLATES, Document, file_sha256, read_jsonl, render_messages
from collector.journal import DOCUMENTS, Journal, JournalError

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
KINDS = ("coupled", "residual")


class RetryableError(RuntimeError):
    """A failure worth another attempt (overload, connection loss, bad stream)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentError(RuntimeError):
    """A failure that another attempt cannot fix (bad request, wrong model).

    ``fatal`` failures (authentication) would fail every request alike, so they stop
    the whole collection at once.
    """

    def __init__(self, message: str, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


@dataclass
class CollectConfig:
    """Everything ``collect`` needs; the fields in :meth:`params` are the resume contract."""

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
    progress: bool = True

    def __post_init__(self) -> None:
        self.servers = [s.rstrip("/") for s in self.servers]
        self.docs_file, self.out = Path(self.docs_file), Path(self.out)
        problems = []
        if not self.servers:
            problems.append("at least one --server is needed")
        if not self.policies:
            problems.append("at least one policy is needed")
        if len(set(self.policies)) != len(self.policies):
            problems.append(f"duplicate policies in {self.policies}")
        if self.kind not in KINDS:
            problems.append(f"--kind must be one of {KINDS}, not {self.kind!r}")
        if self.template not in TEMPLATES:
            problems.append(f"--template must be one of {sorted(TEMPLATES)}, not {self.template!r}")
        if self.replicates < 1 or self.max_new_tokens < 1 or self.concurrency < 1 or self.max_attempts < 1:
            problems.append("--replicates, --max-new-tokens, --concurrency and attempts must be >= 1")
        if self.window is not None and not 1 <= self.window <= self.max_new_tokens:
            problems.append(f"--window must be in 1..{self.max_new_tokens}, not {self.window}")
        if self.kind == "coupled" and self.window not in (None, self.max_new_tokens):
            problems.append("--window applies to residual traces (coupled traces run to the horizon)")
        if self.temperature < 0:
            problems.append("--temperature must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))

    def params(self, docs_sha256: str) -> dict[str, Any]:
        """The parameters that decide the traces' values (compared on resume)."""
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
    """What a collection did: counts, failures (request -> last error), throughput."""

    total: int
    skipped: int
    completed: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    retries: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        rate = self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        text = (f"{self.completed} requests collected, {self.skipped} already complete, "
                f"{len(self.failed)} failed, {self.retries} retries; {self.tokens} tokens in "
                f"{self.elapsed_s:.1f} s ({rate:.1f} tokens/s)")
        for key, reason in sorted(self.failed.items()):
            text += f"\n  FAILED {key}: {reason}"
        return text


@dataclass
class _Job:
    doc: Document
    policy: str
    attempts: int = 0

    @property
    def key(self) -> str:
        return f"{self.doc.id} × {self.policy}"


# --------------------------------------------------------------------------- requests


def derive_seed(seed: int, doc_id: str, policy: str | None) -> int:
    """A per-request seed from (seed, doc, policy): order-independent, so resume == rerun.

    ``policy=None`` derives it from (seed, doc) alone: common random numbers across policies.
    """
    key = f"kvdiv:{seed}\0{doc_id}" + ("" if policy is None else f"\0{policy}")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF  # 31 bits: safe for every RNG API


def request_body(cfg: CollectConfig, doc: Document, policy: str) -> dict[str, Any]:
    """The ``/v1/traces`` JSON for one (document, policy)."""
    parameters: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "do_sample": cfg.temperature > 0,
        "seed": derive_seed(cfg.seed, doc.id, None if cfg.common_random_numbers else policy),
    }
    if cfg.top_k is not None:
        parameters["top_k"] = cfg.top_k
    if cfg.top_p is not None:
        parameters["top_p"] = cfg.top_p
    return {
        "messages": render_messages(doc, cfg.template), "parameters": parameters,
        "candidate": policy, "reference": "full", "kind": cfg.kind,
        "replicates": cfg.replicates, "window": cfg.effective_window, "doc_id": doc.id,
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


class _Checker:
    """Checks a finished stream's header against the request and the run's model."""

    def __init__(self, cfg: CollectConfig, journal: Journal) -> None:
        from protocols import assemble  # the full structural check before a request counts as complete

        self.cfg, self.journal = cfg, journal
        self.assemble = assemble
        manifest = journal.read_manifest() or {}
        self.model: str | None = manifest.get("model")

    def __call__(self, job: _Job, header: Mapping[str, Any], lines: Sequence[bytes]) -> None:
        cfg = self.cfg
        expect = {"kind": cfg.kind, "horizon": cfg.max_new_tokens, "replicates": cfg.replicates}
        if cfg.kind == "residual":
            expect["window"] = cfg.effective_window
        wrong = {k: header.get(k) for k, v in expect.items() if header.get(k) != v}
        if wrong:
            raise PermanentError(f"server answered {wrong}, asked for {expect}")
        model = str(header.get("model"))
        if self.model is None:
            self._record_model(model)
        elif model != self.model:
            raise PermanentError(f"server runs model {model!r}, this collection uses {self.model!r}")
        try:
            self.assemble(list(lines), doc=job.doc.id)
        except Exception as exc:  # any assembly failure means the stream is unusable
            raise RetryableError(f"stream does not assemble: {exc}") from None

    def _record_model(self, model: str) -> None:
        # The first header fixes the run's model; later servers must serve the same one.
        self.model = model
        manifest = self.journal.read_manifest() or {}
        manifest["model"] = model
        self.journal.write_manifest(manifest)


class _Progress:
    """tqdm on stderr: requests done, tokens/s, retries, ETA."""

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="req", desc="collect", file=sys.stderr,
                        disable=not enabled, dynamic_ncols=True, smoothing=0.1)
        self.start = time.monotonic()
        self.tokens = 0
        self.retries = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n
        self._postfix()

    def done(self) -> None:
        self.bar.update(1)
        self._postfix()

    def retry(self) -> None:
        self.retries += 1
        self._postfix()

    def _postfix(self) -> None:
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, {self.retries} retries", refresh=False)

    def close(self) -> None:
        self.bar.close()


# --------------------------------------------------------------------------- the loop


class Collector:
    """One collection run: the queue, the workers and the journal."""

    def __init__(self, cfg: CollectConfig, docs: Sequence[Document], journal: Journal,
                 stop_reason: Callable[[], str | None] | None = None) -> None:
        self.cfg, self.docs, self.journal = cfg, list(docs), journal
        # Asked after each failed attempt: a reason to give up on everything now (e.g. the
        # demo's server process has exited) instead of retrying into a dead socket.
        self.stop_reason = stop_reason
        self.check = _Checker(cfg, journal)
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.pending = 0
        self.finished = asyncio.Event()
        self.timers: set[asyncio.Task[None]] = set()
        todo = [_Job(d, p) for d in self.docs for p in cfg.policies if not journal.is_complete(d.id, p)]
        self.result = CollectResult(total=len(self.docs) * len(cfg.policies),
                                    skipped=len(self.docs) * len(cfg.policies) - len(todo))
        for job in todo:
            self.queue.put_nowait(job)
        self.pending = len(todo)
        self.unfinished = {job.key: job for job in todo}

    async def run(self) -> CollectResult:
        import httpx

        start = time.monotonic()
        self.progress = _Progress(self.result.total, self.result.skipped, self.cfg.progress)
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        timeout = httpx.Timeout(30.0, read=self.cfg.read_timeout_s)
        limits = httpx.Limits(max_connections=self.cfg.concurrency * len(self.cfg.servers) + 2)
        try:
            async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
                workers = [asyncio.create_task(self._worker(client, server))
                           for server in self.cfg.servers for _ in range(self.cfg.concurrency)]
                try:
                    if self.pending:
                        await self.finished.wait()
                finally:
                    for task in [*workers, *self.timers]:
                        task.cancel()
                    await asyncio.gather(*workers, *self.timers, return_exceptions=True)
        finally:
            self.progress.close()
            self.result.tokens = self.progress.tokens
            self.result.retries = self.progress.retries
            self.result.elapsed_s = time.monotonic() - start
        return self.result

    async def _worker(self, client: Any, server: str) -> None:
        while True:
            job = await self.queue.get()
            job.attempts += 1
            try:
                await self._attempt(client, server, job)
            except RetryableError as exc:
                reason = self.stop_reason() if self.stop_reason else None
                if reason:
                    self._abort(reason)
                elif job.attempts >= self.cfg.max_attempts:
                    self._finish(job, f"{exc} (after {job.attempts} attempts)")
                else:
                    self.progress.retry()
                    self._requeue_later(job, self._backoff(job.attempts, exc.retry_after))
            except PermanentError as exc:
                if exc.fatal:
                    self._abort(str(exc))
                else:
                    self._finish(job, str(exc))
            else:
                self.result.completed += 1
                self.progress.done()
                self._finish(job, None)

    def _abort(self, reason: str) -> None:
        """Give up on every unfinished request (left incomplete; a rerun resumes them)."""
        for key in self.unfinished:
            self.result.failed[key] = reason
        self.unfinished.clear()
        self.pending = 0
        self.progress.bar.write(f"collection stopped: {reason}", file=sys.stderr)
        self.finished.set()

    def _finish(self, job: _Job, failure: str | None) -> None:
        if self.unfinished.pop(job.key, None) is None:
            return  # already accounted for by _abort
        if failure is not None:
            self.result.failed[job.key] = failure
            self.progress.bar.write(f"request {job.key} failed: {failure}", file=sys.stderr)
        self.pending -= 1
        if self.pending == 0:
            self.finished.set()

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        # Full jitter: spreads retries of requests that failed together (one 429 burst).
        cap = min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (attempt - 1))
        delay = random.uniform(0.5 * cap, cap)
        return max(delay, retry_after or 0.0)

    def _requeue_later(self, job: _Job, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            self.queue.put_nowait(job)

        task = asyncio.create_task(later())
        self.timers.add(task)
        task.add_done_callback(self.timers.discard)

    async def _attempt(self, client: Any, server: str, job: _Job) -> None:
        """One try: stream into the journal; raise Retryable/Permanent errors on failure."""
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
        except httpx.TransportError as exc:  # refused, reset, dropped mid-stream, timed out
            raise RetryableError(f"{type(exc).__name__}: {exc or 'connection lost'}") from None

    async def _receive(self, response: Any, job: _Job) -> None:
        writer = self.journal.open_request(job.doc.id, job.policy)
        lines: list[bytes] = []
        try:
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    if raw.strip():
                        self._take(writer, lines, raw + b"\n")
            if buffer.strip():
                self._take(writer, lines, buffer)  # a final line without newline: kept, so truncation is seen
            try:
                writer.commit(lambda header: self.check(job, header, lines))
            except JournalError as exc:  # truncated, altered or failed on the server
                if b'"error_type":"validation"' in (lines[-1] if lines else b""):
                    raise PermanentError(str(exc)) from None  # the request itself is bad
                raise RetryableError(str(exc)) from None
        finally:
            writer.abort()

    def _take(self, writer: Any, lines: list[bytes], raw: bytes) -> None:
        writer.write(raw)
        lines.append(raw)
        try:
            record = json.loads(raw)
        except json.JSONDecodeError:
            return  # verify() reports it with the rest of the stream
        if isinstance(record, dict) and record.get("type") in ("step", "shared_step", "branch"):
            self.progress.add_tokens(_tokens_in(record))


# --------------------------------------------------------------------------- entry points


def prepare_run(cfg: CollectConfig) -> tuple[Journal, list[Document]]:
    """Create or check the run directory: copy the documents and write/compare the manifest."""
    journal = Journal(cfg.out)
    docs = read_jsonl(cfg.docs_file)
    if not docs:
        raise ValueError(f"{cfg.docs_file}: no documents")
    digest = file_sha256(cfg.docs_file)
    journal.start(cfg.params(digest), {
        "servers": cfg.servers, "concurrency": cfg.concurrency, "docs_file": str(cfg.docs_file),
        "documents": DOCUMENTS, "n_docs": len(docs),
    })
    copy = journal.dir / DOCUMENTS
    if not copy.exists() or file_sha256(copy) != digest:
        copy.write_bytes(Path(cfg.docs_file).read_bytes())  # pack reads the run dir alone
    return journal, docs


async def collect_async(cfg: CollectConfig, stop_reason: Callable[[], str | None] | None = None) -> CollectResult:
    journal, docs = prepare_run(cfg)
    return await Collector(cfg, docs, journal, stop_reason).run()


def collect(cfg: CollectConfig, stop_reason: Callable[[], str | None] | None = None) -> CollectResult:
    """Run a collection to completion (or until every remaining request has failed).

    ``stop_reason()`` is consulted after each failed attempt; a non-empty answer
    stops the whole collection at once (the requests stay incomplete for a rerun).
    """
    return asyncio.run(collect_async(cfg, stop_reason))
