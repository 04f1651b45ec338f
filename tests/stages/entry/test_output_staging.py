"""``StageContext.output_tensors`` inside a running stage worker (in this process: a real Redis, a real
NIXL agent on CPU, the model in its worker thread): the leader's model writes into the next hop's pool
slot and the put copies nothing; a model that raises after asking, or a payload that does not match, gives
the slot back; followers and the last stage get ordinary tensors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_conn import connect
from stageferry.broker.data.inline import InlineConnector
from stageferry.broker.data.nixl.connector import NixlConnector
from stageferry.broker.data.staging import blank
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.schemas import JobRequest, RequestState
from stageferry.stages.entry.worker import StageWorker
from stageferry.stages.group.group import GroupCompute
from stageferry.stages.group.group_channel import GroupChannel
from stageferry.stages.model import StageContext
from tests.procs import write_pipeline

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}


class Staging:
    """Asks for a 256 KiB output and writes into it; ``fail`` raises after asking, ``other`` returns a
    payload of another layout.  Remembers where its output tensors lived."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, job: JobRequest, payload: Any, ctx: StageContext) -> Any:
        out = ctx.output_tensors({"x": blank((256, 256), torch.float32, ctx.device), "seed": job.seed})
        self.seen.append(out["x"])
        torch.full((256, 256), 7.0, out=out["x"])
        if job.prompt == "fail":
            raise RuntimeError("the model failed after asking for its output")
        if job.prompt == "other":
            return {"x": out["x"][:128].clone(), "seed": job.seed}
        return out


@asynccontextmanager
async def encoder(tmp_path: Path, redis_url: str, prefix: str) -> AsyncIterator[tuple[Client, NixlConnector, Staging]]:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}],
        data_plane={"connector": "nixl"},
    )
    pipeline = PipelineConfig.load(path)
    stage = pipeline.stages[0]
    redis = connect(redis_url)
    producer = NixlConnector(
        redis=redis,
        keys=Keys(prefix),
        stage="encoder",
        replica="a",
        config=pipeline.data_plane,
        timeouts=pipeline.timeouts,
    )
    await anyio.to_thread.run_sync(producer.open)
    model = Staging()
    worker = StageWorker(
        redis=redis,
        keys=Keys(prefix),
        pipeline=pipeline,
        stage=stage,
        replica="a",
        compute=GroupCompute(model, stage, pipeline, GroupChannel.solo(torch.device("cpu"))),  # type: ignore[arg-type]
        input_connector=None,
        output_connector=producer,
    )
    async with Client(redis_url, prefix=prefix, pipeline=pipeline) as client, anyio.create_task_group() as tg:
        await tg.start(producer.run)
        tg.start_soon(worker.run)
        try:
            yield client, producer, model
        finally:
            worker.stop()
            tg.cancel_scope.cancel()
    await producer.aclose()
    await redis.aclose()


async def settled(client: Client, rid: str) -> Any:
    with anyio.fail_after(60):
        while True:
            status = await client.status(rid)
            if status is not None and (status.state.terminal or status.stage == "diffusion"):
                return status
            await anyio.sleep(0.05)


def in_use(conn: NixlConnector) -> int:
    assert conn.pools is not None
    return conn.pools.slots_in_use


async def test_the_leader_writes_into_the_slot_and_the_put_copies_nothing(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    async with encoder(tmp_path, redis_url, prefix) as (client, producer, model):
        status = await settled(client, await client.submit(JOB))
        assert status.state is RequestState.QUEUED and status.stage == "diffusion"
        assert producer.counters.staged_puts == 1 and producer.counters.staged_copies == 0
        assert in_use(producer) == 1 and len(producer.stagings) == 0, "the lease holds the staged slot"
        (lease,) = (producer.leases.get(t) for t in list(producer.leases._leases))
        assert lease is not None and lease.slots[next(iter(lease.slots))].view.data_ptr() == model.seen[0].data_ptr()


async def test_a_model_that_raises_after_asking_gives_the_slot_back(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    async with encoder(tmp_path, redis_url, prefix) as (client, producer, _):
        status = await settled(client, await client.submit({**JOB, "prompt": "fail"}))
        assert status.state is RequestState.FAILED
        assert producer.counters.stagings == 1 and in_use(producer) == 0 and len(producer.stagings) == 0


async def test_another_layout_is_put_the_ordinary_way_and_the_staging_freed(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    async with encoder(tmp_path, redis_url, prefix) as (client, producer, _):
        status = await settled(client, await client.submit({**JOB, "prompt": "other"}))
        assert status.stage == "diffusion" and producer.counters.staged_puts == 0 and producer.counters.puts == 1
        assert in_use(producer) == 1 and len(producer.stagings) == 0, "only the put's own slot, leased"


async def test_without_a_nixl_connector_and_on_followers_the_tensors_are_ordinary() -> None:
    template = {"x": blank((4, 3), torch.float16, "cpu"), "n": 1, "t": (blank((0,), torch.int64, "cpu"),)}
    ctx = StageContext(
        stage="s", rank=1, world_size=2, device=torch.device("cpu"), request_id="r", key="k", output_dir=Path(".")
    )
    for out in (
        ctx.output_tensors(template),
        await InlineConnector(max_bytes=1, max_payload_bytes=1, cuda_device=None).stage("k", template),
    ):
        assert out["x"].shape == (4, 3) and out["x"].dtype == torch.float16 and out["x"].stride() == (3, 1)
        assert out["n"] == 1 and out["t"][0].shape == (0,)
        out["x"].fill_(1.0)  # writable: its own memory
