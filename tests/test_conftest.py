"""The suite's own cleanup: a test's prefix is gone afterwards, with the prefixes derived from it."""

from __future__ import annotations

import redis as sync_redis

from tests.conftest import delete_prefix


def test_delete_prefix_takes_derived_prefixes_and_nothing_else(redis_url: str, prefix: str) -> None:
    """test_pipeline_e2e.py and test_aggregated.py run deployments under ``prefix + "-a"``: their streams
    (no TTL) were left in the test Redis."""
    other = f"{prefix}x"  # another test's prefix that merely starts the same way
    with sync_redis.Redis.from_url(redis_url) as r:
        r.set(f"{prefix}:req:a", "1")
        r.xadd(f"{prefix}-a:stage:encoder:in", {"k": "v"})
        r.xadd(f"{prefix}-b:stage:diffusion:in", {"k": "v"})
        r.set(f"{other}:req:a", "1")
        try:
            delete_prefix(redis_url, prefix)
            left = [*r.scan_iter(match=f"{prefix}:*"), *r.scan_iter(match=f"{prefix}-*")]
            assert left == []
            assert r.get(f"{other}:req:a") == b"1"
        finally:
            r.delete(f"{other}:req:a")
