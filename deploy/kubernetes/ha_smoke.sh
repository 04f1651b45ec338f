#!/usr/bin/env bash
# A real run of the rendered Sentinel profile (overlays/cpu-ha) with `podman kube play`: three Redis data
# pods, three sentinels, the encoder and diffusion stages (TP1, the reference models, small jobs) and the
# gateway, each pod with its own IP. Then, under load:
#   1. N jobs (HA_REQUESTS, default 20) are submitted through the gateway with curl (POST /v1/videos), one
#      every HA_SPACING s; after HA_KILL_AFTER of them the primary Redis container is killed (SIGKILL) and
#      started again a second later (what the kubelet does), while the rest keep coming;
#   2. the failover is timed: kill -> the sentinels name another master -> first successful write on it;
#   3. every job the gateway accepted is followed to its end and audited in Redis (stageferry.chaos.audit):
#      lost / duplicated / stuck must all be 0, every accepted id done exactly once;
#   4. the killed pod is back as a replica of the new master, both replicas in sync.
# Prints PASS or FAIL and removes everything it made (SMOKE_KEEP=1 leaves the pods up).
#
#   sudo deploy/kubernetes/ha_smoke.sh                   # root: podman's bridge network and pod IPs
#   SMOKE_SKIP_BUILD=1 deploy/kubernetes/ha_smoke.sh     # reuse localhost/stageferry:cpu as it is
#
# Needs what smoke.sh needs (podman with catatonit, default_ulimits, runc where crun cannot run; the image
# from image.sh). tests/kube/test_ha_smoke.py checks this script's settings against the rendered tree.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
kubectl="${KUBECTL:-$(dirname "$py")/kubectl}"
net="${SMOKE_NETWORK:-stageferry-ha-smoke}"
subnet="${SMOKE_SUBNET:-10.89.43}"
requests="${HA_REQUESTS:-20}"
kill_after="${HA_KILL_AFTER:-6}"
spacing="${HA_SPACING:-1}"
health_timeout="${SMOKE_HEALTH_TIMEOUT:-600}"
job_timeout="${SMOKE_JOB_TIMEOUT:-900}"
image="localhost/stageferry:cpu"
prefix=sf
t0=$(date +%s.%N)
since() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", a - b}'; }
say() { printf '[ha-smoke %6ss] %s\n' "$(since "$(date +%s.%N)" "$t0")" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
work="$(mktemp -d /var/tmp/stageferry-ha-smoke.XXXXXX)"
volumes=(data-stageferry-redis-0 data-stageferry-redis-1 data-stageferry-redis-2)
# shellcheck source=pods.sh
source "$here/pods.sh"   # pods, teardown, play, container, in_pod
trap teardown EXIT
trap 'exit 130' INT TERM

[[ $(id -u) == 0 ]] || fail "run as root (podman's bridge network gives each pod its own IP)"
for tool in podman catatonit curl redis-cli; do command -v "$tool" >/dev/null || fail "no $tool (smoke.sh installs podman's part)"; done
[[ -x "$py" && -x "$kubectl" ]] || fail "no Python/kubectl at $py / $kubectl (set PYTHON to a venv with stageferry[kube])"
if [[ "${SMOKE_SKIP_BUILD:-0}" != 1 ]]; then
  say "building $image (deploy/kubernetes/image.sh; log $work/image.log)"
  PYTHON="$py" "$here/image.sh" >"$work/image.log" 2>&1 || { grep -v WARNING "$work/image.log" | tail -n 20; fail "image build"; }
fi
podman image exists "$image" || fail "no image $image (deploy/kubernetes/image.sh)"
say "podman $(podman version -f '{{.Client.Version}}'), runtime $(podman info -f '{{.Host.OCIRuntime.Name}}'); image $image"

# --- render: the committed tree, both stages TP1, small requests per rank (a shared 2-core host) ----------
tree="$work/kubernetes"
mkdir -p "$tree"
cp -r "$here/base" "$here/overlays" "$here/components" "$here/values.toml" "$tree/"
sed -i -e 's/^tp = [0-9]*/tp = 1/' "$tree/base/pipeline.toml"
sed -i 's/^memory_per_rank = .*/memory_per_rank = "2Gi"/; s/^cpu_per_rank = .*/cpu_per_rank = "250m"/' "$tree/values.toml"
(cd "$root" && "$py" -m stageferry kube generate --root "$tree") >/dev/null
"$kubectl" kustomize "$tree/overlays/cpu-ha" >"$work/rendered.yaml" || fail "kubectl kustomize overlays/cpu-ha"
(cd "$root" && "$py" -m stageferry kube secret --sentinel --root "$tree") >"$work/secret.yaml"
say "rendered overlays/cpu-ha: $(grep '^kind:' "$work/rendered.yaml" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')"
url="$("$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["stringData"]["url"])' "$work/secret.yaml")"
say "STAGEFERRY_REDIS_URL: $(echo "$url" | sed 's/:[^:@]*@/:***@/')"

