"""deploy/kubernetes/ha_smoke.sh (the failover under load in real containers, too slow for the suite: its
output is in benchmarks/results/issue36/) against the tree it runs: the pods it plays, kills and asks are
the rendered overlays/cpu-ha's, its Secret is `stageferry kube secret --sentinel`'s, and the pipeline it
generates is the committed one with every stage at TP1."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stageferry.config import PipelineConfig
from stageferry.kube.generate import generated_files, write
from stageferry.kube.sentinel import SENTINEL_PORT, SERVICE
from tests.kube.render import TREE, by_kind, copy_tree, render

pytestmark = pytest.mark.timeout(300)

SCRIPT = (TREE / "ha_smoke.sh").read_text()


def test_it_plays_the_sentinel_overlay_with_its_secret() -> None:
    assert '"$kubectl" kustomize "$tree/overlays/cpu-ha"' in SCRIPT
    assert "kube secret --sentinel" in SCRIPT
    assert "podplay.py" in SCRIPT and "podman kube play" in SCRIPT


def test_the_names_it_uses_are_the_rendered_ones() -> None:
    objects = render(TREE / "overlays" / "cpu-ha")
    sets = by_kind(objects, "StatefulSet")
    data, sentinels = sets["stageferry-redis"], sets["stageferry-sentinel"]
    for statefulset in (data, sentinels):
        name, replicas = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
        assert f'for i in 0 1 2; do play "{name}-$i"; done' in SCRIPT and replicas == 3
    (claim,) = data["spec"]["volumeClaimTemplates"]  # the pods' volumes, which it removes before and after
    claims = " ".join(f"{claim['metadata']['name']}-stageferry-redis-{i}" for i in range(data["spec"]["replicas"]))
    assert f"volumes=({claims})" in SCRIPT
    # it asks the sentinels on their port for the service they monitor, and maps the master's announced
    # name (<pod>.<headless service>.<namespace>.svc) back to the pod; the Secret and the pods' POD_NAMESPACE
    # both name its namespace
    assert f"-p {SENTINEL_PORT} --raw sentinel get-master-addr-by-name {SERVICE}" in SCRIPT
    assert f'announced() {{ echo "$1.{data["spec"]["serviceName"]}.$namespace.svc"; }}' in SCRIPT
    assert 'kube secret --sentinel --namespace "$namespace"' in SCRIPT and '--namespace "$namespace"' in SCRIPT
    (port,) = sentinels["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port["containerPort"] == SENTINEL_PORT
    # the gateway it submits to: its one container's port
    gateway = by_kind(objects, "Deployment")["stageferry-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert re.search(r'gw="http://\$\{ip_of\[\$gateway\]\}:(\d+)"', SCRIPT).group(1) == str(  # type: ignore[union-attr]
        gateway["ports"][0]["containerPort"]
    )


def test_its_pipeline_is_the_committed_one_at_tp1(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path / "k")
    (edit,) = re.findall(r"sed -i -e '([^']+)' \"\$tree/base/pipeline.toml\"", SCRIPT)
    pipeline = tree / "base" / "pipeline.toml"
    subprocess.run(["sed", "-i", "-e", edit, str(pipeline)], check=True)
    edited, committed = PipelineConfig.load(pipeline), PipelineConfig.load(TREE / "base" / "pipeline.toml")
    assert [s.name for s in edited.stages] == [s.name for s in committed.stages]
    assert all(s.tp == 1 for s in edited.stages) and any(s.tp > 1 for s in committed.stages)
    write(tree, generated_files(pipeline, tree / "values.toml"))
    rendered = render(tree / "overlays" / "cpu-ha")
    for stage in edited.stages:
        d = by_kind(rendered, "Deployment")[f"stageferry-{stage.name}"]
        assert d["spec"]["template"]["spec"]["containers"][0]["command"] == ["stageferry", "serve", stage.name]
    out = subprocess.run(
        [sys.executable, "-m", "stageferry", "kube", "secret", "--sentinel", "--root", str(tree)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout)["stringData"]
    assert data["url"].startswith("redis+sentinel://") and data["url"].endswith("?wait_replicas=2")
    assert {"password", "sentinel-password", "replica-password"} <= set(data)  # what the script reads
