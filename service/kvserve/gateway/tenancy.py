"""Per-tenant prefix-cache isolation: the ``cache_salt`` the gateway puts on each request.

An engine reuses cached prompt blocks only between requests with the same salt. Without
salts, a tenant could time its first token to learn whether another tenant recently sent
the same prefix (a published timing side channel of shared prefix caches). So every
request through the gateway is salted by its tenant, by default:

- the salt is an HMAC of the tenant's name under a per-deployment secret, so it can be
  neither guessed nor derived from a key, and it never contains the key;
- tenants that set ``share_prefix_cache`` in the keys file share a namespace instead:
  ``true`` joins the deployment's one shared namespace, a name joins that named group;
- a ``cache_salt`` the client sends is mixed in, so it can narrow sharing within its
  tenant, never widen it across tenants.

The secret comes from ``$KVSERVE_CACHE_SALT_SECRET`` (the Helm chart sets it from a
generated Secret). Without it each gateway process draws its own, so gateway replicas
would then each keep their own cache namespaces: isolation holds, sharing across gateway
replicas is lost.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping

from kvserve.gateway.auth import Tenant

log = logging.getLogger("kvserve.gateway")

CACHE_SALT_SECRET_ENV = "KVSERVE_CACHE_SALT_SECRET"
MIN_SECRET_BYTES = 16


class CacheSalts:
    """Salts from one secret: ``salt(tenant, client_salt)``."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cache-salt secret must be at least {MIN_SECRET_BYTES} bytes "
                f"(got {len(secret)}); generate one with: openssl rand -base64 32"
            )
        self._secret = secret
        self._by_namespace: dict[str, str] = {}  # the salts without a client's, made once

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CacheSalts:
        value = environ.get(CACHE_SALT_SECRET_ENV)
        if value:
            return cls(value.encode())
        log.warning(
            "%s is not set: this gateway process salts tenants' prefix caches with a "
            "random secret of its own, so other gateway replicas will not share its "
            "cache entries",
            CACHE_SALT_SECRET_ENV,
        )
        return cls(secrets.token_bytes(32))

    def salt(self, tenant: Tenant, client_salt: str | None = None) -> str:
        """The request's ``cache_salt``: the tenant's namespace (and the client's salt)."""
        share = tenant.share_prefix_cache
        if share is True:
            namespace = "shared"
        elif isinstance(share, str):
            namespace = f"group:{share}"
        else:
            namespace = f"tenant:{tenant.name}"
        if client_salt is not None:
            return self._hmac(f"{namespace}\0{client_salt}")
        salt = self._by_namespace.get(namespace)
        if salt is None:  # one per tenant or group: bounded by the keys file
            salt = self._by_namespace[namespace] = self._hmac(namespace)
        return salt

    def _hmac(self, message: str) -> str:
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()
