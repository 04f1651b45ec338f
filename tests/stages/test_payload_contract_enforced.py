"""The conditioning contract enforced by a real diffusion stage (reference model, TP2 group, real Redis,
real NIXL agents), fed by a plug-in text encoder (the example's, ``tests/stages/contract_models.py``):

* a plug-in encoder of another hidden size (1024; the example ships 384) runs to ``done``;
* a payload that breaks the contract (``text.hidden_states`` of rank 3, or NaN states) ends ``rejected``
  naming the entry, refused by the diffusion leader before the fan-out: the model never runs, the
  followers are told (``fail``), and the group serves the next request;
* hostile stage-to-stage entries pushed straight into the diffusion stream (issue 17.6): an inline
  payload whose bytes are all ``0xFF`` and a payload made for another job end ``rejected`` with the
  entries named (they ended ``failed`` inside the model before);
* a model that refuses its job itself (the example encoder asked for fl2va) ends ``rejected``;
* aggregated mode checks the in-process hand-over against the same contract.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
import torch

from stageferry.broker.data.payload_codec import encode_inline
from stageferry.cli import sample_media
from stageferry.client import SyncClient
from stageferry.schemas import Envelope, InlinePayload, JobRequest, RequestState, RequestStatus, Task, request_key
from stageferry.schemas.payload_contract import build_payload
from tests.procs import ROOT, Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(600)

JOB: dict[str, Any] = {
    "prompt": "a paper boat in the rain",
    "width": 160,
    "height": 96,
    "fps": 8,
    "duration": 1.0,
    "num_inference_steps": 2,
    "seed": 7,
}


class Deployment:
    def __init__(self, svc: Services, redis: sync_redis.Redis, client: SyncClient) -> None:
        self.svc, self.redis, self.client = svc, redis, client

    def events(self, rid: str) -> list[dict[str, Any]]:
        """Every JSON log event of the stage processes about request ``rid``."""
        logs = sorted(Path(self.svc.tmp_path).glob("*.log"))
        lines = [line for path in logs for line in path.read_text(errors="replace").splitlines()]
        return [e for e in map(_json, lines) if e is not None and e.get("request_id") == rid]

    def wait(self, rid: str) -> RequestStatus:
        status = self.client.wait(rid, timeout=300)
        assert status.state.terminal, (status, self.svc.logs())
        return status

    def raw(self, payload: dict[str, Any], *, job: dict[str, Any], blob: bytes | None = None) -> str:
        """An encoder → diffusion entry written straight into the diffusion stream, as a hostile writer
        with access to the stage streams could: the payload inline, optionally with other bytes."""
        rid = f"raw-{uuid.uuid4().hex[:8]}"
        manifest, packed = encode_inline(payload)
        blob = packed if blob is None else blob
        envelope = Envelope(
            request_id=rid,
            key=request_key(rid, 0),
            from_stage="encoder",
            to_stage="diffusion",
            job=JobRequest.model_validate(job),
            payload=InlinePayload(manifest=manifest, blob_bytes=len(blob)),
        )
        fields = {"request_id": rid, "envelope": envelope.model_dump_json(), "blob": blob}
        self.redis.xadd(self.svc.keys.stage_stream("diffusion"), fields)  # type: ignore[arg-type]
        return rid


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp("contract")
    url = "redis://127.0.0.1:6379/0"
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    path = write_pipeline(
        tmp / "pipeline.toml",
        [
            {"name": "encoder", "model": "tests.stages.contract_models:factory", "tp": 1},
            {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "tp": 2},
        ],
    )
    path.write_text(f'output_dir = "{tmp / "out"}"\n' + path.read_text())
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'examples' / 'plugin_encoder'}"}
    redis = sync_redis.Redis.from_url(url)
    svc = Services(tmp, redis_url=url, prefix=prefix, pipeline=path, extra_env=env)
    try:
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        svc.wait_live("encoder", "encoder-a", timeout=120)
        svc.wait_live("diffusion", "diffusion-a", timeout=120)
        yield Deployment(svc, redis, svc.client())
        assert all(p.poll() is None for p in svc.procs), svc.logs()  # nothing crashed along the way
    finally:
        svc.stop_all()
        keys = list(redis.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            redis.delete(*keys)
        redis.close()


def _json(line: str) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def fields_of(status: RequestStatus) -> list[str]:
    assert status.error is not None
    return [e["field"] for e in status.error.details["field_errors"]]


@pytest.mark.parametrize("transport", ["inline", "nixl"])
def test_a_payload_breaking_the_contract_is_rejected_before_the_fanout(deployment: Deployment, transport: str) -> None:
    dep = deployment
    prompt = "rank3 a paper boat" if transport == "inline" else "wide rank3 a paper boat in the rain, at night"
    rid = dep.client.submit({**JOB, "prompt": prompt})
    status = dep.wait(rid)
    assert status.state is RequestState.REJECTED, status
    assert status.error is not None and status.error.code == "payload_contract"
    assert status.error.message == "text.hidden_states: expected rank 2, got 3"
    assert status.error.details["contract"] == "stageferry.conditioning/1"

    # refused by the leader before the fan-out: no rank ran the model, the follower was told (its own
    # process logs that; the line may land a moment after the client saw the status)
    def told() -> bool:
        return any(e.get("event") == "group.request_failed" for e in dep.events(rid))

    mine = dep.events(rid) if wait_for(told, 10, "the follower's group.request_failed line") else []
    assert [e["transport"] for e in mine if e.get("event") == "payload.put"] == [transport], mine
    assert not any(e.get("event") == "group.fanout" for e in mine), mine
    assert any(e.get("event") == "group.request_failed" and e.get("code") == "payload_contract" for e in mine), mine
    # and the entry is kept for inspection
    dead = wait_for(
        lambda: [
            (i, f)
            for i, f in dep.redis.xrange(dep.svc.keys.dead_letter("diffusion"))
            if f[b"request_id"] == rid.encode()
        ],
        10,
        "the dead-letter row",
    )
    assert any(f[b"request_id"] == rid.encode() and f[b"error_code"] == b"payload_contract" for _, f in dead)


def test_values_are_checked_too_not_only_shapes(deployment: Deployment) -> None:
    """NaN hidden states have the right shape (a model's own structural read lets them through); the
    leader's full check refuses them before any rank computes on them."""
    dep = deployment
    status = dep.wait(dep.client.submit({**JOB, "prompt": "nan a paper boat"}))
    assert status.state is RequestState.REJECTED, status
    assert status.error is not None and status.error.code == "payload_contract"
    assert status.error.message == "text.hidden_states: has non-finite values (NaN or infinity)"
    assert not any(e.get("event") == "group.fanout" for e in dep.events(status.request_id))


def test_a_plugin_encoder_of_another_hidden_size_runs_to_done(deployment: Deployment) -> None:
    dep = deployment
    status = dep.wait(dep.client.submit({**JOB, "prompt": "wide: a paper boat in the rain"}))
    assert status.state is RequestState.DONE, (status.error, dep.svc.logs())
    assert any(e.get("event") == "group.fanout" for e in dep.events(status.request_id))  # checked, then fanned out
    assert status.result is not None
    media = status.result.media
    assert (media["width"], media["height"], media["frames"]) == (160, 96, 8)


def test_an_inline_payload_of_ff_bytes_is_rejected_naming_the_entries(deployment: Deployment) -> None:
    dep = deployment
    job = JobRequest.model_validate(JOB)
    payload = build_payload(job, torch.randn(9, 384).bfloat16(), torch.tensor([0, 1, 1, 1, 1, 1, 1, 1, 0]))
    blob = encode_inline(payload)[1]
    status = dep.wait(dep.raw(payload, job=JOB, blob=b"\xff" * len(blob)))
    assert status.state is RequestState.REJECTED, status
    assert status.error is not None and status.error.code == "payload_contract"
    assert fields_of(status) == ["layout", "text.hidden_states", "text.role_ids", "audio_style"], status.error
    assert status.error.message.startswith("layout: version -1 is not supported")


def test_a_payload_for_another_job_is_rejected_naming_the_layout(deployment: Deployment) -> None:
    dep = deployment
    other = JobRequest.model_validate({**JOB, "width": 192})
    payload = build_payload(other, torch.randn(4, 384).bfloat16(), torch.tensor([0, 1, 1, 0]))
    status = dep.wait(dep.raw(payload, job=JOB))
    assert status.state is RequestState.REJECTED, status
    assert status.error is not None and status.error.code == "payload_contract"
    assert status.error.message.startswith("layout: does not match the job (width, video_latent_shape differ)")
    assert fields_of(status) == ["layout", "visual_latents"], status.error


def test_a_model_refusing_its_job_ends_rejected(deployment: Deployment) -> None:
    """The example encoder serves t2va only: asked for fl2va it raises a typed rejection itself."""
    dep = deployment
    job = {**JOB, "task": "fl2va"}
    status = dep.wait(dep.client.submit(job, uploads=sample_media(Task.FL2VA)))
    assert status.state is RequestState.REJECTED, status
    assert status.error is not None and status.error.code == "invalid_job"
    assert fields_of(status) == ["task"]


def test_the_group_still_serves_after_the_refusals(deployment: Deployment) -> None:
    dep = deployment
    status = dep.wait(dep.client.submit(JOB))
    assert status.state is RequestState.DONE, (status.error, dep.svc.logs())
    diffusion_logs = "".join(p.read_text() for p in Path(dep.svc.tmp_path).glob("diffusion-*.log"))
    assert "Traceback" not in diffusion_logs


def test_aggregated_mode_checks_the_handover_against_the_next_parts_contract(tmp_path: Path, prefix: str) -> None:
    """One group runs both models in process: the encoder part's output is checked in full against the
    diffusion part's declared contract before the hand-over, with the same outcome as across stages (NaN
    hidden states pass the model's own structural read: only that check refuses them)."""
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "tests.stages.contract_models:factory", "tp": 1},
            {"name": "diffusion", "model": "stageferry.stages.reference.diffusion:factory", "tp": 2},
        ],
    )
    path.write_text(f'mode = "aggregated"\noutput_dir = "{tmp_path / "out"}"\n' + path.read_text())
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'examples' / 'plugin_encoder'}"}
    with Services(tmp_path, redis_url="redis://127.0.0.1:6379/0", prefix=prefix, pipeline=path, extra_env=env) as svc:
        svc.start("encoder", "a")
        status = svc.client().wait(svc.client().submit({**JOB, "prompt": "nan a paper boat"}), timeout=300)
        assert status.state is RequestState.REJECTED, (status, svc.logs())
        assert status.error is not None and status.error.code == "payload_contract"
        assert status.error.message == "text.hidden_states: has non-finite values (NaN or infinity)"
        assert all(p.poll() is None for p in svc.procs), svc.logs()
