"""The report of an experiment suite's output directory (issue 14): plots (PNG and SVG) under
plots/, report.md and a static report.html that show them with the summary table, the exact
command, the versions and the machine. report.md shows the PNGs only, so that a committed result
(experiments/results/: results.csv, summary.csv, suite.json, report.md and the PNGs) is whole
without the SVGs and report.html, which this script redraws.

    python3 experiments/report.py DIR     # what ./rubato experiment runs after the last run

DIR is what experiments/run_suite.py wrote: suite.json, results.csv, summary.csv and runs/. The
plots, each drawn only where the suite has what it needs:
  accuracy_vs_time    test accuracy against wall time per cell: the median over seeds, and a band
                      from the lowest to the highest run
  time_to_target      time to the target accuracy per cell (mean and 95% interval)
  time_to_target_vs_severity
                      the same against the slowest worker's slowdown, a line per configuration
                      (suites whose cells differ in --slow_workers or --slowdown)
  throughput          examples per second per cell (or against the number of workers when
                      cells differ in --workers)
  staleness           the histogram of gradient staleness per cell (summed over seeds)
  timeline            per worker of one run of each suite.timeline cell: compute, communication
                      and waiting over the run (analysis.timeline says how waiting is estimated)
  noise_scale         the gradient noise scale the servers measured over training (bsp, backup)
  methods_vs_bsp      time to target of the best fixed mode and each mitigation method per
                      straggler pattern, relative to straggler-free bsp (suites with mode and
                      pattern axes; experiments/method_table.py), with its table in report.md
  accuracy_vs_batch   final accuracy (equal epochs) against the global batch, workers x
                      batch_size, a line per configuration (the lr-scaling study's recipes), with
                      the measured noise scale B_simple marked (suites whose cells differ in it)
  steps_to_target_vs_batch
                      the steps to the target accuracy against the global batch, likewise

Such suites also get a table per configuration and global batch in report.md and report.html.
A sweep still running (no summary.csv yet) is summarized from its results.csv so far.

Matplotlib comes from Debian (python3-matplotlib, which ./rubato setup installs); a Python that
does not see Debian's packages (a pyenv one, say) is pointed at them.
"""

import csv
import html
import json
import os
import platform
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from experiments import analysis, method_table, report_batch  # noqa: E402
from experiments.report_common import pm as _pm, save as _save, to_float as _float  # noqa: E402

DEBIAN_PACKAGES = "/usr/lib/python3/dist-packages"
STALENESS_BUCKETS = ["0", "1", "2", "3", "4-7", "8-15", "16-31", ">=32"]
COLORS = {"compute": "#4477aa", "communication": "#66ccee", "waiting": "#ee6677",
          "other": "#dddddd"}


class ReportError(RuntimeError):
    pass


def pyplot():
    """matplotlib.pyplot, drawing to files (Agg)."""
    if "MPLCONFIGDIR" not in os.environ and not os.access(
            os.path.expanduser("~/.config"), os.W_OK):  # Its font cache; a sandbox's home is not.
        os.environ["MPLCONFIGDIR"] = os.path.join(tempfile.gettempdir(), "rubato-matplotlib")
    try:
        import matplotlib
    except ImportError:
        if DEBIAN_PACKAGES in sys.path or not os.path.isdir(DEBIAN_PACKAGES):
            raise ReportError("matplotlib is missing: install Debian's python3-matplotlib "
                              "(./rubato setup does)")
        sys.path.append(DEBIAN_PACKAGES)
        try:
            import matplotlib
        except ImportError as e:
            raise ReportError("matplotlib is missing (%s): install Debian's python3-matplotlib "
                              "(./rubato setup does)" % e)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 9, "axes.grid": True, "grid.alpha": 0.3,
                         "svg.hashsalt": "rubato", "svg.fonttype": "none"})
    return plt


