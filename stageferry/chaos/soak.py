"""The fault-injection soak: the whole pipeline under random faults, then a full accounting.

:func:`run_soak` starts a private Redis with AOF (``appendfsync always``) and the stage replicas
(``encoder`` TP ``enc_tp`` and ``diffusion`` TP ``dif_tp``, ``replicas`` of each, the soak model of
:mod:`stageferry.chaos.model`), submits ``requests`` jobs of mixed tasks at a steady pace, injects the
:class:`~stageferry.chaos.faults.FaultPlan` drawn from ``seed`` meanwhile — restarting replicas that
die, as an orchestrator would — waits until every request is terminal (or the drain bound passes),
lets leases run out, and audits (:mod:`stageferry.chaos.audit`).  :func:`render` prints the summary.

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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import redis as sync_redis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.chaos import audit, blip
from stageferry.chaos.cluster import Cluster
from stageferry.chaos.failover import Failover
from stageferry.chaos.faults import FAILOVER_KINDS, FaultKind, FaultLog, FaultPlan, Injector
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.errors import ControlPlaneError, StageferryError
from stageferry.schemas import TERMINAL_STATES, RequestState

log = structlog.get_logger(__name__)
SAMPLES = Path(__file__).resolve().parent.parent / "samples"

#: The mix of submitted jobs: (kind, weight).  ``fail`` must end failed, ``invalid`` rejected.
MIX = (("t2va", 55), ("fl2va", 25), ("ref2va", 12), ("fail", 4), ("invalid", 4))
#: A streamed job (T2VA; the encoder streams chunks into the diffusion stage, :mod:`stageferry.chaos.model`).
STREAM = "stream"


def mix(streamed: float) -> tuple[tuple[str, float], ...]:
    """:data:`MIX` with a ``streamed`` share of streamed jobs (the rest keep their proportions); at 0,
    :data:`MIX` itself, so a seed draws the same jobs as before there were streamed ones."""
    if not streamed:
        return MIX
    return (*((k, w * (1 - streamed)) for k, w in MIX), (STREAM, 100 * streamed))


#: The faults of a soak behind Sentinel unless told otherwise: six failovers, two of each kind.
FAILOVER_FAULTS = {FaultKind.PRIMARY_KILL: 2, FaultKind.SENTINEL_FAILOVER: 2, FaultKind.PRIMARY_CUT: 2}


@dataclass
class SoakConfig:
    requests: int = 200
    seed: int | None = None
    replicas: int = 2
    enc_tp: int = 2
    dif_tp: int = 4
    #: Seconds over which requests are submitted (and faults injected); default 0.6 s per request.
    window_s: float | None = None
    faults: dict[FaultKind, int] = field(
        default_factory=lambda: {
            FaultKind.LEADER_KILL: 2,
            FaultKind.FOLLOWER_KILL: 2,
            FaultKind.PRODUCER_AFTER_PUBLISH: 2,
            FaultKind.CONSUMER_MID_READ: 2,
            FaultKind.REDIS_RESTART: 2,
            FaultKind.EMPTY_RESTART: 1,
            FaultKind.STALL: 2,
            FaultKind.HOSTILE_CLIENT: 2,
        }
    )
    visibility_s: float = 5.0
    #: How long a fault may wait for its target: a failpoint to be reached, a group to be up again.
    fault_wait_s: float = 150.0
    stage_seconds: float = 0.05
    steps: int = 4
    drain_s: float = 300.0
    work_dir: Path | None = None
    keep_work_dir: bool = False
    #: Redis as a Sentinel group (failover faults); else one AOF server.
    sentinel: bool = False
    #: Replicas a durable write waits for behind Sentinel (the URL's ``wait_replicas``; None: its default, 1).
    wait_replicas: int | None = None
    #: The share of jobs (0..1) whose encoder streams its output into the diffusion stage in chunks.
    streamed: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.streamed < 1.0:
            raise ValueError(f"streamed is a share of the jobs, 0 <= streamed < 1, not {self.streamed}")

    @property
    def window(self) -> float:
        return self.window_s if self.window_s is not None else 0.6 * self.requests


@dataclass
class SoakResult:
    config: SoakConfig
    seed: int
    audit: audit.Audit
    faults: FaultLog
    restarts: dict[str, int]
    seconds: float
    work_dir: Path
    blips: list[blip.Blip] = field(default_factory=list)
    failovers: list[Failover] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        """``FAIL`` when the audit found anything lost, duplicated, stuck, corrupted or leaked;
        ``INCOMPLETE`` when it found nothing but a planned fault was missed (it had nothing to hit, see
        :class:`~stageferry.chaos.faults.FaultLog`: the run did not test it); else ``PASS``."""
        if not self.audit.ok:
            return "FAIL"
        return "INCOMPLETE" if self.faults.misses else "PASS"


def pipeline_toml(cfg: SoakConfig) -> str:
    """The soak's deployment: short visibility and leases, so faults resolve within the run; a streamed
    job's chunk deadlines long enough to ride out a producer's kill, reclaim and recompute (or a stall)."""
    v = cfg.visibility_s
    return f"""
