#!/usr/bin/env python3
"""One task of a Rubato job step under Slurm: what `srun` runs on a node for each server shard
or worker that `rubato launch --slurm` started (deploy/launcher/slurm.py).

    srun ... python3 deploy/slurm/rubato_task.py {server|worker} RUN_DIR/slurm/plan.json

The task's id is SLURM_PROCID (shard i, worker i), its local rank SLURM_LOCALID (a worker's
GPU: --local_rank); the plan file, written by the launcher in the run directory, holds every
process's command line and host. The job's secret and identity are in a flag file that the
command lines name (--flagfile), never on a command line themselves.

The program runs as a child, so that this task can:
  - start a server shard again when it exits with status 75: it stopped to roll back to a
    restarted shard's checkpoint (bsp, backup), and comes back in the same allocation (at most
    MAX_ROLLBACKS times); and when it dies otherwise before the job is over, at most
    --restart_servers times, from its checkpoints;
  - pass SIGTERM, SIGINT and SIGHUP on to it (scancel, the time limit), and then not start it
    again; SIGUSR1 and SIGUSR2 (`sbatch --signal=USR1@T` without B:) are not passed on;
  - say how it ended, in one line on stderr that the launcher reads (MARK, then JSON).
Workers are never started again here: under a parameter-server mode the servers drop a dead
worker after its lease and the others carry on.

Only the standard library and deploy/launcher/programs.py: this file runs on every node with the
node's python3, from the checkout (which every node mounts).
"""

import json
import os
import signal
import subprocess
import sys

# The launcher's knowledge of the binaries (deploy/launcher/programs.py, standard library only),
# from the checkout this file is in.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launcher.programs import MAX_ROLLBACKS, ROLLBACK_EXIT  # noqa: E402

MARK = "rubato-task:"
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Sent to the tasks by `sbatch --signal=USR1@T` without B: (or scancel --signal): the binaries
# would die of them, so they are noted and not passed on. The launcher acts on its own SIGUSR1.
IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def say(**fields):
    print(MARK, json.dumps(fields, sort_keys=True), file=sys.stderr, flush=True)


def fail(message, status=2):
    print("%s error: %s" % (MARK, message), file=sys.stderr, flush=True)
    return status


def slurm_int(name):
    value = os.environ.get(name)
    if value is None or not value.isdigit():
        raise ValueError("%s is %s: run this under srun (rubato launch --slurm does)" % (
            name, "not set" if value is None else "not a number (%r)" % value))
    return int(value)


class Child:
    """The program, and the signals passed on to it."""

    def __init__(self):
        self.popen = None
        self.stopping = None  # The first stopping signal that arrived.
        for s in STOPPING + IGNORED:
            signal.signal(s, self.on_signal)

    def on_signal(self, signum, _frame):
        if signum in IGNORED:
            os.write(2, ("%s %s: not passed on (only SIGTERM, SIGINT and SIGHUP stop the "
                         "task)\n" % (MARK, signal.Signals(signum).name)).encode())
            return
        if self.stopping is None:
            self.stopping = signum
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signum)

    def run(self, argv, env):
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
        if self.stopping is not None:  # Signalled while it started.
            self.popen.send_signal(self.stopping)
        while True:
            try:
                return self.popen.wait()
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue


def main(argv):
    if len(argv) != 3 or argv[1] not in ("server", "worker"):
        return fail("usage: rubato_task.py {server|worker} PLAN_JSON")
    role, plan_path = argv[1], argv[2]
    try:
        procid, localid = slurm_int("SLURM_PROCID"), slurm_int("SLURM_LOCALID")
    except ValueError as e:
        return fail(str(e))
    node = os.environ.get("SLURMD_NODENAME", "")
    try:
        with open(plan_path) as f:
            plan = json.load(f)
    except OSError as e:
        return fail("cannot read the job's plan %s on node %s: %s (the run directory must be on "
                    "a file system that every node mounts)" % (plan_path, node, e.strerror))
    except ValueError as e:
        return fail("the job's plan %s is not JSON: %s" % (plan_path, e))
    tasks = plan.get(role + "s", [])
    if procid >= len(tasks):
        return fail("SLURM_PROCID %d, but the plan has %d %s task(s)" % (procid, len(tasks), role))
    task = tasks[procid]
    name = task["name"]
    if node and node != task["host"]:
        return fail("%s runs on node %s, but the plan puts it on %s (srun did not follow "
                    "SLURM_HOSTFILE)" % (name, node, task["host"]))
    command = list(task["argv"])
    if role == "worker":
        command.append("--local_rank=%d" % localid)
    env = dict(os.environ, **plan.get("env", {}))
    env.update(LOCAL_RANK=str(localid), LOCAL_WORLD_SIZE=str(task.get("local_size", 1)))
    child = Child()
    restarts, rollbacks = 0, 0
    step = "%s.%s" % (os.environ.get("SLURM_JOB_ID", "?"), os.environ.get("SLURM_STEP_ID", "?"))
    say(name=name, event="start", node=node, step=step, local_rank=localid)
    while True:
        rc = child.run(command, env)
        if role != "server" or child.stopping is not None or rc == 0:
            break
        if rc == ROLLBACK_EXIT and rollbacks < MAX_ROLLBACKS:
            rollbacks += 1
            say(name=name, event="restart", why="rollback", exit=rc, count=rollbacks)
        elif rc != ROLLBACK_EXIT and restarts < int(plan.get("restart_servers", 0)):
            restarts += 1
            say(name=name, event="restart", why="died", exit=rc, count=restarts)
        else:
            break
    say(name=name, event="exit", exit=rc, restarts=restarts, rollbacks=rollbacks,
        signal=signal.Signals(child.stopping).name if child.stopping else None)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv))
