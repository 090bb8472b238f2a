#!/usr/bin/env python3
"""Tests of deploy/launcher/summary.py: summary.json's fields and why a job failed.

    python3 deploy/launcher/summary_test.py    (or: bazel test //deploy:launcher_summary_test)
"""

import argparse
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import programs, summary  # noqa: E402
from bazel import pyunit  # noqa: E402


class HelpersTest(unittest.TestCase):

    def test_examples_drawn_follows_the_batch_changes(self):
        self.assertEqual(summary.examples_drawn(10, 16, []), 160)
        changes = [{"step": 4, "batch_size": 32}, {"step": 8, "batch_size": 64}]
        self.assertEqual(summary.examples_drawn(10, 16, changes), 4 * 16 + 4 * 32 + 2 * 64)
        self.assertEqual(summary.examples_drawn(6, 16, changes), 4 * 16 + 2 * 32)
        self.assertEqual(summary.examples_drawn(4, 16, changes), 64)  # Before the first change.
        self.assertEqual(summary.examples_drawn(0, 16, changes), 0)

    def test_noise_scale_adds_the_shards_moving_averages(self):
        def shard(step, g2, trace, batch=64, workers=4, steps=100):
            return {"noise_scale": {"shard_id": 0, "step": step, "g2_ema": g2,
                                    "trace_ema": trace, "steps": steps, "batch_small": batch,
                                    "workers": workers}}
        got = summary.noise_scale([shard(99, 1.0, 300.0), shard(99, 3.0, 500.0)])
        self.assertEqual(got, {"b_simple_ema": 200.0, "g2_ema": 4.0, "trace_ema": 800.0,
                               "step": 99, "steps_measured": 100, "b_small": 64, "b_big": 256})
        # Nothing to say: shards at different steps or batches, one without figures (async, or
        # a shard whose statistics were lost), nothing measured, or a non-positive |G|^2.
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1), shard(98, 1, 1)]))
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1), shard(99, 1, 1, batch=32)]))
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1), {"applied_updates": 3}]))
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1), None]))
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1, steps=0)]))
        self.assertIsNone(summary.noise_scale([]))
        self.assertIsNone(summary.noise_scale([shard(99, 1, 1, batch=0)]))
        self.assertIsNone(summary.noise_scale([shard(99, -1.0, 5.0)])["b_simple_ema"])


class FakeProc:
    """What the summary reads of a process."""

    def __init__(self, name, program, state, reason=None, ended_at=1.0, stats=None):
        self.name, self.program, self.host = name, program, None
        self.state, self.reason, self.ended_at, self.stats = state, reason, ended_at, stats

    def outcome(self):
        return self.state, self.reason

    def end_order(self):
        return self.ended_at, self.program != programs.SERVER_PROGRAM

    def record(self):
        return {"name": self.name, "state": self.state.lower()}


class FakeView:
    """What the summary reads of a WorkerView."""

    def __init__(self, index, evals=(), done=None, step=None, start=None, batch_changes=(),
                 started_at=None):
        self.index = index
        self.evals = [(t, acc) for t, acc, _ in evals]
        self.eval_steps = [s for _, _, s in evals]
        self.eval_epochs = [None] * len(self.evals)
        self.done, self.step, self.start = done or {}, step or {}, start or {}
        self.batch_changes = list(batch_changes)
        self.started_at = started_at


def job_args(**kwargs):
    args = argparse.Namespace(servers=1, workers=2, mode=None, target_accuracy=0.8,
                              max_message_mb="4", plan=None)
    for key, value in kwargs.items():
        setattr(args, key, value)
    return args


class FailureTest(unittest.TestCase):

    def test_failure_message(self):
        w = programs.WORKER_PROGRAM
        done = FakeProc("worker-0", w, "done")
        killed = FakeProc("worker-1", w, "FAILED", "killed by SIGKILL (signal 9)", 2.0)
        server = FakeProc("server-0", programs.SERVER_PROGRAM, "FAILED", "exited with status 2",
                          2.0)
        at = lambda p: p.name  # noqa: E731
        self.assertIsNone(summary.failure_message([], [done], 1, at))
        self.assertEqual(summary.failure_message([], [FakeProc("worker-0", w, "crashed")], 1, at),
                         "no worker finished")
        self.assertEqual(summary.failure_message([killed], [done, killed], 2, at),
                         "1 of 2 worker(s) failed: worker-1 killed by SIGKILL (signal 9)")
        failed = summary.failed_processes([done, killed, server])
        self.assertEqual([p.name for p in failed], ["server-0", "worker-1"])  # Servers first.
        self.assertEqual(summary.failure_message(failed, [done, killed], 2, at),
                         "1 of 2 worker(s) and 1 server(s) failed, first server-0 exited with "
                         "status 2; then worker-1")


