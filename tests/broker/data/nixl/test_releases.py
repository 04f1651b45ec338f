"""The producer's release, queued by the get and sent on the event loop's next turn (nixl.releases).

Two real connectors (two NIXL agents, CPU DRAM over UCX, real Redis), as in ``test_consumer``: the
producer's notification loop is not started, so the test drains its agent's notifications itself.  A get
whose claim is won inside it (``claimed`` None) sends a release of its own: the one that is queued.
"""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.errors import TransferError
from stageferry.schemas.nixl import ResendAction, ResendRequest
from stageferry.testing import assert_same
from tests.broker.data.nixl.test_consumer import pair, put, releases_until  # noqa: F401 - the fixture

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


async def test_the_release_is_queued_by_the_get_and_sent_once_on_the_next_turn(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811
) -> None:
    producer, consumer = pair
    releases = consumer.consumer.reader.releases
    ref, payload = await put(producer, "k-1", seed=1)
    async with consumer.get(ref, None, key="k-1") as incoming:
        assert_same(incoming.payload, payload)
        # the payload is ours before the notification is sent: it waits for the loop's next turn
        assert releases.pending == 1 and releases.sent == 0
        assert consumer.resources()["releases_pending"] == 1
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
    assert releases.pending == 0 and releases.sent == 1


async def test_gets_in_one_turn_are_released_together_each_once(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811
) -> None:
    producer, consumer = pair
    releases = consumer.consumer.reader.releases
    refs = [(await put(producer, f"k-{i}", seed=i))[0] for i in range(3)]
    for i, ref in enumerate(refs):
        async with consumer.get(ref, None, key=f"k-{i}"):
            pass
    seen = await releases_until(producer, refs[-1].token)
    while not all(ref.token in seen for ref in refs):
        seen += await releases_until(producer, next(r.token for r in refs if r.token not in seen))
    assert sorted(seen) == sorted(ref.token for ref in refs), "each released once"
    assert releases.pending == 0 and releases.sent == 3


async def test_a_release_nixl_cannot_send_goes_through_redis(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer's endpoint broke after the bytes arrived: the release becomes the producer's drop request
    (its resend stream), and nothing of it is left queued."""
    producer, consumer = pair
    agent = consumer.agent
    assert agent is not None

    def broken(remote: str, message: bytes) -> None:
        raise TransferError("the peer's endpoint is gone", peer=remote)

    monkeypatch.setattr(agent, "notify", broken)
    ref, payload = await put(producer, "k-1", seed=1)
    redis, stream = producer.endpoint.redis, producer.endpoint.keys.resend(producer.endpoint.name)
    with capture_logs() as logs:
        async with consumer.get(ref, None, key="k-1") as incoming:
            assert_same(incoming.payload, payload)
        with anyio.fail_after(20):
            await consumer.consumer.reader.releases.flush()  # the queued release, and its Redis fallback ended
    ((_, fields),) = await redis.xrange(stream)
    request = ResendRequest.from_fields(fields)
    assert request.token == ref.token and request.action is ResendAction.DROP
    (failed,) = [e for e in logs if e["event"] == "nixl.notify_failed"]
    assert failed["token"] == ref.token and failed["peer"] == producer.agent.name  # type: ignore[union-attr]
    assert consumer.consumer.reader.releases.pending == 0


async def test_closing_the_connector_sends_what_is_queued(
    pair: tuple[NixlConnector, NixlConnector],  # noqa: F811
) -> None:
    producer, consumer = pair
    ref, _ = await put(producer, "k-1", seed=1)
    async with consumer.get(ref, None, key="k-1"):
        pass
    await consumer.aclose()  # no turn of the loop between the get and the close
    assert consumer.consumer.reader.releases.sent == 1
    assert (await releases_until(producer, ref.token)).count(ref.token) == 1
