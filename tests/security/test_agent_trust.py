"""Whose memory a consumer may read: NIXL agent metadata is only taken from the configured prefix, and a
payload reference must name an agent of the stage that produced the envelope."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stageferry.broker.data.payload_codec import plan_payload
from stageferry.errors import EnvelopeError, PayloadUnavailableError
from stageferry.schemas import Envelope, JobRequest, NixlPayload, request_key
from stageferry.schemas.validation import parse_envelope
from tests.broker.data.nixl.test_connector import consumer, ref_of, start_producer  # noqa: F401 - fixture
from tests.security.test_codec_fuzz import GOOD_PAYLOAD

JOB = JobRequest.model_validate({"prompt": "a cat", "width": 320, "height": 192})


def nixl_ref(agent: str, incarnation: str = "0123456789abcdef") -> dict[str, Any]:
    manifest = plan_payload(GOOD_PAYLOAD).manifest
    region = {"mem_kind": "DRAM", "address": 1 << 20, "length": manifest.regions[0].nbytes, "device_id": 0}
    return NixlPayload(
        manifest=manifest,
        agent=agent,
        incarnation=incarnation,
        token="tok-12345678",
        regions=[region],
        lease_expires_at=0.0,
    ).model_dump(mode="json")


def envelope(from_stage: str, payload: dict[str, Any]) -> str:
    doc = Envelope(request_id="r-1", key=request_key("r-1", 0), from_stage=from_stage, to_stage="diffusion", job=JOB)
    raw = doc.model_dump(mode="json")
    raw["payload"] = payload
    return json.dumps(raw)


@pytest.mark.parametrize(
    "agent",
    [
        "diffusion-a-01234567",  # another stage's agent
        "encoderx-a-01234567",  # a stage whose name merely starts like ours
        "encoder-a-ffffffff",  # not this incarnation
        "a-encoder-01234567",
    ],
)
def test_an_agent_that_is_not_the_envelopes_producer_is_rejected(agent: str) -> None:
    with pytest.raises(EnvelopeError) as info:
        parse_envelope(envelope("encoder", nixl_ref(agent)))
    assert info.value.code == "invalid_envelope"
    assert "not an agent of stage" in json.dumps(info.value.details)
    assert parse_envelope(envelope("encoder", nixl_ref("encoder-a-01234567"))).payload.kind == "nixl"


@pytest.mark.anyio
async def test_agent_metadata_is_only_trusted_from_the_configured_prefix(
    start_producer: Any,  # noqa: F811 - the fixture imported above
    redis_url: str,
    prefix: str,
) -> None:
    """A real producer publishes its agent record under another prefix and sends its metadata in the
    envelope too (direct mode): a consumer of ``prefix`` finds no record of its own and refuses to load
    the agent (the payload is unavailable: recomputed upstream), whatever the envelope carries."""
    foreign = f"{prefix}:foreign"  # under the test's prefix for clean-up, but not our agent keys
    producer = start_producer("--prefix", foreign, "--mode", "direct", "--payloads", "T2VA")
    item = json.loads(producer.redis.blpop([f"{foreign}:test:refs"], timeout=60)[1])
    ref, blob = ref_of(item)
    assert isinstance(ref, NixlPayload) and ref.agent_metadata_b64
    assert producer.redis.exists(f"{foreign}:nixl:agent:{ref.agent}")
    assert not producer.redis.exists(f"{prefix}:nixl:agent:{ref.agent}")
    async with consumer(redis_url, prefix, metadata_mode="direct") as conn:
        with pytest.raises(PayloadUnavailableError, match="producer agent is gone"):
            async with conn.get(ref, blob, key=item["key"]):
                pass
        assert ref.agent not in conn.peers and conn.counters.reads == 0
    producer.redis.set(f"{foreign}:test:stop", 1)
    producer.proc.wait(30)
