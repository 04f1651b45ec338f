#!/usr/bin/env bash
# A real run of the compose `ha` profile (docker-compose.yml + docker-compose.ha.yml with ha.env): the primary `redis`, two
# replicas, three sentinels, the encoder and diffusion stages (TP1, the reference models, small jobs) and
# the gateway, every process on STAGEFERRY_REDIS_URL=redis+sentinel://...?wait_replicas=2. Then, under load
# (deploy/ha_load.sh, shared with deploy/kubernetes/ha_smoke.sh):
#   1. N jobs (HA_REQUESTS, default 20) are submitted through the gateway's published port with curl
#      (POST /v1/videos), one every HA_SPACING s; after HA_KILL_AFTER of them the primary Redis container
#      is killed (SIGKILL) and started again a second later, while the rest keep coming;
#   2. the failover is timed: kill -> the sentinels name another master -> first successful write on it;
#   3. every job the gateway accepted is followed to its end and audited in Redis (stageferry.chaos.audit):
#      lost / duplicated / stuck must all be 0, every accepted id done exactly once;
#   4. the killed `redis` is back as a replica of the new master, both replicas in sync.
# Prints PASS or FAIL and removes everything it made (SMOKE_KEEP=1 leaves the stack up).
#
#   sudo compose/ha_smoke.sh          # docker + compose, or podman: it serves podman's Docker API itself
#   DOCKER_HOST=unix:///run/podman/podman.sock compose/ha_smoke.sh
#
# Compose: `docker compose` (v2) or docker-compose (v1, >= 1.28 for profiles). With podman it starts
# `podman system service` on a socket of its own when DOCKER_HOST is unset and there is no docker socket.
# The image: STAGEFERRY_IMAGE (default localhost/stageferry:cpu, deploy/kubernetes/image.sh builds it; no
# build here). Services start with --no-deps, in order, and the script waits on its own conditions:
# podman runs health checks from systemd timers, and with no systemd the `service_healthy` conditions of
# the compose file would never be met. tests/test_compose_ha_smoke.py holds it to the compose file.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
cd "$here"
py="${PYTHON:-$root/.venv/bin/python}"
requests="${HA_REQUESTS:-20}"
kill_after="${HA_KILL_AFTER:-6}"
spacing="${HA_SPACING:-1}"
steps="${HA_STEPS:-8}"
health_timeout="${SMOKE_HEALTH_TIMEOUT:-600}"
job_timeout="${SMOKE_JOB_TIMEOUT:-900}"
prefix=sf
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-stageferry-ha-smoke}"
export STAGEFERRY_IMAGE="${STAGEFERRY_IMAGE:-localhost/stageferry:cpu}"
export REDIS_IMAGE="$STAGEFERRY_IMAGE"
export REDIS_PUBLISH="${REDIS_PUBLISH:-127.0.0.1:16389}"
export GATEWAY_PUBLISH="${GATEWAY_PUBLISH:-127.0.0.1:18093}"
export STAGE_SHM_SIZE="${STAGE_SHM_SIZE:-256mb}"
export REDIS_MAXMEMORY="${REDIS_MAXMEMORY:-512mb}"
data_nodes=(redis redis-replica-1 redis-replica-2)
sentinels=(sentinel-1 sentinel-2 sentinel-3)
stages=(encoder diffusion)
t0=$(date +%s.%N)
since() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", a - b}'; }
say() { printf '[compose-ha %6ss] %s\n' "$(since "$(date +%s.%N)" "$t0")" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
work="$(mktemp -d /var/tmp/stageferry-compose-ha.XXXXXX)"
service_pid=""
# shellcheck source=../deploy/ha_load.sh
source "$root/deploy/ha_load.sh"   # load_and_kill, audit_jobs, await_rejoin

if docker compose version >/dev/null 2>&1; then compose=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then compose=(docker-compose)
else fail "neither 'docker compose' nor 'docker-compose' is installed"
fi
dc() { "${compose[@]}" --env-file ha.env -f docker-compose.yml -f docker-compose.ha.yml "$@"; }  # ha.env's COMPOSE_FILE
declare -A cid_of   # service -> its container, the same across its restart (asking compose takes a second)
up() {  # services: docker-compose up -d --no-deps, then their containers remembered
  local svc
  dc up -d --no-deps "$@" >>"$work/up.log" 2>&1 || { cat "$work/up.log"; fail "up $*"; }
  for svc in "$@"; do cid_of[$svc]="$(dc ps -q "$svc")"; [[ -n "${cid_of[$svc]}" ]] || fail "no container for $svc"; done
}
cid() { if [[ -n "${cid_of[$1]:-}" ]]; then echo "${cid_of[$1]}"; else dc ps -q "$1"; fi; }
ip() {  # a service's address on the compose network; fails while it has none (never an empty -h: localhost)
  local a
  a="$(podman inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$(cid "$1")" 2>/dev/null)" || a=""
  [[ -n "$a" ]] && echo "$a"
}

