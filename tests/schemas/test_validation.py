"""Bad input → typed rejections, as pure functions: field errors from pydantic and deployment limits."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from stageferry.config import Limits
from stageferry.errors import EnvelopeError, JobValidationError
from stageferry.schemas import Envelope, JobRequest, request_key
from stageferry.schemas.validation import check_job_limits, field_errors, parse_envelope, parse_job

SECRET = "do-not-echo-this-input"
LIMITS = Limits(max_steps=30, max_prompt_chars=10, lora_adapters=("anime-v1",))


def test_parse_job_names_every_bad_field_without_echoing_input() -> None:
    with pytest.raises(JobValidationError) as err:
        parse_job(json.dumps({"prompt": "x", "num_inference_steps": 0, "width": SECRET}))
    fields = {e["field"]: e for e in err.value.field_errors}
    assert set(fields) == {"num_inference_steps", "width"}
    assert all(set(e) == {"field", "message", "type"} for e in err.value.field_errors)
    assert fields["num_inference_steps"]["type"] == "greater_than_equal"
    assert SECRET not in json.dumps(err.value.to_dict())


def test_field_errors_are_bounded() -> None:
    raw = json.dumps({"prompt": "x", **{f"extra_{i}": i for i in range(50)}})
    with pytest.raises(JobValidationError) as err:
        parse_job(raw)
    assert len(err.value.field_errors) == 20


def test_parse_envelope_tells_a_bad_job_from_a_bad_envelope() -> None:
    good = Envelope(request_id="req-1", key=request_key("req-1", 0), from_stage="encoder", to_stage="diffusion",
                    job=JobRequest(prompt="x"))  # fmt: skip
    body = json.loads(good.model_dump_json())
    assert parse_envelope(json.dumps(body)) == good
    with pytest.raises(JobValidationError) as job_err:
        parse_envelope(json.dumps({**body, "job": {**body["job"], "num_inference_steps": -1}}))
    assert job_err.value.field_errors[0]["field"] == "num_inference_steps"  # named as the job names it
    with pytest.raises(EnvelopeError) as env_err:
        parse_envelope(json.dumps({**body, "attempt": "many"}))
    assert env_err.value.details["field_errors"][0]["field"] == "attempt"


def test_deployment_limits_report_every_failure() -> None:
    job = JobRequest(prompt="y" * 50, num_inference_steps=40, lora="unknown",
                     media={"reference_audio": {"upload_key": "elsewhere:upload:x:a"}}, task="ref2va")  # fmt: skip
    with pytest.raises(JobValidationError) as err:
        check_job_limits(job, LIMITS, upload_prefix="p:upload:")
    assert [(e["field"], e["type"]) for e in err.value.field_errors] == [
        ("num_inference_steps", "less_than_equal"),
        ("prompt", "string_too_long"),
        ("lora", "unknown_adapter"),
        ("media.reference_audio.upload_key", "bad_upload_key"),
    ]
    check_job_limits(JobRequest(prompt="ok"), LIMITS, upload_prefix="p:")


def test_field_errors_of_a_root_validator_name_its_field() -> None:
    with pytest.raises(JobValidationError) as err:
        parse_job(json.dumps({"prompt": "x", "task": "t2va", "duration": 1.0, "num_frames": 9}))
    assert [e["field"] for e in err.value.field_errors] == ["num_frames"]


def test_field_errors_helper_on_a_pydantic_error() -> None:
    with pytest.raises(ValidationError) as err:
        JobRequest.model_validate({"prompt": 5})
    assert field_errors(err.value) == [{"field": "prompt", "message": "Input should be a valid string",
                                        "type": "string_type"}]  # fmt: skip
