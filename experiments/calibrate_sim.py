"""The simulator's calibration from one real worker (issue 34): what a step computes and what the
loopback transport costs, measured on this machine by two short real jobs of one worker and one
server (./rubato launch, no compute floor, pushes not overlapped with the backward pass, as in
the suites whose floors turn overlap off), and turned into rubato_sim's flags.

    python3 experiments/calibrate_sim.py [--layers 784-256-10] [--steps 400] [--out FILE.json]

  compute_ms           the real worker's mean forward and backward pass (its step records)
  loopback_latency_us  a pull or push of a model of a few kB costs two one-way latencies (the
                       request, the answer): L = mean(pull_ms, push_ms) / 2 of the tiny model
  loopback_gbps        a pull or push of the real model costs 2 L + B / R: R = B / (mean(pull_ms,
                       push_ms) - 2 L), B the model's bytes (4 a parameter)
  eval_ms              one evaluation of the test set, as rubato_sim times it on this machine
                       (the median of 3; a real worker's records do not time their evaluations)
  cores                this machine's processors, which a local launch's processes share

Each figure is the median over the run's step records (a shared machine's stray slow steps move a
mean, not a median); the first record (start-up, first touches of memory) is left out. It prints the
figures and the flags (`--sim_flag=...` for `./rubato experiment --simulate`) as one JSON object,
and writes it to --out. Nothing about a suite's cells goes into it: one worker, alone."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from experiments import analysis  # noqa: E402

LAUNCH = os.path.join(ROOT, "deploy", "launch.py")
TINY_LAYERS = "784-1-10"


def one_worker(bin_dir, layers, steps, run_dir, data_dir, min_step_ms):
    """Median compute_ms, pull_ms and push_ms of a real one-worker job's step records."""
    argv = [sys.executable, LAUNCH, "--bin_dir", bin_dir, "--run_dir", run_dir, "--servers", "1",
            "--workers", "1", "--layers", layers, "--steps", str(steps), "--log_every", "50",
            "--eval_every", str(10 * steps), "--timeout", "600", "--overlap", "false"]
    if data_dir:
        argv += ["--data_dir", data_dir]
    if min_step_ms:
        argv += ["--min_step_ms", str(min_step_ms)]
    with open(run_dir + ".log", "w") as log:
        rc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise RuntimeError("the calibration job (%s) failed: see %s.log" % (layers, run_dir))
    records = analysis.worker_records(run_dir, "step", "pull_ms").get(0, [])[1:]
    if not records:
        raise RuntimeError("the calibration job (%s) wrote no step records" % layers)
    start = analysis.worker_records(run_dir, "start", "parameters").get(0, [])
    if not start:
        raise RuntimeError("the calibration job (%s) wrote no start record" % layers)
    median = lambda key: statistics.median(float(r[key]) for r in records)  # noqa: E731
    return {"compute_ms": median("compute_ms"), "pull_ms": median("pull_ms"),
            "push_ms": median("push_ms"), "steps": steps, "records": len(records), "layers": layers,
            "parameters": int(start[0]["parameters"])}


def eval_ms(bin_dir, layers, run_dir, data_dir):
    """rubato_sim's own timing of one evaluation (the median of 3) on this machine."""
    argv = [os.path.join(bin_dir, "sim", "rubato_sim"), "--run_dir=" + run_dir,
            "--num_workers=1", "--layers=" + layers, "--steps=1", "--compute_ms=1"]
    if data_dir:
        argv.append("--data_dir=" + data_dir)
    proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["eval_ms"]
    except (IndexError, KeyError, ValueError):
        raise RuntimeError("rubato_sim could not time an evaluation: %s" % (
            proc.stderr.strip() or "no output"))


def calibrate(bin_dir, layers, steps, data_dir=None, min_step_ms=0):
    with tempfile.TemporaryDirectory() as tmp:
        big = one_worker(bin_dir, layers, steps, os.path.join(tmp, "model"), data_dir,
                         min_step_ms)
        tiny = one_worker(bin_dir, TINY_LAYERS, steps, os.path.join(tmp, "tiny"), data_dir,
                          min_step_ms)
        evaluation = eval_ms(bin_dir, layers, os.path.join(tmp, "eval"), data_dir)
    return derive(big, tiny, evaluation, min_step_ms, os.cpu_count() or 1)


def derive(big, tiny, evaluation, min_step_ms, cores):
    """The flags from the two runs' figures: L from the tiny model, R from the real one."""
    latency_ms = (tiny["pull_ms"] + tiny["push_ms"]) / 4
    model_bytes = 4 * big["parameters"]  # As the worker counts them (its start record).
    transfer_ms = (big["pull_ms"] + big["push_ms"]) / 2 - 2 * latency_ms
    if transfer_ms <= 0:
        raise RuntimeError("the model's pulls and pushes (%.3f, %.3f ms) took no longer than the "
                           "tiny model's (%.3f, %.3f ms): no rate can be measured (a busy "
                           "machine? run it again on a quiet one)" % (
                               big["pull_ms"], big["push_ms"], tiny["pull_ms"], tiny["push_ms"]))
    gbps = model_bytes * 8 / (transfer_ms * 1e-3) / 1e9
    out = {"model": big, "tiny": tiny, "model_bytes": model_bytes,
           "compute_ms": round(big["compute_ms"], 4),
           "loopback_latency_us": round(1e3 * latency_ms, 2), "loopback_gbps": round(gbps, 3),
           "eval_ms": round(evaluation, 3), "min_step_ms": min_step_ms, "cores": cores}
    out["sim_flags"] = ["--compute_ms=%s" % out["compute_ms"], "--eval_ms=%s" % out["eval_ms"],
                        "--loopback_latency_us=%s" % out["loopback_latency_us"],
                        "--loopback_gbps=%s" % out["loopback_gbps"],
                        "--cores=%d" % out["cores"]]
    return out


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    p.add_argument("--layers", default="784-256-10")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--data_dir", default=None)
    p.add_argument("--min_step_ms", type=float, default=0,
                   help="The suite's compute floor: the worker sleeps up to it every step, as in "
                        "the suite (a transfer after a sleep finds colder caches than one in a "
                        "busy loop).")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.steps < 100:
        p.error("--steps must be >= 100 (the first 50 are left out)")
    try:
        result = calibrate(args.bin_dir, args.layers, args.steps, args.data_dir,
                           args.min_step_ms)
    except RuntimeError as e:
        print("calibrate_sim: error: %s" % e, file=sys.stderr)
        return 1
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
