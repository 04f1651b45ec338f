"""Private ``redis-server`` processes for the access tests: ACL users, TLS with a throwaway CA."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis as sync_redis

from stageferry.embedded_redis import free_port


class PrivateRedis:
    """A redis-server on a free loopback port, in its own directory, killed on exit."""

    def __init__(self, work: Path, args: Sequence[str] = (), *, tls: bool = False, config: Path | None = None) -> None:
        self.work = work
        self.port = free_port()
        self.tls = tls
        port_args = ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not on PATH"
        self.command = [
            binary,
            *([str(config)] if config is not None else []),  # a config file must come first
            *port_args,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(work),
            "--logfile", str(work / "redis.log"),
            *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, probe_url: str, timeout: float = 20.0) -> PrivateRedis:
        """Start and wait until ``probe_url`` (with whatever credentials it needs) answers PING."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.log()}")
            client = sync_redis.Redis.from_url(probe_url, socket_timeout=2)
            try:
                if client.ping():
                    return self
            except (sync_redis.ConnectionError, OSError):
                time.sleep(0.05)
            finally:
                client.close()
        raise TimeoutError(f"redis-server did not answer: {self.log()}")

    def log(self) -> str:
        path = self.work / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else "(no log)"

    def __enter__(self) -> PrivateRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def make_test_ca(work: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (openssl CLI); (ca, cert, key)."""
    ca_key, ca, key, csr, cert = (work / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    ext = work / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    steps = [
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=stageferry test CA",
         "-keyout", ca_key, "-out", ca],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key, "-out", csr],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
         "-extfile", ext, "-out", cert],
    ]  # fmt: skip
    for step in steps:
        subprocess.run([str(s) for s in step], check=True, capture_output=True)
    return ca, cert, key


#: What the ACL helpers set for each user the shipped ACL has (``stageferry acl`` prints ``>CHANGE-ME``).
ACL_PASSWORDS = {"stageferry": "stage-pw", "sfclient": "client-pw", "admin": "admin-pw"}


class AclRedis(PrivateRedis):
    """A private redis-server loaded with the ACL that ``stageferry acl --prefix <prefix>`` prints (the real
    CLI, passwords set from :data:`ACL_PASSWORDS`), plus an ``admin`` user for the test's own checks."""

    def __init__(self, work: Path, prefix: str, args: Sequence[str] = ()) -> None:
        from typer.testing import CliRunner

        from stageferry.cli import app

        printed = CliRunner().invoke(app, ["--prefix", prefix, "acl"])
        assert printed.exit_code == 0, printed.output
        lines = [
            line.replace(">CHANGE-ME", f">{ACL_PASSWORDS.get(line.split()[1], 'unused')}")
            for line in printed.stdout.splitlines()
            if line.startswith("user ")
        ]
        config = work / "acl.conf"
        config.write_text("\n".join([*lines, f"user admin on >{ACL_PASSWORDS['admin']} ~* &* +@all", ""]))
        super().__init__(work, args, config=config)

    def url(self, user: str) -> str:
        return f"redis://{user}:{ACL_PASSWORDS[user]}@127.0.0.1:{self.port}/0"

    def __enter__(self) -> AclRedis:
        self.start(self.url("admin"))
        return self

    def admin(self) -> sync_redis.Redis:
        return sync_redis.Redis.from_url(self.url("admin"))

    def refusals(self) -> list[dict[str, object]]:
        """What Redis refused any user since the start (``ACL LOG``)."""
        admin = self.admin()
        try:
            return list(admin.acl_log())
        finally:
            admin.close()
