#!/usr/bin/env python3
"""Tests of deploy/launcher/slurm.py and deploy/slurm/rubato_task.py without a Slurm: the
allocation's variables, --slurm's checks, the job's secret and identity, a step's labelled output,
and the task wrapper (ids, restarts, signals) around fake binaries. tests/slurm_test runs the real
thing.

    python3 deploy/launcher/slurm_test.py    (or: bazel test //deploy:launcher_slurm_test)
"""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import flags, live, programs, slurm  # noqa: E402
from bazel import pyunit  # noqa: E402

TASK = os.path.join(os.path.dirname(HERE), "slurm", "rubato_task.py")
HOSTS = {"n[1-3]": ["n1", "n2", "n3"]}


def env(**extra):
    out = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x3)"}
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


def parse(argv, environ, tmp):
    """flags.parse_args with --slurm in `environ` (scontrol faked); (args, None) or (None, the
    error printed)."""
    err = io.StringIO()
    with mock.patch.dict(os.environ, environ, clear=False), \
            mock.patch.object(slurm, "expand_nodelist", lambda nl: HOSTS[nl]), \
            contextlib.redirect_stderr(err):
        try:
            return flags.parse_args(["--slurm", "--run_dir", tmp] + argv), None
        except SystemExit:
            return None, err.getvalue()


class AllocationTest(unittest.TestCase):

    def test_tasks_per_node(self):
        self.assertEqual(slurm.tasks_per_node("2(x3),1", 4), [2, 2, 2, 1])
        self.assertEqual(slurm.tasks_per_node("4", 1), [4])
        with self.assertRaisesRegex(slurm.SlurmError, "cannot read '2x3'"):
            slurm.tasks_per_node("2x3", 3)
        with self.assertRaisesRegex(slurm.SlurmError, "gives 3 node.*NODELIST 2"):
            slurm.tasks_per_node("1(x3)", 2)

    def test_allocation(self):
        a = slurm.Allocation(env(SLURM_RESTART_COUNT="2"), HOSTS.get)
        self.assertEqual((a.job_id, a.hosts, a.restarts), ("77", [("n1", 2), ("n2", 2),
                                                                  ("n3", 2)], 2))
        with self.assertRaisesRegex(slurm.SlurmError, "not inside a Slurm allocation"):
            slurm.Allocation(env(SLURM_JOB_ID=None), HOSTS.get)
        with self.assertRaisesRegex(slurm.SlurmError, "give the job --ntasks"):
            slurm.Allocation(env(SLURM_TASKS_PER_NODE=None), HOSTS.get)


class ConfigureTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.run_dir = os.path.join(self.tmp.name, "run")

    def test_plan_from_the_allocation(self):
        args, err = parse(["--servers", "2", "--workers", "4"], env(), self.run_dir)
        self.assertIsNone(err)
        self.assertEqual(args.plan.server_hosts, ["n1", "n2"])
        self.assertEqual(args.plan.worker_hosts, ["n1", "n2", "n3", "n3"])
        self.assertEqual(args.checkpoint_dir, os.path.join(self.run_dir, "checkpoints"))
        self.assertFalse(args.resume)
        self.assertEqual(args.timeout, slurm.SLURM_TIMEOUT)  # Slurm's time limit governs.
        args, _ = parse(["--timeout", "60"], env(), self.run_dir)
        self.assertEqual(args.timeout, 60)

    def test_errors(self):
        for argv, environ, want in [
                (["--workers", "9"], env(), "job 77's tasks \\(n1:2, n2:2, n3:2\\): 9 worker"),
                ([], env(SLURM_JOB_ID=None), "--slurm: not inside a Slurm allocation"),
                (["-H", "a,b"], env(), "--host: not with --slurm"),
                (["--rsh", "ssh"], env(), "--rsh: not with --slurm")]:
            args, err = parse(argv, environ, self.run_dir)
            self.assertIsNone(args)
            self.assertRegex(err, want)

    def test_resume_only_its_own_checkpoints(self):
        ckpt = os.path.join(self.run_dir, "checkpoints")
        os.makedirs(ckpt)
        open(os.path.join(ckpt, "shard-0-step-%012d.ckpt" % 10), "w").close()
        _, err = parse([], env(), self.run_dir)  # Another job's: refused without --resume.
        self.assertRegex(err, "holds checkpoints of another job .*pass --resume")
        args, _ = parse(["--resume"], env(), self.run_dir)
        self.assertTrue(args.resume)
        os.makedirs(os.path.join(self.run_dir, "slurm"))
        with open(os.path.join(self.run_dir, "slurm", "job.json"), "w") as f:
            json.dump({"slurm_job_id": "77"}, f)
        args, err = parse([], env(SLURM_RESTART_COUNT="1"), self.run_dir)  # Requeued: its own.
        self.assertIsNone(err)
        self.assertTrue(args.resume)

    def test_identity_made_once_per_job(self):
        args, _ = parse([], env(), self.run_dir)
        os.makedirs(self.run_dir)
        alloc = args.slurm_alloc
        flag = slurm.job_identity(args, self.run_dir, alloc)
        self.assertEqual(flag, ["--flagfile=" + os.path.join(self.run_dir, "job.flags")])
        with open(os.path.join(self.run_dir, "job.flags")) as f:
            first = f.read()
        with open(os.path.join(self.run_dir, "job.secret")) as f:
            secret = f.read()
        self.assertEqual(len(secret), 64)
        self.assertNotIn(secret, first)  # The flag file names the secret's file.
        self.assertRegex(first, r"--job_id=rubato-slurm-77-[0-9a-f]{16}\n")
        for name in ("job.flags", "job.secret"):
            self.assertEqual(os.stat(os.path.join(self.run_dir, name)).st_mode & 0o777, 0o600)
        slurm.job_identity(args, self.run_dir, alloc)  # A requeue: the same.
        with open(os.path.join(self.run_dir, "job.flags")) as f:
            self.assertEqual(f.read(), first)
        alloc.job_id = "78"  # Another job in the same directory: new ones.
        slurm.job_identity(args, self.run_dir, alloc)
        with open(os.path.join(self.run_dir, "job.flags")) as f:
            self.assertNotEqual(f.read(), first)
        with open(os.path.join(self.run_dir, "job.secret")) as f:
            self.assertNotEqual(f.read(), secret)
        # --insecure: no secret, but the directory still says whose it is (a requeue resumes).
        args.insecure, alloc.job_id = True, "79"
        self.assertEqual(slurm.job_identity(args, self.run_dir, alloc), ["--insecure"])
        self.assertEqual(slurm.owner(self.run_dir), "79")


class FakeJob:
    def __init__(self, run_dir):
        self.began = time.monotonic()
        self.lines = []
        self.job_log = self
        self.views = [live.WorkerView(0, os.path.join(run_dir, "worker-0.jsonl"))]

    def line(self, name, host, text):
        self.lines.append((name, host, text))


class StepTest(unittest.TestCase):

    def test_labelled_output(self):
        with tempfile.TemporaryDirectory() as tmp:
            job = FakeJob(tmp)
            workers = [slurm.SlurmTask("worker-0", programs.WORKER_PROGRAM, "n1", tmp)]
            servers = [slurm.SlurmTask("server-%d" % i, programs.SERVER_PROGRAM, "n%d" % i, tmp)
                       for i in range(2)]
            out = ('0: {"event":"start","steps":5}\n0: {"event":"done","steps":5,'
                   '"test_accuracy":0.5}\n')
            err = ('0: rubato-task: {"event":"start","step":"77.1"}\n0: rubato-task: '
                   '{"event":"exit","exit":3,"signal":null}\nsrun: error: n1: task 0: Exited\n')
            step = slurm.Step(job, "worker", workers, ["sh", "-c", "printf '%s'; printf '%s' >&2"
                                                       % (out, err)], None)
            step.popen.wait()
            step.finish()
            self.assertEqual((workers[0].step, workers[0].poll()), ("77.1", 3))
            self.assertEqual(job.views[0].done["test_accuracy"], 0.5)
            self.assertIn(("srun", "workers", "srun: error: n1: task 0: Exited"), job.lines)
            # Servers: the stats line, a restart, a stop by SIGTERM, and a task that said nothing.
            out = '1: {"event":"stats","applied_updates":4}\n'
            err = ('1: rubato-task: {"event":"restart","why":"rollback","exit":75}\n'
                   '1: rubato-task: {"event":"exit","exit":143,"signal":"SIGTERM"}\n')
            step = slurm.Step(job, "server", servers, ["sh", "-c", "printf '%s'; printf '%s' >&2;"
                                                       " exit 9" % (out, err)], None)
            for t in servers:
                t.srun = step
            step.popen.wait()
            self.assertIsNone(servers[0].rc)  # No exit line: lost once its step has ended.
            # Its poll settles the ended step: both readers done, then the lost task's status.
            self.assertEqual(servers[0].poll(), 9)
            self.assertEqual(servers[1].poll(), -15)
            self.assertEqual(servers[1].stats["applied_updates"], 4)
            self.assertEqual(servers[1].outcome(), ("stopped", "its task was sent SIGTERM "
                                                    "(killed by SIGTERM (signal 15))"))
            self.assertEqual(servers[1].record()["restarts_in_place"],
                             [{"why": "rollback", "exit_status": 75}])
            self.assertEqual(servers[0].poll(), 9)
            self.assertEqual(servers[0].outcome()[0], "FAILED")
            self.assertIn("its task ended without saying how (srun exited with status 9)",
                          servers[0].outcome()[1])


