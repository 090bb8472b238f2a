"""The end of a job: why it failed (if it did), summary.json (every process's outcome, the
workers' results and the servers' statistics) and the lines printed about it."""

import json
import os

from .process import Proc
from .programs import WORKER_PROGRAM

STALENESS_BUCKETS = ["0", "1", "2", "3", "4-7", "8-15", "16-31", ">=32"]
# The lower end of each staleness bucket.
_BUCKET_LOWS = [0, 1, 2, 3, 4, 8, 16, 32]


def examples_drawn(steps, batch, changes):
    """Examples one worker drew in `steps` steps that began at `batch` a step, with the adaptive
    batch's `changes` ({"step", "batch_size"}, in step order) applied."""
    total, at = 0, 0
    for c in changes:
        if c["step"] >= steps:
            break
        total += (c["step"] - at) * batch
        at, batch = c["step"], c["batch_size"]
    return total + max(0, steps - at) * batch


def load_local_stats(servers, run_dir):
    """Local servers write their final statistics to a file: each server's, where its stdout line
    gave none."""
    for s, p in enumerate(servers):
        if p.stats is None:
            try:
                with open(os.path.join(run_dir, "server-%d.stats.json" % s)) as f:
                    p.stats = json.load(f)
            except (OSError, ValueError):
                pass


def failed_processes(procs):
    """Every process that failed by itself, in the order it ended: the first is usually the
    cause."""
    return sorted((p for p in procs if p.outcome()[0] == "FAILED"), key=Proc.end_order)


def failure_message(failed, workers, total_workers, at):
    """Why a job whose processes `failed` (failed_processes) failed, or None; "no worker finished"
    when none of `workers` did. `at(p)` names a process."""
    if failed:
        failed_workers = [p for p in failed if p.program == WORKER_PROGRAM]
        failed_servers = len(failed) - len(failed_workers)  # Ended after the last worker did.
        failure = "%d of %d worker(s)%s failed%s %s %s" % (
            len(failed_workers), total_workers,
            " and %d server(s)" % failed_servers if failed_servers else "",
            ":" if len(failed) == 1 else ", first", at(failed[0]), failed[0].outcome()[1])
        if len(failed) > 1:  # Each one's reason is printed above and in summary.json.
            failure += "; then %s" % ", ".join(at(p) for p in failed[1:])
        return failure
    if not any(p.outcome()[0] == "done" for p in workers):
        return "no worker finished"
    return None


def summarize(views, wall, args, failure, run_dir, workers, servers, restarted=()):
    summary = {"ok": failure is None, "error": failure, "wall_s": round(wall, 3),
               "servers": args.servers, "workers": args.workers, "mode": args.mode or "bsp",
               "target_accuracy": args.target_accuracy, "max_message_mb": int(args.max_message_mb)}
    if args.plan:
        if args.hostfile is not None:
            summary["hostfile"] = os.path.abspath(args.hostfile)
        summary["hosts"] = [{"host": h, "slots": s} for h, s in args.plan.hosts]
        if args.rsh is not None:
            summary["rsh"] = args.rsh
    # How each process ended: done, failed (with its reason), crashed (injected) or stopped.
    summary["worker_outcomes"] = [p.record() for p in workers]
    summary["server_outcomes"] = [p.record() for p in servers]
    summary["restarted_servers"] = [p.record() for p in restarted]
    summary["failed_workers"] = sum(p.outcome()[0] == "FAILED" for p in workers)
    summary["injected_crashes"] = sum(p.outcome()[0] == "crashed" for p in workers)
    summary.update(worker_results(views, wall, args.target_accuracy))
    summary.update(server_totals([s.stats for s in servers]))
    return summary


def worker_results(views, wall, target_accuracy):
    """The summary's fields from the workers' progress records."""
    out = {}
    # Under bsp only worker 0 evaluates (all hold the same weights); a done record without
    # test_accuracy is of a worker that did not.
    done = [(v.evals[-1][0], v.done) for v in views
            if v.done and v.evals and "test_accuracy" in v.done]
    if done:
        # The worker that finished last evaluated the final weights (under bsp all agree).
        out["test_accuracy"] = max(done, key=lambda d: d[0])[1]["test_accuracy"]
        finished = [v.done for v in views if v.done]
        out["steps"] = max(d["steps"] for d in finished)
        out["per_worker"] = finished
    reached = [(t, step, epochs) for v in views
               for (t, acc), step, epochs in zip(v.evals, v.eval_steps, v.eval_epochs)
               if acc >= target_accuracy]
    out["time_to_target_s"] = round(min(reached)[0], 3) if reached else None
    # The job step at which a worker first measured it (the evaluation's own step), and the
    # epochs of training examples drawn by then (the fair measure when the batch changes).
    out["steps_to_target"] = min(reached)[1] if reached else None
    out["epochs_to_target"] = min(reached)[2] if reached else None
    # Adaptive batch: every change, as the servers announced it (worker 0's records).
    changes = [c for v in views for c in v.batch_changes]
    out["batch_changes"] = [
        {k: c.get(k) for k in ("step", "batch_size", "global_batch", "b_simple", "learning_rate")}
        for c in sorted(changes, key=lambda c: c.get("step", 0))]
    # Every evaluation, on the launch's clock (seconds since the launch began), for plots of
    # accuracy against wall time; and when each worker's training began on that clock (its
    # records' "t" count from there).
    out["evals"] = sorted(
        ({"worker": v.index, "t": round(t, 3), "step": step, "test_accuracy": acc}
         for v in views for (t, acc), step in zip(v.evals, v.eval_steps)),
        key=lambda e: e["t"])
    out["worker_started_s"] = [None if v.started_at is None else round(v.started_at, 3)
                               for v in views]
    worker_steps = sum(v.step.get("step", 0) for v in views)
    # The examples the workers drew: their computed steps where their done records say (a worker
    # that skips steps, under backup:b or the partial all-reduce, draws none for them), else the
    # steps their records reached, at the adaptive batch's sizes.
    examples = sum(v.done["computed_steps"] * v.start.get("batch_size", 0)
                   if v.done and "computed_steps" in v.done and not out["batch_changes"]
                   else examples_drawn(v.step.get("step", 0), v.start.get("batch_size", 0),
                                       out["batch_changes"]) for v in views)
    out["worker_steps_per_s"] = round(worker_steps / max(wall, 1e-9), 2)
    out["examples_per_s"] = round(examples / max(wall, 1e-9), 1)
    return out


