"""The rendered CPU and GPU profiles: reproducible, valid against the Kubernetes schemas (pinned version)
and KEDA's CRD schema, and what docs/kubernetes.md says they are — checked on the objects themselves,
since `podman kube play` (deploy/kubernetes/smoke.sh) cannot act on Services, PodDisruptionBudgets,
NetworkPolicies or KEDA's objects."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from stageferry.config import PipelineConfig
from stageferry.kube.values import Values, shm_bytes
from tests.kube.render import K8S_VERSION, TREE, by_kind, copy_tree, render

pytestmark = pytest.mark.timeout(300)

SCHEMAS = Path(__file__).parent / "schemas"
KEDA = {
    "ScaledObject": json.loads((SCHEMAS / "keda-scaledobject-v1alpha1.json").read_text()),
    "TriggerAuthentication": json.loads((SCHEMAS / "keda-triggerauthentication-v1alpha1.json").read_text()),
}
RECOMMENDED = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/part-of",
)
PIPELINE = PipelineConfig.load(TREE / "base" / "pipeline.toml")
VALUES = Values.load(TREE / "values.toml")


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def profile(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(TREE / "overlays" / request.param)


def validate(obj: dict[str, Any]) -> None:
    if obj["apiVersion"].startswith("keda.sh/"):
        jsonschema.validate(obj, KEDA[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_every_object_validates(profile: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = profile
    assert {o["kind"] for o in objects} >= {
        "ConfigMap", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
        "ScaledObject", "TriggerAuthentication",
    }  # fmt: skip
    for obj in objects:
        validate(obj)


def test_a_broken_object_fails_validation() -> None:
    """The validators do refuse: a misspelt field and a ScaledObject without its target."""
    objects = render(TREE / "overlays" / "cpu")
    deployment = by_kind(objects, "Deployment")["stageferry-encoder"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = by_kind(objects, "ScaledObject")["stageferry-diffusion"]
    del scaled["spec"]["scaleTargetRef"]
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_rendering_is_reproducible(tmp_path: Path) -> None:
    """Two renders, of the tree and of a copy elsewhere, are the same objects (ConfigMap hash included)."""
    assert render(TREE / "overlays" / "cpu") == render(copy_tree(tmp_path / "k") / "overlays" / "cpu")


def test_recommended_labels_on_every_object_and_pod(profile: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = profile
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert all(labels.get(k) for k in RECOMMENDED), (obj["kind"], obj["metadata"]["name"], labels)
        template = obj.get("spec", {}).get("template")
        if template is not None:
            assert all(template["metadata"]["labels"].get(k) for k in RECOMMENDED), obj["metadata"]["name"]


def test_one_workload_per_stage_sized_from_the_pipeline(profile: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = profile
    deployments = by_kind(objects, "Deployment")
    for stage in PIPELINE.stages:
        d = deployments[f"stageferry-{stage.name}"]
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["command"] == ["stageferry", "serve", stage.name]  # its ranks are processes in the pod
        resources = container["resources"]
        if name == "gpu":
            assert resources["limits"]["nvidia.com/gpu"] == str(stage.world_size)
            assert resources["requests"]["nvidia.com/gpu"] == str(stage.world_size)
        else:
            assert "nvidia.com/gpu" not in resources.get("limits", {})
            assert resources["requests"]["cpu"] and resources["requests"]["memory"] == resources["limits"]["memory"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert shm["medium"] == "Memory" and shm["sizeLimit"] == f"{shm_bytes(PIPELINE, stage) >> 20}Mi"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        env = {e["name"]: e for e in container["env"]}
        assert env["STAGEFERRY_ADVERTISE_ADDRESS"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["STAGEFERRY_REPLICA"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert env["STAGEFERRY_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "stageferry-redis", "key": "url"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["exec"]["command"][:4] == ["stageferry", "health", "--stage", stage.name]
        assert "kill -TERM 1" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])
        job_s = VALUES.for_stage(stage).job_seconds
        assert job_s is not None and pod["terminationGracePeriodSeconds"] > job_s
        (spread,) = pod["topologySpreadConstraints"]
        assert spread["topologyKey"] == "kubernetes.io/hostname"
        assert spread["labelSelector"]["matchLabels"] == d["spec"]["selector"]["matchLabels"]
        assert by_kind(objects, "PodDisruptionBudget")[d["metadata"]["name"]]["spec"]["maxUnavailable"] == 1
        mount = next(m for m in container["volumeMounts"] if m["name"] == "pipeline")
        assert mount["mountPath"] == env["STAGEFERRY_PIPELINE"]["value"]
        assert next(v for v in pod["volumes"] if v["name"] == "pipeline")["configMap"]["name"].startswith(
            "stageferry-pipeline-"
        )  # the hashed name of the ConfigMap that holds base/pipeline.toml


def test_the_configmap_is_the_pipeline_file(profile: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = profile
    (cm,) = by_kind(objects, "ConfigMap").values()
    assert cm["data"]["pipeline.toml"] == (TREE / "base" / "pipeline.toml").read_text()


def test_keda_scales_each_stage_on_its_consumer_group(profile: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = profile
    scaled = by_kind(objects, "ScaledObject")
    assert set(scaled) == {f"stageferry-{s.name}" for s in PIPELINE.stages}
    for stage in PIPELINE.stages:
        spec = scaled[f"stageferry-{stage.name}"]["spec"]
        v = VALUES.for_stage(stage)
        assert spec["scaleTargetRef"]["name"] == f"stageferry-{stage.name}"
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (v.min_replicas, v.max_replicas)
        pending, lag, *intakes = spec["triggers"]
        if stage is PIPELINE.stages[0]:  # clients' submissions wait in its intake lists before its stream
            expected = [f"{VALUES.prefix}:stage:{stage.name}:submit"]
            expected += [f"{VALUES.prefix}:stage:{stage.name}:submit:{t}" for t in PIPELINE.security.tenants]
            assert [t["metadata"]["listName"] for t in intakes] == expected
            for trigger in intakes:
                assert trigger["type"] == "redis"
                assert trigger["authenticationRef"]["name"] == "stageferry-redis-scaler"
        else:
            assert intakes == []
        for trigger in (pending, lag):
            assert trigger["type"] == "redis-streams"
            assert trigger["metadata"]["stream"] == f"{VALUES.prefix}:stage:{stage.name}:in"
            assert trigger["metadata"]["consumerGroup"] == stage.name
            assert trigger["authenticationRef"]["name"] == "stageferry-redis-scaler"
        assert pending["metadata"]["pendingEntriesCount"] == str(v.pending_per_replica)
        assert lag["metadata"]["lagCount"] == str(v.lag_per_replica)
    auth = by_kind(objects, "TriggerAuthentication")["stageferry-redis-scaler"]["spec"]["secretTargetRef"]
    assert {(a["parameter"], a["key"]) for a in auth} == {
        ("address", "address"),
        ("username", "scaler-username"),
        ("password", "scaler-password"),
    }


def test_network_policy(profile: tuple[str, list[dict[str, Any]]]) -> None:
    """Clients reach only the gateway and Redis; NIXL's ports are open between stage pods only."""
    _, objects = profile
    policies = by_kind(objects, "NetworkPolicy")
    deny = policies["stageferry-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/instance": "stageferry"}
    (gateway,) = policies["stageferry-gateway"]["spec"]["ingress"]
    assert "from" not in gateway and gateway["ports"] == [{"protocol": "TCP", "port": 8091}]
    (redis,) = policies["stageferry-redis"]["spec"]["ingress"]
    assert redis["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert {"podSelector": {"matchLabels": {"stageferry.io/client": "true"}}, "namespaceSelector": {}} in redis["from"]
    nixl = policies["stageferry-nixl"]["spec"]
    low, high = (int(p) for p in VALUES.ucx_tcp_ports.split("-"))
    stage_pods = {"matchLabels": {"app.kubernetes.io/instance": "stageferry", "stageferry.io/role": "stage"}}
    assert nixl["podSelector"] == stage_pods
    assert nixl["ingress"] == [
        {"from": [{"podSelector": stage_pods}], "ports": [{"protocol": "TCP", "port": low, "endPort": high}]}
    ]
    for d in by_kind(objects, "Deployment").values():
        labels = d["spec"]["template"]["metadata"]["labels"]
        is_stage = d["metadata"]["name"] != "stageferry-gateway"
        assert (labels.get("stageferry.io/role") == "stage") == is_stage  # only stage pods get the NIXL ports
        if is_stage:
            env = {e["name"]: e.get("value") for e in d["spec"]["template"]["spec"]["containers"][0]["env"]}
            assert env["UCX_TCP_PORT_RANGE"] == VALUES.ucx_tcp_ports


def test_redis_and_gateway(profile: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = profile
    redis = by_kind(objects, "StatefulSet")["stageferry-redis"]
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    options = dict(zip(args[::2], args[1::2], strict=True))
    assert options["--appendonly"] == "yes" and options["--maxmemory-policy"] == "noeviction"
    assert options["--aclfile"] == "/etc/redis/users.acl"
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    services = by_kind(objects, "Service")
    assert services["stageferry-gateway"]["spec"]["ports"][0]["port"] == 8091
    assert services["stageferry-redis"]["spec"]["ports"][0]["port"] == 6379
    gateway = by_kind(objects, "Deployment")["stageferry-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["exec"]["command"][:2] == ["stageferry", "health"]


@pytest.mark.parametrize("components", [["redis-tls"], ["external-redis"]])
def test_components_render_and_validate(tmp_path: Path, components: list[str]) -> None:
    tree = copy_tree(tmp_path / "k")
    overlay = tree / "overlays" / "variant"
    overlay.mkdir()
    listed = ", ".join(f"../../components/{c}" for c in components)
    overlay.joinpath("kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [../cpu]\ncomponents: [{listed}]\n"
    )
    objects = render(overlay)
    for obj in objects:
        validate(obj)
    if components == ["external-redis"]:
        assert "StatefulSet" not in {o["kind"] for o in objects} and "stageferry-redis" not in by_kind(
            objects, "Service"
        )
    else:
        args = by_kind(objects, "StatefulSet")["stageferry-redis"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:4] == ["--port", "0", "--tls-port", "6379"]
        for d in by_kind(objects, "Deployment").values():
            mounts = d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "redis-ca", "mountPath": "/etc/stageferry/tls", "readOnly": True} in mounts
