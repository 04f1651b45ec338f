"""Client-named local files: refused unless under a configured root, and then only regular files read
with a bound.  Every refusal reads the same, so it tells nothing about the path; probe errors carry no
object reprs.  Real files, a real FIFO, real device and /proc files."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from PIL import Image

from stageferry.broker.control.redis_conn import open_client
from stageferry.cli import sample_media
from stageferry.config import Limits
from stageferry.errors import JobValidationError
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.validation import check_job_limits
from stageferry.stages.entry.media import (
    _probe,
    describe,
    load_media,
    probe_audio_seconds,
    probe_image,
    probe_video_frames,
    read_local_file,
)
from stageferry.stages.reference.media_input import load_audio, load_image, load_video

FIELD = "media.first_frame.path"
PNG = sample_media(Task.FL2VA)["first_frame"].read_bytes()
MP4 = sample_media(Task.REF2VA)["reference_video"].read_bytes()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    media.mkdir()
    (media / "frame.png").write_bytes(PNG)
    return media


def refusal(path: str, roots: tuple[str, ...], max_bytes: int = 1 << 20) -> dict[str, object]:
    with pytest.raises(JobValidationError) as info:
        read_local_file(path, FIELD, roots, max_bytes)
    [error] = info.value.field_errors
    assert error["field"] == FIELD
    assert path not in info.value.message and path not in str(error["message"])
    return error


def test_a_regular_file_under_a_root_is_read(root: Path) -> None:
    assert read_local_file(str(root / "frame.png"), FIELD, (str(root),), 1 << 20) == PNG
    assert read_local_file(str(root / "sub" / ".." / "frame.png"), FIELD, (str(root),), 1 << 20) == PNG


def test_no_roots_no_paths(root: Path) -> None:
    error = refusal(str(root / "frame.png"), ())
    assert error["type"] == "path_not_allowed" and "upload" in str(error["message"])


def test_hostile_paths_are_refused_alike(root: Path, tmp_path: Path) -> None:
    roots = (str(root),)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    (root / "passwd").symlink_to("/etc/passwd")
    (root / "dir").mkdir()
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    (root / "escape.png").symlink_to(outside)
    cases = [
        str(fifo),  # would block a plain open() for good
        "/dev/zero",  # endless: a stat-then-read check never ends
        "/etc/passwd",
        "/proc/self/environ",
        str(root / "passwd"),  # a symlink out of the root
        str(root / "escape.png"),
        str(root / "dir"),
        str(root / "missing.png"),
        str(root / ".." / "secret.png"),
    ]
    messages = set()
    done = threading.Event()

    def run() -> None:
        for path in cases:
            error = refusal(path, roots)
            assert error["type"] == "path_not_allowed", (path, error)
            messages.add(error["message"])
        done.set()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert done.is_set(), "reading a hostile path blocked"
    assert len(messages) == 1, messages  # nothing tells a FIFO from a missing file from /etc/passwd


def test_a_root_that_is_a_symlink_is_resolved(root: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(root)
    assert read_local_file(str(link / "frame.png"), FIELD, (str(link),), 1 << 20) == PNG


def test_reads_are_bounded_and_a_file_too_large_is_refused_like_any_other(root: Path) -> None:
    """A file above the bound reads as every other refusal: its size (so its existence) stays unsaid."""
    big = refusal(str(root / "frame.png"), (str(root),), max_bytes=100)
    missing = refusal(str(root / "missing.png"), (str(root),), max_bytes=100)
    outside = refusal("/etc/passwd", (str(root),), max_bytes=100)
    assert big == missing == outside and big["type"] == "path_not_allowed", (big, missing, outside)
    assert str(len(PNG)) not in str(big["message"])


@pytest.mark.anyio
async def test_every_refused_path_of_a_job_is_reported_the_same_way(root: Path, redis_url: str) -> None:
    """The stage reports each refused path, as the lexical check before it does: two refused fields are
    two identical field errors, whether the paths lie outside the roots, are missing, or too large."""
    limits = Limits(media_roots=(str(root),), max_upload_bytes=1024)
    (root / "big.png").write_bytes(PNG * 3)  # above the limit

    def job(first: str, last: str) -> JobRequest:
        media = {"first_frame": {"path": first}, "last_frame": {"path": last}}
        return JobRequest.model_validate({"task": "fl2va", "prompt": "x", "width": 320, "height": 192, "media": media})

    with pytest.raises(JobValidationError) as lexical:
        check_job_limits(job("/etc/passwd", "/etc/shadow"), limits, upload_prefix="p:upload:x:")
    async with open_client(redis_url) as redis:
        with pytest.raises(JobValidationError) as read:
            await load_media(
                job(str(root / "big.png"), str(root / "missing.png")),
                redis=redis, upload_prefix="p:upload:x:", max_bytes=1024, min_audio_s=0.0,
                media_roots=limits.media_roots,
            )  # fmt: skip
    assert read.value.field_errors == lexical.value.field_errors
    assert [e["field"] for e in read.value.field_errors] == ["media.first_frame.path", "media.last_frame.path"]
    assert read.value.message == lexical.value.message


def test_probe_errors_show_no_object_reprs() -> None:
    for call in (
        lambda: probe_image(b"not an image", "media.first_frame"),
        lambda: load_image(b"not an image", 64, 64, field="media.first_frame"),
        lambda: probe_video_frames(b"not a video", "media.reference_video", limit=81),
        lambda: load_video(b"not a video", 64, 64, 8, 8, field="media.reference_video"),
    ):
        with pytest.raises(JobValidationError) as info:
            call()
        message = str(info.value.field_errors[0]["message"])
        assert "0x" not in message and "BytesIO" not in message and "<" not in message, message
    plain = describe(OSError("cannot identify image file <_io.BytesIO object at 0x7f3a2c>"))
    assert plain == "cannot identify image file"
    assert describe(OSError("[Errno 1094995529] Invalid data found when processing input: '<none>'")) == (
        "Invalid data found when processing input"
    )


def test_oversized_media_frames_are_refused_before_decoding() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (640, 480)).save(buf, format="PNG")
    with pytest.raises(JobValidationError) as info:
        _probe("first_frame", "media.first_frame", buf.getvalue(), 0.0, 320 * 240, 81)
    assert "max_media_pixels = 76800" in str(info.value.field_errors[0]["message"])
    with pytest.raises(JobValidationError):
        probe_video_frames(MP4, "media.reference_video", limit=81, max_pixels=64 * 64)


def test_streaming_video_decode_keeps_the_resampling() -> None:
    frames = load_video(MP4, 64, 64, 4, 6, field="media.reference_video")
    assert frames.shape[1:] == (3, 64, 64) and 1 <= frames.shape[0] <= 6


def _non_utf8_metadata(mp4: bytes) -> bytes:
    """``mp4`` with the first byte of its encoder tag's value made 0xff: metadata that is not UTF-8."""
    value = mp4.index(b"data", mp4.index(b"\xa9too")) + 12  # the tag's data atom: its type and locale first
    return mp4[:value] + b"\xff" + mp4[value + 1 :]


