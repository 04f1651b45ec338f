"""Stage layouts and the aggregated mode in the pipeline file: what loads, and what is refused clearly."""

from __future__ import annotations

from pathlib import Path

import pytest

from stageferry.config import GroupLayout, LayoutForm, Mode, PipelineConfig, StageConfig
from stageferry.errors import ConfigError


def load(tmp_path: Path, text: str) -> PipelineConfig:
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return PipelineConfig.load(path)


def test_layouts_load_from_the_pipeline_file(tmp_path: Path) -> None:
    pipeline = load(
        tmp_path,
        """
[[stages]]
name = "encoder"
tp = 2
[[stages]]
name = "diffusion"
layout = {shard = 2, replicate = 2}
[[stages]]
name = "upscale"
layout = {tp = 2, sp = 4}
""",
    )
    enc, dif, up = pipeline.stages
    assert (enc.layout, enc.world_size, enc.tp) == (GroupLayout(tp=2), 2, 2), "tp alone is a 1-D TP layout"
    assert (dif.layout.form, dif.layout.dims, dif.world_size, dif.tp) == (LayoutForm.HSDP, ("shard", "replicate"), 4, 1)
    assert (up.layout.row_size, up.layout.rows, up.world_size, up.tp) == (2, 4, 8, 2)
    assert StageConfig(name="x", layout={"shard": 1, "replicate": 4}).layout.describe() == "shard1xreplicate4"


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ("layout = {tp = 2, shard = 2}", "exactly one of the two forms"),
        ("layout = {}", "exactly one of the two forms"),
        ("layout = {tp = 16, sp = 8}", "at most 64 ranks"),
        ("layout = {tp = 0}", "greater than or equal to 1"),
        ("layout = {tp = 2, pp = 2}", r"pp: unknown key"),
        ("tp = 4\nlayout = {tp = 2, sp = 2}", "disagrees with layout"),
    ],
)
def test_bad_layouts_are_config_errors(tmp_path: Path, stage: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, f'[[stages]]\nname = "diffusion"\n{stage}\n')


def test_aggregated_mode_folds_the_declared_stages(tmp_path: Path) -> None:
    pipeline = load(tmp_path, 'mode = "aggregated"\n[aggregated]\nlayout = {tp = 2, sp = 2}\n')
    (stage,) = pipeline.stages  # the built-in encoder TP2 and diffusion TP4, in one group of four
    assert pipeline.mode is Mode.AGGREGATED and stage.name == "encoder" and stage.layout.describe() == "tp2xsp2"
    assert [(p.name, p.world_size) for p in stage.parts] == [("encoder", 2), ("diffusion", 4)]
    assert stage.model == "stageferry.stages.group.aggregated:factory"
    assert pipeline.next_stage("encoder") is None and pipeline.previous_stage("encoder") is None
    with pytest.raises(ConfigError, match="needs 4 ranks"):
        load(tmp_path, 'mode = "aggregated"\n[aggregated]\nlayout = {tp = 2}\n')
    named = load(tmp_path, 'mode = "aggregated"\n[aggregated]\nname = "all"\n')
    assert [s.name for s in named.stages] == ["all"] and named.stages[0].world_size == 4
