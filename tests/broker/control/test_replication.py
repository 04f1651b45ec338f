"""Durable writes behind Sentinel (real servers): a submission returns only once a replica has it, is not
acknowledged when no replica answers in time (and is then proved on resubmission), and a stage's
hand-off, result and terminal status wait for a replica too; without ``wait_replicas`` no ``WAIT`` is
ever sent (nothing changes for a single server)."""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect, open_client
from stageferry.broker.control.requests import RequestStore
from stageferry.broker.control.streams import StageStream
from stageferry.chaos.sentinels import SentinelGroup
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.embedded_redis import EmbeddedRedis
from stageferry.errors import NotReplicatedError
from stageferry.schemas import JobRequest, RequestState, RequestStatus
from tests.links import record_sends
from tests.sentinels import eventually, sentinel_group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]
__all__ = ["sentinel_group"]

PIPELINE = PipelineConfig.model_validate(
    {"stages": [{"name": "encoder", "model": "m:f"}, {"name": "diffusion", "model": "m:f"}]}
)
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}


def on_replicas(group: SentinelGroup, key: str) -> list[int]:
    primary = group.primary()
    out = []
    for node in group.nodes:
        if node is not primary:
            with group.node_client(node) as client:
                out.append(int(client.exists(key)))
    return out


async def test_a_submission_returns_only_once_a_replica_has_it(sentinel_group: SentinelGroup) -> None:
    keys = Keys("ha")
    async with Client(sentinel_group.url(query="wait_replicas=2"), prefix="ha", pipeline=PIPELINE) as client:
        trips = record_sends(client._link) if client._link is not None else []
        rid = await client.submit(JOB)
        # No waiting here: WAIT 2 answered, so both replicas hold the entry and its marker already.
        assert on_replicas(sentinel_group, keys.submitted(rid)) == [1, 1]
        assert on_replicas(sentinel_group, keys.intake("encoder")) == [1, 1]
        assert any("WAIT" in trip for trip in trips)


async def test_a_submission_no_replica_acknowledges_is_refused_then_proved_on_resubmission(
    sentinel_group: SentinelGroup,
) -> None:
    url = sentinel_group.url(query="wait_timeout_ms=300&failover_wait_s=0")
    async with Client(url, prefix="ha", pipeline=PIPELINE) as client:
        with sentinel_group.replicas_frozen(), pytest.raises(NotReplicatedError) as caught:
            await client.submit(JOB, request_id="video_sync-unreplicated")
        assert caught.value.details == {"replicas": 0, "wanted": 1}
        with sentinel_group.replicas_frozen(), pytest.raises(NotReplicatedError):
            await client.submit(JOB, request_id="video_sync-unreplicated")  # known, but still not proved
        assert await client.submit(JOB, request_id="video_sync-unreplicated") == "video_sync-unreplicated"
        assert on_replicas(sentinel_group, Keys("ha").submitted("video_sync-unreplicated")) == [1, 1]


async def test_a_client_rides_out_replicas_that_answer_late(sentinel_group: SentinelGroup) -> None:
    """With ``failover_wait_s`` the client resubmits under the same id until a replica acknowledges: here
    the replicas are frozen until the client has been refused once."""
    url = sentinel_group.url(query="wait_timeout_ms=200&failover_wait_s=30")
    async with Client(url, prefix="ha", pipeline=PIPELINE) as client:
        with capture_logs() as logs, sentinel_group.replicas_frozen() as thaw:

            async def thaw_after_a_refusal() -> None:
                await eventually(
                    lambda: _true(any(e["event"] == "client.submit_retry" for e in logs)),
                    timeout=30,
                    what="a refused submission",
                )
                thaw()

            async with anyio.create_task_group() as tg:
                tg.start_soon(thaw_after_a_refusal)
                rid = await client.submit(JOB, request_id="video_sync-late")
        assert rid == "video_sync-late" and await client.store.known(rid)
        retries = [e for e in logs if e["event"] == "client.submit_retry"]
        assert retries and "reached 0 of 1 replicas" in retries[0]["error"]
        assert on_replicas(sentinel_group, Keys("ha").submitted(rid)) == [1, 1]


async def _true(value: bool) -> bool:
    return value


async def test_a_stages_hand_off_result_and_terminal_status_wait_for_a_replica(sentinel_group: SentinelGroup) -> None:
    keys = Keys("ha")
    redis = connect(sentinel_group.url(query="wait_timeout_ms=300"))
    try:
        store = RequestStore(redis, keys, ttl_s=600, events_maxlen=100)
        stream = StageStream(redis, keys, "encoder", "encoder-a", visibility_ms=60_000)
        await stream.ensure_group()
        await redis.xadd(keys.stage_stream("encoder"), {"request_id": "r1", "job": JobRequest(**JOB).model_dump_json()})
        (entry,) = await stream.read(1, block_ms=1000)
        trips = record_sends(stream.script_link) if stream.script_link is not None else []
        assert await stream.hand_off(entry.id, "diffusion", {"request_id": "r1"})
        assert on_replicas(sentinel_group, keys.stage_stream("diffusion")) == [1, 1]
        assert any(trip[-1] == "WAIT" for trip in trips)
        failed = RequestStatus(request_id="r1", state=RequestState.FAILED, stage="encoder")
        with sentinel_group.replicas_frozen(), capture_logs() as logs:
            assert await store.set_status(failed)  # the write stands; the short count is told
        assert next(e for e in logs if e["event"] == "redis.not_replicated")["replicas"] == 0
        await stream.aclose()
    finally:
        await redis.aclose()


async def test_without_wait_replicas_no_wait_is_sent(redis_url: str, prefix: str) -> None:
    """A plain URL (the default) keeps today's commands: the same round trips, no WAIT."""
    async with Client(redis_url, prefix=prefix, pipeline=PIPELINE) as client:
        assert client._link is not None
        trips = record_sends(client._link)
        await client.submit(JOB)
        await client.submit(JOB, request_id=(rid := "video_sync-nowait-1"))
        await client.submit(JOB, request_id=rid)  # known
    assert trips and not any("WAIT" in trip for trip in trips)
    async with EmbeddedRedis() as server, open_client(server.url) as redis:
        stream = StageStream(redis, Keys(prefix), "encoder", "encoder-a", visibility_ms=60_000)
        assert not stream.durability.on
        await stream.aclose()
