"""stageferry.procs: SIGTERM, a bounded wait, SIGKILL what is left — on real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from stageferry.procs import astop, send, stop

# Each child prints "ready" once its SIGTERM handling is in place, so no signal arrives before it.
OBEYS = "import time; print('ready', flush=True); time.sleep(120)"
IGNORES = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
)
NOTES_TERM = (
    "import signal, sys, time\n"
    "def on_term(*_):\n"
    "    open(sys.argv[1], 'w').write('term')\n"
    "    sys.exit(3)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)
# A session leader that ignores SIGTERM and starts a grandchild that ignores it too; prints the grandchild's pid.
LEADER = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    f"child = subprocess.Popen([sys.executable, '-c', {IGNORES!r}], stdout=subprocess.PIPE)\n"
    "child.stdout.readline()\n"
    "print('ready', child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def _spawn(code: str, *args: str, session: bool = False) -> subprocess.Popen[bytes]:
    return _spawn_told(code, *args, session=session)[0]


def _spawn_told(code: str, *args: str, session: bool = False) -> tuple[subprocess.Popen[bytes], list[bytes]]:
    """The started child, once it is ready, and the words of its "ready" line."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, start_new_session=session)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().split()


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return not _alive(pid)


def test_a_process_that_obeys_sigterm_is_not_killed() -> None:
    proc = _spawn(OBEYS)
    (stopped,) = stop([proc], grace_s=30)
    assert stopped.pid == proc.pid
    assert stopped.returncode == -signal.SIGTERM
    assert not stopped.killed


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    proc = _spawn(IGNORES)
    started = time.monotonic()
    (stopped,) = stop([proc], grace_s=0.5)
    assert stopped.killed
    assert stopped.returncode == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5  # it had its grace first


def test_grace_zero_kills_without_sigterm(tmp_path: Path) -> None:
    note = tmp_path / "note"
    proc = _spawn(NOTES_TERM, str(note))
    (stopped,) = stop([proc], grace_s=0)
    assert stopped.killed and stopped.returncode == -signal.SIGKILL
    assert not note.exists()  # no SIGTERM was sent


def test_many_share_one_grace_and_an_exited_one_keeps_its_code(tmp_path: Path) -> None:
    done = subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"])
    done.wait()
    note = tmp_path / "note"
    procs = [done, _spawn(NOTES_TERM, str(note)), _spawn(IGNORES)]
    stopped = stop(procs, grace_s=5)  # one grace for all three; 1 s was sometimes too short for a loaded box
    assert [s.pid for s in stopped] == [p.pid for p in procs]
    assert [(s.returncode, s.killed) for s in stopped] == [(7, False), (3, False), (-signal.SIGKILL, True)]
    assert note.read_text() == "term"


def test_group_kills_the_grandchildren_too() -> None:
    leader, told = _spawn_told(LEADER, session=True)
    grandchild = int(told[1])
    (stopped,) = stop([leader], grace_s=0.3, group=True, term_group=False)
    assert stopped.killed and stopped.returncode == -signal.SIGKILL
    assert _gone_within(grandchild, 10)


def test_without_group_only_the_leader_is_stopped() -> None:
    leader, told = _spawn_told(LEADER, session=True)
    grandchild = int(told[1])
    try:
        (stopped,) = stop([leader], grace_s=0)
        assert stopped.returncode == -signal.SIGKILL
        assert _alive(grandchild)
    finally:
        send(grandchild, signal.SIGKILL)


def test_send_to_a_process_that_is_gone_is_false() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not send(proc.pid, signal.SIGTERM)


@pytest.mark.anyio
async def test_astop_terms_then_kills_anyio_processes(tmp_path: Path) -> None:
    note = tmp_path / "note"
    obeys = await anyio.open_process([sys.executable, "-c", NOTES_TERM, str(note)])
    ignores = await anyio.open_process([sys.executable, "-c", IGNORES])
    for proc in (obeys, ignores):
        assert proc.stdout is not None
        assert (await proc.stdout.receive()).startswith(b"ready")
    # Apart: a grace long enough for a loaded box to run the handler (astop returns once it exited), and a
    # short one for the process that waits it out (one grace of 1 s for both was sometimes too short).
    stopped = await astop([obeys], grace_s=60) + await astop([ignores], grace_s=0.5)
    assert [(s.returncode, s.killed) for s in stopped] == [(3, False), (-signal.SIGKILL, True)]
    assert note.read_text() == "term"
    for proc in (obeys, ignores):
        await proc.aclose()


@pytest.mark.anyio
async def test_astop_is_not_cut_short_by_cancellation() -> None:
    proc = await anyio.open_process([sys.executable, "-c", IGNORES], start_new_session=True)
    assert proc.stdout is not None
    assert (await proc.stdout.receive()).startswith(b"ready")
    with anyio.CancelScope() as scope:
        scope.cancel()
        stopped = await astop([proc], grace_s=0.3, group=True)
    assert stopped[0].killed and stopped[0].returncode == -signal.SIGKILL
    await proc.aclose()
