"""The ``[data_plane]`` section: which connector carries payloads and how NIXL is tuned."""

from __future__ import annotations

import enum
from typing import Annotated

from pydantic import (
    Field,
)

from stageferry.config.base import GiB, KiB, MiB, Strict


class ConnectorKind(enum.StrEnum):
    """Which data plane carries the payload across an edge."""

    NIXL = "nixl"  #: bulk bytes over NIXL, inline below ``inline_max_bytes`` and on failure
    INLINE = "inline"  #: always inline in the stream entry (small payloads, no NIXL available)


class MetadataMode(enum.StrEnum):
    """How a consumer obtains the producer's NIXL agent metadata."""

    QUERIED = "queried"  #: from Redis, ``<prefix>:nixl:agent:<name>``, kept fresh by a TTL heartbeat
    DIRECT = "direct"  #: carried in the envelope as well


class DataPlaneConfig(Strict):
    """Connector choice, thresholds and pool sizes."""

    connector: ConnectorKind = ConnectorKind.NIXL
    """nixl: bulk bytes over NIXL (inline when small or on failure); inline: always in the stream entry."""
    metadata_mode: MetadataMode = MetadataMode.QUERIED
    """queried: agent metadata from Redis; direct: also carried in the envelope (checked against Redis)."""
    inline_max_bytes: Annotated[int, Field(ge=0, le=64 * MiB)] = 64 * KiB
    """Payloads up to this size ride inline in the stream entry."""
    inline_fallback_max_bytes: Annotated[int, Field(ge=0, le=256 * MiB)] = 16 * MiB
    """Cap of the inline fallback when NIXL fails; above it the request is recomputed upstream."""
    cpu_pool_bytes: Annotated[int, Field(ge=MiB, le=64 * GiB)] = 256 * MiB
    """The producer leader's registered DRAM pool."""
    gpu_pool_bytes: Annotated[int, Field(ge=0, le=64 * GiB)] = 512 * MiB
    """The producer leader's registered VRAM pool (GPU stages)."""
    max_payload_bytes: Annotated[int, Field(ge=KiB, le=16 * GiB)] = 1 * GiB
    """Largest payload a stage may hand on."""
    nixl_backends: tuple[Annotated[str, Field(pattern=r"^[A-Z_0-9]{1,32}$")], ...] = ("UCX",)
    """NIXL backends of each agent."""
    read_lanes: Annotated[int, Field(ge=1, le=64)] = 1
    """A DRAM region of at least ``read_lane_min_bytes`` is READ as this many descriptors in one transfer.
    1 by measurement: 2-8, with or without ``ucx_threads``, never beat one (``benchmarks/read_lanes.py``)."""
    read_lane_min_bytes: Annotated[int, Field(ge=64 * KiB, le=16 * GiB)] = 8 * MiB
    """Smallest DRAM region split into ``read_lanes`` descriptors."""
    same_gpu_copy: bool = True
    """When a payload's producer is on this process's own GPU (same GPU UUID), copy its VRAM regions device
    to device through the producer's exported pool arena (CUDA IPC, the copy queued with the CUDA runtime's
    own calls) instead of a NIXL READ, its host-memory rest READ beside; any failure falls back to the READ.
    Same leases, seal and release as the READ.  On by default, by measurement (H200, two processes on one
    GPU, ``benchmarks/same_gpu.py``): the whole get 0.31-0.34 ms against the READ's 0.34-0.40 ms (1-65
    MB), and 0.17-0.20 ms against 0.25-0.26 ms under CUDA MPS."""
    ucx_threads: Annotated[int, Field(ge=0, le=64)] = 0
    """Threads of NIXL's UCX backend (its ``num_threads``); above 0 a transfer's descriptors are spread over
    them.  0 (NIXL's default engine) by measurement: 4 or 8 threads made no DRAM READ faster."""
    ready_slots: bool = True
    """A consumer leader keeps the slots and views of one more payload of its last shape ready, made while
    idle, so a get of that shape skips taking slots and unpacking, and one of another shape that fits the
    slots (a size class up) skips taking slots; with an upstream stage it holds its first get's slots from
    start-up (:mod:`stageferry.broker.data.nixl.ready`)."""
    agent_heartbeat_s: Annotated[float, Field(gt=0, le=60)] = 2.0
    """Seconds between refreshes of the agent record in Redis."""
    agent_ttl_s: Annotated[float, Field(gt=0, le=600)] = 6.0
    """TTL of the agent record: a producer silent this long is gone."""
