"""./rubato simulate: one job in the simulator (sim/README.md) instead of as processes, with the
launcher's own flags, writing what a launch writes: the workers' progress records
(worker-N.jsonl), the shards' statistics and summary.json, with simulated seconds wherever a
launch has seconds of wall time. `./rubato experiment SUITE --simulate` runs a suite this way, so
that real and simulated runs of one suite share results.csv, summary.csv and the report.

    ./rubato simulate --workers 4 --servers 1 --mode bsp --epochs 3 --min_step_ms 20 \\
        --slow_workers 3:4 --run_dir runs/sim-bsp [--sim_flag=--compute_ms=2.5]

The simulator's own flags (the network, the calibration: `rubato_sim --helpfull`) are passed with
--sim_flag, once each. The launcher's flags that only concern processes (transports, backends,
timeouts, security, hosts) mean nothing here and are ignored, with a note; a flag that would
change the job in a way the simulator does not model (a crash, reassignment, which it runs at
the timing level only) makes rubato_sim fail with an error that names it. The all-reduce modes
run on sim/ring_job.h's ring.

summary.json adds, under "simulated": the calibration (compute_ms and eval_ms: one step's
forward and backward pass and one evaluation as measured on this machine unless given), the
workers' mean waiting fraction, the events run and the real seconds the simulation took."""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "deploy"))
from launcher import commands, flags, live, summary  # noqa: E402

SIM_PROGRAM = os.path.join("sim", "rubato_sim")
# The worker flags rubato_sim takes (the rest of commands.WORKER_FLAGS only concern processes:
# transports, backends, devices, timeouts).
SIM_WORKER_FLAGS = ("model", "layers", "batch_size", "epochs", "steps", "eval_every", "log_every",
                    "train_limit", "test_limit", "seed", "data_dir", "slowdown", "min_step_ms",
                    "delay_probability", "delay_distribution", "delay_mean_ms", "delay_sigma",
                    "delay_alpha", "straggler_seed", "pause_at_step", "pause_ms", "crash_at_step",
                    "slow_from_step", "slow_period_steps", "slow_for_steps", "rotate_slow",
                    "delay_trace")
# Flags that change what a real job does in ways the simulator does not model: refused by name.
REFUSED = ("export_model", "reassign_replay", "restore_step", "checkpoint_dir")


def sim_command(args, sim_bin, sim_flags):
    """rubato_sim's argv for the launcher's parsed `args`."""
    argv = [sim_bin, "--run_dir=" + args.run_dir, "--shards=%d" % args.servers]
    argv += commands.cluster_flags(args, [])
    if (args.mode or "").partition(":")[0] == "allreduce":
        # A ring's ranks have addresses in a real job's cluster; the simulated ranks need none,
        # but the cluster's validation does.
        argv.append(commands.peers_flag(["sim-rank-%d:1" % w for w in range(args.workers)]))
    argv += commands.forwarded(args, SIM_WORKER_FLAGS)
    if args.slow_workers:
        argv.append("--slow_workers=" + ",".join(
            "%d:%s" % (w, f) for w, f in sorted(args.slow_workers.items())))
    return argv + list(sim_flags)


def ignored_flags(args):
    """The launcher flags given that the simulator ignores."""
    names = [n for n in commands.WORKER_FLAGS + commands.SERVER_FLAGS
             if n not in SIM_WORKER_FLAGS and n not in REFUSED and getattr(args, n) is not None]
    return names


def read_views(run_dir, workers, eval_s):
    """WorkerViews fed with each worker's records as if each had arrived at its simulated time
    (an evaluation's record once the evaluation is over, as from a real worker)."""
    views = []
    for w in range(workers):
        view = live.WorkerView(w, None)
        view.started_at = 0.0
        try:
            with open(os.path.join(run_dir, "worker-%d.jsonl" % w), "rb") as f:
                for raw in f:
                    record = live.parse_record(raw.decode("utf-8", "replace"))
                    if record is None:
                        continue
                    t = float(record.get("t", 0.0) or 0.0)
                    if record.get("event") == "eval":
                        t += eval_s
                    view.take([raw.rstrip(b"\n")], 0.0, now=t)
        except OSError:
            pass
        views.append(view)
    return views


