"""Tests of experiments/step_overhead.py's reading of the workers' step records and of
model_benchmark's output, on hand-made files."""

import contextlib
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import step_overhead  # noqa: E402


def step(steps_per_s, compute, push, busy, hidden, pull=0):
    return json.dumps({"event": "step", "worker": 0, "steps_per_s": steps_per_s,
                       "compute_ms": compute, "pull_ms": pull, "push_ms": push,
                       "push_busy_ms": busy, "hidden_fraction": hidden})


class StepOverheadTest(unittest.TestCase):

    def test_means_leave_out_each_workers_first_interval(self):
        with tempfile.TemporaryDirectory() as run:
            for w, lines in enumerate([
                    [step(1, 900, 900, 900, 0), step(20, 40, 5, 10, 0.5, pull=3),
                     step(25, 38, 1, 6, 0.9)],
                    [step(2, 900, 900, 900, 0, pull=50), step(10, 80, 9, 12, 0.1, pull=6)]]):
                with open(os.path.join(run, "worker-%d.jsonl" % w), "w") as f:
                    f.write("\n".join(lines + ['{"event":"done"}', "not json"]) + "\n")
            m = step_overhead.step_means(run)
        # Steps of 50, 40 and 100 ms; the rest are plain means of the three records.
        self.assertAlmostEqual(m["step_ms"], (50 + 40 + 100) / 3)
        self.assertAlmostEqual(m["compute_ms"], (40 + 38 + 80) / 3)
        self.assertAlmostEqual(m["pull_ms"], 3.0)
        self.assertAlmostEqual(m["push_ms"], 5.0)
        self.assertAlmostEqual(m["busy_ms"], (10 + 6 + 12) / 3)
        self.assertAlmostEqual(m["hidden"], 0.5)

    def test_a_run_without_step_records_is_an_error_naming_it(self):
        with tempfile.TemporaryDirectory() as run:
            with open(os.path.join(run, "worker-0.jsonl"), "w") as f:
                f.write(step(1, 1, 1, 1, 0) + "\n")  # only the first interval
            with self.assertRaises(SystemExit) as e:
                step_overhead.step_means(run)
            self.assertIn(run, str(e.exception))

    def test_first_layer_wait(self):
        def overlap(*pushes):
            return json.dumps({"event": "overlap", "worker": 0, "step": 1, "pushes": [
                {"layer": name, "start_ms": s, "ack_ms": s, "pulled_ms": p}
                for name, s, p in pushes]})
        with tempfile.TemporaryDirectory() as run:
            with open(os.path.join(run, "worker-0.jsonl"), "w") as f:
                f.write("\n".join([
                    overlap(("dense1", 20, 27), ("conv1", 60, 63)),    # conv1 last: no gain
                    overlap(("dense1", 20, 70), ("conv1", 60, 66)),    # 4 ms sooner at most
                    overlap(("all", 0, 5)),                            # one push: not counted
                    step(1, 1, 1, 1, 0)]) + "\n")
            with open(os.path.join(run, "worker-1.jsonl"), "w") as f:
                f.write(overlap(("conv1", 50, 51), ("dense1", 10, 40)) + "\n")
            n, last, gain = step_overhead.first_layer_wait(run)
        self.assertEqual((n, last), (3, 2))
        self.assertAlmostEqual(gain, 4.0 / 3)

    def test_summarize_prints_the_means_and_the_first_layer_line(self):
        with tempfile.TemporaryDirectory() as run:
            with open(os.path.join(run, "worker-0.jsonl"), "w") as f:
                f.write("\n".join([step(1, 900, 900, 900, 0), step(20, 40, 5, 10, 0.5, pull=2.5),
                                   json.dumps({"event": "overlap", "pushes": [
                                       {"start_ms": 1, "pulled_ms": 9},
                                       {"start_ms": 5, "pulled_ms": 7}]})]) + "\n")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                step_overhead.summarize(run)
        self.assertEqual(out.getvalue().splitlines(), [
            "step 50.00 ms, compute 40.00 ms, pull wait 2.50 ms, push wait 5.00 ms, in flight "
            "10.00 ms, hidden 0.50",
            "this run: the first layer's weights came last in 0 of 1 sampled steps; a forward "
            "waiting layer by layer could have started 2.000 ms sooner on average"])

    def test_benchmark_step_time(self):
        out = ("model cnn, 454922 parameters, batch 64\n\n"
               "backend cpu-eigen avx2+fma: step 58.312 ms (1098 examples/s)\n"
               "  layer  fwd ms\n")
        self.assertEqual(step_overhead.benchmark_step_ms(out), 58.312)
        with self.assertRaises(SystemExit):
            step_overhead.benchmark_step_ms("backend cuda: skipped: no device\n")


if __name__ == "__main__":
    unittest.main()
