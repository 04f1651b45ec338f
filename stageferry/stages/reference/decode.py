"""The reference decode stage: latents in temporal chunks → a fragmented MP4 written as they come.

The third stage of the streamed reference pipeline (``examples/streamed_reference/pipeline.toml``):
the diffusion stage, with ``stream_latent_frames = N``, streams its final latents in chunks of N latent
frames (:func:`stageferry.stages.reference.diffusion.latent_chunks`: ``first``, ``video_latents``
[16, n, h, w], and in the first chunk ``audio_latents``).  This stage takes them as they are announced
(``takes_chunks``) and, on rank 0:

1. decodes the audio track from the first chunk (it is small) and opens the fragmented MP4
   (:class:`~stageferry.stages.reference.fmp4.FragmentedMp4`, ``<output_dir>/<request_id>.mp4.part``),
   one fragment per chunk's worth of frames;
2. for each chunk, VAE-decodes every frame the latents so far determine (a frame interpolates between the
   two latent frames around it: :func:`~stageferry.stages.reference.vae.decodable`) and muxes them — so
   the first fragment is on disk while later latents are still on their way;
3. after the last chunk, decodes the rest, closes the file (renamed to ``<request_id>.mp4``) and returns
   :class:`FinalOutput` with the probed media facts, as the two-stage diffusion stage does.

The VAE decode (on the stage's device) and the mux (colour conversion, H.264 and AAC encoding: CPU) overlap:
a writer thread of this request encodes a chunk's frames while the model thread decodes the next chunk's,
at most :data:`MUX_AHEAD` chunks of frames waiting for it (so decoded frames do not pile up in memory when
the encoder is the slower).  Frames reach the file in order; a writer error ends the request as it would
in the model thread.

The frames are those the two-stage pipeline's diffusion stage decodes from the same latents. A whole
payload (one dict holding all the latents) is taken too.  The weights' ``seed`` must be the diffusion
stage's.  Other ranks only drain the stream: decoding is not sharded.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import PayloadContractError
from stageferry.schemas import JobRequest
from stageferry.schemas.payload_layout import TEMPORAL, Layout
from stageferry.stages.model import FinalOutput, StageContext
from stageferry.stages.reference import audio
from stageferry.stages.reference.audio import AudioCodec
from stageferry.stages.reference.fmp4 import FragmentedMp4
from stageferry.stages.reference.mp4 import probe_mp4
from stageferry.stages.reference.vae import VideoVAE, decodable

MODEL_NAME = "stageferry.reference.decode/1"
#: Chunks of decoded frames that may wait for the writer thread while the next chunk decodes.
MUX_AHEAD = 2


class ReferenceDecode:
    takes_chunks = True

    def __init__(self, *, seed: int = 0, qp: int = 23, preset: str = "veryfast") -> None:
        self.seed, self.qp, self.preset = seed, qp, preset
        self._nets: dict[str, tuple[VideoVAE, AudioCodec]] = {}

    def nets(self, device: torch.device) -> tuple[VideoVAE, AudioCodec]:
        key = str(device)
        if key not in self._nets:
            self._nets[key] = (VideoVAE(seed=self.seed, device=device), AudioCodec(seed=self.seed, device=device))
        return self._nets[key]

    def __call__(self, job: JobRequest, payload: Any | None, ctx: StageContext) -> FinalOutput | None:
        if isinstance(payload, dict):  # a whole payload: one chunk of all the latents
            chunks: Iterable[Any] = [payload]
        elif isinstance(payload, Iterable):  # a ChunkStream
            chunks = payload
        else:
            raise PayloadContractError(f"the decode stage takes latents, not {type(payload).__name__}")
        if ctx.rank != 0:
            for _ in chunks:  # the leader decodes; followers keep pace with the stream
                pass
            return None
        started = time.perf_counter()
        layout = Layout.for_job(job)
        vae, codec = self.nets(ctx.device)
        path = Path(ctx.output_dir) / f"{ctx.request_id}.mp4"
        have: list[torch.Tensor] = []
        written = 0
        writer: FragmentedMp4 | None = None
        mux = _Mux(started)
        try:
            with torch.inference_mode(), mux:
                for chunk in chunks:
                    latents = _latents_of(chunk, sum(int(t.shape[1]) for t in have), layout)
                    have.append(latents.to(torch.float32).clone())  # the chunk's view is freed by the next
                    if writer is None:
                        wave = codec.decode(chunk["audio_latents"], layout.audio_samples, seed=job.seed)
                        gop = TEMPORAL * int(latents.shape[1])
                        writer = FragmentedMp4(path, width=layout.width, height=layout.height, fps=layout.fps,
                                               gop=gop, audio=wave, sample_rate=audio.SAMPLE_RATE,
                                               qp=self.qp, preset=self.preset)  # fmt: skip
                    k = sum(int(t.shape[1]) for t in have)
                    upto = decodable(layout.frames, layout.latent_frames, k)
                    if upto > written:
                        z = torch.cat(have, dim=1)
                        frames = vae.decode_range(z, layout.frames, layout.latent_frames, written, upto)
                        mux.submit(writer, frames)
                        written = upto
                mux.drain()
                if writer is None or written < layout.frames:
                    got = sum(int(t.shape[1]) for t in have)
                    raise PayloadContractError(
                        f"the latents ended at {got} of {layout.latent_frames} latent frames",
                        got=got,
                        want=layout.latent_frames,
                    )
                path = writer.close()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        info = {
            "model": MODEL_NAME,
            "task": job.task.value,
            "seed": job.seed,
            "chunks": len(have),
            "frames_sha256": mux.digest.hexdigest(),
            "timings": {"first_frames_s": mux.first_s, "decode_mux_s": round(time.perf_counter() - started, 3)},
        }
        return FinalOutput(path=path, media=probe_mp4(path), info=info)


class _Mux:
    """One request's writer thread: frames written in order, at most :data:`MUX_AHEAD` waiting; the
    frames' digest (as the two-stage diffusion stage's ``frames_sha256``) and when the first were written.
    Leaving the block waits for the thread; on an error, after dropping the writes not started."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.digest = hashlib.sha256()
        self.first_s: float | None = None
        self._pending: deque[Future[None]] = deque()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fmp4")

    def __enter__(self) -> _Mux:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if kind is not None:
            for future in self._pending:
                future.cancel()
            self._pending.clear()
        self._thread.shutdown(wait=True)

    def submit(self, writer: FragmentedMp4, frames: torch.Tensor) -> None:
        """Queue ``frames`` for the writer; waits (and raises its error) while :data:`MUX_AHEAD` are queued."""
        while len(self._pending) >= MUX_AHEAD:
            self._pending.popleft().result()
        self._pending.append(self._thread.submit(self._write, writer, frames))

    def _write(self, writer: FragmentedMp4, frames: torch.Tensor) -> None:
        frames = frames.contiguous()
        self.digest.update(frames.numpy().data)  # the contiguous bytes, not a copy
        writer.write(frames)
        if self.first_s is None:
            self.first_s = round(time.perf_counter() - self.started, 3)

    def drain(self) -> None:
        """Wait for every queued write (raising the first error)."""
        while self._pending:
            self._pending.popleft().result()


