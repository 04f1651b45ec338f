"""The NIXL side-channel formats: round trips, the protocol version check, hostile input typed."""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import Any

import pytest

from stageferry.errors import HandshakeError, ProtocolMismatchError
from stageferry.schemas import RemoteRegion
from stageferry.schemas.nixl import (
    NIXL_PROTOCOL_VERSION,
    AgentRecord,
    ResendAction,
    ResendRequest,
    Sealer,
    decode_resend_reply,
    encode_resend_reply,
    lease_seal,
    release_notification,
    released_token,
)

ARENA = RemoteRegion(mem_kind="DRAM", address=1 << 30, length=1 << 20, device_id=0)


def record() -> AgentRecord:
    return AgentRecord(
        name="encoder-a-01234567",
        stage="encoder",
        incarnation="0123456789abcdef",
        metadata=b"\x00nixl metadata\xff",
        arenas=[ARENA],
        seal_key=secrets.token_bytes(32),
        started_at=1.5,
    )


def as_read(rec: AgentRecord, **changes: Any) -> dict[bytes, bytes]:
    """What HGETALL returns for ``rec`` (bytes keys and values), with fields changed or (None) removed."""
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in rec.to_redis().items()}
    for key, value in changes.items():
        if value is None:
            raw.pop(key.encode(), None)
        else:
            raw[key.encode()] = value
    return raw


def test_an_agent_record_round_trips_through_its_redis_hash() -> None:
    rec = record()
    fields = rec.to_redis()
    assert fields["protocol"] == str(NIXL_PROTOCOL_VERSION)
    assert AgentRecord.from_redis(as_read(rec)) == rec


@pytest.mark.parametrize("protocol", [b"0", b"2", b"999", b"1.0", b" 1", b"\xff\xfe"])
def test_a_record_of_another_protocol_version_is_refused_typed(protocol: bytes) -> None:
    with pytest.raises(ProtocolMismatchError) as info:
        AgentRecord.from_redis(as_read(record(), protocol=protocol))
    err = info.value
    assert err.code == "protocol_mismatch" and isinstance(err, HandshakeError)
    assert err.details["protocol"] == NIXL_PROTOCOL_VERSION
    assert err.details["agent"] == "encoder-a-01234567"
    assert "protocol" in err.message


def test_a_record_without_a_version_is_refused_before_its_other_fields_are_read() -> None:
    """An unversioned (pre-protocol) record, even one that is otherwise garbage, fails on its version."""
    with pytest.raises(ProtocolMismatchError) as info:
        AgentRecord.from_redis({b"metadata": b"x", b"arenas": b"not json"})
    assert info.value.details["peer_protocol"] == "none"


@pytest.mark.parametrize(
    "changes",
    [
        {"metadata": None},
        {"metadata": b""},
        {"metadata": b"m" * ((1 << 20) + 1)},
        {"arenas": b"{"},
        {"arenas": b'{"a": 1}'},
        {"arenas": b"[" * 5000 + b"]" * 5000},  # past the interpreter's recursion limit: not a crash
        {"arenas": b"[" + b",".join([ARENA.model_dump_json().encode()] * 9) + b"]"},
        {"arenas": b'[{"mem_kind": "DRAM", "address": 0, "length": 1, "device_id": 0}]'},
        {"seal_key": b"zz"},
        {"seal_key": b"00" * 31},
        {"name": b"bad name!"},
        {"name": b"\xff"},
        {"incarnation": b""},
        {"started_at": b"soon"},
        {"stage": None},
    ],
)
def test_a_malformed_record_is_a_handshake_error(changes: dict[str, Any]) -> None:
    with pytest.raises(HandshakeError) as info:
        AgentRecord.from_redis(as_read(record(), **changes))
    assert not isinstance(info.value, ProtocolMismatchError)
    assert info.value.code == "handshake_failed"


def test_resend_requests_round_trip_and_are_checked() -> None:
    req = ResendRequest(token="key_0_0.abcdef123456", action=ResendAction.RESEND)
    fields = {k.encode(): v.encode() for k, v in req.to_fields().items()}
    assert ResendRequest.from_fields(fields) == req
    with pytest.raises(ProtocolMismatchError):
        ResendRequest.from_fields({**fields, b"protocol": b"2"})
    with pytest.raises(ProtocolMismatchError):  # an unversioned request (the old wire form)
        ResendRequest.from_fields({b"token": fields[b"token"], b"action": b"drop"})
    for bad in (
        {b"action": b"explode"},
        {b"token": b"short"},
        {b"token": b"../../etc:x" * 20},
        {b"token": b"\xff" * 9},
    ):
        with pytest.raises(HandshakeError):
            ResendRequest.from_fields({**fields, **bad})


