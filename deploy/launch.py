#!/usr/bin/env python3
"""Launches a Rubato job, as local processes on 127.0.0.1 or across hosts, and shows its progress.

    deploy/launch.py --bin_dir bazel-bin --servers 1 --workers 2 --epochs 3
    deploy/launch.py --hostfile hosts --servers 2 --workers 8 --epochs 3        (several hosts)

Local mode (no --hostfile). Servers start first on free ports (each writes its bound address to a
port file in the run directory); workers are then given the addresses. Every process gets the job's
shared secret (--auth_secret_file: a fresh <run_dir>/job.secret, mode 0600, unless one is given or
--insecure) and a gRPC message limit derived from the model's size (--max_message_mb). Children are
killed by the kernel if this launcher itself dies (PR_SET_PDEATHSIG).

Several hosts (--hostfile FILE, one host per line, `host [slots=N]`, `#` comments), in the manner of
mpirun and horovodrun. Servers are spread round-robin over --server_hosts (default: every host);
workers are placed on --worker_hosts (default: every host) by --map_by slot (fill each host's slots
in host-file order, the default) or host (one per host in turn); a host takes at most `slots`
workers (default 1) unless --oversubscribe. Servers do not take slots. Every process listens on a
fixed port, 0.0.0.0:(--base_port + shard) for server shards (whose Push and Pull data plane
listens on --base_port + servers + shard) and 0.0.0.0:(--base_port + rank) for allreduce ranks
(whose TCP data connection listens on --base_port + workers + rank), and is
advertised as HOST:PORT with HOST spelled as in the host file, so the whole
--servers or --peers list is known before anything starts (every host must resolve every other
host's name). Processes start through --rsh (default `ssh -o BatchMode=yes`), as
`RSH HOST sh -c SCRIPT`: when the remote shell joins its arguments into one command line for a
login shell, as ssh does, SCRIPT is quoted once more; when it passes them on as argv, as
`ip netns exec` does, it is not. Which one the rsh does is found out before anything starts (the
first answer of `RSH HOST echo "'probe'"`). SCRIPT runs the binary in the background, with its
stdout and stderr on the rsh's, and stops it (SIGTERM, SIGKILL 5 s later) once its stdin, a pipe
that this launcher holds open, reaches end of file: the launcher closing it, or dying, tears the
remote process down even though killing an ssh client would not. The job's secret travels on that
same stdin as its first line, never on a command line; SCRIPT writes it to a fresh mode-0600 file in
a `mktemp -d` directory that it removes at exit. The rsh exits with the binary's status (128 + N
when signal N killed it). Before anything starts, a preflight over --rsh checks on every host that
it answers, that the binaries under --remote_bin_dir (default: --bin_dir, made absolute) are
executable, that the data set's four files are in --data_dir on worker hosts, and that the other
hosts' names resolve; it reports every host that lacks something, and what, then exits 2. Each
process's stderr is written to <run_dir>/NAME.log and, each line prefixed with `[NAME@HOST] `, to
<run_dir>/job.log and above the live table. A server's final statistics come from the JSON line
(`{"event":"stats",...}`) that it prints on stdout when it ends, so no shared file system is needed.

A worker that dies does not end the job. In the parameter-server modes the servers drop it once its
lease (--lease_ms) runs out and the others finish; in the allreduce mode the ring breaks and the
other ranks end by themselves, each with an error naming the dead peer. A server that fails while
workers still run ends the job at once, since no worker can finish without every shard. Servers end
by themselves (status 0) once every worker has finished or been dropped, printing their statistics;
the launcher gives them the lease plus 5 s to do so once the workers have ended, before stopping
them, and gives the workers as long to end once a server has ended that way (the last workers'
processes may end just after it). Only a process that ended by itself with a non-zero status (or a
server that ended with none while the workers did not end) counts as failed, and its reason is its
own last error line. Processes still running at the end, on a failure that ends
the job and on Ctrl-C are stopped by the launcher, so nothing is left behind.

Exit status: 0 when every worker finished (a worker's injected crash, --crash_workers or
--crash_at_step, does not count); 1 when any worker failed (once the others have finished), when a
server failed, when no worker finished, or when the job timed out; 2 for bad arguments, a bad host
file, workers that do not fit their hosts' slots, or a failed preflight; 130 on Ctrl-C.

The run directory (default runs/<time>) holds each process's log, each worker's JSON-lines progress
(worker-N.jsonl), job.secret, job.log (several hosts) and summary.json, which records every
process's host and outcome.
"""

import argparse
import ctypes
import json
import os
import re
import secrets
import shlex
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
                 "max_message_mb", "adaptive_batch", "adaptive_batch_every")
# Flags given to servers only.
SERVER_FLAGS = ("update_threads", "apply_threads", "noise_ema_decay", "memory_budget_mb", "push_budget_mb", "checkpoint_dir",
                "checkpoint_every_steps", "checkpoint_keep", "restore_step")
# Flags given to workers only.
WORKER_FLAGS = ("model", "layers", "compute_threads", "cuda_device", "overlap", "push_bucket_kb", "ps_transport", "ring_spin_us", "batch_size", "epochs", "steps", "eval_every", "log_every", "train_limit",
                "test_limit", "seed", "data_dir", "backend", "connect_timeout_ms", "retry_timeout_ms",
                "server_restart_timeout_s",
                # Straggler injection, for every worker; --slow_workers slows chosen ones.
                "slowdown", "min_step_ms", "delay_probability", "delay_distribution",
                "delay_mean_ms", "delay_sigma", "delay_alpha", "straggler_seed", "pause_at_step",
                "pause_ms", "crash_at_step", "export_model")

# The binaries' defaults that the launcher itself needs to know.
DEFAULT_LAYERS = "784-256-10"
DEFAULT_LEASE_MS = "10000"
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DATA_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
              "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")

SERVER_PROGRAM = "rubato_server"
WORKER_PROGRAM = "rubato_worker"

# rubato_worker's exit status after --crash_at_step: an injected failure, not a failed job.
INJECTED_CRASH = 3
# rubato_server's exit status when it stops to roll back (bsp, backup; see ARCHITECTURE.md), and
# how many such restarts of one shard the launcher makes.
ROLLBACK_EXIT = 75
MAX_ROLLBACKS = 8

# Several hosts.
DEFAULT_RSH = "ssh -o BatchMode=yes"
DEFAULT_BASE_PORT = 29500
# The remote wrapper's own one-line errors (no secret on stdin, no mktemp), with status 125.
REMOTE_ERROR = "rubato remote: error:"
REMOTE_WRAPPER_STATUS = 125
PROBE = "rubato-probe"
PREFLIGHT_OK = "rubato-preflight-ok"
# Seconds that a remote process has, once its stdin is closed, before the launcher kills its rsh:
# the wrapper's own SIGTERM-to-SIGKILL wait (5 s) and some.
REMOTE_STOP_GRACE = 8.0


class LaunchError(Exception):
    pass


