#!/usr/bin/env bash
# All-reduce algorithm bandwidth, side by side in one run: Rubato's ring over its TCP data plane
# and over gRPC streams (//experiments:allreduce_benchmark), OpenMPI's MPI_Allreduce over TCP
# (--mca btl tcp,self) and Gloo's ring (AllreduceRing over its TCP transport), for 1, 16 and 64 MB with 2 and 4 ranks on
# 127.0.0.1, plus the ring bound 2(N-1)/N * S/B from a loopback TCP stream measured by the Rubato
# binary. Installs openmpi-bin, libopenmpi-dev and libgloo-dev if missing and builds the peers
# (experiments/peers/) itself.
#
#   experiments/allreduce_peers.sh [REPEATS]   (default 5; about a minute each)
set -euo pipefail
repeats=${1:-5}
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
: > "$work/rubato"
# Interleaved repeats: this machine is shared and noisy, and single runs of every peer (Rubato's
# included) were seen to differ by 2x at 1 MB. The table gives each cell's median over the repeats.
for ((rep = 1; rep <= repeats; rep++)); do
  echo "repeat $rep of $repeats" >&2
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
  bazel-bin/experiments/allreduce_benchmark --seconds=1 2>/dev/null | tee -a "$work/rubato" >&2
done
python3 - "$results" "$work/rubato" "$repeats" <<'PY'
import re, statistics, sys
peers, checks = {}, {}
for line in open(sys.argv[1]):
    name, ranks, mb, seconds, check = line.split()
    key = (name, int(ranks), int(mb))
    peers.setdefault(key, []).append(int(mb) * 1024 * 1024 / float(seconds) / 1e9)
    checks.setdefault(key, []).append(check)
rubato, bound = {}, []
for line in open(sys.argv[2]):
    m = re.match(r"(\d+)MB\s+(\d+)\s+([\d.]+) ms\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+(\w+)", line)
    if m:
        rubato.setdefault((m.group(6), int(m.group(2)), int(m.group(1))), []).append(float(m.group(4)))
        bound.append(float(m.group(5)) * 2 * (int(m.group(2)) - 1) / int(m.group(2)))
def med(table, key):
    v = table.get(key)
    return statistics.median(v) if v else float("nan")
print("\nAlgorithm bandwidth in GB/s, median of %s interleaved repeats (loopback stream median %.2f GB/s)"
      % (sys.argv[3], statistics.median(bound) if bound else float("nan")))
print("%-6s %-6s %10s %10s %10s %10s %11s %11s" % (
    "size", "ranks", "tcp", "grpc", "mpi", "gloo", "t tcp/mpi", "t grpc/mpi"))
for ranks in (2, 4):
    for mb in (1, 16, 64):
        tcp, grpc = med(rubato, ("tcp", ranks, mb)), med(rubato, ("grpc", ranks, mb))
        mpi, gloo = med(peers, ("mpi", ranks, mb)), med(peers, ("gloo", ranks, mb))
        print("%-6s %-6d %10.3f %10.3f %10.3f %10.3f %11.2f %11.2f" % (
            "%dMB" % mb, ranks, tcp, grpc, mpi, gloo, mpi / tcp, mpi / grpc))
print("\nEvery repeat (GB/s):")
for key in sorted(set(rubato) | set(peers), key=lambda k: (k[1], k[2], k[0])):
    values = rubato.get(key) or peers.get(key)
    print("  %-5s %d ranks %2d MB: %s" % (key[0], key[1], key[2], " ".join("%.3f" % v for v in values)))
bad = [k for k, v in checks.items() if any(c != "ok" for c in v)]
if bad:
    print("peer results WRONG for", bad)
PY
