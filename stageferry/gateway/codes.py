"""The gateway's own error codes, defined once: each with its HTTP status and what it means.

These are the answers the gateway makes itself (a form it cannot read, an unknown video, a full stream
table); an error raised by stageferry (``stageferry/errors.py``) keeps its own code and takes its status
from :data:`~stageferry.gateway.errors.STATUS_BY_CLASS`.  Raise one as
``ApiError.of(GatewayCode.NOT_FOUND, message)``; the table in docs/errors.md is generated from this enum
(``stageferry.docgen``), so it cannot drift.
"""

from __future__ import annotations

from enum import Enum


class GatewayCode(Enum):
    """``code`` (the value, as the error body's ``error.code``), ``status`` (``None``: the status the
    web framework answered with) and ``meaning``."""

    INVALID_FORM = ("invalid_form", 400, "the form (or a query/path parameter) cannot be read or is out of range")
    UNAUTHORIZED = ("unauthorized", 401, "no bearer token, or the wrong one, on a gateway that needs one")
    NOT_FOUND = ("not_found", 404, "no such video (unknown, expired or deleted) or its output is gone; or no route")
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, "the route exists, not with this HTTP method")
    HEAD_STALLED = (
        "head_stalled",
        408,
        "the request head (request line and headers) did not arrive whole in time: the connection was closed",
    )
    BODY_STALLED = ("body_stalled", 408, "the request body stopped arriving (no bytes for a while): it was not read")
    NOT_READY = ("not_ready", 409, "the video is still being made: its content is not there yet")
    IDEMPOTENCY_KEY_UNUSABLE = (
        "idempotency_key_unusable",
        409,
        "the record of this Idempotency-Key cannot be read: use another key",
    )
    UPLOAD_TOO_LARGE = ("upload_too_large", 413, "an uploaded file (or the whole body) is over its limit")
    UNSUPPORTED_MEDIA_TYPE = (
        "unsupported_media_type",
        415,
        "the body is neither a form (multipart or urlencoded) nor a JSON object",
    )
    GENERATION_FAILED = ("generation_failed", 422, "the video's generation ended without the output asked for")
    IDEMPOTENCY_KEY_REUSED = (
        "idempotency_key_reused",
        422,
        "this Idempotency-Key was used for a different request (its id is in X-Request-Id)",
    )
    TOO_MANY_STREAMS = ("too_many_streams", 429, "every event-stream slot is taken: retry after Retry-After")
    NOT_SUPPORTED = (
        "not_supported",
        501,
        "an operation of OpenAI's videos API this gateway does not offer (remix, edits, extensions, characters)",
    )
    HTTP_ERROR = ("http_error", None, "any other refusal of the web framework, with its status")
    INTERNAL = ("internal", 500, "an unexpected error in the gateway (a bug): the body names its type")

    def __init__(self, code: str, status: int | None, meaning: str) -> None:
        self.code = code
        self.status = status
        self.meaning = meaning


def code_rows() -> list[tuple[str, str, str]]:
    """``(code, status, meaning)`` for every gateway code, in definition order (the docs table)."""
    return [(f"`{c.code}`", str(c.status) if c.status else "the framework's", c.meaning) for c in GatewayCode]


__all__ = ["GatewayCode", "code_rows"]
