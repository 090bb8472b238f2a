"""`rubato launch --slurm`: a job inside a Slurm allocation (an sbatch script, or salloc), started
with one `srun` step per role, as Horovod and torchrun take their ranks and hosts from Slurm.

The allocation says where: the hosts of SLURM_JOB_NODELIST (`scontrol show hostnames`), each with
its tasks (SLURM_TASKS_PER_NODE) as slots, placed as across hosts (hosts.Plan: servers
round-robin, workers in the slots left). The run directory, which every node must see (a shared
file system, as the checkpoints must be for a requeued job), holds what is made once per Slurm
job and kept across its requeues: the secret (job.secret, mode 0600), the flag file that names it
with the job's identity (job.flags, 0600: --auth_secret_file and --job_id, never on a command
line), slurm/job.json (which Slurm job made them) and slurm/plan.json (every process's command
line and host). Each attempt (SLURM_RESTART_COUNT) writes its logs, progress and summary.json to
attempt-N/.

Two steps, `srun --overlap --distribution=arbitrary` with SLURM_HOSTFILE listing the plan's host of
each task in order: the servers' and the workers' (the ranks' under allreduce). Each task runs
deploy/slurm/rubato_task.py, which takes its id from SLURM_PROCID and its local rank from
SLURM_LOCALID and runs the binary. Failures:
  - a worker that dies under a parameter-server mode does not end its step (--kill-on-bad-exit=0,
    --wait=0): the servers drop it after its lease and the others finish; under allreduce the
    step ends at once (--kill-on-bad-exit=1), as a broken ring cannot go on;
  - a shard's roll-back exit (75) is started again by its task, in the allocation; so is a shard
    that died, up to --restart_servers times;
  - scancel, or the time limit, sends SIGTERM to every task (and this launcher): the shards
    finish the checkpoint they are writing and stop, the attempt's summary says "interrupted";
  - SIGUSR1 (sbatch --signal=B:USR1@SECONDS, before the time limit) stops the job the same way
    and then requeues it (`scontrol requeue`); a requeued job (sbatch --requeue, also after a
    node failure) starts again with the same run directory and resumes from its checkpoints.
"""

import json
import os
import re
import secrets
import subprocess
import threading
import time

from . import commands
from .hosts import DEFAULT_BASE_PORT, Plan
from .live import JobLog, Screen, WorkerView
from .process import LaunchError, Proc, stats_record
from .programs import SERVER_PROGRAM, WORKER_PROGRAM, exit_description
from .supervise import run_supervised

TASK_SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "slurm", "rubato_task.py")
TASK_MARK = "rubato-task:"
# srun --label: "N: line", N right-aligned.
_LABELLED = re.compile(rb"^\s*(\d+): ?(.*)$")
# Seconds the steps have to end after SIGTERM before SIGKILL: a shard finishes the checkpoint it
# writes first. Within Slurm's KillWait (30 s by default), after which scancel and the time limit
# send SIGKILL, this launcher included, so that it still writes the summary.
STOP_GRACE = 25.0
SCONTROL_TIMEOUT = 30.0
# The launcher's --timeout under Slurm unless one is given: 30 days, past any time limit that
# Slurm itself enforces (with SIGTERM, and SIGUSR1 before it where asked).
SLURM_TIMEOUT = 30 * 86400.0


class SlurmError(ValueError):
    pass


def tasks_per_node(text, nodes):
    """SLURM_TASKS_PER_NODE ("2(x3),1") -> [2, 2, 2, 1], checked against `nodes` hosts."""
    counts = []
    for item in text.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", item.strip())
        if not m:
            raise SlurmError("SLURM_TASKS_PER_NODE: cannot read %r" % text)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if len(counts) != nodes:
        raise SlurmError("SLURM_TASKS_PER_NODE %r gives %d node(s), SLURM_JOB_NODELIST %d" % (
            text, len(counts), nodes))
    return counts


