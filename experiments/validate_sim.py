"""Real runs of a suite beside the simulator's runs of the same cells (issue 34's validation):

    python3 experiments/validate_sim.py REAL_DIR SIM_DIR [--out FILE.md] [--tolerance 0.10]

REAL_DIR and SIM_DIR are `./rubato experiment` output directories (the second made with
--simulate) whose runs/ are on disk. For every cell both ran, over the seeds each finished:

  wall_s         training time: from the last worker's start record (when the job runs at full
                 strength; a real launch spends its first second or so starting processes and
                 loading data, which the simulator does not model) to the last worker's end
  ttt_s          time to the suite's target accuracy, from the same origin
  waiting        the workers' waiting fraction: time in pulls and pushes (barriers included) over
                 the time of their steps (compute, injected delay, pull, push), from their step
                 records

each as the real runs' mean with its 95% interval, the simulated mean, and sim / real. A cell is
within the tolerance when every ratio is within 1 +- tolerance. The table goes to stdout, and to
--out (markdown) with a CSV beside it."""

import argparse
import csv
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from experiments import analysis, stats  # noqa: E402

METRICS = ("wall_s", "ttt_s", "waiting")


def run_figures(run_dir):
    """{metric: value or None} of one finished run, or None when it did not finish."""
    try:
        with open(os.path.join(run_dir, "summary.json")) as f:
            s = json.load(f)
    except (OSError, ValueError):
        return None
    if not s.get("ok"):
        return None
    started = [t for t in (s.get("worker_started_s") or []) if t is not None]
    origin = max(started) if started else 0.0
    ends = [t + float(w.get("wall_s", 0)) for t, w in
            zip(s.get("worker_started_s") or [], s.get("per_worker") or []) if t is not None]
    out = {"wall_s": (max(ends) - origin) if ends else None,
           "ttt_s": (s["time_to_target_s"] - origin)
           if s.get("time_to_target_s") is not None else None}
    waiting = busy = 0.0
    for records in analysis.worker_records(run_dir, "step", "pull_ms").values():
        previous = 0
        for r in records:
            n = int(r["step"]) - previous
            previous = int(r["step"])
            comm = float(r.get("pull_ms", 0)) + float(r.get("push_ms", 0))
            waiting += n * comm
            busy += n * (comm + float(r.get("compute_ms", 0)) + float(r.get("delay_ms", 0)))
    out["waiting"] = waiting / busy if busy > 0 else None
    return out


def cell_runs(suite_dir):
    """{cell: [figures of each finished run]} from suite_dir/runs/CELL.seed-N/."""
    cells = {}
    runs = os.path.join(suite_dir, "runs")
    for name in sorted(os.listdir(runs)):
        m = re.fullmatch(r"(.+)\.seed-(\d+)", name)
        if not m or not os.path.isdir(os.path.join(runs, name)):
            continue
        figures = run_figures(os.path.join(runs, name))
        cells.setdefault(m.group(1), [])
        if figures is not None:
            cells[m.group(1)].append(figures)
    return cells


def compare(real, sim, tolerance):
    """One row per cell both have: real mean, interval and n, sim mean, ratio; and whether
    every ratio is within the tolerance."""
    rows = []
    for cell in sorted(set(real) & set(sim)):
        row = {"cell": cell, "real_runs": len(real[cell]), "sim_runs": len(sim[cell])}
        within = bool(real[cell]) and bool(sim[cell])
        for m in METRICS:
            r = [x[m] for x in real[cell] if x[m] is not None]
            s = [x[m] for x in sim[cell] if x[m] is not None]
            row["real_" + m] = stats.mean(r) if r else None
            # The 95% interval's half-width.
            if len(r) > 1:
                low, high = stats.ci95(r)
                row["real_" + m + "_ci"] = (high - low) / 2
            else:
                row["real_" + m + "_ci"] = None
            row["sim_" + m] = stats.mean(s) if s else None
            ratio = (row["sim_" + m] / row["real_" + m]
                     if r and s and row["real_" + m] else None)
            row[m + "_ratio"] = ratio
            # A metric neither side has (a target neither reached) does not count against it.
            if (r or s) and (ratio is None or abs(ratio - 1) > tolerance):
                within = False
        row["within"] = within
        rows.append(row)
    return rows


def fmt(value, ci=None, digits=2):
    if value is None:
        return "-"
    text = "%.*f" % (digits, value)
    return text + (" ± %.*f" % (digits, ci) if ci is not None else "")


def table(rows, tolerance):
    lines = ["| cell | runs real/sim | wall real (s) | sim | ratio | to target real (s) | sim | "
             "ratio | waiting real | sim | ratio | within %d%% |" % round(100 * tolerance),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %d/%d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["cell"], r["real_runs"], r["sim_runs"],
            fmt(r["real_wall_s"], r["real_wall_s_ci"], 1), fmt(r["sim_wall_s"], None, 1),
            fmt(r["wall_s_ratio"]),
            fmt(r["real_ttt_s"], r["real_ttt_s_ci"], 1), fmt(r["sim_ttt_s"], None, 1),
            fmt(r["ttt_s_ratio"]),
            fmt(r["real_waiting"], r["real_waiting_ci"], 3), fmt(r["sim_waiting"], None, 3),
            fmt(r["waiting_ratio"]), "yes" if r["within"] else "**no**"))
    n = sum(r["within"] for r in rows)
    lines.append("")
    lines.append("%d of %d cells within %d%% on every figure." % (
        n, len(rows), round(100 * tolerance)))
    return "\n".join(lines)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("real")
    p.add_argument("sim")
    p.add_argument("--out", default=None, help="Markdown file for the table (a .csv beside it).")
    p.add_argument("--tolerance", type=float, default=0.10)
    args = p.parse_args(argv)
    for d in (args.real, args.sim):
        if not os.path.isdir(os.path.join(d, "runs")):
            print("validate_sim: error: %s has no runs/ directory" % d, file=sys.stderr)
            return 2
    rows = compare(cell_runs(args.real), cell_runs(args.sim), args.tolerance)
    if not rows:
        print("validate_sim: error: no cell is in both %s and %s" % (args.real, args.sim),
              file=sys.stderr)
        return 2
    text = table(rows, args.tolerance)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(os.path.splitext(args.out)[0] + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
