"""Typed errors, and the one place that maps them to HTTP and gRPC status.

Expected "no space" conditions return ``None``; misuse and failures raise a
subclass of :class:`HybridPDError`. Servers take statuses from
:func:`http_status` / :func:`grpc_code` and what a client is told from
:func:`public_message` (a failure on the server's side: a generic message and
the request id, its details only in the log); only the HTTP server's own framing
(body size, body validation, unexpected exceptions, and the 401 of its API-key
middleware) is answered in ``services/router/http_gate.py``.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

import grpc

logger = logging.getLogger(__name__)


class HybridPDError(Exception):
    """Base of every error hybridpd raises on purpose."""


class ConfigError(HybridPDError, ValueError):
    """A configuration value is missing, malformed or out of range.

    ``field`` names the offending setting; the message states the allowed
    range or values.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__("config field %r: %s" % (field, message))
        self.field = field


class InvalidRequestError(HybridPDError, ValueError):
    """The client sent something we will not serve (bad prompt, limits)."""


class OverloadedError(HybridPDError):
    """Queues are full; the client should retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotFoundError(HybridPDError, KeyError):
    """A named object (model, request id) does not exist."""


class UnavailableError(HybridPDError):
    """A dependency (Redis, store, actor) cannot be reached right now."""


class DrainingError(UnavailableError):
    """The router is shutting down (SIGTERM): it admits nothing new, while what it
    admitted finishes. Another replica serves a retry after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineError(UnavailableError):
    """An engine failed while serving a request with an error of its own (an
    assertion in a kernel, say). The request may succeed on another instance; the
    message names the instance and the engine's error, for the log: a client is
    told only that the engine failed (:func:`public_message`)."""


class AuthError(HybridPDError):
    """Missing or invalid credentials."""


class ForbiddenError(AuthError):
    """Valid credentials that may not do this (a client key on the operator surface)."""


class DeadlineError(HybridPDError):
    """The request did not finish within its deadline."""


class StartupError(HybridPDError):
    """A part of the stack (an actor) failed to start; the message carries its error."""


class IntegrityError(HybridPDError):
    """Bytes failed verification (checksum or header mismatch); never use them."""


_HTTP: list[tuple[type[BaseException], HTTPStatus]] = [
    (ConfigError, HTTPStatus.INTERNAL_SERVER_ERROR),
    (InvalidRequestError, HTTPStatus.BAD_REQUEST),
    (OverloadedError, HTTPStatus.TOO_MANY_REQUESTS),
    (NotFoundError, HTTPStatus.NOT_FOUND),
    (UnavailableError, HTTPStatus.SERVICE_UNAVAILABLE),
    (IntegrityError, HTTPStatus.INTERNAL_SERVER_ERROR),
    (DeadlineError, HTTPStatus.GATEWAY_TIMEOUT),
    (ForbiddenError, HTTPStatus.FORBIDDEN),
    (AuthError, HTTPStatus.UNAUTHORIZED),
]

_GRPC: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ConfigError, grpc.StatusCode.INTERNAL),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (OverloadedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (IntegrityError, grpc.StatusCode.DATA_LOSS),
    (DeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ForbiddenError, grpc.StatusCode.PERMISSION_DENIED),
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
]


def unwrap(exc: BaseException) -> BaseException:
    """The error itself: for one an actor raised, the actor's exception rather than
    Ray's wrapper (whose message is a remote traceback)."""
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError carries the actor's exception
    if isinstance(cause, BaseException) and cause is not exc:
        return unwrap(cause)
    return exc


def describe(exc: BaseException) -> str:
    """The message of ``exc`` (see :func:`unwrap`): for the log, and for a client
    only through :func:`public_message`."""
    return str(unwrap(exc))


#: what a client is told of a failure on the server's side, by its kind (first match)
_PUBLIC: list[tuple[type[BaseException], str]] = [
    (EngineError, "an engine failed while serving the request"),
    (UnavailableError, "no instance could serve the request now; retry later"),
    (IntegrityError, "a transfer failed verification"),
]


def server_side(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure of the server (a 5xx other than a deadline or a
    drain), whose details are the log's, not the client's."""
    return int(http_status(exc)) >= 500 and not isinstance(unwrap(exc), (DeadlineError, DrainingError))


def public_message(exc: BaseException, request_id: str) -> str:
    """What a client is told of ``exc``: the message of an error it can act on (a
    4xx, a deadline); for a failure on the server's side (:func:`server_side`: an
    engine's exception, an actor's, Ray's, the store's) a generic message naming
    ``request_id``, under which it logs the details here (a warning)."""
    if not server_side(exc):
        return describe(exc)
    err = unwrap(exc)
    logger.warning("request %s failed: %s: %s", request_id, type(err).__name__, describe(exc))
    what = next((text for cls, text in _PUBLIC if isinstance(err, cls)), "internal error")
    return "%s (request %s)" % (what, request_id)


def public_type(exc: BaseException) -> str:
    """The ``type`` of an error body: the class of one of ours, else ``internal_error``."""
    err = unwrap(exc)
    return type(err).__name__ if isinstance(err, HybridPDError) else "internal_error"


def retry_after_s(exc: BaseException) -> float | None:
    """How long a client should wait before it retries ``exc`` (429, 503 when
    draining); None: no ``Retry-After``."""
    return getattr(unwrap(exc), "retry_after_s", None)


def http_status(exc: BaseException) -> HTTPStatus:
    """HTTP status for ``exc``; unknown exceptions are 500."""
    for cls, status in _HTTP:
        if isinstance(exc, cls):
            return status
    return HTTPStatus.INTERNAL_SERVER_ERROR


def grpc_code(exc: BaseException) -> grpc.StatusCode:
    """gRPC status code for ``exc``; unknown exceptions are INTERNAL."""
    for cls, code in _GRPC:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL
