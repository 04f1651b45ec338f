"""The NIXL connector: payloads wait in the producer's registered pool; the consumer READs them.

One :class:`NixlConnector` per leader process (one agent, one pool set) serves both edges of a stage:
it is the consumer of the input edge and the producer of the output edge.  It composes four parts that
share one :class:`~stageferry.broker.data.nixl.endpoint.Endpoint`:

* :mod:`~stageferry.broker.data.nixl.producer` — put into a leased pool slot, release notifications,
  the resend service;
* :mod:`~stageferry.broker.data.nixl.consumer` — claim, READ, unpack, ask for a resend;
* :mod:`~stageferry.broker.data.nixl.leases` — the lease table, expiry, settling, claim-key marks;
* :mod:`~stageferry.broker.data.nixl.staged_outputs` — pool slots handed to the model to write its output into;
* :mod:`~stageferry.broker.data.nixl.peers` — this agent's record, the peer cache and handshake;
* :mod:`~stageferry.broker.data.nixl.upstream` — the producers of the input edge, connected ahead of
  their payloads (``upstream``: the stage this process consumes from).

Lifecycle (the stage service calls these; see :mod:`stageferry.broker.data.stage_connectors`):
:meth:`NixlConnector.open` once at start-up, in a worker thread (creates the agent, registers the
pools; if NIXL cannot be loaded the connector works inline only and says why once), then
``await tg.start(connector.run)`` for the background loops, :meth:`NixlConnector.put` /
:meth:`NixlConnector.get` per request, :meth:`NixlConnector.aclose` at shutdown after the loops are
cancelled.  The memory contract of put and get is :class:`~stageferry.broker.data.connector_contract.Connector`'s.

Threading: the NIXL agent is not thread-safe; every agent call happens on the event-loop thread (each
is a short, non-blocking call), memory copies run in worker threads.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import uuid

import anyio
import redis.asyncio as aioredis
import structlog
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import durability_of
from stageferry.broker.control.resp_link import open_link
from stageferry.broker.control.streams import LeaseClaim
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Connector, Incoming, Outgoing, Payload
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.address import pin_ucx_devices
from stageferry.broker.data.nixl.agent import NixlAgent
from stageferry.broker.data.nixl.consumer import Consumer
from stageferry.broker.data.nixl.endpoint import Counters, Endpoint
from stageferry.broker.data.nixl.leases import LeaseTable, claim_on_read
from stageferry.broker.data.nixl.peers import Peers
from stageferry.broker.data.nixl.producer import Producer
from stageferry.broker.data.nixl.same_gpu import export_arena, gpu_uuid
from stageferry.broker.data.nixl.staged_outputs import Stagings
from stageferry.broker.data.nixl.upstream import UpstreamWatch
from stageferry.broker.data.pool import PoolSet
from stageferry.broker.data.staging import Template
from stageferry.config import DataPlaneConfig, Timeouts
from stageferry.errors import DataPlaneError
from stageferry.schemas import DeviceKind, PayloadRef
from stageferry.schemas.cuda_ipc import MAX_FIELD_BYTES

log = structlog.get_logger(__name__)

#: How much of its DRAM pool a connector faults in at start-up (:meth:`NixlConnector._prefault`).
PREFAULT_BYTES = 16 << 20


class NixlConnector(Connector):
    """Both sides of the NIXL data plane for one leader process (one agent, one pool set)."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        stage: str,
        replica: str,
        config: DataPlaneConfig,
        timeouts: Timeouts,
        cuda_device: torch.device | None = None,
        agent: NixlAgent | None = None,
        address: str | None = None,
        upstream: str | None = None,
    ) -> None:
        incarnation = uuid.uuid4().hex[:16]
        self.endpoint = Endpoint(
            redis=redis,
            keys=keys,
            stage=stage,
            name=f"{stage}-{replica}-{incarnation[:8]}",
            incarnation=incarnation,
            seal_key=secrets.token_bytes(32),
            config=config,
            timeouts=timeouts,
            inline=InlineConnector(
                max_bytes=config.inline_fallback_max_bytes,
                max_payload_bytes=config.max_payload_bytes,
                cuda_device=cuda_device,
            ),
            cuda_device=cuda_device,
            agent=agent,
            address=address,
        )
        self.leases = LeaseTable(self.endpoint)
        self.stagings = Stagings(self.endpoint)
        self.peers = Peers(self.endpoint)
        self.producer = Producer(self.endpoint, self.leases, self.stagings)
        self.consumer = Consumer(self.endpoint, self.peers)
        self.upstream = UpstreamWatch(self.endpoint, self.peers, upstream) if upstream is not None else None

    # ------------------------------------------------------------------ what callers read

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def incarnation(self) -> str:
        return self.endpoint.incarnation

    @property
    def agent(self) -> NixlAgent | None:
        return self.endpoint.agent

    @agent.setter
    def agent(self, agent: NixlAgent | None) -> None:
        """Before :meth:`open`: use this agent instead of creating one (benchmarks tune theirs)."""
        self.endpoint.agent = agent

    @property
    def pools(self) -> PoolSet | None:
        return self.endpoint.pools

    @property
    def unavailable_reason(self) -> str | None:
        """Why this connector is inline only (``None`` while NIXL works)."""
        return self.endpoint.unavailable_reason

    @property
    def counters(self) -> Counters:
        return self.endpoint.counters

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Create the agent and register the pools once (at start-up, not per request).

        If NIXL cannot be loaded the connector still works, inline only, and says why once."""
        ep = self.endpoint
        try:
            if ep.agent is None:
                devices = pin_ucx_devices(ep.address)  # before the agent: UCX reads it when the worker is made
                if ep.address is not None:
                    log.info("nixl.address", address=ep.address, net_devices=devices)
                ep.agent = NixlAgent(ep.name, backends=ep.config.nixl_backends, ucx_threads=ep.config.ucx_threads)
            ep.pools = PoolSet.from_config(ep.config, registrar=ep.agent, cuda_device=ep.cuda_device)
            self._export_same_gpu()
            self._prefault()
            ep.pools.on_pressure = self.consumer.ready.drop  # anyone about to wait gets the ready slots first
            metrics.watch_resources(self.resources)
            ep.link = open_link(ep.redis)
        except DataPlaneError as exc:
            ep.agent, ep.pools = None, None
            ep.unavailable_reason = exc.code
            metrics.HANDSHAKE_FAILURES.labels("agent_unavailable").inc()
            log.error("nixl.unavailable", error=exc.message, fallback="inline")

    def _prefault(self) -> None:
        """Fault in the head of the DRAM pool now, at start-up: slots are taken first-fit from the lowest
        offset, so the first payloads land there, and a put packing into (or a READ landing in) pages
        never touched paid their faults on the first hop (up to ~10 ms for 789 KB on a loaded 2-core
        box).  VRAM has no such cost."""
        pools = self.endpoint.pools
        pool = pools.pools.get(DeviceKind.CPU) if pools is not None else None
        if pool is not None:
            pool.buffer[: min(pool.capacity, PREFAULT_BYTES)].zero_()

    def _export_same_gpu(self) -> None:
        """Publish this GPU's UUID and, with a CUDA pool, its arena for same-GPU consumers (a failure only
        means they READ over NIXL).  Always published: whether a consumer copies through it is the
        consumer's ``same_gpu_copy``."""
        ep = self.endpoint
        ep.gpu_uuid = gpu_uuid(ep.cuda_device)
        pool = ep.pools.pools.get(DeviceKind.CUDA) if ep.pools is not None else None
        if ep.gpu_uuid is None or pool is None:
            return
        try:
            exported = export_arena(pool.buffer, ep.gpu_uuid).to_json().encode()
        except Exception as exc:  # noqa: BLE001 - torch's errors: the transport still works
            log.warning("nixl.same_gpu_export_failed", error=f"{type(exc).__name__}: {exc}")
            return
        if len(exported) <= MAX_FIELD_BYTES:  # what a record carries
            ep.cuda_ipc = exported

    def resources(self) -> dict[str, float]:
        """What this process holds right now; at rest: no leases, no slots, one registration per pool."""
        agent, pools, ready = self.endpoint.agent, self.endpoint.pools, self.consumer.ready
        return {
            "leases": len(self.leases),
            "stagings": len(self.stagings),
            # a payload's slots made ready ahead (at most one, ``nixl.ready``) are counted apart: not a leak
            "pool_slots_in_use": pools.slots_in_use - ready.slots if pools else 0,
            "pool_bytes_in_use": pools.bytes_in_use - ready.nbytes if pools else 0,
            "ready_slots": ready.slots,
            "releases_pending": self.consumer.reader.releases.pending,  # queued for the loop's next turn
            "pools": len(pools.pools) if pools else 0,
            "registrations": agent.registrations if agent else 0,
            "registered_bytes": agent.registered_bytes if agent else 0,
            "open_handles": agent.open_handles() if agent else 0,
            "idle_handles": agent.idle_handles() if agent else 0,  # kept for READs of the same regions
            "remote_agents": len(agent.remotes()) if agent else 0,
        }

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Background duties: agent record heartbeat, notifications, lease expiry, resend requests,
        forgetting peers that went away, connecting to the upstream stage's agents, and the next payload's
        slots made ready while idle.  Started once the record is published and the upstream agents that
        are up are connected."""
        if self.endpoint.agent is None:
            task_status.started()
            return
        await self.peers.publish_record()
        if self.upstream is not None:
            await self.upstream.look()
        async with anyio.create_task_group() as tg:
            if self.upstream is not None:
                tg.start_soon(self.upstream.run)
            tg.start_soon(self.peers.run_heartbeat)
            tg.start_soon(self.producer.run_notifications)
            tg.start_soon(self.leases.run_expiry)
            tg.start_soon(self.stagings.run_expiry)
            tg.start_soon(self.producer.run_resends)
            tg.start_soon(self.peers.run_sweep)
            tg.start_soon(functools.partial(self.consumer.ready.run, ahead=self.upstream is not None))
            task_status.started()

    async def aclose(self) -> None:
        """Drop the agent record, free every lease, release remotes and pools (NIXL's clean-up order)."""
        ep = self.endpoint
        await self.consumer.reader.releases.flush()  # gets' releases still queued: sent while the agent is open
        if ep.link is not None:
            await ep.link.aclose()
            ep.link = None
        if ep.agent is None:
            return
        await self.peers.withdraw_record()
        self.stagings.free_all(reason="shutdown")
        self.leases.free_all(reason="shutdown")
        self.consumer.ready.drop()
        for remote in list(ep.agent.remotes()):
            ep.agent.remove_remote(remote)
        if ep.pools is not None:
            ep.pools.close()
        ep.agent.close()
        ep.agent = None

    # ------------------------------------------------------------------ the Connector contract

    async def stage(
        self, key: str, template: Template, *, force_inline: bool = False, deadline: float | None = None
    ) -> Payload:
        return await self.stagings.stage(key, template, force_inline=force_inline, deadline=deadline)

    def unstage(self, key: str) -> None:
        self.stagings.release(key, reason="not_put")

    async def put(self, key: str, payload: Payload, *, force_inline: bool = False) -> Outgoing:
        return await self.producer.put(key, payload, force_inline=force_inline)

    def get(
        self, ref: PayloadRef, blob: bytes | None, *, key: str, claimed: bool | None = None
    ) -> contextlib.AbstractAsyncContextManager[Incoming]:
        return self.consumer.get(ref, blob, key=key, claimed=claimed)

    def lease_claim(self) -> LeaseClaim | None:
        """The claim the stream read takes for each entry; None behind ``wait_replicas`` (a claim must be
        on a replica before the READ, which :func:`~.leases.claim` waits for and the read script cannot)."""
        if durability_of(self.endpoint.redis).on:
            return None
        return claim_on_read(self.endpoint)

    def abandon(self, outgoing: Outgoing) -> None:
        self.producer.abandon(outgoing)

    async def discard(self, ref: PayloadRef) -> None:
        await self.consumer.discard(ref)
