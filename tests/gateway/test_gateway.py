"""The HTTP gateway against a running deployment: real uvicorn, real Redis, real stage processes.

Covers vLLM-Omni's sync request as the issue's curl command sends it (smaller), the async job pair with
DELETE as cancel, every kind of invalid input (a 4xx naming the field, never a 500), upload caps (413),
the sync timeout (504, job cancelled), OpenAPI and metrics, the ``stageferry gateway`` command, and
health turning unhealthy when the diffusion stage stops (last: it stops a stage of the shared deployment).
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import wave
from pathlib import Path
from typing import Any

import av
import httpx
import pytest
import redis as sync_redis

from stageferry.broker.control.keys import Keys
from stageferry.cli import sample_media
from stageferry.embedded_redis import free_port
from stageferry.schemas import RequestState, RequestStatus, Task
from tests.gateway.conftest import LORA, MAX_STEPS, MAX_UPLOAD_BYTES, Deployment
from tests.procs import wait_for

pytestmark = pytest.mark.timeout(300)

SMALL = {"width": "256", "height": "144", "fps": "8", "num_inference_steps": "2", "seed": "123", "flow_shift": "12.0"}
EXTRA = {"task": "t2va", "duration": 1.0, "aspect_ratio": "16:9", "audio_flow_shift": 3.0}
SAMPLES = sample_media(Task.FL2VA) | sample_media(Task.REF2VA)


def mp4_facts(data: bytes) -> dict[str, Any]:
    """What an MP4 decodes to, independently of the writer's own probe."""
    with av.open(io.BytesIO(data), mode="r") as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0]
        frames = sum(1 for _ in container.decode(video=0))
        return {"size": (video.codec_context.width, video.codec_context.height), "frames": frames,
                "video": video.codec_context.name, "audio": audio.codec_context.name}  # fmt: skip


def form(**overrides: Any) -> dict[str, str]:
    extra = overrides.pop("extra_params", EXTRA)
    data = {"prompt": "A fluffy orange tabby cat", **SMALL, **overrides}
    if extra is not None:
        data["extra_params"] = extra if isinstance(extra, str) else json.dumps(extra)
    return {k: v for k, v in data.items() if v is not None}


