#!/usr/bin/env bash
# gpu_check.sh: every GPU check and benchmark of the CUDA backend in one run, sized for a short
# lease of a GPU machine (minutes, not hours).
#
#   experiments/gpu_check.sh bundle   # here, on the build machine
#   experiments/gpu_check.sh run      # there, on the GPU machine, from the repository root
#
# Why two halves: the GPU machine has the NVIDIA driver, nvcc and libcublas, but not Bazel, gRPC,
# protobuf or Abseil, and no network. So `bundle` builds here with CUDA (nvcc 13, sm_80 and sm_90
# code plus PTX), statically for Rubato's own libraries (--dynamic_mode=off), and copies into
# .gpu_bundle/ (git-ignored) the binaries, the system libraries they load (gRPC, protobuf,
# Abseil, OpenSSL, ...; not glibc) and Fashion-MNIST. cuBLAS is not carried: the worker loads the
# GPU machine's libcublas.so.13 at run time (worker/model/cuda/cublas_api.h).
#
# `run` then, with the bundle:
#   1. shows the GPU (nvidia-smi) and where libcublas.so.13 is;
#   2. runs the CUDA tests: cuda_device_test, cuda_backend_test (CUDA against the CPU reference,
#      per layer and for a whole CNN step, within 1e-4), cpu_backend_test;
#   3. runs model_benchmark: the CNN step and each layer on cpu (1 thread and all cores) and
#      cuda, each GEMM layer beside cuBLAS on the same shape and cuBLAS's SGEMM peak;
#   4. trains the CNN for one epoch with 1 server and 2 CUDA workers on this machine (Adam 1e-3,
#      batch 64 per worker);
#   5. overlap: experiments/step_overhead.py with the CUDA workers, for the CNN at batch 256 and
#      the residual CNN (--model=resnet) at batch 256: the compute-only step (model_benchmark),
#      then 1 server and 2 workers pushing five ways (no overlap; per layer from the compute
#      thread; per layer from the communication thread; the defaults with the forward pass
#      waiting for every pull; the defaults, waiting layer by layer), each with its step time,
#      compute, exposed pull and push waits, time in flight, hidden fraction and step over
#      compute-only.
#      The per-layer times are step 3's tables.
# `run SECTION...` runs only some of them: tests, bench, epoch, overlap, and epochs5 (five epochs,
# for the accuracy the CNN reaches; not in the default run).
# Everything is logged to $OUT/gpu_check.log (or ./gpu_check.log) and the runs' records to
# $OUT/gpu_runs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=.gpu_bundle