teardown() {  # on EXIT: the failing services' last lines, then everything the run made (SMOKE_KEEP=1: nothing)
  local code=$? svc
  if ((code != 0)); then
    for svc in "${data_nodes[@]}" "${sentinels[@]}" "${stages[@]}" gateway; do  # Redis's lines: from the kill on
      say "last log lines of $svc:"
      dc logs --no-color --tail "$([[ $svc == redis* || $svc == sentinel* ]] && echo 30 || echo 6)" "$svc" 2>&1 | cut -c1-300 | sed 's/^/    /' || true
    done
  fi
  if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then
    say "SMOKE_KEEP=1: leaving the stack up (project $COMPOSE_PROJECT_NAME), files in $work"
  else
    dc down -v --remove-orphans -t 5 >"$work/down.log" 2>&1 || { cat "$work/down.log"; code=1; }
    [[ -n "$service_pid" ]] && kill "$service_pid" 2>/dev/null && wait "$service_pid" 2>/dev/null
    rm -rf "$work"
  fi
  if ((code == 0)); then say "PASS"; else say "FAIL (exit $code)"; fi
  exit "$code"
}
trap teardown EXIT
trap 'exit 130' INT TERM

for tool in podman curl redis-cli; do command -v "$tool" >/dev/null || fail "no $tool"; done
[[ -x "$py" ]] || fail "no Python at $py (set PYTHON to a venv with stageferry)"
if [[ -z "${DOCKER_HOST:-}" && ! -S /var/run/docker.sock ]]; then
  export DOCKER_HOST="unix://$work/podman.sock"
  podman system service --time=0 "$DOCKER_HOST" >"$work/service.log" 2>&1 &
  service_pid=$!
  until curl -fsS --unix-socket "$work/podman.sock" http://d/_ping >/dev/null 2>&1; do
    kill -0 "$service_pid" 2>/dev/null || { cat "$work/service.log"; fail "podman system service did not start"; }
    sleep 0.2
  done
fi
podman image exists "$STAGEFERRY_IMAGE" || fail "no image $STAGEFERRY_IMAGE (deploy/kubernetes/image.sh)"
say "${compose[*]} $("${compose[@]}" version --short 2>/dev/null) on ${DOCKER_HOST:-the docker socket}; podman $(podman version -f '{{.Client.Version}}'), runtime $(podman info -f '{{.Host.OCIRuntime.Name}}'); image $STAGEFERRY_IMAGE"

# --- the compose file as it is, with ha.env; the pipeline at TP1 -------------------------------------------
sed -e 's/^tp = [0-9]*/tp = 1/' pipeline.toml >"$work/pipeline.toml"
export STAGEFERRY_PIPELINE_FILE="$work/pipeline.toml"
dc config >"$work/config.yml" || fail "docker-compose config"
url="$(grep -m1 -o 'STAGEFERRY_REDIS_URL: .*' "$work/config.yml" | cut -d' ' -f2-)"
say "profiles $(grep -o '^COMPOSE_PROFILES=.*' ha.env | cut -d= -f2), project $COMPOSE_PROJECT_NAME; STAGEFERRY_REDIS_URL: $url"
dc down -v --remove-orphans -t 5 >/dev/null 2>&1 || true   # a run before's

