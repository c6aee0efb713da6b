"""The typed request layer: every route's JSON body becomes one frozen record here.

Parsing is pure (a dict and the server's :class:`RequestLimits` in, a record or a 422 out),
so every check lives in one place and every error names its field. What needs the
model (tokenising, the context length, building the policy for the prompt) happens
afterwards in the handlers, still before the first byte of a response is sent.

Unknown keys are ignored on the TGI and OpenAI routes, as TGI does (clients send extra
fields such as ``model`` or ``user``). ``/v1/traces`` is kvdiv's own: there a key it does
not know, at the top level or in ``parameters``, is a 422 naming it and the closest known
name (:func:`refuse_unknown`), so no study is collected with a setting that never applied.
Known features this server does not implement are refused by name
rather than ignored: ``watermark``, ``grammar``, ``best_of`` > 1, ``n`` > 1,
``tools``, ``response_format``, ``logit_bias``, ``suffix`` and ``adapter_id``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gen_service.engine.coupling import Sampling
from gen_service.errors import invalid
from gen_service.serving.limits import RequestLimits
from gen_service.serving.service import Message
from protocols import MAX_TOP_LOGPROBS, WIRE_KINDS, Kind

__all__ = [
    "Reader", "Decoding", "GenerateRequest", "ChatRequest", "CompletionRequest",
    "TraceRequest", "TokenizeRequest", "DetokenizeRequest", "parse_detokenize",
    "parse_generate", "parse_chat", "parse_chat_messages", "parse_completion",
    "parse_trace", "parse_tokenize", "refuse_unknown", "SEED_MAX", "TRACE_FIELDS",
    "TRACE_PARAMETERS",
]

SEED_MAX = 2**63 - 1  # seeds are int64 in the trace contract and in torch
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for frequency and presence penalties
#: Every key a /v1/traces body may have at its top level, and in its ``parameters``.
TRACE_FIELDS = frozenset({
    "inputs", "messages", "context", "question", "add_special_tokens", "candidate", "candidates", "seeds",
    "reference", "kind", "replicates", "window", "doc_id", "seed", "top_logprobs", "parameters",
})
TRACE_PARAMETERS = frozenset({
    "max_new_tokens", "temperature", "top_k", "top_p", "typical_p", "do_sample", "repetition_penalty",
    "frequency_penalty", "presence_penalty", "seed",
})


class Reader:
    """Typed reads from one JSON object; errors name ``prefix + key``.

    Examples
    --------
    >>> Reader({"top_k": 3}, "parameters.").int("top_k", lo=1)
    3
    """

    def __init__(self, data: Any, prefix: str = ""):
        if not isinstance(data, dict):
            raise invalid(prefix.rstrip(".") or "body", "expected a JSON object")
        self.data, self.prefix = data, prefix

    def name(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def int(self, key: str, default: int | None = None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(self.name(key), "expected an integer")
        if lo is not None and value < lo:
            raise invalid(self.name(key), f"must be >= {lo}")
        if hi is not None and value > hi:
            raise invalid(self.name(key), f"must be <= {hi} (server limit)")
        return value

    def number(self, key: str, lo: float | None = None, hi: float | None = None,
               open_lo: bool = False) -> float | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(self.name(key), "expected a finite number")
        if lo is not None and (value <= lo if open_lo else value < lo):
            raise invalid(self.name(key), f"must be {'>' if open_lo else '>='} {lo:g}")
        if hi is not None and value > hi:
            raise invalid(self.name(key), f"must be <= {hi:g}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is not None and not isinstance(value, bool):
            raise invalid(self.name(key), "expected true or false")
        return value

    def str(self, key: str, default: str | None = None, *, required: bool = False) -> str | None:
        value = self.get(key, default)
        if value is None:
            if required:
                raise invalid(self.name(key), "required")
            return None
        if not isinstance(value, str):
            raise invalid(self.name(key), "expected a string")
        return value

    def strings(self, key: str, max_items: int) -> tuple[str, ...]:
        """A string or a list of non-empty strings (``stop``)."""
        value = self.get(key, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise invalid(self.name(key), "expected a list of non-empty strings")
        if len(value) > max_items:
            raise invalid(self.name(key), f"at most {max_items} sequences")
        return tuple(value)

    def refuse(self, key: str, allowed: tuple = (None,), why: str = "not supported by this server") -> None:
        """A known feature this server does not implement: only ``allowed`` values pass."""
        value = self.data.get(key)
        if not any(value is a or (value == a and type(value) is type(a)) for a in allowed):
            raise invalid(self.name(key), why)


def refuse_unknown(r: Reader, known: Collection[str]) -> None:
    """A 422 for the first key of ``r`` not in ``known``, naming it and the closest known name.

    Parameters
    ----------
    r : Reader
        The object read (its prefix names the field: ``parameters.temprature``).
    known : collection of str
        The keys the route reads.

    Returns
    -------
    None

    Raises
    ------
    ApiError
        422 ``<field>: unknown field (did you mean 'temperature'?)``.

    Examples
    --------
    >>> try:
    ...     refuse_unknown(Reader({"temprature": 0.1}, "parameters."), TRACE_PARAMETERS)
    ... except Exception as exc:
    ...     print(exc)
    parameters.temprature: unknown field (did you mean 'temperature'?)
    """
    for key in r.data:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(sorted(known))}"
            raise invalid(r.name(str(key)), f"unknown field ({hint})")


def _text(value: str, field: str, limits: RequestLimits) -> str:
    if len(value.encode("utf-8")) > limits.max_input_bytes:
        raise invalid(field, f"over {limits.max_input_bytes} bytes (server limit --max-input-bytes)")
    if not value.strip():
        raise invalid(field, "empty input")
    return value


def _seed(r: Reader, key: str = "seed") -> int | None:
    return r.int(key, lo=0, hi=SEED_MAX)


def _sampling(r: Reader, *, sample_by_default: bool) -> Sampling:
    """TGI's knobs. ``sample_by_default``: traces and the OpenAI routes sample at T = 1
    unless told otherwise; TGI's /generate is greedy unless a sampling knob is set."""
    temperature = r.number("temperature", lo=0.0)
    top_k = r.int("top_k", lo=1)
    top_p = r.number("top_p", lo=0.0, hi=1.0, open_lo=True)
    typical_p = r.number("typical_p", lo=0.0, hi=1.0, open_lo=True)
    do_sample = r.bool("do_sample")
    if do_sample is None:
        do_sample = sample_by_default or (temperature not in (None, 1.0) or top_k is not None
                                          or top_p is not None or typical_p is not None)
    return Sampling(temperature=1.0 if temperature is None else temperature, top_k=top_k, top_p=top_p,
                    do_sample=bool(do_sample) and temperature != 0,
                    repetition_penalty=r.number("repetition_penalty", lo=0.0, hi=100.0, open_lo=True),
                    frequency_penalty=r.number("frequency_penalty", *PENALTY_RANGE),
                    presence_penalty=r.number("presence_penalty", *PENALTY_RANGE),
                    typical_p=typical_p)


