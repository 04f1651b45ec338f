"""A payload that was READ once is gone for good, even after its consumer's claim has expired.

The soak found this: a consumer READs a payload (the producer frees the slot on the READ's notification),
then dies before acknowledging its entry.  The entry is delivered again, the dead consumer's claim key
has expired by then, and the new consumer used to claim afresh and READ the freed slot — by then holding
another request's payload.  Now the producer marks the claim ``released`` before freeing, for longer
than any consumer could still try, and the second attempt finds the payload gone (and recomputes).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.config import Timeouts
from stageferry.errors import PayloadUnavailableError
from stageferry.schemas import NixlPayload, Transport
from tests.broker.data.nixl.test_connector import consumer, ref_of, start_producer  # noqa: F401 - a fixture

CLAIM_S = 1.0

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def test_a_redelivered_envelope_finds_a_payload_read_before_gone(
    start_producer: Any,  # noqa: F811 - the imported fixture
    redis_url: str,
    prefix: str,
) -> None:
    producer = start_producer("--payloads", "FL2VA")
    item = producer.take()
    ref, blob = ref_of(item)
    assert isinstance(ref, NixlPayload)
    async with consumer(redis_url, prefix, timeouts=Timeouts(resend=3.0, claim=CLAIM_S)) as conn:
        async with conn.get(ref, blob, key=item["key"]) as incoming:
            assert incoming.transport is Transport.NIXL
        await producer.settled(leases=0, slots_in_use=0)  # the READ's notification freed the slot
        r = sync_redis.Redis.from_url(redis_url)
        claim = Keys(prefix).claim(ref.token)
        assert r.get(claim) == b"released"
        assert r.pttl(claim) > 60_000, "the marker outlives the lease"
        # Wait (on Redis's own clock, however loaded this box is) until a claim the consumer took now
        # would have expired: the marker, not the claim, is what refuses the redelivered envelope.
        probe = claim + ":probe"
        r.set(probe, b"1", px=int(CLAIM_S * 1000))
        with anyio.fail_after(30):
            while r.exists(probe):
                await anyio.sleep(0.05)
        assert r.get(claim) == b"released"
        with pytest.raises(PayloadUnavailableError):
            async with conn.get(ref, blob, key=item["key"]):
                pass
    producer.stop()
