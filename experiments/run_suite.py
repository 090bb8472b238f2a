"""./rubato experiment SUITE: runs every job of an experiment suite (experiments/suite.py) one at a
time, and writes what they measured.

    ./rubato experiment stragglers [--seeds N] [--out DIR] [--only PATTERN]

Output, in DIR (default runs/experiments/SUITE-YYYYmmdd-HHMMSS):
  runs/<cell>.seed-<k>/   each run's directory (./rubato launch --run_dir: logs, summary.json)
  results.csv             one row per run (RESULT_COLUMNS)
  summary.csv             per cell: runs, runs that failed, and for every metric its mean and
                          95% confidence interval over the runs that finished (experiments/stats.py)
  suite.json              the suite as run: its cells' flags, the command, when it began
  report.md, report.html  the results table, the plots (plots/*.png, *.svg), the command, the
                          versions and the machine (experiments/report.py, which redraws them:
                          python3 experiments/report.py DIR)

A run whose directory already holds a summary.json is not run again, so an interrupted sweep
resumes when given the same --out; the run that was interrupted itself (its summary.json says
"interrupted") is run again. A run that fails is recorded (ok false, its error) and the
sweep goes on. A progress line gives the runs done and an estimate of the time left.

Runs go one at a time: several jobs at once on a small machine would make the machine itself the
straggler. For the same reason the machine's CPU use is sampled during each run; a run during
which it was saturated (over 95% busy on average) is flagged in results.csv (cpu_busy) and warned
about, since its timings measure the machine, not the consistency model.

Accuracy at an equal wall-clock budget (accuracy_at_budget) is each run's latest evaluation by
the suite's budget_s, or by default by the fastest cell's median wall time
(experiments/analysis.py pick_budget); it is filled in once every run is done. Accuracy at an
equal number of model updates (accuracy_at_updates) is each run's latest evaluation by the cell
that applies fewest updates (its median model_updates: bsp's one per step, where async applies
every worker's gradient), from the workers' step records (analysis.updates_at_evals).
"""

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from experiments import analysis, report, stats, suite  # noqa: E402

LAUNCH = os.path.join(ROOT, "deploy", "launch.py")
SIMULATE = os.path.join(ROOT, "experiments", "simulate.py")
# What results.csv holds for each run, from its summary.json.
METRICS = ("wall_s", "test_accuracy", "time_to_target_s", "steps_to_target", "epochs_to_target",
           "worker_steps_per_s",
           "examples_per_s",
           "applied_updates", "dropped_gradients", "dropped_workers",
           "mean_staleness_lower_bound", "noise_scale", "accuracy_at_budget", "model_updates",
           "accuracy_at_updates")
RESULT_COLUMNS = ("suite", "cell", "seed", "ok", "error", "cpu_busy", "budget_s",
                  "updates_budget") + METRICS
SATURATED = 0.95


def cpu_times():
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class CpuSampler:
    """The machine's mean CPU use between start() and stop(), 0..1."""

    def __init__(self):
        self.start_times = cpu_times()

    def stop(self):
        busy0, total0 = self.start_times
        busy1, total1 = cpu_times()
        return (busy1 - busy0) / max(total1 - total0, 1)