@dataclass(frozen=True)
class Decoding:
    """How to decode one plain generation (/generate and the OpenAI routes).

    ``max_new_tokens`` None means "up to the server limit and the model context"
    (OpenAI's default when ``max_tokens`` is absent).
    """

    max_new_tokens: int | None
    sampling: Sampling
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_n_tokens: int = 0
    eviction: str = "full"


@dataclass(frozen=True)
class GenerateRequest:
    """``POST /generate``, ``/generate_stream`` and ``/`` (TGI)."""

    inputs: str
    decoding: Decoding
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False
    truncate: int | None = None
    stream: bool = False


@dataclass(frozen=True)
class ChatRequest:
    """``POST /v1/chat/completions`` and ``/chat_tokenize``."""

    messages: tuple[Message, ...]
    decoding: Decoding
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    """``POST /v1/completions``."""

    prompt: str
    decoding: Decoding
    stream: bool = False


@dataclass(frozen=True)
class TraceRequest:
    """``POST /v1/traces`` (docs/service.md): a prompt, two policies and the kernels' sampling.

    The prompt is ``inputs``, ``messages`` (all of it compressed) or ``context`` +
    ``question`` (only the context is compressed; the question is prefilled after).
    ``candidates`` (several policies in one request, each with its seed in ``seeds``,
    None where the server draws one) is empty for a one-candidate request.
    ``top_logprobs`` (k ≤ 64; 0: none) asks for the logit traces at every step.
    """

    inputs: str | None
    messages: tuple[Message, ...] | None
    candidate: str
    reference: str = "full"
    kind: str = "coupled"
    horizon: int = 32
    replicates: int = 1
    window: int | None = None
    sampling: Sampling = Sampling()
    seed: int | None = None
    doc: str | None = None
    add_special_tokens: bool = True
    context: str | None = None
    question: str = ""
    candidates: tuple[str, ...] = ()
    seeds: tuple[int | None, ...] = ()
    top_logprobs: int = 0

    @property
    def prompt_field(self) -> str:
        if self.context is not None:
            return "context"
        return "messages" if self.messages is not None else "inputs"


@dataclass(frozen=True)
class TokenizeRequest:
    """``POST /tokenize``."""

    inputs: str
    add_special_tokens: bool = True


@dataclass(frozen=True)
class DetokenizeRequest:
    """``POST /detokenize``: token id sequences to decode with the model's tokenizer."""

    ids: tuple[tuple[int, ...], ...]
    skip_special_tokens: bool = True


#: Most token ids one ``/detokenize`` request may hold in all (a collection's answers
#: are a few thousand).
MAX_DETOKENIZE_IDS = 1 << 20


def _policy(r: Reader, key: str, default: str) -> str:
    value = r.str(key, default)
    if not value.strip():
        raise invalid(r.name(key), "empty policy id")
    return value


def _refuse_tgi_extras(p: Reader) -> None:
    p.refuse("watermark", (None, False), "watermarking is not supported by this server")
    p.refuse("grammar", (None,), "guided generation (grammar) is not supported by this server")
    p.refuse("adapter_id", (None,), "LoRA adapters are not supported by this server")
    p.refuse("best_of", (None, 1), "only best_of = 1 is supported")


def parse_generate(data: dict[str, Any], limits: RequestLimits, *, stream: bool = False) -> GenerateRequest:
    """A TGI generate request (``/generate``, ``/generate_stream``, ``/``).

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits.
    stream : bool
        The default of ``stream`` (read from the body on the compat route ``/``).

    Returns
    -------
    GenerateRequest

    Raises
    ------
    ApiError
        422 naming the field: a missing or empty ``inputs``, a value of the wrong type
        or out of range, a refused feature (``watermark``, ``grammar``, ...).

    Examples
    --------
    >>> req = parse_generate({"inputs": "Hi", "parameters": {"max_new_tokens": 5}}, RequestLimits())
    >>> req.decoding.max_new_tokens, req.decoding.sampling.greedy
    (5, True)
    """
    r = Reader(data)
    inputs = _text(r.str("inputs", required=True), "inputs", limits)
    p = Reader(r.get("parameters", {}), "parameters.")
    _refuse_tgi_extras(p)
    decoding = Decoding(
        max_new_tokens=p.int("max_new_tokens", min(20, limits.max_new_tokens), lo=1, hi=limits.max_new_tokens),
        sampling=_sampling(p, sample_by_default=False), seed=_seed(p), stop=p.strings("stop", limits.max_stop),
        top_n_tokens=p.int("top_n_tokens", 0, lo=0, hi=limits.max_top_n),
        eviction=_policy(p, "eviction", limits.default_eviction))
    return GenerateRequest(inputs=inputs, decoding=decoding, details=p.bool("details", False),
                           decoder_input_details=p.bool("decoder_input_details", False),
                           return_full_text=p.bool("return_full_text", False),
                           truncate=p.int("truncate", lo=1), stream=bool(r.bool("stream", stream)))


