"""Reading a request body safely: size, time, nesting depth and number size are
bounded *before* the JSON parser runs, and text that cannot be encoded is refused.

Python's ``json`` recurses once per nesting level (100k levels raise RecursionError)
and refuses integers over 4,300 digits with a ValueError; a lone surrogate such as
``"\\ud800"`` parses into a ``str`` that the tokenizer then cannot encode. Each of
those would otherwise reach a handler as an internal error.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import numpy as np
from starlette.requests import Request

from gen_service.errors import ApiError, invalid
from gen_service.serving.limits import BodyLimits

__all__ = ["read_body", "parse_json"]

# JSON strings (with escapes), removed before the bracket count: brackets inside
# strings do not nest. The unrolled form runs [^"\\]* as one tight loop: 2 ms on a
# 1 MB string, where the alternation (?:[^"\\]|\\.)* took 270 ms holding the loop.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NUMBER_DIGITS = 40  # a JSON number longer than this is not a parameter anyone means


async def read_body(request: Request, limits: BodyLimits) -> bytes:
    """The raw body of a request, within the size and time limits.

    A client that sends headers and then trickles (or never sends) the body is cut
    off after ``limits.timeout_s``, so it cannot hold a connection indefinitely.

    Parameters
    ----------
    request : Request
        The Starlette request.
    limits : BodyLimits
        Size and time limits.

    Returns
    -------
    bytes

    Raises
    ------
    ApiError
        422 when the body is too large (by its Content-Length or as it arrives),
        408 when it does not arrive in time.

    Examples
    --------
    >>> body = await read_body(request, BodyLimits(max_bytes=1 << 20))  # doctest: +SKIP
    """
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limits.max_bytes:
        raise invalid("body", f"request body over {limits.max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_bytes:
                raise invalid("body", f"request body over {limits.max_bytes} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), limits.timeout_s)
    except TimeoutError:
        raise ApiError(408, f"body: not received within {limits.timeout_s:g} s", "validation") from None
    return b"".join(chunks)


def _depth(body: bytes) -> int:
    """Deepest bracket nesting of a JSON text, strings excluded (vectorised: a 1 MB
    body costs a few milliseconds, and nothing recursive runs on hostile input)."""
    if b"[" not in body and b"{" not in body:
        return 0
    arr = np.frombuffer(_STRING.sub(b'""', body), dtype=np.uint8)
    step = (arr == ord("[")).astype(np.int32) + (arr == ord("{"))
    step -= (arr == ord("]")).astype(np.int32) + (arr == ord("}"))
    return int(np.cumsum(step).max(initial=0))


def _number(text: str) -> float | int:
    if len(text) > _NUMBER_DIGITS:
        raise ValueError(f"number with {len(text)} characters")
    value = int(text) if text.lstrip("-").isdigit() else float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} overflows a double")
    return value


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _find_unencodable(obj: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, if any."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        for key, value in obj.items():
            found = _find_unencodable(key, path) or _find_unencodable(value, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            found = _find_unencodable(value, f"{path}[{i}]")
            if found:
                return found
    return None


def parse_json(body: bytes, limits: BodyLimits) -> dict[str, Any]:
    """Parse a request body into a JSON object within the limits.

    Parameters
    ----------
    body : bytes
        The raw body.
    limits : BodyLimits
        ``max_depth`` bounds the nesting, checked before parsing.

    Returns
    -------
    dict

    Raises
    ------
    ApiError
        422 naming ``body`` (too deep, malformed, a number too long or not finite,
        not an object) or the path of a string holding a lone surrogate.

    Examples
    --------
    >>> parse_json(b'{"inputs": "hi"}', BodyLimits())
    {'inputs': 'hi'}
    """
    if _depth(body) > limits.max_depth:
        raise invalid("body", f"JSON nested deeper than {limits.max_depth} levels")
    try:
        data = json.loads(body, parse_int=_number, parse_float=_number, parse_constant=_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid("body", f"malformed JSON ({exc})") from None
    if not isinstance(data, dict):
        raise invalid("body", "expected a JSON object")
    bad = _find_unencodable(data, "")
    if bad:
        raise invalid(bad, "text with a lone surrogate (not encodable as UTF-8)")
    return data
