#!/usr/bin/env python3
"""Rubato on a real Slurm: deploy/slurm/rubato.sbatch submitted with sbatch to a controller and
three slurmd hosts, each a network namespace (tests/slurm_cluster.py), with the real binaries.

    bazel test //tests:slurm_test        (root and Debian's slurm packages; it skips, naming
                                          why, without them)

Every job trains the default MLP on the first 6000 Fashion-MNIST training images and tests on the
first 2000 (as tests/multihost_test does), with 4 workers for 6 epochs (STEPS): 0.78 measured
here (0.74 with a worker lost at step 15), about 0.1 untrained; ACCURACY is 0.70. Each job must
end COMPLETED with exit code 0:0 and an ok summary.

  - test_parameter_servers: 2 shards and 4 workers (6 tasks on 3 nodes), bsp; worker 3 crashes at
    step 15 (an injected crash: its task exits 3), the step goes on and the others finish.
  - test_shard_restarted_in_the_allocation: the same job with checkpoints every 10 steps (and
    steps of at least 50 ms, so that it still runs then); once the workers pass step 35 shard 1's rubato_server is killed (SIGKILL): its task starts it again
    from its checkpoint (--restart_servers 1), the workers roll shard 0 back to that step, and
    its exit 75 its own task restarts.
  - test_allreduce: 4 ranks (4 tasks), the synchronous ring.
  - test_cancel_requeue_and_time_limit: scancel mid-job (the attempt's summary says
    interrupted, every task stopped by SIGTERM, checkpoints on disk), `scontrol requeue`: the job
    resumes from its checkpoints (its first step past 10); then SIGUSR1 to the batch script (what
    `--signal=B:USR1@120` sends before the time limit): the launcher stops the job and requeues it
    itself; the third attempt completes, with the weights of the same job never stopped
    (bit-identical: bsp resumes from a consistent checkpoint).
"""

import glob
import json
import os
import shutil
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from tests import slurm_cluster  # noqa: E402
from tests.binaries import BIN_DIR, check_final_records, read_jsonl  # noqa: E402

SBATCH = os.path.join(ROOT, "deploy", "slurm", "rubato.sbatch")
DATA = "/usr/share/datasets/fashion-mnist"
ACCURACY = 0.70
JOB = ["--train_limit", "6000", "--test_limit", "2000", "--log_every", "1", "--data_dir", DATA,
       "--lease_ms", "3000", "--timeout", "400"]
JOB_TIMEOUT = 420
# 6 epochs of a worker's 1500 examples at batch 64: 24 steps each, the last one short.
STEPS = 144


def command_lines():
    """{pid: argv} of every process now."""
    out = {}
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(d, "cmdline"), "rb") as f:
                out[int(os.path.basename(d))] = f.read().decode("utf-8", "replace").split("\0")
        except OSError:
            continue
    return out


def job_processes(run_dir, program):
    """{pid: argv} of the job's `program` processes (their flags name `run_dir`)."""
    return {pid: argv for pid, argv in command_lines().items()
            if argv[0].endswith(program) and any(run_dir in a for a in argv)}


def newest_step(path):
    steps = [r.get("step", 0) for r in read_jsonl(path) if r.get("event") == "step"]
    return max(steps) if steps else 0


class SlurmTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.skip = slurm_cluster.skip_reason()
        if cls.skip:
            return
        if not os.path.isdir(DATA):
            cls.skip = "no Fashion-MNIST at %s (Debian's dataset-fashion-mnist)" % DATA
            return
        cls.tmp = tempfile.mkdtemp(prefix="slurm-")
        cls.cluster = slurm_cluster.SlurmCluster(cls.tmp, ["h0", "h1", "h2"])
        cls.jobs = 0

    @classmethod
    def tearDownClass(cls):
        if not cls.skip:
            cls.cluster.close()
            if os.environ.get("RUBATO_KEEP_TMP"):  # Logs and run directories, to look into.
                print("kept %s" % cls.tmp)
            else:
                shutil.rmtree(cls.tmp, ignore_errors=True)

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)

    def submit(self, ntasks, flags):
        """Submits the sbatch script on 3 nodes with `ntasks` tasks; returns (job id, run dir,
        batch output file)."""
        type(self).jobs += 1
        run_dir = os.path.join(self.tmp, "run-%d" % self.jobs)
        out = os.path.join(self.tmp, "batch-%d.out" % self.jobs)
        os.environ.update(RUBATO_DIR=ROOT, RUBATO_BIN_DIR=BIN_DIR)
        self.cluster.env.update(RUBATO_DIR=ROOT, RUBATO_BIN_DIR=BIN_DIR)
        job = self.cluster.sbatch(["--nodes=3", "--ntasks=%d" % ntasks, "--output=" + out],
                                  SBATCH, ["--run_dir", run_dir] + JOB + flags, chdir=self.tmp)
        return job, run_dir, out

    def explain(self, run_dir, out):
        """The batch output's tail and each process log's, for a failure message."""
        text = "\n== batch output\n" + self.cluster.tail(out, 40)
        for log in sorted(glob.glob(os.path.join(run_dir, "attempt-*", "*.log"))):
            if not log.endswith("job.log"):
                text += "\n== %s\n%s" % (log, self.cluster.tail(log, 12))
        return text + "\n== slurmctld.log\n" + self.cluster.tail("slurmctld.log", 10)

    def wait_done(self, job, run_dir, out, attempt=0):
        """Waits for the job to complete; returns the attempt's summary once checked."""
        try:
            fields = self.cluster.wait(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                             "NODE_FAIL"), JOB_TIMEOUT)
        except slurm_cluster.SlurmError as e:
            self.fail("%s%s" % (e, self.explain(run_dir, out)))
        self.assertEqual((fields["JobState"], fields["ExitCode"]), ("COMPLETED", "0:0"),
                         self.explain(run_dir, out))
        attempt_dir = os.path.join(run_dir, "attempt-%d" % attempt)
        with open(os.path.join(attempt_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertTrue(summary["ok"], summary.get("error"))
        self.assertGreater(summary["test_accuracy"], ACCURACY)
        self.assertEqual(summary["slurm"]["job_id"], job)
        self.assertEqual(summary["slurm"]["restart_count"], attempt)
        print("\n%s: job %s, attempt %d: test accuracy %.4f, %.1f s wall, %d steps" % (
            self.id().rsplit(".", 1)[1], job, attempt, summary["test_accuracy"],
            summary["wall_s"], summary["steps"]), flush=True)
        return summary, attempt_dir

    def wait_for(self, what, ready, timeout, job, run_dir, out):
        """Waits for `ready()`, while `job` runs (None: whatever its state); fails when it ends
        first or at `timeout`."""
        deadline = time.monotonic() + timeout
        asked = 0.0
        while time.monotonic() < deadline:
            if ready():
                return
            if job is not None and time.monotonic() - asked > 2:
                asked = time.monotonic()
                state = self.cluster.job(job).get("JobState")
                if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                    self.fail("job %s is %s, waiting for %s%s" % (
                        job, state, what, self.explain(run_dir, out)))
            time.sleep(0.2)
        self.fail("%s not within %d s%s" % (what, timeout, self.explain(run_dir, out)))

    def test_parameter_servers(self):
        job, run_dir, out = self.submit(6, [
            "--servers", "2", "--workers", "4", "--mode", "bsp", "--epochs", "6",
            "--crash_workers", "3:15"])
        summary, attempt = self.wait_done(job, run_dir, out)
        outcomes = {o["name"]: o for o in summary["worker_outcomes"] + summary["server_outcomes"]}
        # Worker 3's task exited 3 at step 15; the step went on, and the servers dropped it.
        self.assertEqual([outcomes["worker-%d" % w]["state"] for w in range(4)],
                         ["done", "done", "done", "crashed"])
        self.assertEqual(outcomes["worker-3"]["exit_status"], 3)
        self.assertEqual([outcomes["server-%d" % s]["state"] for s in range(2)], ["done", "done"])
        self.assertEqual(summary["steps"], STEPS)  # The others went on to the end.
        # Placement from the allocation: servers round-robin, workers in the slots left.
        nodes = self.cluster.nodes
        self.assertEqual([outcomes["server-%d" % s]["host"] for s in range(2)], nodes[:2])
        self.assertEqual(sorted({o["host"] for o in summary["worker_outcomes"]} |
                                {o["host"] for o in summary["server_outcomes"]}), sorted(nodes))
        finals = [[r for r in read_jsonl(os.path.join(attempt, "worker-%d.jsonl" % w))
                   if r.get("event") == "done"][0] for w in range(3)]
        check_final_records(self, "bsp", finals, ACCURACY)
        # The secret stays in its file: no command line of the job names it.
        with open(os.path.join(run_dir, "job.secret")) as f:
            secret = f.read().strip()
        with open(os.path.join(run_dir, "slurm", "plan.json")) as f:
            plan = f.read()
        self.assertNotIn(secret, plan)
        self.assertIn("--flagfile=" + os.path.join(run_dir, "job.flags"), plan)
        self.assertEqual(os.stat(os.path.join(run_dir, "job.secret")).st_mode & 0o777, 0o600)

    def test_shard_restarted_in_the_allocation(self):
        job, run_dir, out = self.submit(6, [
            "--servers", "2", "--workers", "4", "--mode", "bsp", "--epochs", "6",
            "--checkpoint_every_steps", "10", "--restart_servers", "1", "--min_step_ms", "50"])
        worker0 = os.path.join(run_dir, "attempt-0", "worker-0.jsonl")
        self.wait_for("worker 0 at step 35", lambda: newest_step(worker0) >= 35, 240, job,
                      run_dir, out)
        # No command line anywhere holds the job's secret; each worker's --local_rank is its
        # SLURM_LOCALID, its place among the workers on its node.
        with open(os.path.join(run_dir, "job.secret")) as f:
            secret = f.read().strip()
        for pid, argv in command_lines().items():
            self.assertNotIn(secret, " ".join(argv), "pid %d" % pid)
        with open(os.path.join(run_dir, "slurm", "plan.json")) as f:
            hosts = [w["host"] for w in json.load(f)["workers"]]
        ranks = {}
        for argv in job_processes(run_dir, "rubato_worker").values():
            ranks[argv[1]] = [a for a in argv if a.startswith("--local_rank=")]
        self.assertEqual(ranks, {"--worker_id=%d" % w: ["--local_rank=%d" % hosts[:w].count(h)]
                                 for w, h in enumerate(hosts)})
        pids = [pid for pid, argv in job_processes(run_dir, "rubato_server").items()
                if "--shard_id=1" in argv]
        self.assertEqual(len(pids), 1, "shard 1's rubato_server: %s" % pids)
        os.kill(pids[0], 9)
        summary, attempt = self.wait_done(job, run_dir, out)
        outcomes = {o["name"]: o for o in summary["server_outcomes"]}
        self.assertEqual([o["state"] for o in summary["worker_outcomes"]], ["done"] * 4)
        self.assertEqual([outcomes["server-%d" % s]["state"] for s in range(2)], ["done", "done"])
        # Shard 1 died (SIGKILL) and its task started it again from its checkpoint; the workers
        # rolled shard 0 back to that step (exit 75), and its task started it again too.
        self.assertEqual(outcomes["server-1"]["restarts_in_place"][0],
                         {"why": "died", "exit_status": -9})
        self.assertIn({"why": "rollback", "exit_status": 75},
                      outcomes["server-0"]["restarts_in_place"])
        finals = [[r for r in read_jsonl(os.path.join(attempt, "worker-%d.jsonl" % w))
                   if r.get("event") == "done"][0] for w in range(4)]
        check_final_records(self, "bsp", finals, ACCURACY)

    def test_allreduce(self):
        job, run_dir, out = self.submit(4, ["--mode", "allreduce", "--workers", "4",
                                            "--epochs", "6"])
        summary, _ = self.wait_done(job, run_dir, out)
        self.assertEqual(summary["servers"], 0)
        self.assertEqual([o["state"] for o in summary["worker_outcomes"]], ["done"] * 4)
        self.assertEqual(summary["server_outcomes"], [])

    def test_cancel_requeue_and_time_limit(self):
        # Steps of at least 50 ms (a sleep; the arithmetic is unchanged), so that the job is
        # still running when the signals come: 144 steps take 7 s or more an attempt.
        flags = ["--servers", "2", "--workers", "4", "--mode", "bsp", "--epochs", "6",
                 "--checkpoint_every_steps", "10", "--min_step_ms", "50"]
        job, run_dir, out = self.submit(6, flags)
        checkpoints = os.path.join(run_dir, "checkpoints")

        def at_step(attempt, step):
            path = os.path.join(run_dir, "attempt-%d" % attempt, "worker-0.jsonl")
            return lambda: newest_step(path) >= step and len(
                glob.glob(os.path.join(checkpoints, "shard-*-step-*.ckpt"))) >= 2

        # scancel mid-job: every task and the launcher get SIGTERM.
        self.wait_for("worker 0 at step 30", at_step(0, 30), 240, job, run_dir, out)
        self.cluster.command(["scancel", job])
        fields = self.cluster.wait(job, ("CANCELLED",), 60)
        first = os.path.join(run_dir, "attempt-0", "summary.json")
        self.wait_for("attempt 0's summary", lambda: os.path.exists(first), 60, None, run_dir,
                      out)
        with open(first) as f:
            summary = json.load(f)
        self.assertFalse(summary["ok"])
        self.assertIn("interrupted", summary["error"])
        for o in summary["worker_outcomes"] + summary["server_outcomes"]:
            self.assertEqual(o["state"], "stopped", o)
        for o in summary["server_outcomes"]:  # Each shard stopped by SIGTERM, in order.
            self.assertEqual(o["exit_status"], -15, o)
        self.assertTrue(glob.glob(os.path.join(checkpoints, "shard-1-step-*.ckpt")))

        # Requeued: the same run directory, resumed from the checkpoints.
        self.cluster.requeue(job)
        self.wait_for("attempt 1 at step 60", at_step(1, 60), 240, job, run_dir, out)
        steps = [r["step"] for r in read_jsonl(os.path.join(run_dir, "attempt-1",
                                                            "worker-0.jsonl"))
                 if r.get("event") == "step"]
        self.assertGreater(steps[0], 10, "attempt 1 did not resume from a checkpoint")

        # SIGUSR1 to the batch script, as --signal=B:USR1@120 sends before the time limit: the
        # launcher stops the job and requeues it.
        self.cluster.command(["scancel", "--batch", "--signal=USR1", job])
        second = os.path.join(run_dir, "attempt-1", "summary.json")
        self.wait_for("attempt 1's summary", lambda: os.path.exists(second), 90, None, run_dir,
                      out)
        with open(second) as f:
            summary = json.load(f)
        self.assertIn("SIGUSR1", summary["error"])
        for o in summary["worker_outcomes"] + summary["server_outcomes"]:
            self.assertEqual(o["state"], "stopped", o)
        self.cluster.start_now(job)
        summary, attempt = self.wait_done(job, run_dir, out, attempt=2)
        self.assertEqual(int(fields.get("Restarts", 0)), 0)
        self.assertEqual(int(self.cluster.job(job)["Restarts"]), 2)
        self.assertEqual(summary["steps"], STEPS)
        # bsp resumed from a consistent checkpoint twice: the weights of a job never stopped.
        plain, plain_dir, plain_out = self.submit(6, flags)
        self.wait_done(plain, plain_dir, plain_out)
        done = [[r for r in read_jsonl(os.path.join(d, "worker-0.jsonl"))
                 if r.get("event") == "done"][0] for d in (attempt, os.path.join(plain_dir,
                                                                               "attempt-0"))]
        self.assertEqual(done[0]["params_fnv1a"], done[1]["params_fnv1a"])
        self.assertEqual(done[0]["test_accuracy"], done[1]["test_accuracy"])


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/slurm_test"))
