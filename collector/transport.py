"""What an HTTP exchange with a trace server can come to, and how its NDJSON is framed.

One table maps every way a ``POST /v1/traces`` can fail before its stream is read to
the collector's errors, in the manner of httpx's own ``map_exceptions``:
:func:`map_errors` (a context manager) for the exceptions, httpx's and the
request's own deadline, and :func:`refusal` for an answer that is not 200. Both the
one-policy and the multi-candidate request go through them, and through
:func:`ndjson_lines`, the one reader that cuts a response body into lines.

====================================  ==================================================
failure                               becomes
====================================  ==================================================
HTTP 408/409/425/429/500/502/503/504  :class:`RetryableError` (with ``Retry-After``)
HTTP 401/403                          fatal :class:`PermanentError` (every request would
                                      share it: check ``--api-key``)
any other HTTP status                 :class:`Refused` (a :class:`PermanentError`; a
                                      multi-candidate request is then resent policy by
                                      policy); with ``"permanent": true`` in its body
                                      (a press the server refuses on its model by
                                      design) ``designed``: the policy is refused for
                                      every document, never sent again in the run
``httpx.ConnectError``                retryable, server unreachable, request not sent
``httpx.ConnectTimeout``,             retryable, server unreachable
``httpx.ReadTimeout``
any other ``httpx.HTTPError``         retryable (reset, dropped mid-stream, undecodable)
``TimeoutError``                      retryable (the whole-request deadline,
                                      ``--request-timeout``)
``OSError``                           retryable (the journal's disk: full, removed)
====================================  ==================================================
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager

from collector.errors import PermanentError, RetryableError
from protocols.stream import STREAM_LIMITS

__all__ = ["AUTH_STATUS", "RETRY_STATUS", "Refused", "map_errors", "ndjson_lines", "refusal"]

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
AUTH_STATUS = frozenset({401, 403})


class Refused(PermanentError):
    """A request the server refused as a whole (a 4xx other than authentication).

    Attributes
    ----------
    status : int
        The HTTP status.
    designed : bool
        The server marked it ``permanent``: a press it refuses on its model by design
        (docs/presses-by-family.md), whatever the document.
    """

    def __init__(self, message: str, status: int, designed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.designed = designed


def _marked_permanent(body: bytes) -> bool:
    """Whether a JSON error body says ``"permanent": true``."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(obj, dict) and obj.get("permanent") is True


def error_message(status: int, body: bytes) -> str:
    """``HTTP <status>: <detail>``, the detail from a JSON ``error``/``detail`` or the body's start.

    Examples
    --------
    >>> error_message(422, b'{"error": "candidates[1]: unknown policy"}')
    'HTTP 422: candidates[1]: unknown policy'
    """
    try:
        obj = json.loads(body)
        detail = obj.get("error") or obj.get("detail") or obj
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        detail = body[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {detail}"


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The ``Retry-After`` header in seconds (None: absent or not a number)."""
    try:
        return float(headers.get("retry-after", ""))
    except ValueError:
        return None


def refusal(status: int, body: bytes, headers: Mapping[str, str]) -> RetryableError | PermanentError:
    """The error an answer other than 200 stands for (the module's table).

    Parameters
    ----------
    status : int
        The HTTP status (not 200).
    body : bytes
        The answer's body, for its error message.
    headers : mapping
        The answer's headers (``Retry-After``).

    Returns
    -------
    RetryableError or PermanentError
        To be raised: retryable for overload and server errors, fatal for
        authentication, :class:`Refused` otherwise.

    Examples
    --------
    >>> type(refusal(503, b"busy", {"retry-after": "2"})).__name__, refusal(503, b"", {"retry-after": "2"}).retry_after
    ('RetryableError', 2.0)
    >>> refusal(401, b'{"error": "bad token"}', {}).fatal
    True
    >>> refusal(422, b'{"detail": "replicates"}', {})
    Refused('HTTP 422: replicates')
    >>> refusal(422, b'{"error": "candidate: refused", "permanent": true}', {}).designed
    True
    """
    message = error_message(status, body)
    if status in RETRY_STATUS:
        return RetryableError(message, retry_after(headers))
    if status in AUTH_STATUS:
        return PermanentError(f"{message} (check --api-key)", fatal=True)
    return Refused(message, status, designed=_marked_permanent(body))


@contextmanager
def map_errors(server: str, timeout: str) -> Iterator[None]:
    """Turn a failed exchange with ``server`` into a :class:`RetryableError` (the module's table).

    Parameters
    ----------
    server : str
        The server's URL, named in the messages.
    timeout : str
        What the request's own deadline was, for the message when it passes
        (a ``TimeoutError``).

    Raises
    ------
    RetryableError
        For httpx's errors, the deadline and ``OSError``; the collector's own errors
        (a refusal, a bad stream) pass through unchanged.

    Examples
    --------
    >>> try:
    ...     with map_errors("http://x", "--request-timeout 1 s"):
    ...         raise TimeoutError
    ... except RetryableError as exc:
    ...     print(exc)
    no complete answer within --request-timeout 1 s from http://x
    """
    import httpx

    try:
        yield
    except TimeoutError:   # before OSError, its base: the whole-request deadline passed
        raise RetryableError(f"no complete answer within {timeout} from {server}") from None
    except httpx.HTTPError as exc:  # refused, reset, dropped mid-stream, timed out, undecodable body
        # A refused connection never reached the server; a silent one may be down: both take the
        # server out of rotation for a while. (str(exc), not exc: an exception is always truthy.)
        unreachable = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout))
        raise RetryableError(f"{type(exc).__name__} from {server}: {str(exc) or 'connection lost'}",
                             unreachable=unreachable, sent=not isinstance(exc, httpx.ConnectError)) from None
    except OSError as exc:  # the journal's disk (full, removed): worth another attempt
        raise RetryableError(f"{type(exc).__name__}: {exc}") from None


async def ndjson_lines(chunks: AsyncIterable[bytes], line_bytes: int = STREAM_LIMITS.line_bytes,
                       ) -> AsyncIterator[bytes]:
    """The lines of an NDJSON body, as they arrive.

    Parameters
    ----------
    chunks : async iterable of bytes
        The body (``response.aiter_bytes()``), cut anywhere.
    line_bytes : int
        The longest line allowed (``protocols.stream.STREAM_LIMITS.line_bytes``).

    Yields
    ------
    bytes
        Each line with its ``\\n`` (blank lines included), then a last line without
        one if the body ends in a partial line that is not blank: it is kept, so that
        the stream's reader sees the truncation.

    Raises
    ------
    RetryableError
        A line (so far) longer than ``line_bytes``.

    Examples
    --------
    >>> import asyncio
    >>> async def body():
    ...     for chunk in (b'{"a":', b'1}\\n\\n{"b"', b':2}'):
    ...         yield chunk
    >>> async def lines():
    ...     return [line async for line in ndjson_lines(body())]
    >>> asyncio.run(lines())
    [b'{"a":1}\\n', b'\\n', b'{"b":2}']
    """
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            yield raw + b"\n"
        if len(buffer) > line_bytes:
            raise RetryableError(f"a line longer than {line_bytes} bytes")
    if buffer.strip():
        yield buffer
