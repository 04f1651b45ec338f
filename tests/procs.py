"""Running stage services as real processes in tests: pipeline files, start, kill, wait."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.liveness import is_fresh
from stageferry.chaos.sentinels import sync_client
from stageferry.client import SyncClient
from stageferry.config import PipelineConfig
from tests import zygote
from tests.zygote import Proc

ROOT = Path(__file__).resolve().parent.parent


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):  # an inline table, e.g. layout = {tp = 2, sp = 2}
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def write_pipeline(path: Path, stages: list[dict[str, Any]], **sections: Mapping[str, Any]) -> Path:
    """A pipeline TOML file: ``stages`` as an array of tables, every other section as a table."""
    lines: list[str] = []
    for name, table in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        lines.append("")
    for stage in stages:
        lines.append("[[stages]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in stage.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def start_peer(
    module: str, redis_url: str, prefix: str, *args: str, log: Path, env: Mapping[str, str] | None = None
) -> Proc:
    """A test's peer process (``tests.peer_producer``, ``tests.peer_reader_dies``) on ``redis_url`` under
    ``prefix``, its output in ``log``; ``env`` is added to ours (a ``PYTHONPATH`` of its own is exec'd)."""
    return zygote.start(
        module,
        ["--redis-url", redis_url, "--prefix", prefix, *args],
        env={**os.environ, "PYTHONPATH": zygote.PYTHONPATH, **(env or {})},
        cwd=ROOT,
        log=log,
    )


class Services:
    """Stage processes started for one test; everything is killed at the end."""

    def __init__(self, tmp_path: Path, *, redis_url: str, prefix: str, pipeline: Path, extra_env: Mapping[str, str]):
        self.tmp_path = tmp_path
        self.redis_url = redis_url
        self.prefix = prefix
        self.pipeline = pipeline
        self.extra_env = dict(extra_env)
        self.procs: list[Proc] = []
        self.keys = Keys(prefix)
        self._clients: list[SyncClient] = []

    def client(self) -> SyncClient:
        """A client for this deployment, closed with the services (its portal thread would block exit)."""
        client = SyncClient(self.redis_url, prefix=self.prefix, pipeline=PipelineConfig.load(self.pipeline))
        self._clients.append(client)
        return client

    def env(self, replica: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            STAGEFERRY_REDIS_URL=self.redis_url,
            STAGEFERRY_PREFIX=self.prefix,
            STAGEFERRY_PIPELINE=str(self.pipeline),
            STAGEFERRY_REPLICA=replica,
            STAGEFERRY_LOG_FORMAT="json",
            PYTHONPATH=zygote.PYTHONPATH,
        )
        env.update(self.extra_env)
        return env

    def start(self, stage: str, replica: str, *args: str, fresh: bool = False) -> Proc:
        """``python -m stageferry serve <stage> <args>`` as replica ``replica``, forked from the test zygote
        (its imports done once: :mod:`tests.zygote`) unless ``fresh`` (exec'd: a test of what it imports)
        or ``STAGEFERRY_TEST_ZYGOTE=0``."""
        path = self.tmp_path / f"{stage}-{replica}-{len(self.procs)}.log"
        proc = zygote.start(
            "stageferry", ["serve", stage, *args], env=self.env(replica), cwd=self.tmp_path, log=path, fresh=fresh
        )
        self.procs.append(proc)
        return proc

    def wait_live(self, stage: str, consumer: str, timeout: float = 60.0) -> None:
        """Until ``consumer`` of ``stage`` heartbeats (the process is up and reading)."""
        client = sync_client(self.redis_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if is_fresh(client.hget(self.keys.workers(stage), consumer)):
                return
            time.sleep(0.1)
        raise TimeoutError(f"{consumer} of {stage} never came up; logs in {self.tmp_path}")

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self.tmp_path.glob("*.log")))

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        for client in self._clients:
            client.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.procs:
            proc.wait(timeout=10)


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")
