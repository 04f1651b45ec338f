"""The payload manifest and payload references: how a conditioning payload is described on the wire.

A payload is a nested structure of tensors and small plain values.  The *tree* keeps the structure
with tensors replaced by indices; the *tensors* say where each tensor's bytes sit inside one of the
payload's *regions* (one contiguous region per memory kind, packed by the producer).  The bytes
themselves travel over NIXL (regions described by plain ``(address, length, device)`` triples) or
inline as one binary field of the stream entry; never pickled.

Protocol version history:
  1 — first version: one region per memory kind, 64-byte aligned offsets.
  1 (issue 40) — reference kind ``chunks`` (:class:`ChunkedPayload`): the payload comes as a stream of
  chunks, each announced with its own reference (:mod:`stageferry.schemas.chunks`).  It travels only in
  an envelope of version 2, which an earlier reader refuses as ``invalid_envelope``.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

from pydantic import Field

from stageferry.schemas.job import Frozen

MANIFEST_VERSION = 1
MAX_TENSORS = 4096
MAX_NDIM = 8
MAX_DIM = 2**40
MAX_REGION_BYTES = 2**40
MAX_TREE_DEPTH = 16
MAX_TREE_NODES = 16_384


class DType(enum.StrEnum):
    """Tensor element types that may travel; anything else is rejected."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    INT64 = "int64"
    INT32 = "int32"
    INT16 = "int16"
    INT8 = "int8"
    UINT8 = "uint8"
    BOOL = "bool"


class DeviceKind(enum.StrEnum):
    """Where a tensor lives; a CUDA tensor lands on the consumer's configured GPU."""

    CPU = "cpu"
    CUDA = "cuda"


class MemKind(enum.StrEnum):
    """NIXL memory segment kinds, one per :class:`DeviceKind`."""

    DRAM = "DRAM"
    VRAM = "VRAM"


MEM_KIND_OF = {DeviceKind.CPU: MemKind.DRAM, DeviceKind.CUDA: MemKind.VRAM}

NonNegInt = Annotated[int, Field(ge=0, le=MAX_REGION_BYTES)]
AgentName = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:-]+$")]
"""A NIXL agent's name: ``<stage>-<replica>-<incarnation[:8]>``."""
Incarnation = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9-]+$")]
LeaseToken = Annotated[str, Field(min_length=8, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
"""Names one lease of a producer: ``<hop key>.<random>``."""


class TensorSpec(Frozen):
    """One tensor: its element type and shape, and where its bytes are inside ``region``."""

    dtype: DType
    shape: Annotated[list[Annotated[int, Field(ge=0, le=MAX_DIM)]], Field(max_length=MAX_NDIM)]
    device: DeviceKind
    region: Annotated[int, Field(ge=0, lt=len(DeviceKind))]
    offset: NonNegInt
    nbytes: NonNegInt


class RegionSpec(Frozen):
    """One packed region of the payload: all tensors of one device kind."""

    device: DeviceKind
    nbytes: NonNegInt


class Manifest(Frozen):
    """Structure, dtypes, shapes, devices and byte offsets of a payload. Validated before any copy."""

    version: Literal[1] = 1
    tree: Any
    tensors: Annotated[list[TensorSpec], Field(max_length=MAX_TENSORS)]
    regions: Annotated[list[RegionSpec], Field(max_length=len(DeviceKind))]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)


class RemoteRegion(Frozen):
    """Where one region sits in the producer's registered memory: a plain (address, length, device)."""

    mem_kind: MemKind
    address: Annotated[int, Field(ge=1, lt=2**64)]
    length: NonNegInt
    device_id: Annotated[int, Field(ge=0, le=1024)]


class NoPayload(Frozen):
    """The entry carries no payload (the first stage's input)."""

    kind: Literal["none"] = "none"


class InlinePayload(Frozen):
    """The payload's regions ride in the entry's binary ``blob`` field, concatenated in order."""

    kind: Literal["inline"] = "inline"
    manifest: Manifest
    blob_bytes: NonNegInt
    fallback_reason: Annotated[str, Field(max_length=256)] | None = None


class NixlPayload(Frozen):
    """The payload waits in the producer's pool; the consumer claims it, then READs the regions."""

    kind: Literal["nixl"] = "nixl"
    manifest: Manifest
    agent: AgentName
    incarnation: Incarnation
    token: LeaseToken
    regions: Annotated[list[RemoteRegion], Field(max_length=len(DeviceKind))]
    lease_expires_at: float
    agent_metadata_b64: Annotated[str, Field(max_length=1_048_576)] | None = None
    seal: Annotated[str, Field(max_length=64, pattern=r"^[0-9a-f]*$")] = ""
    """HMAC-SHA256 by the producer over the token and its regions, keyed by a secret in the producer's agent
    record: descriptors are only READ when they are exactly the ones the producer leased under that token."""


class ChunkedPayload(Frozen):
    """The payload comes in chunks ``<request>_<stage>_<n>``, each announced on the request's chunk stream
    (``Keys.chunks``) with its own inline or NIXL reference, the last one marked ``final``; the consumer
    takes them in order (:mod:`stageferry.stages.entry.chunk_input`)."""

    kind: Literal["chunks"] = "chunks"
    chunk_version: Literal[1] = 1
    #: At most this many chunks are announced and not yet applied by the consumer (the producer waits).
    max_in_flight: Annotated[int, Field(ge=1, le=1024)] = 4


PayloadRef = Annotated[NoPayload | InlinePayload | NixlPayload | ChunkedPayload, Field(discriminator="kind")]
