#!/usr/bin/env bash
# The long fuzz run, through `bazel run --config=fuzz //fuzz:<harness>_long [-- libFuzzer flags]`:
# RUNS executions (flags after -- override, e.g. -runs=-1 -max_total_time=3600) over a fresh copy
# of the seed corpus in a new temporary folder, which keeps the grown corpus and any crashing input.
# Prints libFuzzer's final statistics.
#
#   run_fuzzer_long.sh FUZZER CORPUS_DIR RUNS [libFuzzer flags]
set -euo pipefail
fuzzer=$1
corpus=$2
runs=$3
shift 3
name=$(basename "$fuzzer")
work=$(mktemp -d "${TMPDIR:-/tmp}/rubato-$name-XXXXXX")
mkdir -p "$work/corpus"
cp -L "$corpus"/* "$work/corpus/"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export ASAN_SYMBOLIZER_PATH=${ASAN_SYMBOLIZER_PATH:-/usr/bin/llvm-symbolizer-14}
echo "$name: $runs executions; corpus and crashes in $work" >&2
rc=0
"$fuzzer" -runs="$runs" -timeout=30 -rss_limit_mb=4096 -close_fd_mask=2 -print_final_stats=1 \
  -artifact_prefix="$work/" "$@" "$work/corpus" || rc=$?
echo "$name: libFuzzer exited with status $rc; corpus now $(ls "$work/corpus" | wc -l) inputs;" \
  "crashing inputs: $(ls "$work" | grep -c -E '^(crash|leak|timeout|oom)-' || true) (in $work)" >&2
exit "$rc"
