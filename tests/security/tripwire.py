"""The pickle tripwire: run a process with ``tripwire_site/sitecustomize.py`` loaded, which records every
unpickling call it makes (there must be none)."""

from __future__ import annotations

import os
from pathlib import Path

TRIPWIRE = Path(__file__).resolve().parent / "tripwire_site"
ROOT = Path(__file__).resolve().parents[2]


def tripwire_env(log: Path) -> dict[str, str]:
    """Environment for a stage process whose unpickling calls are recorded in ``log``."""
    return {
        "PYTHONPATH": os.pathsep.join([str(TRIPWIRE), str(ROOT)]),
        "STAGEFERRY_TEST_PICKLE_LOG": str(log),
    }
