"""What the experiment report derives from the runs (issue 14), as plain functions without plots,
so that each can be tested on known inputs:

- accuracy_at(evals, t): a run's test accuracy at wall time t (its latest evaluation by then);
- pick_budget(rows, given): the wall-clock budget at which cells are compared;
- updates_at_evals(evals, steps_by_worker, started, per_gradient), model_updates(summary),
  pick_update_budget(rows), accuracy_at_updates(update_evals, n): the comparison at an equal
  number of model updates (issue 33: async applies every worker's gradient as an update, bsp one
  mean per step, so equal epochs are not equal optimizer steps);
- band(curves, grid): the median and the min..max over seeds of accuracy against time;
- severity(flags): how much slower than the others a run's slowest worker computes;
- timeline(records_by_worker, started): per worker and log interval, the time spent computing,
  communicating and waiting;
- global_batch(flags), batch_series(cells), batch_grid(series, rows): the runs of a suite whose
  cells differ in global batch (the lr-scaling study), as a line per configuration against it;
- noise_summary(rows, flags): the gradient noise scale B_simple the runs measured, over the suite
  and per global batch.

Times are seconds on the launch's clock (since ./rubato launch began), as in summary.json.
"""

import json
import math
import os
import re

# Which part of a step each timeline segment is.
PARTS = ("compute", "communication", "waiting", "other")


def accuracy_at(evals, t):
    """The test accuracy of the latest evaluation at or before `t` (any worker), or None when
    there was none by then. `evals`: summary.json's list of {"t", "test_accuracy", ...}."""
    return latest_accuracy(evals, "t", t)


def worker_records(run_dir, event, needs):
    """{worker: its `event` records that have the key `needs`} from a run's worker-N.jsonl files
    ({} when there are none; lines that are not JSON are skipped)."""
    out = {}
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return out
    for name in names:
        m = re.fullmatch(r"worker-(\d+)\.jsonl", name)
        if not m:
            continue
        records = []
        with open(os.path.join(run_dir, name), errors="replace") as f:
            for line in f:
                try:
                    r = json.loads(line)
                except ValueError:
                    continue
                if r.get("event") == event and needs in r:
                    records.append(r)
        out[int(m.group(1))] = records
    return out


def per_gradient(mode):
    """Whether each worker's gradient is an update of its own in `mode` (async, ssp), rather than
    one update per step averaging the workers' (bsp, backup, the ring)."""
    return str(mode).startswith(("async", "ssp"))


def model_updates(summary):
    """The updates a run applied to the model: its steps where a step is one update, else the sum
    of the steps each worker computed (skipped steps apply nothing)."""
    if not per_gradient(summary.get("mode", "")):
        return summary.get("steps")
    workers = summary.get("per_worker") or []
    if not workers:
        return None
    return sum(int(w.get("computed_steps", w.get("steps", 0))) for w in workers)


def updates_at_evals(evals, steps_by_worker, started, per_grad):
    """Each evaluation as {"t", "updates", "test_accuracy"}: the model updates applied by its time.
    With one update per step, the evaluation's step; with every gradient an update, the sum over
    workers of the latest step each had logged by then (`steps_by_worker`: {worker: its step
    records, "t" from its own start}; `started`: each worker's start on the launch's clock), so a
    count low by at most one log interval per worker."""
    out = []
    for e in evals:
        if not per_grad:
            updates = int(e["step"])
        else:
            updates = 0
            for w, records in steps_by_worker.items():
                t0 = started[w] if w < len(started) else 0.0
                updates += max([int(r["step"]) for r in records if t0 + r["t"] <= e["t"]] or [0])
        out.append({"t": e["t"], "updates": updates, "test_accuracy": e["test_accuracy"]})
    return out


def pick_update_budget(rows):
    """The number of model updates at which cells are compared: the smallest per-cell median of
    the runs' model_updates (the cell that applies fewest, e.g. bsp's one per step), or None."""
    return smallest_cell_median(rows, "model_updates")


def accuracy_at_updates(update_evals, n):
    """The test accuracy of the latest evaluation with at most `n` updates applied, or None."""
    return latest_accuracy(update_evals, "updates", n)


def latest_accuracy(evals, key, limit):
    """The test accuracy of the evaluation with the largest `key` at or below `limit`, or None."""
    best = None
    for e in evals:
        if e[key] <= limit and (best is None or e[key] >= best[key]):
            best = e
    return None if best is None else best["test_accuracy"]


def smallest_cell_median(rows, column):
    """The smallest per-cell median of `column` over the runs that finished, or None."""
    cells = {}
    for r in rows:
        if r.get("ok") and r.get(column) not in (None, ""):
            cells.setdefault(r["cell"], []).append(float(r[column]))
    if not cells:
        return None
    return min(median(v) for v in cells.values())


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
    return smallest_cell_median(rows, "wall_s")


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


