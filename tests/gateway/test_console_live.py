"""The console plays a running video as it arrives: the streamed reference pipeline (its decode stage held
before its last chunk, tests/gateway/streamed_deployment.py), a gateway with a token, and the page in
Debian's headless chromium (Playwright).  While the decode is held, the page's <video> already has the
MP4's header and first fragments through MediaSource (bytes appended, metadata and a buffered range, the
first frame decoded); once released, the job ends done and the player holds the whole video, byte for byte
the finished file (chromium's MediaSource plays this H.264/AAC: the test checks isTypeSupported first).
With isTypeSupported refusing (a browser without H.264 in MediaSource), the page says why and plays the
whole file once done."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.console_deployment import TOKEN
from tests.gateway.streamed_deployment import FORM, FRAMES, StreamedDeployment, streamed_deployment

pytestmark = pytest.mark.timeout(400)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).exists():
    pytest.skip("Debian's chromium is not installed", allow_module_level=True)

from playwright.sync_api import Browser, expect, sync_playwright  # noqa: E402

AUTH = {"Authorization": f"Bearer {TOKEN}"}
PLAYER = "document.getElementById('player')"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StreamedDeployment]:
    redis_url = os.environ.get("STAGEFERRY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    with streamed_deployment(tmp_path_factory.mktemp("console-live"), redis_url=redis_url, api_token=TOKEN) as dep:
        yield dep


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield instance
        instance.close()


def test_the_console_plays_a_running_video_as_it_arrives(browser: Browser, deployment: StreamedDeployment) -> None:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    with httpx.Client(base_url=deployment.base_url, timeout=120, headers=AUTH) as http:
        created = http.post("/v1/videos", data=FORM)
        assert created.status_code == 200, created.text
        vid = created.json()["id"]
        page.goto(deployment.base_url + "/")
        page.fill("#token-input", TOKEN)
        page.click("#token-save")
        expect(page.locator("#token-dialog")).to_be_hidden()
        page.goto(f"{deployment.base_url}/#{vid}")
        page.reload()

        # the decode is held before its last chunk: the page plays what is there
        page.wait_for_function(
            f"window.stageferryLive && window.stageferryLive.mode === 'live' && window.stageferryLive.appends >= 1"
            f" && {PLAYER}.readyState >= 2 && {PLAYER}.buffered.length > 0",
            timeout=180_000,
        )
        state = page.evaluate("window.stageferryLive")
        codec = state["codec"]
        assert codec.startswith('video/mp4; codecs="avc1.') and "mp4a.40.2" in codec, state
        assert page.evaluate("t => MediaSource.isTypeSupported(t)", codec)
        assert http.get(f"/v1/videos/{vid}").json()["status"] == "in_progress"  # surely before the end
        assert not state["ended"] and state["appendedBytes"] > 0
        early_end = page.evaluate(f"{PLAYER}.buffered.end({PLAYER}.buffered.length - 1)")
        assert 0 < early_end < FRAMES / 8, early_end  # some of the video, not all of it
        assert page.evaluate(f"{PLAYER}.src").startswith("blob:")
        expect(page.locator("#event-log")).to_contain_text("playing as it arrives", timeout=5_000)

        deployment.release(vid)
        expect(page.locator("#current-state")).to_have_text("done", timeout=180_000)
        page.wait_for_function("window.stageferryLive.ended", timeout=60_000)
        whole = http.get(f"/v1/videos/{vid}/content")
        assert whole.status_code == 200
    state = page.evaluate("window.stageferryLive")
    assert state["appendedBytes"] == len(whole.content), state  # every byte of the finished file
    assert abs(page.evaluate(f"{PLAYER}.duration") - FRAMES / 8) < 0.2
    assert page.evaluate(f"{PLAYER}.videoWidth") == 128
    link = page.get_attribute("#download", "href") or ""
    assert link.startswith("blob:") and page.get_attribute("#download", "download") == f"{vid}.mp4"
    size = page.evaluate("async (url) => (await (await fetch(url)).arrayBuffer()).byteLength", link)
    assert size == len(whole.content)
    assert errors == []
    page.close()


def test_without_mediasource_support_the_whole_file_plays_when_done(
    browser: Browser, deployment: StreamedDeployment
) -> None:
    page = browser.new_page()
    page.add_init_script("MediaSource.isTypeSupported = () => false")  # a browser without H.264 in MSE
    with httpx.Client(base_url=deployment.base_url, timeout=120, headers=AUTH) as http:
        vid = http.post("/v1/videos", data=FORM).json()["id"]
        page.goto(deployment.base_url + "/")
        page.fill("#token-input", TOKEN)
        page.click("#token-save")
        page.goto(f"{deployment.base_url}/#{vid}")
        page.reload()
        page.wait_for_function("window.stageferryLive && window.stageferryLive.mode === 'whole'", timeout=180_000)
        state = page.evaluate("window.stageferryLive")
        assert "is not supported by this browser's MediaSource" in state["reason"] and state["appendedBytes"] == 0
        expect(page.locator("#event-log")).to_contain_text("not played live", timeout=5_000)
        deployment.release(vid)
        expect(page.locator("#current-state")).to_have_text("done", timeout=180_000)
        page.wait_for_function(f"{PLAYER}.readyState >= 2", timeout=60_000)
        size = len(http.get(f"/v1/videos/{vid}/content").content)
    link = page.get_attribute("#download", "href") or ""
    assert page.evaluate("async (url) => (await (await fetch(url)).arrayBuffer()).byteLength", link) == size
    assert abs(page.evaluate(f"{PLAYER}.duration") - FRAMES / 8) < 0.2
    page.close()
