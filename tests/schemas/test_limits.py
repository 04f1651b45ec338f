"""Deployment limits on a job (issue 17): the cost budget quotes the deployment's values, local paths need roots,
NaN is not a number in range, and a stream entry has only the documented fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from stageferry.config import DEFAULT_MAX_PIXEL_FRAMES, Limits, PipelineConfig
from stageferry.errors import EnvelopeError, JobValidationError
from stageferry.schemas.validation import check_entry_fields, check_job_limits, parse_job

UPLOADS = "sf:upload:"
#: The job from the issue: schema-valid, 2048 × 2048 × 1,800 frames.
HUGE = {"task": "t2va", "prompt": "x", "width": 2048, "height": 2048, "fps": 60, "duration": 30.0,
        "num_inference_steps": 2}  # fmt: skip


def errors_of(job: dict[str, Any], limits: Limits) -> list[dict[str, Any]]:
    with pytest.raises(JobValidationError) as info:
        check_job_limits(parse_job(json.dumps(job)), limits, upload_prefix=UPLOADS)
    return info.value.field_errors


def test_the_issue_job_is_refused_by_the_schema_and_by_the_budget() -> None:
    with pytest.raises(JobValidationError) as info:
        parse_job(json.dumps(HUGE))
    assert info.value.field_errors[0]["field"] == "duration" and "1024" in info.value.field_errors[0]["message"]
    within_schema = {**HUGE, "duration": 17.0}  # 1,020 frames: the schema lets it through, the budget does not
    [error] = [e for e in errors_of(within_schema, Limits()) if "max_pixel_frames" in e["message"]]
    assert error["field"] == "duration" and error["type"] == "over_budget"
    assert error["limit"] == DEFAULT_MAX_PIXEL_FRAMES and str(DEFAULT_MAX_PIXEL_FRAMES) in error["message"]


def test_the_budget_is_the_deployments_not_the_schemas() -> None:
    limits = Limits(max_pixel_frames=320 * 192 * 10, max_duration_s=2.0)
    job = {"prompt": "x", "width": 320, "height": 192, "num_frames": 11, "fps": 4}
    errors = errors_of(job, limits)
    assert {e["field"] for e in errors} == {"num_frames"}
    assert [e["limit"] for e in errors] == [320 * 192 * 10, 2.0]
    assert "max_pixel_frames = 614400" in errors[0]["message"] and "max_duration_s = 2" in errors[1]["message"]
    check_job_limits(parse_job(json.dumps({**job, "num_frames": 8})), limits, upload_prefix=UPLOADS)  # fits


def test_reference_video_frames_count_toward_the_budget() -> None:
    limits = Limits(max_pixel_frames=320 * 192 * 20, max_reference_frames=16)
    media = {"reference_video": {"upload_key": "sf:upload:r:v"}}
    job = {"task": "ref2va", "prompt": "x", "width": 320, "height": 192, "num_frames": 8, "media": media}
    [error] = errors_of(job, limits)
    assert "16 reference frames" in error["message"]


def test_the_default_budget_serves_the_default_job() -> None:
    check_job_limits(parse_job('{"prompt": "x"}'), PipelineConfig().limits, upload_prefix=UPLOADS)
    ten_seconds = {"prompt": "x", "duration": 10.0}
    check_job_limits(parse_job(json.dumps(ten_seconds)), Limits(), upload_prefix=UPLOADS)


@pytest.mark.parametrize(
    ("roots", "path", "allowed"),
    [
        ((), "/srv/media/a.png", False),
        (("/srv/media",), "/srv/media/a.png", True),
        (("/srv/media",), "/srv/media/../../etc/passwd", False),
        (("/srv/media",), "/srv/mediax/a.png", False),
        (("/srv/media",), "relative.png", False),
        (("/srv/media",), "/etc/passwd", False),
    ],
)
def test_media_paths_need_a_root(roots: tuple[str, ...], path: str, allowed: bool) -> None:
    job = {"task": "fl2va", "prompt": "x", "media": {"first_frame": {"path": path},
                                                      "last_frame": {"upload_key": "sf:upload:r:l"}}}  # fmt: skip
    limits = Limits(media_roots=roots)
    if allowed:
        check_job_limits(parse_job(json.dumps(job)), limits, upload_prefix=UPLOADS)
        return
    [error] = errors_of(job, limits)
    assert error["field"] == "media.first_frame.path" and error["type"] == "path_not_allowed"
    assert path not in error["message"]


def test_media_roots_are_absolute() -> None:
    with pytest.raises(ValueError, match="absolute"):
        Limits(media_roots=("media",))


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_nan_flow_shift_is_not_reported_as_out_of_range(value: str) -> None:
    with pytest.raises(JobValidationError) as info:
        parse_job('{"prompt": "x", "flow_shift": ' + value + "}")
    [error] = info.value.field_errors
    assert error["field"] == "flow_shift" and error["type"] == "finite_number"
    assert "32" not in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"request_id": b"r", "job": b"{}", "priority": b"9"},
        {"request_id": b"r", "job": b"{}", "envelope": b"{}"},
        {"request_id": b"r", "job": b"{}", "blob": b"\x00"},
    ],
)
def test_entries_with_undocumented_fields_are_refused(fields: dict[str, bytes]) -> None:
    with pytest.raises(EnvelopeError):
        check_entry_fields(fields)


def test_documented_entries_pass() -> None:
    check_entry_fields({"request_id": b"r", "job": b"{}"})
    check_entry_fields({"request_id": b"r", "envelope": b"{}", "blob": b"\x00"})
