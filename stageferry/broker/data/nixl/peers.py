"""Agents and their records: this process's own record in Redis, and the producers it has loaded.

Own record (producer side): :meth:`Peers.publish_record` writes ``<prefix>:nixl:agent:<name>`` (an
:class:`~stageferry.schemas.nixl.AgentRecord`: protocol version, metadata, arenas, seal key) at start,
and names the agent in its stage's index ``<prefix>:nixl:agents:<stage>`` (replica id → agent name, which
consumers watch: :mod:`~stageferry.broker.data.nixl.upstream`); :meth:`Peers.run_heartbeat` keeps both
alive (and writes them again when Redis lost them), :meth:`Peers.withdraw_record` deletes the record and
its index entry at shutdown.  A record that expires means the producer is gone; its payloads are then
recomputed, and the first consumer that finds its index entry without a record takes the entry out
(:meth:`Peers.unlist`): replicas come and go (a pod's name is its replica id), and the index must not keep
every one that ever ran (each consumer reads it whole several times a second).

Peer cache (consumer side): :meth:`Peers.ensure` loads a producer's agent once per *incarnation* (a
restarted producer keeps its replica name but gets a new incarnation, so it is re-added from fresh
metadata), only from records under our own prefix, and checks that the envelope's claims match the
record; :meth:`Peers.connect` loads one ahead of its payloads, opens the UCX connection and READs a few
bytes of each of its arenas into our own pools, so that the first payload's READ finds everything in
place (the connection, the remote keys, a GPU arena's IPC mapping); :meth:`Peers.forget` drops a peer
whose endpoint may be broken; :meth:`Peers.run_sweep` drops peers whose record is gone, so remote agents
return to baseline.

Who calls: the consumer (ensure, forget), the upstream watch (connect), the connector (publish, withdraw,
the two loops).  The cache
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
from redis.commands.core import AsyncScript

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data.nixl.agent import XferState
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.same_gpu import IpcArena, open_arena, warm_copy
from stageferry.errors import (
    ControlPlaneError,
    DataPlaneError,
    HandshakeError,
    ManifestError,
    PayloadUnavailableError,
    TransferError,
)
from stageferry.schemas import DeviceKind, MemKind, NixlPayload, RemoteRegion
from stageferry.schemas.cuda_ipc import CudaIpcArena
from stageferry.schemas.nixl import WARM_NOTIFICATION, AgentRecord, Sealer

log = structlog.get_logger(__name__)

#: Bytes :meth:`Peers.connect` READs from the start of each of a peer's arenas (what the wire-up needs) ...
WARM_BYTES = 4096
#: ... and how long those READs may take together (they hold the load lock: a producer that died with its
#: record still up must not keep another producer's first payload waiting for long).
WARM_TIMEOUT_S = 1.0
#: The stage index outlives its last writer by this much (every heartbeat renews it).
INDEX_TTL_S = 3600
#: Take a replica's entry out of a stage's index if it still names the agent (its replica may have
#: restarted and named its new agent since).  KEYS: the index.  ARGV: replica id, agent name.  1 if removed.
_UNLIST = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


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
    stage: str = ""
    """The stage its record names."""
    gpu_uuid: str | None = None
    """The GPU its record names."""
    ipc: IpcArena | None = field(default=None, compare=False, repr=False)
    """Its CUDA pool arena, mapped when it is on our GPU (:mod:`~stageferry.broker.data.nixl.same_gpu`)."""
    routes: dict[tuple[object, ...], str] = field(default_factory=dict, compare=False, repr=False)
    """Route labels of payload layouts READ from it (:meth:`Consumer._route`), once UCX named the transport."""
    sealer: Sealer = field(init=False, compare=False, repr=False)
    """Checks its leases' seals (``seal_key``'s pads hashed once)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sealer", Sealer(self.seal_key))  # frozen: set once, here


