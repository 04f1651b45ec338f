"""The one boundary between stageferry and the ``nixl`` library.

Everything NIXL-specific lives here: memory registration, remote agents, READ transfers, notifications
and clean-up, over the native agent :mod:`~stageferry.broker.data.nixl.native` loads and makes.  Every nixl
exception is translated into a :mod:`stageferry.errors` class (original kept as ``__cause__``), so no
other module imports nixl.
Only what the data plane uses is here (a READ of the same regions as an earlier one is posted again on its
handle: :meth:`NixlAgent.recycle`): the benchmarks extend it with prepared descriptor lists, indexed READs,
WRITE and warm-up (``benchmarks/nixl_bench_agent.py``); UCX's log is read by
:mod:`stageferry.broker.data.nixl.ucx_log`.

Who calls: the connector's endpoint creates one agent per leader process at start-up
(:mod:`stageferry.broker.data.nixl.connector`), the pools register their arenas once, the consumer
posts and polls READs, the producer drains notifications.

Regions travel on the wire as plain ``(address, length, device_id)`` ints; NIXL descriptor objects are
rebuilt locally (their own serialisation is pickle and must not cross a trust boundary).

Not thread-safe: the agent runs without NIXL's internal locking (no listener thread), so one thread
owns a :class:`NixlAgent` and all its calls.

CUDA ordering: UCX copies VRAM on its own CUDA stream, unordered with torch's.  Whoever fills a buffer
(producer) or last wrote the destination (consumer) must synchronize that work before a READ is posted;
once :meth:`NixlAgent.poll` says DONE the bytes are in place for any stream.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import structlog
import torch

from stageferry.broker.data.nixl import native
from stageferry.broker.data.nixl.native import PROGRESS_DELAY_US
from stageferry.broker.data.nixl.ucx_log import UcxLogTail, own_tables, parse_ucx_log, route_matches
from stageferry.errors import NixlUnavailableError, PeerDisconnectedError, TransferError
from stageferry.schemas.payload import MemKind

log = structlog.get_logger(__name__)

Region = tuple[int, int, int]  #: (address, length, device_id) -- what travels on the wire


class XferState(enum.StrEnum):
    """nixl's transfer-state strings, wrapped once."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


def is_nixl_error(exc: BaseException) -> bool:
    return type(exc).__module__.endswith("_bindings") and type(exc).__name__.startswith("nixl")


#: Why a peer's metadata loads but UCX cannot connect to it, as seen here: its worker address lists every
#: interface UCX opened when the peer started, and one of them went away (a veth or a Docker network removed)
#: or its address now belongs to someone else.  Nothing heals that but restarting the peer, so the error
#: names the cure; hops to that peer go inline meanwhile.
UNREACHABLE_HINT = (
    "UCX reached none of the peer's addresses (an interface it listed when it started may be gone: pin "
    "stages to one interface with STAGEFERRY_ADVERTISE_ADDRESS or UCX_NET_DEVICES)"
)


def _translate(exc: Exception, what: str, **details: Any) -> Exception:
    """Map a nixl exception to a stageferry error; anything else is re-raised by the caller."""
    name = type(exc).__name__
    if name == "nixlRemoteDisconnectError":
        return PeerDisconnectedError(f"{what}: remote agent disconnected ({exc})", **details)
    if name == "nixlNotAllowedError" and what == "add_remote":
        return PeerDisconnectedError(
            "add_remote: an agent of that name with other connection info is cached (peer restarted?)"
            "; remove_remote() it first",
            **details,
        )
    if name == "nixlBackendError" and what == "add_remote":
        return TransferError(f"add_remote: {UNREACHABLE_HINT} ({name}: {exc})", **details)
    return TransferError(f"{what}: {name} ({exc})", **details)


def _state(raw: Any) -> XferState:
    """nixl's state string as the enum; a string nixl never documented is a failed transfer."""
    try:
        return XferState(raw.decode() if isinstance(raw, bytes | bytearray) else raw)
    except ValueError:
        raise TransferError(f"nixl reported an unknown transfer state {raw!r}") from None


