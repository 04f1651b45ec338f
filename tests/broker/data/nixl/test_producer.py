"""The producer's notification loop (real agents, CPU DRAM over UCX, real Redis): a put made while the loop
idles has its slot back as soon as its READ's release arrives, not once the idle wait ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import pytest

from stageferry.broker.data.nixl import producer as producer_module
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.schemas import NixlPayload
from stageferry.testing import assert_same, sized_payload
from tests.broker.data.nixl.test_consumer import make

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture
async def pair(redis_url: str, prefix: str) -> AsyncIterator[tuple[NixlConnector, NixlConnector]]:
    """(producer, consumer); no background loop runs unless the test starts it."""
    producer, consumer = make(redis_url, prefix, "encoder"), make(redis_url, prefix, "diffusion")
    await producer.peers.publish_record()
    yield producer, consumer
    for conn in (consumer, producer):
        await conn.aclose()
        await conn.endpoint.redis.aclose()


async def test_a_put_after_an_idle_spell_is_released_without_waiting_out_the_idle_poll(
    pair: tuple[NixlConnector, NixlConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    producer, consumer = pair
    assert producer.pools is not None
    monkeypatch.setattr(producer_module, "_IDLE_POLL_S", 60.0)  # an idle loop that looked only now and then
    async with anyio.create_task_group() as tg:
        tg.start_soon(producer.producer.run_notifications)
        for _ in range(5):  # the loop finds no lease and waits
            await anyio.lowlevel.checkpoint()
        payload = sized_payload(256 << 10, seed=7)
        out = await producer.put("idle-then-put", payload)
        assert isinstance(out.ref, NixlPayload) and producer.pools.slots_in_use == 1
        async with consumer.get(out.ref, None, key="idle-then-put") as incoming:
            assert_same(incoming.payload, payload)
        with anyio.fail_after(10):  # the release is seen within the busy poll, not after 60 s
            while producer.pools.slots_in_use:
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()
