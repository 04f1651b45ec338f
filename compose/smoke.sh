#!/usr/bin/env bash
# Smoke test of the compose deployment (CPU profile): build the image, start Redis, the encoder (TP2), the
# diffusion stage (TP4) and the gateway, wait until every service is healthy, submit one job of each task
# (t2va from the host with plain redis-cli on the published port, fl2va and ref2va from the client
# service), check the MP4s, check that the FL2VA and Ref2VA payloads crossed over NIXL (not inline),
# show a trace, check that the service logs are JSON, then tear everything down (volumes too).
#
#   compose/smoke.sh                       # from anywhere; needs docker + compose (v2 plugin or v1)
#   BASE_IMAGE=… TORCH_SPEC=… compose/smoke.sh   # build arguments pass through (see compose/Dockerfile)
#   SMOKE_KEEP=1 compose/smoke.sh          # leave the stack running at the end
#
# Exits 0 only when every check passed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-stageferry-smoke}"
export COMPOSE_PROFILES=cpu
export REDIS_PUBLISH="${REDIS_PUBLISH:-127.0.0.1:16379}"
export GATEWAY_PUBLISH="${GATEWAY_PUBLISH:-127.0.0.1:18091}"
export REDIS_APPENDONLY="${REDIS_APPENDONLY:-no}"
prefix="${STAGEFERRY_PREFIX:-sf}"
health_timeout="${SMOKE_HEALTH_TIMEOUT:-420}"
job_timeout="${SMOKE_JOB_TIMEOUT:-900}"
samples=/usr/share/stageferry-samples
t0=$(date +%s)

if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  compose=(docker-compose)
else
  echo "smoke: neither 'docker compose' nor 'docker-compose' is installed" >&2
  exit 2
fi
dc() { "${compose[@]}" -f docker-compose.yml "$@"; }
say() { printf '[smoke %4ss] %s\n' "$(($(date +%s) - t0))" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
# compose v1 prints "Creating …" for every run on stderr: keep it out of the way unless something fails
client() { dc run --rm -T --no-deps client "$@" 2>"$tmp/client.err" || { cat "$tmp/client.err" >&2; return 1; }; }
tmp="$(mktemp -d)"

teardown() {
  local code=$?
  if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then
    say "SMOKE_KEEP=1: leaving the stack up (project $COMPOSE_PROJECT_NAME)"
    return
  fi
  if ((code != 0)); then
    say "last log lines of each service:"
    for svc in redis encoder diffusion gateway; do
      dc logs --no-color --tail 8 "$svc" 2>&1 | cut -c1-400 || true
    done
  fi
  rm -rf "$tmp"
  say "tearing down"
  COMPOSE_PROFILES=cpu,tools dc down -v --remove-orphans >/dev/null 2>&1 || true
  say "exit $code"
}
trap teardown EXIT

say "compose: ${compose[*]} ($("${compose[@]}" version --short 2>/dev/null || true)); project $COMPOSE_PROJECT_NAME"
say "building the image"
dc build encoder >"$tmp/build.log" 2>&1 || { tail -n 30 "$tmp/build.log"; fail "the build failed"; }
grep -E '^(Successfully (built [0-9a-f]{12}$|tagged )|#[0-9]+ naming)' "$tmp/build.log" | sed 's/^/  /' || true
image="${STAGEFERRY_IMAGE:-stageferry:cpu}"
docker image inspect "$image" >/dev/null || fail "image $image was not built"
say "image $image: $(docker image inspect -f '{{.Size}}' "$image" | python3 -c 'import sys; print(f"{int(sys.stdin.read())/1e9:.2f} GB")'), user $(docker image inspect -f '{{.Config.User}}' "$image")"

services=(redis encoder diffusion)
if docker run --rm "$image" stageferry gateway --help >/dev/null 2>&1; then
  services+=(gateway)
else
  say "note: this image has no 'stageferry gateway' command; the gateway service is not started"
fi
say "starting: ${services[*]}"
dc up -d "${services[@]}" 2>&1 | sed 's/^/  /'

say "waiting for health (up to ${health_timeout}s)"
deadline=$((SECONDS + health_timeout))
while :; do
  states=()
  all=1
  for svc in "${services[@]}"; do
    for cid in $(dc ps -q "$svc"); do
      st="$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$cid")"
      states+=("$svc=$st")
      [[ "$st" == healthy ]] || all=0
    done
  done
  ((all)) && break
  ((SECONDS < deadline)) || fail "not healthy after ${health_timeout}s: ${states[*]}"
  sleep 5
