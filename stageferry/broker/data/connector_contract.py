"""The data-plane contract: how a stage leader hands a payload to the next stage's leader.

Who calls what, and when (leaders only; followers never touch a connector):

* **Producer leader**, after its model returned a payload: :meth:`Connector.put` once.  The returned
  :class:`Outgoing` holds the :data:`~stageferry.schemas.PayloadRef` for the envelope and, for an inline
  payload, the ``blob`` field.  The producer must then either hand the envelope on (after which the
  payload belongs to the consumer: a NIXL slot is freed by the consumer's READ notification or by its
  lease running out unclaimed) or call :meth:`Connector.abandon` if the hand-off did not happen.
* **Producer model** (on the leader, before the put; optional): :meth:`Connector.stage` with a template
  of the payload (:mod:`stageferry.broker.data.staging`) — the answer holds the output tensors to write
  into.  A connector that can (NIXL) answers views over registered pool slots, so the put that follows
  with the same layout copies nothing; others answer ordinary tensors.  The staging is the hop's until
  the put takes it; the stage worker calls :meth:`Connector.unstage` once the request is done with
  (put or not), which frees what no put took.
* **Consumer leader**, on an envelope: ``async with connector.get(ref, blob) as incoming`` — inside the
  block ``incoming.payload`` is valid (it may be a zero-copy view of the consumer's pool); on exit the
  consumer's slot is released.  A connector whose payloads must be claimed before use (NIXL leases)
  answers :meth:`Connector.lease_claim`: the stage's stream read then claims each new entry's lease in
  its own round trip, and the worker passes the outcome on as ``get(..., claimed=)`` (True: ours
  already; False: someone else's, the payload is gone; None: the connector claims it itself).
  Errors: :class:`~stageferry.errors.ManifestError` (reject),
  :class:`~stageferry.errors.PayloadUnavailableError` (recompute upstream), other
  :class:`~stageferry.errors.DataPlaneError` after the connector's own fallbacks are exhausted.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from stageferry.broker.control.streams import LeaseClaim
from stageferry.broker.data.staging import Template, materialize
from stageferry.schemas import DeviceKind, Manifest, PayloadRef, Transport

Payload = Any
"""A nested structure (dicts, lists, tuples) of tensors and small plain values."""


@dataclass(frozen=True, slots=True)
class Outgoing:
    """What a put produced: the reference for the envelope, and the inline bytes if any."""

    ref: PayloadRef
    blob: bytes | None
    transport: Transport
    nbytes: int
    seconds: float
    fallback_reason: str | None = None
    #: The model wrote the payload into the slots the put leased (:meth:`Connector.stage`): the put
    #: copied only what it made elsewhere (``copied`` tensors).
    staged: bool = False
    copied: int | None = None


@dataclass(frozen=True, slots=True)
class Incoming:
    """A payload held by the consumer leader, with how it came.

    ``manifest`` and ``regions`` are set when the payload's packed bytes are at hand (e.g. the pool
    slot a NIXL READ landed in), so a stage group can fan them out without packing them again.
    ``route`` says, per region, which memory it left and landed in and what carried it (for NIXL, the
    UCX transport: ``"VRAM:0→VRAM:1 cuda_ipc, DRAM→DRAM cma"``), for the hop's line in the status."""

    payload: Payload
    transport: Transport
    nbytes: int
    seconds: float
    fallback_reason: str | None = None
    manifest: Manifest | None = None
    regions: Mapping[DeviceKind, Any] | None = None
    route: str | None = None


class Connector(abc.ABC):
    """Moves one payload from a producer leader to a consumer leader."""

    @abc.abstractmethod
    async def put(self, key: str, payload: Payload, *, force_inline: bool = False) -> Outgoing:
        """Make ``payload`` fetchable by the next stage; ``key`` names the hop in logs and metrics."""

    @abc.abstractmethod
    def get(
        self, ref: PayloadRef, blob: bytes | None, *, key: str, claimed: bool | None = None
    ) -> contextlib.AbstractAsyncContextManager[Incoming]:
        """Fetch the payload ``ref`` describes; the payload is valid inside the context.  ``claimed``:
        what the stream read's lease claim (:meth:`lease_claim`) did for ``ref``, None if it did not try."""

    def lease_claim(self) -> LeaseClaim | None:
        """The claim a stream read should take for each new entry's ``lease`` field (the envelope's
        :meth:`lease_of`), or None: nothing to claim (the default)."""
        return None

    @staticmethod
    def lease_of(ref: PayloadRef) -> str | None:
        """The lease an envelope carrying ``ref`` names in its ``lease`` field (NIXL payloads' token)."""
        return getattr(ref, "token", None)

    async def stage(
        self, key: str, template: Template, *, force_inline: bool = False, deadline: float | None = None
    ) -> Payload:
        """Output tensors for the hop ``key``, laid out as ``template`` describes (its tensors' shape,
        dtype and device; its plain values).  By default ordinary fresh tensors: nothing to release."""
        return materialize(template)

    def unstage(self, key: str) -> None:  # noqa: B027 - optional hook
        """The request of hop ``key`` is done with (put or not): free a staging no put took."""

    def abandon(self, outgoing: Outgoing) -> None:  # noqa: B027 - optional hook
        """The envelope for ``outgoing`` was never handed on: free whatever the put holds."""

    async def discard(self, ref: PayloadRef) -> None:  # noqa: B027 - optional hook
        """Consumer side: ``ref`` will never be fetched (its request was settled meanwhile)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release everything (agents, pools) at shutdown."""


@contextlib.asynccontextmanager
async def holding(incoming: Incoming) -> AsyncIterator[Incoming]:
    """A context for payloads that need no release (inline, in-process)."""
    yield incoming
