"""The report's parts for suites whose cells differ in the global batch (the lr-scaling study):
the plots of final accuracy and steps to target against the batch, with the measured noise scale,
and the table per configuration and batch (experiments/report.py draws and writes them)."""

import math

from experiments import analysis, stats
from experiments.report_common import pm as _pm, save as _save


NOISE_LABEL = "measured B_simple (McCandlish et al. 2018)"


def noise_text(noise):
    """The measured noise scale in words: its median over the runs and its range over the global
    batches (each run measures its own)."""
    if noise is None:
        return "No run measured B_simple."
    return ("%s, over the runs that reached the target (a diverged run measures gradients far "
            "from the others'): median %.0f over the %d runs at the smallest global batch (%d; "
            "the most steps, trained furthest: the noise scale grows as the loss falls); its "
            "median per global batch ranges from %.0f (batch %d) to %.0f (batch %d), lower at "
            "large batches, which end after fewer steps at a higher loss." % (
                "M" + NOISE_LABEL[1:], noise["median"], noise["runs"], noise["batch"],
                noise["low"][1], noise["low"][0], noise["high"][1], noise["high"][0]))


def noise_of(data):
    return analysis.noise_summary(data.results, dict(data.planned))


def _mark_noise(ax, noise):
    """B_simple on a plot against the global batch: a line at its median over the runs, a band
    over its medians per global batch."""
    if noise is None or noise["median"] <= 0:
        return
    low, high = noise["low"][1], noise["high"][1]
    if 0 < low < high:
        ax.axvspan(low, high, color="grey", alpha=0.12, lw=0,
                   label="B_simple, median per batch: %.0f to %.0f" % (low, high))
    ax.axvline(noise["median"], color="k", lw=1.0, ls="-.",
               label="%s at batch %d, median %.0f" % (NOISE_LABEL, noise["batch"],
                                                        noise["median"]))


def _batch_axis(ax, batches):
    """A log2 x axis with a tick at each global batch, and the legend beside the plot."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("global batch (workers x batch_size per worker)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))


def _log_label(value, _):
    """A log axis's tick label: plain numbers at 1, 2 and 5 times a power of ten, none between."""
    if value <= 0:
        return ""
    return "%g" % value if round(value / 10 ** math.floor(math.log10(value) + 1e-9)) in (
        1, 2, 5) else ""


def _epochs(data):
    return "/".join(sorted({str(f.get("epochs", "?")) for _, f in data.cells}))


def plot_accuracy_vs_batch(plt, data, plots_dir):
    if data.batch_series is None:
        return None
    grid = {g["cell"]: g for g in analysis.batch_grid(data.batch_series, data.results)}
    fig, ax = plt.subplots(figsize=(10, 4.8))
    batches = set()
    for i, (label, points) in enumerate(data.batch_series.items()):
        pts = [(b, grid[c]["accuracy"]) for b, c in points if grid[c]["accuracy"]]
        if not pts:
            continue
        xs = [b for b, _ in pts]
        color = "C%d" % (i % 10)
        ax.plot(xs, [analysis.median(v) for _, v in pts], "--" if i >= 10 else "-",
                marker="o", ms=4, lw=1.4, color=color, label=label)
        ax.fill_between(xs, [min(v) for _, v in pts], [max(v) for _, v in pts], color=color,
                        alpha=0.12, lw=0)
        batches.update(xs)
    if len(batches) < 2:
        plt.close(fig)
        return None
    ax.axhline(data.suite["target_accuracy"], color="k", lw=0.8, ls=":")
    _mark_noise(ax, noise_of(data))
    _batch_axis(ax, sorted(batches))
    ax.set_ylabel("final test accuracy (epochs: %s)" % _epochs(data))
    ax.set_title("%s: final test accuracy at an equal number of epochs against the global "
                 "batch\nline: median over seeds; band: lowest to highest run; dotted: target"
                 % data.suite["name"], fontsize=9)
    return _save(plt, fig, plots_dir, "accuracy_vs_batch")


