"""Loading nixl and making its native agent: the part of the NIXL boundary
(:mod:`~stageferry.broker.data.nixl.agent`) that runs once per process.

nixl is imported lazily, once UCX's environment is set
(:func:`~stageferry.broker.data.nixl.ucx_log.configure_environment`: UCX reads it when its library loads);
the native agent gets a progress-thread delay nixl's Python API does not expose, and is made again when
its backend failed while being built.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from stageferry.broker.data.nixl.ucx_log import configure_environment
from stageferry.errors import NixlUnavailableError
from stageferry.logs import adopt_library_logger

log = structlog.get_logger(__name__)

_nixl_api: Any = None  # nixl._api, once imported
_nixl_bind: Any = None  # nixl._bindings (exception classes)
ucx_log_path: Path | None = None  #: where UCX writes its log, when it can be read (the agent's transport_info)


def _import_nixl() -> tuple[Any, Any]:
    """Import nixl once; UCX reads its environment when the library loads, so set it first."""
    global _nixl_api, _nixl_bind, ucx_log_path
    if _nixl_api is not None:
        return _nixl_api, _nixl_bind
    ucx_log_path = configure_environment(cuda=torch.cuda.is_available())
    try:
        import nixl  # noqa: F401  (selects the CUDA-matching backend package)
        from nixl import _api, _bindings
    except Exception as exc:  # ImportError, OSError from missing shared libraries, ...
        raise NixlUnavailableError(f"cannot import nixl: {exc}") from exc
    adopt_library_logger("nixl")  # nixl gave itself a stdout handler on import: its lines go through ours
    _nixl_api, _nixl_bind = _api, _bindings
    return _api, _bindings


#: Tries at creating the native agent.  UCX makes an endpoint to itself while the agent is built, over
#: every network device it found a moment before; one deleted meanwhile (a veth torn down by another
#: process) fails it: NIXL_ERR_BACKEND, "Destination is unreachable".  The next try sees the devices as
#: they are now; without it the process ran inline only for its whole life.
CREATE_TRIES = 3

PROGRESS_DELAY_US = 1000
"""Longest the NIXL progress thread sleeps in ``poll()`` between looks when no UCX event wakes it.

nixl's Python API hard-codes 0, which makes the thread spin on ``poll(..., 0)``: about 85% of a core per
process while idle, stolen from the event loop, torch and the peer on a small host (measured on the 2-core
CPU box: T2VA hop 5.5 ms -> 2.1 ms p50 with 1000).  The thread still wakes at once on UCX's event fd
(incoming notifications, completions); the delay only bounds a missed wake-up (nixl rounds it up to ms).
"""
_config_lock = threading.Lock()


@contextlib.contextmanager
def _progress_thread_delay(api: Any, delay_us: int) -> Iterator[None]:
    """Make the next ``nixl_agent`` get ``delay_us`` as its progress-thread delay.

    ``nixl_agent.__init__`` sets ``pthrDelay = 0`` on its config right before building the native agent,
    so the value is applied in a wrapper around the bindings' constructor, for this one call only.  If the
    bindings change shape, the agent is built with nixl's own default instead.
    """
    bind: Any = getattr(api, "nixlBind", None)
    real: Any = getattr(bind, "nixlAgent", None)
    if real is None or delay_us <= 0:
        yield
        return

    def make(name: str, config: Any) -> Any:
        if hasattr(config, "pthrDelay"):
            config.pthrDelay = delay_us
        return real(name, config)

    with _config_lock:
        bind.nixlAgent = make
        try:
            yield
        finally:
            bind.nixlAgent = real


def make_agent(name: str, backends: Sequence[str], progress_delay_us: int, ucx_threads: int) -> tuple[Any, Any]:
    """nixl's agent ``name`` and its bindings (for their exception classes), :data:`CREATE_TRIES` tries;
    :class:`NixlUnavailableError` when nixl cannot be imported or the last try failed."""
    api, bind = _import_nixl()
    for tried in range(1, CREATE_TRIES + 1):
        try:
            with _progress_thread_delay(api, progress_delay_us):
                config = api.nixl_agent_config(backends=list(backends), num_threads=ucx_threads)
                return api.nixl_agent(name, config), bind
        except Exception as exc:
            if tried == CREATE_TRIES:
                raise NixlUnavailableError(f"cannot create NIXL agent {name!r}: {exc}", agent=name) from exc
            log.warning("nixl.agent_retry", agent=name, tried=tried, error=f"{type(exc).__name__}: {exc}")
    raise AssertionError("unreachable")  # the loop returns or raises
