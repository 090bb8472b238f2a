#!/usr/bin/env bash
# Builds Rubato's container image from deploy/Dockerfile (./rubato image runs this).
#
#   deploy/image/build.sh [--tag NAME] [--engine docker|podman] [--gpu] [--build-arg K=V]...
#                         [--smoke] [--save FILE]
#
#   --tag NAME        image name (default: rubato:cpu, or rubato:gpu with --gpu; $RUBATO_IMAGE)
#   --engine E        docker or podman (default: docker when a daemon answers or dockerd is installed,
#                     else podman; $RUBATO_ENGINE)
#   --gpu             build deploy/Dockerfile.gpu (needs a registry for its nvidia/cuda bases)
#   --build-arg K=V   passed to the build (e.g. BASE, or CUDA_VERSION and BUILDER_BASE with --gpu)
#   --smoke           then run it: --version of both binaries, and a one-server, one-worker job over
#                     127.0.0.1 (--network host) whose worker must exit 0 with a "done" record
#   --save FILE       then write the image to FILE (docker save format; `docker load`, `kind load
#                     image-archive`, `k3s ctr images import` read it)
#
# Environment: RUBATO_BASE (the Debian 12 base image; default debian:12 if present or pullable, else
# localhost/rubato-debian:bookworm, made with debootstrap from apt's Debian mirror and cached),
# RUBATO_BAZEL_FLAGS (extra Bazel flags for the builder, e.g. --local_cpu_resources=1),
# RUBATO_IMAGE_CACHE (default ~/.cache/rubato-image: the base's tarball, and the storage of a
# dockerd or podman that this script runs itself), RUBATO_DEBIAN_MIRROR (overrides the mirror).
#
# Docker: uses the daemon that DOCKER_HOST (or /var/run/docker.sock) reaches; when none answers, it
# starts dockerd itself, without network setup (--bridge=none, no iptables), its data under the
# cache directory, and stops it on exit; the image stays in that data root for the next run (use
# --smoke or --save to do something with it before the daemon goes). Podman: runc as the runtime,
# storage under the cache directory, lowered ulimits (crun and the default limits fail in some
# sandboxes). Every build step that needs apt runs with --network host. Idempotent: a rerun reuses
# the base image and the engine's layer cache (in its own store it tags the builder stage
# rubato-image-builder:* and prunes what earlier builds left untagged). Missing host tools
# (docker.io or podman and runc, debootstrap) are installed with apt. Processes started here
# inherit this script's niceness.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/../.."

tag=${RUBATO_IMAGE:-}
engine=${RUBATO_ENGINE:-}
gpu=0
smoke=0
save=
extra_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag=$2; shift 2 ;;
    --engine) engine=$2; shift 2 ;;
    --gpu) gpu=1; shift ;;
    --build-arg) extra_args+=(--build-arg "$2"); shift 2 ;;
    --smoke) smoke=1; shift ;;
    --save) save=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: error: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if [ "$gpu" = 1 ]; then
  dockerfile=deploy/Dockerfile.gpu
  tag=${tag:-rubato:gpu}
else
  dockerfile=deploy/Dockerfile
  tag=${tag:-rubato:cpu}
fi
cache=${RUBATO_IMAGE_CACHE:-$HOME/.cache/rubato-image}
local_base=localhost/rubato-debian:bookworm
mkdir -p "$cache"

log() { echo "build.sh: $*" >&2; }
die() { echo "build.sh: error: $*" >&2; exit 1; }

# Installs the given Debian packages when one of them is missing (as ./rubato setup does).
apt_install() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  local sudo=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    sudo=(sudo)
  fi
  log "installing ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
}

