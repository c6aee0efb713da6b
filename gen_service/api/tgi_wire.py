"""TGI's wire format: the JSON bodies and SSE events of /generate, /generate_stream,
/tokenize and /info, as TGI's published OpenAPI document (v2.4) describes them.

Pure functions from engine items (``{"id", "logprob", "top"}`` per token) to dicts;
``text`` is a callable giving a token's text, ``special`` the special-token ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["sse", "token", "top_tokens", "details", "prefill_tokens", "stream_event", "stream_details",
           "tokenize_chunks"]

TokenText = Callable[[int], str]


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event, framed as TGI frames them.

    Parameters
    ----------
    obj : dict
        The event's JSON payload.

    Returns
    -------
    bytes
        ``data:<compact json>`` and a blank line.

    Raises
    ------
    TypeError
        If ``obj`` is not JSON-serialisable.

    Examples
    --------
    >>> sse({"a": 1})
    b'data:{"a":1}\\n\\n'
    """
    return b"data:" + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def token(item: dict[str, Any], text: TokenText, special: frozenset[int]) -> dict[str, Any]:
    """TGI's ``Token`` for one generated token.

    Parameters
    ----------
    item : dict
        The engine's item: ``id`` and ``logprob`` (``top`` is not used here).
    text : callable
        Token id -> its text.
    special : frozenset of int
        The special-token ids.

    Returns
    -------
    dict
        ``{id, text, logprob, special}``.

    Raises
    ------
    KeyError
        If ``item`` lacks ``id`` or ``logprob``.

    Examples
    --------
    >>> token({"id": 2, "logprob": -0.5}, str, frozenset({2}))
    {'id': 2, 'text': '2', 'logprob': -0.5, 'special': True}
    """
    return {"id": item["id"], "text": text(item["id"]), "logprob": item["logprob"], "special": item["id"] in special}


def top_tokens(item: dict[str, Any], text: TokenText, special: frozenset[int]) -> list[dict[str, Any]]:
    """The ``top_n_tokens`` alternatives of one step, as TGI ``Token`` objects.

    Parameters
    ----------
    item : dict
        The engine's item; ``top`` holds ``(id, logprob)`` pairs, best first.
    text : callable
        Token id -> its text.
    special : frozenset of int
        The special-token ids.

    Returns
    -------
    list of dict
        One ``Token`` per alternative.

    Raises
    ------
    KeyError
        If ``item`` lacks ``top``.

    Examples
    --------
    >>> top_tokens({"top": [(5, -0.1)]}, str, frozenset())
    [{'id': 5, 'text': '5', 'logprob': -0.1, 'special': False}]
    """
    return [{"id": i, "text": text(i), "logprob": lp, "special": i in special} for i, lp in item["top"]]


def details(tokens: list[dict[str, Any]], finish: str, seed: int, prefill: list[dict[str, Any]], top_n: int,
            text: TokenText, special: frozenset[int]) -> dict[str, Any]:
    """TGI's ``Details`` of a non-streamed generation.

    Parameters
    ----------
    tokens : list of dict
        The engine's items, one per generated token.
    finish : str
        ``length``, ``eos_token`` or ``stop_sequence``.
    seed : int
        The seed used.
    prefill : list of dict
        ``details.prefill`` (see :func:`prefill_tokens`), empty unless asked for.
    top_n : int
        ``top_n_tokens``; ``top_tokens`` is an empty list when 0 (the schema does
        not allow null).
    text, special
        As in :func:`token`.

    Returns
    -------
    dict
        ``{finish_reason, generated_tokens, seed, prefill, tokens, top_tokens, best_of_sequences}``.

    Raises
    ------
    KeyError
        If an item lacks a field.

    Examples
    --------
    >>> details([{"id": 1, "logprob": -1.0, "top": []}], "length", 7, [], 0, str, frozenset())["generated_tokens"]
    1
    """
    return {"finish_reason": finish, "generated_tokens": len(tokens), "seed": seed, "prefill": prefill,
            "tokens": [token(t, text, special) for t in tokens],
            "top_tokens": [top_tokens(t, text, special) for t in tokens] if top_n else [],
            "best_of_sequences": None}


