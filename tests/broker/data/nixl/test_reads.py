"""The READ of a payload's regions (:class:`~stageferry.broker.data.nixl.reads.Reader`) on its error paths:
no READ still writes into our slots once they can go back to the pool.  Real agents (DRAM over UCX) and
a real Redis; a payload of two regions is made by hand (a pipeline's payload of host memory and VRAM,
which this CPU box cannot hold)."""

from __future__ import annotations

from typing import Any

import pytest

from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.errors import TransferError
from stageferry.schemas import DeviceKind
from stageferry.testing import assert_same
from tests.broker.data.nixl.test_consumer import pair, put, releases_until  # noqa: F401 - a fixture

pytest.importorskip("nixl")
pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_reads_posted_before_one_that_fails_to_post_end_before_the_error(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811 - the fixture imported above
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second region's READ cannot be posted (a peer gone meanwhile): the first one, posted already,
    is waited for before the error reaches the caller, who gives the slots back and asks for a resend."""
    producer, consumer = pair
    one, _ = await put(producer, "k-1", seed=1)
    ref = one.model_copy(  # the same region twice: two READs into one slot of ours (not validated here)
        update={
            "manifest": one.manifest.model_copy(update={"regions": [one.manifest.regions[0]] * 2}),
            "regions": [one.regions[0]] * 2,
        }
    )
    cons = consumer.consumer
    real_post, real_wait_all = cons.reader._post, cons.reader._wait_all
    order: list[str] = []

    def post(*args: Any) -> object:
        if order.count("posted") == 1:
            raise TransferError("READ could not be posted: the peer's endpoint is closed")
        handle = real_post(*args)
        order.append("posted")
        return handle

    async def wait_all(handles: list[object], deadline: float) -> None:
        await real_wait_all(handles, deadline)
        order.append(f"{len(handles)} reads ended")

    monkeypatch.setattr(cons.reader, "_post", post)
    monkeypatch.setattr(cons.reader, "_wait_all", wait_all)
    peer = await cons._peers.ensure(one)
    assert consumer.pools is not None
    slots = await consumer.pools.acquire_regions(one.manifest, timeout=5)
    try:
        with pytest.raises(TransferError, match="could not be posted"):
            await cons.reader.read(ref, peer, slots)
        order.append("raised")
        assert order == ["posted", "1 reads ended", "raised"]
        assert consumer.agent is not None and consumer.agent.open_handles() == 0
    finally:
        consumer.pools.release_all(slots)
    assert set(slots) == {DeviceKind.CPU}


async def test_payloads_of_one_shape_from_the_same_producer_slot_repost_their_read(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811 - the fixture imported above
) -> None:
    """The producer frees a payload's slot once released and puts the next one of its size there (first
    fit); our slot is the same too: that READ is posted again on the first one's handle, bit-exact, and a
    READ that failed is never kept."""
    producer, consumer = pair
    agent = consumer.agent
    assert agent is not None
    reposts = agent.reposts
    addresses = set()
    for n in range(3):
        ref, payload = await put(producer, f"k-{n}", seed=n)
        addresses.add(ref.regions[0].address)
        async with consumer.get(ref, None, key=f"k-{n}") as incoming:
            assert_same(incoming.payload, payload)
        assert ref.token in await releases_until(producer, ref.token)
        await producer.leases.settle(ref.token, reason="read_done")  # its slot free for the next put
    assert len(addresses) == 1, "the producer's first fit"
    assert agent.reposts == reposts + 2 and agent.idle_handles() == 1 and agent.open_handles() == 0
    await consumer.aclose()
    assert agent.idle_handles() == 0, "freed with the agent"
