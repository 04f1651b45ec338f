"""The models of ``benchmarks/streaming.py``: an AR-style producer and a consumer, chunked or whole.

Set by the benchmark through the environment (every stage process inherits it):

* ``STAGEFERRY_BENCH_MODE`` — ``chunked``: the producer emits a chunk after every step
  (``ctx.emit_chunk``) and the consumer takes them as they come; ``whole``: the producer returns the
  chunks concatenated after its last step, and the consumer takes the one payload;
* ``STAGEFERRY_BENCH_CHUNKS``, ``STAGEFERRY_BENCH_CHUNK_BYTES`` — how many chunks, and their size;
* ``STAGEFERRY_BENCH_STEP_S`` — the producer's compute per chunk (a decode step's time, slept);
* ``STAGEFERRY_BENCH_CONSUME_S`` — the consumer's compute per chunk's worth of data (a decode's, slept).

The consumer's result (JSON) says when it had the first chunk (or the whole payload) in hand and when it
finished, in ``time.time()`` seconds: the benchmark's time to first chunk.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import FinalOutput, StageContext


def _env() -> tuple[str, int, int, float, float]:
    return (
        os.environ.get("STAGEFERRY_BENCH_MODE", "chunked"),
        int(os.environ.get("STAGEFERRY_BENCH_CHUNKS", "8")),
        int(os.environ.get("STAGEFERRY_BENCH_CHUNK_BYTES", str(256 << 10))),
        float(os.environ.get("STAGEFERRY_BENCH_STEP_S", "0.02")),
        float(os.environ.get("STAGEFERRY_BENCH_CONSUME_S", "0.01")),
    )


class Producer:
    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        mode, chunks, chunk_bytes, step_s, _ = _env()
        parts = []
        for index in range(chunks):
            time.sleep(step_s)  # one step of the AR model
            part = torch.full((chunk_bytes // 4,), float(index), dtype=torch.float32, device=ctx.device)
            if mode == "chunked":
                ctx.emit_chunk({"latents": part})
            else:
                parts.append(part)
        return None if mode == "chunked" else {"latents": torch.cat(parts)}


class Consumer:
    takes_chunks = True

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        mode, chunks, _, _, consume_s = _env()
        assert payload is not None  # a consumer always gets its producer's output (or its chunks)
        first_at: float | None = None
        taken = 0
        if mode == "chunked":
            for chunk in payload:
                first_at = first_at or time.time()
                float(chunk["latents"][0])  # touch the bytes
                time.sleep(consume_s)
                taken += 1
        else:
            first_at = time.time()
            float(payload["latents"][-1])
            time.sleep(consume_s * chunks)
            taken = chunks
        return FinalOutput(data=json.dumps({"first_at": first_at, "done_at": time.time(), "chunks": taken}).encode())


def producer(*, stage: StageConfig, pipeline: PipelineConfig) -> Producer:
    return Producer()


def consumer(*, stage: StageConfig, pipeline: PipelineConfig) -> Consumer:
    return Consumer()
