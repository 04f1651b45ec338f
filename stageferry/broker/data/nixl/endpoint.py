"""This process's end of the NIXL data plane: its identity, agent, pools, Redis and settings.

One :class:`Endpoint` per leader process, made by :class:`~stageferry.broker.data.nixl.connector.NixlConnector`
and shared by the four parts it composes (producer, consumer, leases, peers), so that each part holds
only its own state.  ``agent`` and ``pools`` are filled in by the connector's ``open()`` and emptied by
its ``aclose()``; while they are ``None`` the parts fall back to inline (``unavailable_reason`` says why).

Threading: every agent call happens on the event-loop thread (see
:mod:`stageferry.broker.data.nixl.agent`); nothing here locks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.resp_link import RespLink
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.agent import NixlAgent
from stageferry.broker.data.pool import PoolSet
from stageferry.config import DataPlaneConfig, MetadataMode, Timeouts


@dataclass(slots=True)
class Counters:
    """What tests and benchmarks count (not timings)."""

    puts: int = 0
    gets: int = 0
    reads: int = 0
    #: Output stagings handed to models, puts that used one, and the tensors such puts still copied.
    stagings: int = 0
    staged_puts: int = 0
    staged_copies: int = 0
    #: Gets whose CUDA regions were copied from a producer on the same GPU (no READ).
    same_gpu: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1


@dataclass(eq=False, slots=True)
class Endpoint:
    """Shared, mutable state of one leader's data plane (see the module docstring for who owns what)."""

    redis: aioredis.Redis
    keys: Keys
    stage: str
    name: str
    """The agent name: ``<stage>-<replica>-<incarnation[:8]>``, what envelopes and records carry."""
    incarnation: str
    """New on every start: a restarted producer is a new peer, whatever its name."""
    seal_key: bytes
    """Signs this incarnation's leases (see :func:`stageferry.schemas.nixl.lease_seal`)."""
    config: DataPlaneConfig
    timeouts: Timeouts
    inline: InlineConnector
    cuda_device: torch.device | None = None
    agent: NixlAgent | None = None
    pools: PoolSet | None = None
    unavailable_reason: str | None = None
    link: RespLink | None = None
    """A lean connection (:mod:`~stageferry.broker.control.resp_link`) for the per-payload commands that
    are not a stage stream's (a lease's release marks); made by ``open()``; None: redis-py carries them."""
    counters: Counters = field(default_factory=Counters)
    address: str | None = None
    """The IP peers reach this agent at (``STAGEFERRY_ADVERTISE_ADDRESS``), published in its record."""
    gpu_uuid: str | None = None
    """The UUID of this process's GPU (``GPU-…``), published in its record; None without one."""
    cuda_ipc: bytes | None = None
    """Its CUDA pool arena exported for same-GPU consumers (:mod:`~stageferry.broker.data.nixl.same_gpu`)."""

    @property
    def replica_id(self) -> str:
        """``<stage>-<replica>``: the agent name without its incarnation (its field in the stage index)."""
        return self.name[: -len(self.incarnation[:8]) - 1]

    @property
    def direct(self) -> bool:
        """Whether puts carry the agent metadata in the envelope (``metadata_mode = "direct"``)."""
        return self.config.metadata_mode is MetadataMode.DIRECT
