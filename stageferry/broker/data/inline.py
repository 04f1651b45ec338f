"""The inline connector: the payload rides in the stream entry's binary ``blob`` field.

For small payloads (below ``inline_max_bytes`` the NIXL connector delegates here) and as the fallback
when NIXL cannot be used.  The blob is the payload's regions concatenated, described by the manifest in
the envelope: raw bytes plus a validated JSON header, never pickle.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import structlog
import torch

from stageferry.broker.data import metrics
from stageferry.broker.data.connector_contract import Connector, Incoming, Outgoing, Payload
from stageferry.broker.data.payload_codec import decode_inline, encode_inline, validate_manifest
from stageferry.errors import ManifestError, PayloadTooLargeError
from stageferry.schemas import InlinePayload, PayloadRef, Transport

log = structlog.get_logger(__name__)

#: Below this many bytes, encoding and decoding run on the event loop (a thread hop costs more).
THREAD_ABOVE = 1 << 20


class InlineConnector(Connector):
    """Encodes payloads into the entry; ``max_bytes`` is the hard cap on what may go inline."""

    def __init__(self, *, max_bytes: int, max_payload_bytes: int, cuda_device: torch.device | None) -> None:
        self.max_bytes = max_bytes
        self.max_payload_bytes = max_payload_bytes
        self.cuda_device = cuda_device

    async def encode(self, payload: Payload, *, fallback_reason: str | None = None) -> Outgoing:
        """The inline form of ``payload``; :class:`PayloadTooLargeError` above ``max_bytes``."""
        started = time.perf_counter()
        manifest, blob = await _maybe_in_thread(encode_inline, payload, size_hint=None)
        if len(blob) > self.max_bytes:
            raise PayloadTooLargeError("payload too large to travel inline", bytes=len(blob), inline_cap=self.max_bytes)
        seconds = time.perf_counter() - started
        metrics.PUTS.labels(Transport.INLINE.value).inc()
        metrics.BYTES.labels("put", Transport.INLINE.value).inc(len(blob))
        metrics.TRANSFER_SECONDS.labels(Transport.INLINE.value, "put").observe(seconds)
        if fallback_reason:
            metrics.FALLBACKS.labels(fallback_reason).inc()
        ref = InlinePayload(manifest=manifest, blob_bytes=len(blob), fallback_reason=fallback_reason)
        return Outgoing(
            ref=ref,
            blob=blob,
            transport=Transport.INLINE,
            nbytes=len(blob),
            seconds=seconds,
            fallback_reason=fallback_reason,
        )

    async def put(self, key: str, payload: Payload, *, force_inline: bool = False) -> Outgoing:
        return await self.encode(payload)

    async def decode(self, ref: InlinePayload, blob: bytes | None) -> Incoming:
        """Validate and rebuild an inline payload; any mismatch is a :class:`ManifestError`."""
        started = time.perf_counter()
        if blob is None:
            raise ManifestError("inline payload without a blob field")
        if len(blob) != ref.blob_bytes:
            raise ManifestError("blob length differs from the envelope", blob=len(blob), declared=ref.blob_bytes)
        validate_manifest(ref.manifest, max_payload_bytes=min(self.max_payload_bytes, self.max_bytes))
        payload = await _maybe_in_thread(
            lambda: decode_inline(ref.manifest, blob, cuda_device=self.cuda_device), size_hint=len(blob)
        )
        seconds = time.perf_counter() - started
        metrics.GETS.labels(Transport.INLINE.value).inc()
        metrics.BYTES.labels("get", Transport.INLINE.value).inc(len(blob))
        metrics.TRANSFER_SECONDS.labels(Transport.INLINE.value, "get").observe(seconds)
        return Incoming(
            payload=payload,
            transport=Transport.INLINE,
            nbytes=len(blob),
            seconds=seconds,
            fallback_reason=ref.fallback_reason,
        )

    @contextlib.asynccontextmanager
    async def get(
        self, ref: PayloadRef, blob: bytes | None, *, key: str, claimed: bool | None = None
    ) -> AsyncIterator[Incoming]:
        if not isinstance(ref, InlinePayload):
            raise ManifestError(f"inline connector cannot fetch a {ref.kind!r} payload", kind=ref.kind)
        yield await self.decode(ref, blob)


async def _maybe_in_thread(fn, *args, size_hint: int | None):  # type: ignore[no-untyped-def]
    """Run CPU-heavy codec work off the event loop unless it is known to be small."""
    if size_hint is not None and size_hint < THREAD_ABOVE:
        return fn(*args)
    return await anyio.to_thread.run_sync(fn, *args)
