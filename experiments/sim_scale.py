"""Issue 34's results at scale: the simulator's timing level (sim/scale_study.cc) over 16 to 4,096
workers, every straggler pattern and mode, and the shards a model needs against the ring.

    bazel build -c opt //sim:scale_study
    python3 experiments/sim_scale.py run --bin bazel-bin/sim/scale_study --out DIR [--quick]
    python3 experiments/sim_scale.py report DIR

`run` writes DIR/grid.csv and DIR/shards.csv (scale_study's rows) and then the report:
DIR/report.md and DIR/plots/*.png. Two studies:

  grid    A ResNet-50-sized model (100 MB in 64 tensors), 100 ms of compute a step, every host on
          a 100 Gb/s NIC (10 us one way), min(64, workers) shards. 16, 64, 256 and 1,024 workers,
          20 steps, x every pattern (none; constant: worker 0 4x slower; transient: worker 0 4x
          slower in the first 2 steps of every 5; rotating: one worker at a time 4x slower, the
          next every 2 steps; heavy: every step of every worker delayed with probability 0.1 by
          a Pareto draw, alpha 2.5, mean 100 ms) x bsp, backup:(workers / 16), ssp:2, async, reassign (async with work reassignment, units of
          4 batches), adaptive:5 (a decision every 5 steps, for runs this short), allreduce,
          allreduce:majority and allreduce:solo;
          4,096 workers, 10 steps, patterns none and heavy (a run of the shards' modes there
          takes minutes). Figures: the time per epoch of ImageNet-1k at 32 examples a gradient,
          and the workers' waiting fraction.
  shards  No stragglers, 10 steps, 100 ms of compute. 100 MB and 1 GB models (256 tensors) x
          25 and 100 Gb/s NICs x 16, 64 and 256 workers x 1 to 256 shards, bsp and async, and
          the synchronous ring of the same workers: the fewest shards whose step is within 10%
          of the ring's, and the fewest within 10% of the most shards' step.

--quick runs a small corner of both (for the test and for a look).
"""

import argparse
import csv
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from experiments import report  # noqa: E402
from experiments.report_common import save  # noqa: E402

MODES = ("bsp,backup:auto,ssp:2,async,reassign,adaptive:5,allreduce,allreduce:majority,"
         "allreduce:solo")
PATTERNS = "none,constant,transient,rotating,heavy"
GRID = [  # (workers, patterns, steps)
    ("16,64,256,1024", PATTERNS, 20),
    ("4096", "none,heavy", 10),
]
GRID_FLAGS = ["--model_mb=100", "--tensors=64", "--shards=0", "--nic_gbps=100",
              "--latency_us=10", "--step_ms=100"]
SHARDS = [  # (workers, shard counts)
    ("16,64", "1,2,4,8,16,32,64,128,256"),
    ("256", "4,16,64,128,256"),
]
SHARDS_FLAGS = ["--tensors=256", "--nic_gbps=25,100", "--latency_us=10", "--step_ms=100",
                "--steps=10", "--patterns=none"]
QUICK_GRID = [("16", "none,constant", 5)]
QUICK_SHARDS = [("16", "1,4,16")]


def _run(binary, flags, out_csv, log):
    """Runs scale_study with `flags`, appending its rows to out_csv."""
    tmp = out_csv + ".part"
    argv = [binary] + flags + ["--out=" + tmp]
    log("$ " + " ".join(argv))
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    with open(tmp) as f:
        lines = f.readlines()
    os.remove(tmp)
    exists = os.path.exists(out_csv)
    with open(out_csv, "a") as f:
        f.writelines(lines[1:] if exists else lines)


def run(binary, out, quick, log=print):
    os.makedirs(out, exist_ok=True)
    for name in ("grid.csv", "shards.csv"):
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for workers, patterns, steps in (QUICK_GRID if quick else GRID):
        _run(binary, GRID_FLAGS + ["--workers=" + workers, "--patterns=" + patterns,
                                   "--steps=%d" % steps, "--modes=" + MODES],
             os.path.join(out, "grid.csv"), log)
    for workers, shards in (QUICK_SHARDS if quick else SHARDS):
        for model in ("100", "1000"):
            _run(binary, SHARDS_FLAGS + ["--workers=" + workers, "--shards=" + shards,
                                         "--model_mb=" + model,
                                         "--modes=bsp,async,allreduce"],
                 os.path.join(out, "shards.csv"), log)
    write_report(out)


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _fmt(value, digits=2):
    return "%.*f" % (digits, value)