def expand_nodelist(nodelist):
    """Host names of a Slurm node list ("n[01-03],gpu7"), by `scontrol show hostnames`."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=SCONTROL_TIMEOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError("scontrol not found: --slurm runs inside a Slurm allocation")
    except subprocess.TimeoutExpired:
        raise SlurmError("scontrol show hostnames %s: no answer in %g s" % (
            nodelist, SCONTROL_TIMEOUT))
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise SlurmError("scontrol show hostnames %s: %s" % (
            nodelist, out.stderr.strip() or "no hosts"))
    return hosts


class Allocation:
    """The Slurm job this launcher runs in."""

    def __init__(self, environ, expand=None):
        self.job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not self.job_id:
            raise SlurmError("not inside a Slurm allocation (no SLURM_JOB_ID): submit "
                             "deploy/slurm/rubato.sbatch with sbatch, or run inside salloc")
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise SlurmError("SLURM_JOB_NODELIST is not set in job %s" % self.job_id)
        names = (expand or expand_nodelist)(nodelist)
        per_node = environ.get("SLURM_TASKS_PER_NODE")
        if per_node is None:
            raise SlurmError("SLURM_TASKS_PER_NODE is not set: give the job --ntasks (servers + "
                             "workers) or --ntasks-per-node")
        self.hosts = list(zip(names, tasks_per_node(per_node, len(names))))
        restarts = environ.get("SLURM_RESTART_COUNT", "0")
        self.restarts = int(restarts) if restarts.isdigit() else 0


def configure(p, args, environ=None):
    """parse_args' part for --slurm: the allocation, the plan, the run and checkpoint directories
    and whether this attempt resumes. Errors go through p.error (exit status 2)."""
    for flag in ("hostfile", "host", "rsh", "remote_bin_dir", "preflight_timeout"):
        if getattr(args, flag) is not None:
            p.error("--%s: not with --slurm (the allocation gives the hosts, srun starts the "
                    "processes)" % flag)
    try:
        alloc = Allocation(os.environ if environ is None else environ)
    except SlurmError as e:
        p.error("--slurm: %s" % e)
    args.slurm_alloc = alloc
    args.base_port = DEFAULT_BASE_PORT if args.base_port is None else args.base_port
    if not 1 <= args.base_port <= 65535:
        p.error("--base_port: expected a port in [1, 65535], got %d" % args.base_port)
    args.server_slots = 1 if args.server_slots is None else args.server_slots
    try:
        args.plan = Plan(args, alloc.hosts)
    except ValueError as e:
        p.error("--slurm: job %s's tasks (%s): %s" % (
            alloc.job_id, ", ".join("%s:%d" % h for h in alloc.hosts), e))
    args.run_dir = os.path.abspath(args.run_dir or os.path.join("runs", "slurm-" + alloc.job_id))
    if args.checkpoint_dir is None:
        args.checkpoint_dir = os.path.join(args.run_dir, "checkpoints")
    from .flags import checkpoint_files  # flags imports this module.
    found = checkpoint_files(args.checkpoint_dir)
    own = owner(args.run_dir) == alloc.job_id
    if found and not args.resume:
        if not own:
            p.error("--checkpoint_dir %s holds checkpoints of another job (%s): pass --resume to "
                    "continue it, or give an empty directory" % (args.checkpoint_dir, found[0]))
        args.resume = True  # This job's own, from an attempt before a requeue.
    if args.resume and not found and not own:
        p.error("--resume: no checkpoints in --checkpoint_dir %s to resume from"
                % args.checkpoint_dir)


def owner(run_dir):
    """The Slurm job id that made `run_dir`'s secret and identity (slurm/job.json), or None."""
    try:
        with open(os.path.join(run_dir, "slurm", "job.json")) as f:
            return str(json.load(f).get("slurm_job_id"))
    except (OSError, ValueError, AttributeError):
        return None


