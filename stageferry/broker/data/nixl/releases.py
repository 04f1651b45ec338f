"""The producer's release after a get, sent on the event loop's next turn instead of on the get's path.

A get whose bytes arrived tells the producer its slot is free.  A single READ of a payload the stream read
claimed carries that notification itself (NIXL sends it once the bytes are here); every other get — the
same-GPU copy, several READs, a claim won inside the get — sends one of its own (:meth:`NixlAgent.notify`),
and that call was a third of a same-GPU get on the GPU host (47–64 µs of a 170–210 µs get, issue 39,
round 20).  Nothing after the get waits for it: the payload is in our slots, the claim is ours, and the
producer frees the slot whenever the notification comes.  So :meth:`Releases.soon` only queues it, and
the notifications queued in one turn are sent together on the loop's next turn: once the stage hands the
payload to its model (a thread of its own, ``stageferry.stages.group``) or awaits anything else.

What it keeps:

* **Once, by the claim's winner, after the bytes.**  Only :meth:`~stageferry.broker.data.nixl.reads.Reader.read`
  queues a release, where it used to send one: after the claim was won and every READ and copy ended.
* **Nothing lost.**  A notification NIXL cannot send (the peer went away, its endpoint broke) becomes the
  same release through Redis (:func:`~stageferry.broker.data.nixl.resend.discard`, a drop request the
  producer settles), from a task of its own; if that fails too, the producer's lease expiry frees the
  slot, as it does when a consumer dies between its copy and its release.
* **Nothing left behind.**  :meth:`Releases.flush` sends what is queued and waits for those tasks; the
  connector calls it before it closes its agent.

Threading: the queue is touched on the event-loop thread only (every agent call is,
:mod:`~stageferry.broker.data.nixl.agent`); the callback is the loop's own ``call_soon``.
"""

from __future__ import annotations

import asyncio

import structlog

from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.resend import discard
from stageferry.errors import TransferError
from stageferry.schemas import NixlPayload
from stageferry.schemas.nixl import release_notification

log = structlog.get_logger(__name__)


class Releases:
    """The releases one consumer has queued and not sent yet, and the Redis fallbacks still running."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._ep = endpoint
        self._due: dict[str, tuple[NixlPayload, str]] = {}  # token → (payload, the producer's agent name)
        self._scheduled = False
        self._fallbacks: set[asyncio.Task[None]] = set()
        self.sent = 0  #: notifications sent (tests and benchmarks read it)

    @property
    def pending(self) -> int:
        """Releases queued or falling back through Redis: 0 at rest."""
        return len(self._due) + len(self._fallbacks)

    def soon(self, ref: NixlPayload, peer: str) -> None:
        """Queue the release of ``ref``'s slot at the producer ``peer``; sent on the loop's next turn."""
        self._due[ref.token] = (ref, peer)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.send_due)

    def send_due(self) -> None:
        """Send every queued release now (the loop's callback; :meth:`flush` too)."""
        self._scheduled = False
        due, self._due = self._due, {}
        for ref, peer in due.values():
            self.send(ref, peer)

    def send(self, ref: NixlPayload, peer: str) -> None:
        """Send one release now; through Redis, from a task, if NIXL cannot."""
        agent = self._ep.agent
        try:
            if agent is None:
                raise TransferError("the agent is closed", peer=peer)
            agent.notify(peer, release_notification(ref.token))
        except TransferError as exc:
            log.warning("nixl.notify_failed", peer=peer, token=ref.token, error=exc.message)
            task = asyncio.get_running_loop().create_task(self._fall_back(ref, peer))
            self._fallbacks.add(task)
            task.add_done_callback(self._fallbacks.discard)
            return
        self.sent += 1

    async def _fall_back(self, ref: NixlPayload, peer: str) -> None:
        try:
            await discard(self._ep, ref)  # a Redis it cannot reach is its own (suppressed) case
        except Exception as exc:  # noqa: BLE001 - a task's end: the lease expiry frees the slot instead
            log.warning(
                "nixl.release_fallback_failed", peer=peer, token=ref.token, error=f"{type(exc).__name__}: {exc}"
            )

    async def flush(self) -> None:
        """Send what is queued and wait for the Redis fallbacks still running (the connector's close)."""
        self.send_due()
        if self._fallbacks:
            await asyncio.gather(*self._fallbacks, return_exceptions=True)