class XferHandle:
    """Opaque handle for one posted transfer; the caller polls it, then releases it."""

    __slots__ = ("_h", "key", "nbytes", "posted_ns", "released", "remote", "route")

    def __init__(self, h: Any, remote: str, nbytes: int, route: str = "", key: tuple[object, ...] = ()) -> None:
        self._h = h
        self.remote = remote
        self.nbytes = nbytes
        self.route = route  #: ``"VRAM<-DRAM"``: local <- remote memory kind
        self.key = key  #: what it moves (:meth:`NixlAgent.recycle`): a READ of the same posts it again
        self.posted_ns = 0
        self.released = False


#: Handles of READs that ended, kept to be posted again by a READ of the very same regions (NIXL's reuse: one
#: active post per handle, posted again once DONE, its notification given per post); the oldest is freed
#: past this many.  A consumer's payloads of one shape land in the same slots (``nixl.ready``) from the
#: same producer slots (its first fit), so their READs repeat.
IDLE_HANDLES = 16
#: The routes (local <- remote memory) whose handles are kept: host memory (CMA on one host, TCP across
#: hosts), its post measured shorter.  VRAM <- VRAM reposts READ the right bytes on a GPU (cuda_ipc) but were
#: no faster there than a handle each (issue 39, round 22), so that route makes its handles afresh.
RECYCLED_ROUTES = frozenset({"DRAM<-DRAM"})


class _Registration:
    __slots__ = ("descs", "nbytes")

    def __init__(self, descs: Any, nbytes: int) -> None:
        self.descs = descs
        self.nbytes = nbytes


