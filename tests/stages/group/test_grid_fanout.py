"""Fan-out over a grid (CPU, gloo): TP2 × SP2 and HSDP shard × replicate 4×1, 2×2, 1×4.

Four real rank processes (one spawn for every layout: each layout's groups are built on the same
world).  Per layout, rank 0 is the leader: it alone fetches the payload through a real inline connector
(the producer's blob was made by the test process), runs the real :class:`GroupCompute` for two jobs,
then aborts a third (a miss) and stops; the other ranks run the real ``follow`` loop.  Every rank's model
records the digest of the payload it holds and checks the process groups it was given.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stageferry.broker.data.inline import InlineConnector
from stageferry.config import GroupLayout, PipelineConfig, StageConfig
from stageferry.embedded_redis import free_port
from stageferry.errors import PayloadUnavailableError
from stageferry.schemas import JobRequest
from stageferry.stages.entry.worker import ProgressSink, WorkItem
from stageferry.stages.group import aggregated
from stageferry.stages.group.grid import build_channel, coords, route_sources
from stageferry.stages.group.group import GroupCompute, connector_calls, follow
from stageferry.stages.group.group_channel import GroupChannel
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.stages.passthrough import make_payload, payload_digest

pytestmark = pytest.mark.timeout(240)

LAYOUTS = {
    "tp2xsp2": GroupLayout(tp=2, sp=2),
    "shard4xreplicate1": GroupLayout(shard=4, replicate=1),
    "shard2xreplicate2": GroupLayout(shard=2, replicate=2),
    "shard1xreplicate4": GroupLayout(shard=1, replicate=4),
}
JOBS = [JobRequest.model_validate({"prompt": "a cat", "width": 320, "height": 192, "seed": s}) for s in (1, 2)]
WORLD = 4


class Recorder:
    """A consumer model: records the payload's digest and what it learnt about its groups."""

    def __init__(self, out: Any, layout: str) -> None:
        self.out = out
        self.layout = layout

    def __call__(self, job: JobRequest, payload: Any, ctx: StageContext) -> None:
        sizes = {name: dist.get_world_size(g) if g is not None else 1 for name, g in ctx.groups.items()}
        # A collective over the TP (shard) group: the sum of its members' global ranks.
        mine = torch.tensor([ctx.rank], dtype=torch.int64)
        if ctx.process_group is not None:
            dist.all_reduce(mine, group=ctx.process_group)
        self.out.put(
            (
                "model",
                self.layout,
                ctx.rank,
                job.seed,
                payload_digest(payload),
                dict(ctx.coords),
                sizes,
                (ctx.tp_rank, ctx.tp_size),
                int(mine.item()),
            )
        )


def _rank(rank: int, port: int, tmp: str, out: Any) -> None:
    try:
        blobs = [((Path(tmp) / f"ref{i}.json").read_text(), (Path(tmp) / f"blob{i}").read_bytes()) for i in range(2)]
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        pipeline = PipelineConfig(stages=(StageConfig(name="diffusion"),))
        for name, layout in LAYOUTS.items():
            channel = build_channel(layout, rank, torch.device("cpu"))
            assert channel is not None
            stage = StageConfig(name="diffusion", layout=layout)
            model = Recorder(out, name)
            before = connector_calls()
            if rank == 0:
                compute = GroupCompute(model, stage, pipeline, channel)
                anyio.run(_lead, compute, blobs)
                calls, receipts = compute.rank_calls, compute.rank_receipts
                out.put(("leader", name, calls, receipts, list(before)))
            else:
                follow(model, stage, pipeline, channel)
        out.put(("aggregated", rank, _aggregated(rank)))
        dist.destroy_process_group()
    except BaseException:
        out.put(("error", rank, traceback.format_exc()))
        raise


def _aggregated(rank: int) -> list[Any]:
    """The aggregated model across the four ranks: a TP2 producer part on ranks 0-1, a TP4 consumer part
    on all four; a job, then a job whose producer part fails (on ranks 0-1 only)."""
    pipeline = PipelineConfig.model_validate(
        {
            "mode": "aggregated",
            "stages": [
                {"name": "encoder", "model": "tests.models:factory", "tp": 2},
                {"name": "diffusion", "model": "tests.models:factory", "tp": 4},
            ],
        }
    )
    stage = pipeline.stages[0]
    model = aggregated.factory(stage=stage, pipeline=pipeline)
    ctx = StageContext(
        stage=stage.name,
        rank=rank,
        world_size=WORLD,
        device=torch.device("cpu"),
        request_id="agg",
        key="agg",
        output_dir=Path("."),
        process_group=dist.group.WORLD,
    )
    before = connector_calls()
    results: list[Any] = []
    for job in (JOBS[0], JOBS[0].model_copy(update={"prompt": "fail here"})):
        try:
            output = model(job, None, ctx)
            results.append(output.info if isinstance(output, FinalOutput) else None)
        except Exception as exc:
            results.append(type(exc).__name__)
    results.append(connector_calls() == before)
    return results