class Data:
    """Everything the report reads from an output directory."""

    def __init__(self, out):
        self.out = out
        try:
            with open(os.path.join(out, "suite.json")) as f:
                self.suite = json.load(f)
            self.results = _read_csv(os.path.join(out, "results.csv"))
            summary = os.path.join(out, "summary.csv")
            # The runner writes summary.csv once every run is done; before, results.csv has the
            # runs so far.
            self.partial = not os.path.exists(summary)
            self.summary = _summarize(self.results) if self.partial else _read_csv(summary)
        except (OSError, ValueError) as e:
            raise ReportError("%s: not an experiment's output (%s)" % (out, e))
        self.planned = [(c["name"], c["flags"]) for c in self.suite["cells"]]
        self.cells = [(c, f) for c, f in self.planned
                      if any(r["cell"] == c for r in self.results)]
        self.flags = dict(self.cells)
        # Lines per configuration against the global batch, where the cells differ in it.
        self.batch_series = analysis.batch_series(self.cells, self.planned)
        self.summaries = {}  # (cell, seed) -> summary.json of a run that finished
        for r in self.results:
            if r["ok"] != "True":
                continue
            path = os.path.join(out, "runs", "%s.seed-%s" % (r["cell"], r["seed"]),
                                "summary.json")
            try:
                with open(path) as f:
                    self.summaries[(r["cell"], int(r["seed"]))] = json.load(f)
            except (OSError, ValueError):
                pass

    def runs(self, cell):
        return [(seed, s) for (c, seed), s in sorted(self.summaries.items()) if c == cell]

    def records(self, cell, seed, event, needs):
        """{worker: its `event` records that have the key `needs`} of one run."""
        return analysis.worker_records(
            os.path.join(self.out, "runs", "%s.seed-%d" % (cell, seed)), event, needs)

    def steps(self, cell, seed):
        """{worker: its step records} of one run."""
        return self.records(cell, seed, "step", "comm_ms")


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _summarize(results):
    """summary.csv's rows from results.csv's, as the runner would write them."""
    from experiments import run_suite  # Here, not at the top: run_suite imports this module.
    rows = [dict({m: r.get(m, "") for m in run_suite.METRICS}, cell=r["cell"],
                 ok=r["ok"] == "True") for r in results]
    return run_suite.summarize(rows)


