"""Stage groups on CPU (gloo): TP2 → TP4 fan-out, leader-only transfer, broadcast misses, dead ranks."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis

from stageferry.schemas import Envelope, JobRequest, RequestState, request_key
from tests.procs import Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(300)
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}  # 204,800-byte payload


def make(tmp_path: Path, redis_url: str, prefix: str, *, connector: str, enc_tp: int, dif_tp: int) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "tests.models:factory", "tp": enc_tp},
            {"name": "diffusion", "model": "tests.models:factory", "tp": dif_tp},
        ],
        timeouts={"visibility": 3.0, "claim_renew_every": 0.5},
        data_plane={"connector": connector, "inline_fallback_max_bytes": 1 << 20},
    )
    return Services(
        tmp_path,
        redis_url=redis_url,
        prefix=prefix,
        pipeline=path,
        extra_env={
            "STAGEFERRY_TEST_RECORD": str(tmp_path / "record.txt"),
            "STAGEFERRY_TEST_DIGESTS": str(tmp_path / "digests.txt"),
            "STAGEFERRY_TEST_HIDDEN": "5120",
            "STAGEFERRY_TEST_SLOW_STAGE": "diffusion",
        },
    )


def json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def events(svc: Services, name: str) -> list[dict[str, Any]]:
    return [e for log in sorted(svc.tmp_path.glob("*.log")) for e in json_lines(log) if e.get("event") == name]


def digests(tmp_path: Path, stage: str, rid: str) -> dict[int, str]:
    rows = [line.split() for line in (tmp_path / "digests.txt").read_text().splitlines()]
    return {int(rank): digest for s, r, rank, digest in rows if s == stage and r == rid}


@pytest.mark.slow
@pytest.mark.parametrize("connector", ["nixl", "inline"])
def test_tp2_to_tp4_every_rank_holds_the_producers_payload(
    tmp_path: Path, redis_url: str, prefix: str, connector: str
) -> None:
    with make(tmp_path, redis_url, prefix, connector=connector, enc_tp=2, dif_tp=4) as svc:
        enc = svc.start("encoder", "a")
        dif = svc.start("diffusion", "a")
        client = svc.client()
        rids = [client.submit({**JOB, "seed": seed}) for seed in (1, 2)]
        for rid in rids:
            status = client.wait(rid, timeout=120)
            assert status.state is RequestState.DONE, svc.logs()
            hop = [t for t in status.timings if t.stage == "diffusion"][-1]
            assert hop.transport.value == connector
            produced = digests(tmp_path, "encoder", rid)
            consumed = digests(tmp_path, "diffusion", rid)
            assert sorted(produced) == [0, 1] and sorted(consumed) == [0, 1, 2, 3]
            assert set(consumed.values()) == {produced[0]}, "every consumer rank holds the producer's bytes"
        for proc in (enc, dif):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        calls = {e["service"].split("-")[0]: e["rank_calls"] for e in events(svc, "group.stopped")}
        # [puts, gets] per rank, counted by each rank's own metrics: only the leaders touched a connector.
        assert calls["encoder"] == [[2, 0], [0, 0]]
        assert calls["diffusion"] == [[0, 2], [0, 0], [0, 0], [0, 0]]


def test_a_miss_is_broadcast_and_followers_raise_the_same_error(tmp_path: Path, redis_url: str, prefix: str) -> None:
    with make(tmp_path, redis_url, prefix, connector="nixl", enc_tp=1, dif_tp=4) as svc:
        svc.start("diffusion", "a")
        svc.wait_live("diffusion", "diffusion-a", timeout=90)
        r = sync_redis.Redis.from_url(redis_url)
        rid = "miss-1"
        job = JobRequest.model_validate(JOB)
        env = Envelope(
            request_id=rid, key=request_key(rid, 0), from_stage="encoder", to_stage="diffusion", job=job
        ).model_dump(mode="json")
        env["payload"] = {  # a well-formed reference to a producer that no longer exists
            "kind": "nixl",
            "agent": "encoder-gone-0badc0de",
            "incarnation": "0badc0de00000000",
            "token": "tok-12345678",
            "lease_expires_at": 0,
            "agent_metadata_b64": None,
            "manifest": {
                "version": 1,
                "tree": {"t": 0},
                "regions": [{"device": "cpu", "nbytes": 64}],
                "tensors": [{"dtype": "uint8", "shape": [64], "device": "cpu", "region": 0, "offset": 0, "nbytes": 64}],
            },
            "regions": [{"mem_kind": "DRAM", "address": 4096, "length": 64, "device_id": 0}],
        }
        r.xadd(svc.keys.stage_stream("diffusion"), {"request_id": rid, "envelope": json.dumps(env)})

        def followers_failed() -> list[dict[str, Any]] | None:
            got = [e for e in events(svc, "group.request_failed") if e.get("request_id") == rid]
            return got if len(got) == 3 else None

        failed = wait_for(followers_failed, 30, "three followers raising the leader's error")
        assert sorted(e["rank"] for e in failed) == [1, 2, 3]
        assert {e["code"] for e in failed} == {"payload_unavailable"}
        assert max(e["lag_s"] for e in failed) < 2.0
        status = svc.client().status(rid)
        assert status is not None and status.stage == "encoder", "sent back to be recomputed"


@pytest.mark.slow
def test_a_follower_killed_mid_request_stops_its_group_and_a_replica_finishes(
    tmp_path: Path, redis_url: str, prefix: str
) -> None:
    with make(tmp_path, redis_url, prefix, connector="nixl", enc_tp=1, dif_tp=2) as svc:
        svc.start("encoder", "a")
        group_a = svc.start("diffusion", "a", "--max-restarts", "0")  # no self-healing: replica b takes over
        client = svc.client()
        rid = client.submit({**JOB, "prompt": "sleep:4"})
        wait_for(
            lambda: (s := client.status(rid)) and s.stage == "diffusion" and s.state is RequestState.RUNNING,
            120,
            "diffusion running",
        )
        started = [e for e in events(svc, "group.started") if e["stage"] == "diffusion"]
        follower_pid = started[0]["pids"][1]
        subprocess.run(["kill", "-9", str(follower_pid)], check=True)
        assert group_a.wait(timeout=30) != 0, "a group that lost a rank exits non-zero"
        svc.start("diffusion", "b")
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.DONE, svc.logs()
        record = (tmp_path / "record.txt").read_text().splitlines()
        assert record.count(f"diffusion {rid}") == 1


def test_settle_heap_freezes_what_start_up_made() -> None:
    """After start-up, a full collection no longer walks the start-up heap (the ≈ 86 ms p99 spike)."""
    import gc

    from structlog.testing import capture_logs

    from stageferry.stages.group.group import settle_heap

    startup_state = [{"layer": i} for i in range(1000)]
    assert any(o is startup_state for o in gc.get_objects())
    try:
        with capture_logs() as logs:
            frozen = settle_heap()
        assert frozen >= 1000 and gc.get_freeze_count() > 0
        assert not any(o is startup_state for o in gc.get_objects())  # out of every generation: never scanned
        later = [{"request": 1}]
        assert any(o is later for o in gc.get_objects())  # what requests allocate is still collected
        assert [e["frozen_objects"] for e in logs if e["event"] == "group.heap_settled"] == [frozen]
    finally:
        gc.unfreeze()