bundle() {
  set -e
  local targets=(//worker:rubato_worker //server:rubato_server //worker/model:model_benchmark
                 //worker/model/cuda:cuda_backend_test //worker/model/cuda:cuda_device_test
                 //worker/model:cpu_backend_test)
  bazel build -c opt --dynamic_mode=off "${targets[@]}"
  rm -rf "$BUNDLE"
  mkdir -p "$BUNDLE/bin/worker" "$BUNDLE/bin/server" "$BUNDLE/lib" "$BUNDLE/data"
  # Not rubato_worker_avx2 (the carry's 64 MiB has no room for it): the GPU workers run the
  # baseline build, whose CPU work is small there, and say so in their logs.
  cp bazel-bin/worker/rubato_worker bazel-bin/worker/model/model_benchmark \
     bazel-bin/worker/model/cpu_backend_test "$BUNDLE/bin/worker/"
  cp bazel-bin/server/rubato_server "$BUNDLE/bin/server/"
  cp bazel-bin/worker/model/cuda/cuda_backend_test bazel-bin/worker/model/cuda/cuda_device_test \
     "$BUNDLE/bin/worker/"
  chmod u+w "$BUNDLE"/bin/*/*
  strip "$BUNDLE"/bin/*/*
  # Every shared library the binaries load, except glibc's own (the GPU machine's newer glibc
  # runs binaries linked against Debian 12's).
  ldd "$BUNDLE"/bin/*/* | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|ld-linux-x86-64)\.so' |
    while read -r lib; do cp -L "$lib" "$BUNDLE/lib/"; done
  # glibc too with RUBATO_GPU_GLIBC=1, for a GPU machine whose own is older than Debian 12's 2.36
  # (see run; the H200 machines so far had a newer one). Off by default: the device tool carries
  # at most 64 MiB with the working tree, and the bundle alone is about 62 MiB without it (most of
  # it Fashion-MNIST); with the tree's 9 MiB it is still over, so on 2026-12-04 experiments/results/
  # (5 MiB, not needed there) was moved aside for the call and put back after.
  mkdir -p "$BUNDLE/glibc"
  if [ "${RUBATO_GPU_GLIBC:-0}" = 1 ]; then
    for lib in /lib/x86_64-linux-gnu/{libc,libm,libdl,libpthread,librt,libresolv}.so.* \
               /lib64/ld-linux-x86-64.so.2; do
      cp -L "$lib" "$BUNDLE/glibc/"
    done
  fi
  cp /usr/share/datasets/fashion-mnist/*.gz "$BUNDLE/data/"
  du -sh "$BUNDLE" "$BUNDLE"/*
  echo "bundle ready: carry $BUNDLE to the GPU machine and run: experiments/gpu_check.sh run"
}

# Runs "$@" with a header and its wall time in the log.
step() {
  echo
  echo "=== $* ==="
  local t0=$SECONDS
  "$@"
  local rc=$?
  echo "=== rc=$rc, $((SECONDS - t0)) s ==="
  return 0
}

find_cublas() {
  local d
  for d in "${RUBATO_CUBLAS_DIR:-}" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
           /usr/lib/x86_64-linux-gnu; do
    if [ -n "$d" ] && [ -e "$d/libcublas.so.13" ]; then echo "$d"; return; fi
  done
  # PyTorch's pip wheels carry one too.
  find / -xdev -name 'libcublas.so.13' 2>/dev/null | head -1 | xargs -r dirname
}

train() {  # train NAME LAUNCH_FLAGS...
  local name=$1; shift
  python3 deploy/launch.py --bin_dir "$BUNDLE/bin" --data_dir "$BUNDLE/data" \
    --servers 1 --workers 2 --model cnn --backend cuda --batch_size 64 \
    --optimizer adam --learning_rate 0.001 "$@"
  local last
  last=$(ls -td runs/*/ | head -1)
  mkdir -p "$RUNS/$name"
  cp "$last"/*.jsonl "$last"/summary.json "$last"/*.log "$RUNS/$name/" 2>/dev/null
  # Step time, compute, exposed pull and push waits and hidden fraction, over the step records.
  python3 experiments/step_overhead.py --summarize "$last"
}

run() {  # run [SECTION...]: tests bench epoch overlap (the default), epochs5
  local out=${OUT:-.}
  RUNS=$(mktemp -d)
  exec > >(tee "$out/gpu_check.log") 2>&1
  [ -x "$BUNDLE/bin/worker/rubato_worker" ] || { echo "no $BUNDLE: run '$0 bundle' first"; exit 2; }
  export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Binaries built against Debian 12's glibc 2.36: where the machine's glibc is older, each one
  # is started through the carried loader and glibc instead (a wrapper script in its place).
  if ! "$BUNDLE/bin/worker/cpu_backend_test" --gtest_list_tests >/dev/null 2>&1; then
    echo "the bundle's binaries do not start with this machine's glibc: using the carried one"
    [ -e "$BUNDLE/glibc/libc.so.6" ] || { echo "no glibc in $BUNDLE: bundle with RUBATO_GPU_GLIBC=1"; exit 2; }
    local b
    for b in "$BUNDLE"/bin/*/*; do
      mv "$b" "$b.real"
      printf '#!/bin/sh\nexec "%s/glibc/ld-linux-x86-64.so.2" --library-path "%s/glibc:%s/lib" "%s.real" "$@"\n' \
        "$PWD/$BUNDLE" "$PWD/$BUNDLE" "$PWD/$BUNDLE" "$PWD/$b" > "$b"
      chmod +x "$b"
    done
  fi
  RUBATO_CUBLAS_DIR=$(find_cublas)
  export RUBATO_CUBLAS_DIR
  step nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  echo "libcublas.so.13 in: ${RUBATO_CUBLAS_DIR:-not found}"
  local section t sections=("$@")
  [ ${#sections[@]} -gt 0 ] || sections=(tests bench epoch overlap)
  for section in "${sections[@]}"; do
    case $section in
      tests)
        for t in cuda_device_test cuda_backend_test cpu_backend_test; do
          step "$BUNDLE/bin/worker/$t" --gtest_brief=0
        done
        # A device index past the last GPU: exit 2 naming --cuda_device, not a fallback.
        step "$BUNDLE/bin/worker/rubato_worker" --worker_id=0 --num_workers=1 \
          --servers=127.0.0.1:1 --data_dir="$BUNDLE/data" --backend=auto --cuda_device=64 ;;
      bench)
        step "$BUNDLE/bin/worker/model_benchmark" --model=cnn --batch=64 \
          --backends=cpu,cpu:0,cuda
        step "$BUNDLE/bin/worker/model_benchmark" --model=cnn --batch=256 \
          --backends=cpu:0,cuda --reps=5
        step "$BUNDLE/bin/worker/model_benchmark" --model=resnet --batch=256 \
          --backends=cuda --reps=5 ;;
      epoch) step train epoch --epochs 1 ;;
      overlap)
        for model in cnn resnet; do
          step python3 experiments/step_overhead.py --bin_dir "$BUNDLE/bin" \
            --data_dir "$BUNDLE/data" --backend cuda --model "$model" --batch_size 256 \
            --steps 600 --log_every 100
        done ;;
      epochs5) step train epochs5 --epochs 5 --log_every 100 ;;
      *) echo "unknown section $section" ;;
    esac
  done
  tar -C "$RUNS" -czf "$out/gpu_runs.tar.gz" .
  echo "done: $out/gpu_check.log, $out/gpu_runs.tar.gz"
}

case "${1:-}" in
  bundle) bundle ;;
  run) shift; run "$@" ;;
  *) echo "usage: $0 bundle|run" >&2; exit 2 ;;
esac