# --- play ---------------------------------------------------------------------------------------------
podman network exists "$net" && podman network rm -f "$net" >/dev/null
for volume in "${volumes[@]}"; do podman volume rm -f "$volume" >/dev/null 2>&1 || true; done  # a run before's
podman network create --subnet "$subnet.0/24" "$net" >/dev/null
"$py" "$here/podplay.py" "$work/rendered.yaml" "$work/secret.yaml" --out "$work/pods" --subnet "$subnet" \
  --replicas stageferry-gateway=1 >"$work/plan.txt" 2>/dev/null
declare -A ip_of workload_of
while read -r pod ip workload; do ip_of[$pod]=$ip; workload_of[$pod]=$workload; done <"$work/plan.txt"
password="$("$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["stringData"]["password"])' "$work/secret.yaml")"
sentinel_password="$("$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["stringData"]["sentinel-password"])' "$work/secret.yaml")"
rcli() { REDISCLI_AUTH="$password" timeout 5 redis-cli --no-auth-warning --user stageferry -h "$@"; }   # the services' user
node_info() {  # pod section: INFO as the sentinels' user (the services' user has no INFO)
  REDISCLI_AUTH="$sentinel_password" timeout 5 redis-cli --no-auth-warning --user sfsentinel -h "${ip_of[$1]}" info "$2" | tr -d '\r'
}
sentinel_master() {  # the master's pod, as the first sentinel that answers names it
  local s m
  for s in 0 1 2; do
    m="$(timeout 3 redis-cli -h "${ip_of[stageferry-sentinel-$s]}" -p 26379 --raw sentinel get-master-addr-by-name stageferry 2>/dev/null | head -n 1)" || m=""
    if [[ -n "$m" ]]; then echo "${m%%.*}"; return 0; fi
  done
}

say "playing the Redis data pods and the sentinels"
for i in 0 1 2; do play "stageferry-redis-$i"; done
for i in 0 1 2; do play "stageferry-sentinel-$i"; done
deadline=$((SECONDS + 120))
until [[ "$(sentinel_master)" == stageferry-redis-0 ]] \
  && [[ "$(node_info stageferry-redis-0 replication 2>/dev/null | grep -c '^slave[0-9]*:.*state=online')" == 2 ]] \
  && [[ "$(timeout 3 redis-cli -h "${ip_of[stageferry-sentinel-0]}" -p 26379 sentinel master stageferry 2>/dev/null | tr -d '\r' | grep -A1 -x num-other-sentinels | tail -n 1)" == 2 ]]; do
  ((SECONDS < deadline)) || fail "the Sentinel group did not settle (master, 2 replicas online, 3 sentinels)"
  sleep 1
done
say "settled: master stageferry-redis-0, 2 replicas online, 3 sentinels (quorum 2)"

