"""The fault-injection soak: the whole pipeline under random faults, then a full accounting.

:func:`run_soak` starts a private Redis with AOF (``appendfsync always``) and the stage replicas
(``encoder`` TP ``enc_tp`` and ``diffusion`` TP ``dif_tp``, ``replicas`` of each, the soak model of
:mod:`stageferry.chaos.model`), submits ``requests`` jobs of mixed tasks at a steady pace, injects the
:class:`~stageferry.chaos.faults.FaultPlan` drawn from ``seed`` meanwhile — restarting replicas that
die, as an orchestrator would — waits until every request is terminal (or the drain bound passes),
lets leases run out, and audits (:mod:`stageferry.chaos.audit`).  Its settings and deployment are in
:mod:`stageferry.chaos.soak_config`; :func:`~stageferry.chaos.soak_summary.render` prints the summary.

With ``sentinel`` the Redis is a Sentinel group (:mod:`stageferry.chaos.sentinels`) and the faults are
failovers by default (:data:`FAILOVER_FAULTS`: kill the primary, ``SENTINEL FAILOVER``, cut the primary
off with writes still arriving); the summary adds each failover's time (the fault → the first successful
write on the new master) and the latency blip (:mod:`stageferry.chaos.blip`).
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import redis as sync_redis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.chaos import audit, blip
from stageferry.chaos.cluster import Cluster
from stageferry.chaos.faults import FAILOVER_KINDS, FaultPlan, Injector
from stageferry.chaos.soak_config import FAILOVER_FAULTS, MIX, STREAM, SoakConfig, job_for, mix, pipeline_toml
from stageferry.chaos.soak_summary import SoakResult, render
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.errors import ControlPlaneError, StageferryError
from stageferry.schemas import TERMINAL_STATES, RequestState

__all__ = ["FAILOVER_FAULTS", "MIX", "STREAM", "SoakConfig", "SoakResult", "mix", "render", "run_soak"]

log = structlog.get_logger(__name__)


async def _submit_all(
    cfg: SoakConfig,
    cluster: Cluster,
    rng: random.Random,
    started: float,
    told: dict[str, str],
    submitted: list[blip.Submitted],
) -> dict[str, str]:
    """Submit at a steady pace; Redis may be down for a moment (a fault): retry the same id.  Each request
    gets a waiter (``Client.wait``) from its submission on; what it was told goes into ``told``, and this
    returns once every waiter has its answer (or ``drain_s`` after the window).  Each submission's start
    and acknowledgement go to ``submitted`` (wall clock)."""
    expected: dict[str, str] = {}
    kinds = [k for k, _ in mix(cfg.streamed)]
    weights = [w for _, w in mix(cfg.streamed)]
    pipeline = PipelineConfig.load(cluster.pipeline_file)
    wait_s = cfg.window + cfg.drain_s
    async with (
        Client(cluster.url, prefix=cluster.prefix, pipeline=pipeline) as client,
        anyio.create_task_group() as waits,
    ):
        for i in range(cfg.requests):
            delay = started + i * cfg.window / cfg.requests - time.monotonic()
            if delay > 0:
                await anyio.sleep(delay)
            kind = rng.choices(kinds, weights)[0]
            rid = f"soak-{i:04d}-{kind}"
            began = time.time()
            for attempt in range(60):
                try:
                    if kind == "invalid":  # a raw entry, as a non-Python client could send: rejected
                        await _submit_raw(cluster, rid)
                    else:
                        await client.submit(job_for(kind, i, cfg.steps), request_id=rid)
                    break
                except ControlPlaneError as exc:
                    log.warning("chaos.submit_retry", request_id=rid, attempt=attempt, error=exc.message)
                    await anyio.sleep(0.5)
            else:
                raise RuntimeError(f"could not submit {rid}: Redis stayed away")
            submitted.append(blip.Submitted(rid, began, time.time()))
            expected[rid] = {"fail": RequestState.FAILED, "invalid": RequestState.REJECTED}.get(kind, RequestState.DONE)
            waits.start_soon(_wait_one, client, rid, told, wait_s)
    return expected


async def _wait_one(client: Client, rid: str, told: dict[str, str], timeout: float) -> None:
    """What a waiter of ``rid`` is told: its terminal state, or the error code (``request_lost``, ...)."""
    try:
        status = await client.wait(rid, timeout=timeout)
    except StageferryError as exc:
        told[rid] = exc.code
        return
    lost = status.error is not None and status.error.code == "request_lost"
    told[rid] = "request_lost" if lost else status.state.value


async def _submit_raw(cluster: Cluster, rid: str) -> None:
    def add() -> None:
        client = cluster.client()
        try:
            keys = cluster.keys
            if client.exists(keys.request(rid)):
                return
            client.hset(keys.request(rid), mapping={"state": RequestState.QUEUED.value})
            client.xadd(keys.stage_stream("encoder"), {"request_id": rid, "job": '{"prompt": "x", "width": 100000}'})
        except sync_redis.RedisError as exc:
            raise ControlPlaneError(f"redis: {exc}") from exc
        finally:
            client.close()

    await anyio.to_thread.run_sync(add)


async def _keep_alive(cluster: Cluster, stop: anyio.Event) -> None:
    while not stop.is_set():
        await anyio.to_thread.run_sync(cluster.revive)
        await anyio.sleep(0.5)


def _states(cluster: Cluster, rids: list[str]) -> dict[str, str]:
    client = cluster.client()
    try:
        with client.pipeline(transaction=False) as pipe:
            for rid in rids:
                pipe.hget(cluster.keys.request(rid), "state")
            states = pipe.execute()
    finally:
        client.close()
    return {rid: (s or b"missing").decode() for rid, s in zip(rids, states, strict=True)}


async def _drain(cfg: SoakConfig, cluster: Cluster, rids: list[str], wiped: dict[str, str]) -> None:
    """Until every request is terminal — or has no record after an empty restart wiped it (nothing will
    write it again) — or ``drain_s`` passes (the audit then reports the rest)."""
    deadline = time.monotonic() + cfg.drain_s
    while time.monotonic() < deadline:
        try:
            states = await anyio.to_thread.run_sync(_states, cluster, rids)
        except sync_redis.RedisError:
            await anyio.sleep(1)
            continue
        if all(s in TERMINAL_STATES or (s == "missing" and rid in wiped) for rid, s in states.items()):
            return
        await anyio.sleep(1)


async def _settle(cluster: Cluster, baseline: dict[str, dict[str, float]], bound_s: float) -> None:
    """Wait (bounded) until leases have run out and every live leader is back at its baseline."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        now = await anyio.to_thread.run_sync(_resources, cluster)
        if all(now[r] is not None and all(now[r].get(w) == baseline.get(r, {}).get(w) for w in audit.AT_REST)  # type: ignore[union-attr]
               for r in now):  # fmt: skip
            return
        await anyio.sleep(1)