def assert_names_field(response: httpx.Response, status: int, field: str, kind: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == field, error
    named = [e for e in error["field_errors"] if e["field"] == field]
    assert named, error
    if kind is not None:
        assert named[0]["type"] == kind, error
    return dict(error)


def wait_video(http: httpx.Client, vid: str, until: Any, timeout: float = 120) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        body: dict[str, Any] = http.get(f"/v1/videos/{vid}").json()
        return body if until(body) else None

    result: dict[str, Any] = wait_for(check, timeout, f"video {vid}")
    return result


def wav_bytes(seconds: float, rate: int = 16_000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x01" * int(seconds * rate))
    return out.getvalue()


def test_openapi_and_metrics(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path in ("/v1/videos", "/v1/videos/sync", "/v1/videos/{video_id}", "/v1/videos/{video_id}/content", "/health",
                 "/metrics"):  # fmt: skip
        assert path in doc["paths"], path
    body = doc["paths"]["/v1/videos/sync"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert {"prompt", "extra_params", "flow_shift", "input_reference", "reference_audio"} <= set(body["properties"])
    assert body["properties"]["input_reference"]["format"] == "binary"
    http.get("/health")
    metrics = http.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'stageferry_gateway_requests_total{method="GET",route="/health"' in metrics.text
    assert "stageferry_gateway_request_seconds_bucket" in metrics.text


def test_sync_request_as_curl_sends_it(deployment: Deployment, http: httpx.Client, tmp_path: Path) -> None:
    """The issue's curl request (smaller), with the real curl binary when there is one."""
    curl = shutil.which("curl")
    data = form(prompt="A fluffy orange tabby cat curls up on a sunny windowsill")
    out, head = tmp_path / "out.mp4", tmp_path / "headers.txt"
    if curl is not None:
        args = [
            curl,
            "-sS",
            "-o",
            str(out),
            "-D",
            str(head),
            "-w",
            "%{http_code}",
            f"{deployment.base_url}/v1/videos/sync",
        ]
        for name, value in data.items():
            args += ["-F", f"{name}={value}"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=True)
        assert done.stdout == "200", (done.stdout, done.stderr, out.read_bytes()[:500])
        headers = {k.strip().lower(): v.strip() for k, v in
                   (line.split(":", 1) for line in head.read_text().splitlines() if ":" in line)}  # fmt: skip
        content = out.read_bytes()
    else:
        response = http.post("/v1/videos/sync", data=data)
        assert response.status_code == 200, response.text
        headers, content = dict(response.headers), response.content
    assert headers["content-type"] == "video/mp4"
    assert mp4_facts(content) == {"size": (256, 144), "frames": 8, "video": "h264", "audio": "aac"}
    video = http.get(f"/v1/videos/{headers['x-request-id']}").json()
    assert video["status"] == "completed" and video["progress"] == 100 and video["size"] == "256x144"
    assert set(json.loads(headers["x-stage-durations"])) == {"encoder", "diffusion"}


def test_a_json_body_with_an_image_url_reference_sent_by_curl(deployment: Deployment, http: httpx.Client) -> None:
    """OpenAI's create-video as a JSON body (what clients written from its API reference send), with the
    real curl: the image reference as a data URL makes it an image-to-video job, as an uploaded one does."""
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("no curl on this machine")
    image = base64.b64encode(SAMPLES["first_frame"].read_bytes()).decode()
    body = {
        "prompt": "the scene comes alive", "size": "256x144", "seconds": 1, "model": "test-model",
        "input_reference": {"image_url": f"data:image/png;base64,{image}"},
        "fps": 8, "num_inference_steps": 2, "extra_params": {"duration": 1.0},
    }  # fmt: skip
    args = [curl, "-sS", "-H", "content-type: application/json", "--data-binary", "@-", "-w", "\n%{http_code}"]
    done = subprocess.run([*args, f"{deployment.base_url}/v1/videos"], input=json.dumps(body), capture_output=True,
                          text=True, timeout=120, check=True)  # fmt: skip
    answer, code = done.stdout.rsplit("\n", 1)
    assert code == "200", answer
    video = json.loads(answer)
    assert video["object"] == "video" and video["size"] == "256x144" and video["task"] == "fl2va", video
    finished = wait_video(http, video["id"], lambda v: v["status"] not in ("queued", "in_progress"))
    assert finished["status"] == "completed", finished
    refused = subprocess.run([*args, f"{deployment.base_url}/v1/videos"], input='{"prompt": "x", "seconds": "x"}',
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    answer, code = refused.stdout.rsplit("\n", 1)
    assert code == "400" and json.loads(answer)["error"]["param"] == "seconds", answer


def test_async_pair_with_uploaded_frames(http: httpx.Client) -> None:
    files = {
        "input_reference": ("first.png", SAMPLES["first_frame"].read_bytes(), "image/png"),
        "last_image": ("last.png", SAMPLES["last_frame"].read_bytes(), "image/png"),
    }
    created = http.post("/v1/videos", data=form(extra_params={"task": "fl2va", "duration": 1.0}), files=files)
    assert created.status_code == 200, created.text
    video = created.json()
    assert (
        video["object"] == "video" and video["status"] in ("queued", "in_progress") and video["model"] == "test-model"
    )
    assert video["size"] == "256x144" and video["seconds"] == "1" and video["created_at"] > 0
    vid = video["id"]
    assert re.fullmatch(r"video-[0-9a-f]{16}", vid), vid  # an async job's id (sync ones are video_sync-)
    assert http.get(f"/v1/videos/{vid}/content").status_code in (200, 409)  # 409 while it runs
    done = wait_video(http, vid, lambda v: v["status"] not in ("queued", "in_progress"))
    assert done["status"] == "completed" and done["progress"] == 100 and done["error"] is None, done
    assert done["completed_at"] >= done["created_at"] and set(done["stage_durations"]) == {"encoder", "diffusion"}
    content = http.get(f"/v1/videos/{vid}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert mp4_facts(content.content)["frames"] == 8
    deleted = http.delete(f"/v1/videos/{vid}").json()
    assert deleted == {"id": vid, "object": "video.deleted", "deleted": True}
    assert_error(http.get(f"/v1/videos/{vid}/content"), 404, "not_found")
    assert_error(http.get("/v1/videos/video_sync-nope"), 404, "not_found")
    assert_error(http.get("/v1/videos/..%2F..%2Fetc"), 404, "not_found")


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code, response.text


def test_delete_cancels_a_running_job(http: httpx.Client) -> None:
    created = http.post("/v1/videos", data=form(prompt="sleep:30 a very slow cat"))
    vid = created.json()["id"]
    running = wait_video(http, vid, lambda v: v["status"] == "in_progress" and v["progress"] > 50)
    assert running["stageferry_state"] == "running"
    assert http.delete(f"/v1/videos/{vid}").json()["deleted"] is False  # cancelled, not deleted: it stays
    ended = wait_video(http, vid, lambda v: v["status"] == "failed")
    assert ended["stageferry_state"] == "cancelled" and ended["error"]["code"] == "cancelled"
    assert_error(http.get(f"/v1/videos/{vid}/content"), 422, "generation_failed")


def test_sync_timeout_is_504_and_cancels(http: httpx.Client) -> None:
    response = http.post(
        "/v1/videos/sync", data=form(prompt="sleep:30 too slow"), headers={"X-Stageferry-Timeout": "1.5"}
    )
    assert_error(response, 504, "deadline_exceeded")
    vid = response.headers["x-request-id"]
    ended = wait_video(http, vid, lambda v: v["status"] == "failed")
    assert ended["stageferry_state"] == "cancelled"


def test_sync_timeout_while_the_sampler_denoises_is_504_and_cancelled(
    deployment: Deployment, http: httpx.Client
) -> None:
    """The real reference sampler (no sleep): the timeout's cancel stops it between two steps."""
    response = http.post(
        "/v1/videos/sync",
        # 8x the latent work of SMALL per step, so that 150 steps outlive 5 s on a quiet host too
        data=form(prompt="a real slow cat", num_inference_steps=str(MAX_STEPS), width="512", height="288", fps="16"),
        headers={"X-Stageferry-Timeout": "5"},
    )
    assert_error(response, 504, "deadline_exceeded")
    vid = response.headers["x-request-id"]
    ended = wait_video(http, vid, lambda v: v["status"] == "failed")
    assert ended["stageferry_state"] == "cancelled" and ended["error"]["code"] == "cancelled"
    redis = sync_redis.Redis.from_url(deployment.redis_url)
    try:
        status = RequestStatus.model_validate_json(redis.hget(Keys(deployment.prefix).request(vid), "status") or b"")
    finally:
        redis.close()
    assert status.state is RequestState.CANCELLED and status.stage == "diffusion"
    assert status.error is not None and 1 <= status.error.details["step"] < MAX_STEPS  # stopped mid-denoise


INVALID = [
    pytest.param({"num_inference_steps": "0"}, "num_inference_steps", "greater_than_equal", id="steps-zero"),
    pytest.param({"num_inference_steps": str(MAX_STEPS + 1)}, "num_inference_steps", "less_than_equal",
                 id="steps-above-deployment-cap"),
    pytest.param({"num_inference_steps": "eight"}, "num_inference_steps", "int_parsing", id="steps-not-a-number"),
    pytest.param({"extra_params": {**EXTRA, "task": "t2x"}}, "extra_params.task", "enum", id="task"),
    pytest.param({"lora": '{"name": "unknown-style"}'}, "lora", "unknown_adapter", id="lora-unknown"),
    pytest.param({"lora": '{"path": "/tmp/x.safetensors"}'}, "lora.path", "unsupported", id="lora-by-path"),
    pytest.param({"flow_shift": "0"}, "flow_shift", "greater_than_equal", id="flow-shift"),
    pytest.param({"extra_params": {**EXTRA, "audio_flow_shift": 99}}, "extra_params.audio_flow_shift",
                 "less_than_equal", id="audio-flow-shift"),
    pytest.param({"extra_params": {**EXTRA, "cfg_trunc": 2}}, "extra_params.cfg_trunc", "unknown_field",
                 id="unknown-extra-param"),
    pytest.param({"extra_params": "{not json"}, "extra_params", "json_invalid", id="extra-params-not-json"),
    pytest.param({"extra_params": "[" * 5000 + "]" * 5000}, "extra_params", "json_invalid",
                 id="extra-params-nested-too-deep"),
    pytest.param({"lora": "{" + '"a":{' * 3000 + "}" * 3001}, "lora", "json_invalid", id="lora-nested-too-deep"),
    pytest.param({"extra_params": '{"\\ud800": 1}'}, "extra_params.?", "unknown_field", id="lone-surrogate-key"),
    pytest.param({"model": "m" * 60_000}, "model", "string_too_long", id="model-echoed-back-is-bounded"),
    pytest.param({"guidance_scale_2": "3"}, "guidance_scale_2", "unsupported", id="wan-only-field"),
    pytest.param({"colour": "blue"}, "colour", "unknown_field", id="unknown-field"),
    pytest.param({"width": "250"}, "width", "invalid_combination", id="width-not-multiple-of-16"),
    pytest.param({"width": "512"}, "extra_params.aspect_ratio", "aspect_ratio", id="aspect-ratio-mismatch"),
    pytest.param({"seconds": "3"}, "extra_params.duration", "conflict", id="seconds-vs-duration"),
    pytest.param({"prompt": None}, "prompt", "missing", id="no-prompt"),
    pytest.param({"flow_shift": "nan"}, "flow_shift", "finite_number", id="flow-shift-nan"),
    pytest.param({"seconds": "nan", "extra_params": None}, "seconds", "finite_number", id="seconds-nan"),
    pytest.param({"width": "2048", "height": "1152", "extra_params": {**EXTRA, "duration": 30.0}},
                 "extra_params.duration", "over_budget", id="over-the-deployment-budget"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "field", "kind"), INVALID)
def test_invalid_input_is_400_naming_the_field(
    http: httpx.Client, fields: dict[str, Any], field: str, kind: str
) -> None:
    for endpoint in ("/v1/videos/sync", "/v1/videos"):
        assert_names_field(http.post(endpoint, data=form(**fields)), 400, field, kind)


def test_invalid_media_is_400_naming_the_field(http: httpx.Client) -> None:
    """Checked by the encoder stage: the sync answer carries its rejection, named as the client sent it."""
    png = SAMPLES["last_frame"].read_bytes()
    files = {
        "input_reference": ("a.png", b"not an image at all", "image/png"),
        "last_image": ("b.png", png, "image/png"),
    }
    fl2va = form(extra_params={"task": "fl2va", "duration": 1.0})
    error = assert_names_field(
        http.post("/v1/videos/sync", data=fl2va, files=files), 400, "input_reference", "bad_media"
    )
    assert error["code"] == "invalid_job" and error["field_errors"][0]["job_field"] == "media.first_frame"

    short = "data:audio/wav;base64," + base64.b64encode(wav_bytes(0.3)).decode()
    ref2va = form(extra_params={"task": "ref2va", "duration": 1.0}, audio_reference=json.dumps({"audio_url": short}))
    assert_names_field(http.post("/v1/videos/sync", data=ref2va), 400, "audio_reference", "too_short")

    created = http.post("/v1/videos", data=fl2va, files=files).json()  # async: accepted, then rejected
    ended = wait_video(http, created["id"], lambda v: v["status"] == "failed")
    assert ended["stageferry_state"] == "rejected" and ended["error"]["code"] == "invalid_job"
    assert ended["error"]["field_errors"][0]["field"] == "input_reference"  # as sent, as in the sync answer

    t2va_with_media = http.post("/v1/videos", data=form(), files={"input_reference": ("a.png", png, "image/png")})
    assert_names_field(t2va_with_media, 400, "input_reference")
    lora_ok = http.post("/v1/videos", data=form(lora=LORA, prompt="sleep:0.1 a configured adapter"))
    assert lora_ok.status_code == 200, lora_ok.text


def test_refusals_say_what_the_client_sent_and_this_deployment_allows(
    deployment: Deployment, http: httpx.Client
) -> None:
    """Issue 37: fl2va without media names the form field (not the job's media.first_frame); a prompt over
    the deployment's limit quotes that limit (not the schema's 8192); a data URL whose base64 was wrapped
    onto lines says the JSON broke, not that only base64 data URLs are accepted."""
    fl2va = assert_names_field(http.post("/v1/videos", data=form(extra_params={"task": "fl2va"})), 400, "first_frame")
    assert "media." not in fl2va["message"] and fl2va["field_errors"][0]["message"] == "fl2va needs first_frame"
    assert fl2va["field_errors"][0]["job_field"] == "media.first_frame"

    limit = deployment.pipeline.limits.max_prompt_chars
    long = assert_names_field(http.post("/v1/videos", data=form(prompt="x" * 9000)), 400, "prompt", "string_too_long")
    assert f"at most {limit} characters" in long["message"] and "8192" not in long["message"], long

    wrapped = base64.encodebytes(SAMPLES["first_frame"].read_bytes()).decode()  # 76-character lines
    reference = '{"image_url": "data:image/png;base64,' + wrapped + '"}'
    bad = assert_names_field(http.post("/v1/videos", data=form(image_reference=reference)), 400, "image_reference")
    assert "not valid JSON" in bad["message"] and "line break" in bad["message"], bad
    garbled = json.dumps({"image_url": "data:image/png;base64,@@not-base64@@"})
    bad64 = assert_names_field(
        http.post("/v1/videos", data=form(image_reference=garbled)), 400, "image_reference.image_url"
    )
    assert bad64["field_errors"][0]["message"] == "not valid base64"


def test_oversized_upload_is_413(deployment: Deployment, http: httpx.Client) -> None:
    big = {"input_reference": ("big.png", b"\x89PNG" + b"\x00" * MAX_UPLOAD_BYTES, "image/png")}
    fl2va = form(extra_params={"task": "fl2va", "duration": 1.0})
    assert_names_field(http.post("/v1/videos/sync", data=fl2va, files=big), 413, "input_reference", "upload_too_large")

    # A declared length above the whole-body cap is refused before the body is sent at all.
    host, port = deployment.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/videos/sync HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"Content-Length: 1000000000\r\n\r\n--b\r\n"
        )
        head, body = read_response(sock)
    assert head.startswith("HTTP/1.1 413"), head
    error = json.loads(body)["error"]
    assert error["param"] == "body" and error["code"] == "upload_too_large", error


def read_response(sock: socket.socket) -> tuple[str, bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket: (status line and headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, body
        body += chunk
    return head.decode(), body


def test_gateway_command_serves_the_configured_deployment(deployment: Deployment, tmp_path: Path) -> None:
    port = free_port()
    pipeline = str(deployment.services.pipeline)
    argv = [sys.executable, "-m", "stageferry", "--redis-url", deployment.redis_url, "--prefix", deployment.prefix,
            "--pipeline", pipeline, "gateway", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 90, "stageferry gateway to answer")
        created = httpx.post(f"http://127.0.0.1:{port}/v1/videos", data=form(), timeout=60)
        assert created.status_code == 200, created.text
        redis = sync_redis.Redis.from_url(deployment.redis_url)
        events_key = Keys(deployment.prefix).events(created.json()["id"])

        def traced() -> bool:  # the gateway's own events join the request's trace
            rows = redis.xrange(events_key)
            return any(json.loads(f.get(b"event", b"{}")).get("event") == "gateway.submitted" for _, f in rows)

        wait_for(traced, 30, "the gateway's event in the request's trace")
        redis.close()
        refused = httpx.post(f"http://127.0.0.1:{port}/v1/videos", data={**form(), "steps": "3"}, timeout=60)
        assert refused.status_code == 400, refused.text
        refused_id = refused.headers["X-Refusal-Id"]  # no request was made: no request id (issue 37)
        assert "X-Request-Id" not in refused.headers and refused_id.startswith("refused-")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        log.close()
    logged = (tmp_path / "gateway.log").read_text()
    assert code == 0, logged  # a stop is a normal end: drained, exit 0 (not 143)
    events = [json.loads(line) for line in logged.splitlines()]  # the log is JSON lines only
    assert any(e["event"] == "gateway.stopped" for e in events), logged
    [listening] = [e for e in events if e["event"] == "gateway.listening"]  # where it serves, said once
    assert listening["url"] == f"http://127.0.0.1:{port}", listening
    refusal = next(e for e in events if e["event"] == "gateway.refused")
    assert refusal["key"] == f"{refused_id}_-1_0" and refusal["status"] == 400 and refusal["code"] == "invalid_form"


def test_client_going_away_cancels_its_sync_job(deployment: Deployment, http: httpx.Client) -> None:
    prompt = f"sleep:30 nobody is waiting {time.time()}"
    body = urllib.parse.urlencode(form(prompt=prompt)).encode()
    redis = sync_redis.Redis.from_url(deployment.redis_url)

    def submitted() -> str | None:
        meta_prefix = Keys(deployment.prefix).video_meta("")
        for key in redis.scan_iter(match=f"{meta_prefix}*", count=1000):
            if json.loads(redis.get(key) or b"{}").get("prompt") == prompt:
                return key.decode().removeprefix(meta_prefix)
        return None

    host, port = deployment.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        head = b"POST /v1/videos/sync HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        vid = wait_for(submitted, 60, "the sync job to be submitted")
    redis.close()
    ended = wait_video(http, vid, lambda v: v["status"] == "failed")
    assert ended["stageferry_state"] == "cancelled"


def test_an_unreadable_video_record_is_described_from_its_status(deployment: Deployment, http: httpx.Client) -> None:
    created = http.post("/v1/videos", data=form(prompt=f"a record gone bad {time.time()}"))
    assert created.status_code == 200, created.text
    vid = created.json()["id"]
    redis = sync_redis.Redis.from_url(deployment.redis_url)
    redis.set(Keys(deployment.prefix).video_meta(vid), b"{not json")
    redis.close()
    described = http.get(f"/v1/videos/{vid}")
    assert described.status_code == 200 and described.json()["id"] == vid, described.text  # not a 500
    listed = http.get("/v1/videos", params={"limit": 100})
    assert listed.status_code == 200 and vid not in [v["id"] for v in listed.json()["data"]], listed.text
    assert_error(http.get("/v1/videos", params={"after": vid}), 400, "invalid_form")


def test_health_turns_unhealthy_when_diffusion_stops(deployment: Deployment, http: httpx.Client) -> None:
    """Last in this module: it stops the shared deployment's diffusion stage."""
    healthy = wait_for(lambda: (r := http.get("/health")).status_code == 200 and r, 60, "health to be 200")
    assert healthy.json()["stages"] == {"encoder": ["encoder-a"], "diffusion": ["diffusion-a"]}
    assert http.head("/health").status_code == 200  # a load balancer's probe may be a HEAD
    diffusion = deployment.services.procs[1]
    diffusion.send_signal(signal.SIGTERM)
    diffusion.wait(timeout=60)
    unhealthy = wait_for(lambda: (r := http.get("/health")).status_code == 503 and r, 60, "health to turn 503")
    body = unhealthy.json()
    assert body["status"] == "unhealthy" and body["redis"] is True and body["stages"]["diffusion"] == []
    assert body["problems"] == ["stage diffusion: no live worker"]
    assert http.head("/health").status_code == 503