def finished(run_dir):
    """Whether the run in `run_dir` ran to its end: it has a summary.json that is not the record
    of an interruption (the launcher stopped by a signal writes one too, with that error)."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            return json.load(f).get("error") != "interrupted"
    except (OSError, ValueError):
        return False


def run_one(run, out_dir, bin_dir, target, log, sim_flags=None):
    """Runs `run` (suite.Run) into out_dir/runs/<name>, or with `sim_flags` (a list, perhaps
    empty) in the simulator (experiments/simulate.py) with those flags of its own; returns its
    results.csv row."""
    run_dir = os.path.join(out_dir, "runs", run.name)
    summary_path = os.path.join(run_dir, "summary.json")
    row = {"cell": run.cell, "seed": run.seed}
    cpu = None
    if not finished(run_dir):
        if sim_flags is None:
            argv = [sys.executable, LAUNCH, "--bin_dir", bin_dir, "--run_dir", run_dir,
                    "--target_accuracy", str(target), "--refresh", "1"] + run.argv()
        else:
            argv = ([sys.executable, SIMULATE, "--bin_dir", bin_dir, "--run_dir", run_dir,
                     "--target_accuracy", str(target)] + run.argv()
                    + ["--sim_flag=" + f for f in sim_flags])
        os.makedirs(os.path.dirname(run_dir), exist_ok=True)
        sampler = CpuSampler()
        with open(run_dir + ".log", "w") as f:
            f.write("argv: %s\n" % json.dumps(argv))
            f.flush()
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        cpu = sampler.stop()
        if sim_flags is not None:  # Simulated time does not depend on the machine's load.
            cpu = None
        else:
            with open(os.path.join(out_dir, "cpu.json"), "a") as f:
                f.write(json.dumps({"run": run.name, "cpu_busy": round(cpu, 4)}) + "\n")
    else:
        cpu = previous_cpu(out_dir, run.name)
    try:
        with open(summary_path) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = {"ok": False, "error": "no summary.json: %s (see %s.log)" % (
            last_error(run_dir + ".log"), run_dir)}
    row["ok"] = bool(summary.get("ok"))
    row["error"] = summary.get("error") or ""
    row["cpu_busy"] = "" if cpu is None else "%.3f" % cpu
    for m in METRICS:
        value = summary.get(m)
        row[m] = "" if value is None else value
    noise = summary.get("noise_scale") or {}
    row["noise_scale"] = "" if noise.get("b_simple_ema") is None else noise["b_simple_ema"]
    if summary.get("mode", "").partition(":")[0] == "allreduce":  # No servers: ranks apply.
        row["applied_updates"] = row["mean_staleness_lower_bound"] = ""
    row["evals"] = summary.get("evals") or []  # For accuracy_at_budget; not a CSV column.
    updates = analysis.model_updates(summary) if row["ok"] else None
    row["model_updates"] = "" if updates is None else updates
    row["update_evals"] = analysis.updates_at_evals(  # For accuracy_at_updates; not a column.
        row["evals"], analysis.worker_records(run_dir, "step", "t"),
        summary.get("worker_started_s") or [],
        analysis.per_gradient(summary.get("mode", "")))
    if cpu is not None and cpu > SATURATED:
        log("warning: %s: the machine was %.0f%% busy during the run: its timings measure the "
            "machine, not the mode (raise --min_step_ms or use fewer workers)" % (run.name,
                                                                                 100 * cpu))
    return row


def last_error(log_path):
    """The launcher's error line in a run's log (usage errors come before any run directory), or
    its last line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or ["empty log"])[-1][:300]


def previous_cpu(out_dir, name):
    try:
        with open(os.path.join(out_dir, "cpu.json")) as f:
            for line in f:
                record = json.loads(line)
                if record.get("run") == name:
                    return record.get("cpu_busy")
    except (OSError, ValueError):
        pass
    return None


def summarize(rows):
    """summary.csv's rows: per cell, in first-seen order."""
    cells = []
    for r in rows:
        if r["cell"] not in cells:
            cells.append(r["cell"])
    out = []
    for cell in cells:
        mine = [r for r in rows if r["cell"] == cell]
        done = [r for r in mine if r["ok"]]
        row = {"cell": cell, "runs": len(mine), "failed": len(mine) - len(done)}
        for m in METRICS:
            values = [float(r[m]) for r in done if r[m] != ""]
            row[m + "_n"] = len(values)
            if values:
                lo, hi = stats.ci95(values)
                row[m + "_mean"] = "%.6g" % stats.mean(values)
                row[m + "_ci95_lo"] = "%.6g" % lo
                row[m + "_ci95_hi"] = "%.6g" % hi
            else:
                row[m + "_mean"] = row[m + "_ci95_lo"] = row[m + "_ci95_hi"] = ""
        out.append(row)
    return out


def summary_columns():
    columns = ["cell", "runs", "failed"]
    for m in METRICS:
        columns += [m + "_n", m + "_mean", m + "_ci95_lo", m + "_ci95_hi"]
    return columns


def write_csv(path, columns, rows):
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in columns})
    os.replace(tmp, path)


