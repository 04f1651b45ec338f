"""Connecting a consumer to its producers ahead of their payloads: no cold first hop.

A payload's first READ from a producer used to pay for everything a new peer needs: the agent record's
round trip, loading its metadata, the UCX wire-up and (on a GPU) mapping the producer's arena — 22–25 ms
on the H200 against about 1 ms warm (issue 39).  :class:`UpstreamWatch` does that work when both stages
are up instead: every producer names its current agent in its stage's index ``<prefix>:nixl:agents:<stage>``
(replica id → agent name, written with its record: :meth:`Peers.publish_record`); the watch reads the
index of the stage this process consumes from and :meth:`Peers.connect`\\ s each agent it has not loaded.

Restarts, on either side:

* a producer that restarts gets a new incarnation, hence a new agent name, which replaces the old one
  in the index: the watch drops the old peer and connects the new one (a changed advertised address
  comes with the new record);
* a consumer that restarts starts with an empty cache: :meth:`NixlConnector.run` makes one round of
  the watch before it reports started, so its worker goes live already connected to the producers up.

The watch looks every :data:`WATCH_S`, and every :data:`WATCH_FAST_S` while no producer of the stage is
connected (a stage that has just started, or whose producers all restarted), one ``HGETALL`` each time.
An entry whose agent has no record (its producer died without withdrawing it, and the record expired) is
taken out of the index (:meth:`Peers.unlist`; a producer still alive writes both again at its next
heartbeat).  A producer that cannot be connected otherwise (a record of another protocol, a failed
handshake or warm-up READ) is logged once and tried again after a growing pause; its payloads load it on
the request path as before, where a failure falls back inline.  Nothing here is needed for correctness: every
check of :meth:`Peers.ensure` (incarnation, metadata, arenas, seal) still runs on every payload.
"""

from __future__ import annotations

import re
import time

import anyio
import structlog

from stageferry.broker.control.redis_conn import translated
from stageferry.broker.data.nixl.endpoint import Endpoint
from stageferry.broker.data.nixl.peers import Peers
from stageferry.errors import ControlPlaneError, DataPlaneError, ManifestError, PayloadUnavailableError

log = structlog.get_logger(__name__)

#: How often the watch reads the index while a producer of the stage is connected ...
WATCH_S = 0.25
#: ... and while none is.
WATCH_FAST_S = 0.05
#: A producer that could not be connected is tried again after this pause, doubled on each failure.
RETRY_S, RETRY_MAX_S = 0.5, 30.0
_NAME = re.compile(r"[A-Za-z0-9._:-]{1,256}")


class UpstreamWatch:
    """Keeps this process connected to the agents of ``stage`` (the one it consumes payloads from)."""

    def __init__(self, endpoint: Endpoint, peers: Peers, stage: str) -> None:
        self._ep = endpoint
        self._peers = peers
        self.stage = stage
        self._retry: dict[str, tuple[float, float]] = {}  # agent name -> (next try, pause)
        self.connects = 0  #: agents connected by the watch (tests and benchmarks read it)
        self._redis_away = False  # logged once per outage, not at every look

    async def run(self) -> None:
        """Look every :data:`WATCH_S` (see the module docstring); runs until cancelled."""
        while True:
            connected = await self.look()
            await anyio.sleep(WATCH_S if connected else WATCH_FAST_S)

    async def look(self) -> int:
        """One round: connect the agents the index names that are not loaded, drop loaded ones the index
        replaced (their replica restarted); the number of the stage's agents loaded afterwards.  A Redis
        that is away is logged once per outage and waited out (0 is returned)."""
        ep = self._ep
        try:
            with translated():
                raw = await ep.redis.hgetall(ep.keys.agents(self.stage))
        except ControlPlaneError as exc:
            if not self._redis_away:
                log.warning("nixl.upstream_watch_failed", stage=self.stage, error=exc.message)
            self._redis_away = True
            return 0
        self._redis_away = False
        listed = self._listed(raw)
        current = set(listed.values())
        for peer in self._peers.peers_of(self.stage):
            replica = peer.name[: -len(peer.incarnation[:8]) - 1]
            if replica in listed and listed[replica] != peer.name:
                log.info("nixl.peer_replaced", peer=peer.name, by=listed[replica])
                self._peers.forget(peer.name)
        now = time.monotonic()
        replicas = {name: replica for replica, name in listed.items()}
        for name in sorted(current):
            if name in self._peers or self._retry.get(name, (0.0, 0.0))[0] > now:
                continue
            try:
                await self._peers.connect(name)
            except PayloadUnavailableError as exc:  # no record: its producer is gone
                self._failed(name, exc)
                await self._unlist(replicas[name], name)
                continue
            except (DataPlaneError, ManifestError, ControlPlaneError, TimeoutError) as exc:
                self._failed(name, exc)
                continue
            self._retry.pop(name, None)
            self.connects += 1
        for name in [n for n in self._retry if n not in current]:
            del self._retry[name]  # replaced or withdrawn: nothing to try again
        return len(self._peers.peers_of(self.stage))

    async def _unlist(self, replica: str, name: str) -> None:
        try:
            removed = await self._peers.unlist(self.stage, replica, name)
        except ControlPlaneError:
            return  # the next look tries again
        if removed:
            log.info("nixl.peer_unlisted", peer=name, stage=self.stage, reason="no record")

    def _listed(self, raw: dict[bytes, bytes]) -> dict[str, str]:
        """The index as replica id → agent name, each checked (names of this stage only)."""
        listed: dict[str, str] = {}
        for field, value in raw.items():
            try:
                replica, name = field.decode(), value.decode()
            except UnicodeDecodeError:
                continue
            if _NAME.fullmatch(name) and name.startswith(f"{replica}-") and replica.startswith(f"{self.stage}-"):
                listed[replica] = name
        return listed

    def _failed(self, name: str, exc: BaseException) -> None:
        first = name not in self._retry
        pause = min(RETRY_MAX_S, self._retry.get(name, (0.0, RETRY_S / 2))[1] * 2)
        self._retry[name] = (time.monotonic() + pause, pause)
        if first:  # once per agent: a producer that stays unreachable does not fill the log
            error = getattr(exc, "message", None) or type(exc).__name__
            log.warning("nixl.preconnect_failed", peer=name, stage=self.stage, error=error, retry_s=pause)