async def _lead(compute: GroupCompute, blobs: list[tuple[str, bytes]]) -> None:
    """The leader: fetch each payload through a real connector, fan it out, compute; then a miss, then stop."""
    from stageferry.schemas import InlinePayload

    connector = InlineConnector(max_bytes=1 << 24, max_payload_bytes=1 << 24, cuda_device=None)
    for job, (ref_json, blob) in zip(JOBS, blobs, strict=True):
        ref = InlinePayload.model_validate_json(ref_json)
        async with connector.get(ref, blob, key=f"k-{job.seed}") as incoming:
            item = WorkItem(
                job=job,
                payload=incoming.payload,
                request_id=f"r-{job.seed}",
                key=f"k-{job.seed}",
                manifest=incoming.manifest,
                regions=incoming.regions,
            )
            await compute(item, ProgressSink())
    await compute.abort("r-miss", "k-miss", PayloadUnavailableError("the producer's copy is gone"))
    await compute.close()


def test_routes_reach_every_rank_once() -> None:
    """Pure layout arithmetic: each non-leader rank is the destination of exactly one broadcast."""
    for layout in LAYOUTS.values():
        receives = dict.fromkeys(range(WORLD), 0)
        for rank in range(WORLD):
            for dim, index, src in route_sources(layout, rank):
                members = layout.row_ranks(index) if dim == "row" else layout.column_ranks(index)
                assert rank in members and src in members
                receives[rank] += src != rank
        assert receives == {0: 0, 1: 1, 2: 1, 3: 1}, layout
    assert coords(GroupLayout(tp=2, sp=2), 3).row == 1 and coords(GroupLayout(tp=2, sp=2), 3).pos == 1


def test_grid_layouts_fan_out_one_payload_and_one_miss_to_every_rank(tmp_path: Path) -> None:
    producer = InlineConnector(max_bytes=1 << 24, max_payload_bytes=1 << 24, cuda_device=None)
    expected = {job.seed: payload_digest(make_payload(job, hidden=256)) for job in JOBS}

    async def produce() -> list[tuple[str, bytes]]:
        refs = []
        for job in JOBS:
            outgoing = await producer.put(f"k-{job.seed}", make_payload(job, hidden=256))
            assert outgoing.blob is not None
            refs.append((outgoing.ref.model_dump_json(), outgoing.blob))
        return refs

    blobs = anyio.run(produce)
    for i, (ref, blob) in enumerate(blobs):  # spawn arguments stay small (a full pipe serialises start-up)
        (tmp_path / f"ref{i}.json").write_text(ref)
        (tmp_path / f"blob{i}").write_bytes(blob)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got: list[tuple[Any, ...]] = []
    try:
        want = len(LAYOUTS) * (WORLD * len(JOBS) + 1) + WORLD
        while len(got) < want:
            msg = out.get(timeout=180)
            assert msg[0] != "error", msg[2]
            got.append(msg)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)

    payload_bytes = sum(len(b) for _, b in blobs)
    for name, layout in LAYOUTS.items():
        (leader,) = [m for m in got if m[0] == "leader" and m[1] == name]
        _, _, calls, receipts, before = leader
        # One consumer elected: the leader made the layout's two gets, no other rank touched a connector.
        assert calls[0][1] - before[1] == len(JOBS)
        assert all(c == [0, 0] for c in calls[1:]), calls
        # Every rank, the leader as sender, saw both jobs and the miss exactly once, and every payload byte.
        assert len(receipts) == WORLD
        assert receipts[0][:2] == [2, 1] and receipts[0][2] > 0
        assert all(r == receipts[0] for r in receipts), receipts
        assert receipts[0][2] == payload_bytes, "the regions fanned out are the blobs' bytes"

        models = [m for m in got if m[0] == "model" and m[1] == name]
        assert sorted((m[2], m[3]) for m in models) == sorted((r, j.seed) for r in range(WORLD) for j in JOBS)
        for _, _, rank, seed, digest, at, sizes, (tp_rank, tp_size), tp_sum in models:
            assert digest == expected[seed], (name, rank, "bit-identical payload on every rank")
            row, column = layout.dims
            assert at == {row: rank % layout.row_size, column: rank // layout.row_size}
            assert sizes == {row: layout.row_size, column: layout.rows, "world": WORLD}
            assert (tp_rank, tp_size) == (rank % layout.row_size, layout.row_size)
            assert tp_sum == sum(layout.row_ranks(rank // layout.row_size)), "the TP/shard group is the row"

    # Aggregated: the consumer part got the producer part's payload, bit for bit, with no connector call;
    # a producer part failing on ranks 0-1 fails the request on every rank (none waits for a hand-over).
    agg = {m[1]: m[2] for m in got if m[0] == "aggregated"}
    produced = payload_digest(make_payload(JOBS[0], hidden=256))
    assert [agg[r][0]["payload_sha256"] for r in range(WORLD)] == [produced] * WORLD
    assert agg[0][0]["aggregated"]["parts"] == ["encoder", "diffusion"]
    assert [agg[r][1] for r in range(WORLD)] == ["RuntimeError", "RuntimeError", "StageFailedError", "StageFailedError"]
    assert all(agg[r][2] for r in range(WORLD)), "no rank put or got a payload"


def test_solo_channel_counts_nothing() -> None:
    channel = GroupChannel.solo(torch.device("cpu"))
    assert channel.receipts() == [0, 0, 0]
    assert build_channel(GroupLayout(tp=1), 0, torch.device("cpu")) is not None
    assert build_channel(GroupLayout(tp=1), 1, torch.device("cpu")) is None
