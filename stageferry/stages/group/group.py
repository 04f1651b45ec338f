"""Stage groups: N ranks in a layout (TP, TP × SP, HSDP shard × replicate), one leader.

``stageferry serve <stage>`` starts a *supervisor* that launches the layout's rank processes (or, under
torchrun, each process is one rank already).  Rank 0 is the leader: the only rank that talks to Redis
and to the data plane.  It reads an entry, fetches the payload once, and fans the job, its media and the
payload out to the followers (:class:`GroupCompute`, over :mod:`stageferry.stages.group.group_channel`, along
the layout's rows and then columns, :mod:`stageferry.stages.group.grid`); every rank then runs the model.  A
miss is fanned out too (``fail``), so followers never wait for a payload that will not come.

Health: the supervisor watches its ranks — if any rank dies, it stops the others and exits non-zero
(the un-acked entry is then reclaimed by another replica); rank processes die with their supervisor
(``PR_SET_PDEATHSIG``).  SIGTERM drains: the leader finishes the entry in hand, tells the followers to
stop, and everyone exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import datetime
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import torch.distributed as dist

from stageferry.broker.data import metrics
from stageferry.broker.data.payload_codec import pack_into, plan_payload
from stageferry.broker.data.staging import materialize
from stageferry.config import GroupLayout, PipelineConfig, StageConfig
from stageferry.errors import (
    CancelledRequestError,
    ConfigError,
    GroupBrokenError,
    StageFailedError,
    StageferryError,
    error_from_code,
)
from stageferry.heap import settle_heap
from stageferry.logs import bound_request
from stageferry.schemas import DeviceKind, JobRequest, Manifest
from stageferry.stages.chunk_stream import ChunkStream
from stageferry.stages.entry.worker import ProgressSink, WorkItem
from stageferry.stages.group.chunk_fanout import close_fanned, fan_out, follower_stream
from stageferry.stages.group.grid import build_channel
from stageferry.stages.group.group_channel import GroupChannel, MessageKind
from stageferry.stages.model import StageContext, StageModel, takes_chunks
from stageferry.stages.process.placement import StagePlacement

log = structlog.get_logger(__name__)

#: The leader sends a ``noop`` when idle this long, so followers' collectives never time out.
IDLE_NOOP_S = 2.0
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
_PR_SET_PDEATHSIG = 1


def rank_device(placement: StagePlacement, rank: int) -> torch.device:
    """The device the plan gives this rank (:mod:`stageferry.stages.process.placement`): never the GPU of
    another rank of the same group."""
    return torch.device(placement.ranks[rank].device)


def init_group(rank: int, layout: GroupLayout, device: torch.device) -> GroupChannel:
    """Join the torch.distributed group (env:// rendezvous) and build the layout's subgroups
    (:mod:`stageferry.stages.group.grid`); gloo for headers and CPU tensors, NCCL for CUDA tensors when the
    ranks have GPUs."""
    world_size = layout.world_size
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
    channel = build_channel(layout, rank, device)
    assert channel is not None  # every rank of the world is in its stage's layout
    return channel


def cpu_threads(ranks: int) -> int:
    """Torch threads for one of ``ranks`` CPU ranks sharing this host (oversubscription slows them all)."""
    return max(1, (os.cpu_count() or 1) // ranks)


def rank_context(
    stage: StageConfig,
    pipeline: PipelineConfig,
    channel: GroupChannel,
    *,
    request_id: str,
    key: str,
    media: dict[str, bytes],
    progress: ProgressSink | None = None,
    output_tensors: Callable[[Any], Any] | None = None,
    emit_chunk: Callable[..., None] | None = None,
) -> StageContext:
    return StageContext(
        output_tensors=output_tensors or materialize,
        emit_chunk=emit_chunk or (lambda payload, final=False: None),
        stage=stage.name,
        device=channel.device,
        request_id=request_id,
        key=key,
        output_dir=Path(pipeline.output_dir),
        report_progress=progress.report if progress is not None else (lambda step, total, phase=None: None),
        is_cancelled=(lambda: progress.cancelled) if progress is not None else (lambda: False),
        media=media,
        **placement(channel),
    )


def placement(channel: GroupChannel) -> dict[str, Any]:
    """The :class:`StageContext` fields that place a rank in its group: rank, size and process groups."""
    groups = channel.model_groups
    return {
        "rank": channel.rank,
        "world_size": channel.world_size,
        "process_group": groups.process_group,
        "groups": dict(groups.groups),
        "coords": dict(groups.coords),
        "tp_rank": groups.tp_rank if groups.tp_size else channel.rank,
        "tp_size": groups.tp_size or channel.world_size,
    }


def report_counts(channel: GroupChannel) -> tuple[list[list[int]], list[list[int]]]:
    """Every rank's ``[puts, gets]`` and ``[jobs, fails, payload bytes]`` (collective: all ranks call it)."""
    calls = channel.gather_counts(list(connector_calls()))
    return calls, channel.gather_counts(channel.receipts())


def connector_calls() -> tuple[int, int]:
    """This process's payload puts and gets, over all transports, from its own metrics."""

    def total(counter: Any) -> int:
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))

    return total(metrics.PUTS), total(metrics.GETS)