def _mode_order(modes):
    def key(m):
        base = m.split(":")[0]
        order = ["bsp", "backup", "ssp", "async", "reassign", "adaptive", "allreduce"]
        return (order.index(base) if base in order else len(order), m)
    return sorted(set(modes), key=key)


def _mode_label(mode):
    return "backup:w/16" if mode.startswith("backup:") else mode


def grid_tables(rows):
    """Markdown: per pattern, time per epoch (s) and waiting fraction by workers and mode."""
    lines = []
    patterns = [p for p in PATTERNS.split(",") if any(r["pattern"] == p for r in rows)]
    for pattern in patterns:
        sub = [r for r in rows if r["pattern"] == pattern]
        labels = _mode_order(_mode_label(r["mode"]) for r in sub)
        lines += ["", "**%s**: time per epoch in s, as the job runs / at the workers' rate "
                  "(waiting fraction)" % pattern, "",
                  "| workers | " + " | ".join(labels) + " |",
                  "|---|" + "---|" * len(labels)]
        for n in sorted({int(r["workers"]) for r in sub}):
            cells = []
            for label in labels:
                hit = [r for r in sub if int(r["workers"]) == n and _mode_label(r["mode"]) == label]
                cells.append("%s / %s (%s)" % (
                    _fmt(float(hit[0]["epoch_s"]), 1), _fmt(float(hit[0]["rate_epoch_s"]), 1),
                    _fmt(float(hit[0]["waiting"]))) if hit else "")
            lines.append("| %d | %s |" % (n, " | ".join(cells)))
    return lines


def shard_tables(rows):
    """Markdown: per model and NIC, the step time by shards, and the shards needed."""
    lines = ["", "| model | NIC | workers | ring step (ms) | bsp: fewest shards within 10% of the ring | "
             "bsp: shards within 10% of its best | bsp best step (ms) | async: shards within "
             "10% of its best | async best step (ms) |", "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(float(r["model_mb"]), float(r["nic_gbps"]), int(r["workers"])) for r in rows})
    for model, nic, n in keys:
        sub = [r for r in rows if (float(r["model_mb"]), float(r["nic_gbps"]), int(r["workers"]))
               == (model, nic, n)]
        ring = [float(r["step_s"]) for r in sub if r["mode"] == "allreduce"]
        out = ["%g MB" % model, "%g Gb/s" % nic, str(n),
               _fmt(1e3 * ring[0], 1) if ring else "n/a"]
        for mode in ("bsp", "async"):
            steps = sorted((int(r["shards"]), float(r["step_s"])) for r in sub if r["mode"] == mode)
            if not steps:
                out += ["n/a"] * (3 if mode == "bsp" else 2)
                continue
            best = min(s for _, s in steps)
            near = min(k for k, s in steps if s <= 1.1 * best)
            if mode == "bsp":
                match = [k for k, s in steps if ring and s <= 1.1 * ring[0]]
                out.append(str(min(match)) if match else "none of %d-%d" % (steps[0][0],
                                                                           steps[-1][0]))
            out += [str(near), _fmt(1e3 * best, 1)]
        lines.append("| " + " | ".join(out) + " |")
    return lines


def plot_grid(plt, rows, plots):
    patterns = [p for p in PATTERNS.split(",") if any(r["pattern"] == p for r in rows)]
    # Each size's straggler-free bsp epoch, the reference of its points.
    base = {int(r["workers"]): float(r["epoch_s"]) for r in rows
            if r["mode"] == "bsp" and r["pattern"] == "none"}
    fig, axes = plt.subplots(2, len(patterns), figsize=(3.2 * len(patterns), 6.4), sharey=True,
                             squeeze=False)
    for row, (metric, what) in enumerate((("epoch_s", "as the job runs"),
                                          ("rate_epoch_s", "at the workers' rate"))):
        for ax, pattern in zip(axes[row], patterns):
            sub = [r for r in rows if r["pattern"] == pattern]
            for label in _mode_order(_mode_label(r["mode"]) for r in sub):
                pts = sorted((int(r["workers"]), float(r[metric]) / base[int(r["workers"])])
                             for r in sub if _mode_label(r["mode"]) == label
                             and int(r["workers"]) in base)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label,
                        linestyle="--" if label.startswith("allreduce") else "-")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title("%s (%s)" % (pattern, what), fontsize=8)
            ax.set_xlabel("workers")
        axes[row][0].set_ylabel("time per epoch / bsp's without stragglers")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    return save(plt, fig, plots, "epoch_vs_workers", rect=(0, 0.05, 1, 1))


