"""A Sentinel-managed Redis group on loopback — a primary, its replicas, three sentinels — for the
failover soak and the tests: real ``redis-server`` processes, the sentinels in sentinel mode.

Every data node runs with the settings that bound what a failover can lose (the ones
``compose/docker-compose.yml``'s ``ha`` profile ships): AOF (``appendfsync everysec``),
``min-replicas-to-write 1`` and a short ``min-replicas-max-lag`` (a primary cut off from its replicas
stops taking writes), diskless full syncs.  The sentinels' ``down-after-milliseconds`` and
``failover-timeout`` are short so a failover takes seconds, not a minute.  The faults:
:meth:`SentinelGroup.kill_primary` (SIGKILL, as a crash), :meth:`SentinelGroup.failover`
(``SENTINEL FAILOVER``: a clean hand-over) and :meth:`SentinelGroup.cut_primary` (its port's packets
dropped, both ways: a network partition, the primary still running and still answering whoever reaches
it — nobody, here).  :meth:`SentinelGroup.heal` brings a killed primary back (it rejoins as a replica);
:meth:`SentinelGroup.replicas_frozen` stops the replicas (no acknowledgement, no promotion) for a while.

With ``tls`` (:class:`~stageferry.embedded_redis.TlsFiles`) every process listens on TLS only — the data
nodes replicate over TLS, the sentinels talk TLS to them and to each other — and this module's own
clients and :meth:`SentinelGroup.url` (``ssl=true&ssl_ca_certs=...``) trust the group's CA.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import redis as sync_redis
import redis.backoff
import redis.retry
import redis.sentinel
import structlog

from stageferry.broker.control.redis_conn import FAILOVER_FLAGS
from stageferry.broker.control.redis_url import parse_url
from stageferry.embedded_redis import EmbeddedRedis, TlsFiles, free_port

log = structlog.get_logger(__name__)

SERVICE = "stageferry"


@dataclass(frozen=True, slots=True)
class GroupAuth:
    """The users a group with ACLs needs on its data nodes: (user, password) of each."""

    admin: tuple[str, str]  #: this module's own checks (roles, replication state)
    replica: tuple[str, str]  #: ``masteruser`` of the replicas
    sentinel: tuple[str, str]  #: ``sentinel auth-user`` of the sentinels


class SentinelProcess(EmbeddedRedis):
    """``redis-server <conf> --sentinel`` watching one service (its config file is its state)."""

    log_name = "sentinel.log"

    def __init__(self, *, data_dir: Path, conf: str, tls: TlsFiles | None = None) -> None:
        super().__init__(data_dir=data_dir, tls=tls)
        self._conf = conf

    def _command(self, binary: str, data_dir: Path) -> list[str]:
        path = data_dir / "sentinel.conf"
        if not path.exists():
            path.write_text(self._conf)
        ports = self.tls.args(self.port) if self.tls is not None else ["--port", str(self.port)]
        return [binary, str(path), "--sentinel", *ports, "--bind", "127.0.0.1",
                "--daemonize", "no", "--logfile", str(data_dir / self.log_name)]  # fmt: skip


class SentinelGroup:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels; ``async with`` starts and stops all."""

    def __init__(
        self,
        work_dir: Path,
        *,
        replicas: int = 2,
        sentinels: int = 3,
        down_after_ms: int = 800,
        failover_timeout_ms: int = 4000,
        max_lag_s: int = 2,
        service: str = SERVICE,
        data_args: Sequence[str] = (),
        auth: GroupAuth | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        self.work_dir = work_dir
        self.service = service
        self.auth = auth
        self.tls = tls
        self.max_lag_s = max_lag_s
        ports = [free_port() for _ in range(replicas + 1)]
        self.nodes = [
            EmbeddedRedis(
                port=port,
                appendonly=True,
                data_dir=work_dir / f"node-{port}",
                extra_args=self._data_args(i, ports[0], data_args),
                tls=tls,
            )
            for i, port in enumerate(ports)
        ]
        quorum = sentinels // 2 + 1
        conf = "\n".join([
            f"sentinel monitor {service} 127.0.0.1 {ports[0]} {quorum}",
            f"sentinel down-after-milliseconds {service} {down_after_ms}",
            f"sentinel failover-timeout {service} {failover_timeout_ms}",
            f"sentinel parallel-syncs {service} {replicas}",
            *([f"sentinel auth-user {service} {auth.sentinel[0]}", f"sentinel auth-pass {service} {auth.sentinel[1]}"]
              if auth else []),
            "",
        ])  # fmt: skip
        self.sentinels = [
            SentinelProcess(data_dir=work_dir / f"sentinel-{i}", conf=conf, tls=tls) for i in range(sentinels)
        ]
        self._cut: tuple[int, str | None] | None = None

    def _data_args(self, index: int, primary: int, extra: Sequence[str]) -> list[str]:
        args = ["--appendfsync", "everysec", "--min-replicas-to-write", "1", "--protected-mode", "no",
                "--min-replicas-max-lag", str(self.max_lag_s), "--repl-diskless-sync", "yes",
                "--repl-diskless-sync-delay", "0", "--repl-ping-replica-period", "1", *extra]  # fmt: skip
        if self.auth is not None:
            args += ["--masteruser", self.auth.replica[0], "--masterauth", self.auth.replica[1]]
        if index > 0:
            args += ["--replicaof", "127.0.0.1", str(primary)]
        return args

    # ------------------------------------------------------------------ where things are

    def url(self, *, userinfo: str = "", db: int = 0, query: str = "") -> str:
        """The ``redis+sentinel://`` URL of this group's master (``userinfo``: ``user:pass@``; with TLS,
        ``ssl=true&ssl_ca_certs=<the CA>`` comes before ``query``)."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        tls = f"ssl=true&ssl_ca_certs={self.tls.ca}" if self.tls is not None else ""
        query = "&".join(part for part in (tls, query) if part)
        return f"redis+sentinel://{userinfo}{hosts}/{self.service}/{db}" + (f"?{query}" if query else "")

    def _tls_kwargs(self) -> dict[str, Any]:
        return self.tls.client_kwargs() if self.tls is not None else {}

    def _sentinel(self, index: int = 0) -> sync_redis.Redis:
        port = self.sentinels[index].port
        return sync_redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, **self._tls_kwargs())

    def node_client(self, node: EmbeddedRedis) -> sync_redis.Redis:
        user, password = self.auth.admin if self.auth is not None else (None, None)
        return sync_redis.Redis(
            host="127.0.0.1", port=node.port, username=user, password=password, socket_timeout=2, **self._tls_kwargs()
        )

    def master_port(self) -> int | None:
        """The master's port as the sentinels agree on it now (a majority of those answering), or None."""
        votes: dict[int, int] = {}
        for i in range(len(self.sentinels)):
            if not self.sentinels[i].running:
                continue
            try:
                with self._sentinel(i) as client:
                    _host, port = client.sentinel_get_master_addr_by_name(self.service)
            except (sync_redis.RedisError, TypeError):
                continue
            votes[int(port)] = votes.get(int(port), 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best is not None and best[1] > len(self.sentinels) // 2 else None

    def primary(self) -> EmbeddedRedis:
        port = self.master_port()
        for node in self.nodes:
            if node.port == port:
                return node
        raise RuntimeError(f"the sentinels agree on no master of {self.service}")

    def replication(self, node: EmbeddedRedis) -> dict[str, Any]:
        """The node's ``INFO replication``, as it says itself."""
        with self.node_client(node) as client:
            return dict(client.info("replication"))

    def role(self, node: EmbeddedRedis) -> tuple[str, int]:
        """(``master``/``slave``, connected replicas or link-up flag) as the node itself says."""
        info = self.replication(node)
        if info["role"] == "master":
            return "master", int(info.get("connected_slaves", 0))
        return "slave", int(info.get("master_link_status") == "up")

    # ------------------------------------------------------------------ life cycle

    async def start(self, timeout: float = 30.0) -> None:
        for node in self.nodes:
            await node.start()
        for sentinel in self.sentinels:
            await sentinel.start()
        await self.wait_settled(timeout=timeout)
        log.info("sentinels.started", url=self.url(), primary=self.nodes[0].port)

    async def stop(self) -> None:
        self.restore_primary()
        for process in (*self.sentinels, *self.nodes):
            await process.stop()

    async def __aenter__(self) -> SentinelGroup:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_settled(self, *, timeout: float = 30.0, replicas: int | None = None) -> EmbeddedRedis:
        """Until the sentinels agree on a master that has ``replicas`` (default: all other running nodes)
        replicas online, every sentinel knows the others and none flags a failover; the master."""
        deadline = time.monotonic() + timeout
        last = "nothing checked"
        while time.monotonic() < deadline:
            last = await anyio.to_thread.run_sync(self._settled, replicas)
            if not last:
                return self.primary()
            await anyio.sleep(0.05)
        view = await anyio.to_thread.run_sync(self._replication_view)
        raise TimeoutError(f"the sentinel group did not settle in {timeout:.0f}s: {last} ({view})")

    def _replication_view(self) -> str:
        """Each node's replication as it says itself, for a group that did not settle."""
        parts = []
        for node in self.nodes:
            if not node.running:
                parts.append(f"{node.port}: stopped")
                continue
            try:
                info = self.replication(node)
            except (sync_redis.RedisError, OSError) as exc:
                parts.append(f"{node.port}: {type(exc).__name__}")
                continue
            if info["role"] == "master":
                parts.append(f"{node.port}: master of {info.get('connected_slaves', 0)}")
            else:
                link = info.get("master_link_status")
                parts.append(f"{node.port}: replica of {info.get('master_port')}, link {link}")
        for i, sentinel in enumerate(self.sentinels):  # TILT (a stalled timer) holds every action for 30 s
            try:
                with self._sentinel(i) as client:
                    tilt = client.info("sentinel").get("sentinel_tilt")
                    replicas = client.sentinel_slaves(self.service)
            except (sync_redis.RedisError, OSError) as exc:
                parts.append(f"sentinel {sentinel.port}: {type(exc).__name__}")
                continue
            seen = ", ".join(f"{r.get('port')} {r.get('flags')} ({r.get('role-reported')})" for r in replicas)
            parts.append(f"sentinel {sentinel.port}: tilt {tilt}, replicas {seen or 'none'}")
        if self.sentinels:  # its last events, in its own words
            parts.append(f"sentinel log: {self.sentinels[0].log_tail(8)}")
        return "; ".join(parts)

    def _settled(self, replicas: int | None) -> str:
        """Why the group is not settled yet ('' when it is)."""
        try:
            primary = self.primary()
            role, connected = self.role(primary)
            want = replicas if replicas is not None else sum(1 for n in self.nodes if n.running) - 1
            if role != "master" or connected < want:
                return f"master {primary.port} is {role} with {connected}/{want} replicas"
            for node in self.nodes:
                if node is not primary and node.running and self.role(node) != ("slave", 1):
                    return f"node {node.port} is not a linked replica yet"
            for i, sentinel in enumerate(self.sentinels):
                with self._sentinel(i) as client:
                    state = client.sentinel_master(self.service)
                if int(state.get("num-other-sentinels", 0)) < len(self.sentinels) - 1:
                    return f"sentinel {sentinel.port} knows {state.get('num-other-sentinels')} others"
                if int(state.get("num-slaves", 0)) < want:
                    return f"sentinel {sentinel.port} knows {state.get('num-slaves')} replicas"
                # A promoted master with its replicas linked may still be in the failover's last step
                # (reconfiguring the others): the sentinels still flag it, and the health says so.
                flags = [f for f in str(state.get("flags", "")).split(",") if f in FAILOVER_FLAGS]
                if flags:
                    return f"sentinel {sentinel.port} flags the master {','.join(flags)}"
        except (sync_redis.RedisError, RuntimeError, OSError) as exc:
            return repr(exc)
        return ""

    async def wait_new_master(self, old_port: int, *, timeout: float = 30.0) -> EmbeddedRedis:
        """Until the sentinels agree on a master other than ``old_port`` that takes writes; that master."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            port = await anyio.to_thread.run_sync(self.master_port)
            if port is not None and port != old_port:
                node = next(n for n in self.nodes if n.port == port)
                try:
                    if (await anyio.to_thread.run_sync(self.role, node))[0] == "master":
                        return node
                except (sync_redis.RedisError, OSError):
                    pass
            await anyio.sleep(0.02)
        raise TimeoutError(f"no new master in {timeout:.0f}s (old one: {old_port})")

    # ------------------------------------------------------------------ faults

    async def kill_primary(self) -> EmbeddedRedis:
        """SIGKILL the master (as a crash); the killed node (see :meth:`heal`)."""
        primary = self.primary()
        await primary.kill()
        log.info("sentinels.primary_killed", port=primary.port)
        return primary

    @contextlib.contextmanager
    def replicas_frozen(self) -> Iterator[Callable[[], None]]:
        """SIGSTOP every replica (they stop acknowledging replication, answering the sentinels, and cannot
        be promoted); SIGCONT them on exit, or earlier through the function yielded.  With the master
        killed meanwhile, the sentinels see it down but find no replica to promote: the failover is held
        (``s_down,o_down``) until the replicas are thawed."""
        primary = self.primary()
        stopped = [n.pid for n in self.nodes if n is not primary and n.pid is not None]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        log.info("sentinels.replicas_frozen", pids=stopped)

        def thaw() -> None:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)

        try:
            yield thaw
        finally:
            thaw()

    def failover(self, *, timeout: float = 30.0) -> int:
        """``SENTINEL FAILOVER``: hand the master role to a replica now; the old master's port.  Asked again
        while the sentinel answers ``NOGOODSLAVE`` (up to ``timeout``): it picks only a replica it has sent
        ``INFO`` to itself lately (every 10 s), and a group that just settled may have a replica it counts
        but has not asked yet (seen on a loaded 2-core box)."""
        old = self.primary().port
        deadline = time.monotonic() + timeout
        with self._sentinel() as client:
            while True:
                try:
                    client.execute_command("SENTINEL", "FAILOVER", self.service)
                    break
                except sync_redis.ResponseError as exc:
                    if "NOGOODSLAVE" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # a sync method, run in a worker thread
        log.info("sentinels.failover_asked", old=old)
        return old

    def cut_primary(self, *, spare: str | None = None) -> int:
        """Drop every packet to and from the master's port on loopback (iptables): a partition that leaves
        it running — except for packets from and to the address ``spare`` (a client on the master's side
        of the partition); the old master's port.  Undone by :meth:`restore_primary`."""
        port = self.primary().port
        self._cut = (port, spare)
        for rule in self._cut_rules(port, spare):
            subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        log.info("sentinels.primary_cut", port=port, spare=spare)
        return port

    @staticmethod
    def _cut_rules(port: int, spare: str | None) -> list[list[str]]:
        into = ["INPUT", "-i", "lo", "-p", "tcp", "--dport", str(port), *(["!", "-s", spare] if spare else [])]
        out = ["OUTPUT", "-o", "lo", "-p", "tcp", "--sport", str(port), *(["!", "-d", spare] if spare else [])]
        return [[*into, "-j", "DROP"], [*out, "-j", "DROP"]]

    def restore_primary(self) -> None:
        """Undo :meth:`cut_primary` (the old master rejoins; the sentinels make it a replica)."""
        cut, self._cut = self._cut, None
        if cut is None:
            return
        for rule in self._cut_rules(*cut):
            subprocess.run(["iptables", "-D", *rule], check=False, capture_output=True)
        log.info("sentinels.primary_restored", port=cut[0])

    async def heal(self) -> None:
        """Start every stopped node again (it comes back as a replica of the new master) and undo a cut."""
        self.restore_primary()
        for node in self.nodes:
            if not node.running:
                await node.start()


def sync_client(url: str, *, socket_timeout: float = 15, retries: int = 20) -> sync_redis.Redis:
    """A synchronous redis-py client for any of our URLs (a ``redis+sentinel://`` one through redis-py's
    Sentinel client: it follows the master), for the soak's bookkeeping and for tests."""
    parsed = parse_url(url)
    target = parsed.sentinel
    if target is None:
        return sync_redis.Redis.from_url(parsed.url, socket_timeout=socket_timeout)
    tls: dict[str, Any] = {}
    if target.ssl:  # TLS to the sentinels and the master alike, with the URL's CA and certificates
        tls = {"ssl": True, **{name: v for name, v in target.options.items() if name.startswith("ssl_")}}
    manager = sync_redis.sentinel.Sentinel(list(target.sentinels), sentinel_kwargs={"socket_timeout": 2, **tls})
    return manager.master_for(
        target.service,
        **tls,
        db=target.db,
        username=target.username,
        password=target.password,
        socket_timeout=socket_timeout,
        retry=sync_redis.retry.Retry(sync_redis.backoff.ExponentialBackoff(cap=1.0, base=0.05), retries),
        retry_on_error=[sync_redis.ConnectionError, sync_redis.TimeoutError],
    )


def iptables_unavailable() -> str | None:
    """Why :meth:`SentinelGroup.cut_primary` cannot work here (None when it can)."""
    try:
        probe = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot run iptables: {exc}"
    return None if probe.returncode == 0 else f"iptables refused: {probe.stderr.strip()}"


__all__ = ["SERVICE", "GroupAuth", "SentinelGroup", "SentinelProcess", "iptables_unavailable", "sync_client"]
