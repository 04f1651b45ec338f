#!/usr/bin/env bash
# A real run of the rendered Sentinel profile (overlays/cpu-ha) with `podman kube play`: three Redis data
# pods, three sentinels, the encoder and diffusion stages (TP1, the reference models, small jobs) and the
# gateway, each pod with its own IP. Then, under load (deploy/ha_load.sh, shared with compose/ha_smoke.sh):
#   1. N jobs (HA_REQUESTS, default 20) are submitted through the gateway with curl (POST /v1/videos), one
#      every HA_SPACING s; after HA_KILL_AFTER of them the primary Redis container is killed (SIGKILL) and
#      started again a second later (what the kubelet does), while the rest keep coming;
#   2. the failover is timed: kill -> the sentinels name another master -> first successful write on it;
#   3. every job the gateway accepted is followed to its end and audited in Redis (stageferry.chaos.audit):
#      lost / duplicated / stuck must all be 0, every accepted id done exactly once;
#   4. the killed pod is back as a replica of the new master, both replicas in sync;
#   5. KEDA's path: the Secret's sentinel-addresses (the names with the namespace, which KEDA's operator
#      dials from its own) name the master by its namespace-qualified name, and the scaler user reads there
#      what the triggers read (XPENDING, XINFO GROUPS, LLEN).
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
namespace="${SMOKE_NAMESPACE:-stageferry}"   # what the pods' POD_NAMESPACE and the Secret's names hold
prefix=sf
t0=$(date +%s.%N)
since() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.1f", a - b}'; }
say() { printf '[ha-smoke %6ss] %s\n' "$(since "$(date +%s.%N)" "$t0")" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
work="$(mktemp -d /var/tmp/stageferry-ha-smoke.XXXXXX)"
volumes=(data-stageferry-redis-0 data-stageferry-redis-1 data-stageferry-redis-2)
# shellcheck source=pods.sh
source "$here/pods.sh"   # pods, teardown, play, container, in_pod
# shellcheck source=../ha_load.sh
source "$here/../ha_load.sh"   # load_and_kill, audit_jobs, await_rejoin
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
(cd "$root" && "$py" -m stageferry kube secret --sentinel --namespace "$namespace" --root "$tree") >"$work/secret.yaml"
say "rendered overlays/cpu-ha: $(grep '^kind:' "$work/rendered.yaml" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}')"
url="$("$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["stringData"]["url"])' "$work/secret.yaml")"
say "STAGEFERRY_REDIS_URL: $(echo "$url" | sed 's/:[^:@]*@/:***@/')"

# --- play ---------------------------------------------------------------------------------------------
podman network exists "$net" && podman network rm -f "$net" >/dev/null
for volume in "${volumes[@]}"; do podman volume rm -f "$volume" >/dev/null 2>&1 || true; done  # a run before's
podman network create --subnet "$subnet.0/24" "$net" >/dev/null
"$py" "$here/podplay.py" "$work/rendered.yaml" "$work/secret.yaml" --out "$work/pods" --subnet "$subnet" \
  --namespace "$namespace" --replicas stageferry-gateway=1 >"$work/plan.txt" 2>/dev/null
declare -A ip_of workload_of
while read -r pod ip workload; do ip_of[$pod]=$ip; workload_of[$pod]=$workload; done <"$work/plan.txt"
secret_key() { "$py" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["stringData"][sys.argv[2]])' "$work/secret.yaml" "$1"; }
password="$(secret_key password)"
sentinel_password="$(secret_key sentinel-password)"
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

# --- 1-3. load with the primary killed under it, the failover timed, every accepted job audited ----------
steps="${HA_STEPS:-8}"
probe_write() { rcli "${ip_of[$1]}" set "$prefix:ha-smoke:probe" 1 2>/dev/null | grep -q OK; }
node_container() { container "$1"; }
audit_redis() { echo "${ip_of[$(sentinel_master)]} stageferry $password"; }
load_and_kill
audit_jobs

# --- 4. the old primary is a replica of the new one ---------------------------------------------------------
replication() { node_info "$1" replication; }
announced() { echo "$1.stageferry-redis.$namespace.svc"; }   # <pod>.<headless service>.<namespace>.svc
await_rejoin
say "4. $primary (restarted $(since "$(cat "$work/restarted_at")" "$killed_at") s after the kill) is a replica of $new, link up; its start-up lines:"
podman logs "$victim" 2>&1 | grep 'data node' | sed 's/^/    /' || true
say "   $new: $(node_info "$new" replication | grep -E '^(role|connected_slaves):' | tr '\n' ' ')"
# --- 5. KEDA's path: from the Secret's sentinel-addresses to the master, as sfscaler ---------------------------
keda_read='
import sys, redis
from redis.sentinel import Sentinel
addresses, password, prefix, stage = sys.argv[1:5]
sentinels = [(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in addresses.split(",")]
host, port = Sentinel(sentinels, socket_timeout=3).discover_master("stageferry")
r = redis.Redis(host=host, port=port, username="sfscaler", password=password, socket_timeout=3)
stream = f"{prefix}:stage:{stage}:in"
(group,) = [g for g in r.xinfo_groups(stream) if g["name"] == stage.encode()]
print(host, port, r.xpending(stream, stage)["pending"], group["lag"], r.llen(f"{prefix}:stage:{stage}:submit"))
'
read -r keda_host keda_port keda_pending keda_lag keda_intake <<<"$(in_pod "$gateway" python -c "$keda_read" \
  "$(secret_key sentinel-addresses)" "$(secret_key scaler-password)" "$prefix" encoder)" || true
[[ "$keda_host" == "$(announced "$new")" && "$keda_port" == 6379 && -n "$keda_intake" ]] \
  || fail "KEDA's path: the sentinels at the Secret's addresses named ${keda_host:-nothing}, not $(announced "$new")"
say "5. KEDA's path: sentinel-addresses $(secret_key sentinel-addresses | cut -d, -f1),... -> master $keda_host:$keda_port; as sfscaler XPENDING $keda_pending, lag $keda_lag, LLEN $keda_intake"
say "every check passed: $accepted/$requests accepted, all done exactly once, lost=0 duplicated=0 stuck=0 across a failover under load"
