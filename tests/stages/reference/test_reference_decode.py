"""The reference pipeline in three stages: the diffusion stage streams its final latents in temporal chunks
(``stream_latent_frames``), the decode stage VAE-decodes each chunk's frames as it comes and writes a
fragmented MP4 — its first fragments are in the file before the last chunk is asked for — with the very
frames the two-stage diffusion stage decodes from the same job.  Tiny sizes, on CPU, run in-process with a
hand-built ``StageContext`` (as tests/stages/reference/test_reference_models.py does); the chunk stream is the
runtime's ``ChunkStream`` over the chunks the diffusion stage emitted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import av
import pytest
import torch

from stageferry.config import PipelineConfig, StageConfig
from stageferry.errors import ConfigError, PayloadContractError
from stageferry.schemas.payload_layout import latent_frames
from stageferry.stages.chunk_stream import Chunk, ChunkStream
from stageferry.stages.model import FinalOutput
from stageferry.stages.reference import decode, diffusion, encoder
from stageferry.stages.reference.fmp4 import FragmentedMp4, part_path
from stageferry.stages.reference.vae import VideoVAE, decodable
from tests.stages.reference.test_reference_models import SMALL, context, job
from tests.waits import until_sync

pytestmark = pytest.mark.timeout(120)
PIPE = PipelineConfig()
FRAMES = 17  # 5 latent frames: frame 0 alone, then groups of 4


def stream_of(chunks: list[Any], before: Callable[[int], None] = lambda i: None) -> ChunkStream:
    """The runtime's ChunkStream over ``chunks``; ``before(i)`` runs when chunk ``i`` is asked for."""
    it = iter(enumerate(chunks))

    def next_chunk() -> Chunk | None:
        item = next(it, None)
        if item is None:
            return None
        before(item[0])
        return Chunk(item[0], item[1], final=item[0] == len(chunks) - 1)

    return ChunkStream(next_chunk)


def test_a_chunk_of_latents_decodes_the_frames_of_the_whole_decode() -> None:
    vae = VideoVAE(seed=0)
    total = latent_frames(FRAMES)
    z = torch.randn(16, total, 6, 10, generator=torch.Generator().manual_seed(3))
    whole = vae.decode(z, FRAMES)
    got, written = [], 0
    for k in range(1, total + 1):
        upto = decodable(FRAMES, total, k)
        got.append(vae.decode_range(z[:, :k], FRAMES, total, written, upto))
        written = upto
    assert [decodable(FRAMES, total, k) for k in range(1, total + 1)] == [0, 3, 7, 11, 17]
    assert torch.equal(torch.cat(got), whole)
    with pytest.raises(ValueError, match="need latent frame"):
        vae.decode_range(z[:, :1], FRAMES, total, 0, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("three-stage")
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=256)
    j = job("t2va", num_frames=FRAMES, num_inference_steps=2, guidance=1.0)
    emitted: list[Any] = []
    ctx = context(tmp, request_id="req-two", emit_chunk=lambda chunk, final=False: emitted.append(chunk))
    cond = enc(j, None, ctx)
    two = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, **SMALL)(j, cond, ctx)
    streamer = diffusion.factory(stage=PIPE.stages[1], pipeline=PIPE, stream_latent_frames=1, **SMALL)
    assert streamer(j, cond, context(tmp, emit_chunk=lambda chunk, final=False: emitted.append(chunk))) is None
    return {"tmp": tmp, "job": j, "two": two, "chunks": emitted}


def test_the_diffusion_stage_streams_its_latents_in_temporal_chunks(runs: dict[str, Any]) -> None:
    chunks = runs["chunks"]
    assert [int(c["first"][0]) for c in chunks] == list(range(latent_frames(FRAMES)))
    assert "audio_latents" in chunks[0] and all("audio_latents" not in c for c in chunks[1:])
    assert list(torch.cat([c["video_latents"] for c in chunks], dim=1).shape) == runs["two"].info["video_latent_shape"]


