"""The request-id rule and the key layout: no id can name another request's keys, nor match a key
pattern meant for another tenant (checked with Redis's own glob matcher, ``KEYS``, on a real server)."""

from __future__ import annotations

import json

import pytest
import redis as sync_redis
from hypothesis import given, settings
from hypothesis import strategies as st

from stageferry.broker.control.keys import Keys
from stageferry.cli import job_schema
from stageferry.schemas.job import REQUEST_ID_PATTERN, is_request_id, tenant_of

VALID = ["a", "video_sync-9e35132f9fa268e8", "acme.job-1", "A.b_c-d", "x" * 128, "0"]
INVALID = [
    "",
    "a:b",
    "victim:cancel",
    "victim:events",
    "victim:result",
    "a b*c?[d]",
    "x" * 129,
    "y" * 5000,
    "-leading-dash",
    ".hidden",
    "trailing-newline\n",
    "tab\there",
    "caf\u00e9",
    "star*",
    "back\\slash",
]

ids = st.from_regex(REQUEST_ID_PATTERN, fullmatch=True)


def all_keys(keys: Keys, rid: str) -> set[str]:
    return {
        keys.request(rid),
        keys.events(rid),
        keys.result(rid),
        keys.cancel(rid),
        keys.submitted(rid),
        keys.video_meta(rid),
        keys.upload(rid, "first_frame"),
    }


def test_the_id_rule() -> None:
    for rid in VALID:
        assert is_request_id(rid), rid
    for rid in INVALID:
        assert not is_request_id(rid), rid
    assert tenant_of("acme.job-1") == "acme"
    assert tenant_of("video_sync-1") is None and tenant_of("Acme.x") is None and tenant_of("a-b.x") is None


@settings(max_examples=300, deadline=None)
@given(ids, ids)
def test_no_id_names_another_requests_key(a: str, b: str) -> None:
    keys = Keys("sf")
    if a != b:
        assert not all_keys(keys, a) & all_keys(keys, b)
    assert len(all_keys(keys, a)) == 7  # and one request's keys are distinct from each other


def test_key_patterns_reach_one_tenant_only(redis_url: str, prefix: str) -> None:
    """Redis's own glob (KEYS) against the patterns the ACL users get: a tenant's pattern matches its keys
    and no other tenant's, even when one tenant's name is a prefix of another's."""
    keys = Keys(prefix)
    r = sync_redis.Redis.from_url(redis_url)
    owners = {"acme.job-1": "acme", "acmecorp.job-1": "acmecorp", "acme-job-1": None, "video_sync-1": None}
    for rid in owners:
        for key in all_keys(keys, rid):
            r.set(key, "x", ex=60)
    for tenant in ("acme", "acmecorp"):
        for make in (keys.request, keys.events, keys.result, keys.cancel, keys.submitted):
            matched = {k.decode() for k in r.keys(make(f"{tenant}.*"))}
            assert matched == {make(rid) for rid, owner in owners.items() if owner == tenant}, (tenant, matched)
    r.close()


def test_schema_publishes_the_id_rule() -> None:
    entry = json.loads(json.dumps(job_schema()))["x-stageferry-entry"]
    assert entry["request_id"]["pattern"] == REQUEST_ID_PATTERN
    assert "refused" in entry["refusal"]


@pytest.mark.parametrize("rid", ["acme.job-1", "video_sync-1"])
def test_refusal_keys_are_per_tenant(rid: str) -> None:
    keys = Keys("sf")
    assert keys.refused("1-0") == "sf:refused:1-0"
    assert keys.refused("1-0", tenant_of(rid)) == ("sf:refused:acme.1-0" if tenant_of(rid) else "sf:refused:1-0")