say "playing the stages and the gateway"
for pod in $(awk '$3 ~ /encoder|diffusion|gateway/ {print $1}' "$work/plan.txt"); do play "$pod"; done
gateway=$(awk '$3 == "stageferry-gateway" {print $1; exit}' "$work/plan.txt")
gw="http://${ip_of[$gateway]}:8091"
deadline=$((SECONDS + health_timeout))
for pod in $(awk '$3 ~ /encoder|diffusion/ {print $1}' "$work/plan.txt"); do
  stage="${workload_of[$pod]#stageferry-}"
  until in_pod "$pod" stageferry health --stage "$stage" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$pod not healthy after ${health_timeout}s"
    sleep 5
  done
done
until curl -fsS -m 10 "$gw/health" >/dev/null 2>&1; do ((SECONDS < deadline)) || fail "gateway not healthy"; sleep 3; done
say "healthy; gateway at $gw"

# --- 1. load, and the primary killed under it ---------------------------------------------------------------
steps="${HA_STEPS:-8}"
submit() {  # n: POST /v1/videos; writes <n>.at (when), <n>.code (HTTP status, seconds) and <n>.json
  date +%s.%N >"$work/sub/$1.at"
  curl -sS -m 120 -o "$work/sub/$1.json" -w '%{http_code} %{time_total}' "$gw/v1/videos" -F "prompt=ha smoke job $1" \
    -F width=160 -F height=96 -F num_inference_steps="$steps" -F seed="$1" -F 'extra_params={"task":"t2va","duration":1.0}' \
    >"$work/sub/$1.code" 2>"$work/sub/$1.err" || true
}
time_failover() {  # old master: kill -> the sentinels name another -> first successful write there
  local deadline=$((SECONDS + 120)) m
  until m="$(sentinel_master)" && [[ -n "$m" && "$m" != "$1" ]]; do
    ((SECONDS < deadline)) || { echo "no new master named in 120 s" >"$work/failover.err"; return; }
    sleep 0.2
  done
  date +%s.%N >"$work/named_at"
  echo "$m" >"$work/new_master"
  until rcli "${ip_of[$m]}" set "$prefix:ha-smoke:probe" 1 2>/dev/null | grep -q OK; do
    ((SECONDS < deadline)) || { echo "no write succeeded on $m" >"$work/failover.err"; return; }
    sleep 0.1
  done
  date +%s.%N >"$work/written_at"
}
mkdir -p "$work/sub"
say "1. $requests jobs through the gateway, one every ${spacing}s; the primary is killed after $kill_after"
primary="$(sentinel_master)"
for n in $(seq 1 "$requests"); do
  submit "$n" &
  if ((n == kill_after)); then
    victim="$(container "$primary")"
    killed_at=$(date +%s.%N)
    podman kill -s KILL "$victim" >/dev/null
    say "  after job $n: podman kill -s KILL $victim (the primary, ${ip_of[$primary]})"
    ( sleep 1; podman start "$victim" >/dev/null 2>&1; date +%s.%N >"$work/restarted_at" ) &  # the kubelet's restart
    time_failover "$primary" &
  fi
  sleep "$spacing"
done

# --- 2. the failover, timed (from the kill, beside the submissions) ----------------------------------------
wait
[[ -s "$work/written_at" ]] || fail "the failover did not end: $(cat "$work/failover.err" 2>/dev/null)"
new="$(cat "$work/new_master")"
say "2. failover $primary -> $new: the sentinels named it $(since "$(cat "$work/named_at")" "$killed_at") s after the kill, first write on it $(since "$(cat "$work/written_at")" "$killed_at") s after the kill"
wait
accepted=0
: >"$work/ids.txt"
for n in $(seq 1 "$requests"); do
  read -r code took <<<"$(cat "$work/sub/$n.code" 2>/dev/null)"
  if [[ "$code" == 200 || "$code" == 202 ]]; then
    echo "$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$work/sub/$n.json") $n $(cat "$work/sub/$n.at") $took" >>"$work/ids.txt"
    accepted=$((accepted + 1))
  else
    say "  job $n not accepted: HTTP $code $(head -c 200 "$work/sub/$n.json" 2>/dev/null) $(cat "$work/sub/$n.err")"
  fi
