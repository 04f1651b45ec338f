"""Errors → HTTP: one exception type for the gateway's answers, and the one place codes become statuses.

Every error body has OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``, as vLLM-Omni
answers too), plus ``field_errors`` — ``[{"field", "message", "type"}]`` — whenever the request itself
is at fault, so that a client always learns *which* field to fix.  Status codes follow the stageferry
error class (see :data:`STATUS_BY_CLASS`, keyed on the classes of ``stageferry/errors.py`` like the
request-state table); the gateway's own answers are built where they arise with
:meth:`ApiError.of`, from the one table of their codes and statuses
(:class:`~stageferry.gateway.codes.GatewayCode`).
Anything unknown is a 500, but invalid input never is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from stageferry.errors import (
    AccessDeniedError,
    CancelledRequestError,
    ControlPlaneError,
    DeadlineExceededError,
    JobValidationError,
    RejectedError,
    RequestIdTakenError,
    RequestLostError,
    RequestNotFoundError,
    StageferryError,
    error_class,
    field_error,
)
from stageferry.gateway.codes import GatewayCode
from stageferry.schemas import ErrorInfo

#: HTTP status for each stageferry error class; a class not listed takes its nearest listed base's, and
#: what has none is a server error (500).  Codes in a request's status are looked up by their class
#: (:func:`stageferry.errors.error_class`), so the state table and this one name the same classes.
STATUS_BY_CLASS: Mapping[type[StageferryError], int] = MappingProxyType(
    {
        StageferryError: 500,
        RejectedError: 400,  # invalid_job, invalid_envelope, invalid_manifest
        CancelledRequestError: 409,
        RequestIdTakenError: 409,  # the id is another job's: a conflict, not someone else's video
        ControlPlaneError: 503,  # queue_full too
        AccessDeniedError: 500,  # our own credentials: not the client's to retry
        DeadlineExceededError: 504,
        RequestNotFoundError: 404,  # an unknown id that a wait would not wait for
        RequestLostError: 503,  # Redis lost an accepted job: retry (an Idempotency-Key resubmits it)
    }
)


#: An error body is bounded whatever the client sent: a message, a field's name and its message are cut
#: to these many characters, and at most :data:`MAX_FIELD_ERRORS` fields are named (a 100,000-character
#: id in a path was echoed whole into its 404).
MAX_MESSAGE_CHARS = 500
MAX_FIELD_CHARS = 200
MAX_FIELD_ERRORS = 20


def clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters (the cut marked with an ellipsis), a lone surrogate in it (what
    a JSON ``"\ud800"`` escape in the client's input decodes to) as ``?``: an answer that quotes the
    client must still encode as UTF-8."""
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bounded(error: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(error)
    for key, limit in (("field", MAX_FIELD_CHARS), ("message", MAX_MESSAGE_CHARS)):
        if isinstance(out.get(key), str):
            out[key] = clip(out[key], limit)
    return out


class ApiError(Exception):
    """An answer other than success: HTTP status, stable code, message and the fields at fault — each
    bounded (:data:`MAX_MESSAGE_CHARS`), since any of them may quote what the client sent."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] = (),
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field_errors = [_bounded(e) for e in field_errors[:MAX_FIELD_ERRORS]]
        self.headers = dict(headers or {})
        #: Set by :func:`with_request_id` when a job was accepted before the answer went wrong.
        self.request_id: str | None = None

    @classmethod
    def of(
        cls,
        code: GatewayCode,
        message: str,
        *,
        field_errors: Sequence[Mapping[str, Any]] = (),
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
    ) -> ApiError:
        """One of the gateway's own answers (``status`` only for a code whose status is the framework's)."""
        if (status is None) == (code.status is None):
            raise ValueError(f"{code.code}: a status is given exactly when the code has none of its own")
        answer = code.status if status is None else status
        assert answer is not None
        return cls(answer, code.code, message, field_errors=field_errors, headers=headers)

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object, ``param`` naming the first field at fault."""
        param = self.field_errors[0]["field"] if self.field_errors else None
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        error: dict[str, Any] = {"message": self.message, "type": kind, "param": param, "code": self.code}
        if self.field_errors:
            error["field_errors"] = self.field_errors
        if self.request_id is None:
            return {"error": error}
        url = f"/v1/videos/{self.request_id}"
        cancel = {"method": "DELETE", "url": url}
        return {"error": error, "request_id": self.request_id, "status_url": url, "cancel": cancel}


