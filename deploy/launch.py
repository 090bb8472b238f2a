#!/usr/bin/env python3
"""Launches a Rubato job as local processes on 127.0.0.1 and shows its progress live.

    deploy/launch.py --bin_dir bazel-bin --servers 1 --workers 2 --epochs 3

Servers start first on free ports (each writes its bound address to a port file in the run
directory); workers are then given the addresses. Every process gets the job's shared secret
(--auth_secret_file: a fresh <run_dir>/job.secret, mode 0600, unless one is given or --insecure) and
a gRPC message limit derived from the model's size (--max_message_mb).

A worker that dies does not end the job. In the parameter-server modes the servers drop it once its
lease (--lease_ms) runs out and the others finish; in the allreduce mode the ring breaks and the
other ranks end by themselves, each with an error naming the dead peer. A server that dies ends the
job at once, since no worker can finish without every shard. Only a process that ended by itself
with a non-zero status (or a server that ended at all) counts as failed, and its reason is its own
last error line. Processes still running at the end, on a failure that ends the job and on Ctrl-C
are stopped by the launcher, and children are killed by the kernel if this launcher itself dies
(PR_SET_PDEATHSIG), so nothing is left behind.

Exit status: 0 when every worker finished (a worker's injected crash, --crash_workers or
--crash_at_step, does not count); 1 when any worker failed (once the others have finished), when a
server failed, when no worker finished, or when the job timed out; 2 for bad arguments; 130 on
Ctrl-C.

The run directory (default runs/<time>) holds each process's log, each worker's JSON-lines progress
(worker-N.jsonl), job.secret and summary.json, which records every worker's outcome.
"""

import argparse
import ctypes
import json
import os
import secrets
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
                 "lr_decay_factor", "lr_power", "final_lr_fraction", "lease_ms", "wait_timeout_ms",
                 "max_message_mb")
# Flags given to servers only.
SERVER_FLAGS = ("update_threads", "memory_budget_mb")
# Flags given to workers only.
WORKER_FLAGS = ("layers", "batch_size", "epochs", "steps", "eval_every", "log_every", "train_limit",
                "test_limit", "seed", "data_dir", "backend", "connect_timeout_ms", "retry_timeout_ms",
                # Straggler injection, for every worker; --slow_workers slows chosen ones.
                "slowdown", "min_step_ms", "delay_probability", "delay_distribution",
                "delay_mean_ms", "delay_sigma", "delay_alpha", "straggler_seed", "pause_at_step",
                "pause_ms", "crash_at_step")

# The binaries' defaults that the launcher itself needs to know.
DEFAULT_LAYERS = "784-256-10"
DEFAULT_LEASE_MS = "10000"

SERVER_PROGRAM = "rubato_server"
WORKER_PROGRAM = "rubato_worker"

# rubato_worker's exit status after --crash_at_step: an injected failure, not a failed job.
INJECTED_CRASH = 3


class LaunchError(Exception):
    pass


def _die_with_parent():
    """Runs in the child before exec: ask the kernel for SIGKILL when the launcher dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Own process group, so that a terminal's Ctrl-C reaches only the launcher, which then stops
    # the children in order.
    os.setpgid(0, 0)


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "an unknown signal"


def exit_description(rc):
    """How a process ended, from Popen's returncode: "exited with status 1", "killed by SIGKILL
    (signal 9)"."""
    if rc >= 0:
        return "exited with status %d" % rc
    return "killed by %s (signal %d)" % (signal_name(-rc), -rc)