class TaskTest(unittest.TestCase):
    """rubato_task.py around a fake binary: a shell script that counts its runs in a file."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.count = os.path.join(self.tmp.name, "runs")

    def plan(self, role, script, restart_servers=0, host="n1"):
        binary = os.path.join(self.tmp.name, "fake")
        with open(binary, "w") as f:
            f.write("#!/bin/sh\necho run >> %s\necho \"$@\" >&2\n%s\n" % (self.count, script))
        os.chmod(binary, 0o755)
        path = os.path.join(self.tmp.name, "plan.json")
        with open(path, "w") as f:
            json.dump({role + "s": [{"name": "%s-0" % role, "host": host, "argv": [binary, "-a"],
                                     "local_size": 1}],
                       "env": {"X": "1"}, "restart_servers": restart_servers}, f)
        return path

    def task(self, role, plan, **extra):
        environ = dict(os.environ, SLURM_PROCID="0", SLURM_LOCALID="0", SLURMD_NODENAME="n1",
                       SLURM_JOB_ID="77", SLURM_STEP_ID="1")
        environ.update(extra)
        return subprocess.Popen([sys.executable, TASK, role, plan], env=environ,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def runs(self):
        with open(self.count) as f:
            return len(f.read().split())

    def said(self, err):
        return [json.loads(l.split(None, 1)[1]) for l in err.splitlines()
                if l.startswith("rubato-task: {")]

    def test_server_rolled_back_then_done(self):
        # Exit 75 on its first run, 0 on its second.
        plan = self.plan("server", '[ "$(wc -l < %s)" -ge 2 ] && exit 0; exit 75' % self.count)
        p = self.task("server", plan)
        _, err = p.communicate(timeout=30)
        self.assertEqual(p.returncode, 0, err)
        self.assertEqual(self.runs(), 2)
        events = self.said(err)
        self.assertEqual([e["event"] for e in events], ["start", "restart", "exit"])
        self.assertEqual((events[1]["why"], events[1]["exit"]), ("rollback", 75))
        self.assertEqual(events[0]["step"], "77.1")

    def test_server_that_died_restarted_up_to_the_limit(self):
        plan = self.plan("server", "exit 1", restart_servers=2)
        p = self.task("server", plan)
        _, err = p.communicate(timeout=30)
        self.assertEqual((p.returncode, self.runs()), (1, 3))
        self.assertEqual(self.said(err)[-1]["restarts"], 2)

    def test_worker_never_restarted_and_gets_its_local_rank(self):
        plan = self.plan("worker", 'echo "rank $LOCAL_RANK x $X" >&2; exit 3')
        p = self.task("worker", plan, SLURM_LOCALID="1")
        _, err = p.communicate(timeout=30)
        self.assertEqual((p.returncode, self.runs()), (3, 1))
        self.assertIn("-a --local_rank=1", err)
        self.assertIn("rank 1 x 1", err)

    def test_sigterm_passed_on_and_no_restart(self):
        plan = self.plan("server", 'sleep 30 & trap "kill $!; exit 143" TERM; wait',
                         restart_servers=3)
        p = self.task("server", plan)
        deadline = time.monotonic() + 20
        while not os.path.exists(self.count) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        self.assertEqual((p.returncode, self.runs()), (143, 1), err)
        self.assertEqual(self.said(err)[-1]["signal"], "SIGTERM")

    def test_errors(self):
        plan = self.plan("server", "exit 0", host="n2")
        for extra, want in [({}, "server-0 runs on node n1, but the plan puts it on n2"),
                            ({"SLURM_PROCID": "4"}, "SLURM_PROCID 4, but the plan has 1"),
                            ({"SLURM_PROCID": "x"}, "SLURM_PROCID is not a number")]:
            p = self.task("server", plan, **extra)
            _, err = p.communicate(timeout=30)
            self.assertEqual(p.returncode, 2)
            self.assertIn(want, err)
        p = self.task("server", os.path.join(self.tmp.name, "none.json"))
        _, err = p.communicate(timeout=30)
        self.assertIn("a file system that every node mounts", err)


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher_slurm_test"))