def test_the_decode_stage_writes_a_fragmented_mp4_as_the_chunks_come(runs: dict[str, Any]) -> None:
    tmp, j, two = runs["tmp"], runs["job"], runs["two"]
    ctx = context(tmp, request_id="req-three")
    part = part_path(tmp / "req-three.mp4")
    seen: dict[int, bytes] = {}
    last = len(runs["chunks"]) - 1

    def before(i: int) -> None:
        if i == last:  # the writer thread muxes the chunks before: their fragments reach the file meanwhile
            until_sync(lambda: part.exists() and b"moof" in part.read_bytes(), "a fragment before the last chunk")
        seen[i] = part.read_bytes() if part.exists() else b""

    out = decode.factory(stage=StageConfig(name="decode"), pipeline=PIPE)(j, stream_of(runs["chunks"], before), ctx)
    assert isinstance(out, FinalOutput) and out.path == tmp / "req-three.mp4" and not part.exists()
    assert out.path is not None
    assert b"moof" in seen[last] and b"mvex" in seen[last], "fragments are in the file before the last chunk"
    assert len(seen[last]) < out.path.stat().st_size
    assert out.info["frames_sha256"] == two.info["frames_sha256"], "the two-stage pipeline's frames"
    assert out.info["chunks"] == latent_frames(FRAMES)
    assert out.media["frames"] == j.frame_count and out.media["video_codec"] == "h264"
    assert out.media["audio_codec"] == "aac" and out.media["audio_duration_s"] > 0
    with av.open(str(out.path)) as container:  # decodable end to end
        assert sum(1 for _ in container.decode(video=0)) == j.frame_count


def test_a_whole_payload_decodes_the_same(runs: dict[str, Any]) -> None:
    chunks = runs["chunks"]
    whole = {**chunks[0], "video_latents": torch.cat([c["video_latents"] for c in chunks], dim=1)}
    ctx = context(runs["tmp"], request_id="req-whole")
    out = decode.factory(stage=StageConfig(name="decode"), pipeline=PIPE)(runs["job"], whole, ctx)
    assert isinstance(out, FinalOutput) and out.info["frames_sha256"] == runs["two"].info["frames_sha256"]


def test_chunks_that_do_not_fit_are_refused_typed_and_leave_no_file(runs: dict[str, Any]) -> None:
    chunks = runs["chunks"]
    model = decode.factory(stage=StageConfig(name="decode"), pipeline=PIPE)
    cases = {
        "skips": [chunks[0], chunks[2]],
        "short": chunks[:-1],
        "wrong_shape": [{**chunks[0], "video_latents": torch.zeros(16, 1, 3, 3)}],
        "no_audio": [{k: v for k, v in chunks[0].items() if k != "audio_latents"}],
    }
    for name, bad in cases.items():
        ctx = context(runs["tmp"], request_id=f"req-{name}")
        with pytest.raises(PayloadContractError):
            model(runs["job"], stream_of(bad), ctx)
        assert not part_path(runs["tmp"] / f"req-{name}.mp4").exists(), name
        assert not (runs["tmp"] / f"req-{name}.mp4").exists(), name


def test_an_error_in_the_writer_thread_ends_the_request_and_leaves_no_file(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mux runs in a thread of its own: its error is the model's, raised before the next chunk's
    frames are queued behind it, and the half-written file is dropped."""
    writes: list[int] = []
    real = FragmentedMp4.write

    def failing(self: FragmentedMp4, frames: torch.Tensor) -> None:
        writes.append(int(frames.shape[0]))
        if len(writes) == 2:
            raise av.FFmpegError(-28, "No space left on device")
        real(self, frames)

    monkeypatch.setattr(FragmentedMp4, "write", failing)
    ctx = context(runs["tmp"], request_id="req-disk-full")
    model = decode.factory(stage=StageConfig(name="decode"), pipeline=PIPE)
    with pytest.raises(av.FFmpegError):
        model(runs["job"], stream_of(runs["chunks"]), ctx)
    assert len(writes) <= 2 + decode.MUX_AHEAD, "no write queued far past the failed one"
    assert not part_path(runs["tmp"] / "req-disk-full.mp4").exists()
    assert not (runs["tmp"] / "req-disk-full.mp4").exists()


def test_the_stream_option_is_read_from_the_stage_and_checked(tmp_path: Path) -> None:
    stage = StageConfig(name="diffusion", options={"stream_latent_frames": 2})
    assert diffusion.factory(stage=stage, pipeline=PIPE, **SMALL).cfg.stream_latent_frames == 2
    with pytest.raises(ConfigError, match="stream_latent_frames"):
        diffusion.factory(stage=StageConfig(name="diffusion", options={"stream_latent_frames": "x"}), pipeline=PIPE)
    pipeline = PipelineConfig.load(Path(__file__).parents[3] / "examples/streamed_reference/pipeline.toml")
    assert [s.name for s in pipeline.stages] == ["encoder", "diffusion", "decode"]
    assert pipeline.stages[1].options == {"stream_latent_frames": 1}