def test_metadata_that_is_not_utf8_is_ignored_not_an_internal_error() -> None:
    """PyAV reads metadata strictly by default: ``av.open`` itself raised ``UnicodeDecodeError`` (found by
    fuzzing: the request failed as an internal error).  The video's frames are what counts."""
    bad = _non_utf8_metadata(MP4)
    field = "media.reference_video"
    assert probe_video_frames(bad, field, limit=81) == probe_video_frames(MP4, field, limit=81) > 1
    assert load_video(bad, 64, 64, 8, 8, field=field).shape == load_video(MP4, 64, 64, 8, 8, field=field).shape
    with pytest.raises(JobValidationError) as info:  # the same bytes as audio: no audio stream, said so
        probe_audio_seconds(bad, "media.reference_audio")
    assert info.value.field_errors[0]["type"] == "bad_media"


def test_a_codec_without_a_decoder_is_bad_media() -> None:
    """A stream whose codec FFmpeg has no decoder for has no codec context: PyAV's ``AttributeError`` on it
    was an internal error; now it is ``bad_media`` naming the field, from the probe and the encoder's read."""
    unknown = MP4.replace(b"avc1", b"zzzz")  # the sample's H.264 sample entry renamed
    for call in (
        lambda: probe_video_frames(unknown, "media.reference_video", limit=81),
        lambda: load_video(unknown, 64, 64, 8, 8, field="media.reference_video"),
    ):
        with pytest.raises(JobValidationError) as info:
            call()
        [error] = info.value.field_errors
        assert error["field"] == "media.reference_video" and error["type"] == "bad_media"
        assert "no decoder" in str(error["message"]), error
    with pytest.raises(JobValidationError):
        load_audio(unknown, max_seconds=1.0, field="media.reference_audio")


def test_the_probe_decodes_as_far_as_the_encoder_reads() -> None:
    """A reference video is checked as far as ``limits.max_reference_frames`` frames, what the encoder
    takes, not to its end (a tiny upload of many large frames cost minutes of a stage's CPU)."""
    assert probe_video_frames(MP4, "media.reference_video", limit=3) == 3
    assert probe_video_frames(MP4, "media.reference_video", limit=1000) == 16  # the sample's every frame
