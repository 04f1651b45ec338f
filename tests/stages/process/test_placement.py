"""The placement planner (a pure function of the pipeline and the GPU count) and ``devices`` validation.

No GPU is needed: the planner is given the host's GPU count, as ``stageferry plan --gpus N`` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stageferry.cli import app
from stageferry.config import DEFAULT_STAGES, PipelineConfig
from stageferry.errors import ConfigError
from stageferry.stages.process import placement
from stageferry.stages.process.placement import (
    GPU_DEVICE_NODES,
    PlacedBy,
    Plan,
    default_stages,
    host_gpus,
    parse_devices,
    pipeline_for_host,
    plan,
    with_overrides,
)

runner = CliRunner()


def pipeline(tmp_path: Path, text: str) -> PipelineConfig:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return PipelineConfig.load(path)


def two_stages(enc: str, dif: str, extra: str = "") -> str:
    return f'[[stages]]\nname = "encoder"\n{enc}\n[[stages]]\nname = "diffusion"\n{dif}\n{extra}'


def devices(p: Plan) -> dict[str, list[str]]:
    return {s.name: list(s.devices) for s in p.stages}


def assert_one_gpu_per_rank(p: Plan) -> None:
    """The invariant that NCCL needs: within one group, every rank on its own GPU."""
    for s in p.stages:
        gpus = [r.gpu for r in s.ranks if r.gpu is not None]
        assert len(gpus) == len(set(gpus)), f"{s.name}: two ranks on one GPU: {s.devices}"
        assert all(0 <= g < p.gpus for g in gpus)


# ------------------------------------------------------------------------------- the reference TP2 → TP4


def test_reference_layout_on_six_and_eight_gpus_is_disjoint_in_pipeline_order() -> None:
    for gpus in (6, 8):
        p = plan(PipelineConfig(), gpus)
        assert devices(p) == {
            "encoder": ["cuda:0", "cuda:1"],
            "diffusion": ["cuda:2", "cuda:3", "cuda:4", "cuda:5"],
        }
        assert p.shared == {} and all(s.placed_by is PlacedBy.PLANNER for s in p.stages)
        assert_one_gpu_per_rank(p)


def test_reference_layout_on_four_gpus_shares_them() -> None:
    p = plan(PipelineConfig(), 4)  # each group fits alone, the sum (6) does not
    assert devices(p) == {"encoder": ["cuda:0", "cuda:1"], "diffusion": ["cuda:2", "cuda:3", "cuda:0", "cuda:1"]}
    assert p.shared == {0: ("encoder/0", "diffusion/2"), 1: ("encoder/1", "diffusion/3")}
    assert_one_gpu_per_rank(p)
    assert "sharing GPU 0, 1" in p.summary()


@pytest.mark.parametrize("gpus", [1, 2])
def test_reference_layout_on_fewer_gpus_than_a_group_is_refused_in_one_line(gpus: int) -> None:
    with pytest.raises(ConfigError) as err:
        plan(PipelineConfig(), gpus)
    message = err.value.message
    assert "\n" not in message
    assert message.startswith("stage 'encoder'" if gpus == 1 else "stage 'diffusion'")
    assert f"this host has {gpus}" in message and 'device = "cpu"' in message and "devices" in message
    assert err.value.details["stage"] in {"encoder", "diffusion"}


def test_no_gpu_runs_every_auto_stage_on_cpu() -> None:
    p = plan(PipelineConfig(), 0)
    assert devices(p) == {"encoder": ["cpu"] * 2, "diffusion": ["cpu"] * 4}
    assert all(s.placed_by is PlacedBy.CPU for s in p.stages)
    assert [g.backends for g in p.stage("diffusion").groups] == [("gloo",)]
    assert [(pool.kind, pool.device) for pool in p.stage("encoder").pools] == [("DRAM", "cpu")]


# --------------------------------------------------------------------- the built-in default, fitted


@pytest.mark.parametrize(
    ("gpus", "sizes", "placed"),
    [
        (0, (2, 4), None),
        (1, (1, 1), {"encoder": ["cuda:0"], "diffusion": ["cuda:0"]}),
        (2, (1, 1), {"encoder": ["cuda:0"], "diffusion": ["cuda:1"]}),
        (3, (1, 2), {"encoder": ["cuda:0"], "diffusion": ["cuda:1", "cuda:2"]}),
        (4, (2, 2), {"encoder": ["cuda:0", "cuda:1"], "diffusion": ["cuda:2", "cuda:3"]}),
        (5, (1, 4), {"encoder": ["cuda:0"], "diffusion": ["cuda:1", "cuda:2", "cuda:3", "cuda:4"]}),
        (6, (2, 4), {"encoder": ["cuda:0", "cuda:1"], "diffusion": ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]}),
        (8, (2, 4), {"encoder": ["cuda:0", "cuda:1"], "diffusion": ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]}),
    ],
)
def test_default_pipeline_fits_the_host(gpus: int, sizes: tuple[int, int], placed: dict[str, list[str]] | None) -> None:
    stages = default_stages(gpus)
    assert tuple(s.world_size for s in stages) == sizes
    assert [s.name for s in stages] == [s.name for s in DEFAULT_STAGES]
    assert [s.model for s in stages] == [s.model for s in DEFAULT_STAGES]
    p = plan(pipeline_for_host(None, gpus), gpus)  # never refused
    assert_one_gpu_per_rank(p)
    if placed is not None:
        assert devices(p) == placed
    assert (p.shared != {}) == (gpus == 1), "only a single GPU is shared"


def test_a_pipeline_file_is_taken_as_written(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.toml"
    path.write_text(two_stages("tp = 2", "tp = 4"))
    assert [s.world_size for s in pipeline_for_host(path, 2).stages] == [2, 4]
    with pytest.raises(ConfigError, match="stage 'diffusion' needs 4 GPUs"):
        plan(pipeline_for_host(path, 2), 2)


# ------------------------------------------------------------------------------------------ devices


def test_devices_are_taken_as_written_and_the_rest_planned_around_them(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages("tp = 2\ndevices = [4, 5]", "tp = 4")), 6)
    assert devices(p) == {"encoder": ["cuda:4", "cuda:5"], "diffusion": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]}
    assert p.stage("encoder").placed_by is PlacedBy.DEVICES and p.stage("diffusion").placed_by is PlacedBy.PLANNER
    assert p.stage("diffusion").pools[1].device == "cuda:0", "the VRAM pool is on the leader's GPU"


def test_the_upstream_six_gpu_layout_by_devices(tmp_path: Path) -> None:
    text = two_stages("tp = 2\ndevices = [0, 1]", "tp = 4\ndevices = [2, 3, 4, 5]")
    p = plan(pipeline(tmp_path, text), 6)
    assert devices(p) == {"encoder": ["cuda:0", "cuda:1"], "diffusion": ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]}
    assert p.shared == {}


def test_overlapping_devices_are_allowed_and_reported(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages("tp = 1\ndevices = [1]", "tp = 2\ndevices = [0, 1]")), 2)
    assert devices(p) == {"encoder": ["cuda:1"], "diffusion": ["cuda:0", "cuda:1"]}
    assert p.shared == {1: ("encoder/0", "diffusion/1")}
    assert_one_gpu_per_rank(p)


def test_sharing_starts_each_stage_where_the_previous_ended(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages("tp = 1", "tp = 2")), 2)  # configuration (b) of the GPU run
    assert devices(p) == {"encoder": ["cuda:0"], "diffusion": ["cuda:1", "cuda:0"]}
    assert p.shared == {0: ("encoder/0", "diffusion/1")}


def test_devices_outside_the_host_are_refused_naming_the_stage(tmp_path: Path) -> None:
    pipe = pipeline(tmp_path, two_stages("tp = 1", "tp = 2\ndevices = [2, 3]"))
    with pytest.raises(ConfigError, match=r"stage 'diffusion': devices = \[2, 3\] names GPU 2 .* GPUs 0..1"):
        plan(pipe, 2)
    with pytest.raises(ConfigError, match=r"stage 'diffusion'.*no GPU"):
        plan(pipe, 0)


@pytest.mark.parametrize(
    ("dif", "message"),
    [
        ("tp = 4\ndevices = [2, 3, 3, 5]", "stage 'diffusion'.* names GPU 3 more than once"),
        ("tp = 4\ndevices = [2, 3]", "stage 'diffusion'.* names 2 GPUs but its layout tp4xsp1 has 4 ranks"),
        ("layout = {tp = 2, sp = 2}\ndevices = [0, 1, 2]", "stage 'diffusion'.* names 3 GPUs .* has 4 ranks"),
        ("tp = 1\ndevices = [-1]", "stage 'diffusion'.* GPU index -1 is out of range"),
        ("tp = 1\ndevices = [4096]", "stage 'diffusion'.* GPU index 4096 is out of range"),
        ('tp = 1\ndevices = [0]\ndevice = "cpu"', "stage 'diffusion'.* device = \"cpu\""),
        ("tp = 1\ndevices = []", "too_short|at least 1"),
        ('tp = 1\ndevices = ["0"]', "valid integer"),
        ("tp = 1\ndevices = [true]", "valid integer"),
    ],
)
def test_bad_devices_are_config_errors_naming_the_stage(tmp_path: Path, dif: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pipeline(tmp_path, two_stages("tp = 1", dif))


def test_cpu_and_cuda_stages(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages('tp = 2\ndevice = "cpu"', "tp = 2")), 2)
    assert devices(p) == {"encoder": ["cpu", "cpu"], "diffusion": ["cuda:0", "cuda:1"]}
    assert p.stage("encoder").placed_by is PlacedBy.CPU
    assert [(x.kind, x.device) for x in p.stage("encoder").pools] == [("DRAM", "cpu"), ("VRAM", "cuda:0")]
    with pytest.raises(ConfigError, match="stage 'diffusion' has device = \"cuda\" but this host has no GPU"):
        plan(pipeline(tmp_path, two_stages("tp = 1", 'tp = 1\ndevice = "cuda"')), 0)


def test_groups_follow_the_layout(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages("tp = 1", "layout = {tp = 2, sp = 2}")), 8)
    groups = {(g.name, g.ranks) for g in p.stage("diffusion").groups}
    assert groups == {("world", (0, 1, 2, 3)), ("tp", (0, 1)), ("tp", (2, 3)), ("sp", (0, 2)), ("sp", (1, 3))}
    assert p.stage("encoder").groups == (), "one rank: no process group"
    assert all(g.backends == ("gloo", "nccl") for g in p.stage("diffusion").groups)


def test_inline_edges_register_no_pools(tmp_path: Path) -> None:
    p = plan(pipeline(tmp_path, two_stages("tp = 1", "tp = 1", '[data_plane]\nconnector = "inline"\n')), 2)
    assert all(s.pools == () for s in p.stages)


def test_the_plan_is_a_pure_function(tmp_path: Path) -> None:
    text = two_stages("tp = 2", "layout = {shard = 2, replicate = 2}")
    assert plan(pipeline(tmp_path, text), 4) == plan(pipeline(tmp_path, text), 4)


def test_aggregated_stage_takes_devices_from_its_section(tmp_path: Path) -> None:
    text = 'mode = "aggregated"\n[aggregated]\nlayout = {tp = 4}\ndevices = [3, 1, 0, 2]\n'
    p = plan(pipeline(tmp_path, text), 4)
    assert devices(p) == {"encoder": ["cuda:3", "cuda:1", "cuda:0", "cuda:2"]} and p.stages[0].pools == ()
    with pytest.raises(ConfigError, match="under \\[aggregated\\]"):
        pipeline(tmp_path, 'mode = "aggregated"\n' + two_stages("tp = 1\ndevices = [0]", "tp = 1"))


# ---------------------------------------------------------------------------- serve --tp / --devices


def test_serve_overrides(tmp_path: Path) -> None:
    pipe = pipeline(tmp_path, two_stages("tp = 2\ndevices = [0, 1]", "tp = 2"))
    assert devices(plan(with_overrides(pipe, "diffusion", devices=(3, 2)), 4))["diffusion"] == ["cuda:3", "cuda:2"]
    assert with_overrides(pipe, "encoder", tp=2).stage("encoder").devices == (0, 1), "same size keeps devices"
    assert with_overrides(pipe, "encoder", tp=1).stage("encoder").devices is None
    with pytest.raises(ConfigError, match=r"stage 'encoder'.* names 3 GPUs"):
        with_overrides(pipe, "encoder", devices=(0, 1, 2))
    assert parse_devices("2,3,4,5") == parse_devices("2-5") == (2, 3, 4, 5)
    for bad in ("", "a", "2,,3", "5-2"):
        with pytest.raises(ConfigError, match="--devices"):
            parse_devices(bad)


# ------------------------------------------------------------------------------------- stageferry plan


def test_plan_command_json() -> None:
    result = runner.invoke(app, ["plan", "--gpus", "6", "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["gpus"] == 6 and out["shared"] == []
    enc, dif = out["stages"]
    assert (enc["name"], enc["ranks"]) == (
        "encoder",
        [{"rank": 0, "device": "cuda:0"}, {"rank": 1, "device": "cuda:1"}],
    )
    assert [r["device"] for r in dif["ranks"]] == ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    assert dif["groups"] == [{"name": "world", "ranks": [0, 1, 2, 3], "backends": ["gloo", "nccl"]}]
    assert [(x["kind"], x["device"]) for x in dif["pools"]] == [("DRAM", "cpu"), ("VRAM", "cuda:2")]


def test_plan_command_text_and_refusal(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", "--gpus", "2"])
    assert result.exit_code == 0
    assert "encoder (tp1xsp1, planner):" in result.stdout and "0 → cuda:1" in result.stdout
    path = tmp_path / "pipeline.toml"
    path.write_text(two_stages("tp = 2", "tp = 4"))
    refused = runner.invoke(app, ["--pipeline", str(path), "plan", "--gpus", "2", "--json"])
    assert refused.exit_code == 1 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("error [config]: stage 'diffusion' needs 4")


def test_serve_refuses_only_its_own_stage(tmp_path: Path) -> None:
    """Over several hosts a stage that cannot run here runs elsewhere: ``serve`` plans with strict=False."""
    p = plan(pipeline(tmp_path, two_stages("tp = 2", "tp = 4")), 2, strict=False)
    assert list(p.stage("encoder").devices) == ["cuda:0", "cuda:1"]
    assert [s.name for s in p.stages] == ["encoder"] and set(p.refused) == {"diffusion"}
    with pytest.raises(ConfigError, match="stage 'diffusion' needs 4 GPUs"):
        p.stage("diffusion")
    with pytest.raises(ConfigError, match="stage 'diffusion' needs 4 GPUs"):
        plan(pipeline(tmp_path, two_stages("tp = 2", "tp = 4")), 2)


def test_serve_refuses_its_stage_before_starting_anything(tmp_path: Path, redis_url: str) -> None:
    path = tmp_path / "pipeline.toml"
    path.write_text(two_stages("tp = 1", "tp = 1\ndevices = [5]"))
    base = ["--redis-url", redis_url, "--prefix", "never-used", "--pipeline", str(path)]
    for args in (["serve", "diffusion"], ["serve", "encoder", "--devices", "0"]):
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 1 and result.stderr.count("\n") == 1, result.stderr
        stage = args[1]
        assert result.stderr.startswith(f"error [config]: stage '{stage}': devices = ["), result.stderr
        assert "this host has no GPU" in result.stderr


@pytest.mark.skipif(any(os.path.exists(n) for n in GPU_DEVICE_NODES), reason="this host has a GPU driver's nodes")
def test_without_a_gpu_drivers_nodes_the_host_has_no_gpu_and_torch_is_not_imported() -> None:
    """A group's supervisor asks for the GPU count and needs nothing else of torch (half a stage's start)."""
    probe = (
        "import sys; from stageferry.stages.process.placement import host_gpus; "
        "print(host_gpus(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0", "False"], out


def test_with_a_gpu_drivers_node_torch_counts_the_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    node = tmp_path / "nvidiactl"
    node.touch()
    monkeypatch.setattr(placement, "GPU_DEVICE_NODES", (str(tmp_path / "missing"), str(node)))
    import torch

    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert host_gpus() == expected
