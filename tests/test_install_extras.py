"""The distribution's extras: the base install (client, CLI client commands) pulls no service stack."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = (
    "torch",
    "nixl",
    "msgpack",
    "av",
    "numpy",
    "PIL",
    "fastapi",
    "starlette",
    "uvicorn",
    "multipart",
    "prometheus_client",
)

CLIENT_SIDE = f"""
import sys
from typer.testing import CliRunner
import stageferry, stageferry.client
from stageferry.cli import app
runner = CliRunner()
url = ["--redis-url", "redis://127.0.0.1:1/0"]
for args in (["schema"], [*url, "status", "x"], [*url, "wait", "x", "--timeout", "1"], [*url, "cancel", "x"],
             [*url, "trace", "x"], [*url, "submit", "--prompt", "a boat"], [*url, "health"], ["--help"]):
    result = runner.invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
print(",".join(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_client_and_cli_client_commands_import_no_service_stack() -> None:
    result = subprocess.run([sys.executable, "-c", CLIENT_SIDE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"imported: {result.stdout.strip()}"


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower() for req in requirements}


def test_extras_split_the_service_stack_from_the_base_install() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _names(project["dependencies"])
    extras = {name: _names(reqs) for name, reqs in project["optional-dependencies"].items()}
    assert not base & {"torch", "nixl", "msgpack", "av", "numpy", "pillow", "fastapi", "uvicorn", "python-multipart"}
    assert {"torch", "nixl", "msgpack", "av", "numpy", "pillow"} <= extras["stage"]
    assert {"fastapi", "uvicorn", "python-multipart", "httpx"} <= extras["gateway"]  # httpx: console counters
    assert project["optional-dependencies"]["all"] == ["stageferry[stage,gateway]"]
    # The two README commands install everything: bootstrap takes [all,dev].
    assert "-e '.[all,dev]'" in (ROOT / "scripts" / "bootstrap.sh").read_text()


def test_the_image_lock_pins_every_requirement_within_its_range() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lock = {}
    for line in (ROOT / "compose" / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split(";")[0].strip().split("==")
            lock[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for text in project["dependencies"] + extras["stage"] + extras["gateway"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":  # the image takes it from TORCH_SPEC
            continue
        assert name in lock, f"{name} is not in compose/requirements.lock: run scripts/lock_requirements.py"
        assert req.specifier.contains(lock[name], prereleases=True), f"{name}=={lock[name]} is outside {req}"
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    assert "--no-deps -r /src/requirements.lock" in dockerfile and "pip check" in dockerfile
    # torch's own dependencies are pinned too: the lock is the constraints file of the torch install
    assert "-c /src/requirements.lock $TORCH_SPEC" in dockerfile
    assert {"sympy", "networkx", "jinja2", "fsspec", "filelock"} <= set(lock)
    # Debian bookworm's python3 is 3.11.2: redis needs async-timeout below 3.11.3, whatever Python locked it
    lock_text = (ROOT / "compose" / "requirements.lock").read_text()
    assert 'async-timeout==5.0.1 ; python_full_version < "3.11.3"' in lock_text


def test_the_build_is_pinned_and_the_license_an_spdx_string() -> None:
    """setuptools deprecates ``license = {text = ...}`` (builds stop after 2027-02-18); an unpinned backend
    builds differently from one day to the next."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (backend,) = meta["build-system"]["requires"]
    assert re.fullmatch(r"setuptools==\d+\.\d+\.\d+", backend), backend
    assert int(backend.split("==")[1].split(".")[0]) >= 77  # the first to read PEP 639 license strings


def test_what_a_build_leaves_is_ignored() -> None:
    """`pip install .` leaves build/ (and *.egg-info) in the checkout: not untracked noise for git."""
    for path in ("build/lib/stageferry/client.py", "dist/stageferry-0.1.0.tar.gz", "stageferry.egg-info/PKG-INFO"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
        assert ignored.returncode == 0, f"{path} is not ignored"
