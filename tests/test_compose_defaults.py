"""The compose file's published Redis: not the host's usual 6379 (a Redis already there would take the
docs' host commands), the GPU services' URL following it, and the docs' host commands using it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = (ROOT / "compose" / "docker-compose.yml").read_text()


def _default(variable: str) -> str:
    match = re.search(r"\$\{" + variable + r":-((?:[^${}]|\$\{[^}]*\})*)\}", COMPOSE)
    assert match is not None, variable
    return match[1]


def test_redis_is_published_off_the_usual_port_and_the_gpu_services_follow() -> None:
    published = _default("REDIS_PUBLISH")
    assert published == "127.0.0.1:16379"
    assert f'"${{REDIS_PUBLISH:-{published}}}:6379"' in COMPOSE
    # The GPU services (host network) build their URL in the container's shell from GPU_REDIS_URL, else
    # REDIS_PUBLISH: Compose v1 cannot nest one default in another (it rendered "redis://$${REDIS_...").
    assert _default("GPU_REDIS_URL") == ""
    url = 'export STAGEFERRY_REDIS_URL=\\"$${GPU_REDIS_URL:-redis://$$REDIS_PUBLISH/0}\\"; exec stageferry'
    assert COMPOSE.count(url) == 4  # both GPU stages' command and health check
    for value in ("127.0.0.1:16379", "10.0.0.5:6380"):  # the shell's expansion, as in the container
        env = {"PATH": os.environ["PATH"], "GPU_REDIS_URL": "", "REDIS_PUBLISH": value}
        line = url.replace("$$", "$").replace('\\"', '"').replace("exec stageferry", 'echo "$STAGEFERRY_REDIS_URL"')
        assert (
            subprocess.run(["sh", "-c", line], env=env, capture_output=True, text=True).stdout == f"redis://{value}/0\n"
        )
    smoke = (ROOT / "compose" / "smoke.sh").read_text()
    assert f'REDIS_PUBLISH="${{REDIS_PUBLISH:-{published}}}"' in smoke


def test_the_documented_host_commands_use_the_published_port_and_a_small_size() -> None:
    docs = (ROOT / "docs" / "deployment.md").read_text()
    host_submits = [line for line in docs.splitlines() if line.startswith("stageferry --redis-url")]
    assert host_submits and all("127.0.0.1:16379" in line and "--width 320 --height 192" in line
                                for line in host_submits)  # fmt: skip
    assert "redis-cli -p 16379 RPUSH sf:stage:encoder:submit" in docs and "redis-cli XADD" not in docs
    for line in (line for line in docs.splitlines() if "stageferry submit -" in line):
        assert "--width" in line, line  # the schema's default 1344×768 takes minutes on a CPU


def test_the_ha_profile_waits_for_every_replica_it_runs() -> None:
    """With fewer, an acknowledged write can be lost when back-to-back failovers promote the other replica
    (docs/high-availability.md); the 0-lost soak ran with every replica."""
    from stageferry.broker.control.redis_url import parse_url

    env = dict(
        line.split("=", 1) for line in (ROOT / "compose" / "ha.env").read_text().splitlines() if "=" in line
        and not line.startswith("#")
    )  # fmt: skip
    replicas = len(re.findall(r"^  redis-replica-\d+:", COMPOSE, re.M))
    assert replicas == 2
    assert parse_url(env["STAGEFERRY_REDIS_URL"]).durability.replicas == replicas
