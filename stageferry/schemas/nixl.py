"""The NIXL side channel: what producer and consumer agents exchange besides the envelope.

Four formats, one protocol version (:data:`NIXL_PROTOCOL_VERSION`) that both sides check:

* :class:`AgentRecord` — the producer's Redis hash ``<prefix>:nixl:agent:<name>``: its NIXL metadata,
  the arenas a READ may touch, the key that seals its leases.  A consumer reads it before loading the
  agent and refuses a record of another protocol (:class:`~stageferry.errors.ProtocolMismatchError`)
  before any native call, the way vLLM's NIXL connector checks its peers at handshake.
* :func:`lease_seal` — the producer's HMAC over agent, token and regions, carried in the envelope's
  :class:`~stageferry.schemas.NixlPayload` and checked against the record's key before any READ.
* :class:`ResendRequest` and the reply bytes (:func:`encode_resend_reply` / :func:`decode_resend_reply`)
  — a consumer that could not READ asks the producer (stream ``<prefix>:nixl:resend:<agent>``) to send
  the payload inline, or to drop it; the producer answers on ``<prefix>:nixl:reply:<token>``.
* the release notification (:func:`release_notification` / :func:`released_token`) — sent with the
  consumer's last READ; the producer frees the lease's slots when it arrives;
* the warm-up notification (:data:`WARM_NOTIFICATION`) — sent once by a consumer that connected to the
  producer ahead of its payloads (so that the first release finds the path set up); ignored on arrival.

Everything is validated on read (bounded sizes, exact patterns); nothing is unpickled.

Protocol version history:
  0 — (implicit) records and resend requests without a ``protocol`` field: refused.
  1 — first versioned form: the record and resend requests carry ``protocol``; reply ``\\x01`` + the
      payload's regions concatenated, or ``\\x00`` for a refusal; notification ``sf-release:<token>``.
      Later, compatible additions: the record's optional ``address``, ``gpu_uuid`` and ``cuda_ipc``
      (:mod:`stageferry.schemas.cuda_ipc`, versioned on its own); the stage index
      ``<prefix>:nixl:agents:<stage>`` and the ``sf-warm`` notification (any other notification was
      always ignored, so older producers accept it).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, ValidationError

from stageferry.errors import HandshakeError, ProtocolMismatchError
from stageferry.schemas import json_text
from stageferry.schemas.cuda_ipc import GPU_UUID, MAX_FIELD_BYTES
from stageferry.schemas.job import Frozen
from stageferry.schemas.payload import AgentName, Incarnation, LeaseToken, RemoteRegion

NIXL_PROTOCOL_VERSION = 1
MAX_METADATA_BYTES = 1 << 20
"""NIXL agent metadata is a few hundred bytes to a few KB; anything near this is not metadata."""
MAX_ARENAS = 8
SEAL_KEY_BYTES = 32

RELEASE_TAG = b"sf-release:"
WARM_NOTIFICATION = b"sf-warm"
"""What a consumer that connected ahead of payloads sends its producer once; producers ignore it."""
_TOKEN = re.compile(rb"[A-Za-z0-9._:-]{8,128}")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9._:-]+")
"""Agent names and tokens (their wire patterns): JSON writes them between quotes as they are."""


class AgentRecord(Frozen):
    """A producer agent's record, as published in Redis (a hash of byte strings)."""

    protocol: Annotated[int, Field(ge=0)] = NIXL_PROTOCOL_VERSION
    name: AgentName
    stage: Annotated[str, Field(min_length=1, max_length=64)]
    incarnation: Incarnation
    metadata: Annotated[bytes, Field(min_length=1, max_length=MAX_METADATA_BYTES)]
    arenas: Annotated[list[RemoteRegion], Field(max_length=MAX_ARENAS)]
    seal_key: Annotated[bytes, Field(min_length=SEAL_KEY_BYTES, max_length=SEAL_KEY_BYTES)]
    started_at: float
    address: Annotated[str, Field(max_length=64, pattern=r"^[0-9A-Fa-f.:]+$")] | None = None
    """The IP its peers reach it at (``STAGEFERRY_ADVERTISE_ADDRESS``); absent when not configured."""
    gpu_uuid: Annotated[str, Field(pattern=GPU_UUID)] | None = None
    """The UUID of the GPU its CUDA pool is on; absent without one."""
    cuda_ipc: Annotated[bytes, Field(max_length=MAX_FIELD_BYTES)] | None = None
    """Its CUDA pool arena exported for consumers on that GPU (JSON of
    :class:`~stageferry.schemas.cuda_ipc.CudaIpcArena`, parsed by those only); absent when not exported."""

    def to_redis(self) -> dict[str, str | bytes]:
        """The hash fields to ``HSET`` (metadata raw, arenas as JSON, the seal key in hex)."""
        return {
            "protocol": str(self.protocol),
            "name": self.name,
            "stage": self.stage,
            "incarnation": self.incarnation,
            "metadata": self.metadata,
            "arenas": json.dumps([a.model_dump(mode="json") for a in self.arenas]),
            "seal_key": self.seal_key.hex(),
            "started_at": repr(self.started_at),
            **({"address": self.address} if self.address else {}),
            **({"gpu_uuid": self.gpu_uuid} if self.gpu_uuid else {}),
            **({"cuda_ipc": self.cuda_ipc} if self.cuda_ipc else {}),
        }

    @classmethod
    def from_redis(cls, raw: Mapping[bytes, bytes]) -> AgentRecord:
        """Parse and validate a record read with ``HGETALL``.

        The protocol is checked first, before any other field is looked at: a peer of another version
        raises :class:`ProtocolMismatchError`; a malformed record :class:`HandshakeError`."""
        check_protocol(raw.get(b"protocol"), what="agent record", agent=_shown(raw.get(b"name", b"")))
        try:
            arenas = json_text.loads(raw.get(b"arenas", b"[]"))
            return cls(
                protocol=NIXL_PROTOCOL_VERSION,
                name=_text(raw[b"name"]),
                stage=_text(raw[b"stage"]),
                incarnation=_text(raw[b"incarnation"]),
                metadata=raw[b"metadata"],
                arenas=arenas,
                seal_key=bytes.fromhex(_text(raw[b"seal_key"])),
                started_at=float(raw[b"started_at"]),
                address=_text(raw[b"address"]) if b"address" in raw else None,
                gpu_uuid=_text(raw[b"gpu_uuid"]) if b"gpu_uuid" in raw else None,
                cuda_ipc=raw.get(b"cuda_ipc"),
            )
        except (KeyError, ValueError, ValidationError) as exc:  # JSON, hex, UTF-8 and float errors are ValueErrors
            raise HandshakeError(f"agent record is malformed: {_brief(exc)}") from exc


