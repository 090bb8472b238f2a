"""What the experiment report derives from the runs (issue 14), as plain functions without plots,
so that each can be tested on known inputs:

- accuracy_at(evals, t): a run's test accuracy at wall time t (its latest evaluation by then);
- pick_budget(rows, given): the wall-clock budget at which cells are compared;
- band(curves, grid): the median and the min..max over seeds of accuracy against time;
- severity(flags): how much slower than the others a run's slowest worker computes;
- timeline(records_by_worker, started): per worker and log interval, the time spent computing,
  communicating and waiting.

Times are seconds on the launch's clock (since ./rubato launch began), as in summary.json.
"""

import math
import re

# Which part of a step each timeline segment is.
PARTS = ("compute", "communication", "waiting", "other")


def accuracy_at(evals, t):
    """The test accuracy of the latest evaluation at or before `t` (any worker), or None when
    there was none by then. `evals`: summary.json's list of {"t", "test_accuracy", ...}."""
    best = None
    for e in evals:
        if e["t"] <= t and (best is None or e["t"] >= best["t"]):
            best = e
    return None if best is None else best["test_accuracy"]


def median(values):
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of no values")
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def pick_budget(rows, given=None):
    """The wall-clock budget for "accuracy at an equal budget": `given` if set, else the smallest
    per-cell median wall time over the runs that finished (the time by which the fastest
    configuration is done, so that every cell is still running or just done at that moment).
    None when no run finished."""
    if given:
        return float(given)
    cells = {}
    for r in rows:
        if r.get("ok") and r.get("wall_s") not in (None, ""):
            cells.setdefault(r["cell"], []).append(float(r["wall_s"]))
    if not cells:
        return None
    return min(median(v) for v in cells.values())


def band(curves, grid):
    """For each time in `grid`: (median, lowest, highest) accuracy over the runs whose curve has a
    value by then (None where none has). `curves`: one evals list per run."""
    out = []
    for t in grid:
        values = [a for a in (accuracy_at(c, t) for c in curves) if a is not None]
        out.append((median(values), min(values), max(values)) if values else None)
    return out


def severity(flags):
    """The slowdown factor of a run's slowest worker: the largest FACTOR of --slow_workers
    (ID:FACTOR,...), else --slowdown, else 1."""
    slow = flags.get("slow_workers")
    if slow not in (None, ""):
        factors = [float(part.split(":")[1]) for part in str(slow).split(",") if ":" in part]
        if factors:
            return max(factors)
    slowdown = flags.get("slowdown")
    return float(slowdown) if slowdown not in (None, "") else 1.0


def label(flags, varying, leave_out=()):
    """A short name for a series: the flags that vary across the suite's cells, less
    `leave_out` (e.g. the x axis), as k=v; the mode alone when only it varies."""
    keys = [k for k in varying if k not in leave_out]
    if keys == ["mode"]:
        return str(flags.get("mode", "bsp"))
    parts = ["%s=%s" % (k, flags.get(k, "-")) for k in keys]
    return ",".join(parts) or "all"


def varying_flags(cells):
    """The flags whose values differ across `cells` ([(name, flags)]), in first-seen order."""
    keys = []
    for _, flags in cells:
        for k in flags:
            if k not in keys:
                keys.append(k)
    return [k for k in keys if len({str(f.get(k)) for _, f in cells}) > 1]


def timeline(records_by_worker, started):
    """Per worker, the log intervals of its training as (begin, {part: seconds}), on the launch's
    clock. `records_by_worker`: {worker: [its "step" records]} (from worker-K.jsonl); `started`:
    {worker: seconds since launch when its training began}.

    A step record gives, per step of the interval, the mean compute time (compute_ms, plus
    delay_ms: the injected compute floor and slowdown, which stand for a slower machine) and the
    mean time spent pulling and pushing (comm_ms). How much of comm_ms is waiting for the other
    workers is not measured by the worker; it is estimated here as comm_ms less the least comm_ms
    any worker had for the interval ending at the same step: in a synchronous step the worker
    that arrives last waits for nobody, so its exchange is the step's communication. Under async
    nobody waits for anybody, and the estimate is the spread of exchange times. Whatever of the
    interval's wall time the parts do not cover (evaluations, bookkeeping) is "other"."""
    least = {}
    for records in records_by_worker.values():
        for r in records:
            least[r["step"]] = min(least.get(r["step"], math.inf), r["comm_ms"])
    out = {}
    for worker, records in records_by_worker.items():
        t0 = started.get(worker)
        if t0 is None:
            continue
        intervals, prev_t, prev_step = [], 0.0, 0
        for r in sorted(records, key=lambda r: r["step"]):
            steps = r["step"] - prev_step
            length = r["t"] - prev_t
            if steps <= 0 or length <= 0:
                prev_t, prev_step = r["t"], r["step"]
                continue
            compute = steps * (r["compute_ms"] + r.get("delay_ms", 0.0)) / 1e3
            comm = steps * least[r["step"]] / 1e3
            waiting = steps * (r["comm_ms"] - least[r["step"]]) / 1e3
            parts = {"compute": compute, "communication": comm, "waiting": waiting}
            covered = sum(parts.values())
            if covered > length:  # Rounding: the parts are measured separately from the interval.
                parts = {k: v * length / covered for k, v in parts.items()}
                covered = length
            parts["other"] = length - covered
            intervals.append((t0 + prev_t, parts))
            prev_t, prev_step = r["t"], r["step"]
        out[worker] = intervals
    return out


def totals(intervals):
    """{part: seconds} summed over one worker's timeline intervals."""
    out = dict.fromkeys(PARTS, 0.0)
    for _, parts in intervals:
        for k, v in parts.items():
            out[k] += v
    return out


def slug(name):
    """A file-name-safe form of a cell's name."""
    return re.sub(r"[^a-z0-9.-]+", "_", name.lower()).strip("_") or "cell"