def global_batch(flags):
    """The examples per step of a run: --workers x --batch_size (the launcher's and the worker's
    defaults, 2 and 64, where unset)."""
    return int(flags.get("workers", 2)) * int(flags.get("batch_size", 64))


def name_parts(name):
    """A cell's name as [(key, value)]: its axes' parts "key=value", and the cell's own name (a
    part without "=") under the key ""."""
    return [tuple(p.split("=", 1)) if "=" in p else ("", p) for p in name.split(",")]


def batch_series(cells, planned=None):
    """The lines of a plot against the global batch: {label: [(global batch, cell)]}, each sorted
    by batch, the labels in first-seen order; None when `cells` ([(name, flags)]) do not differ in
    global batch. A label is the parts of the cell's name that the global batch does not determine
    ("recipe=lamb" for "batch=256,recipe=lamb"; "all" when none is left), judged over `planned`
    (every cell of the suite; default `cells`) so that a sweep still running gets the same labels.
    """
    seen = {}  # key -> {global batch: {its values there}}
    for name, flags in planned or cells:
        for key, value in name_parts(name):
            seen.setdefault(key, {}).setdefault(global_batch(flags), set()).add(value)
    tied = {k for k, by_batch in seen.items() if all(len(v) == 1 for v in by_batch.values())}
    series = {}
    for name, flags in cells:
        label = ",".join("%s=%s" % (k, v) if k else v for k, v in name_parts(name)
                         if k not in tied) or "all"
        series.setdefault(label, []).append((global_batch(flags), name))
    if len({b for points in series.values() for b, _ in points}) < 2:
        return None
    return {label: sorted(points) for label, points in series.items()}


def finished_runs(rows, cell=None):
    """The rows of results.csv (or of the runner) whose run finished (ok), of `cell` if given."""
    return [r for r in rows if r.get("ok") in (True, "True") and cell in (None, r["cell"])]


def numbers(rows, column):
    """A column's values that are numbers; blanks, NaN and infinities are left out."""
    out = []
    for r in rows:
        try:
            value = float(r.get(column, ""))
        except (TypeError, ValueError):
            continue
        if math.isfinite(value):
            out.append(value)
    return out


def batch_grid(series, rows):
    """One entry per line and global batch of `series` (batch_series), in its order: {"label",
    "batch", "cell", "runs" (all of the cell's rows), "ok" (those that finished), "accuracy" (the
    final test accuracy of each), "steps" (the steps to target of those that reached it), "noise"
    (the median B_simple of those that measured it, else None)}. `rows`: results.csv's."""
    out = []
    for label, points in series.items():
        for batch, cell in points:
            done = finished_runs(rows, cell)
            noise = numbers(done, "noise_scale")
            out.append({"label": label, "batch": batch, "cell": cell,
                        "runs": sum(1 for r in rows if r["cell"] == cell), "ok": len(done),
                        "accuracy": numbers(done, "test_accuracy"),
                        "steps": numbers(done, "steps_to_target"),
                        "noise": median(noise) if noise else None})
    return out


def noise_summary(rows, flags):
    """The gradient noise scale B_simple that the runs measured (results.csv's noise_scale: each
    job's, from the servers' moving averages at its end), or None when none did. Only runs that
    reached the target count: a diverged run measures gradients far from any the others see.
    {"median": the median at the smallest global batch (the runs with the most steps, trained
    furthest, as the noise scale grows while the loss falls), "batch": that batch, "runs": how
    many runs it is of, "by_batch": {global batch: (median, runs)}, "low", "high": the (global
    batch, median) of by_batch's smallest and largest median}. `flags`: {cell: its flags}, for the
    global batch of each run."""
    by_batch = {}
    for r in finished_runs(rows):
        if r["cell"] not in flags or not numbers([r], "steps_to_target"):
            continue
        for value in numbers([r], "noise_scale"):
            by_batch.setdefault(global_batch(flags[r["cell"]]), []).append(value)
    if not by_batch:
        return None
    per_batch = {b: (median(v), len(v)) for b, v in sorted(by_batch.items())}
    ranked = sorted((m, b) for b, (m, _) in per_batch.items())
    smallest = min(per_batch)
    return {"median": per_batch[smallest][0], "batch": smallest, "runs": per_batch[smallest][1],
            "by_batch": per_batch, "low": ranked[0][::-1], "high": ranked[-1][::-1]}


def slug(name):
    """A file-name-safe form of a cell's name."""
    return re.sub(r"[^a-z0-9.-]+", "_", name.lower()).strip("_") or "cell"