output_dir = "out"

[[stages]]
name = "encoder"
model = "stageferry.chaos.model:factory"
tp = {cfg.enc_tp}
device = "cpu"

[[stages]]
name = "diffusion"
model = "stageferry.chaos.model:factory"
tp = {cfg.dif_tp}
device = "cpu"

[data_plane]
connector = "nixl"
cpu_pool_bytes = {200 << 20}
gpu_pool_bytes = 0
agent_heartbeat_s = 0.5
agent_ttl_s = 3.0

[timeouts]
visibility = {v}
claim_renew_every = {max(0.5, v / 5)}
handshake = 5.0
claim = 8.0
transfer = 10.0
lease = 15.0
pool_wait = 10.0
resend = 3.0
redis_unreachable = 90.0

[limits]
max_deliveries = 6
max_recomputes = 4
media_roots = ["{SAMPLES}"]

[streaming]
max_chunks_in_flight = 2
chunk_timeout_s = 90.0
producer_wait_s = 90.0
"""


def job_for(kind: str, i: int, steps: int) -> dict[str, Any]:
    """A job of ``kind`` (media as paths to the bundled samples, which the encoder checks)."""
    base: dict[str, Any] = {
        "prompt": f"soak job {i}",
        "width": 320,
        "height": 192,
        "seed": i,
        "num_inference_steps": steps,
    }
    if kind == "fl2va":
        base.update(task="fl2va", media={"first_frame": {"path": str(SAMPLES / "first_frame.png")},
                                         "last_frame": {"path": str(SAMPLES / "last_frame.png")}})  # fmt: skip
    elif kind == "ref2va":
        base.update(task="ref2va", media={"reference_audio": {"path": str(SAMPLES / "reference_audio.wav")}})
    elif kind == "fail":
        base.update(prompt=f"fail job {i}")
    elif kind == STREAM:
        base.update(prompt=f"stream job {i}")
    return base


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


def render(result: SoakResult) -> str:
    """The summary table (plain text, stable layout)."""
    a = result.audit
    cfg = result.config
    outs = a.outcomes
    rows: list[tuple[str, str]] = []

    def row(name: str, value: object) -> None:
        rows.append((name, str(value)))

    row("seed", result.seed)
    wait = 1 if cfg.wait_replicas is None else cfg.wait_replicas
    redis = f"Sentinel group (1 primary, 2 replicas, 3 sentinels; AOF, WAIT {wait})" if cfg.sentinel else "AOF Redis"
    row(
        "deployment",
        f"encoder TP{cfg.enc_tp} x{cfg.replicas}, diffusion TP{cfg.dif_tp} x{cfg.replicas}, CPU, {redis}",
    )
    row("requests", len(outs))
    kinds = Counter(o.request_id.rsplit("-", 1)[1] for o in outs)
    row("  by kind", ", ".join(f"{k} {kinds[k]}" for k, _ in mix(cfg.streamed) if kinds[k]))
    if cfg.streamed:
        streamed = [o for o in outs if o.request_id.endswith(f"-{STREAM}")]
        row("  streamed (chunks encoder -> diffusion)",
            f"{len(streamed)}: done {sum(o.state == RequestState.DONE for o in streamed)}, lost to an empty "
            f"restart {sum(o.lost_to_restart for o in streamed)}, lost {sum(o.lost for o in streamed)}, duplicated "
            f"{sum(o.duplicated for o in streamed)}, stuck {sum(o.stuck for o in streamed)}")  # fmt: skip
    row("faults injected", sum(result.faults.injected.values()))
    for kind in FaultKind:
        if kind in FAILOVER_KINDS and not cfg.sentinel:
            continue
        missed = result.faults.missed[kind.value]
        row(f"  {kind.value}", f"{result.faults.injected[kind.value]}" + (f"  (missed {missed})" if missed else ""))
    row("replica restarts", sum(result.restarts.values()))
    row("done", a.count(lambda o: o.state == RequestState.DONE))
    failed = Counter(o.code or "?" for o in outs if o.state == RequestState.FAILED)
    row("failed", sum(failed.values()))
    for code, n in sorted(failed.items()):
        scripted = sum(
            1 for o in outs if o.state == RequestState.FAILED and o.code == code and o.expected == RequestState.FAILED
        )
        row(f"  {code}", f"{n}" + (f"  ({scripted} scripted 'fail' jobs)" if scripted else ""))
    row("rejected", a.count(lambda o: o.state == RequestState.REJECTED))
    row("recomputed (requests)", a.count(lambda o: o.attempt > 0))
    row("recomputes (events)", a.log_events["recompute"])
    row("inline fallbacks", a.log_events["inline_fallback"])
    for reason, n in sorted(a.fallback_reasons.items()):
        row(f"  {reason}", n)
    row("done via inline fallback", a.count(lambda o: o.state == RequestState.DONE and o.fallback))
    row("fallbacks above the inline cap", a.log_events["fallback_too_large"])
    row("reclaimed entries", a.log_events["reclaimed"])
    row("final-stage runs beyond one", sum(max(0, n - 1) for n in a.final_runs.values()))
    row("late results discarded", a.log_events["done_duplicate"] + a.log_events["handoff_lost"])
    wiped_in_flight = a.count(
        lambda o: o.wiped is not None and o.wiped not in (RequestState.DONE, RequestState.FAILED, RequestState.REJECTED)
    )
    row("wiped by empty restarts", f"{a.count(lambda o: o.wiped is not None)} ({wiped_in_flight} in flight)")
    row("  lost to an empty restart", f"{a.lost_to_restart}  (ended request_lost, or no record: documented)")
    row("  of them failed request_lost", a.count(lambda o: o.lost_to_restart and o.state == RequestState.FAILED))
    lost_told = Counter(o.told or "nothing" for o in outs if o.lost_to_restart)
    row("  their waiters were told", ", ".join(f"{k} {n}" for k, n in sorted(lost_told.items())) or "-")
    row("  wiped after they ended", a.count(lambda o: o.wiped_after_end))
    row("waiters told request_lost", a.count(lambda o: o.told == "request_lost"))
    row("waiters told otherwise than the end", a.contradicted)
    row("lost", a.lost)
    row("duplicated", a.duplicated)
    row("stuck", a.stuck)
    row("wrong results / corrupted", f"{a.wrong_results} / {a.corrupted}")
    row("unexpected outcomes", a.unexpected)
    for stage, info in a.streams.items():
        row(f"stream {stage}", f"length {info['length']}, pending {info['pending']}, dlq {info['dlq']}")
    for stage, reasons in a.dead_letters.items():
        for reason, n in reasons.items():
            row(f"  dlq {stage}", f"{n} x {reason}")
    row("resend backlog (dead producers)", a.resend_backlog)
    row("keys without TTL (leaks)", len(a.untimed_keys))
    for key in a.untimed_keys[:10]:
        row("  key", key)
    leaks = a.resource_leaks()
    row("live leaders at baseline", f"{len(a.resources) - len({x.split(':')[0] for x in leaks})}/{len(a.resources)}")
    for leak in leaks:
        row("  leak", leak)
    for replica, now in sorted(a.resources.items()):
        if now is not None:
            row(f"  {replica}", ", ".join(f"{k}={int(now.get(k, 0))}" for k in ("leases", "pool_slots_in_use",
                "open_handles", "registrations", "registered_bytes", "remote_agents")))  # fmt: skip
    if cfg.sentinel:
        times = [f.first_write_s for f in result.failovers]
        row("failovers", len(times))
        if times:
            row("  failover time", f"median {blip.pct(times, 50):.2f}s, max {max(times):.2f}s (fault -> first write)")
        for f in result.failovers:
            row(f"  {f.kind}", f"{f.first_write_s:.2f}s, master {f.old_port} -> {f.new_port}")
            if f.stale is not None:
                st = f.stale
                refused = "never" if st.refused_after_s is None else f"after {st.refused_after_s:.1f}s"
                row("    stale writer on the old master", f"{st.accepted} writes taken, {len(st.acknowledged)} "
                    f"acknowledged by WAIT ({st.lost_acknowledged} of those lost), NOREPLICAS {refused}")  # fmt: skip
        for b in result.blips:
            row(f"  latency {b.what}", b.row())
    row("wall seconds", f"{result.seconds:.0f}")
    verdict = result.verdict
    if verdict == "INCOMPLETE":
        planned = sum(result.faults.injected.values()) + len(result.faults.misses)
        verdict += f": nothing lost, but {len(result.faults.misses)} of {planned} faults missed (not tested)"
    row("verdict", verdict)
    for miss in result.faults.misses:
        row("  missed", miss)
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  {value}" for name, value in rows]
    bar = "-" * max(len(line) for line in lines)
    return "\n".join(["fault timeline:", *result.faults.lines, "", bar, *lines, bar])