def _die_with_parent():
    """Runs in the child before exec: ask the kernel for SIGKILL when the launcher dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Own process group, so that a terminal's Ctrl-C reaches only the launcher, which then stops
    # the children in order.
    os.setpgid(0, 0)


def _own_process_group():
    """Runs in an rsh child before exec. No PR_SET_PDEATHSIG here: the remote process is stopped by
    its stdin reaching end of file, which the launcher's death causes too, and killing an rsh that
    runs the wrapper in place (ip netns exec) would skip the wrapper's clean-up."""
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

    host = None  # Local processes; a RemoteProc's host-file name.

    def __init__(self, name, program, argv, run_dir, capture_stdout=False, crash_at_step=None):
        self._setup(name, program, run_dir, crash_at_step)
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else self.log, stderr=self.log,
            preexec_fn=_die_with_parent)

    def _setup(self, name, program, run_dir, crash_at_step):
        self.name = name
        # "rubato_server" or "rubato_worker": the prefix of the process's own one-line error.
        self.program = program
        # A worker's --crash_at_step, if any: then its exit with status 3 is expected, no failure.
        self.crash_at_step = crash_at_step
        # Set when the launcher ends the process: however it then exits, it has not failed.
        self.stopped = False
        # Set when the launcher started another process in this one's place (--restart_servers).
        self.restarted = False
        # A server: whether every worker had ended when the launcher first saw it ended. A server
        # ends by itself (status 0) once the workers are done; before that, its end is a failure.
        self.after_workers = None
        self.ended_at = None  # time.monotonic() when the launcher first saw it exited.
        self._outcome = None  # outcome(), once the process has exited: it no longer changes.
        self.stats = None  # A server's final GetStats (JSON, camelCase), once it has ended.
        self.log_path = os.path.join(run_dir, name + ".log")

    def returncode(self):
        """Popen's returncode (None while running; -N: killed by signal N)."""
        return self.popen.returncode

    def poll(self, now=None):
        self.popen.poll()
        rc = self.returncode()
        if rc is not None and self.ended_at is None:
            self.ended_at = now or time.monotonic()
        return rc

    def end_order(self):
        """Sort key, first ended first. Processes seen ended in the same round of polls tie, and
        servers come first: a dead server takes the workers with it, never the other way round."""
        return self.ended_at or 0.0, self.program != SERVER_PROGRAM

    def _log_lines(self):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))  # The error is the last line.
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def error_line(self):
        """The process's own last one-line error ("rubato_worker: error: ...", or the flag parser's
        "ERROR: ..."), or "" when it left none. Other lines may quote another process's error, a
        status relayed from a server for instance, so only these prefixes count."""
        for line in reversed(self._log_lines()):
            if line.startswith(self.program + ": error:") or line.startswith("ERROR: "):
                return line.strip()
        return ""

    def outcome(self):
        """(state, reason) of the process: ("running", None); ("stopped", None) when the launcher
        ended it; ("done", None) for a worker that finished or a server that ended by itself after
        the workers; ("crashed", why) for a worker's injected crash; else ("FAILED", why), why
        being how it ended and its own error line."""
        rc = self.poll()
        if rc is None:
            return "running", None
        if self._outcome is None:
            self._outcome = self._ended(rc)
        return self._outcome

    def _ended(self, rc):
        if self.stopped:
            return "stopped", None
        if self.restarted:
            error = self.error_line()
            how = exit_description(rc)
            return "restarted", "%s: %s" % (how, error) if error else how
        if rc == 0 and (self.program == WORKER_PROGRAM or self.after_workers):
            return "done", None
        if self.program == WORKER_PROGRAM and rc == INJECTED_CRASH and self.crash_at_step:
            return "crashed", "injected crash at step %s" % self.crash_at_step
        how = exit_description(rc)
        if self.program == SERVER_PROGRAM and rc == 0:
            how += " before the job ended"  # A server runs until every worker is done.
        error = self.error_line()
        return "FAILED", "%s: %s" % (how, error) if error else how

    def record(self):
        """The process's outcome for summary.json."""
        state, reason = self.outcome()
        out = {"name": self.name, "host": self.host or "127.0.0.1", "state": state.lower()}
        rc = self.returncode()
        if rc is not None:
            out["exit_status"] = rc
            if rc < 0:
                out["signal"] = signal_name(-rc)
        if reason:
            out["reason"] = reason
        return out

    def terminate(self):
        """Asks the process to stop (SIGTERM)."""
        self.popen.terminate()

    def stop_grace(self):
        return 0.0


