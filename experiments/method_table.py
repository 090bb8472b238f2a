"""Straggler-mitigation methods against straggler-free bsp, pattern by pattern (issue 33).

For a suite whose cells cross a `mode` axis with a `pattern` axis (the patterns suite), each
pattern's time to the target accuracy under the best fixed consistency mode and under each
mitigation method, divided by bsp's time without a straggler (pattern none):

  best fixed mode      the fastest of bsp, backup:1, ssp:2, async and the synchronous ring
                       for that pattern (named), as a user who knew the pattern would pick
  reassignment         async with work reassignment (mode reassign; docs/straggler.md)
  majority all-reduce  eager-SGD's partial ring (mode majority)
  adaptive             the adaptive consistency mode (mode adaptive: K = 20), where the suite
                       has it, and with K = 5 (mode adaptive-5)

A method a suite does not run is left out. Intervals are the cell's 95% interval of the mean
divided by the reference's mean (the reference's own spread is not folded in); a cell of one
seed has none.
"""

FIXED = ("bsp", "backup:1", "ssp:2", "async", "allreduce")
METHODS = (("reassignment", "reassign"), ("majority all-reduce", "majority"),
           ("adaptive", "adaptive"), ("adaptive, K = 5", "adaptive-5"))
REFERENCE = ("bsp", "none")  # (mode, pattern)
METRIC = "time_to_target_s"


def axes_of(cell):
    """{"mode": ..., "pattern": ...} from an axes cell's name ("mode=bsp,pattern=none")."""
    out = {}
    for part in cell.split(","):
        key, sep, value = part.partition("=")
        if sep:
            out[key] = value
    return out


def _float(row, key):
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def _grid(summary_rows):
    """{(pattern, mode): summary row} and the patterns in the order they first appear."""
    grid, patterns = {}, []
    for r in summary_rows:
        a = axes_of(r["cell"])
        if "mode" in a and "pattern" in a:
            grid[(a["pattern"], a["mode"])] = r
            if a["pattern"] not in patterns:
                patterns.append(a["pattern"])
    return grid, patterns


def relative(row, reference_s):
    """(ratio, lo, hi) of a cell's mean time to target over `reference_s`; lo and hi are None
    without an interval; None if no run of the cell reached the target."""
    mean = _float(row, METRIC + "_mean")
    if mean is None:
        return None
    lo, hi = _float(row, METRIC + "_ci95_lo"), _float(row, METRIC + "_ci95_hi")
    if lo is None or hi is None or lo == hi:
        return (mean / reference_s, None, None)
    return (mean / reference_s, lo / reference_s, hi / reference_s)


def comparison(summary_rows):
    """The table's data: (reference seconds, methods run, [(pattern, best fixed mode or None,
    {method: (ratio, lo, hi) or None})]), or None where the suite is not such a grid or has no
    reference time."""
    grid, patterns = _grid(summary_rows)
    ref_row = grid.get((REFERENCE[1], REFERENCE[0]))
    reference_s = _float(ref_row, METRIC + "_mean") if ref_row else None
    if not reference_s:
        return None
    modes = {m for _, m in grid}
    methods = ["best fixed mode"] + [name for name, mode in METHODS if mode in modes]
    out = []
    for p in patterns:
        fixed = [(relative(grid[(p, m)], reference_s), m) for m in FIXED if (p, m) in grid]
        fixed = [(r, m) for r, m in fixed if r is not None]
        best = min(fixed, key=lambda x: x[0][0]) if fixed else None
        values = {"best fixed mode": best[0] if best else None}
        for name, mode in METHODS:
            if name in methods:
                row = grid.get((p, mode))
                values[name] = relative(row, reference_s) if row else None
        out.append((p, best[1] if best else None, values))
    return reference_s, methods, out


def _cell(value):
    if value is None:
        return "not reached"
    ratio, lo, hi = value
    return "%.2f" % ratio if lo is None else "%.2f [%.2f, %.2f]" % (ratio, lo, hi)


def table(summary_rows):
    """(header, rows, notes) for report.md, or None (see comparison)."""
    c = comparison(summary_rows)
    if c is None:
        return None
    reference_s, methods, data = c
    header = ["pattern"] + methods
    rows = []
    for pattern, best_mode, values in data:
        best = _cell(values["best fixed mode"])
        if best_mode is not None:
            best += " (%s)" % best_mode
        rows.append([pattern, best] + [_cell(values[m]) for m in methods[1:]])
    notes = [
        "Time to target divided by bsp's without a straggler (pattern none): %.1f s. Below 1: "
        "faster than that." % reference_s,
        "Best fixed mode: the fastest of %s for the pattern, named." % ", ".join(FIXED),
        "[lo, hi]: the cell's 95% interval over its seeds divided by the reference's mean; none "
        "with one seed. Not reached: no run of the cell reached the target.",
    ]
    return header, rows, notes


def plot(plt, summary_rows, suite, plots_dir, save):
    """Grouped bars per pattern, a bar per method, against the reference line at 1."""
    c = comparison(summary_rows)
    if c is None:
        return None
    reference_s, methods, data = c
    fig, ax = plt.subplots(figsize=(9, 4.4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        xs, ys, lows, highs = [], [], [], []
        for j, (_, _, values) in enumerate(data):
            v = values.get(method)
            if v is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(v[0])
            lows.append(v[0] - (v[1] if v[1] is not None else v[0]))
            highs.append((v[2] if v[2] is not None else v[0]) - v[0])
        ax.bar(xs, ys, width * 0.92, color="C%d" % i, label=method,
               yerr=[lows, highs] if any(lows) or any(highs) else None, capsize=2)
    ax.axhline(1.0, color="#444444", lw=0.8, ls=":")
    ax.set_xticks(range(len(data)))
    ax.set_xticklabels(["%s\n(%s)" % (p, b) if b else p for p, b, _ in data], fontsize=7)
    ax.set_ylabel("time to target / straggler-free bsp")
    ax.set_title("%s: time to %.2f test accuracy relative to bsp without a straggler (%.1f s); "
                 "best fixed mode named" % (suite["name"], suite["target_accuracy"], reference_s),
                 fontsize=9)
    ax.legend(fontsize=7)
    return save(plt, fig, plots_dir, "methods_vs_bsp")
