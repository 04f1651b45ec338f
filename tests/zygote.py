"""Stage processes for tests, forked from a process that imported the stage's stack once.

A test's ``stageferry serve`` process spends about 3.4 of its 4.4 s of CPU before it is live importing
torch and the stage's code (the 2-core CI box; ~300 such processes in the suite).  :class:`Zygote` is a
process per test worker that has imported them (:data:`PRELOAD`; nothing configured, no thread of ours,
NIXL not loaded) and forks a child per :meth:`Zygote.spawn`.  The child becomes what ``python -m
<module> <args>`` would be — the given environment and working directory (one whose ``PYTHONPATH`` the
zygote lacks is exec'd instead: a ``sitecustomize`` there runs only at start-up), stdin ``/dev/null``,
stdout and stderr into the log file, default signal dispositions — and runs the module as ``__main__``
(:func:`runpy.run_module`, as ``-m`` does).  Only the exec and the imports are skipped: what
the process does then runs as in production, where ``serve`` is exec'd (a group's ranks still are, by
their supervisor; the CLI's and launcher's tests exec the command).

Protocol (JSON lines, nothing pickled): the test process writes ``{"id", "module", "argv", "env", "cwd",
"log"}`` to the zygote's stdin; the zygote answers ``{"id", "pid"}`` (or ``{"id", "error"}``) and, when a
child ends, ``{"exit": pid, "code": c}`` (``-signal`` as :class:`subprocess.Popen` says it) on its stdout.
When its stdin closes (the test worker ended), it SIGKILLs the children still running and exits.

``STAGEFERRY_TEST_ZYGOTE=0`` turns it off (every service is exec'd, as before).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: What the zygote imports before it forks: what a stage process spends its start on.
PRELOAD = ("torch", "stageferry.cli", "stageferry.stages.process.service")
#: Modules that read the environment when imported: imported again in each child, after its environment.
REIMPORT = ("stageferry.failpoints",)


#: The zygote's own ``PYTHONPATH``: the repository, then the caller's (a device machine's carried wheels).
PYTHONPATH = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def enabled() -> bool:
    return os.environ.get("STAGEFERRY_TEST_ZYGOTE", "1") != "0"


def forkable(env: dict[str, str]) -> bool:
    """Whether a child with ``env`` can be forked: every ``PYTHONPATH`` entry is one the zygote started with.
    Another directory may carry a ``sitecustomize`` (the pickle tripwire's), which only an interpreter's
    start-up runs: such a child is exec'd."""
    ours = set(PYTHONPATH.split(os.pathsep))
    return all(not p or p in ours for p in env.get("PYTHONPATH", "").split(os.pathsep))


def start(module: str, argv: list[str], *, env: dict[str, str], cwd: Path, log: Path, fresh: bool = False) -> Proc:
    """``python -m <module> <argv>``, its output appended to ``log``: forked from this worker's zygote, or
    exec'd with ``fresh`` (a test of what the process imports), with a ``PYTHONPATH`` the zygote does not
    have (:func:`forkable`) or with ``STAGEFERRY_TEST_ZYGOTE=0``."""
    if enabled() and not fresh and forkable(env):
        return zygote().spawn(module, argv, env=env, cwd=cwd, log=log)
    with open(log, "ab") as out:  # O_APPEND: a group's ranks share it
        return subprocess.Popen(
            [sys.executable, "-m", module, *argv], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd
        )


class ForkedProcess:
    """What a test uses of :class:`subprocess.Popen` (pid, poll, wait, signals) for a zygote's child."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.code(self.pid, wait=True, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The test process's side: starts the zygote once, asks it for children, learns their exit codes."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=ROOT,
        )
        self._lock = threading.Lock()  # one request at a time
        self._changed = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self._exits: dict[int, int] = {}
        self._next = 0
        self._closed = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:  # only the zygote writes here; nothing else is expected
                continue
            with self._changed:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies[message["id"]] = message
                self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def spawn(self, module: str, argv: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        """A child running ``python -m <module> <argv>`` (see the module docstring)."""
        assert self._proc.stdin is not None
        with self._lock:
            self._next += 1
            ident = self._next
            request = {"id": ident, "module": module, "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)}
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            with self._changed:
                if not self._changed.wait_for(lambda: ident in self._replies or self._closed, timeout=60):
                    raise TimeoutError("the test zygote did not answer")
                reply = self._replies.pop(ident, None)
        if reply is None or "error" in reply:
            raise RuntimeError(f"the test zygote could not start {argv}: {reply}")
        return ForkedProcess(self, reply["pid"], [sys.executable, "-m", module, *argv])

    def code(self, pid: int, *, wait: bool = False, timeout: float | None = None) -> int | None:
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._exits or self._closed, timeout=timeout)
            return self._exits.get(pid)

    def close(self) -> None:
        """Stop the zygote; it kills the children still running."""
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=30)


Proc = subprocess.Popen[bytes] | ForkedProcess
"""A started process: exec'd, or forked from the zygote."""

_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def zygote() -> Zygote:
    """This test worker's zygote, started on first use and stopped at exit."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        return _zygote


# --- the zygote process -------------------------------------------------------------------------------


def _child(request: dict[str, Any], keep: tuple[int, ...]) -> None:
    """In the forked child: become ``python -m <module> <argv>`` and run it; never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        for fd in (devnull, log, *keep):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path.insert(0, request["cwd"])  # as `python -m` does (its PYTHONPATH is ours: forkable)
        for name in REIMPORT:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
        sys.argv = [request["module"], *request["argv"]]  # run_module puts the module's file first
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        # what interpreter shutdown does in a process of its own: join the threads, run the atexit handlers,
        # flush the streams (below)
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a child must never return into the zygote's loop
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    """The zygote's loop: fork a child per request, report each child's end (module docstring)."""
    commands, replies = os.dup(0), os.dup(1)  # never the sys streams: a child flushes those
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # whatever an import prints goes to stderr, not into the replies
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: set[int] = set()
    buffered = b""

    def send(message: dict[str, Any]) -> None:
        os.write(replies, json.dumps(message).encode() + b"\n")

    def reap() -> None:
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            children.discard(pid)
            send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    while True:
        with contextlib.suppress(InterruptedError):
            ready, _, _ = select.select([commands, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        reap()
        if commands not in ready:
            continue
        chunk = os.read(commands, 65536)
        if not chunk:
            break
        buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            try:
                pid = os.fork()
            except OSError as exc:
                send({"id": request["id"], "error": str(exc)})
                continue
            if pid == 0:
                _child(request, keep=(commands, replies, wake_r, wake_w))
            children.add(pid)
            send({"id": request["id"], "pid": pid})
    for pid in list(children):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for pid in list(children):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


if __name__ == "__main__":
    serve()
