#!/usr/bin/env bash
# A bounded fuzz test: runs a libFuzzer harness for RUNS executions over a fresh copy of its seed
# corpus. Fails on a crash, a leak, a timeout or a broken invariant (libFuzzer exits non-zero and
# saves the input under the test's undeclared outputs, bazel-testlogs/fuzz/<test>/test.outputs),
# and when the binary is not a libFuzzer build (it then prints no "Done N runs" line).
#
#   run_fuzzer_test.sh FUZZER CORPUS_DIR RUNS [libFuzzer flags, e.g. -dict=FILE]
set -euo pipefail
fuzzer=$1
corpus=$2
runs=$3
shift 3
name=$(basename "$fuzzer")
tmp=${TEST_TMPDIR:-$(mktemp -d)}
work="$tmp/corpus"
mkdir -p "$work"
cp -L "$corpus"/* "$work"/
artifacts=${TEST_UNDECLARED_OUTPUTS_DIR:-$tmp}
log="$tmp/fuzz.log"
# -close_fd_mask=2 silences the code under test's own stderr (the shard's log lines); libFuzzer's
# and the sanitizers' reports still come through.
rc=0
"$fuzzer" -runs="$runs" -seed=1 -timeout=30 -rss_limit_mb=4096 -close_fd_mask=2 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$@" "$work" >"$log" 2>&1 || rc=$?
# The log without libFuzzer's per-input progress lines and its recommended dictionary.
grep -v -E '^#[0-9]+\s+(NEW|REDUCE|pulse)' "$log" | sed '/^###### Recommended dictionary/,/^###### End/d' || true
if [ "$rc" -ne 0 ]; then
  echo "$name: FAILED: libFuzzer exited with status $rc; inputs saved under $artifacts" >&2
  ls -l "$artifacts" >&2 || true
  exit 1
fi
if ! grep -q -E '^Done [0-9]+ runs' "$log"; then
  echo "$name: FAILED: no 'Done N runs' line: not a libFuzzer build? (use --config=fuzz)" >&2
  exit 1
fi
executed=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
echo "$name: ${executed:-?} executions (${speed:-?}/s), 0 crashes"
