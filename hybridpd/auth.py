"""Optional API keys (``Authorization: Bearer <key>``) and tenant isolation.

Each configured key is a tenant. A tenant's requests hash their prompts with a
salt derived from the key (plus the client's own ``cache_salt``), so no tenant
can hit, or probe by timing, another tenant's cached prefixes, whatever salt it
sends. Without configured keys, auth is off and the client's salt is used as is.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from hybridpd.errors import AuthError


def tenant_id(key: str) -> str:
    """A stable, non-reversible name for a key (safe in logs and hashes)."""
    return hashlib.sha256(("hybridpd-tenant:" + key).encode()).hexdigest()[:16]


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._tenants = {k: tenant_id(k) for k in keys if k}

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant(self, authorization: str | None) -> str | None:
        """The caller's tenant; None when auth is off. Raises AuthError."""
        if not self.enabled:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise AuthError("missing API key: send Authorization: Bearer <key>")
        for key, tenant in self._tenants.items():
            if hmac.compare_digest(key.encode(), token.strip().encode()):
                return tenant
        raise AuthError("invalid API key")

    @staticmethod
    def salt(tenant: str | None, client_salt: str | None) -> str | None:
        """The cache salt a request hashes with."""
        if tenant is None:
            return client_salt
        return "tenant:%s|%s" % (tenant, client_salt or "")
