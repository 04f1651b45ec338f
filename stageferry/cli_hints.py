"""Commands that ``up`` prints for the user to run next, spelled so that they work as printed.

``up`` usually runs as ``.venv/bin/stageferry`` (``scripts/up.sh``), with no ``stageferry`` on ``PATH``: a
printed ``stageferry trace <id>`` then fails.  :func:`cli_command` names the program the way this process
was started (``stageferry`` only when that is what ``PATH`` finds), and :func:`submit_command` is the
exact ``submit`` against the deployment ``up --serve`` keeps running, at ``up``'s own small size.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def cli_command(argv0: str | None = None) -> str:
    """How to run this CLI again from the current directory: ``stageferry`` when ``PATH`` finds this very
    program, else its path (relative when under the working directory), or ``python -m stageferry``."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if not argv0 or argv0 in ("-m", "-c") or Path(argv0).name == "__main__.py":
        return f"{shlex.quote(sys.executable)} -m stageferry"
    found = shutil.which("stageferry")
    if found is not None and os.path.realpath(found) == os.path.realpath(argv0):
        return "stageferry"
    path = Path(argv0).absolute()
    if "/" in argv0 and not Path(argv0).is_absolute():
        return shlex.quote(argv0)
    if Path.cwd() != Path("/") and path.is_relative_to(Path.cwd()):
        return shlex.quote(str(path.relative_to(Path.cwd())))
    return shlex.quote(str(path))


def submit_command(cli: str, *, redis_url: str, prefix: str, pipeline: Path | None, job: Mapping[str, Any]) -> str:
    """The ``submit --wait`` of a text-to-video job at ``job``'s size and prompt, to this deployment (a bare
    ``submit`` would take the schema's 1344×768)."""
    words = [cli, "--redis-url", redis_url, "--prefix", prefix]
    if pipeline is not None:
        words += ["--pipeline", str(pipeline)]
    words += ["submit", "--wait", "--width", str(job.get("width", 320)), "--height", str(job.get("height", 192))]
    words += ["--prompt", str(job.get("prompt", "a paper boat"))]
    return " ".join([words[0], *(shlex.quote(w) for w in words[1:])])


__all__ = ["cli_command", "submit_command"]
