"""API keys (``Authorization: Bearer <key>``), operator keys, tenant isolation.

Each key is a tenant. A tenant's requests hash their prompts with a salt derived
from the key (plus the client's own ``cache_salt``), so no tenant can hit, or
probe by timing, another tenant's cached prefixes, whatever salt it sends.

Keys come from the config (``api_keys``, ``operator_api_keys``) and from files
(``api_keys_file``, ``operator_api_keys_file``: one key per line, ``#``
comments), which are read again when they change (checked at most every
``RELOAD_CHECK_S``): rotating a mounted Secret needs no restart. A file that
cannot be read keeps the keys it last gave (logged); a configured file that
holds no key lets no one in with it (auth stays on).

Who a caller is (:class:`Caller`):
- with client keys configured (``api_keys`` or ``api_keys_file``), a request
  without one of them (or an operator key) is refused (401);
- without client keys the API is open (the config allows that on loopback, or
  with ``allow_anonymous``): a caller with no matching key is anonymous, and an
  operator only on an open loopback stack that has no operator keys (the
  machine's own users);
- an operator key is a tenant too, and the only key the operator surface
  (``/v1/hybridpd/*``, the ``hybridpd_*`` usage details, ``/metrics`` with
  ``metrics_need_key``) answers to.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridpd.errors import AuthError, ForbiddenError

if TYPE_CHECKING:
    from hybridpd.config import HybridPDConfig

logger = logging.getLogger(__name__)

#: how often a keys file is checked for a change (on the requests that need it)
RELOAD_CHECK_S = 1.0


def tenant_id(key: str) -> str:
    """A stable, non-reversible name for a key (safe in logs and hashes)."""
    return hashlib.sha256(("hybridpd-tenant:" + key).encode()).hexdigest()[:16]


def read_keys(path: str) -> list[str]:
    """The keys of a keys file: one per line; blank lines and ``#`` comments skipped."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: its tenant (None: anonymous, or auth off) and whether it
    may use the operator surface."""

    tenant: str | None
    operator: bool

    def need_operator(self, what: str) -> None:
        """Raise ForbiddenError (403) unless this caller is an operator."""
        if not self.operator:
            raise ForbiddenError("%s needs an operator key" % what)


class KeysFile:
    """The keys of one file, read again when its (inode, size, mtime) changes."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self._clock = path, clock
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self.keys: frozenset[str] = frozenset()
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> frozenset[str]:
        """The file's keys, read again if it changed since (at most every RELOAD_CHECK_S)."""
        now = self._clock()
        if not force and now - self._checked < RELOAD_CHECK_S:
            return self.keys
        with self._lock:
            self._checked = now
            try:
                st = os.stat(self.path)
                seen = (st.st_ino, st.st_size, st.st_mtime_ns)
                if seen != self._seen:
                    self.keys = frozenset(read_keys(self.path))
                    self._seen = seen
                    logger.info("keys file %s: %d keys", self.path, len(self.keys))
                    if not self.keys:
                        logger.warning("keys file %s holds no key: no one gets in with it", self.path)
            except OSError as exc:  # a Secret being swapped, say: keep the last keys
                logger.warning("keys file %s not read (%s): its last %d keys stay", self.path, exc, len(self.keys))
        return self.keys


class KeySet:
    """Keys from the config and, optionally, from a file (read again on change)."""

    def __init__(self, keys: Sequence[str], path: str | None, clock: Callable[[], float]) -> None:
        self.static = frozenset(k for k in keys if k)
        self.file = KeysFile(path, clock) if path else None

    @property
    def configured(self) -> bool:
        """Whether any key or a keys file is configured (an empty file counts: closed)."""
        return bool(self.static) or self.file is not None

    def match(self, token: str) -> str | None:
        """The key ``token`` is, compared in constant time per key; None if none."""
        keys = self.static | (self.file.refresh() if self.file is not None else frozenset())
        found = None
        for key in keys:
            if hmac.compare_digest(key.encode(), token.encode()):
                found = key
        return found


class ApiKeys:
    def __init__(
        self,
        keys: Sequence[str] = (),
        keys_file: str | None = None,
        operator_keys: Sequence[str] = (),
        operator_keys_file: str | None = None,
        open_is_operator: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clients = KeySet(keys, keys_file, clock)
        self.operators = KeySet(operator_keys, operator_keys_file, clock)
        #: an anonymous caller of an open API is an operator (an open loopback stack)
        self._open_operator = open_is_operator and not self.operators.configured

    @classmethod
    def from_config(cls, cfg: HybridPDConfig) -> ApiKeys:
        from hybridpd.config import is_loopback

        return cls(
            cfg.api_keys,
            cfg.api_keys_file,
            cfg.operator_api_keys,
            cfg.operator_api_keys_file,
            open_is_operator=is_loopback(cfg.host),
        )

    @property
    def enabled(self) -> bool:
        """Whether a request needs a key (client keys are configured)."""
        return self.clients.configured

    def caller(self, authorization: str | None) -> Caller:
        """Who sends ``authorization`` (the header's value). Raises AuthError (401)
        where keys are needed and it carries none that is known."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if token:
            key = self.operators.match(token)
            if key is not None:
                return Caller(tenant_id(key), True)
            key = self.clients.match(token)
            if key is not None:
                return Caller(tenant_id(key), False)
        if not self.enabled:
            return Caller(None, self._open_operator)  # an open API: a key no one configured is no one's
        if not token:
            raise AuthError("missing API key: send Authorization: Bearer <key>")
        raise AuthError("invalid API key")

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant (:meth:`caller`); None when anonymous."""
        return self.caller(authorization).tenant

    @staticmethod
    def salt(tenant: str | None, client_salt: str | None) -> str | None:
        """The cache salt a request hashes with."""
        if tenant is None:
            return client_salt
        return "tenant:%s|%s" % (tenant, client_salt or "")


def sees_cache_details(policy: str, caller: Caller) -> bool:
    """Whether ``caller`` is shown the ``hybridpd_*`` usage details (why prompt tokens
    hit or not) under the config's ``cache_details`` ``policy``."""
    return policy == "everyone" or (policy == "operator" and caller.operator)
