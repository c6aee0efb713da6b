"""The HTTP service: TGI's API and its OpenAI-compatible Messages API (so TGI's and
OpenAI's clients work unchanged) plus ``/v1/traces``.

Routes: ``POST /generate``, ``POST /generate_stream`` (SSE), ``POST /`` (TGI's compat
route), ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /chat_tokenize``, ``GET /info``, ``GET /health``,
``GET /metrics`` (Prometheus), ``POST /v1/traces`` (NDJSON, or SSE with
``Accept: text/event-stream``) and ``GET /v1/policies``.

This module only wires things together: :mod:`gen_service.api.handlers` holds the
handlers, :mod:`gen_service.api.records` the typed request layer,
:mod:`gen_service.serving.service` the shared state, and the two ``wire_*`` modules the
response formats. Around every handler, :func:`guarded` checks the bearer token
(constant-time) and turns errors into TGI error bodies; internal exception text
never reaches a client.
"""

from __future__ import annotations

import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gen_service.api import tgi_wire
from gen_service.api.handlers import ROUTES, SSE, Handler
from gen_service.errors import ApiError
from gen_service.serving.service import Service

__all__ = ["create_app", "error_response"]

log = logging.getLogger("kvdiv.service")

# TGI's streaming route answers errors as an event stream (its OpenAPI document).
_SSE_ERROR_ROUTES = frozenset({"/generate_stream"})


def error_response(exc: ApiError, sse: bool = False) -> Response:
    """TGI's error body for an :class:`ApiError`.

    Parameters
    ----------
    exc : ApiError
        The error (status, message, type, extra headers such as ``Retry-After``).
    sse : bool
        Send it as one SSE event (``data:{...}``), as TGI's streaming route does.

    Returns
    -------
    Response
        JSON (or ``text/event-stream``) with ``exc.status``.

    Raises
    ------
    None

    Examples
    --------
    >>> error_response(ApiError(429, "full", "overloaded", {"Retry-After": "1"})).headers["retry-after"]
    '1'
    """
    if sse:
        return Response(tgi_wire.sse(exc.body()), status_code=exc.status, media_type=SSE, headers=exc.headers)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    # compare_digest: the time taken does not reveal how much of the key matched
    return hmac.compare_digest(header.encode("utf-8", "replace"), f"Bearer {key}".encode())


def guarded(path: str, handler: Handler, auth: bool) -> Handler:
    """Authentication and error mapping around one handler."""

    async def run(request: Request) -> Response:
        svc: Service = request.app.state.service
        try:
            if auth and svc.config.api_key is not None and not _authorized(request, svc.config.api_key):
                raise ApiError(401, "missing or wrong bearer token", "authentication")
            return await handler(request)
        except ApiError as exc:
            return error_response(exc, sse=path in _SSE_ERROR_ROUTES)
        except Exception:  # a bug: log it, answer without internals, keep serving
            log.exception("%s failed", path)
            return error_response(ApiError(500, "internal error; see the server log", "internal"))

    return run


class CountResponses:
    """ASGI middleware: count every response by route and status, unknown paths and
    405s included, and time it."""

    def __init__(self, app: ASGIApp, service: Service, paths: frozenset[str]):
        self.app, self.service, self.paths = app, service, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.paths else "other"
        t0, status = time.perf_counter(), [500]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            m = self.service.metrics
            m.requests.labels(route, str(status[0])).inc()
            m.duration.labels(route).observe(time.perf_counter() - t0)


def create_app(service: Service) -> Starlette:
    """The Starlette app over ``service`` (the engine, limits and state).

    Parameters
    ----------
    service : Service
        Built by :func:`gen_service.api.cli.build_service` or directly.

    Returns
    -------
    Starlette
        An ASGI app; ``app.state.service`` is ``service``.

    Raises
    ------
    None

    Examples
    --------
    >>> from gen_service.api.cli import build_service  # doctest: +SKIP
    >>> app, service = build_service("tiny:llama")        # doctest: +SKIP
    """
    routes = [Route(path, guarded(path, handler, auth), methods=[method]) for path, method, handler, auth in ROUTES]
    app = Starlette(routes=routes)
    app.state.service = service
    app.add_middleware(CountResponses, service=service, paths=frozenset(path for path, *_ in ROUTES))
    return app
