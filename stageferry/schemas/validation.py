"""Turning bad input into typed rejections: pydantic errors to field errors, and deployment limits.

The schema's own bounds are the same for every deployment; :func:`check_job_limits` adds what a
deployment configures (its cost budget, step cap, prompt length, LoRA adapters, where uploads and media
paths may live).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from stageferry.errors import EnvelopeError, JobValidationError, StatusCorruptError, field_error
from stageferry.schemas.envelope import ENTRY_FIELDS, Envelope
from stageferry.schemas.job import JobRequest
from stageferry.schemas.payload import PayloadRef
from stageferry.schemas.status import RequestStatus

if TYPE_CHECKING:
    from stageferry.config import Limits

_MAX_FIELD_ERRORS = 20


def field_errors(exc: ValidationError, limits: Limits | None = None) -> list[dict[str, Any]]:
    """pydantic's errors as ``[{"field": "a.b", "message": ..., "type": ...}]`` (bounded, no input echo).

    With the deployment's ``limits``, a bound the deployment sets tighter than the schema is quoted as
    the deployment's (a 9,000-character prompt is "at most 4096", not the schema's 8192)."""
    out = []
    for err in exc.errors(include_input=False, include_url=False)[:_MAX_FIELD_ERRORS]:
        ctx = err.get("ctx") or {}
        field = ".".join(str(p) for p in err.get("loc", ())) or str(ctx.get("field", "__root__"))
        message, kind = str(err.get("msg", ""))[:300], str(err.get("type", ""))
        if limits is not None:
            message = _deployment_bound(field, kind, message, limits)
        out.append(field_error(field, message, kind))
    return out


def _deployment_bound(field: str, kind: str, message: str, limits: Limits) -> str:
    """The message of a schema bound that the deployment's limits make tighter, quoting the limit."""
    if field == "prompt" and kind == "string_too_long":
        return f"at most {limits.max_prompt_chars} characters (this deployment's limits.max_prompt_chars)"
    if field == "num_inference_steps" and kind == "less_than_equal":
        return f"must be at most {limits.max_steps} (this deployment's limits.max_steps)"
    return message


def parse_job(raw: bytes | str) -> JobRequest:
    """Validate a JSON job; any problem is a :class:`JobValidationError` naming the fields."""
    try:
        return JobRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = field_errors(exc)
        raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors) from exc


def parse_status(raw: bytes | str, request_id: str) -> RequestStatus:
    """The status stored in ``request_id``'s record; :class:`StatusCorruptError` when it does not parse
    or names another request (a forged record must not hand out someone else's result)."""
    try:
        status = RequestStatus.model_validate_json(raw)
    except ValidationError as exc:
        raise StatusCorruptError(f"the stored status of {request_id[:80]} does not parse") from exc
    if status.request_id != request_id:
        raise StatusCorruptError(f"the stored status of {request_id[:80]} names another request")
    return status


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


def check_entry_fields(fields: Mapping[str, bytes]) -> None:
    """A stage stream entry has only the documented fields (``ENTRY_FIELDS``), one body, a ``blob`` or
    ``lease`` only beside an ``envelope`` and a ``ticket`` or ``tenant`` only beside a ``job``; anything
    else is an :class:`EnvelopeError` naming the fields."""
    unknown = sorted(name[:64] for name in fields if name not in ENTRY_FIELDS)
    if unknown:
        raise EnvelopeError("entry has fields the protocol does not define", fields=unknown[:10])
    if "job" in fields and ("envelope" in fields or "blob" in fields or "lease" in fields):
        raise EnvelopeError(
            "an entry carries a job or an envelope (and its blob or lease), not both", fields=sorted(fields)
        )
    if "envelope" in fields and ("ticket" in fields or "tenant" in fields):
        raise EnvelopeError("a ticket or a tenant comes only with a client's job", fields=sorted(fields))


def check_payload_fields(fields: Mapping[str, bytes], payload: PayloadRef) -> None:
    """Beside an envelope, exactly its payload kind's fields: ``blob`` with an inline payload (and only
    there), ``lease`` with a NIXL payload, equal to its token (and only there); an
    :class:`EnvelopeError` otherwise."""
    if "blob" in fields and payload.kind != "inline":
        raise EnvelopeError(f"a blob field beside a {payload.kind!r} payload", fields=sorted(fields))
    lease = fields.get("lease")
    if lease is not None:
        token = getattr(payload, "token", None)
        if payload.kind != "nixl" or token is None or lease != token.encode():
            raise EnvelopeError(
                f"a lease field ({len(lease)} bytes) that is not the {payload.kind!r} payload's token",
                fields=sorted(fields),
            )