class SummarizeTest(unittest.TestCase):

    def test_fields_in_order(self):
        views = [
            FakeView(0, evals=[(1.0, 0.5, 10), (2.5, 0.85, 20)],
                     done={"steps": 20, "test_accuracy": 0.85}, step={"step": 20},
                     start={"batch_size": 8}, started_at=0.25,
                     batch_changes=[{"step": 10, "batch_size": 16, "extra": 1}]),
            FakeView(1, evals=[(2.0, 0.81, 20)], done={"steps": 20, "test_accuracy": 0.86},
                     step={"step": 20}, start={"batch_size": 8}, started_at=0.3),
        ]
        stats = {"applied_updates": 40, "dropped_gradients": 2, "staleness_histogram": [3, 1]}
        workers = [FakeProc("worker-%d" % i, programs.WORKER_PROGRAM, "done") for i in range(2)]
        servers = [FakeProc("server-0", programs.SERVER_PROGRAM, "done", stats=stats)]
        got = summary.summarize(views, 4.0, job_args(), None, "run", workers, servers)
        self.assertEqual(list(got), [
            "ok", "error", "wall_s", "servers", "workers", "mode", "target_accuracy",
            "max_message_mb", "worker_outcomes", "server_outcomes", "restarted_servers",
            "failed_workers", "injected_crashes", "test_accuracy", "steps", "per_worker",
            "time_to_target_s", "steps_to_target", "epochs_to_target", "batch_changes", "evals",
            "worker_started_s", "worker_steps_per_s", "examples_per_s", "applied_updates",
            "dropped_gradients", "dropped_workers", "rejected_pushes", "refused_updates",
            "staleness_histogram",
            "mean_staleness_lower_bound"])
        self.assertEqual(got["test_accuracy"], 0.85)  # The last to finish: worker 0 at 2.5 s.
        self.assertEqual(got["time_to_target_s"], 2.0)
        self.assertEqual(got["steps_to_target"], 20)
        self.assertEqual(got["batch_changes"], [{"step": 10, "batch_size": 16,
                                                 "global_batch": None, "b_simple": None,
                                                 "learning_rate": None}])
        self.assertEqual([e["t"] for e in got["evals"]], [1.0, 2.0, 2.5])
        self.assertEqual(got["worker_started_s"], [0.25, 0.3])
        self.assertEqual(got["worker_steps_per_s"], 10.0)
        self.assertEqual(got["examples_per_s"], (10 * 8 + 10 * 16) * 2 / 4.0)
        self.assertEqual((got["applied_updates"], got["dropped_gradients"]), (40, 2))
        self.assertEqual(got["staleness_histogram"]["0"], 3)
        self.assertEqual(got["mean_staleness_lower_bound"], 0.25)

    def test_examples_count_the_steps_a_skipping_worker_computed(self):
        # Worker 1 (a straggler under backup:b or the partial all-reduce) reached step 20 but
        # computed 5 of them: it drew 5 batches, not 20.
        views = [
            FakeView(0, evals=[(2.0, 0.8, 20)], done={"steps": 20, "computed_steps": 20},
                     step={"step": 20}, start={"batch_size": 8}, started_at=0.0),
            FakeView(1, evals=[], done={"steps": 20, "computed_steps": 5},
                     step={"step": 20}, start={"batch_size": 8}, started_at=0.0),
        ]
        workers = [FakeProc("worker-%d" % i, programs.WORKER_PROGRAM, "done") for i in range(2)]
        got = summary.summarize(views, 5.0, job_args(), None, "run", workers, [])
        self.assertEqual(got["examples_per_s"], (20 + 5) * 8 / 5.0)

    def test_under_bsp_only_worker_0_evaluates(self):
        # Worker 1 finished last but, holding the same weights, evaluated nothing: the accuracy is
        # worker 0's, and both workers' done records are listed.
        views = [
            FakeView(0, evals=[(2.0, 0.84, 20)], done={"steps": 20, "test_accuracy": 0.84},
                     step={"step": 20}, start={"batch_size": 8}, started_at=0.25),
            FakeView(1, done={"steps": 20, "params_fnv1a": "ab"}, step={"step": 20},
                     start={"batch_size": 8}, started_at=0.3),
        ]
        workers = [FakeProc("worker-%d" % i, programs.WORKER_PROGRAM, "done") for i in range(2)]
        servers = [FakeProc("server-0", programs.SERVER_PROGRAM, "done", stats={})]
        got = summary.summarize(views, 4.0, job_args(), None, "run", workers, servers)
        self.assertEqual(got["test_accuracy"], 0.84)
        self.assertEqual(got["steps"], 20)
        self.assertEqual(len(got["per_worker"]), 2)

    def test_nothing_finished(self):
        got = summary.summarize([FakeView(0)], 1.0, job_args(workers=1), "boom", "run",
                                [FakeProc("worker-0", programs.WORKER_PROGRAM, "FAILED", "x")],
                                [FakeProc("server-0", programs.SERVER_PROGRAM, "stopped")])
        self.assertEqual((got["ok"], got["error"], got["failed_workers"]), (False, "boom", 1))
        self.assertNotIn("test_accuracy", got)
        self.assertIsNone(got["time_to_target_s"])
        self.assertNotIn("mean_staleness_lower_bound", got)

    def test_local_stats_and_file(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "server-1.stats.json"), "w") as f:
                json.dump({"applied_updates": 5}, f)
            servers = [FakeProc("server-0", programs.SERVER_PROGRAM, "done", stats={"a": 1}),
                       FakeProc("server-1", programs.SERVER_PROGRAM, "done"),
                       FakeProc("server-2", programs.SERVER_PROGRAM, "done")]
            summary.load_local_stats(servers, d)
            self.assertEqual([s.stats for s in servers], [{"a": 1}, {"applied_updates": 5}, None])
            summary.write_summary({"ok": True, "b": [1]}, d)
            with open(os.path.join(d, "summary.json")) as f:
                self.assertEqual(f.read(), '{\n  "ok": true,\n  "b": [\n    1\n  ]\n}\n')


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/summary_test"))
