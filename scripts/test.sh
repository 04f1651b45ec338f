#!/usr/bin/env bash
# The test command: bootstrap, make sure a Redis answers on 127.0.0.1:6379, then lint, types and tests.
# Arguments go to pytest (e.g. scripts/test.sh -k client -x).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/bootstrap.sh

redis_answers() {
  .venv/bin/python - <<'PY' 2>/dev/null
import redis
redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1, socket_timeout=1).ping()
PY
}

if ! redis_answers; then
  if ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      echo "test: installing redis-server" >&2
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    else
      echo "test: no Redis on 127.0.0.1:6379 and no redis-server to start one" >&2
      exit 1
    fi
  fi
  echo "test: starting redis-server on 127.0.0.1:6379" >&2
  redis-server --daemonize yes --port 6379 --bind 127.0.0.1 --save '' --appendonly no >/dev/null
  for _ in $(seq 100); do
    redis_answers && break
    sleep 0.1
  done
  redis_answers || { echo "test: redis-server did not answer" >&2; exit 1; }
fi

# The console's browser test drives Debian's chromium (Playwright's own browser downloads are not used).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing Debian's chromium for the console's browser test (apt-get, about 6 minutes the first" >&2
    echo "test: time; install it yourself beforehand, or put a chromium on PATH, to skip this step)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
      || echo "test: chromium could not be installed; the console's browser test will skip" >&2
  else
    echo "test: no chromium and no way to install it; the console's browser test will skip" >&2
  fi
fi

.venv/bin/ruff check stageferry tests benchmarks
.venv/bin/mypy --explicit-package-bases stageferry tests benchmarks
# Two workers (pytest-xdist): most tests wait on processes, Redis or sockets, so two share the CI box's two
# cores well (pytest 14.5 min serial, 9.5-10 min on two workers there).  STAGEFERRY_TEST_WORKERS=0 runs in one process.
exec .venv/bin/pytest -q -n "${STAGEFERRY_TEST_WORKERS:-2}" --durations=30 "$@"
