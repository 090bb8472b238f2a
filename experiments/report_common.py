"""What the report's modules share: saving a plot, reading a summary row's numbers and
writing them with their interval."""

import os


def save(plt, fig, plots_dir, name, rect=(0, 0, 1, 1)):
    fig.tight_layout(rect=rect)
    for ext in ("png", "svg"):
        fig.savefig(os.path.join(plots_dir, "%s.%s" % (name, ext)),
                    dpi=110 if ext == "png" else None, metadata=_metadata(ext))
    plt.close(fig)
    return name


def _metadata(ext):
    # Files that depend only on the data (no creation date), so that a redrawn report is equal.
    return {"png": {"Software": None}, "svg": {"Date": None}}.get(ext)


def to_float(row, key):
    value = row.get(key, "")
    return float(value) if value not in ("", None) else None


def pm(row, metric, digits):
    m = to_float(row, metric + "_mean")
    if m is None:
        return "n/a"
    lo, hi = to_float(row, metric + "_ci95_lo"), to_float(row, metric + "_ci95_hi")
    if int(row.get(metric + "_n") or 0) < 2 or lo is None:
        return "%.*f" % (digits, m)
    return "%.*f ± %.*f" % (digits, m, digits, (hi - lo) / 2)
