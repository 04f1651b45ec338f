"""Errors → HTTP: one exception type for the gateway's answers, and the one place codes become statuses.

Every error body has OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``, as vLLM-Omni
answers too), plus ``field_errors`` — ``[{"field", "message", "type"}]`` — whenever the request itself
is at fault, so that a client always learns *which* field to fix.  Status codes follow the stageferry
error ``code`` (see :data:`STATUS_BY_CODE`); anything unknown is a 500, but invalid input never is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from stageferry.errors import JobValidationError, StageferryError
from stageferry.schemas import ErrorInfo

#: HTTP status for each stageferry error code; codes not listed are server errors (500).
STATUS_BY_CODE: Mapping[str, int] = {
    "invalid_job": 400,
    "rejected": 400,
    "invalid_envelope": 400,
    "invalid_manifest": 400,
    "invalid_form": 400,
    "not_found": 404,
    "not_ready": 409,
    "cancelled": 409,
    "upload_too_large": 413,
    "unsupported_media_type": 415,
    "generation_failed": 422,
    "queue_full": 503,
    "control_plane": 503,
    "unhealthy": 503,
    "deadline_exceeded": 504,
}


class ApiError(Exception):
    """An answer other than success: HTTP status, stable code, message and the fields at fault."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field_errors = [dict(e) for e in field_errors]
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object, ``param`` naming the first field at fault."""
        param = self.field_errors[0]["field"] if self.field_errors else None
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error: dict[str, Any] = {"message": self.message, "type": kind, "param": param, "code": self.code}
        if self.field_errors:
            error["field_errors"] = self.field_errors
        return {"error": error}


def field_error(field: str, message: str, kind: str) -> dict[str, Any]:
    return {"field": field, "message": message, "type": kind}


def invalid(field: str, message: str, kind: str = "invalid_value") -> ApiError:
    """A 400 naming one form field."""
    return ApiError(400, "invalid_form", f"{field}: {message}", field_errors=[field_error(field, message, kind)])


def invalid_fields(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 naming every field in ``errors`` (the message summarises the first few)."""
    summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:3])
    return ApiError(400, "invalid_form", f"invalid request: {summary}", field_errors=errors)


def status_for(code: str) -> int:
    return STATUS_BY_CODE.get(code, 500)


def from_exception(exc: StageferryError, *, origin: Mapping[str, str] | None = None) -> ApiError:
    """A typed stageferry error as an answer; job field names are renamed to the form's (``origin``)."""
    errors = exc.field_errors if isinstance(exc, JobValidationError) else exc.details.get("field_errors", [])
    errors = rename_fields(errors or [], origin or {})
    headers = {"Retry-After": "5"} if status_for(exc.code) == 503 else None
    return ApiError(status_for(exc.code), exc.code, exc.message, field_errors=errors, headers=headers)


def from_status_error(error: ErrorInfo | None, *, origin: Mapping[str, str] | None = None) -> ApiError:
    """A request's terminal error (rejected, failed, cancelled) as an answer."""
    if error is None:
        return ApiError(500, "internal", "the request ended without a result or an error")
    errors = rename_fields(error.details.get("field_errors") or [], origin or {})
    return ApiError(status_for(error.code), error.code, error.message, field_errors=errors)


def rename_fields(errors: Sequence[Mapping[str, Any]], origin: Mapping[str, str]) -> list[dict[str, Any]]:
    """Field errors named as the client sent them: ``guidance`` → ``guidance_scale`` and so on.

    The job's own name is kept as ``job_field`` when it differs, so both vocabularies are visible.
    """
    out = []
    for err in errors:
        job_field = str(err.get("field", ""))
        sent_as = origin.get(job_field) or origin.get(job_field.split(".upload_key")[0])
        renamed = {**err, "field": sent_as or job_field}
        if sent_as and sent_as != job_field:
            renamed["job_field"] = job_field
        out.append(renamed)
    return out
