"""The dead-letter stream on real Redis: large bodies become size + digest, the stream is trimmed by
length, by bytes and by age, and the key expires when quiet.  Every write runs as the stage ACL user of
``stageferry acl`` on a private redis-server loaded with that ACL, and Redis must refuse nothing (issue 34:
the script's TIME and XTRIM were refused to that user, so every dead letter failed in a real deployment)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.dead_letter import DeadLetterPolicy
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.streams import StageStream
from stageferry.config import PipelineConfig
from tests.procs import wait_for
from tests.security.servers import AclRedis


@pytest.fixture
def acl_redis(tmp_path: Path, prefix: str) -> Iterator[AclRedis]:
    """A private Redis with the shipped ACL for this test's prefix; nothing may have been refused at the end."""
    with AclRedis(tmp_path, prefix) as server:
        yield server
        assert server.refusals() == []


@pytest.fixture
def stage_url(acl_redis: AclRedis) -> str:
    return acl_redis.url("stageferry")


@pytest.fixture
def admin(acl_redis: AclRedis) -> Iterator[sync_redis.Redis]:
    client = acl_redis.admin()
    yield client
    client.close()


def dead_letter_all(stage_url: str, keys: Keys, policy: DeadLetterPolicy, entries: list[dict[str, bytes]]) -> None:
    """XADD ``entries`` to the encoder's stream, read each as a replica would, and dead-letter it."""

    async def run() -> None:
        async with open_client(stage_url) as redis:
            stream = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000, dead_letters=policy)
            await stream.ensure_group()
            for fields in entries:
                await redis.xadd(keys.stage_stream("encoder"), fields)  # type: ignore[arg-type]  # a client's entry
                (entry,) = await stream.read(1, block_ms=100)
                assert await stream.dead_letter(entry, reason="poison " * 1000, error_code="invalid_envelope")

    anyio.run(run)


def test_large_bodies_keep_size_and_digest_only(stage_url: str, prefix: str, admin: sync_redis.Redis) -> None:
    keys = Keys(prefix)
    big_job = b'{"prompt": "' + b"x" * (3 << 20) + b'"}'
    small_job = b'{"prompt": "a cat"}'
    huge_id = b"r" * 5000
    policy = DeadLetterPolicy(body_max_bytes=4096)
    entries = [{"request_id": b"big-1", "job": big_job}, {"request_id": b"small-1", "job": small_job}]
    dead_letter_all(stage_url, keys, policy, [*entries, {"request_id": huge_id}])
    (_, big), (_, small), (_, odd) = admin.xrange(keys.dead_letter("encoder"))
    assert b"job" not in big
    assert int(big[b"job_bytes"]) == len(big_job)
    assert big[b"job_sha256"].decode() == hashlib.sha256(big_job).hexdigest()
    assert int(big[b"entry_bytes"]) >= len(big_job)
    assert big[b"request_id"] == b"big-1" and big[b"error_code"] == b"invalid_envelope"
    assert len(big[b"reason"]) == 2000 and big[b"deliveries"] == b"1"
    assert small[b"job"] == small_job and b"job_sha256" not in small
    assert len(odd[b"request_id"]) == 128
    for fields in (big, small, odd):
        assert sum(len(k) + len(v) for k, v in fields.items()) <= policy.entry_cap
    assert admin.memory_usage(keys.dead_letter("encoder")) < 64 * 1024


def test_trimmed_by_length_and_by_bytes(stage_url: str, prefix: str, admin: sync_redis.Redis) -> None:
    keys = Keys(prefix)
    by_length = DeadLetterPolicy(maxlen=5)
    dead_letter_all(stage_url, keys, by_length, [{"request_id": f"r-{i}".encode(), "job": b"{}"} for i in range(12)])
    rows = admin.xrange(keys.dead_letter("encoder"))
    assert [f[b"request_id"] for _, f in rows] == [f"r-{i}".encode() for i in range(7, 12)], "the newest five stay"

    by_bytes = DeadLetterPolicy(maxlen=1000, max_bytes=64 * 1024, body_max_bytes=8192)
    assert by_bytes.effective_maxlen == 64 * 1024 // by_bytes.entry_cap < 1000
    dead_letter_all(stage_url, keys, by_bytes, [{"request_id": b"b", "job": b"j" * 8000} for _ in range(12)])
    rows = admin.xrange(keys.dead_letter("encoder"))
    assert len(rows) == by_bytes.effective_maxlen
    assert sum(len(k) + len(v) for _, f in rows for k, v in f.items()) <= by_bytes.max_bytes


def test_trimmed_by_age_and_expires(stage_url: str, prefix: str, admin: sync_redis.Redis) -> None:
    """Ages are the server's (the script reads its clock from its XADD's id): the test waits on that clock,
    not on its own sleeps, so a slow box cannot age an entry past the bound behind the test's back."""
    keys = Keys(prefix)
    key = keys.dead_letter("encoder")
    policy = DeadLetterPolicy(max_age_s=3)

    def server_ms() -> int:
        seconds, micros = admin.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def written_ms(request_id: bytes) -> int:
        return next(int(i.split(b"-")[0]) for i, f in admin.xrange(key) if f[b"request_id"] == request_id)

    dead_letter_all(stage_url, keys, policy, [{"request_id": b"old-1", "job": b"{}"}])
    assert 0 < admin.ttl(key) <= 3
    old = written_ms(b"old-1")
    wait_for(lambda: server_ms() - old >= 1_500, 30, "old-1 1.5 s old")
    dead_letter_all(stage_url, keys, policy, [{"request_id": b"mid-1", "job": b"{}"}])  # the key's TTL restarts
    mid = written_ms(b"mid-1")
    wait_for(lambda: server_ms() - old > 3_000, 30, "old-1 past the age bound")
    dead_letter_all(stage_url, keys, policy, [{"request_id": b"new-1", "job": b"{}"}])  # this write trims by age
    if written_ms(b"new-1") - mid <= 3_000:  # mid-1 was still young when new-1 was written
        assert [f[b"request_id"] for _, f in admin.xrange(key)] == [b"mid-1", b"new-1"]
    else:  # the box stalled for 1.5 s between two writes: mid-1 aged out too, rightly
        assert [f[b"request_id"] for _, f in admin.xrange(key)] == [b"new-1"]
    # nothing dead-lettered for longer than the age bound: the stream is gone
    wait_for(lambda: admin.exists(key) == 0, 30, "the dead-letter stream to expire")


def test_policy_follows_the_pipeline_retention() -> None:
    pipeline = PipelineConfig.model_validate(
        {"retention": {"dlq_maxlen": 50, "dlq_max_bytes": 1 << 20, "dlq_max_age_s": 3600, "dlq_body_max_bytes": 512}}
    )
    policy = DeadLetterPolicy.from_retention(pipeline.retention)
    assert policy == DeadLetterPolicy(maxlen=50, max_bytes=1 << 20, max_age_s=3600, body_max_bytes=512)
    assert policy.effective_maxlen == 50
