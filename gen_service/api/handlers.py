"""Route handlers: module-level functions over the app state (``request.app.state.service``).

Every handler follows the same path: read the body within its limits, parse it into
a typed request (:mod:`gen_service.api.records`), take an admission slot, tokenise off
the event loop, check the context and build the policies for this prompt, start the
work, and wait for its first item. Only then is a status sent, so every failure up
to the first token (or the trace header) is an error status rather than a 200
followed by an error. Bodies and events are shaped by :mod:`gen_service.api.tgi_wire`
and :mod:`gen_service.api.openai_wire`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from gen_service.api import openai_wire as oai
from gen_service.api import tgi_wire as tgi
from gen_service.api.body import parse_json, read_body
from gen_service.api.records import (
    ChatRequest,
    Decoding,
    parse_chat,
    parse_chat_messages,
    parse_completion,
    parse_detokenize,
    parse_generate,
    parse_tokenize,
    parse_trace,
)
from gen_service.engine.jobs import CandidateDone, CandidateFailed, TraceJob
from gen_service.errors import ApiError, Cancelled, CandidateError, NonFiniteLogits, RequestTimeout, invalid
from gen_service.presses.table import catalog
from gen_service.serving.service import Service, Ticket, WorkStream, failure_error
from protocols import StreamWriter, error_record
from protocols import __version__ as VERSION

__all__ = ["ROUTES", "Handler", "SSE", "NDJSON"]

log = logging.getLogger("kvdiv.service")

NDJSON, SSE = "application/x-ndjson", "text/event-stream"
Handler = Callable[[Request], Awaitable[Response]]


def state(request: Request) -> Service:
    return request.app.state.service


async def read_json(request: Request) -> tuple[Service, dict[str, Any]]:
    svc = state(request)
    return svc, parse_json(await read_body(request, svc.body_limits), svc.body_limits)


# ---------------------------------------------------------------------- plain generation


@dataclass(frozen=True)
class Started:
    """A generation whose first token is already in hand."""

    work: WorkStream
    ids: list[int]
    seed: int
    max_new_tokens: int


def _stop_check(svc: Service, stop: tuple[str, ...]) -> Callable[[list[int]], bool] | None:
    if not stop:
        return None
    return lambda out: any(svc.decode(out, skip_special_tokens=False).endswith(s) for s in stop)


async def start_generation(svc: Service, ticket: Ticket, ids: list[int], dec: Decoding, field: str,
                           eviction_field: str, prompt_logprobs: bool = False) -> Started:
    """Check the context, the policy and the memory (``prompt_logprobs``: the prompt's
    log-probabilities will be computed afterwards), start decoding, and wait for the first token."""
    room = svc.engine.lm.max_context - len(ids)
    n = dec.max_new_tokens or max(1, min(svc.limits.max_new_tokens, room))
    svc.check_context(ids, n, field)
    # off the loop: the first press of a kind imports kvpress and builds the press
    await svc.off_loop(svc.check_policy, eviction_field, dec.eviction, len(ids))
    await svc.off_loop(svc.check_generate_memory, len(ids), n, dec.eviction, prompt_logprobs,
                       "parameters.decoder_input_details" if prompt_logprobs else field)
    seed = dec.seed if dec.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    stop = _stop_check(svc, dec.stop)
    work = svc.start(lambda cancelled: svc.engine.generate(ids, dec.eviction, n, dec.sampling, seed,
                                                           top_n=dec.top_n_tokens, stop_check=stop,
                                                           cancelled=cancelled), ticket)
    try:
        await work.first()
    except Cancelled:
        raise ApiError(499, "client disconnected", "cancelled") from None
    except BaseException as exc:
        log.exception("generation failed before its first token")
        raise failure_error(exc, eviction_field, (dec.eviction,)) from None
    return Started(work, ids, seed, n)


async def collect(request: Request, started: Started) -> tuple[list[dict[str, Any]], str]:
    """All tokens of a non-streamed generation and its finish reason."""
    watcher = asyncio.create_task(_watch_disconnect(request, started.work.cancel))
    tokens, finish = [], "length"
    try:
        async for item in started.work:
            if "finish_reason" in item:
                finish = item["finish_reason"]
            else:
                tokens.append(item)
    except Cancelled:
        raise ApiError(499, "client disconnected", "cancelled") from None
    except Exception as exc:  # after the first token: TGI's 424, without internals
        err = stream_error(exc)
        raise ApiError(424, err["error"], err["error_type"]) from None
    finally:
        watcher.cancel()
    state(request).metrics.tokens.inc(len(tokens))
    return tokens, finish


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client of a non-streaming request goes away."""
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(0.1)


