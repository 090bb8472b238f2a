#!/usr/bin/env bash
# All-reduce algorithm bandwidth, side by side in one run: Rubato's ring over gRPC
# (//experiments:allreduce_benchmark), OpenMPI's MPI_Allreduce over TCP (--mca btl tcp,self) and
# Gloo's ring (AllreduceRing over its TCP transport), for 1, 16 and 64 MB with 2 and 4 ranks on
# 127.0.0.1, plus the ring bound 2(N-1)/N * S/B from a loopback TCP stream measured by the Rubato
# binary. Installs openmpi-bin, libopenmpi-dev and libgloo-dev if missing and builds the peers
# (experiments/peers/) itself.
#
#   experiments/allreduce_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
for p in openmpi-bin libopenmpi-dev libgloo-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_allreduce" experiments/peers/mpi_allreduce.c
g++ -O2 -std=c++17 -o "$work/gloo_allreduce" experiments/peers/gloo_allreduce.cc -lgloo -lpthread
bazel build --noshow_progress //experiments:allreduce_benchmark >/dev/null 2>&1
results="$work/results"
: > "$results"
for ranks in 2 4; do
  timeout 300 mpirun --oversubscribe --allow-run-as-root --mca btl tcp,self \
    --mca btl_tcp_if_include lo -np "$ranks" "$work/mpi_allreduce" >> "$results"
  store=$(mktemp -d -p "$work")
  pids=()
  for ((r = 1; r < ranks; r++)); do
    timeout 300 "$work/gloo_allreduce" "$r" "$ranks" "$store" > /dev/null & pids+=($!)
  done
  timeout 300 "$work/gloo_allreduce" 0 "$ranks" "$store" >> "$results"
  wait "${pids[@]}"
done
bazel-bin/experiments/allreduce_benchmark --seconds=2 2>/dev/null | tee "$work/rubato"
python3 - "$results" "$work/rubato" <<'PY'
import re, sys
peers = {}
for line in open(sys.argv[1]):
    name, ranks, mb, seconds, check = line.split()
    peers[(name, int(ranks), int(mb))] = (float(seconds), check)
rubato, bound = {}, {}
for line in open(sys.argv[2]):
    m = re.match(r"(\d+)MB\s+(\d+)\s+([\d.]+) ms\s+([\d.]+)\s+([\d.]+)", line)
    if m:
        key = (int(m.group(2)), int(m.group(1)))
        rubato[key], bound[key] = float(m.group(4)), float(m.group(5))
print("\n%-6s %-6s %12s %12s %12s %12s %14s %14s" % (
    "size", "ranks", "rubato GB/s", "mpi GB/s", "gloo GB/s", "bound GB/s", "rubato/gloo",
    "t rubato/mpi"))
for ranks in (2, 4):
    for mb in (1, 16, 64):
        s = mb * 1024 * 1024
        alg = lambda n: s / peers[(n, ranks, mb)][0] / 1e9 if (n, ranks, mb) in peers else float("nan")
        r = rubato.get((ranks, mb), float("nan"))
        print("%-6s %-6d %12.3f %12.3f %12.3f %12.3f %14.2f %14.2f" % (
            "%dMB" % mb, ranks, r, alg("mpi"), alg("gloo"), bound.get((ranks, mb), float("nan")),
            r / alg("gloo"), alg("mpi") / r))
bad = [k for k, v in peers.items() if v[1] != "ok"]
if bad:
    print("peer results WRONG for", bad)
PY
