"""The Kubernetes deployment behind Redis Sentinel (components/redis-ha, components/keda-sentinel,
overlays/cpu-ha and gpu-ha): valid objects (pinned Kubernetes schemas, KEDA's CRD schemas), the shape
docs/high-availability.md describes — three data pods with the loss-bounding settings, three sentinels,
disruption budgets, anti-affinity, headless Services, every KEDA trigger through the sentinels — and a
``stageferry kube secret --sentinel`` whose URL names exactly those pods and whose users run a real
Sentinel group (replication as sfreplica, the sentinels as sfsentinel, a submission WAITed on both
replicas).  The containers themselves run in deploy/kubernetes/ha_smoke.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from stageferry.broker.control.keys import Keys
from stageferry.broker.control.redis_url import parse_url
from stageferry.chaos.sentinels import GroupAuth, SentinelGroup
from stageferry.client import Client
from stageferry.config import PipelineConfig
from stageferry.errors import ConfigError
from stageferry.kube.generate import redis_secret
from stageferry.kube.sentinel import SERVICE, sentinel_addresses
from stageferry.kube.values import Values
from tests.kube.render import TREE, by_kind, render
from tests.kube.test_render import validate

pytestmark = pytest.mark.timeout(300)

PIPELINE = PipelineConfig.load(TREE / "base" / "pipeline.toml")
VALUES = Values.load(TREE / "values.toml")
Obj = dict[str, Any]


@pytest.fixture(scope="module", params=["cpu-ha", "gpu-ha"])
def objects(request: pytest.FixtureRequest) -> list[Obj]:
    return render(TREE / "overlays" / request.param)


@pytest.fixture(scope="module")
def secret() -> Obj:
    return redis_secret(PIPELINE, VALUES, sentinel=True)


def _script(statefulset: Obj) -> str:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["sh", "-c"] and "args" not in container
    return str(container["command"][2])


def _stable_names(statefulset: Obj, port: int, namespace: str | None = None) -> list[str]:
    """The pods' DNS names under the StatefulSet's headless Service, as the cluster's DNS serves them: in
    their namespace, or with ``namespace`` from any."""
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    suffix = f".{namespace}.svc" if namespace else ""
    return [f"{name}-{i}.{service}{suffix}:{port}" for i in range(statefulset["spec"]["replicas"])]


def _namespace_from_the_downward_api(statefulset: Obj) -> bool:
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("valueFrom") for e in container["env"]}
    return env.get("POD_NAMESPACE") == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_every_object_validates(objects: list[Obj]) -> None:
    for obj in objects:
        validate(obj)


def test_three_data_pods_with_the_settings_that_bound_the_loss(objects: list[Obj]) -> None:
    data = by_kind(objects, "StatefulSet")["stageferry-redis"]
    assert data["spec"]["replicas"] == 3
    script = _script(data)
    for setting in (
        "--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction",
        "--min-replicas-to-write 1", "--min-replicas-max-lag 10", "--aclfile /etc/redis/users.acl",
        '--masteruser sfreplica --masterauth "$REDIS_REPLICA_PASSWORD"', '--replica-announce-ip "$me"',
    ):  # fmt: skip
        assert setting in script, setting
    # a restarted pod asks the sentinels first: only with none answering does ordinal 0 start as the primary
    assert "sentinel get-master-addr-by-name stageferry" in script
    assert 'master="stageferry-redis-0.stageferry-redis.$POD_NAMESPACE.svc"' in script
    assert 'me="$HOSTNAME.stageferry-redis.$POD_NAMESPACE.svc"' in script  # announced: dialled from any namespace
    assert _namespace_from_the_downward_api(data)
    assert "[ -e /data/appendonlydir ]" in script  # a restarted master with data waits for the failover
    # it knows itself by pod name in the master the sentinels name: long, or short (a group made before)
    assert 'if [ "${master%%.*}" = "$HOSTNAME" ] && [ -e /data/appendonlydir ]' in script
    assert '"$master" = "$me"' not in script and '"$master" != "$me"' not in script
    (container,) = data["spec"]["template"]["spec"]["containers"]
    startup = container["startupProbe"]  # liveness waits for it: the wait above (60 s and its asks) is no hang
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180 and "for _ in $(seq 60)" in script
    (claim,) = data["spec"]["volumeClaimTemplates"]  # the AOF on a volume of its own, per pod
    assert claim["metadata"]["name"] == "data"


def test_three_sentinels_quorum_two_with_their_user(objects: list[Obj]) -> None:
    sentinels = by_kind(objects, "StatefulSet")["stageferry-sentinel"]
    assert sentinels["spec"]["replicas"] == 3
    script = _script(sentinels)
    assert f"sentinel monitor {SERVICE} $master 6379 2" in script
    assert f"sentinel auth-user {SERVICE} sfsentinel" in script
    assert "sentinel resolve-hostnames yes" in script and "sentinel announce-hostnames yes" in script
    assert "sentinel myid $(printf" in script  # the same id across restarts: no stale sentinels pile up
    assert "sentinel announce-ip $HOSTNAME.stageferry-sentinel.$POD_NAMESPACE.svc" in script
    assert _namespace_from_the_downward_api(sentinels)


def test_budgets_anti_affinity_and_headless_services(objects: list[Obj]) -> None:
    budgets, services = by_kind(objects, "PodDisruptionBudget"), by_kind(objects, "Service")
    for name, component in (("stageferry-redis", "redis"), ("stageferry-sentinel", "sentinel")):
        selector = {"app.kubernetes.io/instance": "stageferry", "app.kubernetes.io/component": component}
        assert budgets[name]["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": selector}}
        spec = by_kind(objects, "StatefulSet")[name]["spec"]
        assert spec["serviceName"] == name and spec["selector"]["matchLabels"] == selector
        (term,) = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"] == {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": selector},
        }
        assert services[name]["spec"]["clusterIP"] == "None" and services[name]["spec"]["publishNotReadyAddresses"]
    (ingress,) = by_kind(objects, "NetworkPolicy")["stageferry-sentinel"]["spec"]["ingress"]
    assert ingress["ports"] == [{"protocol": "TCP", "port": 26379}]


def test_every_keda_trigger_asks_the_sentinels(objects: list[Obj]) -> None:
    """Each trigger asks the sentinels, whose addresses come from the Secret through the
    TriggerAuthentication: there they name the namespace (KEDA's operator dials from ``keda``)."""
    scaled = by_kind(objects, "ScaledObject")
    assert set(scaled) == {f"stageferry-{s.name}" for s in PIPELINE.stages}
    for obj in scaled.values():
        triggers = obj["spec"]["triggers"]
        assert {t["name"] for t in triggers} >= {"pending", "lag"}
        for trigger in triggers:
            assert trigger["type"] in {"redis-sentinel-streams", "redis-sentinel"}
            assert trigger["type"] == (
                "redis-sentinel" if "listName" in trigger["metadata"] else "redis-sentinel-streams"
            )
            assert trigger["metadata"]["sentinelMaster"] == SERVICE and "addresses" not in trigger["metadata"]
    auth = by_kind(objects, "TriggerAuthentication")["stageferry-redis-scaler"]["spec"]["secretTargetRef"]
    assert {a["parameter"]: a["key"] for a in auth} == {  # the sentinels' addresses, no single address
        "addresses": "sentinel-addresses",
        "username": "scaler-username",
        "password": "scaler-password",
    }


def test_the_secret_names_the_pods_and_every_key_the_pods_read(objects: list[Obj], secret: Obj) -> None:
    data = secret["stringData"]
    url = parse_url(data["url"])
    sentinels = by_kind(objects, "StatefulSet")["stageferry-sentinel"]
    assert data["url"].startswith("redis+sentinel://stageferry:")
    assert urlsplit(data["url"]).netloc.split("@")[1] == ",".join(_stable_names(sentinels, 26379))
    # KEDA's: dialled from its own namespace, so named with the deployment's (--namespace, default stageferry)
    assert data["sentinel-addresses"] == ",".join(_stable_names(sentinels, 26379, "stageferry"))
    other = redis_secret(PIPELINE, VALUES, sentinel=True, namespace="video-prod")["stringData"]
    assert (
        other["sentinel-addresses"]
        == sentinel_addresses("video-prod")
        == ",".join(_stable_names(sentinels, 26379, "video-prod"))
    )
    assert url.durability.replicas == by_kind(objects, "StatefulSet")["stageferry-redis"]["spec"]["replicas"] - 1
    assert "/stageferry/0?" in data["url"]  # the service the sentinels monitor, database 0
    for obj in objects:
        for container in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["name"] == "stageferry-redis":
                    assert ref["key"] in data, (obj["metadata"]["name"], ref["key"])
    for user in ("sfreplica", "sfsentinel"):
        assert f"user {user} on >" in data["users.acl"]
    with pytest.raises(ConfigError):
        redis_secret(PIPELINE, VALUES, sentinel=True, tls=True)


def secrets_group(tmp_path: Path, data: dict[str, str]) -> SentinelGroup:
    """A real Sentinel group on loopback whose data nodes load the Secret's ACL file (and an admin user
    for the group's own checks): replication as sfreplica, the sentinels as sfsentinel."""
    acl = tmp_path / "users.acl"
    acl.write_text(data["users.acl"] + "user admin on >admin-pw ~* &* +@all\n")
    auth = GroupAuth(
        admin=("admin", "admin-pw"),
        replica=("sfreplica", data["replica-password"]),
        sentinel=("sfsentinel", data["sentinel-password"]),
    )
    return SentinelGroup(tmp_path / "ha", data_args=("--aclfile", str(acl)), auth=auth)


@pytest.mark.anyio
async def test_the_secrets_users_run_a_sentinel_group(tmp_path: Path, secret: Obj) -> None:
    """Real servers with the Secret's ACL file: the replicas replicate with its replica password, the
    sentinels watch with its sentinel password, and a client on its URL's options submits, WAITed on both
    replicas (the group is on loopback: only the sentinels' addresses differ from the URL)."""
    data = secret["stringData"]
    async with secrets_group(tmp_path, data) as group:
        primary = await group.wait_settled(replicas=2)
        parts = urlsplit(data["url"])
        url = group.url(userinfo=f"sfclient:{data['sfclient-password']}@", query=parts.query)
        assert parse_url(url).durability.replicas == 2
        async with Client(url, prefix=VALUES.prefix, pipeline=PIPELINE) as client:
            rid = await client.submit({"prompt": "a cat", "width": 320, "height": 192, "num_inference_steps": 2})
        intake = Keys(VALUES.prefix).intake(PIPELINE.stages[0].name)
        replicas = [node for node in group.nodes if node is not primary]
        assert len(replicas) == 2
        for replica in replicas:  # acknowledged: on both replicas already
            assert group.node_client(replica).llen(intake) == 1, rid


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _redis_cli_shim(directory: Path, hosts: dict[str, int]) -> Path:
    """A ``redis-cli`` first on PATH that maps the pods' DNS names (cluster DNS is not here) to loopback
    ports, then runs the real one: the script's own commands reach real servers.  A name not in ``hosts``
    goes to port 1, where nothing listens (a pod that is down)."""
    real = shutil.which("redis-cli")
    assert real, "redis-cli is not on PATH"
    cases = "".join(f'      "{name}") set -- "$@" -h 127.0.0.1 -p {port}; skip=1 ;;\n' for name, port in hosts.items())
    shim = directory / "redis-cli"
    shim.write_text(f"""#!/bin/sh
n=$#; skip=0
while [ "$n" -gt 0 ]; do
  a="$1"; shift; n=$((n - 1))
  if [ "$a" = "-h" ]; then
    h="$1"; shift; n=$((n - 1))
    case "$h" in
{cases}      *) set -- "$@" -h 127.0.0.1 -p 1; skip=1 ;;
    esac
  elif [ "$a" = "-p" ] && [ "$skip" = 1 ]; then
    shift; n=$((n - 1)); skip=0
  else
    set -- "$@" "$a"
  fi
done
exec {real} "$@"
""")
    shim.chmod(0o755)
    return directory


@pytest.mark.anyio
async def test_sentinels_all_restarted_after_a_failover_monitor_the_master_that_is(tmp_path: Path, secret: Obj) -> None:
    """Every sentinel restarted at once (its state in an emptyDir) after a failover: none can name the
    master, and the script fell back to ordinal 0, a replica by then; writes stopped for good (READONLY).
    Now it asks the data nodes themselves (``INFO replication`` as sfsentinel) and monitors the one that
    is master.  The rendered script runs against a real group after a real failover; only the pods' DNS
    names are mapped to loopback (:func:`_redis_cli_shim`), and it stops before starting the sentinel."""
    objects = render(TREE / "overlays" / "cpu-ha")
    script = _script(by_kind(objects, "StatefulSet")["stageferry-sentinel"])
    data = secret["stringData"]
    async with secrets_group(tmp_path, data) as group:
        first = await group.wait_settled(replicas=2)
        old = group.failover()
        master = await group.wait_new_master(old)
        await group.wait_settled(replicas=2)
        ordinals = [first, *(node for node in group.nodes if node is not first)]  # ordinal 0: the first master
        hosts = {f"stageferry-redis-{i}.stageferry-redis.ns1.svc": node.port for i, node in enumerate(ordinals)}
        conf_dir = tmp_path / "data"
        conf_dir.mkdir()
        run = script.replace("/data", str(conf_dir)).replace(
            "exec redis-server", "exit 0 #"
        )  # the sentinel it would start: its config is what counts
        env = {
            "PATH": f"{_redis_cli_shim(tmp_path, hosts)}:{os.environ['PATH']}",
            "HOSTNAME": "stageferry-sentinel-0",
            "POD_NAMESPACE": "ns1",
            "REDIS_SENTINEL_PASSWORD": data["sentinel-password"],
        }
        done = subprocess.run(["sh", "-c", run], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        conf = (conf_dir / "sentinel.conf").read_text().splitlines()
        [monitor] = [ln for ln in conf if "sentinel monitor" in ln]
        named = monitor.split()[3]  # its name from any namespace: the address KEDA's operator is handed
        assert hosts[named] == master.port != first.port, (monitor, hosts, master.port)
        assert "sentinel announce-ip stageferry-sentinel-0.stageferry-sentinel.ns1.svc" in [ln.strip() for ln in conf]
