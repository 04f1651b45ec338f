"""``stageferry gateway`` as a process: a start that cannot happen is one typed line and exit 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def test_a_port_in_use_is_one_config_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("STAGEFERRY_")} | {"PYTHONPATH": str(ROOT)}
        argv = [
            sys.executable,
            "-m",
            "stageferry",
            "--redis-url",
            "redis://127.0.0.1:1/0",
            "gateway",
            "--port",
            str(port),
        ]
        result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error [config]: the gateway could not start on 127.0.0.1:{port} (the log line above says why)"
    assert "Traceback" not in result.stderr
