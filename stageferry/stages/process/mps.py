"""CUDA MPS for the stages that ``stageferry up`` places on one GPU (issue 39, item 2).

Two processes on one GPU without MPS take turns on it: each switch from the producer's context to the
consumer's costs 0.13-0.18 ms on an H100 or H200, so the same-GPU copy of a 1-65 MB payload takes
0.17-0.23 ms against 0.03-0.08 ms for the copy itself.  Under MPS the contexts share the GPU and the copy
takes 0.05-0.08 ms, within 2x of the device copy (``benchmarks/results/issue39/h100/round12``).  The
planner shares a GPU whenever the host has fewer GPUs than the stages' ranks (``placement.py``: the
built-in default on a 1-GPU host puts both stages on GPU 0), so ``up`` starts MPS for exactly that case:

* ``auto`` (the default): a private control daemon when the plan shares a GPU, ``nvidia-cuda-mps-control``
  is on ``PATH`` and the environment does not already name one (``CUDA_MPS_PIPE_DIRECTORY``: an operator's
  own MPS is left to them); otherwise nothing, and why is said once;
* ``on``: the same, but a plan that shares no GPU still gets it, and a missing binary is a
  :class:`~stageferry.errors.ConfigError`;
* ``off``: never.

The daemon is private: it runs in the foreground (``-f``) as ``up``'s child, with its own pipe and log
directories under a temporary directory (what it and its servers print goes to ``mps-control.txt`` beside
the stages' logs, not to ``up``'s terminal), and only the stage processes ``up`` starts get that pipe
directory in their environment; no other CUDA program on the host is moved onto it.  CUDA's documented
behaviour covers a daemon that died: a client that cannot reach it runs without MPS.  On the way out
the daemon is asked to ``quit`` (after the stages stopped), stopped if it has not within a bound, and
its directories removed.  ``serve`` (compose, Kubernetes) never starts one: there MPS is the host's or
the cluster's (the NVIDIA device plugin's MPS sharing), see docs/data-plane.md.
"""

from __future__ import annotations

import contextlib
import enum
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio
import anyio.abc
import structlog

from stageferry.errors import ConfigError
from stageferry.procs import astop

log = structlog.get_logger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
#: How long the daemon may take to open its control pipe, and to leave once asked to quit.
START_S, QUIT_S = 10.0, 10.0


class MpsMode(enum.StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True)
class MpsDecision:
    """Whether ``up`` starts a private MPS daemon, and the reason it prints."""

    start: bool
    reason: str


def decide(mode: MpsMode, shared: Mapping[int, tuple[str, ...]], env: Mapping[str, str]) -> MpsDecision:
    """What :class:`MpsMode` ``mode`` means for a plan whose shared GPUs are ``shared`` (GPU → ranks)."""
    if mode is MpsMode.OFF:
        return MpsDecision(False, "off (--mps off)")
    if env.get(PIPE_ENV):
        return MpsDecision(False, f"the environment's own ({PIPE_ENV}={env[PIPE_ENV]})")
    if not shared and mode is MpsMode.AUTO:
        return MpsDecision(False, "not needed (no GPU runs ranks of two stages)")
    if shutil.which(CONTROL, path=env.get("PATH")) is None:
        if mode is MpsMode.ON:
            raise ConfigError(f"--mps on, but no {CONTROL} on PATH: install the NVIDIA driver's utilities")
        return MpsDecision(False, f"not started: no {CONTROL} on PATH (the same-GPU copy waits on context switches)")
    gpus = ", ".join(f"GPU {gpu} ({' + '.join(ranks)})" for gpu, ranks in sorted(shared.items()))
    return MpsDecision(True, f"private control daemon for {gpus or 'the stages'}")


