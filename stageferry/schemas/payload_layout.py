"""Layout metadata of a conditioning payload, and the latent geometry it is measured in.

The layout says what the diffusion stage must generate and where the given latents sit: a job's task,
size, fps and length, and the shapes that follow from them in the latent space the encoder → diffusion
contract (:mod:`stageferry.schemas.payload_contract`) is written for — video latents with 16 channels,
×8 spatial and ×4 temporal compression (frame 0 alone, then groups of 4), audio at 32 kHz in 64-band
latents, one per 640 samples.  The reference VAE and audio codec (``stages/reference``) take these
constants from here, so the contract and the models cannot disagree.

On the wire the layout is an int64 tensor (``payload["layout"]``)::

    [version, task, width, height, fps, frames,
     latent_frames, latent_height, latent_width, audio_latents, n_keyframes, keyframe…]

— 11 header values, then ``n_keyframes`` frame indices (fl2va pins frames 0 and F-1; the other tasks
have none, so their layout is exactly 11 values).  :meth:`Layout.plain` gives the same facts as plain
JSON values for logs and traces.  Parsing checks the version first, then every value's range; anything
off is a :class:`~stageferry.errors.PayloadContractError` naming the ``layout`` entry.

Version history: 1 — first version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from stageferry.errors import PayloadContractError
from stageferry.schemas.job import JobRequest, Task

LAYOUT_VERSION = 1
HEADER = 11
TASK_CODES: dict[Task, int] = {Task.T2VA: 0, Task.FL2VA: 1, Task.REF2VA: 2, Task.I2VA: 3}
_TASKS = {code: task for task, code in TASK_CODES.items()}

LATENT_CHANNELS = 16  #: video latent channels
SPATIAL = 8  #: video pixels per latent, each way
TEMPORAL = 4  #: video frames per latent frame (after frame 0, which is alone)
AUDIO_SAMPLE_RATE = 32_000  #: Hz
AUDIO_HOP = 640  #: audio samples per latent frame (20 ms)
AUDIO_BANDS = 64  #: audio latent channels
#: The layout tensor's values in order, with what each holds (the docs' table is made from this).
FIELDS: tuple[tuple[str, str], ...] = (
    ("version", f"layout version ({LAYOUT_VERSION})"),
    ("task", "0 t2va, 1 fl2va, 2 ref2va, 3 i2va"),
    ("width", "W, pixels"),
    ("height", "H, pixels"),
    ("fps", "frames per second"),
    ("frames", "F, video frames to generate"),
    ("latent_frames", f"1 + ceil((F - 1) / {TEMPORAL})"),
    ("latent_height", f"H / {SPATIAL}"),
    ("latent_width", f"W / {SPATIAL}"),
    ("audio_latents", f"round(F × {AUDIO_SAMPLE_RATE} / fps) // {AUDIO_HOP} + 1"),
    ("n_keyframes", "2 for fl2va, else 0"),
    ("keyframe…", "fl2va: 0 and F - 1 (the frames whose latents are given)"),
)


def latent_frames(frames: int) -> int:
    """Latent frames for ``frames`` video frames: frame 0 alone, then groups of 4."""
    return 1 + math.ceil(max(0, frames - 1) / TEMPORAL)


def latent_index(frame: int) -> int:
    """The latent frame that video frame ``frame`` belongs to."""
    return 0 if frame == 0 else (frame - 1) // TEMPORAL + 1


def audio_samples(frames: int, fps: int) -> int:
    """Samples of audio that last exactly as long as ``frames`` video frames at ``fps``."""
    return round(frames * AUDIO_SAMPLE_RATE / fps)


def audio_latent_count(samples: int) -> int:
    """Audio latent frames for ``samples`` samples (centred STFT frames)."""
    return samples // AUDIO_HOP + 1


def _bad(message: str, **details: Any) -> PayloadContractError:
    return PayloadContractError.of([("layout", message, "layout")], **details)


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
            latent_frames=latent_frames(frames),
            latent_height=height // SPATIAL,
            latent_width=width // SPATIAL,
            audio_latents=audio_latent_count(audio_samples(frames, fps)),
            keyframes=(0, frames - 1) if task is Task.FL2VA else (),
        )

    @property
    def video_latent_shape(self) -> tuple[int, int, int, int]:
        return (LATENT_CHANNELS, self.latent_frames, self.latent_height, self.latent_width)

    @property
    def audio_latent_shape(self) -> tuple[int, int, int]:
        return (1, AUDIO_BANDS, self.audio_latents)

    @property
    def audio_samples(self) -> int:
        return audio_samples(self.frames, self.fps)

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
        """Parse and check a layout tensor (any device); anything off names the ``layout`` entry."""
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise _bad(f"expected a 1-d int64 tensor of {HEADER} + keyframes values")
        if not HEADER <= t.numel() <= HEADER + 2:
            raise _bad(f"expected {HEADER} to {HEADER + 2} values, got {t.numel()}")
        v = [int(x) for x in t.cpu().tolist()]
        if v[0] != LAYOUT_VERSION:
            raise _bad(f"version {v[0]} is not supported (expected {LAYOUT_VERSION})", version=v[0])
        if v[1] not in _TASKS or len(v) != HEADER + v[10]:
            raise _bad("unknown task code or wrong keyframe count")
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
            raise _bad("sizes out of range")
        if layout != cls.of(layout.task, layout.width, layout.height, layout.fps, layout.frames):
            raise _bad("inconsistent (latent shapes or keyframes do not follow from the sizes)")
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
            "audio_sample_rate": AUDIO_SAMPLE_RATE,
            "keyframes": list(self.keyframes),
        }
