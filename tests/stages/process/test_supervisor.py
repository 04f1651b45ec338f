"""``serve`` heals itself: real stage processes on real Redis; the leader of a group (or the one rank of a
supervised replica) is SIGKILLed, the supervisor restarts the group after its backoff, and the next job
completes — no orchestrator involved."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.gateway.health import check_health
from stageferry.gateway.objects import Health
from stageferry.schemas import RequestState
from stageferry.stages.process.supervisor import RestartPolicy
from tests.procs import ROOT, Services, wait_for, write_pipeline

pytestmark = pytest.mark.timeout(400)
JOB = {"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 1}


def make(tmp_path: Path, redis_url: str, prefix: str, *, dif_tp: int) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [
            {"name": "encoder", "model": "tests.models:factory", "tp": 1},
            {"name": "diffusion", "model": "tests.models:factory", "tp": dif_tp},
        ],
        timeouts={"visibility": 3.0, "claim_renew_every": 0.5},
        data_plane={"connector": "inline"},
    )
    return Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={})


def events(svc: Services, name: str) -> list[dict[str, Any]]:
    out = []
    for log in sorted(svc.tmp_path.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and f'"{name}"' in line:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == name:
                    out.append(event)
    return out


def started_groups(svc: Services) -> list[dict[str, Any]]:
    return [e for e in events(svc, "group.started") if e["stage"] == "diffusion"]


def test_restart_policy_backs_off_and_is_bounded() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


@pytest.mark.parametrize(("dif_tp", "extra"), [(2, ()), (1, ("--supervise",))], ids=["tp2-group", "tp1-supervised"])
def test_a_killed_leader_is_restarted_and_the_next_job_completes(
    tmp_path: Path, redis_url: str, prefix: str, dif_tp: int, extra: tuple[str, ...]
) -> None:
    with make(tmp_path, redis_url, prefix, dif_tp=dif_tp) as svc:
        svc.start("encoder", "a")
        supervisor = svc.start("diffusion", "a", *extra)
        client = svc.client()
        first = client.submit(JOB)
        assert client.wait(first, timeout=180).state is RequestState.DONE, svc.logs()

        leader = wait_for(lambda: started_groups(svc), 30, "group.started")[0]["pids"][0]
        subprocess.run(["kill", "-9", str(leader)], check=True)
        restarted = wait_for(lambda: len(started_groups(svc)) >= 2 and started_groups(svc)[-1], 180, "a restart")
        assert restarted["generation"] == 2 and leader not in restarted["pids"]
        assert supervisor.poll() is None, "the supervisor heals its group instead of exiting"
        (died,) = events(svc, "group.rank_died")
        assert [0, -9] in died["failed"]
        (restarting,) = events(svc, "group.restarting")
        assert restarting["attempt"] == 1 and restarting["in_s"] == 1.0

        second = client.submit({**JOB, "seed": 2})
        assert client.wait(second, timeout=180).state is RequestState.DONE, svc.logs()
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0, "a drain still ends with exit 0"


def test_a_group_that_keeps_dying_gives_up(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """--max-restarts bounds the healing: a replica that cannot stay up exits 1 for its orchestrator."""
    with make(tmp_path, redis_url, prefix, dif_tp=1) as svc:
        supervisor = svc.start("diffusion", "a", "--supervise", "--max-restarts", "1")
        for generation in (1, 2):
            group = wait_for(
                lambda g=generation: len(started_groups(svc)) >= g and started_groups(svc)[g - 1], 120, "group"
            )
            svc.wait_live("diffusion", "diffusion-a", timeout=120)
            subprocess.run(["kill", "-9", str(group["pids"][0])], check=True)
        assert supervisor.wait(timeout=60) == 1
        (gave_up,) = events(svc, "group.gave_up")
        assert gave_up["restarts"] == 1


def one_stage(tmp_path: Path, redis_url: str, prefix: str) -> Services:
    path = write_pipeline(
        tmp_path / "pipeline.toml",
        [{"name": "encoder", "model": "tests.models:factory", "tp": 1}],
        data_plane={"connector": "inline"},
    )
    return Services(tmp_path, redis_url=redis_url, prefix=prefix, pipeline=path, extra_env={})


@pytest.mark.slow
def test_poison_jobs_are_dead_letters_not_a_replica_that_gives_up(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """Two poison jobs, each killing the stage ``max_crashes`` (2) times: four deaths, more than
    ``--max-restarts`` (3) — but every pair is charged to an entry that is then dead-lettered, so the
    supervisor takes them off its count: the replica stays up and the next job completes."""
    with one_stage(tmp_path, redis_url, prefix) as svc:
        supervisor = svc.start("encoder", "a", "--supervise", "--max-restarts", "3")
        client = svc.client()
        poisoned = [client.submit({**JOB, "prompt": f"poison {n}"}) for n in range(2)]

        def settled() -> bool:
            statuses = [client.status(r) for r in poisoned]
            return supervisor.poll() is not None or all(s is not None and s.state.terminal for s in statuses)

        wait_for(settled, 300, "the poison jobs to end")
        assert not events(svc, "group.gave_up"), svc.logs()
        for rid in poisoned:
            status = client.status(rid)
            assert status is not None
            assert status.state is RequestState.FAILED and status.error is not None, (status, svc.logs())
            assert status.error.code == "stage_crashed", status
        assert len(events(svc, "group.rank_died")) == 4
        assert not events(svc, "group.gave_up"), svc.logs()
        assert supervisor.poll() is None, "the supervisor still heals its replica"
        # the second pair is settled with no death after
        crashes_settled = events(svc, "group.crashes_settled")
        assert [e["crashes"] for e in crashes_settled] == [2], crashes_settled
        assert max(e["attempt"] for e in events(svc, "group.restarting")) == 2  # the count never ran up

        after = client.submit(JOB)
        assert client.wait(after, timeout=120).state is RequestState.DONE, svc.logs()
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=60) == 0


def gateway_health(svc: Services) -> Health:
    async def check() -> Health:
        async with Client(svc.redis_url, prefix=svc.prefix, pipeline=PipelineConfig.load(svc.pipeline)) as client:
            return await check_health(client)

    return anyio.run(check)


def test_a_replica_that_gave_up_is_named_by_the_health_checks(tmp_path: Path, redis_url: str, prefix: str) -> None:
    """A supervisor that gives up puts ``gave-up`` in place of its heartbeat: the gateway's check and
    ``stageferry health --stage`` say so at once (not ``ok`` until the heartbeat goes stale)."""
    with one_stage(tmp_path, redis_url, prefix) as svc:
        supervisor = svc.start("encoder", "a", "--supervise", "--max-restarts", "0")
        svc.wait_live("encoder", "encoder-a", timeout=120)
        client = svc.client()
        health = gateway_health(svc)
        assert health.status == "ok" and health.gave_up == {}, health
        client.submit({**JOB, "prompt": "poison"})
        assert supervisor.wait(timeout=120) == 1
        (gave_up,) = events(svc, "group.gave_up")
        assert gave_up["restarts"] == 0

        health = gateway_health(svc)
        assert health.status == "unhealthy" and health.gave_up == {"encoder": ["encoder-a"]}, health
        assert "stage encoder: replica encoder-a gave up restarting" in health.problems
        env = {**svc.env("a"), "PYTHONPATH": str(ROOT)}
        cli = subprocess.run(
            [sys.executable, "-m", "stageferry", "health", "--stage", "encoder"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 1 and "'encoder-a' gave up" in cli.stderr, cli

        svc.start("encoder", "a")  # started again: its heartbeat replaces the mark
        svc.wait_live("encoder", "encoder-a", timeout=120)
        health = gateway_health(svc)
        assert health.status == "ok" and health.gave_up == {}, health