class MpsDaemon:
    """A private ``nvidia-cuda-mps-control -f`` for the lifetime of an ``async with`` (module docstring);
    :attr:`env` is what the stage processes need to reach it."""

    def __init__(self, env: Mapping[str, str], log_file: Path | None = None) -> None:
        self._env = dict(env)
        self._log_file = log_file  # what the daemon and its servers print (None: inherited)
        self._dir: Path | None = None
        self._proc: anyio.abc.Process | None = None
        self.env: dict[str, str] = {}

    @property
    def process(self) -> anyio.abc.Process | None:
        """The daemon's process, once started."""
        return self._proc

    async def __aenter__(self) -> MpsDaemon:
        # a short path: the pipes are UNIX sockets, whose paths are limited to about 100 bytes
        self._dir = Path(tempfile.mkdtemp(prefix="sf-mps-", dir="/tmp"))
        pipe, logs = self._dir / "pipe", self._dir / "log"
        pipe.mkdir()
        logs.mkdir()
        self.env = {PIPE_ENV: str(pipe), LOG_ENV: str(logs)}
        self._env.update(self.env)  # the daemon's and its control client's environment
        try:
            with contextlib.ExitStack() as files:
                out = None
                if self._log_file is not None:
                    self._log_file.parent.mkdir(parents=True, exist_ok=True)
                    out = files.enter_context(self._log_file.open("ab"))
                self._proc = await anyio.open_process(
                    # stdin closed: a control binary that took -f for its client mode would read EOF and leave
                    [CONTROL, "-f"],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    env=self._env,
                    start_new_session=True,
                )
            await self._wait_for_pipe(pipe / "control")
        except BaseException:
            await self._stop()
            raise
        log.info("mps.started", pipe=str(pipe), pid=self._proc.pid)
        return self

    async def _wait_for_pipe(self, control: Path) -> None:
        assert self._proc is not None
        with anyio.move_on_after(START_S):
            while not await anyio.Path(control).exists():
                if self._proc.returncode is not None:
                    raise ConfigError(f"{CONTROL} -f exited {self._proc.returncode} before opening {control}")
                await anyio.sleep(0.02)
            return
        raise ConfigError(f"{CONTROL} -f opened no {control} within {START_S:.0f} s")

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    async def _stop(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self._proc is not None and self._proc.returncode is None:
                    try:
                        await self._quit(self._proc)
                    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                        # no control client (gone from PATH, a closed pipe): the daemon is stopped below
                        log.warning("mps.quit_failed", error=f"{type(exc).__name__}: {exc}")
                    await astop([self._proc], grace_s=2.0, group=True)
            finally:
                if self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                    self._dir = None

    async def _quit(self, daemon: anyio.abc.Process) -> None:
        """Ask the daemon to ``quit`` through its control pipe and wait for it to leave (bounded)."""
        control = await anyio.open_process([CONTROL], stdin=subprocess.PIPE, env=self._env, start_new_session=True)
        with anyio.move_on_after(QUIT_S):
            assert control.stdin is not None
            await control.stdin.send(b"quit\n")
            await control.stdin.aclose()
            await control.wait()
            await daemon.wait()
        if daemon.returncode is None:
            log.warning("mps.quit_timed_out", pid=daemon.pid)
        await astop([control], grace_s=0.5)


async def start_mps(
    stack: contextlib.AsyncExitStack,
    mode: MpsMode,
    decision: MpsDecision,
    env: Mapping[str, str],
    log_file: Path | None = None,
) -> tuple[MpsDecision, dict[str, str]]:
    """Start the daemon ``decision`` asks for, kept until ``stack`` closes, its output in ``log_file``; what
    happened and the variables the stages get.  A daemon that fails to start is a :class:`ConfigError`
    under ``--mps on``; under ``auto`` the stages run without it and the reason says why."""
    if not decision.start:
        return decision, {}
    try:
        daemon = await stack.enter_async_context(MpsDaemon(env, log_file))
    except ConfigError as exc:
        if mode is MpsMode.ON:
            raise
        return MpsDecision(False, f"not started: {exc.message}"), {}
    return decision, dict(daemon.env)


__all__ = ["CONTROL", "MpsDaemon", "MpsDecision", "MpsMode", "decide", "start_mps"]