# Cleanup on any exit: the dockerd started here, a half-made base file system.
dockerd_pid=
scratch_rootfs=
cleanup() {
  local rc=$?
  if [ -n "$scratch_rootfs" ] && [ -d "$scratch_rootfs" ]; then rm -rf "$scratch_rootfs"; fi
  if [ -n "$dockerd_pid" ] && kill -0 "$dockerd_pid" 2>/dev/null; then
    log "stopping the dockerd started here (pid $dockerd_pid)"
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$dockerd_pid" 2>/dev/null; then
      log "dockerd did not stop in 30 s; killing it"
      kill -9 "$dockerd_pid" 2>/dev/null || true
    fi
    # What it leaves mounted (its network namespace file), innermost first.
    awk -v p="$cache/docker/" 'index($2, p) == 1 {print $2}' /proc/mounts | sort -r |
      while read -r m; do umount "$m" 2>/dev/null || true; done
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- the engine ---------------------------------------------------------------------------------

# Starts dockerd with its state under the cache directory unless a daemon already answers.
docker_up() {
  if docker info >/dev/null 2>&1; then return 0; fi
  if [ -n "${DOCKER_HOST:-}" ]; then die "DOCKER_HOST=$DOCKER_HOST does not answer"; fi
  apt_install docker.io
  local d=$cache/docker
  mkdir -p "$d"
  log "starting dockerd (state in $d, log $d/dockerd.log)"
  dockerd --data-root "$d/root" --exec-root "$d/exec" --pidfile "$d/dockerd.pid" \
    -H "unix://$d/docker.sock" --bridge=none --iptables=false --ip6tables=false \
    >"$d/dockerd.log" 2>&1 &
  dockerd_pid=$!
  export DOCKER_HOST=unix://$d/docker.sock
  for _ in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then return 0; fi
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 0.5
  done
  tail -n 20 "$d/dockerd.log" >&2
  die "dockerd did not come up"
}

if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v dockerd >/dev/null; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  else engine=docker
  fi
fi
case "$engine" in
  docker)
    command -v docker >/dev/null || apt_install docker.io
    docker_up
    eng=(docker)
    # The classic builder: BuildKit needs the buildx plugin, and it would pull its own images.
    export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
    run_opts=()
    ;;
  podman)
    apt_install podman runc
    eng=(podman --root "$cache/podman/root" --runroot "$cache/podman/run" --runtime runc)
    # Limits below the sandbox's own: podman fails to set equal or higher ones without
    # CAP_SYS_RESOURCE.
    run_opts=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
    ;;
  *) die "unknown engine '$engine' (docker or podman)" ;;
esac

image_exists() { "${eng[@]}" image inspect "$1" >/dev/null 2>&1; }
official_base=debian:12
[ "$engine" = podman ] && official_base=docker.io/library/debian:12

# --- the base image -----------------------------------------------------------------------------

# apt's Debian mirror here (one-line or deb822 sources), else deb.debian.org.
debian_mirror() {
  local kind=$1 url
  if [ "$kind" = security ]; then
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
      2>/dev/null | grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian-security/?' | head -n 1) || true
    echo "${url:-http://deb.debian.org/debian-security}"
  else
    url=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources \
      2>/dev/null | grep -v '^[[:space:]]*#' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -n 1) || true
    echo "${RUBATO_DEBIAN_MIRROR:-${url:-http://deb.debian.org/debian}}" | tr -d ' '
  fi
}

# Makes localhost/rubato-debian:bookworm from a debootstrap --variant=minbase file system, kept as
# a tarball in the cache so that a new engine store needs no second debootstrap.
make_local_base() {
  local tarball=$cache/base/rubato-debian-bookworm.tar
  if [ ! -s "$tarball" ]; then
    apt_install debootstrap debian-archive-keyring
    local mirror security
    mirror=$(debian_mirror main)
    security=$(debian_mirror security)
    mkdir -p "$cache/base"
    scratch_rootfs=$(mktemp -d "$cache/base/rootfs.XXXXXX")
    log "debootstrap --variant=minbase bookworm from $mirror (a few minutes)"
    debootstrap --variant=minbase bookworm "$scratch_rootfs" "$mirror" >"$cache/base/debootstrap.log" 2>&1 ||
      { tail -n 20 "$cache/base/debootstrap.log" >&2; die "debootstrap failed (log: $cache/base/debootstrap.log)"; }
    # The same sources as Debian's own image: the release, its updates and security.
    rm -f "$scratch_rootfs/etc/apt/sources.list"
    cat >"$scratch_rootfs/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    rm -rf "$scratch_rootfs"/var/lib/apt/lists/* "$scratch_rootfs"/var/cache/apt/*.bin \
      "$scratch_rootfs"/var/cache/apt/archives/*.deb "$scratch_rootfs"/var/log/*.log
    tar --numeric-owner -C "$scratch_rootfs" -cf "$tarball.tmp" .
    mv "$tarball.tmp" "$tarball"
    rm -rf "$scratch_rootfs"
    scratch_rootfs=
  fi
  log "importing $tarball as $local_base"
  if [ "$engine" = docker ]; then
    "${eng[@]}" import --change 'CMD ["/bin/bash"]' "$tarball" "$local_base" >/dev/null
  else
    "${eng[@]}" import --change 'CMD=["/bin/bash"]' "$tarball" "$local_base" >/dev/null
  fi
}