def test_resend_replies() -> None:
    assert decode_resend_reply(encode_resend_reply(b"abc")) == b"abc"
    assert decode_resend_reply(encode_resend_reply(b"")) == b""  # an empty payload is still an answer
    assert decode_resend_reply(encode_resend_reply(None)) is None
    assert decode_resend_reply(None) is None and decode_resend_reply(b"") is None
    assert decode_resend_reply(b"\x02abc") is None


def test_release_notifications_name_exactly_one_valid_token() -> None:
    token = "video-1_0_0.0123456789ab"
    assert released_token(release_notification(token)) == token
    assert released_token(b"other notification") is None
    assert released_token(b"sf-release:short") is None
    assert released_token(b"sf-release:" + b"\xff" * 10) is None
    assert released_token(b"sf-release:tok with spaces") is None


def test_the_lease_seal_binds_agent_token_and_every_region() -> None:
    key = secrets.token_bytes(32)
    seal = lease_seal(key, "encoder-a-01234567", "tok-12345678", [ARENA])
    assert len(seal) == 64 and seal == lease_seal(key, "encoder-a-01234567", "tok-12345678", [ARENA])
    shifted = ARENA.model_copy(update={"address": ARENA.address + 64})
    assert seal != lease_seal(key, "encoder-a-01234567", "tok-12345678", [shifted])
    assert seal != lease_seal(key, "encoder-a-01234567", "tok-12345679", [ARENA])
    assert seal != lease_seal(key, "encoder-b-01234567", "tok-12345678", [ARENA])
    assert seal != lease_seal(secrets.token_bytes(32), "encoder-a-01234567", "tok-12345678", [ARENA])


@pytest.mark.parametrize(
    "agent, token",
    [("encoder-a-01234567", "req-1.0123456789ab"), ('odd"agent', "tok\\12345678"), ("agént-a", "tok-12345678")],
    ids=["plain", "needs-escaping", "non-ascii"],
)
def test_the_lease_seal_signs_the_compact_json_body(agent: str, token: str) -> None:
    """Written directly for plain names, by ``json`` otherwise: the same bytes either way."""
    key = secrets.token_bytes(32)
    regions = [ARENA, RemoteRegion(mem_kind="VRAM", address=1 << 40, length=0, device_id=3)]
    body = json.dumps(
        [agent, token, [[r.address, r.length, r.device_id, r.mem_kind.value] for r in regions]], separators=(",", ":")
    )
    assert lease_seal(key, agent, token, regions) == hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    assert Sealer(key).seal(agent, token, regions) == lease_seal(key, agent, token, regions)


@pytest.mark.parametrize("size", [0, 1, 32, 63, 64, 65, 200])
def test_a_sealer_signs_as_the_lease_seal_under_any_key(size: int) -> None:
    """The pads hashed once give HMAC-SHA256's bytes for keys shorter than, as long as and longer than its
    64-byte block (hashed first), every time it is used."""
    key = secrets.token_bytes(size)
    sealer = Sealer(key)
    for n in range(3):
        regions = [ARENA.model_copy(update={"address": ARENA.address + 64 * n})]
        assert sealer.seal("encoder-a-01234567", f"tok-1234567{n}", regions) == lease_seal(
            key, "encoder-a-01234567", f"tok-1234567{n}", regions
        )


def test_an_agent_record_carries_its_advertised_address() -> None:
    """``address`` (``STAGEFERRY_ADVERTISE_ADDRESS``) round-trips; a record without one (an older peer,
    or the setting unset) reads as None; a malformed one is a handshake error."""
    rec = record().model_copy(update={"address": "10.89.42.13"})
    assert AgentRecord.from_redis(as_read(rec)).address == "10.89.42.13"
    assert "address" not in record().to_redis() and AgentRecord.from_redis(as_read(record())).address is None
    with pytest.raises(HandshakeError):
        AgentRecord.from_redis(as_read(rec, address=b"10.0.0.1; rm -rf /"))
