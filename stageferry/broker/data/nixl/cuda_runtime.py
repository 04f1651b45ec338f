"""The CUDA runtime that torch loaded, called directly (ctypes) for the same-GPU copy's four calls.

Why (issue 39): the copy itself is 0.02–0.05 ms of GPU time on an H200, but queueing it through torch — a
stream context, two tensor views per region, ``copy_``, an event made and recorded — cost 0.11–0.16 ms of
host time in a connector's process (each of those calls measured 2–4× its cost in a plain process).  The
same copy as ``cudaMemcpyAsync`` + ``cudaEventRecord`` on a stream and events made once is a few
microseconds of host time.

The library is the ``libcudart`` torch itself mapped (found in ``/proc/self/maps`` once torch has
initialised CUDA), so the calls run in torch's own runtime and primary context; where there is none to
find (a torch with the runtime linked in statically, no CUDA), :meth:`CudaRuntime.loaded` returns None and
the same-GPU path maps no arena (its peers are READ).  Every call's status is checked: a failure is a
``RuntimeError`` naming the call and the runtime's message, which the same-GPU path turns into its
:class:`TransferError` (and the READ follows).

Contract for callers: pointers are device addresses valid in this process (our pool's slots, a mapped
CUDA IPC arena); bounds are the caller's (the same-GPU path checks every region against the arena and the
slot before it copies).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Any

#: cudaMemcpyDeviceToDevice (both pointers are device addresses: the runtime need not look their kinds
#: up), cudaStreamNonBlocking, cudaEventDisableTiming, cudaSuccess, cudaErrorNotReady.
MEMCPY_DEVICE_TO_DEVICE, STREAM_NON_BLOCKING, EVENT_DISABLE_TIMING = 3, 0x01, 0x02
SUCCESS, NOT_READY = 0, 600


def _mapped_cudart(maps: str = "/proc/self/maps") -> str | None:
    """The path of the ``libcudart.so*`` mapped into this process, None if there is none."""
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode[, path]
        if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcudart.so"):
            return fields[5]
    return None


class CudaRuntime:
    """The handful of runtime calls the same-GPU copy makes; one per process (:meth:`loaded`)."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self.path = path
        vp, size, i32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._set_device = self._fn(lib, "cudaSetDevice", i32)
        self._stream_create = self._fn(lib, "cudaStreamCreateWithFlags", ctypes.POINTER(vp), ctypes.c_uint)
        self._event_create = self._fn(lib, "cudaEventCreateWithFlags", ctypes.POINTER(vp), ctypes.c_uint)
        self._memcpy = self._fn(lib, "cudaMemcpyAsync", vp, vp, size, i32, vp)
        self._record = self._fn(lib, "cudaEventRecord", vp, vp)
        self._query = self._fn(lib, "cudaEventQuery", vp)
        self._sync = self._fn(lib, "cudaEventSynchronize", vp)
        self._stream_sync = self._fn(lib, "cudaStreamSynchronize", vp)
        self._last_error = self._fn(lib, "cudaGetLastError")
        self._error_string = lib.cudaGetErrorString
        self._error_string.argtypes, self._error_string.restype = [i32], ctypes.c_char_p

    @staticmethod
    def _fn(lib: ctypes.CDLL, name: str, *argtypes: object) -> Any:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        return fn

    @classmethod
    def loaded(cls) -> CudaRuntime | None:
        """The runtime torch mapped into this process, or None (none yet: asked again next time, so a
        call before torch has initialised CUDA does not settle it)."""
        global _loaded
        if _loaded is not None:
            return _loaded
        path = _mapped_cudart()
        if path is None:
            return None
        try:
            _loaded = cls(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW), path)
        except (OSError, AttributeError):  # not loadable after all, or a runtime without these symbols
            return None
        return _loaded

    def _check(self, status: int, call: str) -> None:
        if status != SUCCESS:
            # The runtime keeps a failed call's status as the thread's last error, and torch raises whatever
            # it finds there after its next kernel: cleared here, so a refused copy cannot fail the model.
            self._last_error()
            message = (self._error_string(status) or b"?").decode(errors="replace")
            raise RuntimeError(f"{call} failed: {message} (cudaError {status})")

    def set_device(self, index: int) -> None:
        """Make ``index`` this thread's device (what torch's device context does; cheap when it is already)."""
        self._check(self._set_device(index), "cudaSetDevice")

    def stream(self) -> int:
        """A new stream that does not synchronise with the legacy default stream."""
        handle = ctypes.c_void_p()
        self._check(self._stream_create(ctypes.byref(handle), STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        return handle.value or 0

    def event(self) -> int:
        """A new event without timing (the cheapest to record and query)."""
        handle = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(handle), EVENT_DISABLE_TIMING), "cudaEventCreateWithFlags")
        return handle.value or 0

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Queue a copy of ``nbytes`` from device address ``src`` to ``dst`` on ``stream``."""
        self._check(self._memcpy(dst, src, nbytes, MEMCPY_DEVICE_TO_DEVICE, stream), "cudaMemcpyAsync")

    def record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cudaEventRecord")

    def done(self, event: int) -> bool:
        """Whether the work before ``event`` has finished (``cudaEventQuery``: ready, or not yet)."""
        status = self._query(event)
        if status == NOT_READY:
            self._last_error()  # not an error, but kept as the last one all the same (torch clears it too)
            return False
        self._check(status, "cudaEventQuery")
        return True

    def synchronize(self, event: int) -> None:
        """Block this thread until the work before ``event`` has finished."""
        self._check(self._sync(event), "cudaEventSynchronize")

    def synchronize_stream(self, stream: int) -> None:
        """Block this thread until everything queued on ``stream`` has finished."""
        self._check(self._stream_sync(stream), "cudaStreamSynchronize")


_loaded: CudaRuntime | None = None


class RuntimeCopy:
    """One launched copy's completion, as ``torch.cuda.Event`` offers it (``query``, ``synchronize``); its
    event goes back to its pool once seen done."""

    __slots__ = ("_event", "_pool", "_returned")

    def __init__(self, event: int, pool: EventPool) -> None:
        self._event, self._pool, self._returned = event, pool, False

    def query(self) -> bool:
        if self._returned:
            return True
        if not self._pool.runtime.done(self._event):
            return False
        self._give_back()
        return True

    def synchronize(self) -> None:
        if not self._returned:
            self._pool.runtime.synchronize(self._event)
            self._give_back()

    def _give_back(self) -> None:
        # once only, though a cancelled wait's worker thread and the loop may both see it done
        self._pool.put_once(self)


class EventPool:
    """Events made once and reused: one per copy in flight (a copy's event comes back when it is done)."""

    def __init__(self, runtime: CudaRuntime) -> None:
        self.runtime = runtime
        self._free: list[int] = []
        self._lock = threading.Lock()  # a cancelled wait gives its event back from a worker thread

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self.runtime.event()

    def put(self, event: int) -> None:
        with self._lock:
            self._free.append(event)

    def put_once(self, copy: RuntimeCopy) -> None:
        """Take ``copy``'s event back unless it was already."""
        with self._lock:
            if not copy._returned:
                copy._returned = True
                self._free.append(copy._event)