def plot_accuracy(plt, data, plots_dir):
    fig, ax = plt.subplots(figsize=(8, 4.8))
    drawn = False
    for i, (cell, _) in enumerate(data.cells):
        curves = [s.get("evals", []) for _, s in data.runs(cell)]
        curves = [c for c in curves if c]
        if not curves:
            continue
        end = max(e["t"] for c in curves for e in c)
        grid = [end * k / 200 for k in range(201)]
        points = [(t, b) for t, b in zip(grid, analysis.band(curves, grid)) if b is not None]
        if not points:
            continue
        color = "C%d" % (i % 10)
        style = "--" if i >= 10 else "-"
        ts = [t for t, _ in points]
        ax.plot(ts, [b[0] for _, b in points], style, color=color, lw=1.4,
                label="%s (%d)" % (cell, len(curves)), drawstyle="steps-post")
        ax.fill_between(ts, [b[1] for _, b in points], [b[2] for _, b in points], color=color,
                        alpha=0.15, step="post", lw=0)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    target = data.suite.get("target_accuracy")
    if target:
        ax.axhline(target, color="k", lw=0.8, ls=":")
    budget = data.suite.get("budget_s_used")
    if budget:
        ax.axvline(budget, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("test accuracy")
    ax.set_title("%s: test accuracy against wall time\nline: median over seeds; band: lowest to "
                 "highest run; dotted: target; dashed: budget" % data.suite["name"], fontsize=9)
    lows = [e["test_accuracy"] for _, s in data.summaries.items() for e in s.get("evals", [])]
    if lows:
        ax.set_ylim(max(0.0, min(sorted(lows)[len(lows) // 20], target or 1) - 0.05), None)
    ax.legend(fontsize=7, loc="lower right", ncol=2, title="cell (runs)", title_fontsize=7)
    return _save(plt, fig, plots_dir, "accuracy_vs_time")


def _cell_bars(plt, data, metric, ylabel, title, plots_dir, name):
    rows = {r["cell"]: r for r in data.summary}
    cells, means, lo, hi, notes = [], [], [], [], []
    for cell, _ in data.cells:
        r = rows.get(cell, {})
        m = _float(r, metric + "_mean")
        cells.append(cell)
        n = int(r.get(metric + "_n") or 0)
        notes.append("%d/%s" % (n, r.get("runs", "?")))
        if m is None:
            means.append(0)
            lo.append(0)
            hi.append(0)
        else:
            means.append(m)
            lo.append(m - _float(r, metric + "_ci95_lo"))
            hi.append(_float(r, metric + "_ci95_hi") - m)
    if not any(means):
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.75 * len(cells) + 2), 4.2))
    xs = range(len(cells))
    ax.bar(xs, means, yerr=[lo, hi], capsize=3, color="#4477aa", alpha=0.85)
    for x, m, note in zip(xs, means, notes):
        ax.annotate("n/a" if m == 0 else note, (x, 0), xytext=(0, 3),
                    textcoords="offset points", ha="center", fontsize=7,
                    color="white" if m else "black")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(cells, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return _save(plt, fig, plots_dir, name)


def plot_time_to_target(plt, data, plots_dir):
    return _cell_bars(plt, data, "time_to_target_s", "seconds",
                      "%s: time to %.2f test accuracy (mean, 95%% interval; runs that reached "
                      "it / runs)" % (data.suite["name"], data.suite["target_accuracy"]),
                      plots_dir, "time_to_target")


def _by_x(data, x_of, x_flags):
    """Series for a plot against x: {label: [(x, cell)]}, when cells differ in x."""
    varying = analysis.varying_flags(data.cells)
    series = {}
    for cell, flags in data.cells:
        series.setdefault(analysis.label(flags, varying, leave_out=x_flags), []).append(
            (x_of(flags), cell))
    xs = {x for points in series.values() for x, _ in points}
    return series if len(xs) > 1 else None


def _plot_against(plt, data, series, metric, xlabel, ylabel, title, plots_dir, name, ideal=False):
    rows = {r["cell"]: r for r in data.summary}
    fig, ax = plt.subplots(figsize=(7, 4.4))
    drawn = False
    for i, (label, points) in enumerate(series.items()):
        pts = []
        for x, cell in sorted(points):
            m = _float(rows.get(cell, {}), metric + "_mean")
            if m is not None:
                pts.append((x, m, _float(rows[cell], metric + "_ci95_lo"),
                            _float(rows[cell], metric + "_ci95_hi")))
        if not pts:
            continue
        xs = [p[0] for p in pts]
        ms = [p[1] for p in pts]
        ax.errorbar(xs, ms, yerr=[[m - p[2] for m, p in zip(ms, pts)],
                                  [p[3] - m for m, p in zip(ms, pts)]],
                    marker="o", ms=4, capsize=3, lw=1.2, color="C%d" % (i % 10), label=label)
        if ideal and xs[0] > 0:
            ax.plot(xs, [ms[0] * x / xs[0] for x in xs], ":", color="C%d" % (i % 10), lw=0.8)
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, plots_dir, name)


def plot_severity(plt, data, plots_dir):
    series = _by_x(data, analysis.severity, ("slow_workers", "slowdown"))
    if series is None:
        return None
    return _plot_against(plt, data, series, "time_to_target_s",
                         "slowdown of the slowest worker (x)", "seconds to target",
                         "%s: time to %.2f test accuracy against straggler severity (mean, 95%% "
                         "interval; missing: not reached)" % (data.suite["name"],
                                                              data.suite["target_accuracy"]),
                         plots_dir, "time_to_target_vs_severity")


def plot_throughput(plt, data, plots_dir):
    series = _by_x(data, lambda f: int(f.get("workers", 2)), ("workers",))
    if series is not None:
        return _plot_against(plt, data, series, "examples_per_s", "workers",
                             "training examples per second",
                             "%s: throughput against workers (mean, 95%% interval; dotted: "
                             "linear from the smallest)" % data.suite["name"], plots_dir,
                             "throughput", ideal=True)
    return _cell_bars(plt, data, "examples_per_s", "training examples per second (all workers)",
                      "%s: throughput (mean, 95%% interval; runs / runs)" % data.suite["name"],
                      plots_dir, "throughput")


def plot_staleness(plt, data, plots_dir):
    hists = []
    for cell, _ in data.cells:
        total = [0] * len(STALENESS_BUCKETS)
        for _, s in data.runs(cell):
            for i, b in enumerate(STALENESS_BUCKETS):
                total[i] += int(s.get("staleness_histogram", {}).get(b, 0))
        if sum(total):
            hists.append((cell, total))
    if not hists:
        return None
    cols = min(5, len(hists))
    rows = (len(hists) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.3 * cols + 0.6, 2.1 * rows + 0.8),
                             sharey=True, squeeze=False)
    for ax in axes.flat[len(hists):]:
        ax.set_visible(False)
    for ax, (cell, total) in zip(axes.flat, hists):
        n = sum(total)
        ax.bar(range(len(total)), [v / n for v in total], color="#4477aa")
        ax.set_xticks(range(len(total)))
        ax.set_xticklabels(STALENESS_BUCKETS, fontsize=6, rotation=45)
        ax.set_title("%s\n%d gradients" % (cell, n), fontsize=7)
        ax.set_ylim(0, 1)
    fig.suptitle("%s: staleness of the gradients the servers applied (fraction; a gradient "
                 "computed on weights k versions old has staleness k)" % data.suite["name"],
                 fontsize=8)
    return _save(plt, fig, plots_dir, "staleness")


def plot_timeline(plt, data, plots_dir):
    panels = []
    for cell in data.suite.get("timeline", []):
        runs = data.runs(cell)
        if not runs:
            continue
        seed, summary = runs[0]
        started = {w: t for w, t in enumerate(summary.get("worker_started_s", []))
                   if t is not None}
        lines = analysis.timeline(data.steps(cell, seed), started)
        if lines:
            panels.append((cell, seed, lines))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 1.0 + 0.42 * sum(
        len(p[2]) for p in panels) + 0.5 * len(panels)), squeeze=False)
    for ax, (cell, seed, lines) in zip(axes[:, 0], panels):
        for row, worker in enumerate(sorted(lines)):
            for begin, parts in lines[worker]:
                x = begin
                for part in analysis.PARTS:
                    width = parts[part]
                    if width > 0:
                        ax.broken_barh([(x, width)], (row - 0.38, 0.76),
                                       facecolors=COLORS[part], lw=0)
                        x += width
            t = analysis.totals(lines[worker])
            busy = sum(t.values()) or 1
            ax.text(1.005, row, "%.0f%% compute, %.0f%% wait" % (
                100 * t["compute"] / busy, 100 * t["waiting"] / busy),
                transform=ax.get_yaxis_transform(), fontsize=6.5, va="center")
        ax.set_yticks(range(len(lines)))
        ax.set_yticklabels(["worker %d" % w for w in sorted(lines)], fontsize=7)
        ax.set_ylim(-0.6, len(lines) - 0.4)
        ax.invert_yaxis()
        ax.set_title("%s (seed %d)" % (cell, seed), fontsize=8, loc="left")
        ax.grid(False)
    axes[-1, 0].set_xlabel("wall time since launch (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[p]) for p in analysis.PARTS]
    fig.legend(handles, analysis.PARTS, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle("%s: per-worker timeline, each log interval as compute, communication, "
                 "waiting (estimated) and other" % data.suite["name"], fontsize=8, x=0.02,
                 ha="left")
    return _save(plt, fig, plots_dir, "timeline", rect=(0, 0.04, 0.9, 0.97))


def plot_noise_scale(plt, data, plots_dir):
    fig, ax = plt.subplots(figsize=(8, 4.4))
    drawn = False
    for i, (cell, flags) in enumerate(data.cells):
        train = int(flags.get("train_limit") or FASHION_MNIST_TRAIN)
        for k, (seed, _) in enumerate(data.runs(cell)):
            noise = data.records(cell, seed, "noise", "b_simple_ema").get(0, [])
            # Epochs drawn before each measured step: the global batches of the steps before it
            # (each record's b_big; it changes under an adaptive batch).
            epochs, drawn_examples, last_step, last_batch = [], 0, 0, 0
            for r in noise:
                drawn_examples += (r["step"] - last_step) * last_batch
                last_step, last_batch = r["step"], r.get("b_big") or last_batch
                epochs.append(drawn_examples / train)
            points = [(e, r["b_simple_ema"]) for e, r in zip(epochs, noise)
                      if r.get("b_simple_ema") is not None]
            if not points:
                continue
            color = "C%d" % (i % 10)
            ax.plot([p[0] for p in points], [p[1] for p in points], color=color,
                    lw=1.0, alpha=0.8, label=cell if k == 0 else None)
            batch = [(e, r["b_big"]) for e, r in zip(epochs, noise) if r.get("b_big")]
            if batch:
                ax.step([p[0] for p in batch], [p[1] for p in batch], where="post", color=color,
                        lw=0.8, ls=":", alpha=0.8)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("epochs of training examples drawn")
    ax.set_ylabel("B_simple (examples)")
    ax.set_yscale("log")
    ax.set_title("%s: gradient noise scale B_simple = tr(Sigma)/|G|^2 over training, from the "
                 "servers' moving averages\n(one line per run; dotted, in its colour: the run's "
                 "global batch)" % data.suite["name"], fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, plots_dir, "noise_scale")


FASHION_MNIST_TRAIN = 60000

def plot_methods(plt, data, plots_dir):
    return method_table.plot(plt, data.summary, data.suite, plots_dir, _save)


PLOTS = [
    ("accuracy_vs_time", plot_accuracy,
     "Test accuracy against wall time since launch. The line is the median over the seeds of "
     "each run's latest evaluation; the band spans the lowest and the highest run."),
    ("time_to_target", plot_time_to_target,
     "Time until a worker first measured the target accuracy: mean and 95% interval over the runs "
     "that reached it."),
    ("time_to_target_vs_severity", plot_severity,
     "Time to target against how much slower the slowest worker computes."),
    ("throughput", plot_throughput, "Training examples per second of wall time, all workers."),
    ("staleness", plot_staleness,
     "How stale the applied gradients were, per cell, summed over seeds (server-side counts)."),
    ("timeline", plot_timeline,
     "One run per cell, each worker's time by log interval: compute (including the injected "
     "compute floor and slowdown), communication, waiting for others, and other time "
     "(evaluations). Waiting is estimated: a worker's pull and push time less the least any "
     "worker had in the same interval."),
    ("noise_scale", plot_noise_scale,
     "The gradient noise scale the servers measured (bsp and backup runs; McCandlish et al. "
     "2018): training at a batch near it is about half as fast per step as at an infinite batch."),
    ("methods_vs_bsp", plot_methods,
     "Time to target under the best fixed consistency mode and each straggler-mitigation "
     "method, pattern by pattern, divided by bsp's without a straggler (the dotted line; below "
     "it is faster); bars: the cell's 95% interval where it has several seeds."),
    ("accuracy_vs_batch", report_batch.plot_accuracy_vs_batch, report_batch.batch_caption(
        "Final test accuracy after the same number of epochs (equal work, so fewer steps at "
        "larger batches)",
        "the median over the seeds, and a band from the lowest to the highest run.")),
    ("steps_to_target_vs_batch", report_batch.plot_steps_vs_batch, report_batch.batch_caption(
        "Steps to the target accuracy (log scale)",
        "the median over the runs that reached it (the step of the first evaluation at or above "
        "it, so no finer than the cell's eval_every), bars from the lowest to the highest; k/n "
        "where only k of the n runs that finished did. A cell none of whose runs reached it is "
        "missing from its line (an x near the top), not drawn as 0.")),
]


def environment(out):
    """The versions and the machine, for the report."""
    def run(argv):
        try:
            return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(l for l in f if l.startswith("MemTotal")).split()[1])
            mem = "%.1f GiB" % (kb / 2 ** 20)
    except (OSError, StopIteration, ValueError):
        pass
    rev = run(["git", "rev-parse", "--short", "HEAD"])
    dirty = run(["git", "status", "--porcelain", "--untracked-files=no"])
    import matplotlib
    return [
        ("Rubato", (rev + (" (with uncommitted changes)" if dirty else "")) or "unknown"),
        ("machine", "%s, %d CPUs, %s memory" % (cpu or platform.machine(), os.cpu_count() or 0,
                                                 mem or "?")),
        ("system", "%s %s" % (platform.system(), platform.release())),
        ("Python", platform.python_version()),
        ("matplotlib", matplotlib.__version__),
    ]


def table(data):
    """The summary table: (header, rows) of strings."""
    budget = data.suite.get("budget_s_used")
    updates = data.suite.get("updates_budget_used")
    epochs = sorted({str(f.get("epochs", "?")) for _, f in data.cells})
    header = ["cell", "runs ok", "time to %.2f (s)" % data.suite["target_accuracy"],
              "epochs to %.2f" % data.suite["target_accuracy"],
              "final accuracy (epochs: %s)" % "/".join(epochs),
              "accuracy at %s" % ("%.1f s" % budget if budget else "budget"),
              "accuracy at %s updates" % ("%d" % updates if updates else "equal"),
              "wall (s)", "examples/s", "updates applied", "mean staleness >=",
              "B_simple", "busiest CPU"]
    rows = {r["cell"]: r for r in data.summary}
    out = []
    for cell, _ in data.cells:
        r = rows.get(cell)
        if r is None:
            continue
        mine = [x for x in data.results if x["cell"] == cell]
        busy = [float(x["cpu_busy"]) for x in mine if x.get("cpu_busy")]
        ttt_n = int(r.get("time_to_target_s_n") or 0)
        ok = int(r["runs"]) - int(r["failed"])
        out.append([
            cell, "%d/%s" % (ok, r["runs"]),
            _pm(r, "time_to_target_s", 1) + ("" if ttt_n == ok else " (%d/%d)" % (ttt_n, ok)),
            _pm(r, "epochs_to_target", 2), _pm(r, "test_accuracy", 4), _pm(r, "accuracy_at_budget", 4),
            _pm(r, "accuracy_at_updates", 4), _pm(r, "wall_s", 1),
            _pm(r, "examples_per_s", 0), _pm(r, "applied_updates", 0),
            _pm(r, "mean_staleness_lower_bound", 2), _pm(r, "noise_scale", 0),
            "%.0f%%" % (100 * max(busy)) if busy else "",
        ])
    return header, out


def notes(data):
    """Sentences that say what the table compares."""
    s = data.suite
    budget = s.get("budget_s_used")
    out = [
        "Each cell ran %s; ± is the half-width of the 95%% confidence interval of the "
        "mean (Student's t), over the runs that finished." % (
            "%d seed(s)" % s["seeds"] if not s.get("skipped") else
            "up to %d seeds (left out with --skip: %s)" % (s["seeds"], ", ".join(s["skipped"]))),
        "Time to target: from the launch until a worker first measured %.2f test accuracy; runs "
        "that never reached it are left out of the mean, and (k/n) says how many did."
        % s["target_accuracy"],
        "Final accuracy is after the same number of epochs for every cell (the table's header "
        "says how many): equal work, not equal time.",
        "Accuracy at %s is each run's latest evaluation by then: equal wall-clock time, not "
        "equal work (%s)." % ("%.1f s" % budget if budget else "the budget",
                               "the suite's budget_s" if s.get("budget_s") else
                               "the fastest cell's median wall time"),
        "Accuracy at %s updates is each run's latest evaluation by then: equal optimizer steps "
        "on the model (one per step under bsp, backup and the ring; one per gradient under async "
        "and ssp, counted from the workers' step logs), the fewest any cell applies."
        % (s.get("updates_budget_used") and "%d" % s["updates_budget_used"] or "equal"),
        "Updates applied counts the tensor updates the servers made, summed over shards: one per "
        "tensor per step under bsp and backup, one per tensor per gradient under async and ssp; "
        "the all-reduce mode has no servers (n/a).",
        "Mean staleness is a lower bound from the servers' staleness histogram (each bucket "
        "counted at its lowest value).",
        "B_simple is the gradient noise scale tr(Sigma)/|G|^2 the servers measured (bsp and "
        "backup only), from their moving averages at the end of the run.",
        "Busiest CPU is the machine's highest mean CPU use during one of the cell's runs; above "
        "95% the run measured the machine rather than the mode.",
    ]
    failed = [r for r in data.results if r["ok"] != "True"]
    if failed:
        out.append("Failed runs: " + "; ".join("%s seed %s: %s" % (
            r["cell"], r["seed"], r["error"] or "no error recorded") for r in failed) + ".")
    busy = [r for r in data.results if r.get("cpu_busy") and float(r["cpu_busy"]) > 0.95]
    if busy:
        out.append("Saturated machine (over 95%% busy) during: %s." % ", ".join(
            "%s seed %s" % (r["cell"], r["seed"]) for r in busy))
    if data.partial:
        out.append("The sweep had not finished (no summary.csv yet): this report has the %d runs "
                   "that results.csv held, of %d." % (len(data.results),
                                                      len(data.planned) * s["seeds"] -
                                                      len(s.get("skipped", []))))
    return out


def write(out):
    """Draws the plots and writes report.md and report.html in `out`; returns their paths."""
    plt = pyplot()
    data = Data(out)
    plots_dir = os.path.join(out, "plots")
    os.makedirs(plots_dir, exist_ok=True)
    drawn = []
    for name, draw, caption in PLOTS:
        if draw(plt, data, plots_dir):
            drawn.append((name, caption(data) if callable(caption) else caption))
    env = environment(out)
    header, rows = table(data)
    batches = report_batch.batch_table(data)
    s = data.suite

    simulated = (["Simulated: every run is the simulator's (sim/README.md), its times simulated "
                  "seconds; the machine's CPU use says nothing about them.", ""]
                 if s.get("simulated") else [])
    md = ["# Experiment %s" % s["name"], "", s.get("description") or "", ""] + simulated + [
          "Command: `%s`" % s["command"], "",
          "Suite file: `%s`; output: `%s`; began %s." % (s["path"], out, s.get("began", "?")), "",
          "## Results", ""] + _md_table(header, rows)
    md += [""] + ["- " + n for n in notes(data)] + [""]
    methods = method_table.table(data.summary)
    if methods:
        md += ["## Methods against straggler-free bsp", ""] + _md_table(*methods[:2]) + [""]
        md += ["- " + n for n in methods[2]] + [""]
    if batches:
        md += ["## Against the global batch", ""] + _md_table(*batches) + [""]
        md += ["- " + n for n in report_batch.batch_notes(data)] + [""]
    md += ["## Plots", ""]
    for name, caption in drawn:
        md += ["### %s" % name, "", "![%s](plots/%s.png)" % (name, name), "", caption, ""]
    md += ["## Versions and machine", ""] + ["- %s: %s" % kv for kv in env]
    md += ["", "## The runs' flags", "", "Every run: `%s`" % _flags(s["base"]), ""]
    md += ["- %s: `%s`" % (c, _flags(f)) for c, f in data.cells]
    md_path = os.path.join(out, "report.md")
    _write(md_path, "\n".join(md) + "\n")

    e = html.escape
    # Well-formed XML as well as HTML (void elements closed), so that tools of either kind read it.
    h = ["<!DOCTYPE html>", "<html><head><meta charset=\"utf-8\"/>",
         "<title>Rubato experiment %s</title>" % e(s["name"]),
         "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;"
         "padding:3px 7px;text-align:right}td:first-child,th:first-child{text-align:left}"
         "img{max-width:100%}code{background:#f4f4f4}</style></head><body>",
         "<h1>Experiment %s</h1>" % e(s["name"]), "<p>%s</p>" % e(s.get("description") or ""),
         "".join("<p>%s</p>" % e(line) for line in simulated if line),
         "<p>Command: <code>%s</code></p>" % e(s["command"]),
         "<p>Suite file: <code>%s</code>; output: <code>%s</code>; began %s.</p>" % (
             e(s["path"]), e(out), e(s.get("began", "?"))),
         "<h2>Results</h2>"] + _html_table(header, rows)
    h += ["<ul>"] + ["<li>%s</li>" % e(n) for n in notes(data)] + ["</ul>"]
    if methods:
        h += ["<h2>Methods against straggler-free bsp</h2>"] + _html_table(*methods[:2])
        h += ["<ul>"] + ["<li>%s</li>" % e(n) for n in methods[2]] + ["</ul>"]
    if batches:
        h += ["<h2>Against the global batch</h2>"] + _html_table(*batches)
        h += ["<ul>"] + ["<li>%s</li>" % e(n) for n in report_batch.batch_notes(data)] + ["</ul>"]
    h += ["<h2>Plots</h2>"]
    for name, caption in drawn:
        h += ["<h3>%s</h3>" % e(name),
              "<p><img src=\"plots/%s.png\" alt=\"%s\"/></p>" % (name, name),
              "<p>%s <a href=\"plots/%s.svg\">SVG</a></p>" % (e(caption), name)]
    h += ["<h2>Versions and machine</h2><ul>"]
    h += ["<li>%s: %s</li>" % (e(k), e(v)) for k, v in env]
    h += ["</ul><h2>The runs' flags</h2>",
          "<p>Every run: <code>%s</code></p><ul>" % e(_flags(s["base"]))]
    h += ["<li>%s: <code>%s</code></li>" % (e(c), e(_flags(f))) for c, f in data.cells]
    h += ["</ul></body></html>"]
    html_path = os.path.join(out, "report.html")
    _write(html_path, "\n".join(h) + "\n")
    return md_path, html_path, [os.path.join(plots_dir, n + ".png") for n, _ in drawn]


def _md_table(header, rows):
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def _html_table(header, rows):
    e = html.escape
    return (["<table><tr>%s</tr>" % "".join("<th>%s</th>" % e(c) for c in header)]
            + ["<tr>%s</tr>" % "".join("<td>%s</td>" % e(c) for c in r) for r in rows]
            + ["</table>"])


def _flags(flags):
    return " ".join("--%s=%s" % (k, v) for k, v in flags.items()) or "(none)"


def _write(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: %s DIR (an experiment's output directory)" % sys.argv[0], file=sys.stderr)
        sys.exit(2)
    try:
        paths = write(sys.argv[1])
    except ReportError as e:
        print("rubato experiment: error: %s" % e, file=sys.stderr)
        sys.exit(1)
    print("rubato experiment: report in %s and %s (%d plots)" % (paths[0], paths[1],
                                                                  len(paths[2])))
