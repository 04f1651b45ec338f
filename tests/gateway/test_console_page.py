"""The console page in a real headless browser (Debian's chromium, driven by Playwright) against a real
deployment: the token prompt, a field error shown next to its field, a job submitted from the form that
reaches ``done`` with its video loaded in the page, the trace timeline and the panels, and the page at
phone width without horizontal scrolling.

Screenshots go to ``$STAGEFERRY_CONSOLE_SCREENSHOTS`` when set (the docs' images are made that way), else
to the test's temporary directory.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import delete_prefix
from tests.gateway.console_deployment import TOKEN, ConsoleDeployment, console_deployment

pytestmark = pytest.mark.timeout(400)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DONE_TIMEOUT_MS = 180_000

if not Path(CHROMIUM).exists():
    pytest.skip(
        "Debian's chromium is not installed (scripts/test.sh installs it when run as root with apt-get)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, Route, expect, sync_playwright  # noqa: E402


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[ConsoleDeployment]:
    prefix = f"t-page-{uuid.uuid4().hex[:10]}"
    try:
        with console_deployment(tmp_path_factory.mktemp("page"), redis_url=redis_url, prefix=prefix) as dep:
            yield dep
    finally:
        delete_prefix(redis_url, prefix)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        # --no-sandbox: tests run as root, where chromium's sandbox refuses to start
        instance = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield instance
        instance.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("STAGEFERRY_CONSOLE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def sign_in(page: Page, deployment: ConsoleDeployment) -> None:
    """Open the page; it asks for the token (the gateway has one), and the token is entered."""
    page.goto(deployment.base_url + "/")
    dialog = page.locator("#token-dialog")
    expect(dialog).to_be_visible()
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    expect(dialog).to_be_hidden()
    expect(page.locator("#health")).to_have_text("healthy", timeout=30_000)


def test_wrong_token_is_asked_again(browser: Browser, deployment: ConsoleDeployment) -> None:
    page = browser.new_page()
    page.goto(deployment.base_url + "/")
    page.fill("#token-input", "not-the-token")
    page.click("#token-save")
    expect(page.locator("#token-error")).to_have_text("That token was refused.", timeout=30_000)
    expect(page.locator("#token-dialog")).to_be_visible()
    page.close()


def test_a_refusal_of_a_call_sent_before_the_token_was_saved_asks_nothing(
    browser: Browser, deployment: ConsoleDeployment
) -> None:
    """The page's first panel calls go out without a token and are refused; a refusal arriving after the
    token was saved (a loaded box) neither reopens the token dialog nor marks the gateway unreachable."""
    page = browser.new_page()
    held: list[Route] = []

    def hold_the_first(route: Route) -> None:
        if not held and "authorization" not in route.request.headers:
            held.append(route)  # answered below, once the token is saved and the page is healthy
        else:
            route.continue_()

    page.route("**/console/api/stages", hold_the_first)
    sign_in(page, deployment)  # a later call, with the token, made the page healthy
    assert len(held) == 1
    with page.expect_response(lambda reply: reply.request == held[0].request) as stale:
        held[0].continue_()
    assert stale.value.status == 401
    page.evaluate("() => Api.json('/console/api/stages')")  # its reply is handled after the stale one's
    assert page.evaluate("() => document.getElementById('token-dialog').open") is False
    expect(page.locator("#health")).to_have_text("healthy")
    page.close()


def test_submit_watch_play_and_trace(browser: Browser, deployment: ConsoleDeployment, shots: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, deployment)

    # a field the API refuses: its error shows next to that field, and nothing is submitted
    page.fill("#f-prompt", "A fluffy orange tabby cat")
    page.fill("#f-steps", "180")  # within the schema, above this deployment's max_steps (150)
    page.click("#submit")
    steps_error = page.locator('[data-error-for="num_inference_steps"]')
    expect(steps_error).to_contain_text("150", timeout=30_000)
    expect(page.locator('.field[data-field="num_inference_steps"]')).to_have_class("field invalid")
    expect(page.locator("#current-id")).to_have_text("—")

    # a good job: progress live, then done, the video plays, the trace and the panels show it
    page.fill("#f-steps", "2")
    page.fill("#f-prompt", "sleep:1 A fluffy orange tabby cat curls up on a sunny windowsill")
    page.click("#submit")
    expect(steps_error).to_have_text("")
    expect(page.locator("#current-id")).not_to_have_text("—", timeout=30_000)
    vid = page.locator("#current-id").inner_text()
    expect(page.locator("#current-state")).to_have_text("done", timeout=DONE_TIMEOUT_MS)
    page.wait_for_function("document.getElementById('player').readyState >= 2", timeout=60_000)
    assert page.evaluate("document.getElementById('player').videoWidth") == 256
    href = page.get_attribute("#download", "href", timeout=5_000)
    assert href is not None and href.startswith("blob:")
    assert page.get_attribute("#download", "download") == f"{vid}.mp4"
    page.wait_for_function("document.getElementById('player').poster.startsWith('data:image/jpeg')", timeout=30_000)
    log = page.locator("#event-log li")
    assert log.count() > 3
    assert "status.running" in " ".join(log.all_text_contents())  # (inside a closed <details>)

    spans = page.locator("#spans tbody tr")
    expect(spans).to_have_count(2, timeout=30_000)
    assert spans.nth(0).inner_text().startswith("encoder") and spans.nth(1).inner_text().startswith("diffusion")
    expect(page.locator("#timeline .lane").first).to_be_visible()
    expect(page.locator("#recent")).to_contain_text(vid, timeout=30_000)
    expect(page.locator("#stages .dot.live")).to_have_count(2)
    expect(page.locator("#counters")).to_contain_text("payload_puts", timeout=30_000)
    # the panels refresh on their own: the finished job leaves the diffusion queue and is counted done
    expect(page.locator("#stages")).not_to_contain_text("in flight 1", timeout=30_000)
    expect(page.locator("#counters")).to_contain_text("outcome=done,stage=diffusion", timeout=30_000)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(shots / "console.png"), full_page=True)
    assert errors == []
    page.close()

    # phone width: the same request opened from its link, nothing wider than the screen
    phone = browser.new_page(viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True)
    phone.goto(deployment.base_url + "/")
    phone.fill("#token-input", TOKEN)
    phone.click("#token-save")
    phone.goto(f"{deployment.base_url}/#{vid}")
    phone.reload()
    expect(phone.locator("#current-state")).to_have_text("done", timeout=60_000)
    phone.wait_for_function("document.getElementById('player').readyState >= 2", timeout=60_000)
    expect(phone.locator("#spans tbody tr")).to_have_count(2, timeout=30_000)
    assert phone.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    phone.evaluate("document.getElementById('request-card').scrollIntoView()")
    phone.screenshot(path=str(shots / "console-phone.png"), full_page=False)
    phone.close()
