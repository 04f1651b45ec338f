"""A stand-in for ``nvidia-cuda-mps-control`` on a box without the NVIDIA driver (CI): the control protocol
``stageferry up`` relies on, nothing of MPS itself (the real daemon runs on the device machine:
``benchmarks/issue39_device.sh up_gpu``).

``install(directory, record)`` writes an executable ``nvidia-cuda-mps-control`` there.  Run with ``-f`` it
listens on ``$CUDA_MPS_PIPE_DIRECTORY/control`` (a UNIX socket, as the real one) and appends ``started``
to ``record``; run with no argument it sends its stdin to that socket, as the real one does.  The daemon
appends each command it receives and leaves on ``quit``.  ``FAKE_MPS_EXIT=N`` makes ``-f`` exit N at once;
``FAKE_MPS_DEAF=1`` makes it ignore ``quit``; ``FAKE_MPS_HOLD=1`` keeps it from ever opening its control
pipe (``up`` waits for it) until it is stopped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_SCRIPT = r"""
import os, socket, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
record = os.environ["FAKE_MPS_RECORD"]
def note(line):
    with open(record, "a") as f:
        f.write(line + "\n")
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_EXIT"):
        sys.exit(int(os.environ["FAKE_MPS_EXIT"]))
    server = socket.socket(socket.AF_UNIX)
    server.bind(os.path.join(pipe, "control.new"))
    server.listen()
    note("started " + pipe)
    print("fake mps control: listening on " + pipe, flush=True)  # as the real one logs in the foreground
    if os.environ.get("FAKE_MPS_HOLD"):  # never ready: blocks until it is stopped
        import threading; threading.Event().wait()
    os.rename(os.path.join(pipe, "control.new"), os.path.join(pipe, "control"))  # ready once it is there
    while True:
        conn, _ = server.accept()
        command = conn.recv(1024).decode().strip()
        conn.close()
        note(command)
        if command == "quit" and not os.environ.get("FAKE_MPS_DEAF"):
            sys.exit(0)
else:
    client = socket.socket(socket.AF_UNIX)
    client.connect(os.path.join(pipe, "control"))
    client.sendall(sys.stdin.buffer.read())
    client.close()
"""


def install(directory: Path, record: Path) -> dict[str, str]:
    """Write the fake into ``directory``; the environment that puts it first on ``PATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "nvidia-cuda-mps-control"
    program.write_text(f"#!{sys.executable}\n{_SCRIPT}")
    program.chmod(0o755)
    return {"PATH": f"{directory}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_MPS_RECORD": str(record)}
