"""What a stage group's ranks exchange and compute over: the kinds of leader → follower messages, the
message a follower receives, one broadcast of a rank's route, and the process groups a model computes
over.  The channel that moves them is :mod:`stageferry.stages.group.group_channel`."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from stageferry.schemas import DeviceKind, Manifest


class MessageKind(enum.StrEnum):
    JOB = "job"
    #: one chunk of a streamed payload (a job's header says ``chunked``), or its end / the leader's error
    CHUNK = "chunk"
    FAIL = "fail"
    NOOP = "noop"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class Message:
    """What a follower receives: the header fields, media bytes, payload region buffers and the payload
    unpacked over them (tensors are views of ``buffers``).

    An inline region's buffer is part of a frame the channel keeps and receives into again: it and the
    payload's tensors hold until this rank's next :meth:`GroupChannel.receive` — the same lifetime as the
    leader's payload, a pool slot freed after the job.  Keep a copy to hold anything longer."""

    kind: MessageKind
    header: dict[str, Any]
    media: dict[str, bytes]
    buffers: dict[DeviceKind, torch.Tensor]
    manifest: Manifest | None
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Hop:
    """One broadcast on a rank's route: from global rank ``src`` over a gloo group (headers, CPU
    regions) and its device twin (CUDA regions; the same group on CPU-only ranks)."""

    src: int
    cpu_group: Any
    device_group: Any


@dataclass(frozen=True, slots=True)
class ModelGroups:
    """The process groups a model computes over, from this rank: ``process_group`` is the TP group (the
    HSDP shard group), ``groups`` names every dimension's group (``tp``/``sp`` or ``shard``/``replicate``,
    and ``world``; ``None`` for a dimension of size 1) and ``coords`` this rank's index along each."""

    process_group: Any = None
    groups: Mapping[str, Any] = field(default_factory=dict)
    coords: Mapping[str, int] = field(default_factory=dict)
    tp_rank: int = -1  #: this rank's index in ``process_group`` (-1: the channel's rank)
    tp_size: int = 0  #: ``process_group``'s size (0: the channel's world size)
