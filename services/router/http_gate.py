"""The HTTP server's outer layer and its error handlers, one framing for every route.

:class:`Gate` (plain ASGI, around every request) gives the request the server's
own id and echoes the client's ``X-Request-Id`` (at most ``MAX_REQUEST_ID_CHARS``),
reads the whole body before any handler and refuses it past :data:`MAX_BODY_BYTES`
(413, counted on the bytes read: a chunked body too), and checks API keys on
:data:`KEYED_PATHS` (401) and operator keys on :data:`OPERATOR_PATHS` and, with
``metrics_need_key``, ``/metrics`` (403 for another key); the caller
(``auth.Caller``) is ``request.state.caller``. The handlers give every error the body
``{"error": {"message", "type", "code"}}`` with the status of
``hybridpd.errors.http_status``; a failure on the server's side is told as
``errors.public_message`` (generic, naming the request id; the details go to
the log).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridpd.auth import ApiKeys, Caller
from hybridpd.errors import (
    AuthError,
    ForbiddenError,
    HybridPDError,
    http_status,
    public_message,
    public_type,
    retry_after_s,
)
from services.router.request_builder import MAX_REQUEST_ID_CHARS, new_request_id

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
#: paths that need an API key (when keys are configured)
KEYED_PATHS = ("/v1/", "/tokenize", "/detokenize")
#: paths only an operator key may call (``/metrics`` too with ``metrics_need_key``)
OPERATOR_PATHS = ("/v1/hybridpd/",)


def install(app: FastAPI, keys: ApiKeys, metrics_need_key: bool) -> None:
    """:class:`Gate` around ``app`` (checking ``keys``) and the error handlers."""
    app.add_middleware(Gate, keys=keys, metrics_need_key=metrics_need_key)
    app.add_exception_handler(RequestValidationError, on_validation)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, on_http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(HybridPDError, on_error)  # type: ignore[arg-type]


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error body every HTTP error has."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status, headers=headers)


class Gate:
    """Plain ASGI, around every HTTP request: ``X-Request-Id`` on every response, the
    body read whole before any handler and refused past :data:`MAX_BODY_BYTES` (413,
    counted on the bytes read: a chunked body too), API keys on ``KEYED_PATHS`` (401)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, metrics_need_key: bool) -> None:
        self.app, self.keys, self.metrics_need_key = app, keys, metrics_need_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        client = headers.get("x-request-id")
        if client is not None and len(client) > MAX_REQUEST_ID_CHARS:
            client = None  # not echoed: an id is no place for a payload
        local = scope.setdefault("state", {})
        local.update(request_id=new_request_id(), client_id=client, tenant=None, caller=Caller(None, False))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # the client's id (a handler may set it), or ours
                MutableHeaders(scope=message)["X-Request-Id"] = local["client_id"] or local["request_id"]
            await send(message)

        size = headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            await _too_large()(scope, receive, send_with_id)
            return
        body = await _read_body(receive)
        if body is None:  # the client went away while sending it
            return
        if len(body) > MAX_BODY_BYTES:
            await _too_large()(scope, receive, send_with_id)
            return
        path = scope["path"]
        operator_only = path.startswith(OPERATOR_PATHS) or (path == "/metrics" and self.metrics_need_key)
        try:
            if path.startswith(KEYED_PATHS) or operator_only:  # /health, /ready, /docs, /version stay open
                caller = self.keys.caller(headers.get("authorization"))
                if operator_only:
                    caller.need_operator(path)
                local.update(caller=caller, tenant=caller.tenant)
        except ForbiddenError as exc:
            await error_response(403, str(exc), "permission_error")(scope, receive, send_with_id)
            return
        except AuthError as exc:
            resp = error_response(401, str(exc), "authentication_error", {"WWW-Authenticate": "Bearer"})
            await resp(scope, receive, send_with_id)
            return
        await self.app(scope, _replay(body, receive), send_with_id)


def _too_large() -> JSONResponse:
    return error_response(413, "request body over %d bytes" % MAX_BODY_BYTES, "invalid_request_error")


async def _read_body(receive: Receive) -> bytes | None:
    """The request's body, read until its end or until it is past :data:`MAX_BODY_BYTES`
    (then what was read: the caller refuses it); None if the client disconnected."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the client's own messages
    (its disconnect: ``_until_disconnected``)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    msgs = ["%s: %s" % (".".join(str(p) for p in e.get("loc", ())[1:]) or "body", e.get("msg")) for e in exc.errors()]
    return error_response(400, "; ".join(msgs), "invalid_request_error")


async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # body parse errors, 404 routes, 405 methods: same error shape as everything else
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return error_response(exc.status_code, str(exc.detail), kind, dict(exc.headers or {}) or None)


async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    rid = getattr(request.state, "request_id", "?")
    logger.exception("request %s failed", rid)
    return error_response(500, "internal error (request %s)" % rid, "internal_error")


async def on_error(request: Request, exc: HybridPDError) -> JSONResponse:
    status = int(http_status(exc))
    wait = retry_after_s(exc)
    headers = {"Retry-After": "%d" % max(1, int(wait))} if wait is not None else None
    return error_response(status, public_message(exc, request.state.request_id), public_type(exc), headers)
