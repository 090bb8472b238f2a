#!/usr/bin/env python3
"""Sharpness of small-batch and large-batch minima (Keskar et al. 2017, issue 15).

Trains the same model with the same recipe at each global batch (4 workers, bsp, SGD with momentum
and square-root LR scaling from a rate tuned at 64, one epoch of warmup), exports each final model
(--export_model), and measures its epsilon-sharpness with `rubato_worker --sharpness` (the largest
relative loss increase in a box of size eps (|x| + 1) around the weights, found by projected
gradient ascent; worker/model/sharpness.h) on the first training examples. Writes sharpness.json (every
run) and sharpness.md (the table per batch: mean and 95% interval over seeds) into --out.

    python3 experiments/sharpness.py [--batches 64,4096] [--seeds 3] [--epochs 5]
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from experiments import stats  # noqa: E402

LAUNCH = os.path.join(ROOT, "deploy", "launch.py")
WORKERS = 4


def recipe(batch, epochs, seed):
    """The launcher's flags for one run at global `batch`."""
    per_worker = batch // WORKERS
    # About 40 evaluations a run at any batch (they cost the same whatever the batch).
    steps = epochs * 60000 // batch
    return ["--workers", str(WORKERS), "--batch_size", str(per_worker), "--epochs", str(epochs),
            "--optimizer", "sgd", "--momentum", "0.9", "--learning_rate", "0.05",
            "--lr_reference_batch", "64", "--lr_scaling", "sqrt", "--warmup_epochs", "1",
            "--eval_every", str(max(1, steps // 40)), "--log_every", "5", "--seed", str(seed)]


def sharpness(bin_dir, model, epsilons, steps, examples):
    """rubato_worker --sharpness's records, one per epsilon."""
    out = subprocess.run(
        [os.path.join(bin_dir, "worker", "rubato_worker"), "--sharpness", model,
         "--sharpness_epsilon", epsilons, "--sharpness_steps", str(steps),
         "--sharpness_examples", str(examples)],
        check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if '"event":"sharpness"' in line]


def table(runs, epsilons):
    """Markdown: one row per global batch, mean ± 95% interval over its seeds."""
    header = ["global batch", "runs", "test accuracy", "training loss at the weights"] + [
        "sharpness, eps %s" % e for e in epsilons]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch in sorted({r["global_batch"] for r in runs}):
        mine = [r for r in runs if r["global_batch"] == batch]

        def cell(values, digits):
            lo, hi = stats.ci95(values) if len(values) > 1 else (None, None)
            m = sum(values) / len(values)
            return "%.*f" % (digits, m) if lo is None else "%.*f ± %.*f" % (
                digits, m, digits, (hi - lo) / 2)

        row = [str(batch), str(len(mine)), cell([r["test_accuracy"] for r in mine], 4),
               cell([r["sharpness"][0]["loss"] for r in mine], 4)]
        for k in range(len(epsilons)):
            row.append(cell([r["sharpness"][k]["sharpness"] for r in mine], 2))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv):
    p = argparse.ArgumentParser(prog="experiments/sharpness.py", description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,4096", help="Global batches, comma-separated.")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--epsilons", default="1e-3,5e-4")
    p.add_argument("--ascent_steps", type=int, default=10)
    p.add_argument("--examples", type=int, default=10000)
    p.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error("--batches: expected comma-separated integers, got %r" % args.batches)
    if any(b < WORKERS or b % WORKERS for b in batches) or args.seeds < 1 or args.epochs < 1:
        p.error("every batch must be a multiple of %d workers; --seeds and --epochs >= 1" % WORKERS)
    out = args.out or os.path.join(ROOT, "runs", "experiments",
                                   "sharpness-%s" % time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    runs = []
    for batch in batches:
        for seed in range(1, args.seeds + 1):
            name = "batch-%d.seed-%d" % (batch, seed)
            run_dir = os.path.join(out, "runs", name)
            model = os.path.join(out, name + ".rubato")
            began = time.monotonic()
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            with open(run_dir + ".log", "w") as log:
                subprocess.run([sys.executable, LAUNCH, "--bin_dir", args.bin_dir, "--run_dir",
                                run_dir, "--export_model", model, "--refresh", "5"] +
                               recipe(batch, args.epochs, seed),
                               stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            try:
                with open(os.path.join(run_dir, "summary.json")) as f:
                    summary = json.load(f)
            except (OSError, ValueError):
                raise SystemExit("%s: no summary.json (see %s.log)" % (name, run_dir))
            if not summary.get("ok"):
                raise SystemExit("%s failed: %s" % (name, summary.get("error")))
            records = sharpness(args.bin_dir, model, args.epsilons, args.ascent_steps,
                                args.examples)
            runs.append({"name": name, "global_batch": batch, "seed": seed,
                         "test_accuracy": summary["test_accuracy"], "sharpness": records})
            print("%s: accuracy %.4f, sharpness %s (%.0f s)" % (
                name, summary["test_accuracy"],
                ", ".join("%.2f at %g" % (r["sharpness"], r["epsilon"]) for r in records),
                time.monotonic() - began), flush=True)
    with open(os.path.join(out, "sharpness.json"), "w") as f:
        json.dump({"argv": argv, "runs": runs}, f, indent=1)
    text = table(runs, args.epsilons.split(","))
    with open(os.path.join(out, "sharpness.md"), "w") as f:
        f.write("# Sharpness of the final models (Keskar et al. 2017)\n\n")
        f.write("`python3 experiments/sharpness.py %s`, %d epochs, 4 workers, SGD with momentum "
                "0.9, rate 0.05 at batch 64 scaled by the square root of the batch, one epoch of "
                "warmup. Sharpness on the first %d training examples, %d ascent steps.\n\n" % (
                    " ".join(argv), args.epochs, args.examples, args.ascent_steps))
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
