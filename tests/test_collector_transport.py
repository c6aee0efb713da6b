"""The one HTTP error table and NDJSON line reader of the collector (collector/transport.py),
shared by one-policy and multi-candidate requests."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from collector.errors import PermanentError, RetryableError
from collector.transport import RETRY_STATUS, Refused, map_errors, ndjson_lines, refusal


@pytest.mark.parametrize("status", sorted(RETRY_STATUS))
def test_overload_and_server_errors_are_retried_with_retry_after(status: int) -> None:
    err = refusal(status, b'{"error": "queue full"}', {"retry-after": "3"})
    assert type(err) is RetryableError and err.retry_after == 3.0 and str(err) == f"HTTP {status}: queue full"


def test_authentication_is_fatal_and_other_statuses_refuse_the_request() -> None:
    for status in (401, 403):
        err = refusal(status, b'{"error": "Unauthorized"}', {})
        assert type(err) is PermanentError and err.fatal and "check --api-key" in str(err)
    err = refusal(422, b'{"detail": "candidates[1]: unknown policy"}', {})
    assert isinstance(err, Refused) and isinstance(err, PermanentError) and not err.fatal and err.status == 422
    assert str(err) == "HTTP 422: candidates[1]: unknown policy"
    assert str(refusal(400, b"\xffnot json", {})) == "HTTP 400: \ufffdnot json"
    assert refusal(503, b"", {"retry-after": "soon"}).retry_after is None


def _mapped(exc: BaseException) -> RetryableError:
    with pytest.raises(RetryableError) as caught, map_errors("http://s", "--request-timeout 5 s"):
        raise exc
    return caught.value


def test_transport_failures_map_to_retryable_errors() -> None:
    request = httpx.Request("POST", "http://s/v1/traces")
    refused = _mapped(httpx.ConnectError("refused", request=request))
    assert refused.unreachable and not refused.sent and str(refused) == "ConnectError from http://s: refused"
    for exc in (httpx.ConnectTimeout("slow", request=request), httpx.ReadTimeout("silent", request=request)):
        err = _mapped(exc)
        assert err.unreachable and err.sent
    dropped = _mapped(httpx.RemoteProtocolError("peer closed connection", request=request))
    assert not dropped.unreachable and dropped.sent
    assert str(dropped) == "RemoteProtocolError from http://s: peer closed connection"
    silent = _mapped(httpx.ReadError("", request=request))   # httpx gives some errors no text
    assert str(silent) == "ReadError from http://s: connection lost"
    assert str(_mapped(TimeoutError())) == "no complete answer within --request-timeout 5 s from http://s"
    assert str(_mapped(OSError(28, "No space left on device"))) == "OSError: [Errno 28] No space left on device"


def test_the_collectors_own_errors_pass_through() -> None:
    for exc in (RetryableError("bad stream"), PermanentError("header"), Refused("HTTP 422: x", 422), KeyError("k")):
        with pytest.raises(type(exc)) as caught, map_errors("http://s", "-"):
            raise exc
        assert caught.value is exc


def _lines(chunks: list[bytes], line_bytes: int = 1 << 20) -> list[bytes]:
    async def body():
        for chunk in chunks:
            yield chunk

    async def read() -> list[bytes]:
        return [line async for line in ndjson_lines(body(), line_bytes)]

    return asyncio.run(read())


def test_lines_are_framed_across_chunks_and_a_partial_last_line_is_kept() -> None:
    assert _lines([b'{"a"', b':1}\n{"b":2}\n\n{"c"', b":3}"]) == [b'{"a":1}\n', b'{"b":2}\n', b"\n", b'{"c":3}']
    assert _lines([b'{"a":1}\n', b"  "]) == [b'{"a":1}\n']          # a blank tail is nothing
    assert _lines([b"x" * 10 + b"\n"], line_bytes=10) == [b"x" * 10 + b"\n"]
    with pytest.raises(RetryableError, match="a line longer than 10 bytes"):
        _lines([b"x" * 6, b"x" * 5], line_bytes=10)
