"""Attaching a router to its actors (``LocalStack.start_serving``): wait until each
is constructed (the first failure named at once), then check that each serves the
router's own model identity and hybridpd release."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from hybridpd.errors import StartupError

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


def wait_ready(handles: dict[str, ActorHandle[Any]], timeout_s: float, kill: bool) -> None:
    """Wait until every actor is constructed. The first one that fails (or the
    deadline) ends the wait at once with a StartupError naming the actor and its
    error; with ``kill`` (the actors are this router's own, not shared by router
    replicas) the actors are killed then (a Ray restart would only fail again)."""
    import ray

    pending: dict[ObjectRef[Any], str] = {h.ready.remote(): name for name, h in handles.items()}
    deadline = time.monotonic() + timeout_s
    error: StartupError | None = None
    while pending and error is None:
        left = deadline - time.monotonic()
        if left <= 0:
            error = StartupError("actors not ready within %.0fs: %s" % (timeout_s, ", ".join(sorted(pending.values()))))
            break
        done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
        for ref in done:
            name = pending.pop(ref)
            try:
                ray.get(ref)
            except Exception as exc:  # the actor's constructor raised, or its process died
                error = StartupError("actor %s failed to start: %s" % (name, startup_cause(exc)))
                break
    if error is None:
        return
    for h in handles.values() if kill else []:
        try:
            ray.kill(h, no_restart=True)
        except Exception:  # already gone
            logger.debug("kill failed", exc_info=True)
    raise error


def check_identity(handles: dict[str, ActorHandle[Any]], expected: str | None) -> str:
    """The model identity every actor serves; StartupError naming the first actor whose
    identity or release is not this router's (``expected``: the router's own
    identity of the model files; None: the first actor's)."""
    import ray

    import hybridpd

    idents: list[tuple[str, str]] = ray.get([h.identity.remote() for h in handles.values()])
    got = dict(zip(handles, idents, strict=True))
    want = expected or next(iter(got.values()))[0]
    for name, (identity, release) in got.items():
        if identity != want or release != hybridpd.__version__:
            raise StartupError(
                "actor %s serves model %s of hybridpd %s; this router serves %s of hybridpd %s: the actors and"
                " the router must run the same release with the same model files (same weights, config,"
                " tokenizer, dtype and block geometry)" % (name, identity, release, want, hybridpd.__version__)
            )
    return want


def startup_cause(exc: BaseException) -> str:
    """The actor's own error out of Ray's wrapper: its last line first (``Type: message``),
    then the traceback Ray carried over."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "%s\n%s" % (lines[-1].strip(), text) if lines else type(exc).__name__
