"""The OpenAI-compatible wire format as TGI's Messages API serves it:
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` bodies and chunks.

Pure functions returning dicts; :class:`IncrementalText` turns a growing list of
token ids into text deltas without splitting a multi-byte character.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["IncrementalText", "finish_reason", "usage", "chat_completion", "chat_chunk", "completion",
           "completion_chunk", "models", "logprob_content", "new_id", "FINGERPRINT"]

FINGERPRINT = "kvdiv"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(tgi_reason: str) -> str:
    """TGI's finish reason in OpenAI's words: EOS and stop sequences are ``stop``."""
    return "length" if tgi_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class IncrementalText:
    """Text deltas of a token stream, held back while the text ends in an incomplete
    character (U+FFFD), as TGI's detokenizer does with prefix and read offsets."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids = decode, []
        self.prefix = self.read = 0

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back when the stream ends (an incomplete character
        included, so the streamed text equals the non-streamed one)."""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


def logprob_content(item: dict[str, Any], text: Callable[[int], str]) -> dict[str, Any]:
    """One ``logprobs.content`` entry: the token, its log-probability and the top ones."""
    return {"token": text(item["id"]), "logprob": item["logprob"],
            "top_logprobs": [{"token": text(i), "logprob": lp} for i, lp in item["top"]]}


def _envelope(cid: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": cid, "object": obj, "created": int(created or time.time()), "model": model,
            "system_fingerprint": FINGERPRINT}


def chat_completion(cid: str, model: str, text: str, finish: str, use: dict[str, int],
                    logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A non-streamed ``ChatCompletion``."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}
    return {**_envelope(cid, "chat.completion", model, None), "choices": [choice], "usage": use}


def chat_chunk(cid: str, model: str, created: int, delta: str, finish: str | None,
               logprobs: list[dict[str, Any]] | None = None, use: dict[str, int] | None = None,
               empty: bool = False) -> dict[str, Any]:
    """One ``ChatCompletionChunk``. ``empty``: the usage-only chunk (no choices)."""
    choices = [] if empty else [{"index": 0, "delta": {"role": "assistant", "content": delta},
                                 "logprobs": None if logprobs is None else {"content": logprobs},
                                 "finish_reason": finish}]
    return {**_envelope(cid, "chat.completion.chunk", model, created), "choices": choices, "usage": use}


def completion(cid: str, model: str, text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
    """A non-streamed ``CompletionFinal``."""
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**_envelope(cid, "text_completion", model, None), "choices": [choice], "usage": use}


def completion_chunk(cid: str, model: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
    """One streamed completion ``Chunk``; TGI's schema wants ``finish_reason`` a string,
    so chunks before the last carry ``""``."""
    choice = {"index": 0, "text": text, "finish_reason": finish or "", "logprobs": None}
    return {**_envelope(cid, "text_completion", model, created), "choices": [choice]}


def models(model: str, created: int) -> dict[str, Any]:
    """``/v1/models``: TGI's ``ModelInfo`` for the one model, which is also an OpenAI
    list (``data``), so both TGI's schema and ``openai``'s ``models.list()`` read it."""
    card = {"id": model, "object": "model", "created": created, "owned_by": "kvdiv"}
    return {**card, "object": "list", "data": [card]}