class Peers:
    """This process's agent record, and the producer agents it has loaded (by agent name)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._peers: dict[str, Peer] = {}
        self._lock = anyio.Lock()
        self._stranded: list[IpcArena] = []
        """Arenas whose warm-up copy did not end: kept mapped, as its slot is kept (:meth:`_warm_copy`)."""
        self._unlist: AsyncScript = endpoint.redis.register_script(_UNLIST)  # bound once (no I/O until called)

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
            gpu_uuid=ep.gpu_uuid,
            cuda_ipc=ep.cuda_ipc,
        )
        key, index = ep.keys.agent(ep.name), ep.keys.agents(ep.stage)
        with translated():
            async with ep.redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping=record.to_redis())  # type: ignore[arg-type]
                pipe.pexpire(key, int(ep.config.agent_ttl_s * 1000))
                pipe.hset(index, ep.replica_id, ep.name)  # the record first: a name in the index has one
                pipe.expire(index, INDEX_TTL_S)
                await pipe.execute()

    async def run_heartbeat(self) -> None:
        """Keep the record and its index entry alive every ``agent_heartbeat_s``; runs until cancelled."""
        ep = self._ep
        index = ep.keys.agents(ep.stage)
        while True:
            await anyio.sleep(ep.config.agent_heartbeat_s)
            try:
                with translated():
                    async with ep.redis.pipeline(transaction=False) as pipe:
                        pipe.pexpire(ep.keys.agent(ep.name), int(ep.config.agent_ttl_s * 1000))
                        pipe.hget(index, ep.replica_id)
                        pipe.expire(index, INDEX_TTL_S)
                        alive, listed, _ = await pipe.execute()
                if not alive or listed != ep.name.encode():  # Redis restarted (or was flushed) without them
                    await self.publish_record()
            except ControlPlaneError as exc:
                log.warning("nixl.heartbeat_failed", error=exc.message)

    async def withdraw_record(self) -> None:
        """Delete the record and its index entry at shutdown (best effort: the record expires anyway, and
        a consumer then takes the entry out)."""
        ep = self._ep
        with contextlib.suppress(ControlPlaneError), translated():
            await ep.redis.delete(ep.keys.agent(ep.name))
            await self.unlist(ep.stage, ep.replica_id, ep.name)

    async def unlist(self, stage: str, replica: str, name: str) -> bool:
        """Take ``replica``'s entry out of ``stage``'s index if it still names agent ``name``; True if it did.
        :class:`ControlPlaneError` if Redis is away."""
        ep = self._ep
        with translated():
            removed = await self._unlist(keys=[ep.keys.agents(stage)], args=[replica, name])
        return bool(removed)

    # ------------------------------------------------------------------ peer cache

    def loaded(self, name: str) -> Peer | None:
        """The agent ``name`` if it is loaded already (any incarnation; :meth:`ensure` checks that): no I/O."""
        return self._peers.get(name)

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
                    peer = self._keep(await self._load(ref.agent, ref.incarnation))
        if claimed is not None and claimed != peer.metadata:
            raise ManifestError("envelope metadata differs from the registered agent", agent=ref.agent)
        return peer

    async def connect(self, name: str) -> Peer:
        """Load the agent ``name`` (from its record) ahead of its payloads, connect to it and READ a few bytes
        of each of its arenas (:data:`WARM_BYTES`, into our own pools, no notification): the first payload's
        READ then finds the connection made and the arenas mapped.  A peer loaded already is returned as it
        is.  Raises what :meth:`ensure` raises for a record (:class:`PayloadUnavailableError` when there is
        none), and :class:`HandshakeError` when the connection or a warm-up READ fails (the peer is not kept:
        its payloads then load it as before)."""
        async with self._lock:
            peer = self._peers.get(name)
            if peer is not None:
                return peer
            peer = await self._load(name, None)
            agent = self._ep.agent
            assert agent is not None
            try:
                agent.connect(name)
                reads = await self._warm(peer)
            except DataPlaneError as exc:
                self.forget(name)  # its endpoint closes: nothing of a warm-up READ lands in a reused slot
                raise HandshakeError(f"cannot connect to agent {name}: {exc.message}", agent=name) from exc
            except BaseException:
                self.forget(name)
                raise
            log.info("nixl.peer_connected", peer=name, stage=peer.stage, warm_reads=reads)
            return self._keep(peer)

    def peers_of(self, stage: str) -> list[Peer]:
        """The loaded peers whose record names ``stage``."""
        return [p for p in self._peers.values() if p.stage == stage]

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

    async def _load(self, agent_name: str, incarnation: str | None) -> Peer:
        """Read ``agent_name``'s record and add its agent (the caller keeps the peer: :meth:`_keep`).  With
        ``incarnation`` (an envelope's), the record must be of it; without, the record's own must be the
        one its name carries."""
        ep = self._ep
        with anyio.fail_after(ep.timeouts.handshake):
            raw = await self._record(agent_name)
        if raw is None:
            raise PayloadUnavailableError("producer agent is gone", agent=agent_name)
        record = AgentRecord.from_redis(raw)  # the protocol version first, then every field
        if record.name != agent_name or record.incarnation != (incarnation or record.incarnation):
            raise ManifestError("agent record does not match the envelope", agent=agent_name)
        if not agent_name.endswith(f"-{record.incarnation[:8]}"):
            raise ManifestError("agent name does not match its incarnation", agent=agent_name)
        if agent_name in self._peers:  # only now: an envelope refused above leaves a good peer as it was
            self.forget(agent_name)
        assert ep.agent is not None
        loaded = ep.agent.remotes()
        try:
            name = ep.agent.add_remote(record.metadata)
        except DataPlaneError as exc:
            raise HandshakeError(f"cannot load agent {agent_name}: {exc.message}", agent=agent_name) from exc
        if name != agent_name:
            # Metadata of an agent loaded already (a record copying a real producer's) loads as that
            # agent: it is not this record's to unload, with its READs in flight.
            if name not in loaded:
                ep.agent.remove_remote(name)
            raise HandshakeError("agent metadata names another agent", agent=agent_name, metadata_name=name)
        return Peer(
            name=name,
            incarnation=record.incarnation,
            arenas=tuple(record.arenas),
            metadata=record.metadata,
            seal_key=record.seal_key,
            address=record.address,
            stage=record.stage,
            gpu_uuid=record.gpu_uuid,
            ipc=self._same_gpu_arena(record),
        )

    def _same_gpu_arena(self, record: AgentRecord) -> IpcArena | None:
        """The producer's CUDA arena mapped here, when its record names our GPU and exports one; a handle
        that does not parse, names another arena or cannot be opened is logged and the peer is READ."""
        ep = self._ep
        if not ep.config.same_gpu_copy or ep.gpu_uuid is None or record.gpu_uuid != ep.gpu_uuid:
            return None
        if record.cuda_ipc is None:
            return None
        if self._stranded:  # a warm-up copy never ended here: no more arenas mapped, no more slots kept
            log.warning("nixl.same_gpu_unavailable", peer=record.name, error="a copy did not end", fallback="nixl")
            return None
        try:
            spec = CudaIpcArena.from_json(record.cuda_ipc)
            vram = [a for a in record.arenas if a.mem_kind is MemKind.VRAM]
            if spec.gpu_uuid != record.gpu_uuid or not any(
                a.address == spec.address and a.length == spec.length for a in vram
            ):
                raise HandshakeError("cuda_ipc arena is not the record's VRAM arena", agent=record.name)
            arena = open_arena(spec, ep.cuda_device)
            self._warm_copy(arena)
        except HandshakeError as exc:
            log.warning("nixl.same_gpu_unavailable", peer=record.name, error=exc.message, fallback="nixl")
            return None
        log.info("nixl.same_gpu", peer=record.name, gpu=ep.gpu_uuid, arena_bytes=spec.length)
        return arena

    def _warm_copy(self, arena: IpcArena) -> None:
        """The first copy from a newly mapped arena (:func:`warm_copy`) into a free slot of our CUDA pool (none
        free: skipped), so that a payload's is not the first; :class:`HandshakeError` if it fails."""
        pools = self._ep.pools
        pool = pools.pools.get(DeviceKind.CUDA) if pools is not None else None
        slot = pool.take_now(WARM_BYTES) if pool is not None else None
        if pool is None or slot is None:
            return
        ended = True
        try:
            ended = warm_copy(arena, slot, WARM_BYTES, timeout=WARM_TIMEOUT_S)
        except RuntimeError as exc:  # nothing was queued
            raise HandshakeError(f"the warm-up copy from the producer's arena failed: {exc}") from exc
        finally:
            if ended:
                pool.release(slot)
        if not ended:  # a copy that may still run must not write into a reused slot nor read an unmapped arena
            self._stranded.append(arena)
            raise HandshakeError("the warm-up copy from the producer's arena did not end", slot_kept=WARM_BYTES)

    def _keep(self, peer: Peer) -> Peer:
        self._peers[peer.name] = peer
        return peer

    async def _warm(self, peer: Peer) -> int:
        """READ the first :data:`WARM_BYTES` of each of ``peer``'s arenas into a free slot of each of our
        pools (a pool with no free slot now is skipped), then send it the warm-up notification; the number
        of READs.  A READ that fails or outlives :data:`WARM_TIMEOUT_S` raises :class:`TransferError`; the
        caller then drops the peer before the slot goes back (a late byte of it cannot land in a reused
        slot: the endpoint is closed)."""
        ep = self._ep
        agent, pools = ep.agent, ep.pools
        assert agent is not None
        if pools is None:
            return 0
        deadline = time.monotonic() + min(WARM_TIMEOUT_S, ep.timeouts.handshake)
        reads = 0
        for pool in pools.pools.values():
            for arena in peer.arenas:
                nbytes = min(WARM_BYTES, arena.length)
                slot = pool.take_now(nbytes) if nbytes else None
                if slot is None:
                    continue
                ok = False
                try:
                    local = slot.remote_region()
                    handle = agent.start_read(
                        [(slot.address, nbytes, slot.device_id)],
                        local.mem_kind,
                        [(arena.address, nbytes, arena.device_id)],
                        arena.mem_kind,
                        peer.name,
                        b"",
                    )
                    try:
                        while agent.poll(handle) is not XferState.DONE:
                            if time.monotonic() > deadline:
                                raise TransferError("warm-up READ timed out", agent=peer.name)
                            await anyio.sleep(0.001)
                    finally:
                        agent.release(handle)
                    ok = True
                    reads += 1
                finally:
                    if not ok:  # the caller's forget() closes the endpoint first
                        agent.remove_remote(peer.name)
                    pool.release(slot)
        agent.notify(peer.name, WARM_NOTIFICATION)  # and the release notifications' path
        return reads

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
