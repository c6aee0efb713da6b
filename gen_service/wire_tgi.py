"""TGI's wire format: the JSON bodies and SSE events of /generate, /generate_stream,
/tokenize and /info, as TGI's published OpenAPI document (v2.4) describes them.

Pure functions from engine items (``{"id", "logprob", "top"}`` per token) to dicts;
``text`` is a callable giving a token's text, ``special`` the special-token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["sse", "token", "top_tokens", "details", "stream_event", "stream_details", "tokenize_body"]

TokenText = Callable[[int], str]


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event (``data:<json>``), as TGI frames them."""
    return b"data:" + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(item: dict[str, Any], text: TokenText, special: frozenset[int]) -> dict[str, Any]:
    """TGI's ``Token``: ``{id, text, logprob, special}``."""
    return {"id": item["id"], "text": text(item["id"]), "logprob": item["logprob"], "special": item["id"] in special}


def top_tokens(item: dict[str, Any], text: TokenText, special: frozenset[int]) -> list[dict[str, Any]]:
    """The ``top_n_tokens`` alternatives of one step, as ``Token`` objects."""
    return [{"id": i, "text": text(i), "logprob": lp, "special": i in special} for i, lp in item["top"]]


def details(tokens: list[dict[str, Any]], finish: str, seed: int, prefill: list[dict[str, Any]], top_n: int,
            text: TokenText, special: frozenset[int]) -> dict[str, Any]:
    """TGI's ``Details`` of a non-streamed generation."""
    return {"finish_reason": finish, "generated_tokens": len(tokens), "seed": seed, "prefill": prefill,
            "tokens": [token(t, text, special) for t in tokens],
            "top_tokens": [top_tokens(t, text, special) for t in tokens] if top_n else [],
            "best_of_sequences": None}


def prefill_tokens(ids: list[int], logprobs: Iterable[float | None], text: TokenText) -> list[dict[str, Any]]:
    """``details.prefill``: each prompt token with its log-probability (None for the first)."""
    return [{"id": i, "text": text(i), "logprob": lp} for i, lp in zip(ids, logprobs, strict=True)]


def stream_details(finish: str, generated: int, seed: int, input_length: int) -> dict[str, Any]:
    """TGI's ``StreamDetails`` (the last event's ``details``)."""
    return {"finish_reason": finish, "generated_tokens": generated, "seed": seed, "input_length": input_length}


def stream_event(index: int, item: dict[str, Any], top_n: int, text: TokenText, special: frozenset[int],
                 generated_text: str | None = None, details_: dict[str, Any] | None = None) -> dict[str, Any]:
    """TGI's ``StreamResponse``: one event per token; the last carries the text and details.
    ``top_tokens`` is a list (empty without ``top_n_tokens``): the schema does not allow null."""
    return {"index": index, "token": token(item, text, special),
            "top_tokens": top_tokens(item, text, special) if top_n else [],
            "generated_text": generated_text, "details": details_}


def tokenize_body(inputs: str, ids: list[int], offsets: list[tuple[int, int]], text: TokenText,
                  chunk: int = 1024) -> bytes:
    """``/tokenize``'s ``[{id, text, start, stop}]`` as JSON bytes, encoded in chunks so
    a million-token answer never holds the interpreter for one long call."""
    parts = []
    for lo in range(0, len(ids), chunk):
        rows = [{"id": i, "text": inputs[a:b] if b > a else text(i), "start": a, "stop": b}
                for i, (a, b) in zip(ids[lo:lo + chunk], offsets[lo:lo + chunk], strict=True)]
        parts.append(json.dumps(rows, separators=(",", ":"))[1:-1])
    return ("[" + ",".join(parts) + "]").encode()