def job_identity(args, run_dir, alloc):
    """The flags that authenticate the job's processes: --flagfile naming the job's flag file,
    made once per Slurm job (a fresh secret and identity; kept across requeues), or --insecure.
    Also records in slurm/job.json which Slurm job the directory is."""
    mine = owner(run_dir) == alloc.job_id
    if not mine:  # Which Slurm job this directory is (a requeue resumes only its own).
        os.makedirs(os.path.join(run_dir, "slurm"), exist_ok=True)
        with open(os.path.join(run_dir, "slurm", "job.json"), "w") as f:
            json.dump({"slurm_job_id": alloc.job_id}, f)
            f.write("\n")
    if args.insecure:
        return ["--insecure"]
    flags = os.path.join(run_dir, "job.flags")
    if mine and os.path.isfile(flags):
        return ["--flagfile=" + flags]
    secret = os.path.abspath(args.auth_secret_file) if args.auth_secret_file else \
        commands.write_job_secret(run_dir)
    identity = "rubato-slurm-%s-%s" % (alloc.job_id, secrets.token_hex(8))
    commands.write_private_file(flags, "--auth_secret_file=%s\n--job_id=%s\n" % (secret, identity))
    return ["--flagfile=" + flags]


class SlurmTask(Proc):
    """One task of a step: a server shard or a worker. It ends when its rubato_task.py says so
    (its exit line), or when its step ends without that line (lost: killed, or its node died)."""

    def __init__(self, name, program, host, run_dir, crash_at_step=None):
        self._setup(name, program, run_dir, crash_at_step)
        self.host = host
        self.log = open(self.log_path, "wb")
        self.rc = None
        self.step = None  # "JOB.STEP", from its start line.
        self.restarts_in_place = []  # Its task's restart lines (servers).
        self.lost = None  # Why it ended without its exit line.
        self.srun = None  # Its Step.
        self.signalled = None  # The signal its task passed on to it and stopped for.

    def returncode(self):
        return self.rc

    def poll(self, now=None):
        if self.rc is None and self.srun is not None and self.srun.done():
            self.srun.finish()  # Its step ended; without its exit line, it is lost.
        if self.rc is not None and self.ended_at is None:
            self.ended_at = now or time.monotonic()
        return self.rc

    def write(self, raw):
        self.log.write(raw + b"\n")
        self.log.flush()

    def error_line(self):
        return super().error_line() or self.lost or ""

    def _ended(self, rc):
        state, why = super()._ended(rc)
        if state == "stopped" and self.signalled:
            why = "its task was sent %s (%s)" % (self.signalled, exit_description(rc))
        return state, why

    def terminate(self):
        """Its step is stopped as a whole (SlurmJob.stop)."""

    def record(self):
        out = super().record()
        if self.restarts_in_place:
            out["restarts_in_place"] = self.restarts_in_place
        return out


class Step:
    """One srun step: its tasks, and the threads that read its labelled output."""

    def __init__(self, job, role, tasks, argv, env):
        self.job, self.role, self.tasks = job, role, tasks
        self.finished = False
        try:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, env=env,
                                          start_new_session=True)
        except OSError as e:
            raise LaunchError("cannot start the %ss' step: %s: %s" % (role, argv[0], e.strerror))
        self.readers = [threading.Thread(target=self._read, args=(self.popen.stdout, True),
                                         daemon=True),
                        threading.Thread(target=self._read, args=(self.popen.stderr, False),
                                         daemon=True)]
        for t in self.readers:
            t.start()

    def _read(self, stream, stdout):
        for raw in iter(stream.readline, b""):
            raw = raw.rstrip(b"\n")
            m = _LABELLED.match(raw)
            index = int(m.group(1)) if m else len(self.tasks)
            if index >= len(self.tasks):  # srun's own lines.
                self.job.job_log.line("srun", self.role + "s", raw.decode("utf-8", "replace"))
                continue
            task, line = self.tasks[index], m.group(2)
            if stdout and task.program == WORKER_PROGRAM:
                self.job.views[index].take([line], self.job.began)
                continue
            task.write(line)
            text = line.decode("utf-8", "replace")
            if stdout:  # A server's final statistics line.
                task.stats = stats_record(line) or task.stats
                continue
            if text.startswith(TASK_MARK):
                self._mark(task, text[len(TASK_MARK):].strip())
            self.job.job_log.line(task.name, task.host, text)

    def _mark(self, task, text):
        try:
            said = json.loads(text)
        except ValueError:
            return  # Its error line: kept in its log as it is.
        if not isinstance(said, dict):
            return
        event = said.get("event")
        if event == "start":
            task.step = said.get("step")
        elif event == "restart":
            task.restarts_in_place.append({"why": said.get("why"), "exit_status": said.get("exit")})
        elif event == "exit" and isinstance(said.get("exit"), int):
            # Stopped by a signal to its task (scancel, the time limit, this launcher's stop):
            # not a failure of its own, however it exited.
            task.signalled = said.get("signal")
            task.stopped = task.stopped or bool(task.signalled)
            task.rc = said["exit"] if said["exit"] < 128 else -(said["exit"] - 128)

    def done(self):
        return self.popen.poll() is not None

    def finish(self):
        """Once srun has ended: the readers are done, and a task without its exit line is lost."""
        if self.finished:
            return
        self.finished = True
        for t in self.readers:
            t.join(timeout=10)
        rc = self.popen.returncode
        for task in self.tasks:
            if task.rc is None:
                task.lost = "its task ended without saying how (srun %s)" % exit_description(rc)
                task.rc = rc if rc not in (0, None) else 1