def _content(value: Any, field: str) -> str:
    """OpenAI message content: a string, or a list of ``{"type": "text", "text"}`` parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            pr = Reader(part, f"{field}[{i}].")
            if pr.get("type") != "text":
                raise invalid(pr.name("type"), "only text content is supported")
            parts.append(pr.str("text", required=True))
        return "".join(parts)
    raise invalid(field, "expected a string or a list of text parts")


def _messages(r: Reader, limits: RequestLimits, *, allow_empty: bool = False) -> tuple[Message, ...]:
    raw = r.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        mr = Reader(m, f"messages[{i}].")
        role = mr.str("role", required=True)
        mr.refuse("tool_calls", (None,), "tool calls are not supported by this server")
        out.append(Message(role, _content(mr.get("content", ""), mr.name("content"))))
    total = sum(len(m.content.encode("utf-8")) for m in out)
    if total > limits.max_input_bytes:
        raise invalid("messages", f"over {limits.max_input_bytes} bytes (server limit --max-input-bytes)")
    if not allow_empty and not any(m.content.strip() for m in out):
        raise invalid("messages", "empty input")
    return tuple(out)


def _openai_decoding(r: Reader, limits: RequestLimits, *, top_n: int) -> Decoding:
    r.refuse("n", (None, 1), "only n = 1 is supported")
    r.refuse("logit_bias", (None,), "logit_bias is not supported by this server")
    r.refuse("best_of", (None, 1), "only best_of = 1 is supported")
    return Decoding(max_new_tokens=r.int("max_tokens", lo=1, hi=limits.max_new_tokens),
                    sampling=_sampling(r, sample_by_default=True), seed=_seed(r),
                    stop=r.strings("stop", limits.max_stop), top_n_tokens=top_n,
                    eviction=_policy(r, "eviction", limits.default_eviction))


def parse_chat(data: dict[str, Any], limits: RequestLimits) -> ChatRequest:
    """An OpenAI chat request as TGI's Messages API takes it, plus kvdiv's ``eviction``.

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits.

    Returns
    -------
    ChatRequest

    Raises
    ------
    ApiError
        422 naming the field (``messages[0].content``, ``n``, ``tools``, ...).

    Examples
    --------
    >>> parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, RequestLimits()).messages[0].content
    'Hi'
    """
    r = Reader(data)
    messages = _messages(r, limits)
    for key in ("tools", "tool_choice", "response_format", "tool_prompt"):
        r.refuse(key, (None,), f"{key} is not supported by this server")
    logprobs = bool(r.bool("logprobs", False))
    top = r.int("top_logprobs", 0, lo=0, hi=min(20, limits.max_top_n))
    if top and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    options = Reader(r.get("stream_options", {}), "stream_options.")
    return ChatRequest(messages=messages, decoding=_openai_decoding(r, limits, top_n=top), logprobs=logprobs,
                       stream=bool(r.bool("stream", False)), include_usage=bool(options.bool("include_usage", False)))


def parse_chat_messages(data: dict[str, Any], limits: RequestLimits) -> tuple[Message, ...]:
    """The messages of a ``/chat_tokenize`` request; the generation knobs do not matter
    for templating and are ignored, as TGI does.

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits.

    Returns
    -------
    tuple of Message

    Raises
    ------
    ApiError
        422 naming the message field at fault.

    Examples
    --------
    >>> parse_chat_messages({"messages": [{"role": "user", "content": ""}]}, RequestLimits())
    (Message(role='user', content=''),)
    """
    return _messages(Reader(data), limits, allow_empty=True)


def parse_completion(data: dict[str, Any], limits: RequestLimits) -> CompletionRequest:
    """An OpenAI (legacy) completion request: ``prompt`` is a string or a list of one.

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits.

    Returns
    -------
    CompletionRequest

    Raises
    ------
    ApiError
        422 naming the field (``prompt``, ``suffix``, ``echo``, ``logprobs``, ...).

    Examples
    --------
    >>> parse_completion({"prompt": ["Once"], "max_tokens": 3}, RequestLimits()).prompt
    'Once'
    """
    r = Reader(data)
    prompt = r.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt", "expected a string (or a list of one string)")
    r.refuse("suffix", (None,), "suffix is not supported by this server")
    r.refuse("echo", (None, False), "echo is not supported by this server")
    r.refuse("logprobs", (None,), "logprobs are not supported on /v1/completions; use /generate details")
    return CompletionRequest(prompt=_text(prompt, "prompt", limits),
                             decoding=_openai_decoding(r, limits, top_n=0), stream=bool(r.bool("stream", False)))


def parse_trace(data: dict[str, Any], limits: RequestLimits) -> TraceRequest:
    """A ``/v1/traces`` request; the prompt is tokenised and the policies built later.

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits.

    Returns
    -------
    TraceRequest

    Raises
    ------
    ApiError
        422 naming the field (``inputs``, ``context``, ``question``, ``kind``, ``window``, ``replicates``,
        ``parameters.max_new_tokens``, ``seed``, ``candidates[i]``, ``seeds``, ``top_logprobs``, ...),
        or a key it does not know, at the top level or in ``parameters`` (:func:`refuse_unknown`).

    Examples
    --------
    >>> parse_trace({"inputs": "Hi", "candidate": "snapkv@0.5"}, RequestLimits()).kind
    'coupled'
    """
    r = Reader(data)
    refuse_unknown(r, TRACE_FIELDS)
    p = Reader(r.get("parameters", {}), "parameters.")
    refuse_unknown(p, TRACE_PARAMETERS)
    inputs, messages, context, question = _trace_prompt(r, limits)
    horizon = p.int("max_new_tokens", 32, lo=1, hi=limits.max_new_tokens)
    kind = r.get("kind", "coupled")
    if kind not in WIRE_KINDS:
        raise invalid("kind", f"must be one of {', '.join(map(repr, WIRE_KINDS))}")
    window = r.int("window", lo=1)
    if window is not None and window > horizon:
        raise invalid("window", f"window {window} > horizon (max_new_tokens) {horizon}")
    if window is not None and kind == Kind.COUPLED and window != horizon:
        raise invalid("window", "coupled traces run to the horizon; window applies to residual traces")
    if window is not None and kind == Kind.REFERENCE:
        raise invalid("window", "reference traces observe nothing after divergence; window applies to residual "
                                "traces")
    candidates, seeds = _candidates(r, limits.max_candidates)
    doc = r.get("doc_id")
    if doc is not None and (isinstance(doc, bool) or not isinstance(doc, (str, int))):
        raise invalid("doc_id", "expected a string")
    sampling = _sampling(p, sample_by_default=True)
    seed = _seed(p) if p.get("seed") is not None else _seed(r)
    if seeds and seed is not None:
        raise invalid("seeds", "give either `seeds` (one per candidate) or `seed`, not both")
    if candidates and not seeds:
        seeds = (seed,) * len(candidates)   # every candidate as its own request with that seed
    return TraceRequest(inputs=inputs, messages=messages,
                        candidate=candidates[0] if candidates else _policy(r, "candidate", ""),
                        candidates=candidates, seeds=seeds,
                        reference=_policy(r, "reference", "full"), kind=kind, horizon=horizon,
                        replicates=r.int("replicates", 1, lo=1, hi=limits.max_replicates), window=window,
                        sampling=sampling, seed=seed, doc=None if doc is None else str(doc),
                        add_special_tokens=bool(r.bool("add_special_tokens", True)), context=context,
                        question=question, top_logprobs=r.int("top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS))


def _candidates(r: Reader, most: int) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    """``candidate`` (one policy id) or ``candidates`` (a list of distinct ids) with
    optional ``seeds`` parallel to it; ((), ()) for a one-candidate request."""
    one, many = r.data.get("candidate"), r.data.get("candidates")
    if one is not None and many is not None:
        raise invalid("candidates", "give either `candidate` or `candidates`, not both")
    if many is None:
        if one is None:
            raise invalid("candidate", "required policy id (or `candidates`, a list of them)")
        if r.data.get("seeds") is not None:
            raise invalid("seeds", "only with `candidates`")
        return (), ()
    if not isinstance(many, list) or not many:
        raise invalid("candidates", "expected a non-empty list of policy ids")
    if len(many) > most:
        raise invalid("candidates", f"at most {most} candidates in one request (server limit --max-candidates)")
    for i, policy in enumerate(many):
        if not isinstance(policy, str) or not policy.strip():
            raise invalid(f"candidates[{i}]", "expected a non-empty policy id")
        if policy in many[:i]:
            raise invalid(f"candidates[{i}]", f"duplicate policy {policy!r} (also candidates[{many.index(policy)}])")
    seeds = r.data.get("seeds")
    if seeds is None:
        return tuple(many), ()
    if not isinstance(seeds, list) or len(seeds) != len(many):
        raise invalid("seeds", f"expected a list of {len(many)} seeds, one per candidate")
    seeds_reader = Reader({f"seeds[{i}]": v for i, v in enumerate(seeds)})
    return tuple(many), tuple(_seed(seeds_reader, f"seeds[{i}]") for i in range(len(seeds)))


def _trace_prompt(r: Reader, limits: RequestLimits) -> tuple[str | None, tuple[Message, ...] | None, str | None, str]:
    """(inputs, messages, context, question): exactly one of the three prompts."""
    if r.get("context") is None:
        if r.get("question") is not None:
            raise invalid("question", "needs a `context`")
        messages = _messages(r, limits) if r.get("messages") is not None else None
        inputs = None if messages is not None else _text(r.str("inputs", required=True), "inputs", limits)
        return inputs, messages, None, ""
    if r.get("inputs") is not None or r.get("messages") is not None:
        raise invalid("context", "give either `context` (+ `question`) or `inputs`/`messages`")
    context = _text(r.str("context"), "context", limits)
    question = r.str("question", "")
    if len(question.encode("utf-8")) > limits.max_input_bytes:
        raise invalid("question", f"over {limits.max_input_bytes} bytes (server limit --max-input-bytes)")
    return None, None, context, question


def parse_detokenize(data: dict[str, Any], vocab_size: int) -> DetokenizeRequest:
    """A ``/detokenize`` request: ``{"ids": [[int, ...], ...], "skip_special_tokens": true}``.

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    vocab_size : int
        The model's vocabulary: every id must lie in [0, vocab_size).

    Returns
    -------
    DetokenizeRequest

    Raises
    ------
    ApiError
        422 naming the field: ``ids`` missing or not a list of lists of integers, an id
        outside the vocabulary, more than :data:`MAX_DETOKENIZE_IDS` ids, an unknown key.

    Examples
    --------
    >>> parse_detokenize({"ids": [[1, 2], []]}, 10).ids
    ((1, 2), ())
    """
    r = Reader(data)
    refuse_unknown(r, ("ids", "skip_special_tokens"))
    ids = r.get("ids")
    if not isinstance(ids, list) or not all(isinstance(row, list) for row in ids):
        raise invalid("ids", "expected a list of token id lists")
    total = 0
    for i, row in enumerate(ids):
        total += len(row)
        if total > MAX_DETOKENIZE_IDS:
            raise invalid("ids", f"more than {MAX_DETOKENIZE_IDS} ids (server limit)")
        bad = next((t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid(f"ids[{i}]", f"{bad!r} is not a token id in [0, {vocab_size})")
    skip = r.bool("skip_special_tokens", True)
    return DetokenizeRequest(tuple(tuple(row) for row in ids), bool(skip))


def parse_tokenize(data: dict[str, Any], limits: RequestLimits) -> TokenizeRequest:
    """A ``/tokenize`` request (TGI's GenerateRequest; ``parameters`` are ignored).

    Parameters
    ----------
    data : dict
        The parsed JSON body.
    limits : RequestLimits
        The server's limits (``max_input_bytes``).

    Returns
    -------
    TokenizeRequest

    Raises
    ------
    ApiError
        422 for a missing or oversized ``inputs``.

    Examples
    --------
    >>> parse_tokenize({"inputs": ""}, RequestLimits()).inputs
    ''
    """
    r = Reader(data)
    inputs = r.str("inputs", required=True)
    if len(inputs.encode("utf-8")) > limits.max_input_bytes:
        raise invalid("inputs", f"over {limits.max_input_bytes} bytes (server limit --max-input-bytes)")
    return TokenizeRequest(inputs=inputs, add_special_tokens=bool(r.bool("add_special_tokens", True)))
