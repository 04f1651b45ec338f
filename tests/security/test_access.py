"""Access control: the whole pipeline over TLS (``rediss://``, a throwaway CA) through the Redis ACL
users of ``compose/redis-acl.conf`` exactly as shipped (held to their keys and command lists).  Clients
without the password, or outside their keys, get a typed ``access_denied``; without the CA, a typed
``control_plane`` error — a one-line error at the CLI, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import redis as sync_redis

from stageferry.broker.control.redis_conn import check_url, translated
from stageferry.client import Client, SyncClient
from stageferry.config import PipelineConfig
from stageferry.errors import AccessDeniedError, ConfigError, ControlPlaneError
from stageferry.schemas import RequestState, Transport
from tests.procs import ROOT, Services, write_pipeline
from tests.security.servers import PrivateRedis, make_test_ca

pytestmark = pytest.mark.timeout(240)

STAGES = [{"name": "encoder", "model": "tests.models:factory"}, {"name": "diffusion", "model": "tests.models:factory"}]
SAMPLES = ROOT / "stageferry" / "samples"
FL2VA = {"task": "fl2va", "prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2}
PREFIX = "sfacl"
PASSWORD = "s3cret-for-tests"
CLIENT_PASSWORD = "client-s3cret"


def run_pipeline(tmp_path: Path, url: str, *, client_url: str | None = None, cancel: bool = False) -> None:
    """Encoder → diffusion (NIXL between them) and one job with uploads and trace (and a cancelled one);
    the stages use ``url``, the client ``client_url`` (default the same)."""
    pipeline = write_pipeline(
        tmp_path / "pipeline.toml", STAGES, data_plane={"connector": "nixl"}, timeouts={"claim_renew_every": 0.5}
    )
    env = {"STAGEFERRY_TEST_HIDDEN": "5120"}  # 204,800-byte payload: above the inline cap, so NIXL carries it
    with (
        Services(tmp_path, redis_url=url, prefix=PREFIX, pipeline=pipeline, extra_env=env) as svc,
        SyncClient(client_url or url, prefix=PREFIX, pipeline=PipelineConfig.load(pipeline)) as client,
    ):
        svc.start("encoder", "a")
        svc.start("diffusion", "a")
        uploads = {"first_frame": SAMPLES / "first_frame.png", "last_frame": SAMPLES / "last_frame.png"}
        rid = client.submit(FL2VA, uploads=uploads)
        status = client.wait(rid, timeout=120)
        assert status.state is RequestState.DONE, (status, svc.logs())
        assert [t.transport for t in status.timings] == [Transport.NONE, Transport.NIXL]
        assert client.result_bytes(rid)
        assert any(e.stage == "diffusion" for e in client.trace(rid))
        if not cancel:
            return
        cancelled = client.submit({**FL2VA, "prompt": "sleep:30"}, uploads=uploads)
        assert client.cancel(cancelled)
        assert client.wait(cancelled, timeout=120).state is RequestState.CANCELLED


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "stageferry", "--redis-url", url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: str) -> None:
    assert result.returncode == 1, result
    assert f"error [{code}]" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def acl_config(tmp_path: Path) -> Path:
    """The shipped ACL users with this test's prefix and passwords, plus an admin to read ACL LOG."""
    shipped = (ROOT / "compose" / "redis-acl.conf").read_text()
    assert "~sf:*" in shipped and ">CHANGE-ME" in shipped
    lines = []
    for line in shipped.replace("~sf:", f"~{PREFIX}:").splitlines():
        password = CLIENT_PASSWORD if line.startswith("user sfclient") else PASSWORD
        lines.append(line.replace(">CHANGE-ME", f">{password}"))
    path = tmp_path / "redis-acl.conf"
    path.write_text("\n".join([*lines, "user admin on >admin-pw ~* &* +@all", ""]))
    return path


def test_pipeline_over_tls_through_acl_users_and_refusals(tmp_path: Path) -> None:
    """One Redis with TLS (a throwaway CA) and the shipped ACL users: stages as ``stageferry``, the client
    as ``sfclient``, all over ``rediss://``.  The whole pipeline works and Redis never refused a command;
    then the refusals for no password, a wrong one, keys outside the prefix, no CA, and plain TCP."""
    work = tmp_path / "redis"
    work.mkdir()
    ca, cert, key = make_test_ca(work)
    tls = ["--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
    with PrivateRedis(work, [*tls, "--tls-auth-clients", "no"], tls=True, config=acl_config(tmp_path)) as server:
        base = f"127.0.0.1:{server.port}/0"
        trust = f"?ssl_ca_certs={ca}"
        stage_url = f"rediss://stageferry:{PASSWORD}@{base}{trust}"
        server.start(stage_url)
        run_pipeline(tmp_path, stage_url, client_url=f"rediss://sfclient:{CLIENT_PASSWORD}@{base}{trust}", cancel=True)
        admin = sync_redis.Redis.from_url(f"rediss://admin:admin-pw@{base}{trust}")
        assert admin.acl_log() == []  # nothing was ever refused, to either user
        admin.close()

        # At the CLI: one line, no traceback.
        assert_one_line_error(cli(f"rediss://{base}{trust}", "status", "some-id"), "access_denied")
        assert_one_line_error(cli(f"rediss://stageferry:{PASSWORD}@{base}", "status", "x"), "control_plane")

        async def refusals() -> None:
            for url, prefix, code in [
                (f"rediss://{base}{trust}", PREFIX, "access_denied"),  # no password
                (f"rediss://stageferry:wrong@{base}{trust}", PREFIX, "access_denied"),
                (stage_url, "other", "access_denied"),  # keys outside the prefix
                (f"rediss://stageferry:{PASSWORD}@{base}", PREFIX, "control_plane"),  # no CA: not trusted
                (f"redis://stageferry:{PASSWORD}@{base}", PREFIX, "control_plane"),  # plain TCP to TLS
            ]:
                async with Client(url, prefix=prefix) as client:
                    with pytest.raises(ControlPlaneError) as info:
                        await client.status("some-id")
                    assert info.value.code == code, (url, info.value)

        anyio.run(refusals)
        # A client cannot write to a later stage's stream, nor read NIXL agent records.
        as_client = sync_redis.Redis.from_url(f"rediss://sfclient:{CLIENT_PASSWORD}@{base}{trust}")
        for forbidden in (
            lambda: as_client.xadd(f"{PREFIX}:stage:diffusion:in", {"request_id": "x", "envelope": "{}"}),
            lambda: as_client.hgetall(f"{PREFIX}:nixl:agent:encoder-a-00000000"),
        ):
            with pytest.raises(AccessDeniedError), translated():
                forbidden()
        as_client.close()


def test_malformed_redis_urls_are_config_errors(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not really a certificate")
    check_url(f"rediss://u:p@h:1/0?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    check_url("redis://h:6379/0?socket_timeout=3")
    bad = [
        f"redis://h:1/0?ssl_ca_certs={ca}",  # TLS option without TLS
        "rediss://h:1/0?ssl_ca_certs=/no/such/ca.crt",
        "redis://h:1/0?sslca=x",  # unknown option (redis-py would raise TypeError at the first command)
        "http://h:1/0",
    ]
    for url in bad:
        with pytest.raises(ConfigError):
            check_url(url)
    assert_one_line_error(cli(bad[1], "status", "x"), "config")
    assert issubclass(AccessDeniedError, ControlPlaneError)