rcli() { local a; a="$(ip "$1")" && timeout 5 redis-cli -h "$a" "${@:2}"; }
declare -A addr_of  # data node -> its address when it started (fixed: docker-compose.ha.yml), kept while it is down
node_at() {  # the data node at an address the sentinels name (ha.env's fixed IPs), else the address
  local svc
  for svc in "${data_nodes[@]}"; do [[ "${addr_of[$svc]:-}" == "$1" ]] && { echo "$svc"; return 0; }; done
  echo "$1"
}
sentinel_master() {  # the master's service name, as the first sentinel that answers names it
  local s m
  for s in "${sentinels[@]}"; do
    m="$(rcli "$s" -p 26379 --raw sentinel get-master-addr-by-name stageferry 2>/dev/null | head -n 1)" || m=""
    if [[ -n "$m" ]]; then node_at "$m"; return 0; fi
  done
}
probe_write() { rcli "$1" set "$prefix:ha-smoke:probe" 1 2>/dev/null | grep -q OK; }
node_container() { podman inspect -f '{{.Name}}' "$(cid "$1")"; }
audit_redis() { local a; a="$(ip "$(sentinel_master)")" || a=no-master.invalid; echo "$a - -"; }

say "starting the data nodes and the sentinels: ${data_nodes[*]} ${sentinels[*]}"
up redis
deadline=$((SECONDS + 60))
until rcli redis ping 2>/dev/null | grep -q PONG; do ((SECONDS < deadline)) || fail "redis did not answer"; sleep 0.5; done
up "${data_nodes[@]:1}" "${sentinels[@]}"
for svc in "${data_nodes[@]}"; do addr_of[$svc]="$(ip "$svc")" || fail "$svc has no address"; done
mac() { podman inspect -f '{{range .NetworkSettings.Networks}}{{.MacAddress}}{{end}}' "$(cid "$1")" 2>/dev/null; }
for svc in "${data_nodes[@]}" "${sentinels[@]}"; do say "  $svc at $(ip "$svc") $(mac "$svc") ($(node_container "$svc"))"; done
deadline=$((SECONDS + 120))
until [[ "$(sentinel_master)" == redis ]] \
  && [[ "$(rcli redis info replication 2>/dev/null | tr -d '\r' | grep -c '^slave[0-9]*:.*state=online')" == 2 ]] \
  && [[ "$(rcli sentinel-1 -p 26379 sentinel master stageferry 2>/dev/null | tr -d '\r' | grep -A1 -x num-other-sentinels | tail -n 1)" == 2 ]]; do
  ((SECONDS < deadline)) || fail "the Sentinel group did not settle (master redis, 2 replicas online, 3 sentinels)"
  sleep 1
done
say "settled: master redis, 2 replicas online, 3 sentinels (quorum 2)"

say "starting the stages and the gateway: ${stages[*]} gateway"
up "${stages[@]}" gateway
gw="http://$GATEWAY_PUBLISH"
deadline=$((SECONDS + health_timeout))
for stage in "${stages[@]}"; do
  until podman exec "$(cid "$stage")" stageferry health --stage "$stage" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$stage not healthy after ${health_timeout}s"
    sleep 5
  done
done
until curl -fsS -m 10 "$gw/health" >/dev/null 2>&1; do ((SECONDS < deadline)) || fail "gateway not healthy"; sleep 3; done
say "healthy; gateway at $gw (published port of the gateway service)"

# --- 1-3. load with the primary killed under it, the failover timed, every accepted job audited -------------
load_and_kill
audit_jobs

# --- 4. the old primary is a replica of the new one ---------------------------------------------------------
replication() { rcli "$1" info replication | tr -d '\r'; }
announced() { echo "${addr_of[$1]}"; }   # the data nodes announce their fixed IPs (replica-announce-ip, docker-compose.ha.yml)
await_rejoin
say "4. $primary (started again at $(ip "$primary") $(mac "$primary"))"
say "   $primary (started again $(since "$(cat "$work/restarted_at")" "$killed_at") s after the kill) is a replica of $new, link up"
say "   $new: $(replication "$new" | grep -E '^(role|connected_slaves):' | tr '\n' ' ')"
say "every check passed: $accepted/$requests accepted, all done exactly once, lost=0 duplicated=0 stuck=0 across a failover under load"
