"""The soak's deployment: a private AOF Redis and stage replicas, with the runner as their supervisor.

With ``sentinel`` the Redis is a Sentinel group instead (:class:`~stageferry.chaos.sentinels.SentinelGroup`:
a primary, two replicas, three sentinels) and every process connects through its ``redis+sentinel://``
URL, so the failover faults (:mod:`.faults`) move the master under a running pipeline.

Each replica is one ``python -m stageferry serve <stage>`` process (a TP group's supervisor, or the
leader itself for TP1) in its own session, logging JSON lines to ``<work_dir>/logs/<replica>.log``.
:meth:`Cluster.revive` restarts replicas that died (under the same replica name, so a restarted one
first takes back its own pending entries), as an orchestrator would.  Rank processes are found through
``/proc`` (children of a replica's supervisor, told apart by their ``RANK``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis as sync_redis
import structlog

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import is_fresh, replica_id
from stageferry.chaos.model import RECORD_ENV, STAGE_SECONDS_ENV
from stageferry.chaos.sentinels import SentinelGroup, sync_client
from stageferry.embedded_redis import EmbeddedRedis, free_port
from stageferry.failpoints import ENV as FAILPOINTS_ENV
from stageferry.procs import stop

log = structlog.get_logger(__name__)


@dataclass
class Replica:
    """One replica of a stage (a TP group, or one process) and its restarts."""

    stage: str
    name: str
    tp: int
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)

    @property
    def consumer(self) -> str:
        return replica_id(self.stage, self.name)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def ranks(self) -> dict[int, int]:
        """rank → pid of the live rank processes (the replica process itself is rank 0 for TP1)."""
        if not self.alive:
            return {}
        assert self.process is not None
        if self.tp == 1:
            return {0: self.process.pid}
        out = {}
        for pid in _children(self.process.pid):
            rank = _env_of(pid).get("RANK")
            if rank is not None and rank.isdigit():
                out[int(rank)] = pid
        return out


class Cluster:
    """Redis (AOF, fsync always) plus every replica; everything it started is stopped by :meth:`close`."""

    def __init__(
        self,
        work_dir: Path,
        *,
        prefix: str,
        pipeline_file: Path,
        replicas: list[tuple[str, str, int]],
        stage_seconds: float,
        extra_env: dict[str, str] | None = None,
        sentinel: bool = False,
        url_query: str = "",
    ) -> None:
        self.work_dir = work_dir
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.pipeline_file = pipeline_file
        self.log_dir = work_dir / "logs"
        self.failpoint_dir = work_dir / "failpoints"
        self.record_file = work_dir / "final_runs.txt"
        self.stage_seconds = stage_seconds
        self.extra_env = dict(extra_env or {})
        self.redis = EmbeddedRedis(appendonly=True, data_dir=work_dir / "redis", extra_args=("--appendfsync", "always"))
        #: The Sentinel group that replaces ``redis`` when asked for.
        self.group = SentinelGroup(work_dir / "redis-ha") if sentinel else None
        self.url_query = url_query  #: options of the sentinel URL every process gets (``wait_replicas=2``)
        self.replicas = [Replica(stage, name, tp, free_port()) for stage, name, tp in replicas]
        self.redis_restarts = 0

    @property
    def url(self) -> str:
        return self.redis.url if self.group is None else self.group.url(query=self.url_query)

    def client(self) -> sync_redis.Redis:
        return sync_client(self.url, socket_timeout=15)

    async def start_redis(self) -> None:
        await (self.redis.start() if self.group is None else self.group.start())

    async def stop_redis(self) -> None:
        await (self.redis.stop() if self.group is None else self.group.stop())

    # ------------------------------------------------------------------ processes

    def env(self, replica: Replica) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            STAGEFERRY_REDIS_URL=self.url,
            STAGEFERRY_PREFIX=self.prefix,
            STAGEFERRY_PIPELINE=str(self.pipeline_file),
            STAGEFERRY_REPLICA=replica.name,
            STAGEFERRY_LOG_FORMAT="json",
            STAGEFERRY_METRICS_PORT=str(replica.metrics_port),
            **{FAILPOINTS_ENV: str(self.failpoint_dir), RECORD_ENV: str(self.record_file)},
            **{STAGE_SECONDS_ENV: str(self.stage_seconds)},
        )
        env.update(self.extra_env)
        return env

    def start(self, replica: Replica) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{replica.consumer}.log", "ab") as out:
            replica.process = subprocess.Popen(
                # --max-restarts 0: the runner is the orchestrator here (it revives and counts restarts)
                [sys.executable, "-m", "stageferry", "serve", replica.stage, "--max-restarts", "0"],
                env=self.env(replica),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.work_dir,
                start_new_session=True,
            )

    def start_all(self) -> None:
        self.failpoint_dir.mkdir(parents=True, exist_ok=True)
        for replica in self.replicas:
            self.start(replica)

    def wait_live(self, timeout: float = 180.0) -> None:
        """Until every replica heartbeats (its leader is up and reading its stream)."""
        client = self.client()
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                missing = [r.consumer for r in self.replicas if not self._beating(client, r)]
                if not missing:
                    return
                dead = [r.consumer for r in self.replicas if not r.alive]
                if dead:
                    raise RuntimeError(f"replicas exited during start-up: {dead}; logs in {self.log_dir}")
                time.sleep(0.2)
        finally:
            client.close()
        raise TimeoutError(f"replicas never came up: {missing}; logs in {self.log_dir}")

    def _beating(self, client: sync_redis.Redis, replica: Replica) -> bool:
        try:
            beat = client.hget(self.keys.workers(replica.stage), replica.consumer)
        except sync_redis.RedisError:
            return False
        return is_fresh(beat)

    def revive(self) -> list[Replica]:
        """Restart every replica that exited (the orchestrator's job); the ones restarted."""
        revived = []
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is not None:
                replica.exit_codes.append(replica.process.returncode)
                replica.restarts += 1
                log.info("chaos.replica_restart", replica=replica.consumer, code=replica.process.returncode)
                self.start(replica)
                revived.append(replica)
        return revived

    def stop_all(self, timeout: float = 30.0) -> dict[str, int | None]:
        """SIGTERM (drain) every replica, SIGKILL the session of what is left after ``timeout``; exit codes
        (``None``: killed)."""
        replicas = [r for r in self.replicas if r.process is not None]
        stopped = stop([r.process for r in replicas if r.process], grace_s=timeout, group=True, term_group=False)
        return {r.consumer: None if s.killed else s.returncode for r, s in zip(replicas, stopped, strict=True)}

    def kill_everything(self) -> None:
        """SIGKILL every replica's whole session (its supervisor and ranks); each was started with its own."""
        stop([r.process for r in self.replicas if r.process is not None], grace_s=0, group=True)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        return [int(p) for p in text.split()]
    except OSError:
        pass
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
