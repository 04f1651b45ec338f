"""Benchmark-only NIXL transfer modes, on top of stageferry's :class:`NixlAgent`.

The production data plane posts one READ per region with a fresh ``initialize_xfer`` (see
``stageferry.broker.data.nixl.agent``).  The GPU benchmarks also measure what NIXL offers beyond that —
prepared descriptor lists with indexed READs, reposting a finished handle, WRITE (push) and opening the
connection ahead of the first transfer — so that a later performance pass knows what each is worth.
They live here, not in the package, until production code uses them.

Same contract as the base class: not thread-safe; clean-up in NIXL's order (transfer handles, prepared
lists, remote agents, registrations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import structlog

from stageferry.broker.data.nixl.agent import MemKind, NixlAgent, Region, XferHandle, XferState, is_nixl_error

__all__ = ["BenchAgent", "MemKind", "PreparedList", "XferState"]

log = structlog.get_logger(__name__)


class PreparedList:
    """Opaque handle for a prepared descriptor list (local, or one remote agent's)."""

    __slots__ = ("_h", "count", "kind", "released", "remote")

    def __init__(self, h: Any, remote: str | None, kind: MemKind, count: int) -> None:
        self._h = h
        self.remote = remote
        self.kind = kind
        self.count = count
        self.released = False


class BenchAgent(NixlAgent):
    """A :class:`NixlAgent` that can also prepare descriptor lists, repost, WRITE and warm up peers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._prepped: dict[int, PreparedList] = {}

    def warm_up(self, remote_name: str) -> None:
        """Open the connection now: the first transfer to a new peer otherwise pays 1.5-5 ms for it."""
        try:
            self._agent.make_connection(remote_name)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            raise self._fail(exc, "warm_up", remote_name) from exc

    def start_write(
        self,
        local: Sequence[Region],
        local_kind: MemKind,
        remote: Sequence[Region],
        remote_kind: MemKind,
        remote_name: str,
        notif: bytes,
    ) -> object:
        """Post a WRITE (local -> remote, a push); same contract as :meth:`start_read`."""
        return self._start("WRITE", local, local_kind, remote, remote_kind, remote_name, notif)

    def prepare_local(self, regions: Sequence[Region], kind: MemKind) -> PreparedList:
        """Prepare local regions once (e.g. one per pool block) for :meth:`start_read_indexed`."""
        return self._prepare("NIXL_INIT_AGENT", None, regions, kind)

    def prepare_remote(self, remote_name: str, regions: Sequence[Region], kind: MemKind) -> PreparedList:
        """Prepare a peer's regions once; validation then happens here instead of on every READ."""
        return self._prepare(remote_name, remote_name, regions, kind)

    def start_read_indexed(
        self,
        local: PreparedList,
        local_idx: Sequence[int],
        remote: PreparedList,
        remote_idx: Sequence[int],
        notif: bytes,
    ) -> object:
        """Post a READ of prepared remote entries into prepared local entries (contiguous ones merge)."""
        if remote.remote is None or local.remote is not None:
            raise ValueError("need a local prepared list and a remote one")
        if local.released or remote.released:
            raise ValueError("prepared list already released")
        try:
            h = self._agent.make_prepped_xfer("READ", local._h, list(local_idx), remote._h, list(remote_idx), notif)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            raise self._fail(exc, "start_read_indexed", remote.remote) from exc
        return self._post(XferHandle(h, remote.remote, -1), notif)

    def repost(self, handle: object, notif: bytes) -> None:
        """Post a finished READ again with a new ``notif``: the cheapest way to repeat the same copy."""
        xh = self._own(handle)
        if xh.released:
            raise ValueError("transfer handle already released")
        self._post(xh, notif)

    def release_prepared(self, prepared: PreparedList) -> None:
        if prepared.released:
            return
        prepared.released = True
        self._prepped.pop(id(prepared), None)
        try:
            prepared._h.release()
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            log.warning("nixl.dlist.release_failed", agent=self.name, remote=prepared.remote, error=str(exc))

    def remove_remote(self, name: str) -> None:
        """Forget a peer: its open transfers, then its prepared lists, then the agent (NIXL's order)."""
        for h in [h for h in self._handles.values() if h.remote == name]:
            self.release(h)
        for p in [p for p in self._prepped.values() if p.remote == name]:
            self.release_prepared(p)
        super().remove_remote(name)

    def close(self) -> None:
        for h in list(self._handles.values()):
            self.release(h)
        for p in list(self._prepped.values()):
            self.release_prepared(p)
        super().close()

    def _prepare(self, agent_name: str, remote: str | None, regions: Sequence[Region], kind: MemKind) -> PreparedList:
        if not regions:
            raise ValueError("nothing to prepare")
        try:
            h = self._agent.prep_xfer_dlist(agent_name, list(regions), kind.value)
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            raise self._fail(exc, "prepare", remote or self.name) from exc
        p = PreparedList(h, remote, kind, len(regions))
        self._prepped[id(p)] = p
        return p
