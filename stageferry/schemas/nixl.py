"""The NIXL side channel: what producer and consumer agents exchange besides the envelope.

* the agent record (a Redis hash under ``<prefix>:nixl:agent:<name>``): metadata, arenas, seal key;
* the lease seal: the producer's HMAC over agent, token and regions;
* the release notification sent with the last READ: ``sf-release:<token>``.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from stageferry.errors import HandshakeError
from stageferry.schemas.payload import RemoteRegion

RELEASE_TAG = b"sf-release:"


def parse_arenas(raw: bytes) -> tuple[RemoteRegion, ...]:
    try:
        items = json.loads(raw)
        if not isinstance(items, list) or len(items) > 8:
            raise ValueError("arenas must be a short list")
        return tuple(RemoteRegion.model_validate(item) for item in items)
    except ValueError as exc:
        raise HandshakeError(f"agent record has invalid arenas: {exc}") from exc


def lease_seal(key: bytes, agent: str, token: str, regions: list[RemoteRegion]) -> str:
    """The producer's HMAC over a lease: its agent, token and exact regions (address, length, device, kind).

    The consumer checks it with the key from the producer's agent record (readable only by stages under
    the ACL), so a forged or shifted descriptor that still lies inside the producer's pool — another
    request's slot — is refused before any READ."""
    body = json.dumps(
        [agent, token, [[r.address, r.length, r.device_id, r.mem_kind.value] for r in regions]], separators=(",", ":")
    )
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