def prefill_tokens(ids: list[int], logprobs: Iterable[float | None], text: TokenText) -> list[dict[str, Any]]:
    """``details.prefill``: each prompt token with its log-probability.

    Parameters
    ----------
    ids : list of int
        The prompt's token ids.
    logprobs : iterable of float or None
        One per id; the first is None (nothing predicts it).
    text : callable
        Token id -> its text.

    Returns
    -------
    list of dict
        TGI's ``PrefillToken`` objects ``{id, text, logprob}``.

    Raises
    ------
    ValueError
        If ``ids`` and ``logprobs`` differ in length.

    Examples
    --------
    >>> prefill_tokens([1, 2], [None, -0.3], str)
    [{'id': 1, 'text': '1', 'logprob': None}, {'id': 2, 'text': '2', 'logprob': -0.3}]
    """
    return [{"id": i, "text": text(i), "logprob": lp} for i, lp in zip(ids, logprobs, strict=True)]


def stream_details(finish: str, generated: int, seed: int, input_length: int) -> dict[str, Any]:
    """TGI's ``StreamDetails``, carried by the last event of a stream.

    Parameters
    ----------
    finish : str
        The finish reason.
    generated : int
        Tokens generated.
    seed : int
        The seed used.
    input_length : int
        Prompt tokens (required by the schema).

    Returns
    -------
    dict
        ``{finish_reason, generated_tokens, seed, input_length}``.

    Raises
    ------
    None

    Examples
    --------
    >>> stream_details("length", 3, 1, 10)["input_length"]
    10
    """
    return {"finish_reason": finish, "generated_tokens": generated, "seed": seed, "input_length": input_length}


def stream_event(index: int, item: dict[str, Any], top_n: int, text: TokenText, special: frozenset[int],
                 generated_text: str | None = None, details_: dict[str, Any] | None = None) -> dict[str, Any]:
    """TGI's ``StreamResponse``: one event per token; the last carries the text and details.

    Parameters
    ----------
    index : int
        The token's position in the output, from 1.
    item : dict
        The engine's item.
    top_n : int
        ``top_n_tokens``; ``top_tokens`` is a list, empty when 0 (the schema does
        not allow null).
    text, special
        As in :func:`token`.
    generated_text : str, optional
        The whole text, on the last event only.
    details_ : dict, optional
        :func:`stream_details`, on the last event only.

    Returns
    -------
    dict
        ``{index, token, top_tokens, generated_text, details}``.

    Raises
    ------
    KeyError
        If ``item`` lacks a field.

    Examples
    --------
    >>> stream_event(1, {"id": 3, "logprob": -0.2, "top": []}, 0, str, frozenset())["top_tokens"]
    []
    """
    return {"index": index, "token": token(item, text, special),
            "top_tokens": top_tokens(item, text, special) if top_n else [],
            "generated_text": generated_text, "details": details_}


def tokenize_chunks(inputs: str, ids: list[int], offsets: list[tuple[int, int]], text: TokenText,
                    chunk: int = 1024) -> list[bytes]:
    """``/tokenize``'s ``[{id, text, start, stop}]`` as JSON, in pieces that join into one array.

    Encoded ``chunk`` tokens at a time, so a million-token answer never holds the
    interpreter for one long call, and can be sent piece by piece (the event loop
    keeps answering ``/health`` meanwhile).

    Parameters
    ----------
    inputs : str
        The tokenised text (a token's ``text`` is its span of it).
    ids : list of int
        Token ids.
    offsets : list of (int, int)
        Character span of each token; an empty span (a special token) takes the
        token's own text.
    text : callable
        Token id -> its text.
    chunk : int
        Tokens per piece.

    Returns
    -------
    list of bytes
        Pieces whose concatenation is a JSON array of TGI's ``SimpleToken``.

    Raises
    ------
    ValueError
        If ``ids`` and ``offsets`` differ in length.

    Examples
    --------
    >>> b"".join(tokenize_chunks("ab", [97, 98], [(0, 1), (1, 2)], chr, chunk=1))
    b'[{"id":97,"text":"a","start":0,"stop":1},{"id":98,"text":"b","start":1,"stop":2}]'
    """
    if len(ids) != len(offsets):
        raise ValueError(f"{len(ids)} ids but {len(offsets)} offsets")
    pieces = [b"["]
    for lo in range(0, len(ids), chunk):
        rows = [{"id": i, "text": inputs[a:b] if b > a else text(i), "start": a, "stop": b}
                for i, (a, b) in zip(ids[lo:lo + chunk], offsets[lo:lo + chunk], strict=True)]
        piece = json.dumps(rows, separators=(",", ":"))[1:-1].encode()
        pieces.append(piece if lo == 0 else b"," + piece)
    pieces.append(b"]")
    return pieces
