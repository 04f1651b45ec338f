"""``stageferry kube secret``: the Secret's ACL file loads in a real redis-server (7.0, as Debian ships
it) as ``--aclfile``, its URL and passwords work, and the autoscaler's user reads the stage streams'
backlog (what KEDA's redis-streams trigger sends) and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as sync_redis
import yaml

from stageferry.config import PipelineConfig
from stageferry.errors import ConfigError
from stageferry.kube.generate import redis_secret, secret_yaml
from stageferry.kube.values import Values
from tests.kube.render import TREE
from tests.security.servers import PrivateRedis

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def secret() -> dict[str, Any]:
    obj = redis_secret(PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values.load(TREE / "values.toml"))
    assert yaml.safe_load(secret_yaml(obj)) == obj
    return obj


@pytest.fixture
def server(tmp_path: Path, secret: dict[str, Any]) -> Iterator[PrivateRedis]:
    """The Secret's ACL file loaded by a private redis-server, killed after the test (it was left running,
    one orphaned server per run of the suite)."""
    acl = tmp_path / "users.acl"
    acl.write_text(secret["stringData"]["users.acl"])
    work = tmp_path / "redis"
    work.mkdir()
    password = secret["stringData"]["password"]
    with PrivateRedis(work, ["--aclfile", str(acl)]) as redis:
        yield redis.start(f"redis://stageferry:{password}@127.0.0.1:{redis.port}/0")


def test_passwords_are_fresh_and_the_url_names_the_service(secret: dict[str, Any]) -> None:
    data = secret["stringData"]
    assert data["url"] == f"redis://stageferry:{data['password']}@stageferry-redis:6379/0"
    # KEDA's operator dials from its own namespace (keda): the Service by its namespace's name, not bare
    assert data["address"] == "stageferry-redis.stageferry.svc:6379" and "CHANGE-ME" not in data["users.acl"]
    elsewhere = redis_secret(PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values(), namespace="prod")
    assert elsewhere["stringData"]["address"] == "stageferry-redis.prod.svc:6379"
    other = redis_secret(PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values())
    assert other["stringData"]["password"] != data["password"]


def test_an_existing_redis_and_tls() -> None:
    pipeline, values = PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values()
    external = redis_secret(pipeline, values, url="rediss://stageferry:pw@redis.internal:6380/0")["stringData"]
    assert (external["address"], external["scaler-tls"]) == ("redis.internal:6380", "enable")
    tls = redis_secret(pipeline, values, tls=True)["stringData"]
    assert tls["url"].startswith("rediss://") and tls["url"].endswith("?ssl_ca_certs=/etc/stageferry/tls/ca.crt")


@pytest.mark.parametrize(
    ("url", "said"),
    [("notaurl", "got none; a host and port: redis://HOST:PORT/0"), ("http://redis:6379", "got 'http'")],
)
def test_a_url_that_is_no_redis_url_is_refused_here_not_by_the_pods(url: str, said: str) -> None:
    """``--url`` is held to the check ``--redis-url`` gets: every pod would have failed at its start."""
    pipeline = PipelineConfig.load(TREE / "base" / "pipeline.toml")
    with pytest.raises(ConfigError, match="redis URL must start with redis://") as refused:
        redis_secret(pipeline, Values(), url=url)
    assert said in refused.value.message


def test_a_pipeline_with_tenants_gets_a_password_for_each_tenants_user(tmp_path: Path) -> None:
    """The tenants come from the pipeline file, as the ACL's users do: each user its own fresh password
    (they were left at CHANGE-ME, and a password was made for an ``sfclient`` the file did not have)."""
    pipeline = PipelineConfig.model_validate({"security": {"tenants": ["acme", "beta"]}})
    data = redis_secret(pipeline, Values())["stringData"]
    assert "CHANGE-ME" not in data["users.acl"]
    assert {k for k in data if k.startswith("sfclient")} == {"sfclient-acme-password", "sfclient-beta-password"}
    for tenant in ("acme", "beta"):
        assert f"user sfclient-{tenant} on >{data[f'sfclient-{tenant}-password']} " in data["users.acl"]


def test_a_sentinel_url_is_refused_as_url_pointing_at_the_ha_component() -> None:
    pipeline = PipelineConfig.load(TREE / "base" / "pipeline.toml")
    with pytest.raises(ConfigError, match="--sentinel"):  # it crashed on the sentinels' port list
        redis_secret(pipeline, Values(), url="redis+sentinel://u:p@s1:26379,s2:26379/stageferry/0")


def test_the_acl_file_runs_in_redis(server: PrivateRedis, secret: dict[str, Any]) -> None:
    data = secret["stringData"]
    services = sync_redis.Redis(port=server.port, username="stageferry", password=data["password"])
    services.xgroup_create("sf:stage:diffusion:in", "diffusion", id="0", mkstream=True)
    services.xadd("sf:stage:diffusion:in", {"job": "{}"})
    services.xadd("sf:stage:diffusion:in", {"job": "{}"})
    services.xreadgroup("diffusion", "replica-a", {"sf:stage:diffusion:in": ">"}, count=1)

    scaler = sync_redis.Redis(port=server.port, username=data["scaler-username"], password=data["scaler-password"])
    assert scaler.xpending("sf:stage:diffusion:in", "diffusion")["pending"] == 1  # pendingEntriesCount
    (group,) = scaler.xinfo_groups("sf:stage:diffusion:in")  # lagCount
    assert group["name"] == b"diffusion" and group["lag"] == 1
    assert scaler.xlen("sf:stage:diffusion:in") == 2
    services.rpush("sf:stage:encoder:submit", b"{}")
    assert scaler.llen("sf:stage:encoder:submit") == 1  # the first stage's intake backlog (KEDA's redis trigger)
    for refused in (
        lambda: scaler.lrange("sf:stage:encoder:submit", 0, -1),  # no submission's body
        lambda: scaler.llen("sf:stage:diffusion:in"),  # LLEN on the intake lists only
        lambda: scaler.xrange("sf:stage:diffusion:in"),  # no entry's body (prompts)
        lambda: scaler.xlen("sf:req-events:x"),  # no other key
        lambda: scaler.xadd("sf:stage:diffusion:in", {"job": "{}"}),
        lambda: scaler.get("sf:req:x"),
    ):
        with pytest.raises(sync_redis.exceptions.NoPermissionError):
            refused()
    client = sync_redis.Redis(port=server.port, username="sfclient", password=data["sfclient-password"])
    assert client.ping()
    with pytest.raises(sync_redis.exceptions.AuthenticationError):
        sync_redis.Redis(port=server.port).ping()  # the default user is off