def check_protocol(raw: bytes | None, *, what: str, **details: Any) -> None:
    """Raise :class:`ProtocolMismatchError` unless ``raw`` is this side's protocol version."""
    if raw == str(NIXL_PROTOCOL_VERSION).encode():
        return
    peer = "none" if raw is None else _shown(raw)[:16]
    raise ProtocolMismatchError(
        f"{what} speaks NIXL side-channel protocol {peer}, this process speaks {NIXL_PROTOCOL_VERSION}",
        peer_protocol=peer,
        protocol=NIXL_PROTOCOL_VERSION,
        **details,
    )


def lease_seal(key: bytes, agent: str, token: str, regions: list[RemoteRegion]) -> str:
    """The producer's HMAC over a lease: its agent, token and exact regions (address, length, device, kind).

    The consumer checks it with the key from the producer's agent record (readable only by stages under
    the ACL), so a forged or shifted descriptor that still lies inside the producer's pool — another
    request's slot — is refused before any READ.

    The signed body is the compact JSON ``[agent, token, [[address, length, device_id, mem_kind], ...]]``;
    for the usual names and ints it is written directly (every put and get signs one), else by ``json``.
    Puts and gets sign with a :class:`Sealer` (the same HMAC-SHA256, its key's pads hashed once)."""
    return hmac.digest(key, _seal_body(agent, token, regions), hashlib.sha256).hex()