def stream_error(exc: BaseException) -> dict[str, str]:
    """The error record ending a stream that already sent its 200 (no internals)."""
    if isinstance(exc, RequestTimeout):
        return {"error": str(exc), "error_type": "timeout"}
    if isinstance(exc, NonFiniteLogits):   # the model's numbers, not the server's internals: say where
        log.error("%s", exc)
        return {"error": str(exc), "error_type": "non_finite_logits"}
    if isinstance(exc, ApiError):
        return exc.body()
    log.error("stream failed after its first item", exc_info=exc)
    return {"error": f"generation failed ({type(exc).__name__}); see the server log", "error_type": "generation"}


# ---------------------------------------------------------------------- TGI routes


async def _tgi_started(request: Request, *, stream: bool | None) -> tuple[Service, Any, Started]:
    svc, data = await read_json(request)
    req = parse_generate(data, svc.limits, stream=bool(stream))
    async with svc.admitted() as ticket:
        ids = await svc.off_loop(svc.encode, req.inputs)
        if req.truncate:
            ids = ids[-req.truncate:]
        started = await start_generation(svc, ticket, ids, req.decoding, "inputs", "parameters.eviction",
                                         prompt_logprobs=req.details and req.decoder_input_details)
    return svc, req, started


async def _tgi_body(request: Request, svc: Service, req: Any, started: Started) -> dict[str, Any]:
    tokens, finish = await collect(request, started)
    text = svc.decode([t["id"] for t in tokens])
    out: dict[str, Any] = {"generated_text": (req.inputs + text) if req.return_full_text else text}
    if req.details:
        prefill = []
        if req.decoder_input_details:
            lps = await svc.on_model_thread(svc.engine.prompt_logprobs, started.ids)
            prefill = tgi.prefill_tokens(started.ids, lps, svc.token_text)
        out["details"] = tgi.details(tokens, finish, started.seed, prefill, req.decoding.top_n_tokens,
                                     svc.token_text, svc.special_ids)
    return out


def _tgi_stream(svc: Service, req: Any, started: Started) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        ids: list[int] = []
        pending: dict | None = None
        try:
            async for item in started.work:
                if "finish_reason" in item:
                    text = svc.decode(ids)
                    details = tgi.stream_details(item["finish_reason"], len(ids), started.seed, len(started.ids))
                    if pending:
                        yield tgi.sse({**pending, "generated_text": (req.inputs + text) if req.return_full_text
                                       else text, "details": details})
                    return
                if pending:
                    yield tgi.sse(pending)
                ids.append(item["id"])
                svc.metrics.tokens.inc()
                pending = tgi.stream_event(len(ids), item, req.decoding.top_n_tokens, svc.token_text,
                                           svc.special_ids)
        except Cancelled:
            pass
        except Exception as exc:  # mid-stream failure: TGI sends an error event
            yield tgi.sse(stream_error(exc))
        finally:
            started.work.cancel.set()

    return StreamingResponse(events(), media_type=SSE)


async def generate(request: Request) -> Response:
    """``POST /generate``: TGI's ``GenerateResponse``."""
    svc, req, started = await _tgi_started(request, stream=False)
    return JSONResponse(await _tgi_body(request, svc, req, started))


async def generate_stream(request: Request) -> Response:
    """``POST /generate_stream``: TGI's ``StreamResponse`` events."""
    svc, req, started = await _tgi_started(request, stream=True)
    return _tgi_stream(svc, req, started)


async def compat(request: Request) -> Response:
    """``POST /``: ``stream`` picks SSE; otherwise a list of one response, as TGI answers."""
    svc, req, started = await _tgi_started(request, stream=None)
    if req.stream:
        return _tgi_stream(svc, req, started)
    return JSONResponse([await _tgi_body(request, svc, req, started)])