def _resources(cluster: Cluster) -> dict[str, dict[str, float] | None]:
    return {r.consumer: audit.scrape_resources(r.metrics_port) for r in cluster.replicas}


async def run_soak(cfg: SoakConfig) -> SoakResult:
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1 << 31)
    work_dir = cfg.work_dir or Path(tempfile.mkdtemp(prefix="stageferry-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    pipeline_file = work_dir / "pipeline.toml"
    pipeline_file.write_text(pipeline_toml(cfg))
    replicas = [
        (stage, f"{tag}{chr(ord('a') + i)}", tp)
        for stage, tag, tp in (("encoder", "e", cfg.enc_tp), ("diffusion", "d", cfg.dif_tp))
        for i in range(cfg.replicas)
    ]
    cluster = Cluster(
        work_dir, prefix=f"soak-{uuid.uuid4().hex[:8]}", pipeline_file=pipeline_file, replicas=replicas,
        stage_seconds=cfg.stage_seconds, sentinel=cfg.sentinel,
        url_query="" if cfg.wait_replicas is None else f"wait_replicas={cfg.wait_replicas}",
    )  # fmt: skip
    if not cfg.sentinel and any(cfg.faults.get(kind) for kind in FAILOVER_KINDS):
        raise ValueError("failover faults need a Sentinel group: SoakConfig(sentinel=True)")
    plan = FaultPlan.draw(seed, cfg.faults, window_s=cfg.window * 0.85)
    injector = Injector(
        cluster,
        plan,
        stall_s=cfg.visibility_s * 1.6 + 1,
        failpoint_wait_s=cfg.fault_wait_s,
        max_entry_bytes=PipelineConfig.load(cluster.pipeline_file).limits.max_entry_bytes,
    )
    await cluster.start_redis()
    t0 = time.monotonic()
    submitted: list[blip.Submitted] = []
    try:
        cluster.start_all()
        await anyio.to_thread.run_sync(cluster.wait_live)
        baseline = {k: v for k, v in (await anyio.to_thread.run_sync(_resources, cluster)).items() if v is not None}
        started = time.monotonic()
        stop = anyio.Event()
        told: dict[str, str] = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(_keep_alive, cluster, stop)
            async with anyio.create_task_group() as load:  # faults land while jobs flow
                load.start_soon(injector.run, started)
                expected = await _submit_all(cfg, cluster, random.Random(seed), started, told, submitted)
            await _drain(cfg, cluster, list(expected), injector.wiped)
            tg.cancel_scope.cancel()
        injector.resume_all()
        await anyio.to_thread.run_sync(cluster.revive)
        await anyio.to_thread.run_sync(cluster.wait_live)
        await _settle(cluster, baseline, bound_s=60.0)
        result = await anyio.to_thread.run_sync(_audit, cfg, cluster, expected, baseline, injector.wiped, told)
        restarts = {r.consumer: r.restarts for r in cluster.replicas}
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(cluster.stop_all)
            await cluster.stop_redis()
    if not cfg.keep_work_dir and cfg.work_dir is None and result.ok:
        shutil.rmtree(work_dir, ignore_errors=True)
    wins = blip.windows(injector.failovers, wall_minus_mono=time.time() - time.monotonic())
    blips = blip.blips(submitted, {o.request_id: o.ended_ms for o in result.outcomes}, wins) if wins else []
    return SoakResult(
        cfg, seed, result, injector.log, restarts, time.monotonic() - t0, work_dir, blips, injector.failovers
    )


def _audit(
    cfg: SoakConfig,
    cluster: Cluster,
    expected: dict[str, str],
    baseline: dict[str, dict[str, float]],
    wiped: dict[str, str],
    told: dict[str, str],
) -> audit.Audit:
    client = cluster.client()
    stages = ("encoder", "diffusion")
    keys: Keys = cluster.keys
    try:
        events, reasons = audit.log_tallies(cluster.log_dir)
        return audit.Audit(
            outcomes=audit.outcomes(client, keys, expected, stages, wiped=wiped, told=told),
            streams=audit.stream_state(client, keys, stages),
            dead_letters=audit.dead_letters(client, keys, stages),
            resend_backlog=audit.resend_backlog(client, keys),
            untimed_keys=audit.untimed_keys(client, keys, stages),
            resources=_resources(cluster),
            baseline=baseline,
            final_runs=audit.final_runs(cluster.record_file),
            log_events=events,
            fallback_reasons=reasons,
        )
    finally:
        client.close()
