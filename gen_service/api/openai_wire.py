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
    """A fresh response id.

    Parameters
    ----------
    prefix : str
        ``chatcmpl`` or ``cmpl``, as OpenAI names them.

    Returns
    -------
    str
        ``prefix-<24 hex digits>``.

    Raises
    ------
    None

    Examples
    --------
    >>> new_id("cmpl").startswith("cmpl-")
    True
    """
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(tgi_reason: str) -> str:
    """TGI's finish reason in OpenAI's words.

    Parameters
    ----------
    tgi_reason : str
        ``length``, ``eos_token`` or ``stop_sequence``.

    Returns
    -------
    str
        ``length``, or ``stop`` for an EOS or a stop sequence.

    Raises
    ------
    None

    Examples
    --------
    >>> finish_reason("eos_token"), finish_reason("length")
    ('stop', 'length')
    """
    return "length" if tgi_reason == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's ``usage`` object.

    Parameters
    ----------
    prompt_tokens, completion_tokens : int
        Token counts.

    Returns
    -------
    dict
        ``{prompt_tokens, completion_tokens, total_tokens}``.

    Raises
    ------
    None

    Examples
    --------
    >>> usage(3, 2)["total_tokens"]
    5
    """
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class IncrementalText:
    """Text deltas of a token stream, held back while the text ends in an incomplete
    character (U+FFFD), as TGI's detokenizer does with prefix and read offsets.

    Parameters
    ----------
    decode : callable
        Token ids -> text.

    Examples
    --------
    >>> inc = IncrementalText(lambda ids: bytes(ids).decode("utf-8", "replace"))
    >>> inc.push(0xC3), inc.push(0xA9), inc.flush()
    ('', 'é', '')
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids = decode, []
        self.prefix = self.read = 0

    def push(self, tid: int) -> str:
        """Append a token; return the text it completes (possibly empty)."""
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
    """One ``logprobs.content`` entry of a chat choice.

    Parameters
    ----------
    item : dict
        The engine's item: ``id``, ``logprob`` and ``top`` (``(id, logprob)`` pairs).
    text : callable
        Token id -> its text.

    Returns
    -------
    dict
        ``{token, logprob, top_logprobs: [{token, logprob}]}``.

    Raises
    ------
    KeyError
        If ``item`` lacks a field.

    Examples
    --------
    >>> logprob_content({"id": 65, "logprob": -0.1, "top": [(65, -0.1)]}, chr)["top_logprobs"]
    [{'token': 'A', 'logprob': -0.1}]
    """
    return {"token": text(item["id"]), "logprob": item["logprob"],
            "top_logprobs": [{"token": text(i), "logprob": lp} for i, lp in item["top"]]}


def _envelope(cid: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": cid, "object": obj, "created": int(created or time.time()), "model": model,
            "system_fingerprint": FINGERPRINT}


def chat_completion(cid: str, model: str, text: str, finish: str, use: dict[str, int],
                    logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A non-streamed ``ChatCompletion``.

    Parameters
    ----------
    cid : str
        The response id.
    model : str
        The served model's name.
    text : str
        The assistant's message.
    finish : str
        OpenAI finish reason (:func:`finish_reason`).
    use : dict
        :func:`usage`.
    logprobs : list of dict, optional
        :func:`logprob_content` per token, when asked for.

    Returns
    -------
    dict
        The ``chat.completion`` object with one choice.

    Raises
    ------
    None

    Examples
    --------
    >>> chat_completion("c", "m", "hi", "stop", usage(1, 1), None)["choices"][0]["message"]
    {'role': 'assistant', 'content': 'hi'}
    """
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": finish}
    return {**_envelope(cid, "chat.completion", model, None), "choices": [choice], "usage": use}


def chat_chunk(cid: str, model: str, created: int, delta: str, finish: str | None,
               logprobs: list[dict[str, Any]] | None = None, use: dict[str, int] | None = None,
               empty: bool = False) -> dict[str, Any]:
    """One ``ChatCompletionChunk`` of a streamed chat.

    Parameters
    ----------
    cid, model, created
        The stream's id, model name and creation time (the same on every chunk).
    delta : str
        The new text. Every delta carries ``role`` too, as TGI's schema requires.
    finish : str or None
        The finish reason, on the last content chunk only.
    logprobs : list of dict, optional
        This chunk's :func:`logprob_content` entries.
    use : dict, optional
        :func:`usage`, on the usage-only chunk.
    empty : bool
        The usage-only chunk (``stream_options.include_usage``) has no choices.

    Returns
    -------
    dict
        The ``chat.completion.chunk`` object.

    Raises
    ------
    None

    Examples
    --------
    >>> chat_chunk("c", "m", 0, "Hi", None)["choices"][0]["delta"]
    {'role': 'assistant', 'content': 'Hi'}
    """
    choices = [] if empty else [{"index": 0, "delta": {"role": "assistant", "content": delta},
                                 "logprobs": None if logprobs is None else {"content": logprobs},
                                 "finish_reason": finish}]
    return {**_envelope(cid, "chat.completion.chunk", model, created), "choices": choices, "usage": use}


def completion(cid: str, model: str, text: str, finish: str, use: dict[str, int]) -> dict[str, Any]:
    """A non-streamed ``CompletionFinal``.

    Parameters
    ----------
    cid, model
        The response id and model name.
    text : str
        The completion.
    finish : str
        OpenAI finish reason.
    use : dict
        :func:`usage`.

    Returns
    -------
    dict
        The ``text_completion`` object with one choice.

    Raises
    ------
    None

    Examples
    --------
    >>> completion("c", "m", "x", "length", usage(1, 1))["choices"][0]["text"]
    'x'
    """
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    return {**_envelope(cid, "text_completion", model, None), "choices": [choice], "usage": use}


def completion_chunk(cid: str, model: str, created: int, text: str, finish: str | None) -> dict[str, Any]:
    """One streamed completion ``Chunk``.

    Parameters
    ----------
    cid, model, created
        The stream's id, model name and creation time.
    text : str
        The new text.
    finish : str or None
        The finish reason on the last chunk; TGI's schema wants a string, so the
        chunks before it carry ``""``.

    Returns
    -------
    dict
        The ``text_completion`` chunk.

    Raises
    ------
    None

    Examples
    --------
    >>> completion_chunk("c", "m", 0, "x", None)["choices"][0]["finish_reason"]
    ''
    """
    choice = {"index": 0, "text": text, "finish_reason": finish or "", "logprobs": None}
    return {**_envelope(cid, "text_completion", model, created), "choices": [choice]}


def models(model: str, created: int) -> dict[str, Any]:
    """``/v1/models``: the one served model.

    TGI's ``ModelInfo`` for the model, which is also an OpenAI list (``data``), so both
    TGI's schema and ``openai``'s ``models.list()`` read it.

    Parameters
    ----------
    model : str
        The served model's name.
    created : int
        When the server started (Unix seconds).

    Returns
    -------
    dict
        ``{id, object: "list", created, owned_by, data: [model card]}``.

    Raises
    ------
    None

    Examples
    --------
    >>> [m["id"] for m in models("tiny:llama", 0)["data"]]
    ['tiny:llama']
    """
    card = {"id": model, "object": "model", "created": created, "owned_by": "kvdiv"}
    return {**card, "object": "list", "data": [card]}