def _seal_body(agent: str, token: str, regions: list[RemoteRegion]) -> bytes:
    if (
        _PLAIN_NAME.fullmatch(agent)
        and _PLAIN_NAME.fullmatch(token)
        and all(type(r.address) is int and type(r.length) is int and type(r.device_id) is int for r in regions)
    ):
        spans = ",".join(f'[{r.address},{r.length},{r.device_id},"{r.mem_kind.value}"]' for r in regions)
        return f'["{agent}","{token}",[{spans}]]'.encode()
    return json.dumps(
        [agent, token, [[r.address, r.length, r.device_id, r.mem_kind.value] for r in regions]],
        separators=(",", ":"),
    ).encode()


_SHA256_BLOCK = 64
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


class Sealer:
    """:func:`lease_seal` under one key, the key's HMAC pads hashed once (RFC 2104's inner and outer states,
    as the standard library's own pure-Python HMAC keeps them): a seal then copies two SHA-256 states
    instead of setting up an HMAC in OpenSSL, whose set-up is what a get pays after its loop slept (on the
    CPU box, medians after 2 ms asleep: 7 µs against 13.5, p90 25 against 60).  The producer keeps one for
    its own key, the consumer one per loaded peer."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        block = (hashlib.sha256(key).digest() if len(key) > _SHA256_BLOCK else key).ljust(_SHA256_BLOCK, b"\0")
        self._inner = hashlib.sha256(block.translate(_IPAD))
        self._outer = hashlib.sha256(block.translate(_OPAD))

    def seal(self, agent: str, token: str, regions: list[RemoteRegion]) -> str:
        """``lease_seal(key, agent, token, regions)``."""
        inner = self._inner.copy()
        inner.update(_seal_body(agent, token, regions))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.hexdigest()


class ResendAction(enum.StrEnum):
    """What a consumer asks of the producer of a payload it will not READ."""

    RESEND = "resend"
    """Send the payload inline (the consumer's READ or handshake failed), then free the slot."""
    DROP = "drop"
    """Free the slot: the payload will never be read (its request was settled meanwhile)."""


class ResendRequest(Frozen):
    """One entry of the producer's resend stream."""

    protocol: Annotated[int, Field(ge=0)] = NIXL_PROTOCOL_VERSION
    token: LeaseToken
    action: ResendAction

    def to_fields(self) -> dict[str, str]:
        return {"protocol": str(self.protocol), "token": self.token, "action": self.action.value}

    @classmethod
    def from_fields(cls, fields: Mapping[bytes, bytes]) -> ResendRequest:
        """Parse a stream entry: :class:`ProtocolMismatchError` for another version (checked first),
        :class:`HandshakeError` for anything malformed."""
        check_protocol(fields.get(b"protocol"), what="resend request")
        try:
            return cls(token=_text(fields[b"token"]), action=_text(fields[b"action"]))  # type: ignore[arg-type]
        except (KeyError, ValueError, ValidationError) as exc:
            raise HandshakeError(f"resend request is malformed: {_brief(exc)}") from exc


def encode_resend_reply(blob: bytes | None) -> bytes:
    """The reply to a resend request: the payload's regions concatenated, or ``None`` for a refusal."""
    return b"\x00" if blob is None else b"\x01" + blob


def decode_resend_reply(raw: bytes | None) -> bytes | None:
    """The inline bytes of a reply, or ``None`` if the producer refused (or answered nothing usable)."""
    if not raw or raw[:1] != b"\x01":
        return None
    return raw[1:]


def release_notification(token: str) -> bytes:
    """The notification a consumer's last READ carries; NIXL delivers it to the producer."""
    return RELEASE_TAG + token.encode()


def released_token(message: bytes) -> str | None:
    """The token a release notification names; ``None`` for any other or malformed message."""
    if not message.startswith(RELEASE_TAG):
        return None
    token = message[len(RELEASE_TAG) :]
    return token.decode() if _TOKEN.fullmatch(token) else None


def _text(raw: bytes) -> str:
    return raw.decode("utf-8")  # a UnicodeDecodeError is a ValueError: malformed


def _shown(raw: bytes) -> str:
    """Peer-written bytes, safe to put in a message or log."""
    return raw[:256].decode("utf-8", errors="replace")


def _brief(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
