#!/usr/bin/env python3
"""Launches a Rubato job as local processes on 127.0.0.1 and shows its progress live.

    deploy/launch.py --bin_dir bazel-bin --servers 1 --workers 2 --epochs 3

Servers start first on free ports (each writes its bound address to a port file in the run
directory); workers are then given the addresses. Every process is ended on success, on failure
and on Ctrl-C, and children are killed by the kernel if this launcher itself dies (PR_SET_PDEATHSIG),
so nothing is left behind. Exit status: 0 when every worker finished, 1 when any process failed or
the job timed out, 2 for bad arguments, 130 on Ctrl-C.

The run directory (default runs/<time>) holds each process's log, each worker's JSON-lines progress
(worker-N.jsonl) and summary.json.
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1

# Flags that describe the cluster: given to servers and workers alike.
CLUSTER_FLAGS = ("mode", "staleness_aware_lr", "optimizer", "learning_rate", "weight_decay", "momentum", "nesterov",
                 "beta1", "beta2", "epsilon", "trust_coefficient", "exclude_from_weight_decay",
                 "exclude_from_layer_adaptation", "clip_global_norm", "lr_reference_batch",
                 "lr_scaling", "warmup_steps", "warmup_epochs", "lr_decay", "lr_decay_steps",
                 "lr_decay_factor", "lr_power", "final_lr_fraction", "lease_ms", "wait_timeout_ms")
# Flags given to servers only.
SERVER_FLAGS = ("update_threads",)
# Flags given to workers only.
WORKER_FLAGS = ("layers", "batch_size", "epochs", "steps", "eval_every", "log_every", "train_limit",
                "test_limit", "seed", "data_dir", "backend", "connect_timeout_ms",
                # Straggler injection, for every worker; --slow_workers slows chosen ones.
                "slowdown", "min_step_ms", "delay_probability", "delay_distribution",
                "delay_mean_ms", "delay_sigma", "delay_alpha", "straggler_seed", "pause_at_step",
                "pause_ms", "crash_at_step")


class LaunchError(Exception):
    pass


def _die_with_parent():
    """Runs in the child before exec: ask the kernel for SIGKILL when the launcher dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Own process group, so that a terminal's Ctrl-C reaches only the launcher, which then stops
    # the children in order.
    os.setpgid(0, 0)


class Proc:
    def __init__(self, name, argv, run_dir, capture_stdout=False):
        self.name = name
        self.log_path = os.path.join(run_dir, name + ".log")
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else self.log, stderr=self.log,
            preexec_fn=_die_with_parent)

    def poll(self):
        return self.popen.poll()

    def error_line(self):
        """The last line the process wrote to stderr: its one-line error when it failed."""
        try:
            with open(self.log_path, "rb") as f:
                lines = [l for l in f.read().decode("utf-8", "replace").splitlines() if l.strip()]
        except OSError:
            return ""
        for line in reversed(lines):
            if "error:" in line:
                return line.strip()
        return lines[-1].strip() if lines else "(no output)"


class WorkerView:
    """What the live view knows of one worker, fed by its JSON-lines progress."""

    def __init__(self, index, jsonl_path):
        self.index = index
        self.jsonl = open(jsonl_path, "w")
        self.lock = threading.Lock()
        self.start = {}
        self.step = {}
        self.eval = {}
        self.done = {}
        self.evals = []  # (seconds since launch, test accuracy) of every evaluation.

    def feed(self, stream, began):
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            self.jsonl.write(line + "\n")
            self.jsonl.flush()
            try:
                record = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                event = record.get("event")
                if event in ("start", "step", "eval", "done"):
                    setattr(self, event, record)
                if event in ("eval", "done") and "test_accuracy" in record:
                    self.evals.append((time.monotonic() - began, record["test_accuracy"]))


def free_ports(n):
    """n distinct loopback ports that were free a moment ago (the workers bind them next)."""
    socks, ports = [], []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in socks:
        sock.close()
    return ports


# rubato_worker's exit status after --crash_at_step: an injected failure, not a failed job.
INJECTED_CRASH = 3


def worker_state(rc):
    if rc is None:
        return "running"
    return {0: "done", INJECTED_CRASH: "crashed"}.get(rc, "FAILED")


def wait_for_port_file(proc, path, deadline):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LaunchError("%s exited with status %d before serving: %s"
                              % (proc.name, proc.poll(), proc.error_line()))
        try:
            with open(path) as f:
                address = f.read().strip()
            if address:
                return address
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise LaunchError("%s did not start serving within the start-up timeout" % proc.name)