class GroupCompute:
    """The leader's side of a group: fan out, compute on every rank, agree on success.

    The model runs in one thread of its own (the *model thread*), one item at a time in call order.  A
    leader holding several entries (``entries_in_flight``) calls while an earlier call still runs: the
    call waits in the thread's queue, and the thread takes it the moment the earlier one ends, without
    a round trip through the event loop in between (a hop there and back per entry is what a lock around
    a thread-pool call would cost, and on a busy host each hop waits for a core)."""

    def __init__(self, model: StageModel, stage: StageConfig, pipeline: PipelineConfig, channel: GroupChannel):
        self.model = model
        self.stage = stage
        self.pipeline = pipeline
        self.channel = channel
        self.rank_calls: list[list[int]] = []
        self.rank_receipts: list[list[int]] = []
        self._lock = threading.Lock()  # one message at a time on the channel
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{stage.name}")
        self._last_sent = time.monotonic()
        self.broken = False

    async def __call__(self, item: WorkItem, progress: ProgressSink) -> Any:
        context = contextvars.copy_context()  # the caller's bound request id and key reach the model's logs
        done = asyncio.get_running_loop().run_in_executor(self._model_thread, context.run, self._run, item, progress)
        with anyio.CancelScope(shield=True):  # as anyio's run_sync: a started run is waited for, not abandoned
            return await done

    def _run(self, item: WorkItem, progress: ProgressSink) -> Any:
        chunked = isinstance(item.payload, ChunkStream)  # a streamed payload: each chunk is fanned out
        if chunked and not takes_chunks(self.model):  # refused before any rank hears of the job
            raise ConfigError(
                f"stage {self.stage.name!r} got a streamed payload, but its model does not take chunks "
                "(takes_chunks = True): stream only into stages whose models take chunks",
                stage=self.stage.name,
            )
        manifest, regions = (None, None) if chunked else _packed(item)
        header = {
            "request_id": item.request_id,
            "key": item.key,
            "job": item.job.model_dump_json(),
            "sent_at": time.time(),
            "chunked": chunked,
        }
        ctx = rank_context(
            self.stage,
            self.pipeline,
            self.channel,
            request_id=item.request_id,
            key=item.key,
            media=item.media,
            progress=progress,
            output_tensors=item.output_tensors,
            emit_chunk=item.emit_chunk,
        )
        if chunked and self.channel.world_size > 1:
            fan_out(item.payload, self.channel, pack=pack_payload)
        with self._lock, self._collectives():
            started = time.perf_counter()
            self.channel.send(MessageKind.JOB, header, media=item.media, manifest=manifest, buffers=regions)
            if self.channel.world_size > 1:
                log.info(
                    "group.fanout",
                    ranks=self.channel.world_size,
                    seconds=round(time.perf_counter() - started, 6),
                    bytes=manifest.total_bytes if manifest is not None else 0,
                )
            error: BaseException | None = None
            output = None
            try:
                output = self.model(item.job, item.payload, ctx)
            except Exception as exc:
                error = exc
                if chunked and self.channel.world_size > 1 and not item.payload.ended:
                    close_fanned(self.channel, exc)  # followers may wait for a chunk that will not come
            # A dead rank makes this fail too, and then the group — not the request — is what broke.
            any_failed = self.channel.any_failed(error is not None)
            self._last_sent = time.monotonic()
        if isinstance(error, StageferryError):
            raise error
        if error is not None:
            raise StageFailedError(f"{self.stage.name} model failed: {type(error).__name__}: {error}") from error
        if any_failed:
            raise StageFailedError(f"{self.stage.name}: a follower rank failed", stage=self.stage.name)
        return output

    async def abort(self, request_id: str, key: str, error: StageferryError) -> None:
        """Tell the followers the leader could not get this request's payload."""
        header = {"request_id": request_id, "key": key, "error": error.to_dict(), "sent_at": time.time()}
        await anyio.to_thread.run_sync(self._send, MessageKind.FAIL, header)

    async def idle(self) -> None:
        if time.monotonic() - self._last_sent >= IDLE_NOOP_S:
            await anyio.to_thread.run_sync(self._send, MessageKind.NOOP, {})

    async def close(self) -> None:
        """Release the followers; every rank then reports its connector calls (``rank_calls``) and the
        messages it sent or received (``rank_receipts``: jobs, fails, payload bytes)."""

        def stop() -> None:
            self._send(MessageKind.STOP, {})
            with self._collectives():
                self.rank_calls, self.rank_receipts = report_counts(self.channel)

        if not self.broken:
            await anyio.to_thread.run_sync(stop)
        self._model_thread.shutdown(wait=False)

    def _send(self, kind: MessageKind, header: dict[str, Any]) -> None:
        with self._lock, self._collectives():
            self.channel.send(kind, header)
            self._last_sent = time.monotonic()

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """A failed collective means a rank is gone: :class:`GroupBrokenError`, and no more messages."""
        if self.broken:
            raise GroupBrokenError("the stage group lost a rank", stage=self.stage.name)
        try:
            yield
        except (RuntimeError, dist.DistBackendError) as exc:
            self.broken = True
            log.error("group.broken", stage=self.stage.name, error=str(exc)[:500])
            raise GroupBrokenError(f"the stage group lost a rank: {exc}", stage=self.stage.name) from exc


