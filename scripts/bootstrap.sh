#!/usr/bin/env bash
# Creates .venv (Python 3.11+) and installs stageferry with every extra (all: stages, gateway) and dev; idempotent and quick when
# nothing changed (a stamp holds the hash of pyproject.toml).  torch is installed first, pinned, so that
# pip takes the CPU build from this machine's disk instead of downloading a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_PIN="torch==2.13.0"
VENV=.venv
STAMP="$VENV/.stageferry-bootstrap"

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.11 python3 python3.12 python3.13; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  echo "bootstrap: no Python >= 3.11 found (set PYTHON=/path/to/python3.11)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  python=$(find_python)
  echo "bootstrap: creating $VENV with $($python --version)" >&2
  "$python" -m venv "$VENV"
fi

want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c 'import stageferry' 2>/dev/null; then
  exit 0
fi

# pip's own lines (Collecting …, Installing collected packages …) are the progress: a cold install takes
# a minute or two, which should not look like a hang.  They go to stderr, prefixed, one per line.
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
progress() { sed -u 's/^/bootstrap: pip: /' >&2; }
started=$SECONDS
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  echo "bootstrap: installing $TORCH_PIN" >&2
  "${pip[@]}" "$TORCH_PIN" 2>&1 | progress
fi
echo "bootstrap: installing stageferry[all,dev] (client, CLI, stages, gateway, test tools)" >&2
"${pip[@]}" -e '.[all,dev]' 2>&1 | { grep -v '^Requirement already satisfied' || true; } | progress
echo "$want" > "$STAMP"
echo "bootstrap: done in $((SECONDS - started)) s" >&2