def render(views, states, total_steps):
    rows = ["%-8s %-8s %13s %6s %8s %9s %9s %9s %9s %6s" % (
        "worker", "state", "step", "epoch", "loss", "test_acc", "steps/s", "comm_ms", "delay_ms",
        "stale")]
    for v, state in zip(views, states):
        with v.lock:
            step, ev, start = dict(v.step), dict(v.eval), dict(v.start)
        total = start.get("steps", total_steps or 0)
        acc = ev.get("test_accuracy")
        rows.append("%-8s %-8s %13s %6s %8s %9s %9s %9s %9s %6s" % (
            v.index, state,
            "%d/%d" % (step.get("step", 0), total),
            step.get("epoch", "-"),
            "%.4f" % step["loss"] if "loss" in step else "-",
            "%.4f" % acc if acc is not None else "-",
            "%.1f" % step["steps_per_s"] if "steps_per_s" in step else "-",
            "%.2f" % step["comm_ms"] if "comm_ms" in step else "-",
            "%.1f" % step["delay_ms"] if "delay_ms" in step else "-",
            "%.1f" % step["staleness"] if "staleness" in step else "-"))
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="rubato launch", description="Run a Rubato job as local processes on 127.0.0.1.")
    p.add_argument("--bin_dir", default="bazel-bin", help="Where server/ and worker/ binaries are.")
    p.add_argument("--servers", type=int, default=1, help="Parameter-server shards (default 1).")
    p.add_argument("--workers", type=int, default=2, help="Workers (default 2).")
    p.add_argument("--run_dir", default=None, help="Logs and metrics (default runs/<time>).")
    p.add_argument("--timeout", type=float, default=3600, help="Give up after this many seconds.")
    p.add_argument("--startup_timeout", type=float, default=30,
                   help="Seconds for a server to start serving.")
    p.add_argument("--refresh", type=float, default=0.5, help="Live view refresh, seconds.")
    p.add_argument("--slow_workers", default=None, metavar="ID:FACTOR,...",
                   help="Give these workers --slowdown=FACTOR (e.g. 1:4,3:2), instead of "
                        "--slowdown if that is given too.")
    p.add_argument("--crash_workers", default=None, metavar="ID:STEP,...",
                   help="Make these workers crash at that step (e.g. 2:50). A worker that exits "
                        "by an injected crash does not fail the job.")
    p.add_argument("--target_accuracy", type=float, default=0.8,
                   help="The summary reports when a worker's test accuracy first reached this.")
    for name in CLUSTER_FLAGS + WORKER_FLAGS + SERVER_FLAGS:
        p.add_argument("--" + name, default=None, help="Passed to rubato_%s as --%s." % (
            "server and rubato_worker" if name in CLUSTER_FLAGS else
            "worker" if name in WORKER_FLAGS else "server", name))
    args = p.parse_args(argv)
    if args.servers < 1 or args.workers < 1:
        p.error("--servers and --workers must be >= 1")
    if args.mode == "allreduce":
        args.servers = 0  # The workers form a ring; no parameter servers.
    if args.timeout <= 0 or args.startup_timeout <= 0 or args.refresh <= 0:
        p.error("--timeout, --startup_timeout and --refresh must be > 0")
    try:
        args.slow_workers = parse_slow_workers(args.slow_workers, args.workers)
    except ValueError as e:
        p.error("--slow_workers: %s" % e)
    try:
        args.crash_workers = parse_crash_workers(args.crash_workers, args.workers)
    except ValueError as e:
        p.error("--crash_workers: %s" % e)
    return args


def parse_crash_workers(text, workers):
    """"2:50" -> {2: 50}: worker id -> step of its injected crash."""
    crash = {}
    if text is None:
        return crash
    for item in text.split(","):
        worker, _, step = item.strip().partition(":")
        try:
            w, k = int(worker), int(step)
        except ValueError:
            raise ValueError("expected ID:STEP,... such as 2:50, got %r" % text)
        if not 0 <= w < workers or k < 0 or w in crash:
            raise ValueError("bad or repeated worker id or step in %r" % item)
        crash[w] = k
    return crash