class NixlAgent:
    """One per leader process, created at start-up (the first agent costs ~0.45 s).

    Not thread-safe: call from one thread.  Register pools once (``registrations`` counts them, so tests
    can assert there is no per-request registration); READs are posted and polled, never blocked on.
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = PROGRESS_DELAY_US,
        ucx_threads: int = 0,
    ) -> None:
        t0 = time.perf_counter()
        self._agent, bind = native.make_agent(name, backends, progress_delay_us, ucx_threads)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:  # nixl only warns when a plugin is missing; an agent without it is useless to us
            raise NixlUnavailableError(f"NIXL backend(s) {missing} not available", agent=name)
        self._bind = bind
        self.name = name
        self.registrations = 0
        self._regs: dict[int, _Registration] = {}
        self._remotes: set[str] = set()
        self._dead: set[str] = set()  # remotes that reported a disconnect: must be removed before re-adding
        self._handles: dict[int, XferHandle] = {}
        self._idle: OrderedDict[tuple[object, ...], XferHandle] = OrderedDict()  # recycled, oldest first
        self.reposts = 0  #: READs posted on a recycled handle (tests and benchmarks read it)
        self._transport: dict[tuple[str, str], str] = {}  # (remote, route) -> what UCX said
        self._transport_tries: dict[tuple[str, str], int] = {}
        self._ucx_tables: dict[str, list[str]] = {}  # remote -> what UCX printed, not yet matched to a route
        # route -> the last tables UCX printed for it, kept when their peer goes: UCX prints a table once
        # per endpoint configuration, so a later peer on the same one (a producer restarted) prints none
        self._route_tables: dict[str, str] = {}
        self._ucx_log = UcxLogTail(native.ucx_log_path) if native.ucx_log_path is not None else None
        log.info(
            "nixl.agent.created",
            agent=name,
            backends=list(backends),
            ucx_threads=ucx_threads,
            seconds=round(time.perf_counter() - t0, 4),
        )

    @contextlib.contextmanager
    def _raising(self, what: str, remote: str | None = None) -> Iterator[None]:
        """The one translation: a nixl exception inside becomes a stageferry error (cause kept), anything
        else passes through.  With ``remote``, a disconnect also marks that peer dead (see :meth:`_fail`)."""
        try:
            yield
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            if remote is None:
                raise _translate(exc, what, agent=self.name) from exc
            raise self._fail(exc, what, remote) from exc

    @contextlib.contextmanager
    def _warning(self, event: str, **details: Any) -> Iterator[None]:
        """Clean-up calls: a nixl exception is logged as ``event`` and swallowed (nothing to undo)."""
        try:
            yield
        except Exception as exc:
            if not is_nixl_error(exc):
                raise
            log.warning(event, agent=self.name, error=str(exc), **details)

    # -- identity and memory ---------------------------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (a few hundred bytes to a few KB), for peers' :meth:`add_remote`."""
        return bytes(self._agent.get_agent_metadata())

    def register(self, tensor: torch.Tensor) -> object:
        """Register one contiguous tensor (DRAM for CPU, VRAM for CUDA) once, at pool creation."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        with self._raising("register"):
            descs = self._agent.register_memory(tensor)
        reg = _Registration(descs, tensor.numel() * tensor.element_size())
        self._regs[id(reg)] = reg
        self.registrations += 1
        log.info(
            "nixl.memory.registered",
            agent=self.name,
            kind=self.kind_of(tensor).value,
            nbytes=reg.nbytes,
            device=str(tensor.device),
        )
        return reg

    def deregister(self, handle: object) -> None:
        reg = self._regs.pop(id(handle), None)
        if reg is None:
            return
        with self._raising("deregister"):
            self._agent.deregister_memory(reg.descs)

    @staticmethod
    def kind_of(tensor: torch.Tensor) -> MemKind:
        return MemKind.VRAM if tensor.is_cuda else MemKind.DRAM

    @staticmethod
    def region_of(tensor: torch.Tensor) -> Region:
        """The wire form of a contiguous tensor (device id 0 for DRAM, as NIXL expects)."""
        dev = tensor.get_device()
        return (tensor.data_ptr(), tensor.numel() * tensor.element_size(), max(dev, 0))

    # -- remote agents ---------------------------------------------------------------------------------

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its name. A cached dead peer of the same name is replaced."""
        try:
            with self._raising("add_remote"):
                raw = self._agent.add_remote_agent(metadata)
        except PeerDisconnectedError as err:
            if not (self._dead and type(err.__cause__).__name__ == "nixlNotAllowedError"):
                raise
            # Same name, new connection info: a restarted peer. Drop the dead entries and retry once.
            for dead in list(self._dead):
                self.remove_remote(dead)
            return self.add_remote(metadata)
        name = raw.decode() if isinstance(raw, bytes | bytearray) else str(raw)
        if name not in self._remotes:
            self._remotes.add(name)
            log.info("nixl.remote.added", agent=self.name, remote=name)
        return name

    def connect(self, name: str) -> None:
        """Open the UCX connection to a loaded peer now (NIXL's ``make_connection``), so that its first READ
        does not wait for the wire-up."""
        with self._raising("make_connection", name):
            self._agent.make_connection(name)

    def remove_remote(self, name: str) -> None:
        """Forget a peer (idempotent); its open transfers go first, as NIXL requires."""
        for h in [h for h in self._handles.values() if h.remote == name]:
            self.release(h)
        for key in [k for k, h in self._idle.items() if h.remote == name]:
            self._free(self._idle.pop(key))
        self._dead.discard(name)
        for key in [k for k in self._transport if k[0] == name]:
            del self._transport[key]
        for key in [k for k in self._transport_tries if k[0] == name]:
            del self._transport_tries[key]
        self._ucx_tables.pop(name, None)
        if name not in self._remotes:
            return
        self._remotes.discard(name)
        with self._warning("nixl.remote.remove_failed", remote=name):
            self._agent.remove_remote_agent(name)
        log.info("nixl.remote.removed", agent=self.name, remote=name)

    def remotes(self) -> frozenset[str]:
        return frozenset(self._remotes)

    # -- transfers -------------------------------------------------------------------------------------

    def start_read(
        self,
        local: Sequence[Region],
        local_kind: MemKind,
        remote: Sequence[Region],
        remote_kind: MemKind,
        remote_name: str,
        notif: bytes,
    ) -> object:
        """Post a READ (remote -> local); ``notif`` reaches the remote side when it completes."""
        return self._start("READ", local, local_kind, remote, remote_kind, remote_name, notif)

    def poll(self, handle: object) -> XferState:
        """PROC or DONE; a failed transfer raises (TransferError / PeerDisconnectedError), never ERR.  So
        does one whose handle was released under it (:meth:`remove_remote`: its peer was dropped while
        another get still waited on it): NIXL has freed it, and what it would say of it means nothing."""
        xh = self._own(handle)
        if xh.released:
            raise PeerDisconnectedError("READ cancelled: its peer was dropped", agent=self.name, remote=xh.remote)
        with self._raising("poll", xh.remote):
            state = _state(self._agent.check_xfer_state(xh._h))
        if state is XferState.PROC:
            return state
        if state is XferState.DONE:
            if (xh.remote, xh.route) not in self._transport and self._ucx_log is not None:
                self._learn_transport((xh.remote, xh.route))  # at most a few cheap looks per peer and route
            return state
        raise TransferError("READ reported ERR", agent=self.name, remote=xh.remote)

    def release(self, handle: object) -> None:
        """Free a transfer handle (idempotent); an active one is cancelled by NIXL."""
        xh = self._own(handle)
        if xh.released:
            return
        self._handles.pop(id(xh), None)
        self._free(xh)

    def recycle(self, handle: object) -> None:
        """Done with a handle whose READ :meth:`poll` saw DONE: keep it for a READ of the very same regions,
        which :meth:`start_read` then posts on it instead of making a new one (NIXL's per-call descriptor
        checks skipped); the oldest kept is freed past :data:`IDLE_HANDLES`; one of a route not in
        :data:`RECYCLED_ROUTES` is released.  Anything else: :meth:`release`."""
        xh = self._own(handle)
        if xh.released:
            return
        if xh.route not in RECYCLED_ROUTES:
            self.release(xh)
            return
        self._handles.pop(id(xh), None)
        stale = self._idle.pop(xh.key, None)
        if stale is not None:
            self._free(stale)
        self._idle[xh.key] = xh
        while len(self._idle) > IDLE_HANDLES:
            self._free(self._idle.popitem(last=False)[1])

    def _free(self, xh: XferHandle) -> None:
        xh.released = True
        # On failure nixl keeps the handle on its leak list and frees it when the agent goes.
        with self._warning("nixl.xfer.release_failed", remote=xh.remote):
            self._agent.release_xfer_handle(xh._h)

    def notify(self, remote_name: str, message: bytes) -> None:
        """Send ``message`` to ``remote_name`` as a notification of its own (not carried by a transfer);
        it arrives in the peer's :meth:`drain_notifs` like a READ's."""
        with self._raising("notify", remote_name):
            self._agent.send_notif(remote_name, message)

    def drain_notifs(self) -> dict[str, list[bytes]]:
        """All notifications received since the last call; the ONLY place notifs are consumed."""
        with self._raising("drain_notifs"):
            got = self._agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in got.items()}

    def open_handles(self) -> int:
        """Handles posted and not yet released or recycled (0 at rest)."""
        return len(self._handles)

    def idle_handles(self) -> int:
        """Recycled handles kept for a READ of the same regions (at most :data:`IDLE_HANDLES`)."""
        return len(self._idle)

    @property
    def registered_bytes(self) -> int:
        """Memory registered right now (the pools, once each: it must not grow with traffic)."""
        return sum(reg.nbytes for reg in self._regs.values())

    def close(self) -> None:
        """Clean-up in NIXL's order: transfer handles, remote agents, registrations."""
        for h in list(self._handles.values()):
            self.release(h)
        while self._idle:
            self._free(self._idle.popitem()[1])
        for r in list(self._remotes):
            self.remove_remote(r)
        for key in list(self._regs):
            self.deregister(self._regs[key])
        log.info("nixl.agent.closed", agent=self.name)

    # -- diagnostics -----------------------------------------------------------------------------------

    def transport_info(
        self, remote_name: str, local_kind: MemKind | None = None, remote_kind: MemKind | None = None
    ) -> str | None:
        """Which UCX transport carried READs to ``remote_name``, when UCX was asked to say so.

        Source: the protocol tables UCX prints with ``UCX_PROTO_INFO=y`` (set before the first agent;
        UCX's log is then sent to a file we parse, ``UCX_LOG_FILE`` or ``$TMP/stageferry-ucx-<pid>.log``),
        e.g. ``remote memory read by ucp_get* ... from cuda/GPU0: 0..inf zero-copy cuda_ipc/cuda``. With
        only ``UCX_LOG_LEVEL=info`` the lane summary (``rma(...) am(...)``) is returned instead, which
        names the candidate transports but not the one chosen per size.
        Cannot tell: anything when neither is set (None; NIXL's own ``query_xfer_backend`` only says
        "UCX" and telemetry only times and bytes); per-peer detail when two peers share one UCX endpoint
        configuration (UCX prints a table once per configuration: the second peer gets the first's, marked
        "shared", as does a peer that came after one gone, a producer restarted); anything with
        ``UCX_PROTO_INFO=used`` (printed only when the agent is destroyed).
        Learned at a peer's first completed READ.  Seen on 2 x H200 (nixl-cu13 1.5.1, UCX 1.23.0):
        ``remote memory read by ucp_get*(multi) into cuda/GPU1 from cuda/dev[2]: 0..inf zero-copy
        cuda_ipc/cuda``; on CPU: ``... zero-copy cma/memory``.
        With both memory kinds given: what READs between those kinds used (a mixed payload's DRAM and
        VRAM regions take different transports); without: the first learned for the peer.
        """
        if local_kind is not None and remote_kind is not None:
            return self._transport.get((remote_name, f"{local_kind.value}<-{remote_kind.value}"))
        return next((v for (r, _), v in self._transport.items() if r == remote_name), None)

    # -- internals -------------------------------------------------------------------------------------

    def _own(self, handle: object) -> XferHandle:
        if not isinstance(handle, XferHandle):
            raise TypeError(f"not a transfer handle of this agent: {handle!r}")
        return handle

    def _fail(self, exc: Exception, what: str, remote: str) -> Exception:
        err = _translate(exc, what, agent=self.name, remote=remote)
        if isinstance(err, PeerDisconnectedError):
            self._dead.add(remote)  # never heals: caller removes it and re-adds from fresh metadata
            log.warning("nixl.remote.disconnected", agent=self.name, remote=remote, during=what)
        return err

    def _start(
        self,
        op: str,
        local: Sequence[Region],
        local_kind: MemKind,
        remote: Sequence[Region],
        remote_kind: MemKind,
        remote_name: str,
        notif: bytes,
    ) -> XferHandle:
        if len(local) != len(remote) or not local:
            raise ValueError("local and remote need the same, non-zero number of regions")
        nbytes = 0
        for lr, rr in zip(local, remote, strict=True):
            if lr[1] != rr[1]:
                raise ValueError(f"region lengths differ: local {lr[1]} vs remote {rr[1]}")
            nbytes += lr[1]
        route = f"{local_kind.value}<-{remote_kind.value}"
        key: tuple[object, ...] = ()
        if route in RECYCLED_ROUTES:  # a handle posted with a notification is reposted only with one
            key = (op, remote_name, route, tuple(local), tuple(remote), bool(notif))
            xh = self._idle.pop(key, None)
            if xh is not None:
                self.reposts += 1
                return self._post(xh, notif)
        with self._raising(f"start_{op.lower()}", remote_name):
            ld = self._agent.get_xfer_descs(list(local), local_kind.value)
            rd = self._agent.get_xfer_descs(list(remote), remote_kind.value)
            h = self._agent.initialize_xfer(op, ld, rd, remote_name, notif)
        return self._post(XferHandle(h, remote_name, nbytes, route, key), notif)

    def _post(self, xh: XferHandle, notif: bytes) -> XferHandle:
        self._handles[id(xh)] = xh
        xh.posted_ns = time.perf_counter_ns()
        try:
            with self._raising("post", xh.remote):
                state = _state(self._agent.transfer(xh._h, notif))
        except BaseException:
            self.release(xh)
            raise
        if state is XferState.ERR:
            self.release(xh)
            raise TransferError("posting the READ failed", agent=self.name, remote=xh.remote)
        return xh

    def _learn_transport(self, key: tuple[str, str]) -> None:
        """Parse what UCX logged since the last look; attribute the data-path tables to ``key``
        (remote agent, route)."""
        tries = self._transport_tries.get(key, 0)
        if self._ucx_log is None or tries >= 3:
            return
        self._transport_tries[key] = tries + 1
        text = self._ucx_log.read_new()
        tables = self._ucx_tables.setdefault(key[0], [])
        tables += own_tables(parse_ucx_log(text or ""), self.name)
        # READs of several routes run at once (a payload's VRAM and DRAM regions): each takes the tables
        # of its memory kinds; the others wait for their own route's first DONE.
        found = [t for t in tables if route_matches(t, key[1])]
        if found:
            tables[:] = [t for t in tables if t not in found]
            info = self._route_tables[key[1]] = "; ".join(found)
        else:
            earlier = self._route_tables.get(key[1])
            if earlier is None:
                return
            info = earlier + " (shared)"
        self._transport[key] = info
        log.info("nixl.transport", agent=self.name, remote=key[0], route=key[1], transport=info)