def with_request_id(error: ApiError, request_id: str) -> ApiError:
    """``error`` for a request whose job *was accepted*: the answer carries the id (header and body),
    where to follow it and how to cancel it, so that a client never loses a job that runs on."""
    error.request_id = request_id
    error.headers.setdefault("X-Request-Id", request_id)
    error.headers.setdefault("Location", f"/v1/videos/{request_id}")
    if error.status == 503:
        error.headers.setdefault("Retry-After", "5")
    return error


def invalid(field: str, message: str, kind: str = "invalid_value") -> ApiError:
    """A 400 naming one form field."""
    return ApiError.of(
        GatewayCode.INVALID_FORM, f"{field}: {message}", field_errors=[field_error(field, message, kind)]
    )


def invalid_fields(errors: Sequence[Mapping[str, Any]]) -> ApiError:
    """A 400 naming every field in ``errors`` (the message summarises the first few)."""
    summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:3])
    return ApiError.of(GatewayCode.INVALID_FORM, f"invalid request: {summary}", field_errors=errors)


def status_for(error: StageferryError | type[StageferryError] | str) -> int:
    """The HTTP status of an error, its class, or the code a request's status carries."""
    if isinstance(error, str):
        error = error_class(error)
    cls = error if isinstance(error, type) else type(error)
    return next(STATUS_BY_CLASS[c] for c in cls.__mro__ if c in STATUS_BY_CLASS)


def from_exception(exc: StageferryError, *, origin: Mapping[str, str] | None = None) -> ApiError:
    """A typed stageferry error as an answer; job field names are renamed to the form's (``origin``)."""
    errors = exc.field_errors if isinstance(exc, JobValidationError) else exc.details.get("field_errors", [])
    errors = rename_fields(errors or [], origin or {})
    status = status_for(exc)
    headers = {"Retry-After": "5"} if status == 503 else None
    return ApiError(status, exc.code, _renamed_message(exc.message, errors), field_errors=errors, headers=headers)


def _renamed_message(message: str, errors: Sequence[Mapping[str, Any]]) -> str:
    """``message`` with each renamed job field written as the form's name (longest names first)."""
    pairs = sorted(
        ((str(e["job_field"]), str(e["field"])) for e in errors if "job_field" in e), key=lambda p: -len(p[0])
    )
    for job_field, sent_as in pairs:
        message = message.replace(job_field, sent_as)
    return message


def from_status_error(error: ErrorInfo | None, *, origin: Mapping[str, str] | None = None) -> ApiError:
    """A request's terminal error (rejected, failed, cancelled) as an answer."""
    if error is None:
        return ApiError.of(GatewayCode.INTERNAL, "the request ended without a result or an error")
    errors = rename_fields(error.details.get("field_errors") or [], origin or {})
    return ApiError(status_for(error.code), error.code, _renamed_message(error.message, errors), field_errors=errors)


def rename_fields(errors: Sequence[Mapping[str, Any]], origin: Mapping[str, str]) -> list[dict[str, Any]]:
    """Field errors named as the client sent them: ``guidance`` → ``guidance_scale`` and so on.

    The job's own name is kept as ``job_field`` when it differs, so both vocabularies are visible.  A
    media input the client did not send (``fl2va needs media.first_frame``) is named as the upload field
    that would carry it (``first_frame``).
    """
    out = []
    for err in errors:
        job_field = str(err.get("field", ""))
        sent_as = origin.get(job_field) or origin.get(job_field.split(".upload_key")[0])
        if sent_as is None and job_field.startswith("media."):
            sent_as = job_field.removeprefix("media.").split(".")[0]
        renamed = {**err, "field": sent_as or job_field}
        if sent_as and sent_as != job_field:
            renamed["job_field"] = job_field
            renamed["message"] = str(err.get("message", "")).replace(job_field, sent_as)
        out.append(renamed)
    return out