def plot_shards(plt, rows, plots):
    keys = sorted({(float(r["model_mb"]), float(r["nic_gbps"])) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(3.4 * len(keys), 3.4), squeeze=False)
    for ax, (model, nic) in zip(axes[0], keys):
        sub = [r for r in rows if (float(r["model_mb"]), float(r["nic_gbps"])) == (model, nic)]
        for n in sorted({int(r["workers"]) for r in sub}):
            pts = sorted((int(r["shards"]), float(r["step_s"])) for r in sub
                         if r["mode"] == "bsp" and int(r["workers"]) == n)
            line = ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], marker="o", ms=3,
                           label="bsp, %d workers" % n)
            ring = [float(r["step_s"]) for r in sub
                    if r["mode"] == "allreduce" and int(r["workers"]) == n]
            if ring:
                ax.axhline(1e3 * ring[0], color=line[0].get_color(), linestyle=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title("%g MB, %g Gb/s (dotted: ring)" % (model, nic), fontsize=8)
        ax.set_xlabel("shards")
    axes[0][0].set_ylabel("step (ms)")
    axes[0][-1].legend(fontsize=7)
    return save(plt, fig, plots, "step_vs_shards")


def write_report(out):
    grid = _rows(os.path.join(out, "grid.csv"))
    shards = _rows(os.path.join(out, "shards.csv"))
    plots = os.path.join(out, "plots")
    os.makedirs(plots, exist_ok=True)
    plt = report.pyplot()
    names = [plot_grid(plt, grid, plots), plot_shards(plt, shards, plots)]
    studies = __doc__.split("Two studies:\n\n")[1].split("\n\n--quick")[0]
    lines = ["# The simulator at scale", "",
             "Written by `python3 experiments/sim_scale.py run --bin bazel-bin/sim/scale_study "
             "--out DIR` (after `bazel build -c opt //sim:scale_study`) from grid.csv and "
             "shards.csv, sim/scale_study's rows, in simulated time (sim/README.md says what the "
             "simulator models and what it leaves out). The studies:", "", "```", studies, "```",
             "", "## Time per epoch by workers, pattern and mode", "",
             "Two times per epoch: as the job runs (every worker trains its own share of the "
             "data, so under async and ssp the slowest share ends the epoch, while the partial "
             "rings' rounds and reassignment's units go to whoever is ready), and at the rate "
             "the workers apply gradients while all of them run. In parentheses, the workers' "
             "mean waiting fraction. The plot divides each by straggler-free bsp's time at the "
             "same size.", "",
             "![](plots/%s.png)" % names[0]]
    lines += grid_tables(grid)
    lines += ["", "## The shards a model needs, against the ring", "",
              "bsp's step (pull, 100 ms of compute, push) by shards, against the synchronous "
              "ring's step on the same workers and NICs (dotted); async's best for reference. "
              "No stragglers.", "",
              "![](plots/%s.png)" % names[1]]
    lines += shard_tables(shards)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return os.path.join(out, "report.md")


def main(argv):
    p = argparse.ArgumentParser(prog="sim_scale.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="Run both studies and write the report.")
    r.add_argument("--bin", default=os.path.join("bazel-bin", "sim", "scale_study"))
    r.add_argument("--out", required=True)
    r.add_argument("--quick", action="store_true")
    w = sub.add_parser("report", help="Write the report from DIR's CSVs.")
    w.add_argument("dir")
    args = p.parse_args(argv)
    try:
        if args.command == "run":
            if not os.access(args.bin, os.X_OK):
                p.error("%s is not an executable: bazel build -c opt //sim:scale_study" % args.bin)
            run(args.bin, args.out, args.quick)
            print("sim_scale: %s" % os.path.join(args.out, "report.md"))
        else:
            print("sim_scale: %s" % write_report(args.dir))
    except (OSError, subprocess.CalledProcessError, report.ReportError, KeyError,
            ValueError) as e:
        print("sim_scale: error: %s" % e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
