"""What a consumer asks of a payload's producer through Redis: send it inline instead, or drop it.

The producer's resend service (:mod:`stageferry.broker.data.nixl.producer`) reads these requests from its
resend stream and answers a resend on a reply list.
"""

from __future__ import annotations

import contextlib
import time

import structlog

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Incoming
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.errors import ControlPlaneError, PayloadUnavailableError
from stageferry.schemas import InlinePayload, NixlPayload, PayloadRef, Transport
from stageferry.schemas.nixl import ResendAction, ResendRequest, decode_resend_reply

log = structlog.get_logger(__name__)


async def discard(ep: Endpoint, ref: PayloadRef) -> None:
    """Tell the producer that a payload will never be read (the request was settled meanwhile)."""
    if isinstance(ref, NixlPayload):
        with contextlib.suppress(ControlPlaneError), translated():
            await ask_producer(ep, ref, ResendAction.DROP)


async def resend_inline(ep: Endpoint, ref: NixlPayload, *, reason: str) -> Incoming:
    """Ask the producer to send the payload inline; it is gone if nobody answers in time."""
    started = time.perf_counter()
    reply_key = ep.keys.resend_reply(ref.token)
    with translated():
        await ask_producer(ep, ref, ResendAction.RESEND)
        reply = await ep.redis.blpop([reply_key], timeout=ep.timeouts.resend)
    blob = decode_resend_reply(reply[1] if reply else None)
    if blob is None:
        raise PayloadUnavailableError("producer could not resend the payload", reason=reason, agent=ref.agent)
    metrics.FALLBACKS.labels(reason).inc()
    ep.counters.fallback(reason)
    log.warning("payload.inline_fallback", reason=reason, side="consumer")
    inline_ref = InlinePayload(manifest=ref.manifest, blob_bytes=len(blob), fallback_reason=reason)
    incoming = await ep.inline.decode(inline_ref, blob)
    return Incoming(
        payload=incoming.payload,
        transport=Transport.INLINE,
        nbytes=incoming.nbytes,
        seconds=time.perf_counter() - started,
        fallback_reason=reason,
    )


async def ask_producer(ep: Endpoint, ref: NixlPayload, action: ResendAction) -> None:
    """Post a resend/drop request; the stream expires once no lease could still need it, so a
    producer that died leaves nothing behind in Redis."""
    stream = ep.keys.resend(ref.agent)
    async with ep.redis.pipeline(transaction=True) as pipe:
        pipe.xadd(stream, ResendRequest(token=ref.token, action=action).to_fields())  # type: ignore[arg-type]
        pipe.expire(stream, int(ep.timeouts.lease + ep.timeouts.resend) + 60)
        await pipe.execute()
