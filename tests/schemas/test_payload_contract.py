"""The conditioning payload contract: what passes, what is refused (and how the refusal names the entry),
what ``read`` fills in, and that the published table is the enforced contract.

Payloads come from the real reference encoder (small ``hidden``, CPU, TP1) for all three tasks, with the
bundled sample media; violations are single edits of a valid payload.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stageferry.cli import sample_media
from stageferry.config import PipelineConfig
from stageferry.errors import PayloadContractError, RejectedError
from stageferry.schemas import JobRequest, Task
from stageferry.schemas.payload_contract import CONDITIONING, MAX_HIDDEN, build_payload
from stageferry.schemas.payload_contract_doc import contract_json, contract_markdown, generated_block
from stageferry.schemas.payload_layout import Layout
from stageferry.stages.model import StageContext
from stageferry.stages.reference import encoder

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
PIPE = PipelineConfig()
BASE: dict[str, Any] = {"prompt": "a red fox runs through deep snow.", "width": 128, "height": 64, "fps": 8}


def job(task: str = "t2va", **kw: Any) -> JobRequest:
    media = {name: {"path": str(path)} for name, path in sample_media(Task(task)).items()}
    return JobRequest.model_validate({**BASE, "num_frames": 9, "task": task, "media": media, **kw})


def reference_payload(j: JobRequest) -> dict[str, Any]:
    """What the reference encoder sends for ``j`` (hidden 64, one CPU rank)."""
    enc = encoder.factory(stage=PIPE.stages[0], pipeline=PIPE, hidden=64)
    media = {name: Path(ref.path).read_bytes() for name, ref in j.media if ref is not None and ref.path}
    ctx = StageContext(
        stage="encoder",
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        request_id="r",
        key="r_0_0",
        output_dir=Path("."),
        media=media,
    )
    return enc(j, None, ctx)


@pytest.fixture(scope="module")
def t2va() -> dict[str, Any]:
    return reference_payload(job("t2va", negative_prompt="blurry"))


def refused(j: JobRequest, payload: Any) -> PayloadContractError:
    with pytest.raises(PayloadContractError) as info:
        CONDITIONING.check(j, payload)
    err = info.value
    assert isinstance(err, RejectedError) and err.code == "payload_contract"
    assert err.to_dict()["details"]["field_errors"] == err.field_errors
    return err


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_reference_encoder_payloads_follow_the_contract(task: str) -> None:
    j = job(task)
    payload = reference_payload(j)
    inputs = CONDITIONING.check(j, payload)
    assert inputs.layout == Layout.for_job(j)
    assert inputs.hidden_states is payload["text"]["hidden_states"]  # read, not copied
    k = {"t2va": 0, "fl2va": 2, "ref2va": 1}[task]
    assert inputs.visual_latents.shape[:2] == (k, 16) and inputs.visual_latents.shape[3:] == (8, 16)
    assert inputs.audio_latents.shape[:2] == (1, 64) and (inputs.audio_latents.shape[2] > 0) == (task == "ref2va")
    assert payload["meta"]["contract"] == CONDITIONING.id == "stageferry.conditioning/1"


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def edit(p: dict[str, Any]) -> dict[str, Any]:
        p = {**p, "text": dict(p["text"])}
        where = p["text"] if path.startswith("text.") else p
        key = path.removeprefix("text.")
        if value is None:
            del where[key]
        else:
            where[key] = value(where[key]) if callable(value) else value
        return p

    return edit


NAN = float("nan")


def _with(t: torch.Tensor, values: list[float]) -> torch.Tensor:
    """``t`` with its first values replaced (the rest stays finite)."""
    out = t.clone()
    out.view(-1)[: len(values)] = torch.tensor(values, dtype=t.dtype)
    return out


VIOLATIONS = [
    ("text.hidden_states", _set("text.hidden_states", lambda t: t[None]), "expected rank 2, got 3"),
    (
        "text.hidden_states",
        _set("text.hidden_states", lambda t: t.long()),
        "expected dtype bfloat16, float16 or float32",
    ),
    ("text.hidden_states", _set("text.hidden_states", lambda t: t.float().fill_(NAN)), "non-finite"),
    ("text.hidden_states", _set("text.hidden_states", lambda t: _with(t, [float("inf"), -float("inf")])), "non-finite"),
    ("text.hidden_states", _set("text.hidden_states", lambda t: _with(t, [-float("inf")])), "non-finite"),
    ("text.hidden_states", _set("text.hidden_states", None), "missing (required)"),
    ("text.hidden_states", _set("text.hidden_states", [[0.0]]), "expected a tensor, got list"),
    (
        "text.role_ids",
        _set("text.role_ids", lambda t: t[:-1]),
        "dimension 0 (n) must be 43 as in text.hidden_states, got 42",
    ),
    ("text.role_ids", _set("text.role_ids", lambda t: t.clone().fill_(7)), "values must be in 0..2"),
    ("text.role_ids", _set("text.role_ids", lambda t: torch.full_like(t, 2)), "no prompt token"),
    ("text.role_ids", _set("text.role_ids", lambda t: t.int()), "expected dtype int64, got int32"),
    ("text", lambda p: {**p, "text": "hello"}, "expected a dict with hidden_states and role_ids, got str"),
    ("visual_latents", _set("visual_latents", lambda t: torch.zeros(1, 16, 3, 8, 16)), "dimension 0 (k) must be 0"),
    ("visual_latents", _set("visual_latents", lambda t: torch.zeros(0, 16, 3, 9, 16)), "dimension 3 (h) must be 8"),
    ("visual_latents", _set("visual_latents", lambda t: torch.zeros(0, 15, 3, 8, 16)), "dimension 1 (16) must be 16"),
    ("audio_latents", _set("audio_latents", lambda t: torch.zeros(1, 64, 5)), "dimension 2 (m) must be 0 for this"),
    ("audio_style", _set("audio_style", torch.zeros(64)), "expected rank 2, got 1"),
    ("audio_style", _set("audio_style", torch.full((1, 64), float("inf"))), "non-finite"),
    ("layout", _set("layout", None), "missing (required)"),
    ("layout", _set("layout", Layout.for_job(job("t2va", width=192)).to_tensor()), "does not match the job"),
    ("layout", _set("layout", lambda t: torch.cat([t[:1] + 1, t[1:]])), "version 2 is not supported"),
    ("layout", _set("layout", lambda t: t.float()), "expected a 1-d int64 tensor"),
    ("layout", _set("layout", torch.full((11,), -1, dtype=torch.int64)), "version -1 is not supported"),
    ("task", lambda p: {**p, "task": "fl2va"}, "'fl2va' is not the job's task 't2va'"),
    ("seed", lambda p: {**p, "seed": "7"}, "expected int, got str"),
]


@pytest.mark.parametrize(("entry", "edit", "message"), VIOLATIONS, ids=[f"{v[0]}:{v[2][:24]}" for v in VIOLATIONS])
def test_a_violation_is_refused_naming_the_entry(
    t2va: dict[str, Any], entry: str, edit: Callable[[dict[str, Any]], Any], message: str
) -> None:
    j = job("t2va", negative_prompt="blurry")
    err = refused(j, edit(t2va))
    assert err.field_errors[0]["field"] == entry, err.field_errors
    assert message in err.field_errors[0]["message"], err.field_errors
    assert str(err).startswith(f"{entry}: ")  # one clear line naming the entry


def test_every_violation_is_reported_at_once(t2va: dict[str, Any]) -> None:
    bad = {**t2va, "text": {"hidden_states": torch.zeros(3, 4, 5), "role_ids": torch.zeros(2)}, "audio_style": "x"}
    del bad["layout"]
    err = refused(job("t2va", negative_prompt="blurry"), bad)
    fields = [e["field"] for e in err.field_errors]
    assert fields == ["text.hidden_states", "text.role_ids", "audio_style", "layout"], err.field_errors
    assert "(+3 more)" in str(err)


def test_not_a_dict_is_refused() -> None:
    for payload in (None, [1, 2], b"\xff" * 8, torch.zeros(3)):
        err = refused(job(), payload)
        assert err.field_errors[0]["field"] == "payload"


def test_fl2va_needs_its_first_and_last_frame_latents() -> None:
    j = job("fl2va")
    payload = reference_payload(j)
    err = refused(j, {k: v for k, v in payload.items() if k != "visual_latents"})
    assert err.field_errors[0] == {
        "field": "visual_latents",
        "message": "missing (required for fl2va)",
        "type": "missing",
    }
    one = {**payload, "visual_latents": payload["visual_latents"][:, :, :1].repeat(1, 1, 2, 1, 1)}
    assert "dimension 2 (t) must be 1" in refused(j, one).field_errors[0]["message"]


@pytest.mark.parametrize("hidden", [1, 384, 1024, MAX_HIDDEN])
def test_the_text_hidden_size_is_free(hidden: int) -> None:
    j = job()
    payload = build_payload(j, torch.randn(5, hidden).bfloat16(), torch.tensor([0, 1, 1, 1, 0]))
    assert CONDITIONING.check(j, payload).hidden_states.shape == (5, hidden)


def test_the_free_sizes_have_bounds() -> None:
    j = job()
    wide = build_payload(j, torch.zeros(2, MAX_HIDDEN + 1, dtype=torch.bfloat16), torch.tensor([1, 1]))
    err = refused(j, wide)
    assert err.field_errors[0]["message"] == f"dimension 1 (hidden) must be in 1..{MAX_HIDDEN} for this job, got 65537"
    empty = build_payload(j, torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64))
    assert "dimension 0 (n) must be in 1..16384" in refused(j, empty).field_errors[0]["message"]


def test_large_finite_values_are_finite() -> None:
    """The finiteness scan sums in float64: the largest half/bfloat16/float32 values do not overflow it."""
    j = job()
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        big = torch.full((16_384, 64), torch.finfo(dtype).max, dtype=dtype)
        CONDITIONING.check(j, build_payload(j, big, torch.ones(16_384, dtype=torch.int64)))


def test_read_fills_absent_optional_entries_and_keeps_extras() -> None:
    j = job()
    minimal = {
        "text": {"hidden_states": torch.randn(3, 16), "role_ids": torch.tensor([0, 1, 0])},
        "layout": Layout.for_job(j).to_tensor(),
        "my_extra": torch.ones(2),
    }
    inputs = CONDITIONING.read(j, minimal)
    layout = Layout.for_job(j)
    assert inputs.visual_latents.shape == (0, *layout.video_latent_shape)
    assert inputs.audio_latents.shape == (1, 64, 0) and torch.equal(inputs.audio_style, torch.zeros(1, 64))
    assert list(inputs.extras) == ["my_extra"]


def test_read_checks_structure_only_and_check_scans_values(t2va: dict[str, Any]) -> None:
    """A model reads structurally (its leader scanned the values before the fan-out)."""
    j = job("t2va", negative_prompt="blurry")
    nan = _set("text.hidden_states", lambda t: torch.full_like(t, NAN))(t2va)
    assert CONDITIONING.read(j, nan).hidden_states.isnan().all()
    assert "non-finite" in refused(j, nan).field_errors[0]["message"]


def test_build_payload_is_the_reference_encoders_payload(t2va: dict[str, Any]) -> None:
    j = job("t2va", negative_prompt="blurry")
    built = build_payload(j, t2va["text"]["hidden_states"], t2va["text"]["role_ids"])
    for name in ("visual_latents", "audio_latents", "audio_style", "layout"):
        assert torch.equal(built[name], t2va[name]), name
    assert built["task"] == "t2va" and built["seed"] == j.seed


def test_the_published_table_is_the_enforced_contract() -> None:
    doc = (ROOT / "docs" / "payload-contract.md").read_text()
    assert generated_block(doc) == contract_markdown(CONDITIONING), (
        "docs/payload-contract.md is stale: regenerate its block with `stageferry schema payload --format markdown`"
    )


def test_the_json_form_lists_every_entry_and_dimension() -> None:
    doc = json.loads(json.dumps(contract_json(CONDITIONING)))
    assert (doc["contract"], doc["version"], doc["layout_version"]) == ("stageferry.conditioning", 1, 1)
    names = [t["name"] for t in doc["tensors"]]
    assert names == ["text.hidden_states", "text.role_ids", "visual_latents", "audio_latents", "audio_style", "layout"]
    hidden = doc["tensors"][0]
    assert hidden["shape"] == ["n", "hidden"] and hidden["required_for"] == ["t2va", "fl2va", "ref2va", "i2va"]
    assert doc["dimensions"]["hidden"]["kind"] == "free" and doc["dimensions"]["h"]["kind"] == "job"
    assert doc["tensors"][2]["required_for"] == ["fl2va"]
    assert [f["name"] for f in doc["layout_fields"]][:3] == ["version", "task", "width"]
