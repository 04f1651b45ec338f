"""Agents and their records: this process's own record in Redis, and the producers it has loaded.

Own record (producer side): :meth:`Peers.publish_record` writes ``<prefix>:nixl:agent:<name>`` (an
:class:`~stageferry.schemas.nixl.AgentRecord`: protocol version, metadata, arenas, seal key) at start,
:meth:`Peers.run_heartbeat` keeps it alive (and writes it again when Redis lost it),
:meth:`Peers.withdraw_record` deletes it at shutdown.  A record that expires means the producer is gone;
its payloads are then recomputed.

Peer cache (consumer side): :meth:`Peers.ensure` loads a producer's agent once per *incarnation* (a
restarted producer keeps its replica name but gets a new incarnation, so it is re-added from fresh
metadata), only from records under our own prefix, and checks that the envelope's claims match the
record; :meth:`Peers.forget` drops a peer whose endpoint may be broken; :meth:`Peers.run_sweep` drops
peers whose record is gone, so remote agents return to baseline.

Who calls: the consumer (ensure, forget), the connector (publish, withdraw, the two loops).  The cache
is touched on the event-loop thread only; loading is serialised by a lock (adding one remote agent from
two tasks at once has crashed UCX elsewhere).
"""

from __future__ import annotations

import base64
import contextlib
import time
from dataclasses import dataclass, field

import anyio
import structlog

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.errors import ControlPlaneError, DataPlaneError, HandshakeError, ManifestError, PayloadUnavailableError
from stageferry.schemas import NixlPayload, RemoteRegion
from stageferry.schemas.nixl import AgentRecord

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Peer:
    """A producer agent this consumer has loaded."""

    name: str
    incarnation: str
    arenas: tuple[RemoteRegion, ...]
    metadata: bytes
    seal_key: bytes
    address: str | None = None
    """The IP its record advertises (None: not configured there)."""
    routes: dict[tuple[object, ...], str] = field(default_factory=dict, compare=False, repr=False)
    """Route labels of payload layouts READ from it (:meth:`Consumer._route`), once UCX named the transport."""


class Peers:
    """This process's agent record, and the producer agents it has loaded (by agent name)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._peers: dict[str, Peer] = {}
        self._lock = anyio.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    # ------------------------------------------------------------------ own record

    async def publish_record(self) -> None:
        """Write this agent's record (raises :class:`ControlPlaneError` if Redis is away)."""
        ep = self._ep
        assert ep.agent is not None and ep.pools is not None
        record = AgentRecord(
            name=ep.name,
            stage=ep.stage,
            incarnation=ep.incarnation,
            metadata=ep.agent.metadata(),
            arenas=ep.pools.arenas(),
            seal_key=ep.seal_key,
            started_at=time.time(),
            address=ep.address,
        )
        key = ep.keys.agent(ep.name)
        with translated():
            async with ep.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record.to_redis())  # type: ignore[arg-type]
                pipe.pexpire(key, int(ep.config.agent_ttl_s * 1000))
                await pipe.execute()

    async def run_heartbeat(self) -> None:
        """Keep the record alive every ``agent_heartbeat_s``; runs until cancelled."""
        ep = self._ep
        while True:
            await anyio.sleep(ep.config.agent_heartbeat_s)
            try:
                with translated():
                    alive = await ep.redis.pexpire(ep.keys.agent(ep.name), int(ep.config.agent_ttl_s * 1000))
                if not alive:  # Redis restarted without our record
                    await self.publish_record()
            except ControlPlaneError as exc:
                log.warning("nixl.heartbeat_failed", error=exc.message)

    async def withdraw_record(self) -> None:
        """Delete the record at shutdown (best effort: it expires anyway)."""
        with contextlib.suppress(ControlPlaneError), translated():
            await self._ep.redis.delete(self._ep.keys.agent(self._ep.name))

    # ------------------------------------------------------------------ peer cache

    async def ensure(self, ref: NixlPayload) -> Peer:
        """The producer's agent, loaded once per incarnation; metadata only from our own prefix.

        A name that does not carry its incarnation, or envelope metadata that differs from the agent's
        record, is a hostile or corrupted descriptor (:class:`ManifestError`); a well-formed agent
        without a record has gone away (:class:`PayloadUnavailableError`: recompute); a record of another
        protocol version raises :class:`ProtocolMismatchError` before anything is loaded; a malformed
        record or metadata NIXL cannot load is a :class:`HandshakeError`; a slow Redis a ``TimeoutError``."""
        if not ref.agent.endswith(f"-{ref.incarnation[:8]}"):
            raise ManifestError("agent name does not match its incarnation", agent=ref.agent)
        claimed = None if ref.agent_metadata_b64 is None else _b64(ref.agent_metadata_b64)
        if ref.agent_metadata_b64 is not None and claimed is None:
            raise ManifestError("agent metadata is not base64", agent=ref.agent)
        peer = self._peers.get(ref.agent)
        if peer is None or peer.incarnation != ref.incarnation:
            async with self._lock:
                peer = self._peers.get(ref.agent)
                if peer is None or peer.incarnation != ref.incarnation:
                    peer = await self._load(ref)
        if claimed is not None and claimed != peer.metadata:
            raise ManifestError("envelope metadata differs from the registered agent", agent=ref.agent)
        return peer

    def forget(self, name: str) -> None:
        """Drop a peer and its remote agent (idempotent); the next payload from it re-adds it."""
        self._peers.pop(name, None)
        if self._ep.agent is not None:
            self._ep.agent.remove_remote(name)

    async def run_sweep(self) -> None:
        """Forget producers whose record is gone (they exited or died); runs until cancelled."""
        ep = self._ep
        while True:
            await anyio.sleep(ep.config.agent_ttl_s)
            for name in list(self._peers):
                try:
                    with translated():
                        alive = await ep.redis.exists(ep.keys.agent(name))
                except ControlPlaneError:
                    break
                if not alive:
                    log.info("nixl.peer_gone", peer=name)
                    self.forget(name)

    async def _load(self, ref: NixlPayload) -> Peer:
        ep = self._ep
        if ref.agent in self._peers:
            self.forget(ref.agent)
        with anyio.fail_after(ep.timeouts.handshake):
            raw = await self._record(ref.agent)
        if raw is None:
            raise PayloadUnavailableError("producer agent is gone", agent=ref.agent)
        record = AgentRecord.from_redis(raw)  # the protocol version first, then every field
        if record.name != ref.agent or record.incarnation != ref.incarnation:
            raise ManifestError("agent record does not match the envelope", agent=ref.agent)
        assert ep.agent is not None
        try:
            name = ep.agent.add_remote(record.metadata)
        except DataPlaneError as exc:
            raise HandshakeError(f"cannot load agent {ref.agent}: {exc.message}", agent=ref.agent) from exc
        if name != ref.agent:
            ep.agent.remove_remote(name)
            raise HandshakeError("agent metadata names another agent", agent=ref.agent, metadata_name=name)
        peer = Peer(
            name=name,
            incarnation=ref.incarnation,
            arenas=tuple(record.arenas),
            metadata=record.metadata,
            seal_key=record.seal_key,
            address=record.address,
        )
        self._peers[name] = peer
        return peer

    async def _record(self, name: str) -> dict[bytes, bytes] | None:
        with translated():
            record = await self._ep.redis.hgetall(self._ep.keys.agent(name))
        if not record or b"metadata" not in record:
            return None
        return record


def _b64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        return None