done
say "  accepted $accepted of $requests submissions (HTTP 200/202)"

# --- 3. every accepted job to its end, audited in Redis ------------------------------------------------------
audit() {
  PYTHONPATH="$root" "$py" - "$work/ids.txt" "${ip_of[$(sentinel_master)]}" "$password" "$prefix" "$killed_at" "${1:-}" <<'EOF'
import sys
import redis
from stageferry.broker.control.keys import Keys
from stageferry.chaos.audit import outcomes
rows = {line.split()[0]: line.split()[1:] for line in open(sys.argv[1]) if line.strip()}
client = redis.Redis(host=sys.argv[2], username="stageferry", password=sys.argv[3])
found = outcomes(client, Keys(sys.argv[4]), {rid: "done" for rid in rows}, ["encoder", "diffusion"])
if sys.argv[6] == "table":  # per job, times from the kill: submitted, accepted (curl's total), ended
    kill = float(sys.argv[5])
    print("    job  submitted  accepted    ended  state  terminal events  (s from the kill)", file=sys.stderr)
    for o in found:
        n, at, took = rows[o.request_id]
        end = "-" if o.ended_ms is None else f"{o.ended_ms / 1000 - kill:+8.1f}"
        flag = "  in flight at the kill" if float(at) < kill and o.ended_ms and o.ended_ms / 1000 > kill else ""
        print(f"    {n:>3}  {float(at) - kill:+9.1f}  {float(took):7.1f}s  {end:>8}  {o.state}   {o.terminal_events}{flag}", file=sys.stderr)
states = {}
for o in found:
    states[o.state] = states.get(o.state, 0) + 1
lost = sum(o.lost for o in found); stuck = sum(o.stuck for o in found); dup = sum(o.duplicated for o in found)
pending = sum(1 for o in found if not o.terminal)
print(f"{pending} {lost} {dup} {stuck} {' '.join(f'{k}={v}' for k, v in sorted(states.items(), key=str))}")
EOF
}
deadline=$((SECONDS + job_timeout))
while :; do
  read -r pending lost dup stuck states <<<"$(audit)"
  ((pending == 0)) && break
  ((SECONDS < deadline)) || break
  sleep 5
done
read -r pending lost dup stuck states <<<"$(audit table 2>"$work/table.txt")"
cat "$work/table.txt"
say "3. $accepted accepted: $states; lost=$lost duplicated=$dup stuck=$stuck (not terminal: $pending)"
[[ "$states" == "done=$accepted" && $lost == 0 && $dup == 0 && $stuck == 0 ]] || fail "not every accepted job ended done exactly once"

# --- 4. the old primary is a replica of the new one ---------------------------------------------------------
deadline=$((SECONDS + 120))
until [[ "$(node_info "$primary" replication 2>/dev/null | grep -E '^(role|master_host|master_link_status):' | tr '\n' ' ')" == "role:slave master_host:$new.stageferry-redis master_link_status:up " ]]; do
  ((SECONDS < deadline)) || fail "$primary did not rejoin as a replica of $new: $(node_info "$primary" replication 2>&1 | head -n 5 | tr '\n' ' ')"
  sleep 1
done
say "4. $primary (restarted $(since "$(cat "$work/restarted_at")" "$killed_at") s after the kill) is a replica of $new, link up; its start-up lines:"
podman logs "$victim" 2>&1 | grep 'data node' | sed 's/^/    /' || true
say "   $new: $(node_info "$new" replication | grep -E '^(role|connected_slaves):' | tr '\n' ' ')"
say "every check passed: $accepted/$requests accepted, all done exactly once, lost=0 duplicated=0 stuck=0 across a failover under load"
