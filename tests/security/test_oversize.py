"""Oversized input is refused before it is read whole: stream entries are measured inside Redis, upload
files by their size on disk."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import open_client
from stageferry.broker.control.streams import StageStream
from stageferry.client import Client
from stageferry.config import Limits, PipelineConfig
from stageferry.errors import JobValidationError
from tests.security.servers import PrivateRedis

MiB = 1 << 20


def output_bytes(client: sync_redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_an_oversized_entry_is_measured_in_redis_and_never_pulled(tmp_path: Path) -> None:
    """On a private server, so that its byte counters are ours alone."""
    with PrivateRedis(tmp_path) as server:
        url = f"redis://127.0.0.1:{server.port}/0"
        server.start(url)
        admin = sync_redis.Redis.from_url(url)
        keys = Keys("sfbig")

        async def scenario() -> None:
            async with open_client(url) as redis:
                stream = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000, max_entry_bytes=MiB)
                await stream.ensure_group()
                admin.xadd(keys.stage_stream("encoder"), {"request_id": "big-1", "job": b"x" * (8 * MiB)})
                admin.xadd(keys.stage_stream("encoder"), {"request_id": "small-1", "job": b"{}"})
                before = output_bytes(admin)
                big = await stream.read(1, block_ms=100)
                pulled = output_bytes(admin) - before
                assert len(big) == 1 and big[0].too_large == 8 * MiB + len("request_id") + len("job") + len("big-1")
                assert dict(big[0].fields) == {"request_id": b"big-1"}
                assert pulled < 64 * 1024, f"{pulled} bytes left Redis for an entry refused on its size"
                assert await stream.dead_letter(big[0], reason="entry too large", error_code="invalid_envelope")
                small = await stream.read(1, block_ms=100)
                assert small[0].too_large is None and small[0].fields["job"] == b"{}"
                assert await stream.ack(small[0].id)
                # The oversized entry is gone from the stream (deleted inside Redis); the DLQ copy is small.
                assert admin.xlen(keys.stage_stream("encoder")) == 0
                ((_, dead),) = admin.xrange(keys.dead_letter("encoder"))
                assert dead[b"request_id"] == b"big-1" and b"job" not in dead
                assert await stream.read(1, block_ms=50) == []

        anyio.run(scenario)
        admin.close()


@pytest.mark.anyio
async def test_an_oversized_upload_file_is_refused_on_its_size(tmp_path: Path, redis_url: str, prefix: str) -> None:
    huge = tmp_path / "huge.png"
    with huge.open("wb") as fh:
        fh.truncate(1 << 40)  # a sparse terabyte: reading it whole would never finish
    pipeline = PipelineConfig(limits=Limits(max_upload_bytes=MiB))
    with anyio.fail_after(30):
        async with Client(redis_url, prefix=prefix, pipeline=pipeline) as client:
            job = {"task": "fl2va", "prompt": "x", "width": 320, "height": 192}
            with pytest.raises(JobValidationError) as info:
                await client.submit(job, uploads={"first_frame": huge, "last_frame": huge})
    assert info.value.field_errors[0]["type"] == "upload_too_large"
    assert str(1 << 40) in info.value.message