def job_pixel_frames(job: JobRequest, *, reference_frames: int) -> int:
    """What a job costs in pixel-frames: width × height × (generated frames + reference-video frames).

    ``reference_frames`` is the deployment's cap on reference-video frames; they are decoded at the
    job's size, so a reference video costs that many frames more."""
    extra = reference_frames if job.media.reference_video is not None else 0
    return job.width * job.height * (job.frame_count + extra)


def check_job_limits(job: JobRequest, limits: Limits, *, upload_prefix: str) -> None:
    """Deployment checks beyond the schema; raises :class:`JobValidationError` with every failure.

    Messages quote the deployment's limit (``limits.<name> = <value>``), not the schema's: a client
    learns what *this* deployment serves."""
    errors: list[dict[str, Any]] = []
    if job.task not in limits.tasks:
        served = ", ".join(t.value for t in limits.tasks)
        errors.append(field_error("task", f"this deployment serves {served} only (limits.tasks)", "unsupported_task"))
    if job.num_inference_steps > limits.max_steps:
        errors.append(field_error("num_inference_steps", f"must be at most {limits.max_steps}", "less_than_equal"))
    if len(job.prompt) > limits.max_prompt_chars:
        errors.append(field_error("prompt", f"at most {limits.max_prompt_chars} characters", "string_too_long"))
    if job.lora is not None and job.lora not in limits.lora_adapters:
        errors.append(
            field_error(
                "lora", f"unknown adapter {job.lora!r}; configured: {list(limits.lora_adapters)}", "unknown_adapter"
            )
        )
    errors += _budget_errors(job, limits)
    for name in type(job.media).model_fields:
        ref = getattr(job.media, name)
        if ref is None:
            continue
        if ref.upload_key is not None and not ref.upload_key.startswith(upload_prefix):
            errors.append(
                field_error(f"media.{name}.upload_key", f"must start with {upload_prefix!r}", "bad_upload_key")
            )
        if ref.path is not None and not path_may_be_allowed(ref.path, limits.media_roots):
            refusal = path_refusal(limits.media_roots, limits.max_upload_bytes)
            errors.append(field_error(f"media.{name}.path", refusal, "path_not_allowed"))
    if errors:
        raise JobValidationError(f"invalid job: {errors[0]['field']}: {errors[0]['message']}", errors)


def _budget_errors(job: JobRequest, limits: Limits) -> list[dict[str, Any]]:
    """The job's cost against the deployment's budget; each error carries the ``limit`` it broke."""
    errors = []
    frames_field = "num_frames" if job.num_frames is not None else "duration"
    pixel_frames = job_pixel_frames(job, reference_frames=limits.max_reference_frames)
    if pixel_frames > limits.max_pixel_frames:
        refs = f" + {limits.max_reference_frames} reference frames" if job.media.reference_video is not None else ""
        message = (
            f"width × height × frames = {job.width} × {job.height} × ({job.frame_count}{refs}) = {pixel_frames} "
            f"is above this deployment's limit max_pixel_frames = {limits.max_pixel_frames}"
        )
        errors.append(field_error(frames_field, message, "over_budget", limit=limits.max_pixel_frames))
    seconds = job.frame_count / job.fps
    if seconds > limits.max_duration_s:
        message = (
            f"{job.frame_count} frames at {job.fps} fps last {seconds:g} s, above this deployment's limit "
            f"max_duration_s = {limits.max_duration_s:g}"
        )
        errors.append(field_error(frames_field, message, "over_budget", limit=limits.max_duration_s))
    return errors


def path_may_be_allowed(path: str, roots: tuple[str, ...]) -> bool:
    """A lexical first look at a client's media path: absolute and under one of ``roots``.

    It opens nothing (the client and gateway may not even see the stage's files); the stage that reads
    the file resolves it (``realpath``) and checks it again (``stages/media.py``)."""
    if not roots or not path.startswith("/") or "\x00" in path:
        return False
    normal = posixpath.normpath(path)
    return any(_under(normal, posixpath.normpath(root)) for root in roots)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def path_refusal(roots: tuple[str, ...], max_bytes: int) -> str:
    """The one message for every refused path: it says nothing about the file (whether it exists, what
    it is, how large), only what the deployment accepts."""
    if not roots:
        return "local paths are not accepted by this deployment; upload the file instead"
    return f"not a readable regular file of at most {max_bytes} bytes under this deployment's media_roots"
