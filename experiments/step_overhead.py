#!/usr/bin/env python3
"""What the parameter servers add to a worker's step: compute-only against the PS job.

    python3 experiments/step_overhead.py [--model cnn] [--backend cpu] [--steps 300]
        [--bin_dir bazel-bin] [--data_dir DIR] [--only NAME,...]

First the compute-only step: `model_benchmark` (forward and backward of one batch, no servers,
the median of its timed steps) on the backend (cpu: one thread, as each worker runs). Then one
job of 1 server and 2 workers on this host for each of these ways to push:

    no_overlap   --overlap=false: one push after the backward pass, then one pull
    per_layer    --push_bucket_kb=0 --comm_thread=false --layerwise_forward=false: each layer's
                 push started from the compute thread inside the backward pass, and every pull
                 waited for after it (the worker before issue 36)
    comm_thread  --push_bucket_kb=0 --layerwise_forward=false: each layer's push started on the
                 communication thread
    whole_pull   --layerwise_forward=false: the defaults (4 MiB buckets, communication thread),
                 but the next step's forward pass waits for every pull before it starts
    default      the worker's defaults: that forward pass waits for each layer's pull as it
                 reaches the layer

and prints, per job, the mean over the workers' step records (the first interval, which warms
up, left out) of the step time (1000 / steps_per_s), the compute, the waits for weights
(pull_ms: before the step or, layer by layer, inside its forward pass) and for the pushes after
the backward pass (push_ms), the time pushes were in flight (push_busy_ms) and the part of it
hidden behind compute (hidden_fraction), with the step time over the compute-only step.
Evaluation runs only at the end (--eval_every past the last step), so that no interval includes
one. Then, for each job that pushed in more than one piece, from its overlap records: how often
the first layer's weights for the next step were the last to arrive, and how much sooner a
forward pass waiting for its weights layer by layer could start than one waiting for all of them
(first_layer_wait: the most the default way can gain over whole_pull).

The figures are a benchmark's: compare them within one run (this machine is shared and noisy).
Under `experiments/gpu_check.sh run` the same script measures the GPU workers (--backend cuda),
and `--summarize RUN_DIR` prints the same figures for a run made elsewhere (its training jobs).
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WAYS = {
    "no_overlap": ["--overlap", "false"],
    "per_layer": ["--push_bucket_kb", "0", "--comm_thread", "false", "--layerwise_forward",
                  "false"],
    "comm_thread": ["--push_bucket_kb", "0", "--layerwise_forward", "false"],
    "whole_pull": ["--layerwise_forward", "false"],
    "default": [],
}


def compute_only_ms(args):
    """model_benchmark's median step on the backend, in ms."""
    # bazel-bin/worker/model/model_benchmark, or the GPU bundle's bin/worker/model_benchmark.
    paths = [os.path.join(args.bin_dir, "worker", d, "model_benchmark") for d in ("model", "")]
    binary = next((p for p in paths if os.path.exists(p)), paths[0])
    out = subprocess.run(
        [binary, "--model=" + args.model,
         "--batch=%d" % args.batch_size, "--backends=" + args.backend, "--reps=%d" % args.reps],
        check=True, capture_output=True, text=True).stdout
    return benchmark_step_ms(out)


def benchmark_step_ms(out):
    """The step time in model_benchmark's output (its first backend)."""
    match = re.search(r"^backend .*: step ([0-9.]+) ms", out, re.MULTILINE)
    if not match:
        sys.exit("step_overhead: no step time in model_benchmark's output:\n" + out)
    return float(match.group(1))


def worker_records(run_dir):
    """Each worker's progress records (its JSON lines), worker by worker."""
    for path in sorted(glob.glob(os.path.join(run_dir, "worker-*.jsonl"))):
        with open(path) as f:
            yield [json.loads(line) for line in f if line.startswith("{")]


def step_means(run_dir):
    """Means over both workers' step records after the first: step ms, compute, pull and push
    waits, push busy, hidden fraction."""
    steps = []
    for recs in worker_records(run_dir):
        steps += [r for r in recs if r.get("event") == "step"][1:]
    if not steps:
        sys.exit("step_overhead: no step records in " + run_dir)

    def mean(key):
        return sum(r.get(key, 0) for r in steps) / len(steps)

    return {"step_ms": sum(1000.0 / r["steps_per_s"] for r in steps) / len(steps),
            "compute_ms": mean("compute_ms"), "pull_ms": mean("pull_ms"),
            "push_ms": mean("push_ms"),
            "busy_ms": mean("push_busy_ms"), "hidden": mean("hidden_fraction")}