def last_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def simulate(args, sim_bin, sim_flags, log=sys.stdout):
    """Runs the job in the simulator; writes summary.json; returns the exit status."""
    os.makedirs(args.run_dir, exist_ok=True)
    refused = [n for n in REFUSED if getattr(args, n) is not None]
    refused += ["crash_workers"] if args.crash_workers else []
    argv = sim_command(args, sim_bin, sim_flags)
    began = time.monotonic()
    if refused:
        what = refused[0] if ":" in refused[0] else refused[0] + ": the simulator does not model it"
        rc, out, err = 2, "", "rubato_sim: error: --%s" % what
    else:
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=args.timeout)
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired:
            rc, out, err = 1, "", "rubato_sim: error: timed out after --timeout=%g s" % args.timeout
    with open(os.path.join(args.run_dir, "sim.log"), "w") as f:
        f.write("argv: %s\n%s%s" % (json.dumps(argv), err, out))
    result = {}
    try:
        result = json.loads(last_line(out))
    except ValueError:
        pass
    failure = None if rc == 0 and result.get("event") == "simulated" else (
        last_line(err) or "rubato_sim exited with status %d" % rc)
    wall = float(result.get("wall_s", 0.0))
    views = read_views(args.run_dir, args.workers, float(result.get("eval_ms", 0.0)) / 1e3)
    out_summary = {"ok": failure is None, "error": failure, "wall_s": round(wall, 3),
                   "servers": args.servers, "workers": args.workers, "mode": args.mode or "bsp",
                   "target_accuracy": args.target_accuracy,
                   "simulated": dict(result, argv=argv, ignored_flags=ignored_flags(args),
                                     real_s=round(time.monotonic() - began, 3))}
    if failure is None:
        out_summary.update(summary.worker_results(views, wall, args.target_accuracy))
        stats = []
        for s in range(args.servers):
            try:
                with open(commands.stats_file(args.run_dir, s)) as f:
                    stats.append(json.load(f))
            except (OSError, ValueError):
                stats.append(None)
        out_summary.update(summary.server_totals(stats))
    summary.write_summary(out_summary, args.run_dir)
    if failure is not None:
        print("rubato simulate: failed: %s" % failure, file=log)
        return 1 if rc != 2 else 2
    acc = out_summary.get("test_accuracy")
    ttt = out_summary.get("time_to_target_s")
    print("rubato simulate: %d worker(s), %d shard(s), %s: %.1f s simulated (%.1f s real), test "
          "accuracy %s, time to %.2f %s; summary in %s" % (
              args.workers, args.servers, out_summary["mode"], wall,
              out_summary["simulated"]["real_s"], "%.4f" % acc if acc is not None else "n/a",
              args.target_accuracy, "%.1f s" % ttt if ttt is not None else "not reached",
              os.path.join(args.run_dir, "summary.json")), file=log)
    return 0


def main(argv):
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--sim_flag", action="append", default=[],
                   help="A flag for rubato_sim itself (e.g. --sim_flag=--compute_ms=2.5).")
    own, rest = p.parse_known_args(argv)
    args = flags.parse_args(rest)
    if args.plan is not None:
        print("rubato simulate: error: the simulator runs no hosts: give no --hostfile or -H",
              file=sys.stderr)
        return 2
    if args.run_dir is None:
        args.run_dir = os.path.join("runs", "sim-" + time.strftime("%Y%m%d-%H%M%S"))
    for name in ignored_flags(args):
        print("rubato simulate: --%s: not modelled by the simulator; ignored" % name)
    sim_bin = os.path.join(args.bin_dir, SIM_PROGRAM)
    if not os.access(sim_bin, os.X_OK):
        print("rubato simulate: error: no simulator at %s (bazel build //sim:rubato_sim)" % sim_bin,
              file=sys.stderr)
        return 2
    return simulate(args, sim_bin, own.sim_flag)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
