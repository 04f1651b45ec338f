# Sourced by smoke.sh and ha_smoke.sh: the pods of a `podman kube play` run, and their teardown.
# The caller sets: work (its scratch directory; podplay.py wrote $work/pods), net (the podman network),
# ip_of (pod -> IP, from podplay.py's plan), volumes (podman volumes to remove), and say/fail.
pods=()

teardown() {  # on EXIT: the failing pods' last lines, then everything the run made (SMOKE_KEEP=1: nothing)
  local code=$? pod
  if ((code != 0)); then
    for pod in "${pods[@]}"; do
      say "last log lines of $pod:"
      podman pod logs --tail 6 "$pod" 2>&1 | cut -c1-300 | sed 's/^/    /' || true
    done
  fi
  if [[ "${SMOKE_KEEP:-0}" == 1 ]]; then
    say "SMOKE_KEEP=1: leaving the pods up (${pods[*]}), files in $work"
  else
    for pod in "${pods[@]}"; do podman pod rm -f -t 5 "$pod" >/dev/null 2>&1 || true; done
    grep -o "^$work/[^ ]*" "$work/pods/tmpfs.txt" 2>/dev/null | while read -r path; do umount "$path" 2>/dev/null || true; done
    for volume in "${volumes[@]}"; do podman volume rm -f "$volume" >/dev/null 2>&1 || true; done
    podman network rm -f "$net" >/dev/null 2>&1 || true
    rm -rf "$work"
  fi
  if ((code == 0)); then say "PASS"; else say "FAIL (exit $code)"; fi
}

play() {  # pod: its in-memory volumes first (tmpfs, as the kubelet mounts them), then `podman kube play`
  local path size
  while read -r path size; do
    [[ "$path" == "$work/pods/files/$1/"* ]] || continue
    mountpoint -q "$path" || mount -t tmpfs -o "size=$size,mode=1777" tmpfs "$path"
  done < <(cat "$work/pods/tmpfs.txt" 2>/dev/null)
  podman kube play --network "$net" --ip "${ip_of[$1]}" "$work/pods/$1.yaml" >"$work/play-$1.log" 2>&1 \
    || { cat "$work/play-$1.log"; fail "podman kube play $1"; }
  pods+=("$1")
  say "  pod $1${workload_of[$1]:+ (${workload_of[$1]})} at ${ip_of[$1]}"
}
container() { podman pod inspect -f '{{range .Containers}}{{.Name}} {{end}}' "$1" | tr ' ' '\n' | grep -v infra | grep -m1 .; }
in_pod() { local pod=$1; shift; podman exec "$(container "$pod")" "$@"; }