def server_totals(stats):
    """The summary's fields from the servers' final statistics (each one's stats record,
    proto/progress.proto: from its stdout line, or locally its file; None where a server left
    none)."""
    histogram = [0] * len(STALENESS_BUCKETS)
    totals = {"applied_updates": 0, "dropped_gradients": 0, "dropped_workers": 0,
              "rejected_pushes": 0, "refused_updates": 0}
    for one in stats:
        if not isinstance(one, dict):
            continue
        for key in totals:
            try:
                totals[key] += int(one.get(key, 0))
            except (TypeError, ValueError):
                pass
        for i, n in enumerate(one.get("staleness_histogram", [])[:len(histogram)]):
            histogram[i] += int(n)
    out = dict(totals)
    out["staleness_histogram"] = dict(zip(STALENESS_BUCKETS, histogram))
    noise = noise_scale(stats)
    if noise:
        out["noise_scale"] = noise
    total = sum(histogram)
    if total:
        out["mean_staleness_lower_bound"] = round(
            sum(l * n for l, n in zip(_BUCKET_LOWS, histogram)) / total, 3)
    return out


def noise_scale(stats):
    """The job's gradient noise scale from its shards' final statistics (bsp, backup): the sums
    of their moving averages of |G|^2 and tr(Sigma) (server/noise_scale.h), and their ratio
    B_simple; None unless every shard measured the same step with one batch size."""
    parts = [s.get("noise_scale") for s in stats if isinstance(s, dict)]
    if not parts or any(not isinstance(p, dict) for p in parts) or len(parts) != len(stats):
        return None
    try:
        steps = {int(p.get("step", 0)) for p in parts}
        batch = {int(p.get("batch_small", 0)) for p in parts}
        g2 = sum(float(p.get("g2_ema", 0)) for p in parts)
        trace = sum(float(p.get("trace_ema", 0)) for p in parts)
        measured = min(int(p.get("steps", 0)) for p in parts)
        workers = min(int(p.get("workers", 0)) for p in parts)
    except (TypeError, ValueError):
        return None
    if len(steps) != 1 or len(batch) != 1 or min(batch) <= 0 or measured <= 0:
        return None
    return {"b_simple_ema": round(trace / g2, 4) if g2 > 0 else None, "g2_ema": g2,
            "trace_ema": trace, "step": steps.pop(), "steps_measured": measured,
            "b_small": min(batch), "b_big": min(batch) * workers}


def write_summary(summary, run_dir):
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")


def print_results(summary, wall, args, failure, run_dir):
    """The lines printed at the end of a job that some worker finished."""
    acc = summary["test_accuracy"]
    print("rubato: %s in %.1f s wall: %d worker(s), %d server(s), %d steps, test accuracy %s"
          % ("done" if failure is None else "ended", wall, args.workers, args.servers,
             summary.get("steps", 0), "%.4f" % acc if acc is not None else "n/a"))
    ttt = summary.get("time_to_target_s")
    staleness = " ".join("%s:%d" % kv for kv in summary["staleness_histogram"].items() if kv[1])
    print("rubato: time to %.2f test accuracy %s; %.1f worker steps/s; dropped gradients %d; "
          "staleness %s" % (args.target_accuracy,
                            "%.1f s" % ttt if ttt is not None else "not reached",
                            summary["worker_steps_per_s"], summary["dropped_gradients"],
                            staleness))
    noise = summary.get("noise_scale")
    if noise and noise["b_simple_ema"] is not None:
        print("rubato: gradient noise scale B_simple = tr(Sigma)/|G|^2 = %.0f examples "
              "(moving average over %d steps at the end; each step's gradients at batch %d "
              "and %d)" % (noise["b_simple_ema"], noise["steps_measured"], noise["b_small"],
                           noise["b_big"]))
    print("rubato: summary in %s" % os.path.join(run_dir, "summary.json"), flush=True)