def _latents_of(chunk: Any, expect_first: int, layout: Layout) -> torch.Tensor:
    """A chunk's video latents, checked against the job's layout and the chunks before it."""
    try:
        latents, first = chunk["video_latents"], int(chunk["first"][0])
    except (TypeError, KeyError, IndexError) as exc:
        raise PayloadContractError(f"a latent chunk needs first and video_latents: {exc}") from exc
    c, _, h, w = layout.video_latent_shape
    ok = isinstance(latents, torch.Tensor) and latents.dim() == 4 and tuple(latents.shape[::2]) == (c, h)
    if not ok or latents.shape[3] != w or first != expect_first or first + latents.shape[1] > layout.latent_frames:
        raise PayloadContractError(
            f"latent chunk at {first} does not fit the layout (want [{c}, n, {h}, {w}] from {expect_first})",
            first=first,
        )
    if expect_first == 0 and "audio_latents" not in chunk:
        raise PayloadContractError("the first latent chunk carries the audio latents")
    return latents


def factory(
    *, stage: StageConfig, pipeline: PipelineConfig, seed: int = 0, qp: int = 23, preset: str = "veryfast"
) -> ReferenceDecode:
    """The reference decode stage (VAE decode + fragmented-MP4 mux); ``seed`` must be the diffusion stage's."""
    return ReferenceDecode(seed=seed, qp=qp, preset=preset)
