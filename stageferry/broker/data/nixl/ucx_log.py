"""What UCX says about the transport it picked, read back from its own log.

Silently falling back to TCP is the most common NIXL performance complaint, and neither NIXL's API nor
its telemetry names the UCX transport.  UCX prints it, though: with ``UCX_PROTO_INFO=y`` it writes one
protocol table per endpoint configuration (``remote memory read by ucp_get* ... zero-copy cma/memory``),
with ``UCX_LOG_LEVEL=info`` a lane summary.  This module points UCX's log at a per-process file before the
library loads (:func:`configure_environment`), reads what was appended since the last look
(:class:`UcxLogTail`), condenses the tables into short strings (:func:`parse_ucx_log`) and sorts them to
the agent (:func:`own_tables`) and route (:func:`route_matches`) they describe.

Who calls: :mod:`stageferry.broker.data.nixl.agent` only — ``configure_environment`` once, before
``import nixl``; a tail per agent, read at a peer's first completed READ.  Nothing here touches NIXL.

The file is ours to clean up when we chose it (``$TMP/stageferry-ucx-<pid>.log``): UCX opens it when its
library loads and keeps writing to it, so the first tail opens it too and unlinks the name at once; every
tail in the process then reads that one descriptor.  A process that exits or is killed leaves no file
behind (before, each agent process left one, up to 1.4 MB, in ``$TMP``).  An operator's ``UCX_LOG_FILE``
is read the same way and never removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import tempfile
import threading
from pathlib import Path

_OFF = {"", "n", "no", "0", "off"}
_LOG_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s*")
_LANES = re.compile(r"UCX\s+INFO\s+(\S+ (?:self|intra-node|inter-node) cfg#\d+ .*\(.*)$")


def configure_environment(*, cuda: bool = False) -> Path | None:
    """Set UCX's environment before its library loads; returns the log file UCX will write, if any.

    Sets ``UCX_RCACHE_MAX_UNRELEASED`` (a known registration-cache leak) and, unless told otherwise,
    ``UCX_PROTO_INFO=y`` with ``UCX_LOG_FILE`` pointing at ``$TMP/stageferry-ucx-%p.log`` (UCX replaces
    ``%p`` with the pid, so child processes inheriting the variable get files of their own).  Set
    ``UCX_PROTO_INFO=n`` to turn it off; a ``UCX_LOG_FILE`` given by the operator is kept and read.

    With ``cuda`` (this process sees a GPU), also ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` unless set: the data
    plane READs (a GET), and UCX's ``auto`` turns cuda_ipc GETs off where it finds no NVLink (one GPU,
    PCIe-only hosts), so a READ between two processes on the same GPU went over TCP emulation (``software
    emulation tcp/lo``; 0.83 ms for 359 KB on a one-GPU H200 host, ``benchmarks/results/issue20_r5/``).
    With it, cuda_ipc carries such READs.  Without a GPU it is left out (UCX would warn that it is unused).
    """
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    if cuda:
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    proto_info = os.environ.get("UCX_PROTO_INFO", "n").lower()
    info_level = os.environ.get("UCX_LOG_LEVEL", "").lower() in {"info", "debug", "trace"}
    if (proto_info not in _OFF or info_level) and "UCX_LOG_FILE" not in os.environ:
        os.environ["UCX_LOG_FILE"] = str(Path(tempfile.gettempdir()) / _OWN_LOG)
    if "UCX_LOG_FILE" not in os.environ:
        return None
    raw = os.environ["UCX_LOG_FILE"].replace("%p", str(os.getpid())).replace("%h", socket.gethostname())
    return Path(raw)


_OWN_LOG = "stageferry-ucx-%p.log"  #: the log file :func:`configure_environment` names when none is set
_open_logs: dict[Path, int] = {}  # path -> the descriptor every tail of this process reads
_open_lock = threading.Lock()


def _own_log_path() -> Path:
    return Path(tempfile.gettempdir()) / _OWN_LOG.replace("%p", str(os.getpid()))


def _log_fd(path: Path) -> int | None:
    """This process's descriptor of UCX's log ``path``, opened once (None while it cannot be); the name is
    unlinked right after when the file is the one we chose for UCX (UCX writes on through its own)."""
    with _open_lock:
        fd = _open_logs.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
            _open_logs[path] = fd
            if path == _own_log_path():
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return fd


class UcxLogTail:
    """Reads what UCX appended to its log since the previous read (one per agent; not thread-safe)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        _log_fd(path)  # UCX made the file when its library loaded: opened (and our own unlinked) now

    def read_new(self) -> str | None:
        """The text appended since the last call; None if the file cannot be read (yet)."""
        _flush_c_stdio()  # UCX writes its log through a fully buffered FILE*
        fd = _log_fd(self.path)
        if fd is None:
            return None
        chunks = []
        try:
            while chunk := os.pread(fd, 1 << 16, self._offset):
                chunks.append(chunk)
                self._offset += len(chunk)
        except OSError:
            return None
        return b"".join(chunks).decode(errors="replace")


def _flush_c_stdio() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)  # fflush(NULL): every C stdio output stream of this process


def parse_ucx_log(text: str) -> list[str]:
    """Data-path ('remote memory ...') protocol tables, else INFO lane summaries, as short strings."""
    tables: list[str] = []
    lanes: list[str] = []
    title: list[str] = []
    rows: list[list[str]] = []
    in_rows = False

    def finish() -> None:
        if in_rows and any("remote memory" in t for t in title):
            parts = [f"{r[-3]} {r[-2]} {r[-1]}".strip() for r in rows]
            tables.append(f"{' '.join(title)}: {', '.join(parts)}")

    for line in text.splitlines():
        m = _LANES.search(line)
        if m:
            lanes.append(" ".join(m.group(1).split()))
            continue
        s = _LOG_PREFIX.sub("", line).strip()
        if not s.startswith("|"):
            continue
        cells = [c.strip() for c in s.strip("|").split("|")]
        if len(cells) == 1:  # a title line: starts a new table when rows were being read
            if in_rows:
                finish()
                in_rows, title, rows = False, [], []
            title.append(cells[0])
        elif "Range" in cells and "Config" in cells:
            in_rows = True
        elif in_rows and len(cells) >= 3:
            if not cells[-3] and rows:  # continuation of a multi-line config cell
                rows[-1][-1] += " " + cells[-1]
            else:
                rows.append(cells)
    finish()
    # Loopback ("self") configurations are the agent talking to itself; READ tables are our data path.
    tables = list(dict.fromkeys(t for t in tables if " self cfg#" not in t))
    lanes = list(dict.fromkeys(t for t in lanes if " self cfg#" not in t))
    reads = [t for t in tables if "remote memory read" in t]
    return reads or tables or lanes


def transport_names(info: str | None) -> list[str]:
    """The UCX transports named in :func:`parse_ucx_log`'s strings (as ``NixlAgent.transport_info``
    joins them with ``"; "``), in order: ``"... 0..inf zero-copy cuda_ipc/cuda"`` → ``["cuda_ipc"]``;
    ``[]`` when it names none (lane summaries, None)."""
    names: list[str] = []
    for table in (info or "").split("; "):
        _, sep, ranges = table.removesuffix(" (shared)").rpartition(": ")
        if not sep:
            continue
        for part in ranges.split(", "):
            last = part.split()[-1] if part.split() else ""
            if "/" in last:
                names.append(last.split("/", 1)[0])
    return list(dict.fromkeys(names))


def own_tables(tables: list[str], agent: str) -> list[str]:
    """The tables UCX printed for ``agent``'s own worker: a table's title starts with its worker's name,
    which is the NIXL agent's; one process's log also holds the tables of its other agents (a test's or
    a benchmark's earlier ones).  Tables naming no agent of ours are kept when none names this one."""
    own = [t for t in tables if t.split(" ", 1)[0] == agent]
    return own or tables


def route_matches(table: str, route: str) -> bool:
    """Whether a :func:`parse_ucx_log` string can describe READs of ``route`` (``"VRAM<-DRAM"``): a
    data-path table names GPU memory (``cuda/GPU1``) exactly when one side of the route is VRAM; lane
    summaries name no memory and match any route."""
    title = table.rpartition(": ")[0]
    if "remote memory" not in title:
        return True
    return ("cuda" in title) == ("VRAM" in route)