def parse_slow_workers(text, workers):
    """"1:4,3:2" -> {1: "4", 3: "2"}: worker id -> --slowdown value, ids in [0, workers)."""
    slow = {}
    if text is None:
        return slow
    for item in text.split(","):
        worker, _, factor = item.strip().partition(":")
        try:
            w, f = int(worker), float(factor)
        except ValueError:
            raise ValueError("expected ID:FACTOR,... such as 1:4,3:2, got %r" % text)
        if not 0 <= w < workers:
            raise ValueError("worker id %s is not in [0, --workers=%d)" % (worker, workers))
        if not f >= 1 or f == float("inf"):
            raise ValueError("worker %d: factor must be >= 1, got %s" % (w, factor))
        if w in slow:
            raise ValueError("worker %d given twice" % w)
        slow[w] = factor.strip()
    return slow


def worker_flags(args, worker):
    """The worker-only flags for one worker: --slow_workers overrides --slowdown."""
    flags = forwarded(args, WORKER_FLAGS)
    if worker in args.slow_workers:
        flags = [f for f in flags if not f.startswith("--slowdown=")]
        flags.append("--slowdown=%s" % args.slow_workers[worker])
    if worker in args.crash_workers:
        flags = [f for f in flags if not f.startswith("--crash_at_step=")]
        flags.append("--crash_at_step=%d" % args.crash_workers[worker])
    return flags


def forwarded(args, names):
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out.append("--%s=%s" % (name, value))
    return out


def main(argv):
    args = parse_args(argv)
    server_bin = os.path.join(args.bin_dir, "server", "rubato_server")
    worker_bin = os.path.join(args.bin_dir, "worker", "rubato_worker")
    for b in (server_bin, worker_bin):
        if not os.access(b, os.X_OK):
            print("rubato launch: error: binary not found: %s (build first)" % b, file=sys.stderr)
            return 2
    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    cluster = forwarded(args, CLUSTER_FLAGS) + ["--num_workers=%d" % args.workers]

    procs, servers, workers, views, readers = [], [], [], [], []
    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))
    tty = sys.stdout.isatty()
    status = 1
    began = time.monotonic()
    failure = None
    try:
        # Servers first, each on a free port reported through its port file. The allreduce mode
        # has no servers: the workers listen on free ports chosen here and form a ring.
        allreduce = args.mode == "allreduce"
        addresses = []
        for s in range(0 if allreduce else args.servers):
            port_file = os.path.join(run_dir, "server-%d.port" % s)
            if os.path.exists(port_file):
                os.remove(port_file)
            proc = Proc("server-%d" % s, [server_bin, "--shard_id=%d" % s,
                                          "--num_shards=%d" % args.servers,
                                          "--listen=127.0.0.1:0", "--port_file=" + port_file,
                                          "--stats_file=" + os.path.join(
                                              run_dir, "server-%d.stats.json" % s)]
                        + cluster + forwarded(args, SERVER_FLAGS), run_dir)
            procs.append(proc)
            servers.append(proc)
        for s, proc in enumerate(servers):
            addresses.append(wait_for_port_file(
                proc, os.path.join(run_dir, "server-%d.port" % s),
                time.monotonic() + args.startup_timeout))
        if allreduce:
            where = "--peers=" + ",".join("127.0.0.1:%d" % p for p in free_ports(args.workers))
            print("rubato: allreduce ring of %d worker(s) (%s); run directory %s"
                  % (args.workers, where[len("--peers="):], run_dir), flush=True)
        else:
            where = "--servers=" + ",".join(addresses)
            print("rubato: %d server(s) at %s; starting %d worker(s); run directory %s"
                  % (args.servers, ",".join(addresses), args.workers, run_dir), flush=True)
        for w in range(args.workers):
            proc = Proc("worker-%d" % w, [worker_bin, "--worker_id=%d" % w, where]
                        + cluster + worker_flags(args, w), run_dir, capture_stdout=True)
            procs.append(proc)
            workers.append(proc)
            view = WorkerView(w, os.path.join(run_dir, "worker-%d.jsonl" % w))
            views.append(view)
            t = threading.Thread(target=view.feed, args=(proc.popen.stdout, began), daemon=True)
            t.start()
            readers.append(t)

        drawn = 0
        last_plain = 0.0
        while True:
            states = []
            for proc in workers:
                rc = proc.poll()
                states.append(worker_state(rc))
            now = time.monotonic()
            if tty:
                rows = render(views, states, None)
                sys.stdout.write(("\x1b[%dF" % drawn if drawn else "") +
                                 "".join("\x1b[2K" + r + "\n" for r in rows))
                sys.stdout.flush()
                drawn = len(rows)
            elif now - last_plain >= 5:
                last_plain = now
                print("\n".join(render(views, states, None)), flush=True)
            if interrupted:
                failure = "interrupted"
                status = 130
                break
            failed = [p for p in workers if p.poll() not in (None, 0, INJECTED_CRASH)]
            failed += [p for p in servers if p.poll() not in (None, 0)]
            failed += [p for p in servers if p.poll() == 0]  # A server must not stop by itself.
            if failed:
                p = failed[0]
                failure = "%s exited with status %d: %s" % (p.name, p.poll(), p.error_line())
                break
            if all(p.poll() in (0, INJECTED_CRASH) for p in workers) and \
                    any(p.poll() == 0 for p in workers):
                status = 0
                break
            if now - began > args.timeout:
                failure = "job did not finish within --timeout=%gs" % args.timeout
                break
            time.sleep(args.refresh)
    except LaunchError as e:
        failure = str(e)
    finally:
        stop(procs)
        for t in readers:
            t.join(timeout=5)
    wall = time.monotonic() - began

    if not tty and views:
        states = [worker_state(p.poll()) for p in workers]
        print("\n".join(render(views, states, None)))
    summary = summarize(views, wall, args, failure, run_dir)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    if failure:
        print("rubato launch: error: %s (logs in %s)" % (failure, run_dir), file=sys.stderr)
        return status if status == 130 else 1
    acc = summary.get("test_accuracy")
    print("rubato: done in %.1f s wall: %d worker(s), %d server(s), %d steps, test accuracy %s"
          % (wall, args.workers, args.servers, summary.get("steps", 0),
             "%.4f" % acc if acc is not None else "n/a"))
    ttt = summary.get("time_to_target_s")
    print("rubato: time to %.2f test accuracy %s; %.1f worker steps/s; dropped gradients %d; "
          "staleness %s" % (args.target_accuracy, "%.1f s" % ttt if ttt is not None else "not reached",
                            summary["worker_steps_per_s"], summary["dropped_gradients"],
                            " ".join("%s:%d" % kv for kv in summary["staleness_histogram"].items()
                                     if kv[1])))
    print("rubato: summary in %s" % os.path.join(run_dir, "summary.json"))
    return 0


