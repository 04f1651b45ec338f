#!/usr/bin/env bash
# Build the stageferry image (compose/Dockerfile) with podman, with no registry and no index at build time:
#   1. a Debian bookworm base with python3, python3-venv, redis-server and redis-tools, made by debootstrap
#      from the Debian mirror your apt already uses (or DEBIAN_MIRROR) and loaded with `podman import`;
#   2. every wheel the image installs, downloaded on the host by pip into compose/wheels/ (the lock file's
#      exact versions, pip, setuptools; torch from TORCH_WHEEL_DIR or the index);
#   3. `podman build` of compose/Dockerfile with --no-index and no network.
#
#   deploy/kubernetes/image.sh                  # stageferry:cpu (torch==2.13.0+cpu)
#   VARIANT=cuda deploy/kubernetes/image.sh     # stageferry:cuda (torch==2.13.0, the CUDA build, ~3 GB)
#   IMAGE=registry.example/stageferry:cpu deploy/kubernetes/image.sh   # tag it for your registry
#
# Needs root (debootstrap, podman), debootstrap and podman.  Skips the base when it exists (REBUILD_BASE=1).
# Then push the image to the registry your cluster pulls from, or load it into kind/k3s
# (docs/kubernetes.md, "Images").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
variant="${VARIANT:-cpu}"
case "$variant" in
  cpu) torch_spec="${TORCH_SPEC:-torch==2.13.0+cpu}" ;;
  cuda) torch_spec="${TORCH_SPEC:-torch==2.13.0}" ;;
  *) echo "image: VARIANT is cpu or cuda, not $variant" >&2; exit 2 ;;
esac
image="${IMAGE:-localhost/stageferry:$variant}"
base="${BASE_IMAGE:-localhost/stageferry-base:bookworm}"
python="${PYTHON:-python3}"
pip=("$python" -m pip)
say() { printf '[image %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# The mirror apt uses here: the first URI of a deb822 .sources file, or of a one-line sources.list entry.
debian_mirror() {
  if [[ -n "${DEBIAN_MIRROR:-}" ]]; then echo "$DEBIAN_MIRROR"; return; fi
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' "$f"
    return
  done
  awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' \
    /etc/apt/sources.list 2>/dev/null
}

if [[ "${REBUILD_BASE:-0}" == 1 ]] || ! podman image exists "$base"; then
  mirror="$(debian_mirror)"
  [[ -n "$mirror" ]] || { echo "image: no Debian mirror found in apt's sources; set DEBIAN_MIRROR" >&2; exit 2; }
  rootfs="$(mktemp -d /var/tmp/stageferry-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  say "debootstrap bookworm (minbase + python3, python3-venv, redis) into $rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,redis-server,redis-tools \
    bookworm "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -n 20 "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  say "podman import -> $base"
  tar -C "$rootfs" -c . | podman import - "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi

wheels="$root/compose/wheels"
say "wheels into compose/wheels/ (requirements.lock, pip, setuptools, $torch_spec)"
# Markers dropped: the lock's marker-guarded pins (async-timeout for Python < 3.11.3) are for the image's
# python3 (Debian's 3.11.2), which is not necessarily the host's.
reqs="$(mktemp)"
grep -Ev '^\s*(#|$)' "$root/compose/requirements.lock" | sed 's/\s*;.*//' >"$reqs"
pip_spec="${PIP_SPEC:-pip==26.3}"
{ echo "$pip_spec"; echo "setuptools==84.2.1"; } >>"$reqs"
"${pip[@]}" download --quiet --no-deps --only-binary=:all: -d "$wheels" -r "$reqs"
rm -f "$reqs"
torch_file_version="${torch_spec#torch==}"
if ! ls "$wheels"/torch-"${torch_file_version}"-*.whl >/dev/null 2>&1; then
  found="$(ls "${TORCH_WHEEL_DIR:-/opt/wheels}"/torch-"${torch_file_version}"-cp311-*.whl 2>/dev/null | head -n 1 || true)"
  if [[ -n "$found" ]]; then cp "$found" "$wheels/"; else "${pip[@]}" download --quiet --no-deps -d "$wheels" "$torch_spec"; fi
fi

say "podman build -> $image (no network, --no-index)"
podman build --network none -f "$root/compose/Dockerfile" \
  --build-arg BASE_IMAGE="$base" \
  --build-arg TORCH_SPEC="$torch_spec" \
  --build-arg PIP_SPEC="$pip_spec" \
  --build-arg PIP_EXTRA_OPTS="--no-index" \
  -t "$image" "$root"
# The build stage's layers stay (the next build reuses them): `podman image prune -f` removes them.
say "built $image: $(podman image inspect -f '{{.Size}}' "$image" | "$python" -c 'import sys; print(f"{int(sys.stdin.read())/1e9:.2f} GB")')"
