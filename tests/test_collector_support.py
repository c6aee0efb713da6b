"""A fake trace server for the collector tests (imported by test_collector*.py, test_demo*.py).

It speaks ``POST /v1/traces`` with valid ``kvdiv.trace/1`` wire streams built with
``protocols.wire``. The stream's numbers depend only on the request (seed, doc,
policy, sizes), never on the attempt, so a retried or resumed request yields the
same bytes (apart from the ``elapsed_s`` of the end record). A fault script makes
the next requests answer 429 / 500, drop the connection mid-stream, end without an
``end`` record, send a wrong digest, or send an ``error`` record.

The hostile faults (:data:`HOSTILE`) act like a rewriting proxy or a broken server
whose stream still carries a fresh, valid digest: the request rewritten before the
server sees it (policy, temperature, seed, prompt, document id), header fields
altered, bytes dripped slower than any deadline, a ``Content-Encoding: gzip`` body
that is not gzip, a 5,000-digit integer, a 100k-deep nesting, an int32-overflowing
budget, bytes that are not UTF-8. ``fault_every=n`` injects the next fault of
``fault_cycle`` into every n-th request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from collector import documents as D
from collector.collect import CollectConfig
from protocols import (
    StreamWriter,
    branch_record,
    encode_line,
    end_record,
    error_record,
    header_record,
    prompt_digest,
    reference_step_record,
    shared_step_record,
    step_record,
)

VOCAB = 50
FAULTS = ("ok", "429", "500", "drop", "truncate", "bad_digest", "error")
#: fault -> how the request is rewritten before the stream is generated (a proxy in the middle).
REWRITES = {
    "rewrite_policy": lambda b: {**b, "candidate": "recent@0.9"},
    "rewrite_temperature": lambda b: {**b, "parameters": {**b["parameters"], "temperature": 2.0}},
    "rewrite_seed": lambda b: {**b, "parameters": {**b["parameters"], "seed": 12345}},
    "rewrite_prompt": lambda b: {**b, "messages": [{"role": "user", "content": "Something else entirely."}]},
    "rewrite_doc": lambda b: {**b, "doc_id": "doc-other"},
    "rewrite_kind_sizes": lambda b: {**b, "replicates": int(b["replicates"]) + 1},
}
#: fault -> an edit of the header record (the stream's digest is computed after it).
HEADER_EDITS = {
    "header_reference": lambda h: {**h, "reference": {"policy": "recent@0.9"}},
    "header_model": lambda h: {**h, "model": "another-model"},
    "header_prompt_tokens": lambda h: {**h, "prompt_tokens": h["prompt_tokens"] + 1},
    "budget_overflow": lambda h: {**h, "candidate": {**h["candidate"], "budget": 2**40}},
    "header_no_prompt_sha256": lambda h: {k: v for k, v in h.items() if k != "prompt_sha256"},
}
#: faults that damage the bytes themselves (a fresh digest where the stream still ends).
BYTE_FAULTS = ("drip", "gzip_garbage", "huge_int", "deep_nesting", "not_utf8", "long_line")
HOSTILE = (*REWRITES, *HEADER_EDITS, *BYTE_FAULTS)


def _rng(body: dict[str, Any]) -> np.random.Generator:
    key = json.dumps([body.get("doc_id"), body.get("candidate"), body["parameters"].get("seed")])
    return np.random.default_rng(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))


def trace_records(body: dict[str, Any], model: str = "fake-model") -> Iterator[dict[str, Any]]:
    """Header and data records of a valid stream for a /v1/traces request body."""
    params = body["parameters"]
    horizon, reps, kind = int(params["max_new_tokens"]), int(body.get("replicates", 1)), body.get("kind", "coupled")
    window = 0 if kind == "reference" else int(body.get("window") or horizon)
    rng = _rng(body)
    text = "".join(m["content"] for m in body.get("messages", [])) or body.get("inputs", "")
    prompt_ids = list(text.encode())[::4]  # a stand-in tokenizer: deterministic in the prompt
    prompt = len(prompt_ids)
    yield header_record(
        kind=kind, horizon=horizon, window=window, model=model, eos_token_id=None,
        sampling={"temperature": params.get("temperature", 1.0), "top_k": 0, "top_p": 1.0},
        candidate={"policy": body["candidate"], "press": "fake", "retention": 0.5, "budget": -1},
        seed=params.get("seed"), prompt_tokens=prompt, retained_tokens=prompt // 2, replicates=reps,
        vocab_size=VOCAB, doc=body.get("doc_id"), request_id="fake", prompt_sha256=prompt_digest(prompt_ids),
    )
    if kind == "coupled":
        for t in range(1, horizon + 1):
            tv = rng.uniform(0.05, 0.5, reps)
            x = rng.integers(0, VOCAB, reps)
            y = np.where(rng.random(reps) < 0.5, x, (x + 1) % VOCAB)
            yield step_record(t, tv, x, y)
        return
    if kind == "reference":
        for t in range(1, horizon + 1):
            logp = rng.uniform(-4.0, -0.1, reps)
            yield reference_step_record(t, rng.uniform(0.05, 0.5, reps), rng.integers(0, VOCAB, reps), logp,
                                        np.minimum(logp + rng.normal(0.0, 0.5, reps), 0.0))
        return
    shared_tv = rng.uniform(0.01, 0.2, (reps, horizon))
    shared_tok = rng.integers(0, VOCAB, (reps, horizon))
    for t in range(horizon):
        yield shared_step_record(t + 1, shared_tv[:, t], shared_tok[:, t])
    for r in range(reps):
        t_star = int(rng.integers(1, horizon + 1))
        k = min(window, horizon - t_star)
        x = rng.integers(0, VOCAB, k + 1)
        y = (x + 1 + rng.integers(0, VOCAB - 1, k + 1)) % VOCAB  # y != x: consistent with tv > 0
        tv = rng.uniform(0.05, 0.6, k + 1)
        tv[0] = shared_tv[r, t_star - 1]
        yield branch_record(r, t_star, tv, x, y)


class FakeServer:
    """A uvicorn server in a thread on 127.0.0.1, with a fault script and request log."""

    def __init__(self, *, delay_s: float = 0.0, model: str = "fake-model", fault_every: int = 0,
                 fault_cycle: tuple[str, ...] = ()) -> None:
        self.faults: list[str] = []      # consumed one per /v1/traces request
        self.fault_every, self.fault_cycle = fault_every, list(fault_cycle)
        self.served = 0
        self.faults_for: dict[tuple[str, str], list[str]] = {}  # (doc_id, candidate) -> its own script
        self.requests: list[dict[str, Any]] = []
        self.delay_s = delay_s
        self.model = model
        self.lock = threading.Lock()
        app = Starlette(routes=[Route("/health", self._health), Route("/v1/traces", self._traces, methods=["POST"]),
                                Route("/tokenize", self._tokenize, methods=["POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def _next_fault(self, body: dict[str, Any]) -> str:
        with self.lock:
            own = self.faults_for.get((body.get("doc_id"), body.get("candidate")))
            if own:
                return own.pop(0)
            self.served += 1
            if self.fault_every and self.fault_cycle and self.served % self.fault_every == 0:
                fault = self.fault_cycle.pop(0)
                self.fault_cycle.append(fault)
                return fault
            return self.faults.pop(0) if self.faults else "ok"

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _tokenize(self, request: Request) -> Response:
        # TGI's shape: a BOS with an empty span, then one token per whitespace-separated word.
        text = (await request.json())["inputs"]
        words = [{"id": i + 1, "text": m.group(), "start": m.start(), "stop": m.end()}
                 for i, m in enumerate(re.finditer(r"\S+", text))]
        return JSONResponse([{"id": 0, "text": "<s>", "start": 0, "stop": 0}, *words])

    async def _traces(self, request: Request) -> Response:
        body = await request.json()
        fault = self._next_fault(body)
        with self.lock:
            self.requests.append({**body, "fault": fault})
        if fault == "429":
            return JSONResponse({"error": "queue full", "error_type": "overloaded"}, status_code=429,
                                headers={"Retry-After": "0"})
        if fault == "500":
            return JSONResponse({"error": "boom", "error_type": "internal"}, status_code=500)
        if fault == "401":
            return JSONResponse({"error": "Unauthorized", "error_type": "authentication"}, status_code=401)
        if fault == "422":
            return JSONResponse({"error": "candidate: unknown policy", "error_type": "validation"},
                                status_code=422)
        if fault == "422_permanent":   # a press the server refuses on its model by design
            return JSONResponse({"error": f"candidate: policy {body.get('candidate')!r}: ThinKPress cannot run on "
                                          "Phi3ForCausalLM: partial rotary", "error_type": "validation",
                                 "permanent": True}, status_code=422)
        if fault == "gzip_garbage":
            return StreamingResponse(self._stream(body, "ok"), media_type="application/x-ndjson",
                                     headers={"Content-Encoding": "gzip"})
        if fault == "drip":
            return StreamingResponse(self._drip(body), media_type="application/x-ndjson")
        return StreamingResponse(self._stream(REWRITES.get(fault, lambda b: b)(body), fault),
                                 media_type="application/x-ndjson")

    async def _drip(self, body: dict[str, Any]):
        # One byte every 50 ms: each read arrives well within any read timeout, the whole never.
        async for line in self._stream(body, "ok"):
            for i in range(len(line)):
                yield line[i:i + 1]
                await asyncio.sleep(0.05)

    def _records(self, body: dict[str, Any], fault: str) -> list[dict[str, Any]]:
        records = list(trace_records(body, self.model))
        records[0] = HEADER_EDITS.get(fault, lambda h: h)(records[0])
        return records

    async def _stream(self, body: dict[str, Any], fault: str):
        digest = hashlib.sha256()  # a fresh, valid digest over whatever is sent

        def line(data: bytes) -> bytes:
            digest.update(data)
            return data

        records = self._records(body, fault)
        for i, record in enumerate(records):
            if i == len(records) // 2 and fault in ("drop", "truncate", "error", "error_validation"):
                if fault == "drop":
                    raise ConnectionResetError("simulated connection drop")
                if fault == "error":
                    yield encode_line(error_record("out of memory", "internal"))
                if fault == "error_validation":  # the server refuses the request mid-stream, with spaces
                    yield json.dumps({"type": "error", "error": "window: too large",
                                      "error_type": "validation"}).encode() + b"\n"
                return
            if i == 2 and fault in BAD_LINES:
                yield line(BAD_LINES[fault])
            yield line(encode_line(record))
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
        if fault == "bad_digest":
            yield encode_line({"type": "end", "steps": 0, "replicates": 0, "elapsed_s": 0.0, "sha256": "0" * 64})
            return
        steps, reps = int(body["parameters"]["max_new_tokens"]), int(body.get("replicates", 1))
        yield encode_line(end_record(steps, reps, 0.0, digest.hexdigest()))


#: Lines inserted after the first data record, under a fresh digest.
BAD_LINES = {
    "huge_int": b'{"type":"step","step":' + b"9" * 5000 + b',"tv":[]}\n',
    "deep_nesting": b'{"type":"step","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    "not_utf8": b'{"type":"step","tv":"\xff\xfe"}\n',
    "long_line": b'{"type":"step","pad":"' + b"x" * (17 << 20) + b'"}\n',
}


#: The policies of the collector tests' runs.
POLICIES = ["snapkv@0.5", "recent@0.5"]


def write_docs(path: Path, count: int = 3) -> Path:
    """A small document set of ``count`` two-paragraph documents (``doc0``, ``doc1``, ...)."""
    docs = [D.Document(f"doc{i}", f"Paragraph {i} of the test set.\n\nSecond paragraph {i}.") for i in range(count)]
    return D.write_jsonl(docs, path)


def small_config(servers: list[str], docs_file: Path, out: Path, **kw: Any) -> CollectConfig:
    """A fast residual run (R = 2, T = 6, W = 4) with quick retries; ``kw`` overrides."""
    base = dict(servers=servers, docs_file=docs_file, policies=POLICIES, out=out, kind="residual",
                replicates=2, max_new_tokens=6, window=4, seed=7, progress=False, backoff_s=0.01,
                backoff_max_s=0.05, max_attempts=4)
    base.update(kw)
    return CollectConfig.flat(**base)


def test_fake_streams_are_deterministic_and_valid() -> None:
    body = {"parameters": {"max_new_tokens": 6, "seed": 3}, "candidate": "snapkv@0.5", "kind": "residual",
            "replicates": 3, "window": 4, "doc_id": "d", "messages": [{"role": "user", "content": "x" * 80}]}
    a, b = list(trace_records(body)), list(trace_records(body))
    assert a == b
    from protocols.assemble import assemble

    for kind in ("residual", "coupled"):
        w = StreamWriter()
        lines = [w.line(r) for r in trace_records({**body, "kind": kind})] + [w.end(6, 3, 0.0)]
        ds = assemble(lines, doc="d")
        assert ds.sizes["replicate"] == 3 and ds.attrs["kind"] == kind
