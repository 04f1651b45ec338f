"""``stageferry kube generate``: the committed per-stage files are what the pipeline file and the values
give (the drift check, like tests/test_docgen.py), and a stage added to the pipeline file appears in
every rendered profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stageferry.errors import ConfigError
from stageferry.kube.generate import generated_files, stale, write
from tests.kube.render import TREE, by_kind, copy_tree, render
from tests.procs import ROOT

pytestmark = pytest.mark.timeout(300)

UPSCALER = """
[[stages]]
name = "upscale_2x"
model = "stageferry.stages.passthrough:factory"
tp = 3
"""


def test_the_committed_files_are_fresh() -> None:
    """Fails when the pipeline file or values.toml changed without `stageferry kube generate`."""
    files = generated_files(TREE / "base" / "pipeline.toml", TREE / "values.toml")
    assert stale(TREE, files) == [], "run: stageferry kube generate"


def test_check_reports_drift_and_generate_mends_it(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path / "k")
    pipeline = tree / "base" / "pipeline.toml"
    pipeline.write_text(pipeline.read_text() + UPSCALER)
    cli = [sys.executable, "-m", "stageferry", "kube", "generate", "--root", str(tree)]
    check = subprocess.run([*cli, "--check"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert check.returncode == 1
    assert sorted(line.split("/k/")[-1] for line in check.stderr.split()[1::2]) == sorted(
        [
            "base/stages.yaml",
            "overlays/cpu/stages.yaml",
            "overlays/gpu/stages.yaml",
            "components/keda/scaledobjects.yaml",
            "components/keda-sentinel/scaledobjects.yaml",
        ]
    )
    assert subprocess.run(cli, capture_output=True, cwd=ROOT, timeout=120).returncode == 0
    assert subprocess.run([*cli, "--check"], capture_output=True, cwd=ROOT, timeout=120).returncode == 0


def test_a_stage_added_to_the_pipeline_file_appears_in_the_manifests(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path / "k")
    pipeline = tree / "base" / "pipeline.toml"
    pipeline.write_text(pipeline.read_text() + UPSCALER)
    write(tree, generated_files(pipeline, tree / "values.toml"))
    for profile in ("cpu", "gpu"):
        objects = render(tree / "overlays" / profile)
        name = "stageferry-upscale-2x"  # a Kubernetes name: `_` becomes `-`
        deployment = by_kind(objects, "Deployment")[name]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["stageferry", "serve", "upscale_2x"]
        assert deployment["metadata"]["labels"]["app.kubernetes.io/component"] == "upscale-2x"
        assert name in by_kind(objects, "PodDisruptionBudget")
        (trigger, _) = by_kind(objects, "ScaledObject")[name]["spec"]["triggers"]
        assert (trigger["metadata"]["stream"], trigger["metadata"]["consumerGroup"]) == (
            "sf:stage:upscale_2x:in",
            "upscale_2x",
        )
        if profile == "gpu":
            assert container["resources"]["limits"]["nvidia.com/gpu"] == "3"
        else:
            assert container["resources"]["requests"]["cpu"] == "3"  # 1 per rank, from values.toml's defaults
        (cm,) = by_kind(objects, "ConfigMap").values()
        assert 'name = "upscale_2x"' in cm["data"]["pipeline.toml"]


def test_a_prefix_in_the_values_reaches_the_gateway_as_the_stages(tmp_path: Path) -> None:
    """``prefix`` in values.toml: the gateway submits under the stages' prefix (its was written by hand as
    ``sf`` and drifted: its jobs reached no stage, and its ACL user was refused their keys)."""
    tree = copy_tree(tmp_path / "k")
    values = tree / "values.toml"
    values.write_text(values.read_text().replace('prefix = "sf"', 'prefix = "xq"', 1))
    assert write(tree, generated_files(tree / "base" / "pipeline.toml", values))  # the drift, mended
    objects = render(tree / "overlays" / "cpu")
    prefixes = {
        name: [e["value"] for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
               if e["name"] == "STAGEFERRY_PREFIX"]
        for name, d in by_kind(objects, "Deployment").items()
    }  # fmt: skip
    assert prefixes == {name: ["xq"] for name in prefixes} and "stageferry-gateway" in prefixes, prefixes


def test_values_for_a_stage_the_file_lacks_are_refused(tmp_path: Path) -> None:
    values = tmp_path / "values.toml"
    values.write_text((TREE / "values.toml").read_text() + "\n[stages.upscaler]\nmax_replicas = 2\n")
    with pytest.raises(ConfigError, match="upscaler"):
        generated_files(TREE / "base" / "pipeline.toml", values)


def test_without_pyyaml_the_command_says_which_extra_it_needs() -> None:
    code = "import sys; sys.modules['yaml'] = None; from stageferry.cli import main; main()"
    out = subprocess.run(
        [sys.executable, "-c", code, "kube", "generate", "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "stageferry kube needs PyYAML: pip install 'stageferry[kube]'" in out.stderr
