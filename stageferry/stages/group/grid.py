"""A stage group's layout as process groups: rank coordinates, subgroups, and each rank's fan-out route.

A layout (:class:`stageferry.config.GroupLayout`) arranges ``rows × row_size`` ranks row-major:

* a **row** is a TP group (TP × SP) or an HSDP shard group — consecutive ranks;
* a **column** is an SP (Ulysses) group or an HSDP replicate group — ranks ``row_size`` apart.

TP2 × SP2 (and HSDP shard 2 × replicate 2)::

    row 0:  rank 0 ── rank 1        row groups (tp / shard):         {0, 1}  {2, 3}
              │         │           column groups (sp / replicate):  {0, 2}  {1, 3}
    row 1:  rank 2    rank 3

Rank 0 is the leader, the one payload consumer.  A message leaves it along row 0 (one broadcast over
the row group), then every member of row 0 forwards it down its own column (one broadcast per column,
all at once).  Each rank therefore takes part in at most two broadcasts per piece and receives every
message exactly once.  A 1-D layout (``tp = N``, shard N × replicate 1, or 1 × N) is a single broadcast
over the whole group, as before grids existed.

``torch.distributed.new_group`` must be called by every rank of the world, for every group, in the same
order: :func:`build_channel` does exactly that, whatever the calling rank, and hands back only the groups
that rank belongs to.  Groups may cover just the first ranks of the world (an aggregated stage's parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from stageferry.config import GroupLayout
from stageferry.stages.group.group_channel import GroupChannel, Hop, ModelGroups


@dataclass(frozen=True, slots=True)
class Coords:
    """A rank's place in a layout: ``row`` (its SP/replicate index) and ``pos`` (its TP/shard index)."""

    row: int
    pos: int


def coords(layout: GroupLayout, rank: int) -> Coords:
    return Coords(row=rank // layout.row_size, pos=rank % layout.row_size)


def route_sources(layout: GroupLayout, rank: int) -> list[tuple[str, int, int]]:
    """This rank's broadcasts, in order, as ``(dimension, index, src)``: the leader's row (``"row"``, 0,
    0) for the members of row 0, then its own column (``"column"``, pos, pos)."""
    at = coords(layout, rank)
    hops = []
    if at.row == 0 and layout.row_size > 1:
        hops.append(("row", 0, 0))
    if layout.rows > 1:
        hops.append(("column", at.pos, at.pos))
    return hops


@dataclass(frozen=True, slots=True)
class _Pair:
    """A group's gloo side (headers, CPU tensors) and device side (NCCL for CUDA; the same on CPU)."""

    cpu: Any
    device: Any


def _new_group(ranks: Sequence[int], *, cuda: bool) -> _Pair:
    """Create (on every rank) the group of ``ranks``; the whole world is the default group."""
    if list(ranks) == list(range(dist.get_world_size())):
        if cuda:
            return _Pair(dist.new_group(backend="gloo"), dist.group.WORLD)
        return _Pair(dist.group.WORLD, dist.group.WORLD)
    cpu = dist.new_group(list(ranks), backend="gloo")
    return _Pair(cpu, dist.new_group(list(ranks)) if cuda else cpu)


def build_channel(layout: GroupLayout, rank: int, device: torch.device) -> GroupChannel | None:
    """This rank's channel for a group of ``layout`` over global ranks ``0 .. world_size - 1``.

    Collective over the whole default group (every rank must call it, in the same order as its
    peers); ``None`` on ranks outside the layout."""
    world = layout.world_size
    member = rank < world
    if world == 1:
        return GroupChannel.solo(device) if member else None
    cuda = device.type == "cuda"
    whole = _new_group(range(world), cuda=cuda)
    # A dimension of size 1 has no group; a 1-D layout's only dimension is the whole group.
    rows = [
        (whole if layout.rows == 1 else _new_group(layout.row_ranks(r), cuda=cuda)) if layout.row_size > 1 else None
        for r in range(layout.rows)
    ]
    columns = [
        (whole if layout.row_size == 1 else _new_group(layout.column_ranks(p), cuda=cuda)) if layout.rows > 1 else None
        for p in range(layout.row_size)
    ]
    if not member:
        return None
    at = coords(layout, rank)
    route = []
    for dim, index, src in route_sources(layout, rank):
        pair = rows[index] if dim == "row" else columns[index]
        assert pair is not None
        route.append(Hop(src, pair.cpu, pair.device))
    row, column = rows[at.row], columns[at.pos]
    row_name, column_name = layout.dims
    groups = {
        row_name: row.device if row is not None else None,
        column_name: column.device if column is not None else None,
        "world": whole.device,
    }
    return GroupChannel(
        rank=rank,
        world_size=world,
        device=device,
        cpu_group=whole.cpu,
        device_group=whole.device,
        route=route,
        model_groups=ModelGroups(
            process_group=groups[row_name],
            groups=groups,
            coords={row_name: at.pos, column_name: at.row},
            tp_rank=at.pos,
            tp_size=layout.row_size,
        ),
    )