def plot_steps_vs_batch(plt, data, plots_dir):
    if data.batch_series is None:
        return None
    grid = {g["cell"]: g for g in analysis.batch_grid(data.batch_series, data.results)}
    target = data.suite["target_accuracy"]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    batches, missing = set(), False
    for i, (label, points) in enumerate(data.batch_series.items()):
        color = "C%d" % (i % 10)
        xs, ys, lo, hi, none = [], [], [], [], []
        for batch, cell in points:
            g = grid[cell]
            if not g["steps"]:
                if g["ok"]:  # Finished, never reached it: a gap in the line, not a zero.
                    none.append(batch)
                    xs.append(batch)
                    ys.append(float("nan"))
                    lo.append(0)
                    hi.append(0)
                continue
            m = analysis.median(g["steps"])
            xs.append(batch)
            ys.append(m)
            lo.append(m - min(g["steps"]))
            hi.append(max(g["steps"]) - m)
            if len(g["steps"]) < g["ok"]:
                ax.annotate("%d/%d" % (len(g["steps"]), g["ok"]), (batch, m), xytext=(4, 3),
                            textcoords="offset points", fontsize=6.5, color=color)
            batches.add(batch)
        if len(xs) > len(none):
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=3, lw=1.2,
                        ls="--" if i >= 10 else "-", color=color, label=label)
        if none:  # Near the top, a row per line so that lines missing at one batch all show.
            ax.plot(none, [0.97 - 0.035 * (i % 10)] * len(none), "x", ms=5, mew=1.5, color=color,
                    transform=ax.get_xaxis_transform(), clip_on=False)
            batches.update(none)
            missing = True
    if len(batches) < 2 or not any(grid[c]["steps"] for c in grid):
        plt.close(fig)
        return None
    if missing:
        ax.plot([], [], "x", color="grey", mew=1.5,
                label="no run reached %.2f (missing, not 0)" % target)
    _mark_noise(ax, noise_of(data))
    _batch_axis(ax, sorted(batches))
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(plt.FuncFormatter(_log_label))
    ax.yaxis.set_minor_formatter(plt.FuncFormatter(_log_label))
    ax.set_ylabel("steps to %.2f test accuracy" % target)
    ax.set_title("%s: steps to %.2f test accuracy against the global batch\nmedian of the runs "
                 "that reached it; bars: lowest to highest; k/n: how many did; x at the top: "
                 "none did" % (data.suite["name"], target), fontsize=9)
    return _save(plt, fig, plots_dir, "steps_to_target_vs_batch")


def batch_caption(what, how):
    """The caption of a plot against the global batch, with the measured noise scale."""
    def caption(data):
        return ("%s against the global batch (workers x batch_size; log scale, base 2), a line "
                "per configuration: %s The dash-dotted vertical line is the gradient noise scale "
                "B_simple that the runs measured (McCandlish et al. 2018): at a batch equal to it "
                "training takes about twice the fewest steps any batch could, and beyond it a "
                "larger batch saves ever fewer steps; the grey band spans its medians per global "
                "batch. %s" % (what, how, noise_text(noise_of(data))))
    return caption


def batch_table(data):
    """The table per configuration and global batch, for suites whose cells differ in it:
    (header, rows) of strings, or None."""
    if data.batch_series is None:
        return None
    header = ["configuration", "global batch", "runs ok",
              "final accuracy (epochs: %s)" % _epochs(data),
              "steps to %.2f" % data.suite["target_accuracy"], "runs that reached it",
              "B_simple (median)"]
    out = []
    for g in analysis.batch_grid(data.batch_series, data.results):
        out.append([g["label"], str(g["batch"]), "%d/%d" % (g["ok"], g["runs"]),
                    _pm(_interval("a", g["accuracy"]), "a", 4),
                    _pm(_interval("s", g["steps"]), "s", 0), "%d/%d" % (len(g["steps"]), g["ok"]),
                    "n/a" if g["noise"] is None else "%.0f" % g["noise"]])
    return header, out


def _interval(metric, values):
    """A summary.csv row of `values` for _pm: their mean and 95% interval (experiments/stats.py)."""
    if not values:
        return {}
    lo, hi = stats.ci95(values)
    return {metric + "_n": len(values), metric + "_mean": stats.mean(values),
            metric + "_ci95_lo": lo, metric + "_ci95_hi": hi}


def batch_notes(data):
    """Sentences that say what the table per global batch compares."""
    noise = noise_of(data)
    out = [
        "Global batch: examples per step, workers x batch_size; each row is one cell of the "
        "suite. Final accuracy: mean ± half-width of the 95% interval over the runs that "
        "finished, after the same number of epochs at every batch.",
        "Steps to target: the job step of the first evaluation at or above %.2f (so no finer "
        "than the cell's eval_every), mean ± 95%% interval over the runs that reached it; the "
        "next column says how many of the runs that finished did." % (
            data.suite["target_accuracy"]),
        "B_simple: the median over the cell's runs of the gradient noise scale tr(Sigma)/|G|^2 "
        "that the servers measured (their moving averages at the end of each run). " +
        noise_text(noise),
    ]
    if noise is not None:
        out.append("B_simple per global batch (median over its runs, runs): " + ", ".join(
            "%d: %.0f (%d)" % (b, m, n) for b, (m, n) in noise["by_batch"].items()) + ".")
    return out