class Proc:
    """One child process, its log, and how it ended."""

    def __init__(self, name, program, argv, run_dir, capture_stdout=False, crash_at_step=None):
        self.name = name
        # "rubato_server" or "rubato_worker": the prefix of the process's own one-line error.
        self.program = program
        # A worker's --crash_at_step, if any: then its exit with status 3 is expected, no failure.
        self.crash_at_step = crash_at_step
        # Set when the launcher ends the process: however it then exits, it has not failed.
        self.stopped = False
        self.ended_at = None  # time.monotonic() when the launcher first saw it exited.
        self._outcome = None  # outcome(), once the process has exited: it no longer changes.
        self.log_path = os.path.join(run_dir, name + ".log")
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else self.log, stderr=self.log,
            preexec_fn=_die_with_parent)

    def poll(self, now=None):
        rc = self.popen.poll()
        if rc is not None and self.ended_at is None:
            self.ended_at = now or time.monotonic()
        return rc

    def end_order(self):
        """Sort key, first ended first. Processes seen ended in the same round of polls tie, and
        servers come first: a dead server takes the workers with it, never the other way round."""
        return self.ended_at or 0.0, self.program != SERVER_PROGRAM

    def error_line(self):
        """The process's own last one-line error ("rubato_worker: error: ...", or the flag parser's
        "ERROR: ..."), or "" when it left none. Other lines may quote another process's error, a
        status relayed from a server for instance, so only these prefixes count."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))  # The error is the last line.
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            if line.startswith(self.program + ": error:") or line.startswith("ERROR: "):
                return line.strip()
        return ""

    def outcome(self):
        """(state, reason) of the process: ("running", None); ("stopped", None) when the launcher
        ended it; ("done", None) for a worker that finished; ("crashed", why) for a worker's
        injected crash; else ("FAILED", why), why being how it ended and its own error line."""
        rc = self.poll()
        if rc is None:
            return "running", None
        if self._outcome is None:
            self._outcome = self._ended(rc)
        return self._outcome

    def _ended(self, rc):
        if self.stopped:
            return "stopped", None
        if self.program == WORKER_PROGRAM and rc == 0:
            return "done", None
        if self.program == WORKER_PROGRAM and rc == INJECTED_CRASH and self.crash_at_step:
            return "crashed", "injected crash at step %s" % self.crash_at_step
        how = exit_description(rc)
        if self.program == SERVER_PROGRAM and rc == 0:
            how += " before the job ended"  # A server runs until the launcher stops it.
        error = self.error_line()
        return "FAILED", "%s: %s" % (how, error) if error else how

    def record(self):
        """The process's outcome for summary.json."""
        state, reason = self.outcome()
        out = {"name": self.name, "state": state.lower()}
        rc = self.popen.returncode
        if rc is not None:
            out["exit_status"] = rc
            if rc < 0:
                out["signal"] = signal_name(-rc)
        if reason:
            out["reason"] = reason
        return out


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


def model_bytes(layers):
    """Bytes of the float32 MLP that --layers describes ("784-256-10"): for each consecutive pair
    of sizes (in, out), an [in, out] weight and an [out] bias."""
    try:
        sizes = [int(s) for s in layers.split("-")]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError("expected two or more positive sizes such as 784-256-10, got %r" % layers)
    return 4 * sum(n_in * n_out + n_out for n_in, n_out in zip(sizes, sizes[1:]))