build_args=()
if [ "$gpu" = 0 ]; then
  base=${RUBATO_BASE:-}
  if [ -z "$base" ]; then
    if image_exists "$official_base"; then base=$official_base
    elif image_exists "$local_base"; then base=$local_base
    elif timeout 120 "${eng[@]}" pull "$official_base" >"$cache/pull.log" 2>&1; then base=$official_base
    else
      log "$official_base cannot be pulled ($(tail -n 1 "$cache/pull.log")); making $local_base"
      make_local_base
      base=$local_base
    fi
  elif ! image_exists "$base" && [ "$base" = "$local_base" ]; then
    make_local_base
  fi
  build_args+=(--build-arg "BASE=$base")
  log "base image: $base"
elif [ -n "${RUBATO_BASE:-}" ]; then
  build_args+=(--build-arg "BASE=$RUBATO_BASE")
fi

# --- the build ----------------------------------------------------------------------------------

version=$(git describe --always --dirty 2>/dev/null || echo dev)
revision=$(git rev-parse HEAD 2>/dev/null || true)
created=$(git log -1 --format=%cI 2>/dev/null || true)
build_args+=(--build-arg "BAZEL_FLAGS=${RUBATO_BAZEL_FLAGS:-}" --build-arg "VERSION=$version"
  --build-arg "REVISION=$revision" --build-arg "CREATED=$created" "${extra_args[@]}")

log "building $tag from $dockerfile with $engine"
start=$SECONDS
"${eng[@]}" build --network host "${run_opts[@]}" -f "$dockerfile" -t "$tag" "${build_args[@]}" .
log "built $tag in $((SECONDS - start)) s"
# In a store of this script's own, drop what earlier builds left untagged, but keep this build's
# builder stage (the apt and Bazel steps' cache) under a tag of its own: rebuilding it is all cache.
if [ -n "$dockerd_pid" ] || [ "$engine" = podman ]; then
  "${eng[@]}" build -q --network host "${run_opts[@]}" --target builder -f "$dockerfile" \
    -t "rubato-image-builder:$(printf '%s' "$tag" | tr '/:' '--')" "${build_args[@]}" . >/dev/null
  "${eng[@]}" image prune -f >/dev/null
fi

# --- optional smoke test and export -------------------------------------------------------------

if [ "$smoke" = 1 ]; then
  run=("${eng[@]}" run --rm --network host "${run_opts[@]}")
  "${run[@]}" "$tag" rubato_server --version
  "${run[@]}" "$tag" rubato_worker --version
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
    2>/dev/null || echo 47011)
  server=rubato-smoke-server-$$
  log "smoke job: rubato_server on 127.0.0.1:$port, one worker, 50 steps"
  "${eng[@]}" run -d --name "$server" --network host "${run_opts[@]}" "$tag" \
    rubato_server --listen="127.0.0.1:$port" --num_workers=1 >/dev/null
  worker_out=$(mktemp)
  worker_rc=0
  "${run[@]}" "$tag" rubato_worker --worker_id=0 --servers="127.0.0.1:$port" --num_workers=1 \
    --steps=50 --train_limit=2000 --test_limit=500 >"$worker_out" || worker_rc=$?
  server_rc=$(timeout 60 "${eng[@]}" wait "$server" 2>/dev/null || echo timeout)
  if [ "$server_rc" = timeout ]; then "${eng[@]}" stop -t 10 "$server" >/dev/null || true; fi
  server_log=$("${eng[@]}" logs "$server" 2>&1 || true)
  "${eng[@]}" rm -f "$server" >/dev/null 2>&1 || true
  grep -E '"event":"(start|eval|done)"' "$worker_out" | tail -n 3 || true
  printf '%s\n' "$server_log" | grep '"event":"stats"' | cut -c1-300 || true
  done_ok=0
  grep -q '"event":"done"' "$worker_out" && done_ok=1
  rm -f "$worker_out"
  if [ "$worker_rc" -ne 0 ] || [ "$done_ok" != 1 ] || [ "$server_rc" != 0 ]; then
    printf '%s\n' "$server_log" | tail -n 20 >&2
    die "smoke job failed: worker exit $worker_rc, done record $([ "$done_ok" = 1 ] && echo yes || echo no), server exit $server_rc"
  fi
  log "smoke job passed: worker exit 0 with a done record, server exit 0"
fi

if [ -n "$save" ]; then
  "${eng[@]}" save -o "$save" "$tag"
  log "saved $tag to $save ($(du -h "$save" | cut -f1))"
fi

"${eng[@]}" images "$tag"
size=$("${eng[@]}" image inspect -f '{{.Size}}' "$tag")
log "image $tag: $((size / 1000000)) MB ($size bytes)"