def first_layer_wait(run_dir):
    """From the workers' overlap records (one step's pushes each): in how many of them the push
    that started last, the one holding the first layer (whose gradient the backward pass computes
    last), was also the last whose pull of the next step's weights ended, and the mean time by
    which another push's pull ended after it: at most what a forward pass that waited for its
    weights layer by layer could start sooner than one that waits for all. Returns (records,
    first layer last, mean ms); records with fewer than two pushes do not count."""
    n = last = 0
    gain = 0.0
    for recs in worker_records(run_dir):
        for r in recs:
            pushes = r.get("pushes", []) if r.get("event") == "overlap" else []
            if len(pushes) < 2:
                continue
            first = max(range(len(pushes)), key=lambda i: pushes[i]["start_ms"])
            others = max(p["pulled_ms"] for i, p in enumerate(pushes) if i != first)
            n += 1
            last += pushes[first]["pulled_ms"] >= others
            gain += max(0.0, others - pushes[first]["pulled_ms"])
    return n, last, gain / n if n else 0.0


def first_layer_note(way, run_dir):
    """first_layer_wait's line for a job ("" when it pushed in one piece)."""
    n, last, gain = first_layer_wait(run_dir)
    if not n:
        return ""
    return ("%s: the first layer's weights came last in %d of %d sampled steps; a forward waiting "
            "layer by layer could have started %.3f ms sooner on average" % (way, last, n, gain))


def summarize(run_dir):
    """The figures of a run made elsewhere (experiments/gpu_check.sh's jobs)."""
    m = step_means(run_dir)
    print("step %.2f ms, compute %.2f ms, pull wait %.2f ms, push wait %.2f ms, in flight %.2f ms, "
          "hidden %.2f" % (m["step_ms"], m["compute_ms"], m["pull_ms"], m["push_ms"], m["busy_ms"],
                           m["hidden"]))
    note = first_layer_note("this run", run_dir)
    if note:
        print(note)


def run_job(args, flags):
    """One job; returns its run directory."""
    runs = os.path.join(ROOT, "runs")
    before = set(glob.glob(os.path.join(runs, "*/")))
    cmd = [sys.executable, os.path.join(ROOT, "deploy", "launch.py"), "--bin_dir", args.bin_dir,
           "--servers", "1", "--workers", "2", "--model", args.model, "--backend", args.backend,
           "--batch_size", str(args.batch_size), "--steps", str(args.steps), "--log_every",
           str(args.log_every), "--eval_every", str(args.steps + 1), "--optimizer", "adam",
           "--learning_rate", "0.001"] + flags
    if args.data_dir:
        cmd += ["--data_dir", args.data_dir]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    new = sorted(set(glob.glob(os.path.join(runs, "*/"))) - before)
    if not new:
        sys.exit("step_overhead: the launcher made no run directory")
    return new[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--reps", type=int, default=10, help="model_benchmark's timed steps")
    parser.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    parser.add_argument("--data_dir", default="")
    parser.add_argument("--only", default="", help="comma-separated ways (default: all)")
    parser.add_argument("--summarize", default="", metavar="RUN_DIR",
                        help="only print the figures of a run made elsewhere")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return
    ways = [w for w in args.only.split(",") if w] or list(WAYS)
    unknown = [w for w in ways if w not in WAYS]
    if unknown:
        parser.error("unknown way %s (known: %s)" % (", ".join(unknown), ", ".join(WAYS)))
    if args.steps < 3 * args.log_every:
        parser.error("--steps must be at least 3 x --log_every (the first interval is left out)")

    alone = compute_only_ms(args)
    print("model %s, backend %s, batch %d per worker, 1 server, 2 workers, %d steps" %
          (args.model, args.backend, args.batch_size, args.steps))
    print("compute-only step (model_benchmark, median of %d): %.2f ms" % (args.reps, alone))
    print("%-12s %9s %11s %9s %9s %9s %7s %14s" % ("way", "step ms", "compute ms", "pull ms",
                                                    "push ms", "busy ms", "hidden",
                                                    "step/compute"))
    notes = []
    for way in ways:
        run = run_job(args, WAYS[way])
        m = step_means(run)
        print("%-12s %9.2f %11.2f %9.2f %9.2f %9.2f %7.2f %13.3fx" %
              (way, m["step_ms"], m["compute_ms"], m["pull_ms"], m["push_ms"], m["busy_ms"],
               m["hidden"], m["step_ms"] / alone))
        sys.stdout.flush()
        notes.append(first_layer_note(way, run))
    for note in filter(None, notes):
        print(note)


if __name__ == "__main__":
    main()