class RemoteProc(Proc):
    """One process started on a host through the remote shell: `argv` runs it there (see
    remote_script). Its stdout and stderr come back through the rsh's; its stdin is a pipe that
    this launcher holds open, whose end (close_stdin, or the launcher's death) stops the remote
    process. `secret`, if not None, is sent as the pipe's first line."""

    def __init__(self, name, program, host, argv, run_dir, job_log, secret=None,
                 crash_at_step=None, stdout_sink=None):
        self._setup(name, program, run_dir, crash_at_step)
        self.host = host
        self.job_log = job_log
        self.log = open(self.log_path, "wb")
        self.log_lock = threading.Lock()
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_own_process_group)
        if secret is not None:
            try:
                self.popen.stdin.write(encode_secret(secret) + b"\n")
                self.popen.stdin.flush()
            except OSError:  # It has ended already: its outcome says how.
                pass
        self.readers = [threading.Thread(target=self._read_stderr, daemon=True)]
        if stdout_sink is None:
            self.readers.append(threading.Thread(target=self._read_stdout, daemon=True))
        else:  # A worker: its JSON lines go to its WorkerView.
            self.readers.append(threading.Thread(target=stdout_sink, args=(self.popen.stdout,),
                                                 daemon=True))
        for t in self.readers:
            t.start()

    def returncode(self):
        """The rsh returns the remote status; 128 + N, the wrapper's status when signal N killed
        the remote process, reads as Popen's -N."""
        rc = self.popen.returncode
        if rc is not None and 128 < rc <= 128 + 64:
            return -(rc - 128)
        return rc

    def _write_log(self, raw):
        with self.log_lock:
            self.log.write(raw)
            self.log.flush()

    def _read_stderr(self):
        for raw in iter(self.popen.stderr.readline, b""):
            self._write_log(raw)
            self.job_log.line(self.name, self.host, raw.decode("utf-8", "replace").rstrip("\n"))

    def _read_stdout(self):
        """A server's stdout: its log lines, and at its end one {"event":"stats",...} line."""
        for raw in iter(self.popen.stdout.readline, b""):
            self._write_log(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == "stats":
                self.stats = record

    def error_line(self):
        """As for a local process; failing that, the wrapper's own error, or for an rsh that
        failed (ssh: 255; the shell: 126, 127) its last line, "ssh: connect to host ..."."""
        line = super().error_line()
        if line:
            return line
        lines = [l.strip() for l in self._log_lines() if l.strip()]
        for l in reversed(lines):
            if l.startswith(REMOTE_ERROR):
                return l
        if lines and self.popen.returncode in (126, 127, 255):
            return lines[-1]
        return ""

    def close_stdin(self):
        """Ends the remote process: its wrapper sends it SIGTERM, then SIGKILL after 5 s."""
        try:
            self.popen.stdin.close()
        except OSError:
            pass

    def terminate(self):
        self.close_stdin()

    def stop_grace(self):
        return REMOTE_STOP_GRACE

    def join(self, timeout=5.0):
        for t in self.readers:
            t.join(timeout=timeout)


class JobLog:
    """<run_dir>/job.log: every remote process's stderr, each line prefixed `[NAME@HOST] `, also
    echoed above the live table."""

    def __init__(self, path, screen):
        self.file = open(path, "w")
        self.screen = screen
        self.lock = threading.Lock()

    def line(self, name, host, text):
        text = "[%s@%s] %s" % (name, host, text)
        with self.lock:
            self.file.write(text + "\n")
            self.file.flush()
        self.screen.note(text)


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
        self.eval_steps = []  # The step of each of self.evals.
        self.eval_epochs = []  # The epochs drawn by each of self.evals (None: not reported).
        self.batch_changes = []  # Adaptive batch: worker 0's "batch" records, in step order.
        self.started_at = None  # Seconds since launch when the worker's start record came.

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
                if event == "start" and self.started_at is None:
                    self.started_at = time.monotonic() - began
                # A done record repeats its final eval's accuracy; count that evaluation once.
                if event == "eval" and "test_accuracy" in record:
                    self.evals.append((time.monotonic() - began, record["test_accuracy"]))
                    self.eval_steps.append(record.get("step"))
                    self.eval_epochs.append(record.get("epochs"))
                elif event == "done" and "test_accuracy" in record and not self.evals:
                    self.evals.append((time.monotonic() - began, record["test_accuracy"]))
                    self.eval_steps.append(record.get("steps"))
                    self.eval_epochs.append(None)
                elif event == "batch":
                    self.batch_changes.append(record)


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


# Parameters of --model=cnn (worker/model_spec.h, CnnModelSpec).
CNN_PARAMETERS = 454922


def model_flag_bytes(model, layers):
    """Bytes of the float32 model that --model (mlp:SIZES or cnn) or its old spelling --layers
    names; ValueError for anything else."""
    if model is not None and layers is not None:
        raise ValueError("give --model or its old spelling --layers, not both")
    if model is None:
        return model_bytes(layers or DEFAULT_LAYERS)
    if model == "cnn":
        return 4 * CNN_PARAMETERS
    if model.startswith("mlp:"):
        return model_bytes(model[len("mlp:"):])
    raise ValueError("unknown model %r (expected mlp:IN-HIDDEN...-CLASSES or cnn)" % model)


def max_message_mb(layers):
    """The largest gRPC message, in MiB, that a job training this model must accept: the model's
    bytes (a whole-model pull or push, or the ring's largest chunk, is at most that) plus a quarter
    for message framing, rounded up, plus one; at least gRPC's default of 4."""
    mib = 1 << 20
    nbytes = layers if isinstance(layers, int) else model_bytes(layers)
    return max(4, -(-nbytes * 5 // (4 * mib)) + 1)  # ceil(bytes * 1.25 / MiB) + 1


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


def render(views, states, total_steps, hosts=None):
    """The live table: one row per worker; with `hosts` (several hosts), a host column."""
    fmt = "%-8s " + ("%-12s " if hosts else "%s") + "%-8s %13s %6s %8s %9s %9s %9s %9s %6s"
    rows = [fmt % ("worker", "host" if hosts else "", "state", "step", "epoch", "loss",
                   "test_acc", "steps/s", "comm_ms", "delay_ms", "stale")]
    # Adaptive batch: the job's steps follow the plan; worker 0's newest batch record says how many.
    changes = []
    for v in views:
        with v.lock:
            changes += v.batch_changes
    planned = max(changes, key=lambda c: c.get("step", 0)).get("steps") if changes else None
    for i, (v, state) in enumerate(zip(views, states)):
        with v.lock:
            step, ev, start = dict(v.step), dict(v.eval), dict(v.start)
        total = planned or start.get("steps", total_steps or 0)
        acc = ev.get("test_accuracy")
        rows.append(fmt % (
            v.index, hosts[i] if hosts else "", state,
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
    notes (the launcher's, and remote processes' stderr lines) go above the table."""

    def __init__(self, tty):
        self.tty = tty
        self.drawn = 0  # Lines of the table now on the terminal.
        self.last_plain = 0.0
        self.rows = []  # The table last drawn, redrawn below the notes on a terminal.
        self.lock = threading.Lock()  # Notes come from reader threads too.

    def table(self, rows, force=False):
        with self.lock:
            now = time.monotonic()
            self.rows = rows
            if self.tty:
                sys.stdout.write(("\x1b[%dF" % self.drawn if self.drawn else "") +
                                 "".join("\x1b[2K" + r + "\n" for r in rows))
                sys.stdout.flush()
                self.drawn = len(rows)
            elif force or now - self.last_plain >= 5:
                self.last_plain = now
                print("\n".join(rows), flush=True)

    def note(self, text):
        with self.lock:
            if self.tty and self.drawn:
                # Clear the table, print the note where it was, and draw the table again below.
                sys.stdout.write("\x1b[%dF\x1b[J" % self.drawn)
                sys.stdout.write(text + "\n" + "".join("\x1b[2K" + r + "\n" for r in self.rows))
                sys.stdout.flush()
                self.drawn = len(self.rows)
            else:
                print(text, flush=True)


# --- Several hosts: the host file, placement, the remote wrapper, the preflight. -----------------

class HostfileError(ValueError):
    pass


# A host name or IPv4 address: what can precede ":PORT" in --servers and --peers.
HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def parse_hostfile(text, path="hostfile"):
    """mpirun-style host file -> [(host, slots)] in file order. One host per line, optionally
    followed by `slots=N` (default 1); `#` starts a comment; blank lines are skipped. Errors name
    the file and line: "hosts:3: ..."."""
    hosts, seen = [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = "%s:%d: " % (path, number)
        words = line.split()
        host = words[0]
        if "=" in host:
            raise HostfileError(where + "expected a host name first, got %r" % host)
        if not HOST_NAME.match(host):
            raise HostfileError(where + "bad host name %r (letters, digits, '.', '-' and '_'; "
                                "IPv6 addresses are not supported, give a name)" % host)
        if host in seen:
            raise HostfileError(where + "host %s is already on line %d" % (host, seen[host]))
        slots = None
        for word in words[1:]:
            key, eq, value = word.partition("=")
            if key != "slots" or not eq:
                raise HostfileError(where + "expected slots=N after the host name, got %r" % word)
            if slots is not None:
                raise HostfileError(where + "slots given twice")
            if not value.isdigit() or int(value) < 1:
                raise HostfileError(where + "slots must be a whole number >= 1, got %r" % value)
            slots = int(value)
        seen[host] = number
        hosts.append((host, slots or 1))
    if not hosts:
        raise HostfileError("%s: no hosts in the file" % path)
    return hosts


def select_hosts(hosts, names, flag):
    """The hosts that --server_hosts or --worker_hosts (`names`, comma-separated, or None for every
    host) names, with their slots, in the flag's order."""
    if names is None:
        return list(hosts)
    slots = dict(hosts)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen:
        raise ValueError("%s: no host names in %r" % (flag, names))
    unknown = [n for n in chosen if n not in slots]
    if unknown:
        raise ValueError("%s: unknown host%s %s (the host file lists %s)" % (
            flag, "s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(slots)))
    twice = sorted({n for n in chosen if chosen.count(n) > 1})
    if twice:
        raise ValueError("%s: %s given twice" % (flag, ", ".join(twice)))
    return [(n, slots[n]) for n in chosen]


def place_servers(hosts, n):
    """Shard i goes to host i mod len(hosts): round-robin. Servers take no slots."""
    return [hosts[i % len(hosts)][0] for i in range(n)]


def place_workers(hosts, n, map_by="slot", oversubscribe=False):
    """The host of each of `n` workers. map_by "slot": fill each host's slots in order, so that
    consecutive ranks share a host; "host": one worker per host in turn, skipping full hosts. A
    host takes at most its slots: more workers than slots is an error unless `oversubscribe`, and
    then the extra workers go round-robin over every host."""
    total = sum(s for _, s in hosts)
    if n > total and not oversubscribe:
        raise ValueError(
            "%d worker(s) do not fit in the %d slot(s) of their hosts (%s): give hosts more slots "
            "(slots=N in the host file), more --worker_hosts, fewer --workers, or --oversubscribe"
            % (n, total, ", ".join("%s:%d" % h for h in hosts)))
    placement = []
    if map_by == "slot":
        for host, slots in hosts:
            placement += [host] * min(slots, n - len(placement))
    elif map_by == "host":
        used = dict.fromkeys((h for h, _ in hosts), 0)
        while len(placement) < min(n, total):
            for host, slots in hosts:
                if used[host] < slots and len(placement) < n:
                    used[host] += 1
                    placement.append(host)
        # Worker ids in host order within each round: rank r on host r mod len(hosts).
    else:
        raise ValueError("--map_by: expected slot or host, got %r" % map_by)
    for i in range(n - len(placement)):  # Oversubscribed.
        placement.append(hosts[i % len(hosts)][0])
    return placement


def encode_secret(secret):
    """The secret's bytes as one line for the wrapper's `printf %b`: every byte as \\0NNN, so
    that any byte, a newline or NUL included, arrives intact."""
    return "".join("\\0%03o" % b for b in secret).encode("ascii")


def remote_script(argv, secret):
    """The one-line sh script that runs `argv` on a host and ties its life to the script's stdin.

    With `secret`, the first stdin line is the job's secret (encode_secret): it goes to a fresh
    mode-0600 file in a `mktemp -d` directory, removed at exit, and the program gets
    --auth_secret_file=that file. The program runs in the background with stdin from /dev/null; a
    watcher subshell reads the rest of stdin and, at its end of file, sends it SIGTERM, then SIGKILL
    5 s later (and removes the directory, in case the script itself was killed). SIGTERM, SIGINT or
    SIGHUP to the script are passed on. The script exits with the program's status, 128 + N when
    signal N killed it. One line, since a login shell that reads it may not be sh."""
    cmd = " ".join(shlex.quote(a) for a in argv)
    fail = "{ echo '%s %%s' >&2; exit %d; }" % (REMOTE_ERROR, REMOTE_WRAPPER_STATUS)
    parts = ["d=", "exec 3<&0"]
    if secret:
        parts += [
            "IFS= read -r s || [ -n \"$s\" ] || " + fail % "no job secret on stdin",
            "d=$(mktemp -d \"${TMPDIR:-/tmp}/rubato.XXXXXX\") || " + fail % "mktemp -d failed",
            "trap 'rm -rf \"$d\"' EXIT",
            "(umask 077 && printf '%b' \"$s\" >\"$d/job.secret\") || " +
            fail % "cannot write the job secret",
            "s=",
        ]
        cmd += ' "--auth_secret_file=$d/job.secret"'
    parts += [
        cmd + " </dev/null 3<&- &",
        "p=$!",
        "(while IFS= read -r _; do :; done; kill -TERM $p; i=0; "
        "while kill -0 $p && [ $i -lt 5 ]; do sleep 1; i=$((i+1)); done; kill -KILL $p; "
        "[ -z \"$d\" ] || rm -rf \"$d\") <&3 >/dev/null 2>&1 &",
        "w=$!",
        "exec 3<&-",
        "trap 'kill -TERM $p 2>/dev/null' HUP INT TERM",
        "wait $p; rc=$?",
        # A trapped signal interrupts wait: wait again until the program has really ended.
        "while kill -0 $p 2>/dev/null; do wait $p; rc=$?; done",
        "kill $w 2>/dev/null",
        "exit $rc",
    ]
    out = ""
    for part in parts:
        out += part + (" " if part.endswith("&") else "; ")
    return out.rstrip("; ")


def rsh_argv(rsh, host, script, joins):
    """argv that runs `sh -c script` on `host` through the remote shell `rsh` (a list). A remote
    shell that joins its arguments into one command line (ssh) gets the script quoted once more;
    one that passes them on as argv (ip netns exec) gets it as is."""
    if joins:
        return rsh + [host, "sh -c " + shlex.quote(script)]
    return rsh + [host, "sh", "-c", script]


def _run_rsh(argv, timeout):
    """(status, stdout, stderr) of a short rsh command; status None on a timeout."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout, preexec_fn=os.setpgrp)
    except subprocess.TimeoutExpired:
        return None, "", ""
    except OSError as e:  # No such rsh program.
        return 127, "", str(e)
    return (done.returncode, done.stdout.decode("utf-8", "replace"),
            done.stderr.decode("utf-8", "replace"))


def _last_line(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def probe_host(rsh, rsh_text, host, timeout):
    """Runs `RSH HOST echo "'probe'"`: (joins, None) when the host answered, joins telling whether
    the rsh joined its arguments into a command line for a shell (which then removed the quotes:
    ssh) or passed them on as argv (ip netns exec); (None, why) when it did not answer."""
    rc, out, err = _run_rsh(rsh + [host, "echo", "'%s'" % PROBE], timeout)
    if rc is None:
        return None, "no answer through --rsh '%s' within %g s" % (rsh_text, timeout)
    answer = _last_line(out)
    if rc == 0 and answer in (PROBE, "'%s'" % PROBE):
        return answer == PROBE, None
    why = _last_line(err) or (answer and "unexpected answer %r" % answer) or "no output"
    return None, "unreachable through --rsh '%s' (%s): %s" % (rsh_text, exit_description(rc), why)


def preflight_script(executables, files, names):
    """One-line sh script: a line "not executable: PATH", "missing: PATH" or "cannot resolve: NAME"
    per problem, then PREFLIGHT_OK."""
    q = lambda items: " ".join(shlex.quote(i) for i in items)  # noqa: E731
    parts = []
    if executables:
        parts.append('for f in %s; do [ -f "$f" ] && [ -x "$f" ] || echo "not executable: $f"; '
                     'done' % q(executables))
    if files:
        parts.append('for f in %s; do [ -f "$f" ] && [ -r "$f" ] || echo "missing: $f"; done'
                     % q(files))
    parts.append('command -v mktemp >/dev/null 2>&1 || echo "missing: the mktemp command"')
    if names:
        parts.append('if command -v getent >/dev/null 2>&1; then for h in %s; do '
                     'getent hosts "$h" >/dev/null 2>&1 || echo "cannot resolve: $h"; done; fi'
                     % q(names))
    parts.append("echo %s" % PREFLIGHT_OK)
    return "; ".join(parts)


def preflight(rsh, rsh_text, needs, timeout):
    """Checks every host in parallel. `needs`: host -> (executables, files, names to resolve).
    Returns (joins, problems): whether the rsh joins its arguments (probe_host), and host ->
    [problem, ...] for every host that lacks something (empty when all is well)."""
    problems, modes = {}, {}

    def check(host):
        executables, files, names = needs[host]
        joins, why = probe_host(rsh, rsh_text, host, timeout)
        if why:
            problems[host] = [why]
            return
        modes[host] = joins
        rc, out, err = _run_rsh(
            rsh_argv(rsh, host, preflight_script(executables, files, names), joins), timeout)
        lines = [l.strip() for l in out.splitlines() if l.strip()]
        found = [l for l in lines if l.split(":", 1)[0] in
                 ("not executable", "missing", "cannot resolve")]
        if rc is None:
            found.append("the checks did not finish within %g s" % timeout)
        elif PREFLIGHT_OK not in lines:
            found.append("the checks failed (%s): %s" % (exit_description(rc),
                                                         _last_line(err) or "no output"))
        if found:
            problems[host] = found

    threads = [threading.Thread(target=check, args=(h,), daemon=True) for h in needs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(set(modes.values())) > 1:
        for host in modes:  # One rsh for every host: it cannot do both.
            problems.setdefault(host, []).append(
                "--rsh '%s' %s its arguments here, unlike on other hosts" % (
                    rsh_text, "joins" if modes[host] else "does not join"))
    joins = next(iter(modes.values()), False)
    return joins, {h: problems[h] for h in needs if h in problems}


class Plan:
    """Where each process runs, and its address, for a job across hosts."""

    def __init__(self, args, hosts):
        self.hosts = hosts
        self.server_hosts = place_servers(select_hosts(hosts, args.server_hosts,
                                                       "--server_hosts"), args.servers)
        self.worker_hosts = place_workers(select_hosts(hosts, args.worker_hosts,
                                                       "--worker_hosts"),
                                          args.workers, args.map_by, args.oversubscribe)
        # Fixed ports, so that every address is known before anything starts. Only one kind
        # listens in a job: servers (parameter-server modes) or ranks (allreduce).
        self.server_ports = [args.base_port + i for i in range(args.servers)]
        self.rank_ports = [args.base_port + r for r in range(args.workers)]
        self.rank_data_ports = [args.base_port + args.workers + r for r in range(args.workers)]
        self.server_data_ports = [args.base_port + args.servers + i for i in range(args.servers)]
        if args.base_port + max(2 * args.servers, 2 * args.workers) > 65536:
            raise ValueError("--base_port %d leaves too few ports" % args.base_port)

    def servers(self):
        return ",".join("%s:%d" % a for a in zip(self.server_hosts, self.server_ports))

    def peers(self):
        return ",".join("%s:%d" % a for a in zip(self.worker_hosts, self.rank_ports))


def preflight_needs(args, plan, remote_bin_dir):
    """host -> (executables, files, names) that the preflight checks there."""
    data_dir = args.data_dir or DEFAULT_DATA_DIR
    used = [h for h, _ in plan.hosts if h in plan.server_hosts or h in plan.worker_hosts]
    allreduce = args.mode == "allreduce"
    needs = {}
    for host in used:
        executables, files, names = [], [], []
        if host in plan.server_hosts:
            executables.append(os.path.join(remote_bin_dir, "server", SERVER_PROGRAM))
        if host in plan.worker_hosts:
            executables.append(os.path.join(remote_bin_dir, "worker", WORKER_PROGRAM))
            files += [os.path.join(data_dir, f) for f in DATA_FILES]
            # The addresses that this host's workers dial.
            for name in (plan.worker_hosts if allreduce else plan.server_hosts):
                if name not in names:
                    names.append(name)
        needs[host] = (executables, files, names)
    return needs


# Launcher flags that are also cluster flags but have a default of the launcher's own.
OWN_HELP = {
    "max_message_mb": "Largest gRPC message, in MiB, that every server and worker accepts "
                      "(passed as --max_message_mb). Default: from the model that --model (or "
                      "--layers) describes, max(4, ceil(1.25 * model bytes / MiB) + 1), model "
                      "bytes being 4 * sum(in * out + out) over consecutive layer sizes for "
                      "mlp:SIZES and 4 * 454922 for cnn.",
}


def make_parser():
    """The launcher's command line (also how experiment suites check their flags)."""
    p = argparse.ArgumentParser(
        prog="rubato launch", description="Run a Rubato job as local processes on 127.0.0.1, "
        "or across the hosts of a host file (--hostfile).",
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
                   help="Seconds for a server to start serving (local mode; across hosts the "
                        "workers wait for the servers up to their --connect_timeout_ms).")
    p.add_argument("--refresh", type=float, default=0.5, help="Live view refresh, seconds.")
    p.add_argument("--slow_workers", default=None, metavar="ID:FACTOR,...",
                   help="Give these workers --slowdown=FACTOR (e.g. 1:4,3:2), instead of "
                        "--slowdown if that is given too.")
    p.add_argument("--restart_servers", type=int, default=0, metavar="N",
                   help="Restart a server shard that dies before the job ends, on its address and "
                        "from its --checkpoint_dir, at most N times each (local runs). The "
                        "workers retry it meanwhile and register again; under bsp and backup "
                        "they then roll the other shards back to its checkpoint's step, which "
                        "restarts them too (exit status 75; not counted in N).")
    p.add_argument("--resume", action="store_true",
                   help="Continue the job whose checkpoints are in --checkpoint_dir: the shards "
                        "restore their newest ones and the workers go on from that step. Without "
                        "it, a local --checkpoint_dir that holds checkpoints is refused, so that a "
                        "new job never silently resumes an old one.")
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
    hosts = p.add_argument_group(
        "several hosts", "Start the processes on the hosts of a host file through a remote shell "
        "instead of on 127.0.0.1. Without --hostfile these flags are not allowed.")
    hosts.add_argument("--hostfile", default=None, metavar="FILE",
                       help="One host per line, optionally `slots=N` (how many workers it takes, "
                            "default 1); `#` comments. Host names are also the processes' "
                            "advertised addresses and must resolve on every host.")
    hosts.add_argument("--server_hosts", default=None, metavar="H1,H2,...",
                       help="Hosts for the servers, spread round-robin (default: every host).")
    hosts.add_argument("--worker_hosts", default=None, metavar="H1,H2,...",
                       help="Hosts for the workers (default: every host).")
    hosts.add_argument("--map_by", default="slot", choices=("slot", "host"),
                       help="slot (default): fill each worker host's slots in turn; host: one "
                            "worker per host in turn.")
    hosts.add_argument("--oversubscribe", action="store_true",
                       help="Allow more workers than slots (the extra ones go round-robin).")
    hosts.add_argument("--rsh", default=None, metavar="COMMAND",
                       help="Remote shell, run as COMMAND HOST sh -c SCRIPT (default: %r; "
                            "e.g. 'ip netns exec')." % DEFAULT_RSH)
    hosts.add_argument("--remote_bin_dir", default=None, metavar="DIR",
                       help="Where server/ and worker/ binaries are on every host (default: "
                            "--bin_dir, made absolute).")
    hosts.add_argument("--base_port", type=int, default=None, metavar="PORT",
                       help="Server shard i listens on PORT + i (its Push and Pull data plane on "
                            "PORT + servers + i), allreduce rank r on PORT + r "
                            "and its data connection on PORT + workers + r (default %d)."
                            % DEFAULT_BASE_PORT)
    hosts.add_argument("--preflight_timeout", type=float, default=None, metavar="S",
                       help="Seconds for each host to answer a preflight check (default 30).")
    for name in CLUSTER_FLAGS + WORKER_FLAGS + SERVER_FLAGS:
        p.add_argument("--" + name, default=None, help=OWN_HELP.get(name) or
                       "Passed to rubato_%s as --%s." % (
                           "server and rubato_worker" if name in CLUSTER_FLAGS else
                           "worker" if name in WORKER_FLAGS else "server", name))
    return p


def parse_args(argv):
    p = make_parser()
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
    remote_only = [f for f in ("server_hosts", "worker_hosts", "rsh", "remote_bin_dir",
                               "base_port", "preflight_timeout") if getattr(args, f) is not None]
    remote_only += ["map_by"] if args.map_by != "slot" else []
    remote_only += ["oversubscribe"] if args.oversubscribe else []
    if args.restart_servers < 0:
        p.error("--restart_servers must be >= 0")
    if args.restart_servers and args.checkpoint_dir is None:
        p.error("--restart_servers needs --checkpoint_dir: a restarted shard without checkpoints "
                "would start empty")
    if args.resume and args.checkpoint_dir is None:
        p.error("--resume needs --checkpoint_dir: the directory of the job to continue")
    if args.checkpoint_dir is not None and args.hostfile is None:
        # Local runs: the directory is here to look at (remote hosts have their own).
        found = checkpoint_files(args.checkpoint_dir)
        if found and not args.resume:
            p.error("--checkpoint_dir %s holds checkpoints of an earlier job (%s%s): pass "
                    "--resume to continue it, or give an empty directory"
                    % (args.checkpoint_dir, ", ".join(found[:3]),
                       ", ..." if len(found) > 3 else ""))
        if args.resume and not found:
            p.error("--resume: no checkpoints in --checkpoint_dir %s to resume from"
                    % args.checkpoint_dir)
    if args.restart_servers and args.hostfile is not None:
        p.error("--restart_servers: local runs only (with --hostfile, restart shards with your "
                "own supervisor, or use the Kubernetes manifests)")
    args.plan = None
    if args.hostfile is None:
        if remote_only:
            p.error("--%s: only with --hostfile" % remote_only[0])
    else:
        args.rsh = args.rsh if args.rsh is not None else DEFAULT_RSH
        args.base_port = args.base_port if args.base_port is not None else DEFAULT_BASE_PORT
        if args.preflight_timeout is None:
            args.preflight_timeout = 30.0
        if not shlex.split(args.rsh):
            p.error("--rsh: empty command")
        if not 1 <= args.base_port <= 65535:
            p.error("--base_port: expected a port in [1, 65535], got %d" % args.base_port)
        if args.preflight_timeout <= 0:
            p.error("--preflight_timeout must be > 0")
        try:
            with open(args.hostfile) as f:
                hosts = parse_hostfile(f.read(), args.hostfile)
        except OSError as e:
            p.error("--hostfile: %s" % e)
        except HostfileError as e:
            p.error("--hostfile: %s" % e)
        try:
            args.plan = Plan(args, hosts)
        except ValueError as e:
            p.error(str(e))
    if args.auth_secret_file is not None and not os.path.isfile(args.auth_secret_file):
        p.error("--auth_secret_file: no such file: %s" % args.auth_secret_file)
    if args.max_message_mb is None:
        try:
            args.max_message_mb = str(max_message_mb(model_flag_bytes(args.model, args.layers)))
        except ValueError as e:
            p.error("%s: %s" % ("--layers" if args.model is None else "--model", e))
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


def server_grace(args):
    """Seconds that servers have to end by themselves once the workers have ended (and workers
    have to end once a server has ended by itself): the lease, in which a server drops a worker
    that vanished, plus 5 s."""
    try:
        return float(args.lease_ms or DEFAULT_LEASE_MS) / 1000.0 + 5.0
    except ValueError:
        return float(DEFAULT_LEASE_MS) / 1000.0 + 5.0


def main(argv):
    args = parse_args(argv)
    plan = args.plan  # None: local processes.
    allreduce = args.mode == "allreduce"
    if plan:
        rsh = shlex.split(args.rsh)
        bin_dir = args.remote_bin_dir or os.path.abspath(args.bin_dir)
    else:
        bin_dir = args.bin_dir
    server_bin = os.path.join(bin_dir, "server", SERVER_PROGRAM)
    worker_bin = os.path.join(bin_dir, "worker", WORKER_PROGRAM)
    if plan:
        # Before anything starts: every host answers and has what its processes need.
        joins, problems = preflight(rsh, args.rsh, preflight_needs(args, plan, bin_dir),
                                    args.preflight_timeout)
        checked = len(preflight_needs(args, plan, bin_dir))
        if problems:
            print("rubato launch: error: preflight failed on %d of %d host(s); nothing was "
                  "started:" % (len(problems), checked), file=sys.stderr)
            for host, found in problems.items():
                for what in found:
                    print("  %s: %s" % (host, what), file=sys.stderr)
            return 2
        print("rubato: preflight passed on %d host(s) (binaries in %s, data in %s)" % (
            checked, bin_dir, args.data_dir or DEFAULT_DATA_DIR), flush=True)
    else:
        for b in (server_bin, worker_bin):
            if not os.access(b, os.X_OK):
                print("rubato launch: error: binary not found: %s (build first)" % b,
                      file=sys.stderr)
                return 2
    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    auth = auth_flags(args, run_dir)
    secret = None  # Several hosts: the secret's bytes, sent on each remote process's stdin.
    if plan and not args.insecure:
        with open(auth[0].partition("=")[2], "rb") as f:
            secret = f.read()
        auth = []  # The remote wrapper adds --auth_secret_file, naming its own copy.
    cluster = forwarded(args, CLUSTER_FLAGS) + ["--num_workers=%d" % args.workers] + auth

    procs, servers, workers, views, readers = [], [], [], [], []
    server_argv = []  # Local servers: the argv of each, for --restart_servers.
    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))
    screen = Screen(sys.stdout.isatty())
    job_log = JobLog(os.path.join(run_dir, "job.log"), screen) if plan else None
    began = time.monotonic()
    failure = None  # Why the job ended early: a timeout, a server's failure, Ctrl-C.

    def remote(name, program, host, proc_argv, **kwargs):
        argv = rsh_argv(rsh, host, remote_script(proc_argv, secret is not None), joins)
        return RemoteProc(name, program, host, argv, run_dir, job_log, secret=secret, **kwargs)

    try:
        if plan:
            # Every address is fixed: servers (or ranks) and workers all start at once; workers
            # wait for the servers (--connect_timeout_ms), ranks for each other.
            for s in range(args.servers):
                proc = remote("server-%d" % s, SERVER_PROGRAM, plan.server_hosts[s],
                              [server_bin, "--shard_id=%d" % s, "--num_shards=%d" % args.servers,
                               "--listen=0.0.0.0:%d" % plan.server_ports[s],
                               "--data_port=%d" % plan.server_data_ports[s]]
                              + cluster + forwarded(args, SERVER_FLAGS))
                procs.append(proc)
                servers.append(proc)
            if allreduce:
                where = "--peers=" + plan.peers()
                print("rubato: allreduce ring of %d worker(s) (%s) through --rsh '%s'; run "
                      "directory %s" % (args.workers, plan.peers(), args.rsh, run_dir), flush=True)
            else:
                where = "--servers=" + plan.servers()
                print("rubato: %d server(s) at %s; starting %d worker(s) on %s through --rsh "
                      "'%s'; run directory %s" % (
                          args.servers, plan.servers(), args.workers,
                          ",".join(plan.worker_hosts), args.rsh, run_dir), flush=True)
        else:
            # Servers first, each on a free port reported through its port file. The allreduce
            # mode has no servers: the workers listen on free ports chosen here and form a ring.
            addresses = []
            for s in range(0 if allreduce else args.servers):
                port_file = os.path.join(run_dir, "server-%d.port" % s)
                if os.path.exists(port_file):
                    os.remove(port_file)
                argv = ([server_bin, "--shard_id=%d" % s, "--num_shards=%d" % args.servers,
                         "--listen=127.0.0.1:0", "--port_file=" + port_file,
                         "--stats_file=" + os.path.join(run_dir, "server-%d.stats.json" % s)]
                        + cluster + forwarded(args, SERVER_FLAGS))
                server_argv.append(argv)
                proc = Proc("server-%d" % s, SERVER_PROGRAM, argv, run_dir)
                procs.append(proc)
                servers.append(proc)
            for s, proc in enumerate(servers):
                addresses.append(wait_for_port_file(
                    proc, os.path.join(run_dir, "server-%d.port" % s),
                    time.monotonic() + args.startup_timeout))
            if allreduce:
                where = "--peers=" + ",".join("127.0.0.1:%d" % p
                                              for p in free_ports(args.workers))
                print("rubato: allreduce ring of %d worker(s) (%s); run directory %s"
                      % (args.workers, where[len("--peers="):], run_dir), flush=True)
            else:
                where = "--servers=" + ",".join(addresses)
                print("rubato: %d server(s) at %s; starting %d worker(s); run directory %s"
                      % (args.servers, ",".join(addresses), args.workers, run_dir), flush=True)
        for w in range(args.workers):
            flags = worker_flags(args, w)
            crash = [f.partition("=")[2] for f in flags if f.startswith("--crash_at_step=")]
            crash = crash[0] if crash else None
            view = WorkerView(w, os.path.join(run_dir, "worker-%d.jsonl" % w))
            views.append(view)
            if plan:
                listen = (["--listen=0.0.0.0:%d" % plan.rank_ports[w],
                           "--ring_data_port=%d" % plan.rank_data_ports[w]] if allreduce else [])
                proc = remote("worker-%d" % w, WORKER_PROGRAM, plan.worker_hosts[w],
                              [worker_bin, "--worker_id=%d" % w, where] + listen + cluster + flags,
                              crash_at_step=crash,
                              stdout_sink=lambda stream, view=view: view.feed(stream, began))
            else:
                proc = Proc("worker-%d" % w, WORKER_PROGRAM, [worker_bin, "--worker_id=%d" % w,
                                                              where] + cluster + flags,
                            run_dir, capture_stdout=True, crash_at_step=crash)
                t = threading.Thread(target=view.feed, args=(proc.popen.stdout, began),
                                     daemon=True)
                t.start()
                readers.append(t)
            procs.append(proc)
            workers.append(proc)

        # Runs until every worker has ended by itself, then gives the servers the lease and 5 s to
        # end by themselves. A dead worker is only noted: the servers drop it after its lease and
        # the others carry on (allreduce: the others end by themselves).
        noted = set()
        restarts = [0] * len(servers)
        rollbacks = [0] * len(servers)
        workers_over_at = None
        grace = server_grace(args)
        while True:
            now = time.monotonic()
            ended = {p: p.poll(now) is not None for p in procs}  # One timestamp per round.
            workers_over = all(ended[p] for p in workers)
            for p in servers:
                # A server that ends by itself (status 0) may do so just before the last workers'
                # processes end (it ends once they have told it they finished): it has until the
                # same grace has passed for the workers to end. Any other end is at once a failure.
                if ended[p] and p.after_workers is None:
                    if workers_over:
                        p.after_workers = True
                    elif p.returncode() != 0 or now - p.ended_at > grace:
                        p.after_workers = False
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
            screen.table(render(views, [s for s, _ in outcomes], None,
                                plan.worker_hosts if plan else None))
            if interrupted:
                failure = "interrupted"
                break
            # --restart_servers: a shard that died early is started again on its address, from
            # its checkpoints; the workers retry it meanwhile. A bsp or backup shard that exits
            # with ROLLBACK_EXIT stopped to roll back to a restarted shard's checkpoint: it is
            # started again too, without counting against N (at most MAX_ROLLBACKS times).
            for s, p in enumerate(servers):
                rollback = p.returncode() == ROLLBACK_EXIT and rollbacks[s] < MAX_ROLLBACKS
                if (p.after_workers is False and not plan and not p.restarted
                        and args.restart_servers > 0
                        and (rollback or restarts[s] < args.restart_servers)):
                    p.restarted = True
                    if rollback:
                        rollbacks[s] += 1
                    else:
                        restarts[s] += 1
                    argv = [("--listen=" + addresses[s]) if a == "--listen=127.0.0.1:0" else a
                            for a in server_argv[s]]
                    argv = [a for a in argv if not a.startswith("--port_file=")]
                    new = Proc("server-%d.%s-%d" % (s, "rollback" if rollback else "restart",
                                                     rollbacks[s] if rollback else restarts[s]),
                               SERVER_PROGRAM, argv, run_dir)
                    if rollback:
                        screen.note("rubato: server-%d stopped to roll back to another shard's "
                                    "checkpoint; restarting it on %s" % (s, addresses[s]))
                    else:
                        screen.note("rubato: server-%d %s; restarting it on %s from its "
                                    "checkpoints (%d of %d)" % (s, p.outcome()[1], addresses[s],
                                                                restarts[s],
                                                                args.restart_servers))
                    procs.append(new)
                    servers[s] = new
                    ended[new] = False
            # Without every shard no worker can finish: a server that ends first ends the job.
            early = sorted((p for p in servers if p.after_workers is False), key=Proc.end_order)
            if early:
                failure = "%s%s %s" % (early[0].name, "@" + early[0].host if plan else "",
                                       early[0].outcome()[1])
                break
            if workers_over:
                if workers_over_at is None:
                    workers_over_at = now
                if all(ended[p] for p in servers) or now - workers_over_at > grace:
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
        for p in procs:
            if isinstance(p, RemoteProc):
                p.join()
    wall = time.monotonic() - began
    for s, p in enumerate(servers):  # Local servers write their final statistics to a file.
        if p.stats is None and not plan:
            try:
                with open(os.path.join(run_dir, "server-%d.stats.json" % s)) as f:
                    p.stats = json.load(f)
            except (OSError, ValueError):
                pass

    if views:
        screen.table(render(views, [p.outcome()[0] for p in workers], None,
                            plan.worker_hosts if plan else None), force=True)
    # Every process that failed by itself, in the order it ended: the first is usually the cause.
    failed = sorted((p for p in procs if p.outcome()[0] == "FAILED"), key=Proc.end_order)
    at = (lambda p: "%s@%s" % (p.name, p.host)) if plan else (lambda p: p.name)
    for p in failed:
        print("rubato: %s FAILED: %s" % (at(p), p.outcome()[1]), flush=True)
    failed_workers = [p for p in failed if p.program == WORKER_PROGRAM]
    if failure is None and failed:
        failed_servers = len(failed) - len(failed_workers)  # Ended after the last worker did.
        failure = "%d of %d worker(s)%s failed%s %s %s" % (
            len(failed_workers), args.workers,
            " and %d server(s)" % failed_servers if failed_servers else "",
            ":" if len(failed) == 1 else ", first", at(failed[0]), failed[0].outcome()[1])
        if len(failed) > 1:  # Each one's reason is printed above and in summary.json.
            failure += "; then %s" % ", ".join(at(p) for p in failed[1:])
    if failure is None and not any(p.outcome()[0] == "done" for p in workers):
        failure = "no worker finished"
    summary = summarize(views, wall, args, failure, run_dir, workers, servers,
                        [p for p in procs if p.restarted])
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
        noise = summary.get("noise_scale")
        if noise and noise["b_simple_ema"] is not None:
            print("rubato: gradient noise scale B_simple = tr(Sigma)/|G|^2 = %.0f examples "
                  "(moving average over %d steps at the end; each step's gradients at batch %d "
                  "and %d)" % (noise["b_simple_ema"], noise["steps_measured"], noise["b_small"],
                               noise["b_big"]))
        print("rubato: summary in %s" % os.path.join(run_dir, "summary.json"), flush=True)
    if failure:
        print("rubato launch: error: %s (logs in %s)" % (failure, run_dir), file=sys.stderr)
        return 130 if interrupted else 1
    return 0


STALENESS_BUCKETS = ["0", "1", "2", "3", "4-7", "8-15", "16-31", ">=32"]


def checkpoint_files(directory):
    """The shard checkpoints (shard-<id>-step-<step>.ckpt) in `directory`, sorted; [] if none
    or no such directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if re.match(r"^shard-\d+-step-\d{12}\.ckpt$", n))


def summarize(views, wall, args, failure, run_dir, workers, servers, restarted=()):
    summary = {"ok": failure is None, "error": failure, "wall_s": round(wall, 3),
               "servers": args.servers, "workers": args.workers, "mode": args.mode or "bsp",
               "target_accuracy": args.target_accuracy, "max_message_mb": int(args.max_message_mb)}
    if args.plan:
        summary["hostfile"] = os.path.abspath(args.hostfile)
        summary["hosts"] = [{"host": h, "slots": s} for h, s in args.plan.hosts]
        summary["rsh"] = args.rsh
    # How each process ended: done, failed (with its reason), crashed (injected) or stopped.
    summary["worker_outcomes"] = [p.record() for p in workers]
    summary["server_outcomes"] = [p.record() for p in servers]
    summary["restarted_servers"] = [p.record() for p in restarted]
    summary["failed_workers"] = sum(p.outcome()[0] == "FAILED" for p in workers)
    summary["injected_crashes"] = sum(p.outcome()[0] == "crashed" for p in workers)
    done = [(v.evals[-1][0], v.done) for v in views if v.done and v.evals]
    if done:
        # The worker that finished last evaluated the final weights (under bsp all agree).
        summary["test_accuracy"] = max(done, key=lambda d: d[0])[1]["test_accuracy"]
        summary["steps"] = max(d["steps"] for _, d in done)
        summary["per_worker"] = [d for _, d in done]
    reached = [(t, step, epochs) for v in views
               for (t, acc), step, epochs in zip(v.evals, v.eval_steps, v.eval_epochs)
               if acc >= args.target_accuracy]
    summary["time_to_target_s"] = round(min(reached)[0], 3) if reached else None
    # The job step at which a worker first measured it (the evaluation's own step), and the
    # epochs of training examples drawn by then (the fair measure when the batch changes).
    summary["steps_to_target"] = min(reached)[1] if reached else None
    summary["epochs_to_target"] = min(reached)[2] if reached else None
    # Adaptive batch: every change, as the servers announced it (worker 0's records).
    changes = [c for v in views for c in v.batch_changes]
    summary["batch_changes"] = [
        {k: c.get(k) for k in ("step", "batch_size", "global_batch", "b_simple", "learning_rate")}
        for c in sorted(changes, key=lambda c: c.get("step", 0))]
    # Every evaluation, on the launch's clock (seconds since the launch began), for plots of
    # accuracy against wall time; and when each worker's training began on that clock (its
    # records' "t" count from there).
    summary["evals"] = sorted(
        ({"worker": v.index, "t": round(t, 3), "step": step, "test_accuracy": acc}
         for v in views for (t, acc), step in zip(v.evals, v.eval_steps)),
        key=lambda e: e["t"])
    summary["worker_started_s"] = [None if v.started_at is None else round(v.started_at, 3)
                                   for v in views]
    worker_steps = sum(v.step.get("step", 0) for v in views)
    examples = sum(examples_drawn(v.step.get("step", 0), v.start.get("batch_size", 0),
                                  summary["batch_changes"]) for v in views)
    summary["worker_steps_per_s"] = round(worker_steps / max(wall, 1e-9), 2)
    summary["examples_per_s"] = round(examples / max(wall, 1e-9), 1)
    # What the servers saw: each one's final statistics (its stdout line, or local: its file).
    histogram = [0] * len(STALENESS_BUCKETS)
    totals = {"applied_updates": 0, "dropped_gradients": 0, "dropped_workers": 0,
              "rejected_pushes": 0}
    for server in servers:
        stats = server.stats
        if not isinstance(stats, dict):
            continue
        for key in totals:
            try:
                totals[key] += int(stats.get(_camel(key), 0))
            except (TypeError, ValueError):
                pass
        for i, n in enumerate(stats.get("stalenessHistogram", [])[:len(histogram)]):
            histogram[i] += int(n)
    summary.update(totals)
    summary["staleness_histogram"] = dict(zip(STALENESS_BUCKETS, histogram))
    noise = noise_scale([s.stats for s in servers])
    if noise:
        summary["noise_scale"] = noise
    total = sum(histogram)
    if total:
        lows = [0, 1, 2, 3, 4, 8, 16, 32]
        summary["mean_staleness_lower_bound"] = round(
            sum(l * n for l, n in zip(lows, histogram)) / total, 3)
    return summary


def noise_scale(stats):
    """The job's gradient noise scale from its shards' final statistics (bsp, backup): the sums
    of their moving averages of |G|^2 and tr(Sigma) (server/noise_scale.h), and their ratio
    B_simple; None unless every shard measured the same step with one batch size."""
    parts = [s.get("noiseScale") for s in stats if isinstance(s, dict)]
    if not parts or any(not isinstance(p, dict) for p in parts) or len(parts) != len(stats):
        return None
    try:
        steps = {int(p.get("step", 0)) for p in parts}
        batch = {int(p.get("batchSmall", 0)) for p in parts}
        g2 = sum(float(p.get("g2Ema", 0)) for p in parts)
        trace = sum(float(p.get("traceEma", 0)) for p in parts)
        measured = min(int(p.get("steps", 0)) for p in parts)
        workers = min(int(p.get("workers", 0)) for p in parts)
    except (TypeError, ValueError):
        return None
    if len(steps) != 1 or len(batch) != 1 or min(batch) <= 0 or measured <= 0:
        return None
    return {"b_simple_ema": round(trace / g2, 4) if g2 > 0 else None, "g2_ema": g2,
            "trace_ema": trace, "step": steps.pop(), "steps_measured": measured,
            "b_small": min(batch), "b_big": min(batch) * workers}


def _camel(name):
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def stop(procs, grace=5.0):
    """Stops everything still running: SIGTERM to a local process, then SIGKILL after `grace`
    seconds; a remote one's stdin is closed (its wrapper sends SIGTERM, then SIGKILL after 5 s),
    and its rsh is killed if it has not ended after REMOTE_STOP_GRACE seconds. A process stopped
    here has not failed, however it exits."""
    start = time.monotonic()
    for p in procs:
        if p.poll() is None:
            p.stopped = True
            p.terminate()
    for p in procs:
        deadline = start + max(grace, p.stop_grace())
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        if isinstance(p, RemoteProc):
            p.close_stdin()  # Also for those that ended by themselves: the pipe is not needed.
        p.poll()  # Records when it ended.


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
