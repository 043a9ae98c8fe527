"""API keys: who is calling (401) and whether they may use this model (403).

Keys are never stored: the keys file holds SHA-256 digests, and a presented key is
hashed and looked up. Nothing here keeps, logs or prints the presented key — errors say
what was wrong with the header, never what it contained.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from kvserve.gateway.keys import KeyLimits, KeysFile, Priority, hash_key
from kvserve.names import WILDCARD

MAX_MODEL_IN_MESSAGE = 200  # the model name comes from the client: don't echo a novel


@dataclass(frozen=True)
class Tenant:
    """Who a key belongs to: rate limits and priority are per tenant, shared by its keys."""

    name: str
    priority: Priority
    limits: KeyLimits
    models: frozenset[str]  # {"*"} allows every model
    share_prefix_cache: bool | str = False  # see kvserve.gateway.tenancy

    def allows(self, model: str) -> bool:
        return WILDCARD in self.models or model in self.models


class AuthError(Exception):
    """A request the gateway must refuse: 401 (who are you?) or 403 (not for you).

    ``reason`` is the rejection metric label; ``headers`` go on the response
    (``WWW-Authenticate`` on 401, as RFC 6750 asks).
    """

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code

    @property
    def reason(self) -> str:
        return "unauthenticated" if self.status == 401 else "forbidden"

    @property
    def headers(self) -> dict[str, str]:
        return {"www-authenticate": 'Bearer realm="kvserve"'} if self.status == 401 else {}

    def __repr__(self) -> str:
        return f"AuthError(status={self.status}, code={self.code!r}, message={self.message!r})"


def _missing() -> AuthError:
    return AuthError(
        401,
        "missing API key: send it as 'Authorization: Bearer <key>'",
        "missing_api_key",
    )


def _malformed() -> AuthError:
    return AuthError(
        401,
        "malformed Authorization header: expected 'Authorization: Bearer <key>'",
        "invalid_api_key",
    )


def _unknown() -> AuthError:
    return AuthError(401, "invalid API key", "invalid_api_key")


def bearer_token(authorization_header: str | None) -> str:
    """The key from ``Bearer <key>`` (scheme case-insensitive, as HTTP auth schemes are)."""
    if authorization_header is None or not authorization_header.strip():
        raise _missing()
    parts = authorization_header.strip().split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise _malformed()
    return parts[1]


def tenants_of(keys: KeysFile) -> dict[str, Tenant]:
    """Digest → tenant; keys of one tenant share one ``Tenant`` (the keys file checks they
    agree on models, priority and limits)."""
    tenants: dict[str, Tenant] = {}
    by_digest: dict[str, Tenant] = {}
    for entry in keys.keys:
        tenant = tenants.get(entry.tenant)
        if tenant is None:
            tenant = Tenant(
                entry.tenant,
                entry.priority,
                entry.limits,
                frozenset(entry.models),
                entry.share_prefix_cache,
            )
            tenants[entry.tenant] = tenant
        by_digest[entry.sha256] = tenant
    return by_digest


class KeyStore:
    """Authenticates ``Authorization`` headers against the digests of a keys file.

    Lookup is a dict keyed by digest rather than a ``compare_digest`` scan over every
    stored digest. The dict's timing depends only on SHA-256 of the caller's own input;
    learning how many leading bytes of that hash match a stored digest gives no way to
    construct a key (that would need a SHA-256 preimage), so it leaks nothing usable while
    staying O(1) however many keys there are. The final check is still
    ``hmac.compare_digest`` against the stored digest (defence in depth).

    Used from the gateway's one asyncio loop: ``replace`` swaps the table in one
    assignment, so no lock is needed.
    """

    def __init__(self, keys: KeysFile) -> None:
        self._by_digest: dict[str, tuple[str, Tenant]] = {}
        self.replace(keys)

    def replace(self, keys: KeysFile) -> None:
        """Hot reload: the new keys apply to the next request; admitted requests keep the
        ``Tenant`` they were authenticated as."""
        self._by_digest = {d: (d, t) for d, t in tenants_of(keys).items()}

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """Every distinct tenant, e.g. for ``RateLimiter.update`` after a reload."""
        unique = {t.name: t for _, t in self._by_digest.values()}
        return tuple(unique.values())

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        names = ", ".join(sorted(t.name for t in self.tenants))
        return f"KeyStore({len(self)} keys; tenants: {names})"

    def authenticate(self, authorization_header: str | None) -> Tenant:
        """The tenant whose key is in the header, or ``AuthError`` 401."""
        digest = hash_key(bearer_token(authorization_header))
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            raise _unknown()
        return found[1]

    def authorize(self, tenant: Tenant, model: str) -> None:
        """``AuthError`` 403 unless the tenant's keys may use ``model``."""
        if not tenant.allows(model):
            shown = model[:MAX_MODEL_IN_MESSAGE] + (
                "…" if len(model) > MAX_MODEL_IN_MESSAGE else ""
            )
            raise AuthError(
                403,
                f"tenant {tenant.name!r} may not use model {shown!r}",
                "model_not_allowed",
            )