def _packed(item: WorkItem) -> tuple[Manifest | None, dict[DeviceKind, torch.Tensor] | None]:
    """The payload's packed regions: as received (a NIXL slot) when available, else packed now."""
    if item.payload is None:
        return None, None
    if item.manifest is not None and item.regions is not None:
        return item.manifest, dict(item.regions)
    return pack_payload(item.payload)


def pack_payload(payload: Any) -> tuple[Manifest, dict[DeviceKind, torch.Tensor]]:
    """Pack ``payload`` into fresh region buffers (one per memory kind), as a connector would."""
    plan = plan_payload(payload)
    buffers = {
        r.device: torch.empty(r.nbytes, dtype=torch.uint8, device=_device_of(payload, r.device))
        for r in plan.manifest.regions
    }
    pack_into(plan, buffers)
    return plan.manifest, buffers


def _device_of(payload: Any, kind: DeviceKind) -> torch.device:
    if kind is DeviceKind.CPU:
        return torch.device("cpu")
    stack = [payload]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor) and node.is_cuda:
            return node.device
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list | tuple):
            stack.extend(node)
    return torch.device("cuda", torch.cuda.current_device())


def follow(model: StageModel, stage: StageConfig, pipeline: PipelineConfig, channel: GroupChannel) -> None:
    """A follower rank: receive, compute, agree — until the leader says stop."""
    settle_heap()
    log.info("group.follower_ready", stage=stage.name, rank=channel.rank)
    while True:
        message = channel.receive()
        header = message.header
        if message.kind is MessageKind.STOP:
            puts, gets = connector_calls()
            report_counts(channel)
            jobs, fails, nbytes = channel.receipts()
            log.info(
                "group.follower_stopping",
                stage=stage.name,
                rank=channel.rank,
                puts=puts,
                gets=gets,
                jobs=jobs,
                fails=fails,
                bytes=nbytes,
            )
            return
        if message.kind is MessageKind.NOOP:
            continue
        if message.kind is MessageKind.CHUNK:  # the end of a stream this rank's model had left already
            log.debug("group.stray_chunk", stage=stage.name, rank=channel.rank)
            continue
        request_id = str(header.get("request_id", ""))
        with bound_request(request_id, key=header.get("key"), stage=stage.name, rank=channel.rank):
            if message.kind is MessageKind.FAIL:
                _raise_leaders_error(header)
                continue
            failed = False
            try:
                job = JobRequest.model_validate_json(header["job"])
                payload = follower_stream(channel) if header.get("chunked") else message.payload
                ctx = rank_context(
                    stage, pipeline, channel, request_id=request_id, key=str(header.get("key")), media=message.media
                )
                model(job, payload, ctx)
            except CancelledRequestError as exc:  # every rank stops together (the sampler agrees per step)
                log.info("group.follower_cancelled", error=exc.message, **exc.details)
                failed = True
            except Exception:
                log.exception("group.follower_model_failed")
                failed = True
            channel.any_failed(failed)


def _raise_leaders_error(header: dict[str, Any]) -> None:
    """Raise (and log) on this follower the typed error the leader hit, then carry on serving."""
    err = header.get("error") or {}
    try:
        raise error_from_code(str(err.get("code", "")), str(err.get("message", "")), err.get("details"))
    except StageferryError as exc:
        lag = time.time() - float(header.get("sent_at", time.time()))
        log.warning("group.request_failed", code=exc.code, error=exc.message, lag_s=round(lag, 4))


# ---------------------------------------------------------------------- processes


def die_with_parent(*, follower: bool) -> None:
    """Ask the kernel to SIGKILL this rank if its supervisor dies (Linux; elsewhere a no-op).

    Followers ignore SIGTERM/SIGINT (a Ctrl-C or ``pkill`` reaches every process of the group): they
    stop when their leader, which drains first, tells them to."""
    if follower:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