async def tokenize(request: Request) -> Response:
    """``POST /tokenize``: ``[{id, text, start, stop}]``, built off the event loop."""
    svc, data = await read_json(request)
    req = parse_tokenize(data, svc.limits)

    def work() -> list[bytes]:
        ids, offsets = svc.encode_offsets(req.inputs, req.add_special_tokens)
        return tgi.tokenize_chunks(req.inputs, ids, offsets, svc.token_text)

    async with svc.admitted():
        pieces = await svc.off_loop(work)

    async def send() -> AsyncIterator[bytes]:  # piece by piece: a 50 MB answer never blocks the loop
        for piece in pieces:
            yield piece

    return StreamingResponse(send(), media_type="application/json")


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: ``{"texts": [...], "ends": [[...], ...]}``, decoded off the event loop.

    ``texts[i]`` is ``ids[i]`` decoded with the model's tokenizer; ``ends[i][k]`` is the
    length of the text of ``ids[i][:k + 1]`` (capped at ``len(texts[i])``), so a character
    offset into the text maps back to the token that produced it (the collector places
    an answer among a trace's tokens with it).
    """
    svc, data = await read_json(request)
    req = parse_detokenize(data, svc.engine.lm.vocab_size)

    def work() -> bytes:
        texts, ends = [], []
        for row in req.ids:
            ids = list(row)
            text = svc.decode(ids, skip_special_tokens=req.skip_special_tokens)
            texts.append(text)
            # a prefix's text, token by token (T is small: an answer of tens of tokens)
            ends.append([min(len(svc.decode(ids[:k + 1], skip_special_tokens=req.skip_special_tokens)), len(text))
                         for k in range(len(ids))])
        return json.dumps({"texts": texts, "ends": ends}).encode()

    async with svc.admitted():
        body = await svc.off_loop(work)
    return Response(body, media_type="application/json")


async def chat_tokenize(request: Request) -> Response:
    """``POST /chat_tokenize``: the templated text and its tokens."""
    svc, data = await read_json(request)
    messages = parse_chat_messages(data, svc.limits)

    def work() -> bytes:
        text = svc.chat_text(messages)
        ids, offsets = svc.encode_offsets(text, add_special_tokens=False)
        tokens = b"".join(tgi.tokenize_chunks(text, ids, offsets, svc.token_text))
        return b'{"templated_text":' + json.dumps(text).encode() + b',"tokenize_response":' + tokens + b"}"

    async with svc.admitted():
        body = await svc.off_loop(work)
    return Response(body, media_type="application/json")


async def info(request: Request) -> Response:
    """``GET /info``: TGI's ``Info`` plus a ``kvdiv`` object (limits, policies)."""
    svc = state(request)
    lm, cfg = svc.engine.lm, svc.config
    return JSONResponse({
        "model_id": lm.name, "model_sha": None, "model_dtype": str(lm.dtype).replace("torch.", ""),
        "model_device_type": lm.device.type, "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": cfg.max_queue, "max_best_of": 1, "max_stop_sequences": svc.limits.max_stop,
        "max_input_tokens": lm.max_context - 1, "max_total_tokens": lm.max_context,
        "max_input_length": lm.max_context - 1,
        "waiting_served_ratio": 0.0, "max_batch_total_tokens": lm.max_context * cfg.max_replicates,
        "max_waiting_tokens": 0, "max_batch_size": cfg.max_replicates, "validation_workers": 2,
        "max_client_batch_size": 1, "router": "kvdiv-gen-service", "version": VERSION, "sha": None,
        "docker_label": None,
        "kvdiv": {"eviction": cfg.eviction, "max_new_tokens": cfg.max_new_tokens,
                  "max_replicates": cfg.max_replicates, "max_input_bytes": cfg.max_input_bytes,
                  "max_request_seconds": cfg.max_request_seconds, "vocab_size": lm.vocab_size,
                  # every EOS id ends a generation; eos_token_id (the first) for older clients
                  "eos_token_id": lm.eos_token_id, "eos_token_ids": list(lm.eos_token_ids),
                  "policies": svc.engine.registry.names(),
                  # /v1/traces takes `candidates` (several policies, one request; docs/service.md)
                  "trace_candidates": cfg.max_candidates > 1, "max_candidates": cfg.max_candidates,
                  "batch_candidates": svc.engine.batch_candidates,
                  "batch_invariant": svc.engine.batch_invariant, "padded_linears": svc.engine.padded_linears,
                  # P's and Q's forwards as one: the setting and each shape's timings
                  "fused_forward": svc.engine.fusion_info(),
                  # which path each attention feature of the model takes (gen_service.attention.plan)
                  "attention": svc.engine.attention.info(),
                  # stacked decoding forwards replayed as CUDA graphs (null: off)
                  "cuda_graphs": None if svc.engine.cuda_graphs is None else svc.engine.cuda_graphs.info(),
                  # concurrent /v1/traces requests decoded in one batch, and why that many (docs/service.md)
                  **svc.batching.info(),
                  # the start-up self-check: P against the model's own forward, the tokenizer (docs/service.md)
                  "self_check": {"skipped": True} if svc.self_check is None else svc.self_check.info(),
                  **svc.memory.info()},
    })


async def health(request: Request) -> Response:
    """``GET /health`` (no authentication)."""
    svc = state(request)
    return JSONResponse({"status": "ok", "model": svc.engine.lm.name, "queue": svc.admission.count})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: Prometheus text."""
    return Response(generate_latest(state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def policies(request: Request) -> Response:
    """``GET /v1/policies``: names, examples, the grammar and every kvpress press (what it
    takes, whether it runs coupled and residual, and why not when it does not)."""
    svc = state(request)
    reg = svc.engine.registry
    return JSONResponse({"default": svc.config.eviction, "names": reg.names(), "examples": reg.examples(),
                         "grammar": "full | name@retention | name#budget | Wrapper(Inner, ...)@r | id:k=v,... "
                                    "| id+quant:kivi@bits:k=v,... | quant:kivi@bits:k=v,...",
                         "presses": catalog()})


# ---------------------------------------------------------------------- traces


async def traces(request: Request) -> Response:
    """``POST /v1/traces``: the kvdiv.trace/1 stream (NDJSON, or SSE on request).

    With ``candidates`` the response multiplexes one stream per candidate, each record
    tagged with its ``candidate`` (docs/contract.md §3, "Several candidates")."""
    svc, data = await read_json(request)
    req = parse_trace(data, svc.limits)
    async with svc.admitted() as ticket:
        question: list[int] = []  # prefilled after compression, never compressed
        if req.context is not None:
            ids, question = await svc.off_loop(svc.encode_context, req.context, req.question)
        elif req.messages is not None:
            ids = await svc.off_loop(svc.encode_chat, req.messages)
        else:
            ids = await svc.off_loop(svc.encode, req.inputs, req.add_special_tokens)
        svc.check_context(ids + question, req.horizon, req.prompt_field)
        # the press compresses the context only: policies are fitted to its length
        fields = [f"candidates[{i}]" for i in range(len(req.candidates))] if req.candidates else ["candidate"]
        for field, policy in zip(fields, req.candidates or (req.candidate,), strict=True):
            await svc.off_loop(svc.check_policy, field, policy, len(ids))
        await svc.off_loop(svc.check_policy, "reference", req.reference, len(ids))
        # each candidate's sides as the engine will hold them (shared prompt or per-row copies)
        cost = await svc.off_loop(svc.check_memory, req.replicates, len(ids) + len(question), req.horizon, req.kind,
                           max(1, len(req.candidates)), tuple(req.candidates or (req.candidate,)), req.reference,
                           len(ids), req.top_logprobs)
        if req.top_logprobs > svc.engine.lm.vocab_size:
            raise invalid("top_logprobs", f"must be <= the vocabulary size {svc.engine.lm.vocab_size}")
        job = TraceJob(prompt_ids=ids, candidate=req.candidate, reference=req.reference, kind=req.kind,
                       horizon=req.horizon, replicates=req.replicates, window=req.window, sampling=req.sampling,
                       seed=req.seed, doc=req.doc, request_id=uuid.uuid4().hex, question_ids=question,
                       candidates=list(req.candidates), seeds=list(req.seeds), top_logprobs=req.top_logprobs)
        work = svc.start_trace(job, ticket, cost)
        try:
            await work.first()  # the header: the prefills ran, so the policies work on this prompt
        except CandidateError as exc:
            log.exception("trace %s failed before its header", job.request_id)
            raise failure_error(exc.cause, f"candidates[{exc.index}]", (exc.policy, req.reference)) from None
        except BaseException as exc:
            log.exception("trace %s failed before its header", job.request_id)
            raise failure_error(exc, "candidate", (req.candidate, req.reference)) from None
    sse = SSE in request.headers.get("accept", "")

    def frame(line: bytes) -> bytes:
        return b"data: " + line.rstrip(b"\n") + b"\n\n" if sse else line

    body = _candidates_body(svc, job, work, frame) if job.candidates else _trace_body(svc, job, work, frame)
    return StreamingResponse(body, media_type=SSE if sse else NDJSON, headers={"x-request-id": job.request_id})


def _count_row_steps(svc: Service, job: TraceJob, rec: dict[str, Any]) -> None:
    if rec["type"] in ("step", "shared_step"):
        svc.metrics.row_steps.inc(job.replicates)
    elif rec["type"] == "branch":
        svc.metrics.row_steps.inc(len(rec["tv"]) - 1)


async def _trace_body(svc: Service, job: TraceJob, work: WorkStream,
                      frame: Callable[[bytes], bytes]) -> AsyncIterator[bytes]:
    """One candidate: its records, then ``end`` (or an ``error`` record if the work fails)."""
    writer = StreamWriter()
    t0 = time.perf_counter()
    try:
        async for rec in work:
            _count_row_steps(svc, job, rec)
            yield frame(writer.line(rec))
        yield frame(writer.end(job.horizon, job.replicates, time.perf_counter() - t0))
    except Cancelled:
        pass
    except Exception as exc:  # mid-stream failure: an error record ends the stream
        err = stream_error(exc)
        yield frame(writer.line(error_record(err["error"], err["error_type"])))
    finally:
        work.cancel.set()


async def _candidates_body(svc: Service, job: TraceJob, work: WorkStream,
                           frame: Callable[[bytes], bytes]) -> AsyncIterator[bytes]:
    """Several candidates: each one's lines carry ``candidate`` and its own digest; each ends
    with its ``end`` or ``error`` record. A candidate failing on its own ends with an error
    record while the others go on; a failure of the whole work (a stacked forward, the
    deadline) ends every candidate still open with one. Candidates already ended keep
    their complete streams."""
    writers = {policy: StreamWriter() for policy in job.candidates}
    open_ = list(job.candidates)
    t0 = time.perf_counter()
    try:
        async for item in work:
            if isinstance(item, CandidateDone):
                open_.remove(item.policy)
                yield frame(writers[item.policy].end(job.horizon, job.replicates, time.perf_counter() - t0,
                                                     candidate=item.policy))
            elif isinstance(item, CandidateFailed):
                open_.remove(item.policy)
                err = stream_error(item.error)
                yield frame(writers[item.policy].line(error_record(err["error"], err["error_type"], item.policy)))
            else:
                policy = item["candidate"]["policy"] if item["type"] == "header" else item["candidate"]
                _count_row_steps(svc, job, item)
                yield frame(writers[policy].line(item))
    except Cancelled:
        pass
    except Exception as exc:
        err = stream_error(exc)
        for policy in open_:
            yield frame(writers[policy].line(error_record(err["error"], err["error_type"], policy)))
    finally:
        work.cancel.set()


# ---------------------------------------------------------------------- OpenAI-compatible routes


async def _chat_started(request: Request) -> tuple[Service, ChatRequest, Started]:
    svc, data = await read_json(request)
    req = parse_chat(data, svc.limits)
    async with svc.admitted() as ticket:
        ids = await svc.off_loop(svc.encode_chat, req.messages)
        started = await start_generation(svc, ticket, ids, req.decoding, "messages", "eviction")
    return svc, req, started


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (stream and not), with kvdiv's ``eviction``."""
    svc, req, started = await _chat_started(request)
    cid, model = oai.new_id("chatcmpl"), svc.engine.lm.name
    if req.stream:
        return StreamingResponse(_chat_events(svc, req, started, cid, model), media_type=SSE)
    tokens, finish = await collect(request, started)
    logprobs = [oai.logprob_content(t, svc.token_text) for t in tokens] if req.logprobs else None
    return JSONResponse(oai.chat_completion(cid, model, svc.decode([t["id"] for t in tokens]),
                                            oai.finish_reason(finish), oai.usage(len(started.ids), len(tokens)),
                                            logprobs))


async def _chat_events(svc: Service, req: ChatRequest, started: Started, cid: str, model: str) -> AsyncIterator[bytes]:
    created, text, n = int(time.time()), oai.IncrementalText(svc.decode), 0
    try:
        async for item in started.work:
            if "finish_reason" in item:
                yield tgi.sse(oai.chat_chunk(cid, model, created, text.flush(),
                                             oai.finish_reason(item["finish_reason"])))
                if req.include_usage:
                    yield tgi.sse(oai.chat_chunk(cid, model, created, "", None,
                                                 use=oai.usage(len(started.ids), n), empty=True))
                break
            n += 1
            svc.metrics.tokens.inc()
            lp = [oai.logprob_content(item, svc.token_text)] if req.logprobs else None
            yield tgi.sse(oai.chat_chunk(cid, model, created, text.push(item["id"]), None, lp))
        yield b"data: [DONE]\n\n"
    except Cancelled:
        pass
    except Exception as exc:
        yield tgi.sse(stream_error(exc))
    finally:
        started.work.cancel.set()


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (stream and not), with kvdiv's ``eviction``."""
    svc, data = await read_json(request)
    req = parse_completion(data, svc.limits)
    async with svc.admitted() as ticket:
        ids = await svc.off_loop(svc.encode, req.prompt)
        started = await start_generation(svc, ticket, ids, req.decoding, "prompt", "eviction")
    cid, model = oai.new_id("cmpl"), svc.engine.lm.name
    if req.stream:
        return StreamingResponse(_completion_events(svc, started, cid, model), media_type=SSE)
    tokens, finish = await collect(request, started)
    return JSONResponse(oai.completion(cid, model, svc.decode([t["id"] for t in tokens]), oai.finish_reason(finish),
                                       oai.usage(len(ids), len(tokens))))


async def _completion_events(svc: Service, started: Started, cid: str, model: str) -> AsyncIterator[bytes]:
    created, text = int(time.time()), oai.IncrementalText(svc.decode)
    try:
        async for item in started.work:
            if "finish_reason" in item:
                yield tgi.sse(oai.completion_chunk(cid, model, created, text.flush(),
                                                   oai.finish_reason(item["finish_reason"])))
                break
            svc.metrics.tokens.inc()
            yield tgi.sse(oai.completion_chunk(cid, model, created, text.push(item["id"]), None))
        yield b"data: [DONE]\n\n"
    except Cancelled:
        pass
    except Exception as exc:
        yield tgi.sse(stream_error(exc))
    finally:
        started.work.cancel.set()


async def models(request: Request) -> Response:
    """``GET /v1/models``: the one served model."""
    svc = state(request)
    return JSONResponse(oai.models(svc.engine.lm.name, svc.created))


# path, method, handler, needs authentication
ROUTES: list[tuple[str, str, Handler, bool]] = [
    ("/", "POST", compat, True),
    ("/generate", "POST", generate, True),
    ("/generate_stream", "POST", generate_stream, True),
    ("/tokenize", "POST", tokenize, True),
    ("/chat_tokenize", "POST", chat_tokenize, True),
    ("/detokenize", "POST", detokenize, True),
    ("/v1/chat/completions", "POST", chat_completions, True),
    ("/v1/completions", "POST", completions, True),
    ("/v1/models", "GET", models, True),
    ("/info", "GET", info, True),
    ("/health", "GET", health, False),
    ("/metrics", "GET", metrics, True),
    ("/v1/traces", "POST", traces, True),
    ("/v1/policies", "GET", policies, True),
]
