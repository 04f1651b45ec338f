"""Layout metadata of a conditioning payload: what the diffusion stage must generate, and where.

On the wire it is an int64 tensor (``payload["layout"]``)::

    [version, task, width, height, fps, frames,
     latent_frames, latent_height, latent_width, audio_latents, n_keyframes, keyframe…]

— 11 header values, then ``n_keyframes`` frame indices (fl2va pins frames 0 and F-1; the other tasks
have none, so their layout is exactly 11 values).  :meth:`Layout.plain` gives the same facts as plain
JSON values for logs and traces.  Parsing checks the version first, then every value's range.

Version history: 1 — first version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stageferry.errors import EnvelopeError
from stageferry.schemas import JobRequest, Task
from stageferry.stages.reference import audio, vae

LAYOUT_VERSION = 1
HEADER = 11
TASK_CODES: dict[Task, int] = {Task.T2VA: 0, Task.FL2VA: 1, Task.REF2VA: 2}
_TASKS = {code: task for task, code in TASK_CODES.items()}


@dataclass(frozen=True, slots=True)
class Layout:
    task: Task
    width: int
    height: int
    fps: int
    frames: int
    latent_frames: int
    latent_height: int
    latent_width: int
    audio_latents: int  #: latent frames of the generated audio track
    keyframes: tuple[int, ...] = ()  #: video frame indices whose latents are given (pinned)
    version: int = LAYOUT_VERSION

    @classmethod
    def for_job(cls, job: JobRequest) -> Layout:
        return cls.of(job.task, job.width, job.height, job.fps, job.frame_count)

    @classmethod
    def of(cls, task: Task, width: int, height: int, fps: int, frames: int) -> Layout:
        """The layout a job of this task, size, fps and length gets."""
        return cls(
            task=task,
            width=width,
            height=height,
            fps=fps,
            frames=frames,
            latent_frames=vae.latent_frames(frames),
            latent_height=height // vae.SPATIAL,
            latent_width=width // vae.SPATIAL,
            audio_latents=audio.latent_count(audio.samples_for(frames, fps)),
            keyframes=(0, frames - 1) if task is Task.FL2VA else (),
        )

    @property
    def video_latent_shape(self) -> tuple[int, int, int, int]:
        return (vae.CHANNELS, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def audio_latent_shape(self) -> tuple[int, int, int]:
        return (1, audio.BANDS, self.audio_latents)

    @property
    def audio_samples(self) -> int:
        return audio.samples_for(self.frames, self.fps)

    def to_tensor(self) -> torch.Tensor:
        values = [
            self.version,
            TASK_CODES[self.task],
            self.width,
            self.height,
            self.fps,
            self.frames,
            self.latent_frames,
            self.latent_height,
            self.latent_width,
            self.audio_latents,
            len(self.keyframes),
            *self.keyframes,
        ]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: Any) -> Layout:
        """Parse and check a layout tensor; anything off is an :class:`EnvelopeError`."""
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1 or t.numel() < HEADER:
            raise EnvelopeError("payload layout must be a 1-d int64 tensor of at least 11 values")
        v = [int(x) for x in t.cpu().tolist()]
        if v[0] != LAYOUT_VERSION:
            raise EnvelopeError(
                f"payload layout version {v[0]} is not supported (expected {LAYOUT_VERSION})",
                version=v[0],
                expected=LAYOUT_VERSION,
            )
        if v[1] not in _TASKS or len(v) != HEADER + v[10]:
            raise EnvelopeError("payload layout has an unknown task or a wrong keyframe count")
        layout = cls(
            task=_TASKS[v[1]],
            width=v[2],
            height=v[3],
            fps=v[4],
            frames=v[5],
            latent_frames=v[6],
            latent_height=v[7],
            latent_width=v[8],
            audio_latents=v[9],
            keyframes=tuple(v[HEADER:]),
        )
        if min(layout.width, layout.height, layout.fps, layout.frames) < 1:
            raise EnvelopeError("payload layout has out-of-range sizes")
        if layout != cls.of(layout.task, layout.width, layout.height, layout.fps, layout.frames):
            raise EnvelopeError("payload layout is inconsistent (sizes, latent shapes or keyframes)")
        return layout

    def plain(self) -> dict[str, Any]:
        return {
            "layout_version": self.version,
            "task": self.task.value,
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames": self.frames,
            "video_latent_shape": list(self.video_latent_shape),
            "audio_latent_shape": list(self.audio_latent_shape),
            "audio_sample_rate": audio.SAMPLE_RATE,
            "keyframes": list(self.keyframes),
        }
