"""Models for tests, plugged in by ``module:factory`` exactly as a user's model would be.

Behaviour is driven by the job's prompt, so one pipeline config serves every test:

* ``sleep:<seconds>`` — sleep that long (in steps, reporting progress) before producing the output;
* ``poison`` — kill the whole process at once (a request that crashes its worker every time);
* ``fail`` — raise an ordinary exception (the request fails with ``stage_failed``).

With ``STAGEFERRY_TEST_PAYLOAD_ON_DEVICE`` set, the producer's payload lives on its rank's device (GPU).

Every completed run appends ``<stage> <request_id>`` (rank 0 only) to the file named by
``STAGEFERRY_TEST_RECORD``, so tests can count executions across processes; with
``STAGEFERRY_TEST_DIGESTS`` every rank appends ``<stage> <request_id> <rank> <sha256>`` of the payload it
holds.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.schemas import JobRequest
from stageferry.stages.model import StageContext
from stageferry.stages.passthrough import Passthrough, payload_digest


class Scripted(Passthrough):
    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        prompt = job.prompt
        if prompt.startswith("poison"):
            os._exit(17)
        if prompt.startswith("fail"):
            raise RuntimeError("scripted failure")
        if prompt.startswith("sleep:") and ctx.stage == os.environ.get("STAGEFERRY_TEST_SLOW_STAGE", ctx.stage):
            seconds = float(prompt.split(":", 1)[1].split()[0])
            steps = max(1, int(seconds / 0.1))
            for step in range(1, steps + 1):
                time.sleep(seconds / steps)
                ctx.report_progress(step, steps)
                if ctx.is_cancelled():
                    break
        result = super().__call__(job, payload, ctx)
        if isinstance(result, dict) and os.environ.get("STAGEFERRY_TEST_PAYLOAD_ON_DEVICE"):
            result = {k: v.to(ctx.device) if isinstance(v, torch.Tensor) else v for k, v in result.items()}
        record = os.environ.get("STAGEFERRY_TEST_RECORD")
        if record and ctx.rank == 0:
            with open(record, "a") as fh:
                fh.write(f"{ctx.stage} {ctx.request_id}\n")
        digests = os.environ.get("STAGEFERRY_TEST_DIGESTS")
        if digests:  # what every rank holds: the input payload (consumers) or the output (producers)
            held = payload if payload is not None else result
            with open(digests, "a") as fh:
                fh.write(f"{ctx.stage} {ctx.request_id} {ctx.rank} {payload_digest(held)}\n")
        return result


def factory(*, stage: StageConfig, pipeline: PipelineConfig) -> Scripted:
    hidden = int(os.environ.get("STAGEFERRY_TEST_HIDDEN", "256"))
    return Scripted(final=pipeline.stages[-1].name == stage.name, hidden=hidden, delay_s=0.0)


# ---------------------------------------------------------------------- streaming (issue 40)
#
# ``streamer`` is an AR-style producer (the thinker → talker shape): it runs ``steps`` decode steps and
# emits a chunk every ``every`` steps, each ``{"index": [i], "data": <hidden floats>}`` (seeded by the
# request and the index, so a recomputed chunk equals the first).  Its prompt says how:
# ``stream chunks:<n> every:<k> [step_s:<s>] [die_at:<i>] [stall_at:<i>:<s>]`` — ``die_at``: the process
# exits before emitting chunk i (once per request, marked under STAGEFERRY_TEST_MARKS); ``stall_at``: it
# sleeps s seconds before chunk i.  ``chunk_consumer`` takes the chunks (``takes_chunks``), checks each
# one's content, sleeps ``consume_s:<s>`` per chunk, and with ``consumer_dies_at:<i>`` exits after
# taking chunk i (once per request).  Every chunk a consumer run applies is appended to
# STAGEFERRY_TEST_CHUNKS as ``<run> <request_id> <index>``; its result (JSON) lists the indices it applied.


def _opts(prompt: str) -> dict[str, str]:
    return dict(part.split(":", 1) for part in prompt.split() if ":" in part)


def chunk_data(request_id: str, index: int, hidden: int) -> torch.Tensor:
    seed = int.from_bytes(request_id.encode()[-6:].rjust(6, b"\0"), "big") * 1000 + index
    return torch.randn(hidden, generator=torch.Generator().manual_seed(seed))


def _once(name: str, request_id: str) -> bool:
    """True the first time ``name`` happens for ``request_id`` (a marker file), across processes."""
    marks = os.environ.get("STAGEFERRY_TEST_MARKS")
    if not marks:
        return False
    path = os.path.join(marks, f"{name}-{request_id}")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


class Streamer:
    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        opts = _opts(job.prompt)
        chunks, every = int(opts.get("chunks", "4")), int(opts.get("every", "2"))
        step_s = float(opts.get("step_s", "0"))
        stall = opts.get("stall_at", "").split(":") if "stall_at" in opts else None
        state = torch.zeros(self.hidden)
        for step in range(chunks * every):
            state = state * 0.5 + 1.0  # one "decode step"
            if step_s:
                time.sleep(step_s)
            ctx.report_progress(step + 1, chunks * every)
            if (step + 1) % every:
                continue
            index = step // every
            if "die_at" in opts and int(opts["die_at"]) == index and _once("producer", ctx.request_id):
                os._exit(19)
            if stall is not None and int(stall[0]) == index:
                time.sleep(float(stall[1]))
            if "fail_at" in opts and int(opts["fail_at"]) == index:  # the model breaks mid-stream
                raise RuntimeError(f"the producer broke before chunk {index}")
            ctx.emit_chunk({"index": torch.tensor([index]), "data": chunk_data(ctx.request_id, index, self.hidden)})
        return None


class ChunkConsumer:
    takes_chunks = True

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> Any:
        import json
        import uuid

        from stageferry.stages.model import FinalOutput

        opts = _opts(job.prompt)
        consume_s = float(opts.get("consume_s", "0"))
        run = uuid.uuid4().hex[:12]
        applied: list[int] = []
        record = os.environ.get("STAGEFERRY_TEST_CHUNKS")
        assert payload is not None, "a consumer stage always has an input"
        for chunk in payload:
            index = int(chunk["index"][0])
            if not torch.equal(chunk["data"], chunk_data(ctx.request_id, index, self.hidden)):
                raise RuntimeError(f"chunk {index} holds the wrong bytes")
            applied.append(index)
            if record:  # followers (TP ranks) to a file of their own
                with open(record if ctx.rank == 0 else f"{record}.rank{ctx.rank}", "a") as fh:
                    fh.write(f"{run} {ctx.request_id} {index}\n")
            if consume_s:
                time.sleep(consume_s)
            dies = opts.get("consumer_dies_at")
            if dies is not None and int(dies) == index and ctx.rank == 0 and _once("consumer", ctx.request_id):
                os._exit(23)
            if "take" in opts and len(applied) >= int(opts["take"]):  # done before the last chunk
                break
        return FinalOutput(data=json.dumps({"run": run, "applied": applied}).encode())


def streamer(*, stage: StageConfig, pipeline: PipelineConfig) -> Streamer:
    return Streamer(int(os.environ.get("STAGEFERRY_TEST_HIDDEN", "256")))


def chunk_consumer(*, stage: StageConfig, pipeline: PipelineConfig) -> ChunkConsumer:
    return ChunkConsumer(int(os.environ.get("STAGEFERRY_TEST_HIDDEN", "256")))
