#!/usr/bin/env bash
# Straggler experiment: 4 workers on Fashion-MNIST (MLP 784-256-10, batch 64 each), worker 3
# slowed 4x, every consistency model and the synchronous ring all-reduce baseline (no servers),
# plus straggler-free BSP and all-reduce runs. Reports the wall time until a
# worker first measured the target test accuracy (default 0.80), from each run's summary.json.
#
#   experiments/stragglers.sh [target] [extra ./rubato launch flags...]
#
# Every step has a compute floor (--min_step_ms) so that 4 workers on 2 cores behave like 4
# machines: the straggler's floor is stretched 4x by --slow_workers, and delays sleep.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-0.80}
[ $# -gt 0 ] && shift
./rubato build >/dev/null 2>&1
out=runs/stragglers-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
common=(--bin_dir bazel-bin --workers 4 --layers 784-256-10 --batch_size 64 --learning_rate 0.1
        --epochs 3 --eval_every 25 --log_every 25 --min_step_ms 20 --target_accuracy "$target"
        --timeout 900)
run() {
  local name=$1; shift
  python3 deploy/launch.py "${common[@]}" --run_dir "$out/$name" "$@" > "$out/$name.log" 2>&1 || {
    echo "$name: failed, see $out/$name.log" >&2; }
}
run bsp-no-straggler --mode bsp "$@"
run allreduce-no-straggler --mode allreduce "$@"
for mode in allreduce bsp backup:1 ssp:2 ssp:8 async; do
  run "${mode/:/-}" --mode "$mode" --slow_workers 3:4 "$@"
done
run async-staleness-aware --mode async --staleness_aware_lr true --slow_workers 3:4 "$@"
printf '%-24s %14s %10s %12s %10s %9s\n' run "time_to_${target}" final_acc wall_s dropped stale_mean
for s in "$out"/*/summary.json; do
  python3 - "$s" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
name = os.path.basename(os.path.dirname(sys.argv[1]))
ttt = d.get("time_to_target_s")
print("%-24s %14s %10s %12.1f %10d %9s" % (
    name, "%.1f s" % ttt if ttt is not None else "not reached",
    "%.4f" % d["test_accuracy"] if d.get("test_accuracy") is not None else "-",
    d["wall_s"], d.get("dropped_gradients", 0), d.get("mean_staleness_lower_bound", "-")))
PY
done
echo "runs in $out"