STALENESS_BUCKETS = ["0", "1", "2", "3", "4-7", "8-15", "16-31", ">=32"]


def summarize(views, wall, args, failure, run_dir):
    summary = {"ok": failure is None, "error": failure, "wall_s": round(wall, 3),
               "servers": args.servers, "workers": args.workers, "mode": args.mode or "bsp",
               "target_accuracy": args.target_accuracy}
    done = [(v.evals[-1][0], v.done) for v in views if v.done and v.evals]
    if done:
        # The worker that finished last evaluated the final weights (under bsp all agree).
        summary["test_accuracy"] = max(done, key=lambda d: d[0])[1]["test_accuracy"]
        summary["steps"] = max(d["steps"] for _, d in done)
        summary["per_worker"] = [d for _, d in done]
    reached = [t for v in views for t, acc in v.evals if acc >= args.target_accuracy]
    summary["time_to_target_s"] = round(min(reached), 3) if reached else None
    worker_steps = sum(v.step.get("step", 0) for v in views)
    batch = sum(v.start.get("batch_size", 0) for v in views) / max(1, len(views))
    summary["worker_steps_per_s"] = round(worker_steps / max(wall, 1e-9), 2)
    summary["examples_per_s"] = round(worker_steps * batch / max(wall, 1e-9), 1)
    # What the servers saw (written by each server at shutdown).
    histogram = [0] * len(STALENESS_BUCKETS)
    servers = {"applied_updates": 0, "dropped_gradients": 0, "dropped_workers": 0,
               "rejected_pushes": 0}
    for shard in range(args.servers):
        try:
            with open(os.path.join(run_dir, "server-%d.stats.json" % shard)) as f:
                stats = json.load(f)
        except (OSError, ValueError):
            continue
        for key in servers:
            servers[key] += int(stats.get(_camel(key), 0))
        for i, n in enumerate(stats.get("stalenessHistogram", [])[:len(histogram)]):
            histogram[i] += int(n)
    summary.update(servers)
    summary["staleness_histogram"] = dict(zip(STALENESS_BUCKETS, histogram))
    total = sum(histogram)
    if total:
        lows = [0, 1, 2, 3, 4, 8, 16, 32]
        summary["mean_staleness_lower_bound"] = round(
            sum(l * n for l, n in zip(lows, histogram)) / total, 3)
    return summary


def _camel(name):
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def stop(procs, grace=5.0):
    """SIGTERM to everything still running, then SIGKILL after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            p.popen.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