def main(argv):
    p = argparse.ArgumentParser(prog="rubato experiment",
                                description="Run an experiment suite (experiments/suites/).")
    p.add_argument("suite", help="A suite's name (experiments/suites/NAME.yaml) or file.")
    p.add_argument("--seeds", type=int, default=None, help="Runs per cell (default: the suite's).")
    p.add_argument("--out", default=None,
                   help="Output directory; give an earlier one to resume it (default: "
                        "runs/experiments/SUITE-TIME).")
    p.add_argument("--only", default=None, metavar="PATTERN",
                   help="Only the cells whose names match this regular expression.")
    p.add_argument("--skip", default=None, metavar="PATTERN",
                   help="Leave out the runs whose names (CELL.seed-N) match this regular "
                        "expression (e.g. one seed that takes far longer than the rest).")
    p.add_argument("--bin_dir", default=os.path.join(ROOT, "bazel-bin"))
    p.add_argument("--simulate", action="store_true",
                   help="Run every job in the simulator (experiments/simulate.py, sim/README.md) "
                        "instead of as processes: the same results, in simulated seconds.")
    p.add_argument("--sim_flag", action="append", default=[], metavar="FLAG",
                   help="With --simulate: a flag for rubato_sim (e.g. --sim_flag=--compute_ms=2). "
                        "Repeatable.")
    args = p.parse_args(argv)
    if args.sim_flag and not args.simulate:
        p.error("--sim_flag needs --simulate")
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    try:
        s = suite.load(args.suite)
        runs = s.runs(seeds=args.seeds, only=args.only, skip=args.skip)
        kept = {r.name for r in runs}
        skipped = [r.name for r in s.runs(seeds=args.seeds, only=args.only)
                   if r.name not in kept]
    except (suite.SuiteError, re.error) as e:  # re.error: a bad --only pattern.
        print("rubato experiment: error: %s" % e, file=sys.stderr)
        return 2
    if not runs:
        print("rubato experiment: error: --only %r and --skip %r leave no run of %s (cells: %s)"
              % (args.only, args.skip, s.name, ", ".join(c for c, _ in s.cells)),
              file=sys.stderr)
        return 2
    if s.simulate is not None:  # A suite only the simulator runs.
        args.simulate = True
        args.sim_flag = list(s.simulate) + args.sim_flag
    out = args.out or os.path.join(ROOT, "runs", "experiments",
                                   "%s-%s" % (s.name, time.strftime("%Y%m%d-%H%M%S")))
    os.makedirs(out, exist_ok=True)
    lock = threading.Lock()

    def log(message):
        with lock:
            print(message, flush=True)

    cells = len({r.cell for r in runs})
    described = describe(s, runs, argv)
    described["skipped"] = skipped
    described["simulated"] = args.simulate
    write_json(os.path.join(out, "suite.json"), described)
    log("rubato experiment: suite %s (%s), %d runs (%d cells x up to %d seeds) into %s" % (
        s.name, s.path, len(runs), cells, described["seeds"], out))
    rows, durations = [], []
    for k, run in enumerate(runs):
        began = time.monotonic()
        resumed = finished(os.path.join(out, "runs", run.name))
        row = run_one(run, out, args.bin_dir, s.target_accuracy, log,
                      args.sim_flag if args.simulate else None)
        row["suite"] = s.name
        rows.append(row)
        if not resumed:
            durations.append(time.monotonic() - began)
        left = len(runs) - k - 1
        eta = (sum(durations) / len(durations) * left) if durations else 0
        log("[%d/%d] %s: %s%s; ETA %s" % (
            k + 1, len(runs), run.name,
            "kept from before" if resumed else "%.1f s" % (time.monotonic() - began),
            "" if row["ok"] else ", FAILED: %s" % row["error"],
            "%d min %02d s" % divmod(int(eta), 60)))
        write_csv(os.path.join(out, "results.csv"), RESULT_COLUMNS, rows)
    # Accuracy at an equal wall-clock budget, now that every run's wall time is known.
    budget = analysis.pick_budget(rows, s.budget_s)
    for row in rows:
        row["budget_s"] = "" if budget is None else "%.3f" % budget
        if row["ok"] and budget is not None:
            acc = analysis.accuracy_at(row["evals"], budget)
            row["accuracy_at_budget"] = "" if acc is None else acc
    # And at an equal number of model updates.
    updates_budget = analysis.pick_update_budget(rows)
    for row in rows:
        row["updates_budget"] = "" if updates_budget is None else "%d" % updates_budget
        if row["ok"] and updates_budget is not None:
            acc = analysis.accuracy_at_updates(row["update_evals"], updates_budget)
            row["accuracy_at_updates"] = "" if acc is None else acc
    write_csv(os.path.join(out, "results.csv"), RESULT_COLUMNS, rows)
    write_csv(os.path.join(out, "summary.csv"), summary_columns(), summarize(rows))
    described["budget_s_used"] = budget
    described["updates_budget_used"] = updates_budget
    write_json(os.path.join(out, "suite.json"), described)
    failed = sum(1 for r in rows if not r["ok"])
    log("rubato experiment: %d runs, %d failed; %s, %s" % (
        len(rows), failed, os.path.join(out, "results.csv"), os.path.join(out, "summary.csv")))
    try:
        md, page, plots = report.write(out)
        log("rubato experiment: report in %s and %s (%d plots)" % (md, page, len(plots)))
    except report.ReportError as e:
        log("rubato experiment: error: no report: %s" % e)
        return 1
    return 1 if failed == len(rows) else 0


def describe(s, runs, argv):
    """suite.json: the suite as this sweep runs it, for the report."""
    cells = []
    for r in runs:
        if r.cell not in [c["name"] for c in cells]:
            cells.append({"name": r.cell, "flags": r.flags})
    common = {k: v for k, v in cells[0]["flags"].items()
              if all(c["flags"].get(k, object()) == v for c in cells)}
    return {"name": s.name, "description": s.description, "path": os.path.relpath(s.path, ROOT)
            if os.path.abspath(s.path).startswith(ROOT + os.sep) else s.path,
            "command": " ".join(["./rubato", "experiment"] + argv),
            "began": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "seeds": max(r.seed for r in runs),
            "target_accuracy": s.target_accuracy, "budget_s": s.budget_s,
            "timeline": [c for c in s.timeline if any(c == x["name"] for x in cells)],
            "base": common, "cells": cells}


def write_json(path, value):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
