#!/usr/bin/env python3
"""Regenerate the reference tables in docs/ from the code (keys, errors, settings, pipeline file, job).

scripts/gen_docs.py           rewrite the generated blocks of docs/*.md
scripts/gen_docs.py --check   exit 1, naming the files, when a committed block differs from the code
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, whichever environment runs the script

from stageferry.docgen import stale_files  # noqa: E402

DOCS = ROOT / "docs"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = stale_files(DOCS, write=not check)
    for path in stale:
        print(f"{'stale' if check else 'updated'}: {path.relative_to(DOCS.parent)}", file=sys.stderr)
    if check and stale:
        print("run scripts/gen_docs.py and commit the result", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