done
say "healthy: ${states[*]}"
if [[ " ${services[*]} " == *" gateway "* ]]; then
  say "gateway: GET /health on the published port ${GATEWAY_PUBLISH}"
  python3 -c 'import sys, urllib.request as u; print("  " + u.urlopen(sys.argv[1], timeout=10).read().decode()[:300])' \
    "http://${GATEWAY_PUBLISH}/health" || fail "gateway /health did not answer 200"
fi

# --- one job of each task ----------------------------------------------------------------------------
host_port="${REDIS_PUBLISH##*:}"
host_addr="${REDIS_PUBLISH%:*}"
t2va_id="smoke-t2va-$$-$(date +%s)"
job='{"task":"t2va","prompt":"a paper boat drifting down a rain-soaked street","width":320,"height":192}'
if command -v redis-cli >/dev/null 2>&1; then
  say "t2va: XADD from the host with redis-cli on $host_addr:$host_port"
  redis-cli -h "$host_addr" -p "$host_port" XADD "$prefix:stage:encoder:in" '*' request_id "$t2va_id" job "$job" >/dev/null
else
  say "t2va: XADD with redis-cli inside the redis container (no redis-cli on the host)"
  dc exec -T redis redis-cli XADD "$prefix:stage:encoder:in" '*' request_id "$t2va_id" job "$job" >/dev/null
fi
say "t2va: submitted $t2va_id"

say "fl2va: stageferry submit from the client service (uploads the sample frames)"
fl2va_id="$(client stageferry submit --task fl2va --prompt "from the first frame to the last" \
  --width 320 --height 192 --first-frame "upload:$samples/first_frame.png" \
  --last-frame "upload:$samples/last_frame.png" | tail -n 1)"
say "fl2va: submitted $fl2va_id"

say "ref2va: stageferry submit from the client service (uploads the sample video and audio)"
ref2va_id="$(client stageferry submit --task ref2va --prompt "follow the reference" \
  --width 320 --height 192 --reference-video "upload:$samples/reference_video.mp4" \
  --reference-audio "upload:$samples/reference_audio.wav" | tail -n 1)"
say "ref2va: submitted $ref2va_id"

# --- results ------------------------------------------------------------------------------------------
for pair in "t2va:$t2va_id" "fl2va:$fl2va_id" "ref2va:$ref2va_id"; do
  task="${pair%%:*}"
  rid="${pair#*:}"
  client stageferry wait "$rid" --timeout "$job_timeout" >"$tmp/$task.json" || true
  nixl=(); [[ "$task" == t2va ]] || nixl=(--nixl)
  python3 smoke_check.py status "$task" "$tmp/$task.json" "${nixl[@]}" \
    || fail "$task ($rid) did not pass: $(head -c 600 "$tmp/$task.json")"
done

say "checking the MP4s in the shared output volume (from the client container)"
client python -c '
import sys, av
for path in sys.argv[1:]:
    with av.open(path) as c:
        v = c.streams.video[0]; a = c.streams.audio[0]
        frames = sum(1 for _ in c.decode(video=0))
        print(f"{path}: {v.codec_context.name} {v.codec_context.pix_fmt} {v.width}x{v.height}, {frames} frames; "
              f"{a.codec_context.name} {a.channels}ch {a.sample_rate} Hz")
        assert frames > 0 and v.codec_context.name == "h264" and a.codec_context.name == "aac"
' "$(cat "$tmp/t2va.json.location")" "$(cat "$tmp/fl2va.json.location")" "$(cat "$tmp/ref2va.json.location")" \
  | sed 's/^/  /' || fail "an MP4 did not decode"

say "trace of the ref2va request across containers (stageferry trace)"
client stageferry trace "$ref2va_id" >"$tmp/trace.txt" || fail "no trace for $ref2va_id"
sed 's/^/  /' "$tmp/trace.txt" | cut -c1-200
grep -Eq 'diffusion.*via .*nixl' "$tmp/trace.txt" || fail "the trace shows no nixl hop into diffusion"

say "NIXL/UCX transport the diffusion leader logged for its peer"
docker logs "$(dc ps -q diffusion | head -n 1)" 2>&1 | grep -m 3 -E '"transport_info"|ucx.transport|nixl.transport' \
  | cut -c1-300 | sed 's/^/  /' || say "  (no transport line logged)"

say "service logs are JSON lines (Redis keeps its own log format)"
for svc in "${services[@]}"; do
  [[ "$svc" == redis ]] && continue
  docker logs "$(dc ps -q "$svc" | head -n 1)" >"$tmp/$svc.log" 2>&1
  python3 smoke_check.py jsonlog "$svc" "$tmp/$svc.log" || fail "$svc logged lines that are not JSON"
done
say "PASS: 3 jobs (t2va, fl2va, ref2va) done; fl2va and ref2va payloads crossed over NIXL"
