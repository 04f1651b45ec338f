"""The gateway's ``Idempotency-Key`` record, stored at ``<p>:idem:<digest>`` (see ``gateway/idempotency.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from stageferry.schemas.job import Frozen, RequestId

#: Version of :class:`IdempotencyRecord`; history: 1 — first.
IDEMPOTENCY_VERSION: Literal[1] = 1


class IdempotencyRecord(Frozen):
    """Which request a key created, and a digest of what that request asked for."""

    v: Literal[1] = IDEMPOTENCY_VERSION
    request_id: RequestId
    fingerprint: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