def max_message_mb(layers):
    """The largest gRPC message, in MiB, that a job training this model must accept: the model's
    bytes (a whole-model pull or push, or the ring's largest chunk, is at most that) plus a quarter
    for message framing, rounded up, plus one; at least gRPC's default of 4."""
    mib = 1 << 20
    return max(4, -(-model_bytes(layers) * 5 // (4 * mib)) + 1)  # ceil(bytes * 1.25 / MiB) + 1


def write_job_secret(run_dir):
    """Writes a fresh secret (32 random bytes, hex) to <run_dir>/job.secret, readable by this user
    only, and returns its absolute path. Every process of the job reads it to authenticate the
    others, so that no other local process can join or drive the job."""
    path = os.path.abspath(os.path.join(run_dir, "job.secret"))
    try:
        os.remove(path)  # An earlier job's, in a reused run directory: a secret is never reused.
    except FileNotFoundError:
        pass
    # O_EXCL: the file is this call's own, never one (or a link) that someone else put there.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def auth_flags(args, run_dir):
    """The flags that give every server and worker the job's secret, or --insecure."""
    if args.insecure:
        return ["--insecure"]
    path = os.path.abspath(args.auth_secret_file) if args.auth_secret_file else \
        write_job_secret(run_dir)
    return ["--auth_secret_file=" + path]


def wait_for_port_file(proc, path, deadline):
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            error = proc.error_line()
            raise LaunchError("%s %s before serving%s" % (
                proc.name, exit_description(proc.poll()), ": " + error if error else ""))
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


class Screen:
    """Stdout: on a terminal the worker table is redrawn in place, elsewhere printed every 5 s;
    notes go above the table."""

    def __init__(self, tty):
        self.tty = tty
        self.drawn = 0  # Lines of the table now on the terminal.
        self.last_plain = 0.0

    def table(self, rows, force=False):
        now = time.monotonic()
        if self.tty:
            sys.stdout.write(("\x1b[%dF" % self.drawn if self.drawn else "") +
                             "".join("\x1b[2K" + r + "\n" for r in rows))
            sys.stdout.flush()
            self.drawn = len(rows)
        elif force or now - self.last_plain >= 5:
            self.last_plain = now
            print("\n".join(rows), flush=True)

    def note(self, text):
        if self.tty and self.drawn:
            sys.stdout.write("\x1b[%dF\x1b[J" % self.drawn)  # Clear the table; it is redrawn below.
            self.drawn = 0
        print(text, flush=True)


# Launcher flags that are also cluster flags but have a default of the launcher's own.
OWN_HELP = {
    "max_message_mb": "Largest gRPC message, in MiB, that every server and worker accepts "
                      "(passed as --max_message_mb). Default: from the model that --layers "
                      "describes, max(4, ceil(1.25 * model bytes / MiB) + 1), model bytes being "
                      "4 * sum(in * out + out) over consecutive layer sizes.",
}


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="rubato launch", description="Run a Rubato job as local processes on 127.0.0.1.",
        epilog="A worker that dies does not end the job: in the parameter-server modes the "
               "servers drop it after its lease (--lease_ms) and the others finish; in the "
               "allreduce mode the other ranks end by themselves, naming the dead peer. The exit "
               "status is 0 when every worker finished (injected crashes aside), else 1.")
    p.add_argument("--bin_dir", default="bazel-bin", help="Where server/ and worker/ binaries are.")
    p.add_argument("--servers", type=int, default=1, help="Parameter-server shards (default 1).")
    p.add_argument("--workers", type=int, default=2, help="Workers (default 2).")
    p.add_argument("--run_dir", default=None, help="Logs and metrics (default runs/<time>).")
    p.add_argument("--timeout", type=float, default=3600,
                   help="Stop every process and fail after this many seconds.")
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
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--auth_secret_file", default=None, metavar="PATH",
                      help="Give every server and worker this existing secret file (passed as "
                           "--auth_secret_file). Default: a fresh secret for each job, 32 random "
                           "bytes in hex, written to <run_dir>/job.secret with mode 0600.")
    auth.add_argument("--insecure", action="store_true",
                      help="Pass --insecure to every server and worker and make no secret: any "
                           "local process could then call the servers and workers.")
    for name in CLUSTER_FLAGS + WORKER_FLAGS + SERVER_FLAGS:
        p.add_argument("--" + name, default=None, help=OWN_HELP.get(name) or
                       "Passed to rubato_%s as --%s." % (
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
    if args.auth_secret_file is not None and not os.path.isfile(args.auth_secret_file):
        p.error("--auth_secret_file: no such file: %s" % args.auth_secret_file)
    if args.max_message_mb is None:
        try:
            args.max_message_mb = str(max_message_mb(args.layers or DEFAULT_LAYERS))
        except ValueError as e:
            p.error("--layers: %s" % e)
    elif not args.max_message_mb.isdigit() or int(args.max_message_mb) < 1:
        p.error("--max_message_mb: expected a whole number of MiB >= 1, got %r"
                % args.max_message_mb)
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
    server_bin = os.path.join(args.bin_dir, "server", SERVER_PROGRAM)
    worker_bin = os.path.join(args.bin_dir, "worker", WORKER_PROGRAM)
    for b in (server_bin, worker_bin):
        if not os.access(b, os.X_OK):
            print("rubato launch: error: binary not found: %s (build first)" % b, file=sys.stderr)
            return 2
    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    cluster = (forwarded(args, CLUSTER_FLAGS) + ["--num_workers=%d" % args.workers] +
               auth_flags(args, run_dir))

    procs, servers, workers, views, readers = [], [], [], [], []
    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))
    screen = Screen(sys.stdout.isatty())
    allreduce = args.mode == "allreduce"
    began = time.monotonic()
    failure = None  # Why the job ended early: a timeout, a server's failure, Ctrl-C.
    try:
        # Servers first, each on a free port reported through its port file. The allreduce mode
        # has no servers: the workers listen on free ports chosen here and form a ring.
        addresses = []
        for s in range(0 if allreduce else args.servers):
            port_file = os.path.join(run_dir, "server-%d.port" % s)
            if os.path.exists(port_file):
                os.remove(port_file)
            proc = Proc("server-%d" % s, SERVER_PROGRAM,
                        [server_bin, "--shard_id=%d" % s, "--num_shards=%d" % args.servers,
                         "--listen=127.0.0.1:0", "--port_file=" + port_file,
                         "--stats_file=" + os.path.join(run_dir, "server-%d.stats.json" % s)]
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
            flags = worker_flags(args, w)
            crash = [f.partition("=")[2] for f in flags if f.startswith("--crash_at_step=")]
            proc = Proc("worker-%d" % w, WORKER_PROGRAM, [worker_bin, "--worker_id=%d" % w, where]
                        + cluster + flags, run_dir, capture_stdout=True,
                        crash_at_step=crash[0] if crash else None)
            procs.append(proc)
            workers.append(proc)
            view = WorkerView(w, os.path.join(run_dir, "worker-%d.jsonl" % w))
            views.append(view)
            t = threading.Thread(target=view.feed, args=(proc.popen.stdout, began), daemon=True)
            t.start()
            readers.append(t)

        # Runs until every worker has ended by itself. A dead worker is only noted: the servers
        # drop it after its lease and the others carry on (allreduce: the others end by themselves).
        noted = set()
        while True:
            now = time.monotonic()
            for p in procs:
                p.poll(now)  # One timestamp for every process seen ended in this round.
            outcomes = [p.outcome() for p in workers]
            for p, (state, reason) in zip(workers, outcomes):
                if state in ("FAILED", "crashed") and p.name not in noted:
                    if not allreduce:
                        reason += ("; the servers drop it after its lease (%s ms) and the others "
                                   "carry on" % (args.lease_ms or DEFAULT_LEASE_MS))
                    elif not noted:
                        reason += "; the ring is broken: the other ranks will end with an error"
                    noted.add(p.name)
                    screen.note("rubato: %s %s: %s" % (p.name, state, reason))
            screen.table(render(views, [s for s, _ in outcomes], None))
            if interrupted:
                failure = "interrupted"
                break
            # A server runs until the launcher stops it; without every shard no worker can finish.
            ended = sorted((p for p in servers if p.poll() is not None), key=Proc.end_order)
            if ended:
                failure = "%s %s" % (ended[0].name, ended[0].outcome()[1])
                break
            if all(p.poll() is not None for p in workers):
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

    if views:
        screen.table(render(views, [p.outcome()[0] for p in workers], None), force=True)
    # Every process that failed by itself, in the order it ended: the first is usually the cause.
    failed = sorted((p for p in procs if p.outcome()[0] == "FAILED"), key=Proc.end_order)
    for p in failed:
        print("rubato: %s FAILED: %s" % (p.name, p.outcome()[1]), flush=True)
    failed_workers = [p for p in failed if p.program == WORKER_PROGRAM]
    if failure is None and failed:
        failed_servers = len(failed) - len(failed_workers)  # Ended after the last worker did.
        failure = "%d of %d worker(s)%s failed%s %s %s" % (
            len(failed_workers), args.workers,
            " and %d server(s)" % failed_servers if failed_servers else "",
            ":" if len(failed) == 1 else ", first", failed[0].name, failed[0].outcome()[1])
        if len(failed) > 1:  # Each one's reason is printed above and in summary.json.
            failure += "; then %s" % ", ".join(p.name for p in failed[1:])
    if failure is None and not any(p.outcome()[0] == "done" for p in workers):
        failure = "no worker finished"
    summary = summarize(views, wall, args, failure, run_dir, workers, servers)
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    if "test_accuracy" in summary:  # Some worker finished: its results stand, failures or not.
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
        print("rubato: summary in %s" % os.path.join(run_dir, "summary.json"), flush=True)
    if failure:
        print("rubato launch: error: %s (logs in %s)" % (failure, run_dir), file=sys.stderr)
        return 130 if interrupted else 1
    return 0


STALENESS_BUCKETS = ["0", "1", "2", "3", "4-7", "8-15", "16-31", ">=32"]


def summarize(views, wall, args, failure, run_dir, workers, servers):
    summary = {"ok": failure is None, "error": failure, "wall_s": round(wall, 3),
               "servers": args.servers, "workers": args.workers, "mode": args.mode or "bsp",
               "target_accuracy": args.target_accuracy, "max_message_mb": int(args.max_message_mb)}
    # How each process ended: done, failed (with its reason), crashed (injected) or stopped.
    summary["worker_outcomes"] = [p.record() for p in workers]
    summary["server_outcomes"] = [p.record() for p in servers]
    summary["failed_workers"] = sum(p.outcome()[0] == "FAILED" for p in workers)
    summary["injected_crashes"] = sum(p.outcome()[0] == "crashed" for p in workers)
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
    totals = {"applied_updates": 0, "dropped_gradients": 0, "dropped_workers": 0,
              "rejected_pushes": 0}
    for shard in range(args.servers):
        try:
            with open(os.path.join(run_dir, "server-%d.stats.json" % shard)) as f:
                stats = json.load(f)
        except (OSError, ValueError):
            continue
        for key in totals:
            totals[key] += int(stats.get(_camel(key), 0))
        for i, n in enumerate(stats.get("stalenessHistogram", [])[:len(histogram)]):
            histogram[i] += int(n)
    summary.update(totals)
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
    """SIGTERM to everything still running, then SIGKILL after `grace` seconds. A process stopped
    here has not failed, however it exits."""
    for p in procs:
        if p.poll() is None:
            p.stopped = True
            p.popen.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        p.poll()  # Records when it ended.


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
