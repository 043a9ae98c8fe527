"""API-key authentication (401) and model authorization (403); keys never leak."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.gateway.auth import AuthError, KeyStore, Tenant, bearer_token
from kvserve.gateway.keys import KeyEntry, KeyLimits, KeysFile, new_key

KEY_A, DIGEST_A = new_key()
KEY_A2, DIGEST_A2 = new_key()
KEY_B, DIGEST_B = new_key()


def entry(tenant: str, digest: str, models: list[str], **extra: object) -> KeyEntry:
    return KeyEntry.model_validate({"tenant": tenant, "sha256": digest, "models": models, **extra})


def keys(*entries: KeyEntry) -> KeysFile:
    return KeysFile(keys=list(entries))


LIMITS = {"requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 2}


@pytest.fixture
def store() -> KeyStore:
    return KeyStore(
        keys(
            entry("team-a", DIGEST_A, ["*"], priority="critical", limits=LIMITS),
            entry("team-a", DIGEST_A2, ["*"], priority="critical", limits=LIMITS),
            entry("batch", DIGEST_B, ["tiny", "small"], priority="sheddable"),
        )
    )


def test_authenticates_a_bearer_key(store: KeyStore) -> None:
    tenant = store.authenticate(f"Bearer {KEY_A}")
    assert tenant == Tenant("team-a", "critical", KeyLimits(**LIMITS), frozenset({"*"}))
    assert store.authenticate(f"bearer   {KEY_B} ").name == "batch"


def test_keys_of_one_tenant_share_one_tenant(store: KeyStore) -> None:
    assert store.authenticate(f"Bearer {KEY_A}") is store.authenticate(f"Bearer {KEY_A2}")
    assert sorted(t.name for t in store.tenants) == ["batch", "team-a"]
    assert len(store) == 3


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (None, "missing_api_key"),
        ("", "missing_api_key"),
        ("   ", "missing_api_key"),
        ("Bearer", "invalid_api_key"),
        ("Basic dXNlcjpwYXNz", "invalid_api_key"),
        ("Bearer a b", "invalid_api_key"),
        ("Bearer sk-kvs-not-a-real-key", "invalid_api_key"),
        pytest.param("Bearer " + DIGEST_A, "invalid_api_key", id="the-key-digest"),  # not the key
    ],
)
def test_missing_or_invalid_key_is_401(store: KeyStore, header: str | None, code: str) -> None:
    with pytest.raises(AuthError) as info:
        store.authenticate(header)
    error = info.value
    assert (error.status, error.code, error.reason) == (401, code, "unauthenticated")
    assert error.headers == {"www-authenticate": 'Bearer realm="kvserve"'}


def test_model_not_allowed_is_403(store: KeyStore) -> None:
    batch = store.authenticate(f"Bearer {KEY_B}")
    store.authorize(batch, "tiny")
    with pytest.raises(AuthError) as info:
        store.authorize(batch, "big")
    error = info.value
    assert (error.status, error.code, error.reason) == (403, "model_not_allowed", "forbidden")
    assert "'batch'" in error.message and "'big'" in error.message and error.headers == {}
    team = store.authenticate(f"Bearer {KEY_A}")
    store.authorize(team, "anything-at-all")


def test_long_model_names_are_truncated_in_errors(store: KeyStore) -> None:
    batch = store.authenticate(f"Bearer {KEY_B}")
    with pytest.raises(AuthError) as info:
        store.authorize(batch, "m" * 10_000)
    assert len(info.value.message) < 300


def test_replace_swaps_keys(store: KeyStore) -> None:
    store.replace(keys(entry("batch", DIGEST_B, ["tiny"], limits={"max_concurrent": 1})))
    with pytest.raises(AuthError):
        store.authenticate(f"Bearer {KEY_A}")
    batch = store.authenticate(f"Bearer {KEY_B}")
    assert batch.limits.max_concurrent == 1 and batch.models == frozenset({"tiny"})


def test_the_key_is_never_in_reprs_or_errors(store: KeyStore) -> None:
    tenant = store.authenticate(f"Bearer {KEY_A}")
    texts = [repr(store), str(store), repr(tenant), str(tenant)]
    for header in (f"Bearer {KEY_A}x", f"Basic {KEY_A}", f"Bearer {KEY_A} {KEY_A}"):
        with pytest.raises(AuthError) as info:
            store.authenticate(header)
        texts += [repr(info.value), str(info.value), info.value.message]
    with pytest.raises(AuthError) as forbidden:
        store.authorize(store.authenticate(f"Bearer {KEY_B}"), "big")
    texts += [repr(forbidden.value), str(forbidden.value)]
    for text in texts:
        for key in (KEY_A, KEY_B):
            assert key not in text and key[7:20] not in text


@given(st.from_regex(r"[!-~]{1,80}", fullmatch=True))
def test_bearer_token_round_trips(token: str) -> None:
    assert bearer_token(f"Bearer {token}") == token


@given(st.text(max_size=100))
def test_any_header_is_either_a_tenant_or_a_401(header: str) -> None:
    store = KeyStore(keys(entry("a", DIGEST_A, ["*"])))
    try:
        tenant = store.authenticate(header)
    except AuthError as error:
        assert error.status == 401
    else:
        assert tenant.name == "a"
