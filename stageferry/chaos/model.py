"""The soak's model: idempotent, payloads of the product's real sizes, and a check of every delivery.

* The first stage returns the conditioning payload of the job's task, with the byte totals measured
  on the real model (:mod:`stageferry.testing`: T2VA 359,024, FL2VA 11,158,136, Ref2VA 64,963,792
  bytes) plus a small tensor naming the request, so a payload delivered to the wrong request is caught.
  The task payloads are built once per process and reused: the same job gives the same bytes on every
  rank, replica and attempt (idempotent, as the delivery guarantees require).
* The last stage checks, on every rank, that the payload it holds is bit-for-bit the one for this job
  and this request — else it fails the request with a ``payload corrupted`` error the soak counts —
  then returns a small result.  Rank 0 appends ``<request_id> <pid>`` to ``STAGEFERRY_CHAOS_RECORD``
  so the soak can count how often the final stage really ran.
* A prompt starting with ``fail`` makes the first stage raise (a request that must end ``failed``).
* A prompt starting with ``stream`` makes the first stage **stream** (docs/streaming.md): a chunk after
  each step (``ctx.emit_chunk``), each naming the request and its index and holding
  :data:`STREAM_PART_BYTES` bytes drawn from both (so above the inline cap: NIXL, lease per chunk), then
  ``None`` to close the stream.  The last stage takes chunks (``takes_chunks``) and checks, on every rank,
  that it got every index once, in order, each with its own bytes — else ``payload corrupted``.

Each stage sleeps ``STAGEFERRY_CHAOS_STAGE_S`` (default 0.05 s) per step, reporting progress, so that
faults find requests in flight.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.chunk_stream import ChunkStream
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.testing import TASKS, assert_same

RECORD_ENV = "STAGEFERRY_CHAOS_RECORD"
STAGE_SECONDS_ENV = "STAGEFERRY_CHAOS_STAGE_S"
_TASK_NAMES = {"t2va": "T2VA", "fl2va": "FL2VA", "ref2va": "Ref2VA"}
#: Bytes of each streamed chunk's part (above ``data_plane.inline_max_bytes``' default: it goes over NIXL).
STREAM_PART_BYTES = 96 << 10


@functools.cache
def task_payload(task: str) -> Any:
    """The (cached, read-only) conditioning payload of ``task`` ("t2va", "fl2va", "ref2va")."""
    return TASKS[_TASK_NAMES[task]][0]()


def request_tag(request_id: str) -> torch.Tensor:
    return torch.tensor(list(request_id.encode()), dtype=torch.uint8)


def stream_part(request_id: str, index: int) -> torch.Tensor:
    """Chunk ``index``'s bytes for ``request_id``: the same on every rank, replica and attempt."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{request_id}:{index}".encode()))
    return torch.randint(0, 256, (STREAM_PART_BYTES,), dtype=torch.uint8, generator=gen)


def streams(job: JobRequest) -> bool:
    return job.prompt.startswith("stream")


class SoakModel:
    takes_chunks = True  #: the last stage takes a streamed payload (a whole one still comes as itself)

    def __init__(self, *, final: bool, step_s: float) -> None:
        self.final = final
        self.step_s = step_s

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        if job.prompt.startswith("fail") and payload is None:
            raise RuntimeError("scripted failure")
        steps = max(1, min(job.num_inference_steps, 20))
        stream = not self.final and streams(job)
        for step in range(1, steps + 1):
            time.sleep(self.step_s)
            ctx.report_progress(step, steps)
            if stream:
                tag = request_tag(ctx.request_id)
                ctx.emit_chunk({"index": torch.tensor([step - 1]), "request": tag,
                                "part": stream_part(ctx.request_id, step - 1)})  # fmt: skip
        if stream:
            return None  # closes the stream
        if not self.final:
            return {"conditioning": task_payload(job.task.value), "request": request_tag(ctx.request_id)}
        try:
            if streams(job):
                _check_stream(payload, ctx.request_id, steps)
            else:
                assert isinstance(payload, dict), f"payload is a {type(payload).__name__}"
                assert_same(payload["request"], request_tag(ctx.request_id), "$.request")
                assert_same(payload["conditioning"], task_payload(job.task.value), "$.conditioning")
        except (AssertionError, KeyError) as exc:
            raise RuntimeError(f"payload corrupted: {exc}") from exc
        record = os.environ.get(RECORD_ENV)
        if record and ctx.rank == 0:
            with open(record, "a") as fh:
                fh.write(f"{ctx.request_id} {os.getpid()}\n")
        return FinalOutput(data=f"ok {ctx.request_id} {job.task.value}".encode(), info={"task": job.task.value})


def _check_stream(payload: Any, request_id: str, steps: int) -> None:
    """Every chunk once, in order, each this request's and with its own bytes (AssertionError if not)."""
    assert isinstance(payload, ChunkStream), f"a streamed job's payload is a {type(payload).__name__}"
    seen = 0
    for chunk in payload:
        assert int(chunk["index"][0]) == seen, f"chunk {int(chunk['index'][0])} where {seen} was due"
        assert_same(chunk["request"], request_tag(request_id), f"$.chunks[{seen}].request")
        assert_same(chunk["part"], stream_part(request_id, seen), f"$.chunks[{seen}].part")
        seen += 1
    assert seen == steps, f"{seen} chunks of {steps}"


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> SoakModel:
    step_s = float(os.environ.get(STAGE_SECONDS_ENV, "0.05"))
    return SoakModel(final=pipeline.stages[-1].name == stage.name, step_s=step_s)
