"""A Sentinel group whose data nodes all load ``stageferry acl --sentinel``'s users (real servers): the
replicas replicate as the replicas' user, the sentinels monitor and fail over as theirs, a client user
submits over a ``redis+sentinel://`` URL with ``WAIT`` (on its own connection rights), the services' user
hands off with ``WAIT`` — before and after a failover — and the default user is off everywhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis as sync_redis

from stageferry.acl import acl_file
from stageferry.broker.control.intake import Intake
from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.control.streams import StageStream
from stageferry.chaos.sentinels import GroupAuth, SentinelGroup
from stageferry.client import Client
from stageferry.config import PipelineConfig
from tests.links import record_sends

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

PREFIX = "sfha"
PASSWORDS = {"stageferry": ">stage-pw", "sfclient": ">client-pw", "sfreplica": ">replica-pw", "sfsentinel": ">sent-pw"}
PIPELINE = PipelineConfig.model_validate(
    {"stages": [{"name": "encoder", "model": "m:f"}, {"name": "diffusion", "model": "m:f"}]}
)
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_group_with_acl_users_replicates_fails_over_and_waits(tmp_path: Path) -> None:
    acl = tmp_path / "users.acl"
    acl.write_text(
        acl_file(PREFIX, "encoder", passwords=PASSWORDS, sentinel=True) + "user admin on >admin-pw ~* &* +@all\n"
    )
    auth = GroupAuth(
        admin=("admin", "admin-pw"), replica=("sfreplica", "replica-pw"), sentinel=("sfsentinel", "sent-pw")
    )
    async with SentinelGroup(tmp_path / "ha", data_args=("--aclfile", str(acl)), auth=auth) as group:
        with pytest.raises(sync_redis.AuthenticationError):  # the default user is off on every node
            sync_redis.Redis(port=group.primary().port).ping()
        client_url = group.url(userinfo="sfclient:client-pw@")
        stage_url = group.url(userinfo="stageferry:stage-pw@")
        for round_ in ("before", "after"):
            async with Client(client_url, prefix=PREFIX, pipeline=PIPELINE) as client:
                assert client._link is not None
                trips = record_sends(client._link)
                rid = await client.submit(JOB, request_id=f"video_sync-{round_}")
                assert any("WAIT" in trip for trip in trips)  # the client user may WAIT
            redis = connect(stage_url)
            keys = Keys(PREFIX)
            try:
                stream = StageStream(
                    redis, keys, "encoder", "encoder-a", visibility_ms=60_000,
                    intake=Intake(redis, keys, "encoder", max_item_bytes=1 << 20),
                )  # fmt: skip
                await stream.ensure_group()
                read = await stream.read(10, block_ms=2000)  # moves the client's submission in from its intake
                (entry,) = [e for e in read if f'"request_id":"{rid}"'.encode() in e.fields.get("submission", b"")]
                assert await stream.hand_off(entry.id, "diffusion", {"request_id": rid})  # WAITed, as the stage user
                await stream.aclose()
            finally:
                await redis.aclose()
            if round_ == "before":
                old = group.failover()  # the sentinels' user reconfigures the nodes
                await group.wait_new_master(old)
                await group.wait_settled(timeout=60)
