#!/usr/bin/env bash
# The main job on a fresh machine: bootstrap, then run the whole pipeline and one job (`stageferry up`).
# Arguments go to `stageferry up` (e.g. scripts/up.sh --task t2va --steps 4, or --serve to keep it running).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
"$root/scripts/bootstrap.sh"
exec "$root/.venv/bin/stageferry" up "$@"
