"""The official ``openai`` Python SDK's ``client.videos`` against a real gateway (real uvicorn, Redis, stages).

Everything goes through the SDK's own request shapes (read from ``openai/resources/videos.py``):
multipart ``create`` with ``input_reference``, ``retrieve``, ``poll``, ``list`` with its cursor pages,
``download_content`` of each variant, and ``delete``.  Only ``extra_body`` (the SDK's own escape hatch)
makes the jobs cheap: few frames and steps.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import av
import httpx
import openai
import pytest
import redis as sync_redis
from PIL import Image

from stageferry.broker.control.keys import Keys
from stageferry.cli import sample_media
from stageferry.gateway.previews import grid_of
from stageferry.schemas import Task
from tests.gateway.conftest import Deployment
from tests.procs import wait_for

pytestmark = pytest.mark.timeout(300)

SIZE = "256x144"
CHEAP = {"fps": 8, "num_inference_steps": 2}
SAMPLES = sample_media(Task.FL2VA) | sample_media(Task.REF2VA)


@pytest.fixture(scope="module")
def sdk(deployment: Deployment) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def create(sdk: openai.OpenAI, prompt: str, **kwargs: Any) -> Any:
    extra = {**CHEAP, **kwargs.pop("extra_body", {})}
    return sdk.videos.create(prompt=prompt, size=SIZE, seconds="1", extra_body=extra, **kwargs)  # type: ignore[arg-type]


def finished(sdk: openai.OpenAI, vid: str) -> Any:
    video = sdk.videos.poll(vid, poll_interval_ms=100)
    assert video.status == "completed", video
    return video


def test_create_poll_and_download_every_variant(sdk: openai.OpenAI) -> None:
    video = finished(sdk, create(sdk, "a lighthouse at dusk").id)
    assert video.size == SIZE and video.seconds == "1" and video.progress == 100
    assert video.model_extra is not None and video.model_extra["task"] == "t2va"
    mp4 = sdk.videos.download_content(video.id).read()
    with av.open(io.BytesIO(mp4), mode="r") as container:
        frames = sum(1 for _frame in container.decode(video=0))
    assert frames == 8
    thumb = sdk.videos.download_content(video.id, variant="thumbnail")
    assert thumb.response.headers["content-type"] == "image/webp"
    image = Image.open(io.BytesIO(thumb.read()))
    assert image.format == "WEBP" and image.size == (256, 144)
    sheet = sdk.videos.download_content(video.id, variant="spritesheet")
    assert sheet.response.headers["content-type"] == "image/jpeg"
    grid = Image.open(io.BytesIO(sheet.read()))
    cols, rows = grid_of(frames)
    assert grid.format == "JPEG" and grid.size == (cols * 256, rows * 144) and (cols, rows) == (3, 3)
    # made once: the same bytes however often it is asked for
    again = sdk.videos.download_content(video.id, variant="thumbnail").read()
    assert again == thumb.read()


def test_a_variant_of_an_unfinished_video_is_409(sdk: openai.OpenAI) -> None:
    vid = create(sdk, "sleep:30 still rendering").id
    with pytest.raises(openai.ConflictError):
        sdk.videos.download_content(vid, variant="thumbnail")
    with pytest.raises(openai.BadRequestError, match="variant"):
        sdk.videos.download_content(vid, variant="poster")  # type: ignore[arg-type]
    sdk.videos.delete(vid)  # cancels it


def test_delete_makes_a_finished_video_gone(deployment: Deployment, sdk: openai.OpenAI) -> None:
    video = finished(sdk, create(sdk, "a red kite").id)
    sdk.videos.download_content(video.id, variant="spritesheet").read()
    keys = Keys(deployment.prefix)
    deleted = sdk.videos.delete(video.id)
    assert deleted.id == video.id and deleted.deleted is True and deleted.object == "video.deleted"
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        sdk.videos.download_content(video.id)
    with pytest.raises(openai.NotFoundError):
        sdk.videos.download_content(video.id, variant="thumbnail")
    with pytest.raises(openai.NotFoundError):
        sdk.videos.delete(video.id)
    assert video.id not in [v.id for v in sdk.videos.list(limit=100)]
    with sync_redis.Redis.from_url(deployment.redis_url) as r:  # the output and previews are freed
        previews = [keys.video_preview(video.id, v) for v in ("thumbnail", "spritesheet")]
        assert not r.exists(keys.result(video.id), *previews)


def test_delete_cancels_a_running_job(sdk: openai.OpenAI) -> None:
    vid = create(sdk, "sleep:30 a slow heron").id

    def running() -> Any:
        video = sdk.videos.retrieve(vid)
        return video if video.status == "in_progress" else None

    wait_for(running, 60, "the job running")
    assert sdk.videos.delete(vid).deleted is False  # cancelled, not deleted: it stays until deleted again
    ended = sdk.videos.poll(vid, poll_interval_ms=100)
    assert ended.status == "failed" and ended.error is not None and ended.error.code == "cancelled"
    assert sdk.videos.delete(vid).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.videos.retrieve(vid)


def test_an_image_reference_is_an_image_to_video_job(sdk: openai.OpenAI) -> None:
    """No task named (the SDK cannot name one): an image makes it fl2va, its first (and last) frame."""
    first = SAMPLES["first_frame"]
    video = finished(sdk, create(sdk, "the scene comes alive", input_reference=first).id)
    assert video.model_extra is not None and video.model_extra["task"] == "fl2va"
    assert sdk.videos.download_content(video.id).read()[4:8] == b"ftyp"
    with first.open("rb") as handle:  # an open file, as the SDK's docs show
        raw = create(sdk, "the same, from a file object", input_reference=handle)
    assert raw.model_extra is not None and raw.model_extra["task"] == "fl2va"


@pytest.mark.parametrize("sample", ["reference_video", "reference_audio"])
def test_a_video_or_audio_reference_is_ref2va(sdk: openai.OpenAI, sample: str) -> None:
    video = finished(sdk, create(sdk, "in the style of the reference", input_reference=SAMPLES[sample]).id)
    assert video.model_extra is not None and video.model_extra["task"] == "ref2va"


def test_list_pages_through_the_callers_videos(deployment: Deployment, sdk: openai.OpenAI) -> None:
    """A fresh gateway prefix would be cleaner, but the module's deployment is shared: the test pages
    through everything and checks its own five videos come in order, each once."""
    mine = [create(sdk, f"sleep:0.1 listed {i}").id for i in range(5)]
    newest_first = [v.id for v in sdk.videos.list(limit=2)]  # auto-pagination: after=last_id, page by page
    assert [v for v in newest_first if v in mine] == mine[::-1]
    assert len(newest_first) == len(set(newest_first))
    oldest_first = [v.id for v in sdk.videos.list(limit=3, order="asc")]
    assert [v for v in oldest_first if v in mine] == mine
    page = sdk.videos.list(limit=2)
    assert [v.id for v in page.data] == [mine[4], mine[3]] and page.has_more is True
    after = sdk.videos.list(limit=2, after=page.data[-1].id)
    assert [v.id for v in after.data] == [mine[2], mine[1]]
    assert page.data[0].object == "video" and page.data[0].prompt == "sleep:0.1 listed 4"
    with pytest.raises(openai.BadRequestError, match="after"):
        sdk.videos.list(after="video-0000000000000000")
    with pytest.raises(openai.BadRequestError, match="invalid request: limit: "):  # the field named, as every 400
        sdk.videos.list(limit=0)


def test_list_skips_what_the_caller_did_not_submit(deployment: Deployment, sdk: openai.OpenAI) -> None:
    """Jobs enqueued beside the gateway (a raw client) are not the gateway's caller's: not listed; and a
    deleted one leaves the list at once while its id still works as a cursor."""
    from stageferry.client import SyncClient

    with SyncClient(deployment.redis_url, prefix=deployment.prefix, pipeline=deployment.pipeline) as raw:
        beside = raw.submit({"prompt": "sleep:0.1 not via the gateway", "width": 64, "height": 64, "num_frames": 1})
    first, second, third = (finished(sdk, create(sdk, f"kept {i}").id) for i in range(3))
    sdk.videos.delete(second.id)
    ids = [v.id for v in sdk.videos.list(limit=100)]
    assert beside not in ids and second.id not in ids and {first.id, third.id} <= set(ids)
    assert [v.id for v in sdk.videos.list(limit=1, after=second.id).data] == [first.id]
    # let it finish, so that it does not hold the shared stages
    wait_for(lambda: httpx.get(f"{deployment.base_url}/v1/videos/{beside}").json().get("status") == "completed" or None,
             60, "the raw job")  # fmt: skip


def test_operations_the_gateway_does_not_offer_say_so(sdk: openai.OpenAI) -> None:
    """remix, edit, extend and the character calls answer 501 ``not_supported`` naming the operation and
    what is offered: they met the id routes' 404 (read as an unknown video) and 405."""
    vid = create(sdk, "a tern").id
    mp4 = SAMPLES["reference_video"].read_bytes()
    calls = {
        "remix": lambda: sdk.videos.remix(vid, prompt="again"),
        "edit": lambda: sdk.videos.edit(prompt="again", video=("tern.mp4", mp4)),
        "extend": lambda: sdk.videos.extend(prompt="more", seconds="4", video=("tern.mp4", mp4)),
        "create_character": lambda: sdk.videos.create_character(name="tern", video=("tern.mp4", mp4)),
        "get_character": lambda: sdk.videos.get_character("char_1"),
    }
    for operation, call in calls.items():
        with pytest.raises(openai.APIStatusError) as refused:
            call()
        assert refused.value.status_code == 501, (operation, refused.value.response.text)
        error = refused.value.response.json()["error"]
        assert error["code"] == "not_supported" and f"videos.{operation};" in error["message"], error
        assert "download_content" in error["message"]
    assert sdk.videos.retrieve(vid).id == vid  # the video itself is untouched
