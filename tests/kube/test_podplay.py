"""deploy/kubernetes/podplay.py, which stands in for a cluster's controllers in the podman run
(smoke.sh): the Pods it writes are the rendered pod templates with only the controllers' and kubelet's
part filled in.  No containers here: smoke.sh runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stageferry.config import PipelineConfig
from stageferry.kube.generate import redis_secret, secret_yaml
from stageferry.kube.values import Values
from tests.kube.render import TREE, by_kind, kubectl

pytestmark = pytest.mark.timeout(120)


def test_pods_from_the_rendered_cpu_profile(tmp_path: Path) -> None:
    rendered = tmp_path / "rendered.yaml"
    out = subprocess.run(
        [kubectl(), "kustomize", str(TREE / "overlays" / "cpu")], capture_output=True, text=True, timeout=60
    )
    rendered.write_text(out.stdout)
    secret = redis_secret(PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values.load(TREE / "values.toml"))
    (tmp_path / "secret.yaml").write_text(secret_yaml(secret))
    pods = tmp_path / "pods"
    podplay = [sys.executable, str(TREE / "podplay.py"), str(rendered), str(tmp_path / "secret.yaml")]
    options = ["--out", str(pods), "--subnet", "10.89.99", "--replicas", "stageferry-diffusion=2"]
    plan = subprocess.run([*podplay, *options], capture_output=True, text=True, timeout=60, check=True)
    rows = [line.split() for line in plan.stdout.splitlines()]
    assert rows[0] == ["stageferry-redis", "10.89.99.10", "stageferry-redis"]  # named after its Service
    diffusion, encoder, gateway = "stageferry-diffusion", "stageferry-encoder", "stageferry-gateway"
    assert [r[0] for r in rows[1:]] == [
        f"{diffusion}-0",
        f"{diffusion}-1",
        f"{encoder}-0",
        f"{gateway}-0",
        f"{gateway}-1",
    ]
    for kind in ("Service", "NetworkPolicy", "PodDisruptionBudget", "ScaledObject"):
        assert kind in plan.stderr  # listed as not played
    templates = by_kind(list(yaml.safe_load_all(out.stdout)), "Deployment")
    for name, ip, workload in rows[1:]:
        (pod,) = [d for d in yaml.safe_load_all((pods / f"{name}.yaml").read_text()) if d["kind"] == "Pod"]
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert "ports" not in container and all("valueFrom" not in e for e in container["env"])
        assert env["STAGEFERRY_REDIS_URL"] == secret["stringData"]["url"]
        (rendered_container,) = templates[workload]["spec"]["template"]["spec"]["containers"]
        assert (
            container["command"] == rendered_container["command"] and container["image"] == rendered_container["image"]
        )
        if workload != "stageferry-gateway":
            assert (env["STAGEFERRY_ADVERTISE_ADDRESS"], env["STAGEFERRY_REPLICA"]) == (ip, name)
            assert container["resources"] == rendered_container["resources"]
    tmpfs = dict(line.split() for line in (pods / "tmpfs.txt").read_text().splitlines())
    assert (
        tmpfs[str(pods / "files" / "stageferry-diffusion-0" / "dshm")] == "3584m"
    )  # pool 256M + 3 x 1G (fan-out, TP4) + 256M


def test_pods_of_the_sentinel_profile_know_the_stable_names(tmp_path: Path) -> None:
    """overlays/cpu-ha: three data pods and three sentinels named as their StatefulSets name them, and
    every pod resolves each one's DNS names under its headless Service (hostAliases: podman's DNS serves
    pod names only), the long one of which the sentinels hand out as the master's address."""
    out = subprocess.run(
        [kubectl(), "kustomize", str(TREE / "overlays" / "cpu-ha")], capture_output=True, text=True, timeout=60
    )
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(out.stdout)
    pipeline, values = PipelineConfig.load(TREE / "base" / "pipeline.toml"), Values.load(TREE / "values.toml")
    secret = redis_secret(pipeline, values, sentinel=True)
    (tmp_path / "secret.yaml").write_text(secret_yaml(secret))
    pods = tmp_path / "pods"
    plan = subprocess.run(
        [sys.executable, str(TREE / "podplay.py"), str(rendered), str(tmp_path / "secret.yaml"),
         "--out", str(pods), "--subnet", "10.89.98"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    ip_of = {name: ip for name, ip, _ in (line.split() for line in plan.stdout.splitlines())}
    stable = {
        ip_of[f"{s}-{i}"]: [f"{s}-{i}.{s}", f"{s}-{i}.{s}.stageferry.svc"]  # in the namespace, and from any
        for s in ("stageferry-redis", "stageferry-sentinel")
        for i in range(3)
    }
    for name in ip_of:
        docs = list(yaml.safe_load_all((pods / f"{name}.yaml").read_text()))
        (pod,) = [d for d in docs if d["kind"] == "Pod"]
        assert {h["ip"]: h["hostnames"] for h in pod["spec"]["hostAliases"]} == stable
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        if name.startswith(("stageferry-redis-", "stageferry-sentinel-")):
            assert env["POD_NAMESPACE"] == "stageferry"  # the downward API's metadata.namespace
        if name.startswith("stageferry-redis-"):
            assert env["REDIS_REPLICA_PASSWORD"] == secret["stringData"]["replica-password"]
            assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Pod"]
        elif name.startswith("stageferry-sentinel-"):
            assert env["REDIS_SENTINEL_PASSWORD"] == secret["stringData"]["sentinel-password"]
        else:
            assert env["STAGEFERRY_REDIS_URL"] == secret["stringData"]["url"]