class SlurmJob:
    """A job's two steps, with what job.Job offers the Supervisor and main.finish."""

    restarts_in_place = True  # The tasks restart their shards; the Supervisor does not.
    # A task's exit line travels from its node through slurmstepd and srun, which a loaded node
    # can hold back for seconds (seen: a worker's past a grace of 8 s): the grace periods get
    # this much more, which only delays the verdict on a server that ended early.
    output_lag_s = 30.0

    def __init__(self, args, run_dir):
        self.args = args
        self.plan = args.plan
        self.alloc = args.slurm_alloc
        self.job_dir = args.run_dir
        self.run_dir = run_dir  # This attempt's: logs, progress, summary.json.
        self.interrupted = []
        self.requeue = False  # SIGUSR1: stop and requeue.
        self.screen = Screen(False)
        self.job_log = JobLog(os.path.join(run_dir, "job.log"), self.screen)
        self.procs, self.servers, self.workers, self.views, self.steps = [], [], [], [], []
        self.readers = []
        self.began = time.monotonic()

    def worker_hosts(self):
        return self.plan.worker_hosts

    def write_plan(self):
        """slurm/plan.json and a host file per step; returns the plan's path."""
        args, plan = self.args, self.plan
        bins = os.path.abspath(args.bin_dir)
        cluster = commands.cluster_flags(args, job_identity(args, self.job_dir, self.alloc)) + \
            commands.tls_flags(args)
        allreduce = (args.mode or "").partition(":")[0] == "allreduce"
        servers = [] if allreduce else [
            {"name": "server-%d" % s, "host": plan.server_hosts[s],
             "argv": commands.server_command(args, os.path.join(bins, "server", SERVER_PROGRAM),
                                             s, cluster, plan=plan)}
            for s in range(args.servers)]
        where = ("--peers=" + plan.peers()) if allreduce else ("--servers=" + plan.servers())
        workers = []
        for w in range(args.workers):
            argv = commands.worker_command(args, os.path.join(bins, "worker", WORKER_PROGRAM), w,
                                           where, cluster, plan=plan)
            workers.append({"name": "worker-%d" % w, "host": plan.worker_hosts[w],
                            "argv": [a for a in argv if not a.startswith("--local_rank=")],
                            # LOCAL_WORLD_SIZE as the launcher gives it across hosts.
                            "local_size": commands.local_rank(args, WORKER_PROGRAM, w)[1]})
        d = os.path.join(self.job_dir, "slurm")
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, "plan.json")
        with open(path, "w") as f:
            json.dump({"servers": servers, "workers": workers, "env": args.env_vars,
                       "restart_servers": args.restart_servers}, f, indent=1)
            f.write("\n")
        for role, tasks in (("server", servers), ("worker", workers)):
            with open(os.path.join(d, role + "s.hosts"), "w") as f:
                f.write("".join(t["host"] + "\n" for t in tasks))
        return path

    def run(self):
        return run_supervised(self, self.stop)

    def start(self):
        args = self.args
        plan_path = self.write_plan()
        allreduce = (args.mode or "").partition(":")[0] == "allreduce"
        roles = [("worker", WORKER_PROGRAM, self.plan.worker_hosts)]
        if not allreduce:
            roles.insert(0, ("server", SERVER_PROGRAM, self.plan.server_hosts))
        for role, program, hosts in roles:
            tasks = []
            for i, host in enumerate(hosts):
                crash = args.crash_workers.get(i) if program == WORKER_PROGRAM else None
                task = SlurmTask("%s-%d" % (role, i), program, host, self.run_dir,
                                 None if crash is None else str(crash))
                tasks.append(task)
                if program == WORKER_PROGRAM:
                    self.views.append(WorkerView(i, os.path.join(self.run_dir,
                                                                 "worker-%d.jsonl" % i)))
            (self.workers if program == WORKER_PROGRAM else self.servers).extend(tasks)
            self.procs.extend(tasks)
            # SLURM_HOSTFILE lists each task's host in order (arbitrary distribution).
            argv = ["srun", "--job-name=rubato-%ss" % role, "--ntasks=%d" % len(hosts),
                    "--distribution=arbitrary", "--overlap", "--wait=0", "--label",
                    "--kill-on-bad-exit=%d" % (1 if allreduce else 0),
                    "python3", TASK_SCRIPT, role, plan_path]
            env = dict(os.environ, SLURM_HOSTFILE=os.path.join(self.job_dir, "slurm",
                                                               role + "s.hosts"))
            step = Step(self, role, tasks, argv, env)
            for task in tasks:
                task.srun = step
            self.steps.append(step)
        what = ("allreduce ring of %d rank(s) (%s)" % (args.workers, self.plan.peers())
                if allreduce else "%d server(s) at %s, %d worker(s) on %s" % (
                    args.servers, self.plan.servers(), args.workers,
                    ",".join(self.plan.worker_hosts)))
        print("rubato: Slurm job %s%s: %s; run directory %s" % (
            self.alloc.job_id, " (requeued %d time(s): resuming)" % self.alloc.restarts
            if self.alloc.restarts else "", what, self.run_dir), flush=True)

    def _scancel(self, signame):
        """Signals every step of this launcher (not the batch script): the steps' ids, where their
        tasks said them, else the whole job's steps."""
        steps = sorted({t.step for t in self.procs if t.step and not t.step.endswith(".?")})
        targets = steps or [self.alloc.job_id]
        subprocess.run(["scancel", "--quiet", "--signal=" + signame] + targets,
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=SCONTROL_TIMEOUT)

    def stop(self):
        """Stops whatever still runs (SIGTERM to every task, SIGKILL after STOP_GRACE) and
        settles how each task ended."""
        running = [s for s in self.steps if not s.done()]
        if running:
            for t in self.procs:
                if t.rc is None:
                    t.stopped = True
            try:
                self._scancel("TERM")
            except (OSError, subprocess.TimeoutExpired):
                pass
            deadline = time.monotonic() + STOP_GRACE
            while any(not s.done() for s in self.steps) and time.monotonic() < deadline:
                time.sleep(0.2)
            if any(not s.done() for s in self.steps):
                try:
                    self._scancel("KILL")
                except (OSError, subprocess.TimeoutExpired):
                    pass
                for s in self.steps:
                    try:
                        s.popen.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        s.popen.kill()
                        s.popen.wait()
        for s in self.steps:
            s.popen.wait()
            s.finish()
        for t in self.procs:
            t.poll()

    def summary_extra(self):
        return {"slurm": {"job_id": self.alloc.job_id, "restart_count": self.alloc.restarts,
                          "job_dir": self.job_dir,
                          "hosts": [{"host": h, "tasks": n} for h, n in self.alloc.hosts],
                          "steps": sorted({t.step for t in self.procs if t.step})}}

    def requeue_job(self):
        """Asks Slurm to requeue this job (after SIGUSR1, before the time limit)."""
        out = subprocess.run(["scontrol", "requeue", self.alloc.job_id], capture_output=True,
                             text=True, stdin=subprocess.DEVNULL, timeout=SCONTROL_TIMEOUT)
        if out.returncode != 0:
            print("rubato launch: error: scontrol requeue %s: %s" % (
                self.alloc.job_id, out.stderr.strip()), flush=True)
            return False
        print("rubato: requeued Slurm job %s; it resumes from its checkpoints in %s" % (
            self.alloc.job_id, self.args.checkpoint_dir), flush=True)
        return True
