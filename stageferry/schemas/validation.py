"""Turning bad input into typed rejections: pydantic errors to field errors, and deployment limits.

The schema's own bounds are the same for every deployment; :func:`check_job_limits` adds what a
deployment configures (step cap, prompt length, LoRA adapters, where uploads may live).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from stageferry.errors import EnvelopeError, JobValidationError, field_error
from stageferry.schemas.envelope import Envelope
from stageferry.schemas.job import JobRequest

_MAX_FIELD_ERRORS = 20


def field_errors(exc: ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as ``[{"field": "a.b", "message": ..., "type": ...}]`` (bounded, no input echo)."""
    out = []
    for err in exc.errors(include_input=False, include_url=False)[:_MAX_FIELD_ERRORS]:
        ctx = err.get("ctx") or {}
        field = ".".join(str(p) for p in err.get("loc", ())) or str(ctx.get("field", "__root__"))
        out.append(field_error(field, str(err.get("msg", ""))[:300], str(err.get("type", ""))))
    return out


def parse_job(raw: bytes | str) -> JobRequest:
    """Validate a JSON job; any problem is a :class:`JobValidationError` naming the fields."""
    try:
        return JobRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = field_errors(exc)
        raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors) from exc


def parse_envelope(raw: bytes | str) -> Envelope:
    """Validate a JSON envelope; a bad job inside is still a job error, anything else an envelope error."""
    try:
        return Envelope.model_validate_json(raw)
    except ValidationError as exc:
        errors = field_errors(exc)
        if all(e["field"].startswith("job") for e in errors):
            job_errors = [{**e, "field": e["field"].removeprefix("job.")} for e in errors]
            raise JobValidationError(f"invalid job: {job_errors[0]['field']}", job_errors) from exc
        raise EnvelopeError(
            f"invalid envelope: {errors[0]['field']}: {errors[0]['message']}", field_errors=errors
        ) from exc


def check_job_limits(
    job: JobRequest,
    *,
    max_steps: int,
    max_prompt_chars: int,
    lora_adapters: tuple[str, ...],
    upload_prefix: str,
) -> None:
    """Deployment checks beyond the schema; raises :class:`JobValidationError` with every failure."""
    errors: list[dict[str, Any]] = []
    if job.num_inference_steps > max_steps:
        errors.append(field_error("num_inference_steps", f"must be at most {max_steps}", "less_than_equal"))
    if len(job.prompt) > max_prompt_chars:
        errors.append(field_error("prompt", f"at most {max_prompt_chars} characters", "string_too_long"))
    if job.lora is not None and job.lora not in lora_adapters:
        errors.append(
            field_error("lora", f"unknown adapter {job.lora!r}; configured: {list(lora_adapters)}", "unknown_adapter")
        )
    for name in type(job.media).model_fields:
        ref = getattr(job.media, name)
        if ref is not None and ref.upload_key is not None and not ref.upload_key.startswith(upload_prefix):
            errors.append(
                field_error(f"media.{name}.upload_key", f"must start with {upload_prefix!r}", "bad_upload_key")
            )
    if errors:
        raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors)
