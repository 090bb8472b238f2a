"""./rubato simulate and the simulated suites end to end (experiments/simulate.py, run_suite.py
--simulate) with the real rubato_sim, and the validation table's arithmetic
(experiments/validate_sim.py) on runs made up here.

    bazel test //experiments:simulate_test
"""

import csv
import json
import os
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from experiments import (calibrate_sim, report, run_suite, sim_scale, simulate,  # noqa: E402
                         validate_sim)

DATA = "/usr/share/datasets/fashion-mnist"
BIN_DIR = ROOT if os.path.exists(os.path.join(ROOT, "sim", "rubato_sim")) else \
    os.path.join(ROOT, "bazel-bin")
# A small job: 2 workers x 30 steps, worker 1 four times slower than the 20 ms floor; a step's
# compute and an evaluation are given, so that the simulated times are known in advance.
JOB = ["--workers", "2", "--servers", "1", "--steps", "30", "--train_limit", "2000",
       "--test_limit", "500", "--eval_every", "10", "--log_every", "10", "--layers", "784-32-10",
       "--min_step_ms", "20", "--slow_workers", "1:4", "--data_dir", DATA,
       "--sim_flag=--compute_ms=1", "--sim_flag=--eval_ms=5"]


def load(path):
    with open(path) as f:
        return json.load(f)


class SimulateTest(unittest.TestCase):

    def setUp(self):
        if not os.path.isdir(DATA):
            self.skipTest("no Fashion-MNIST at %s (Debian's dataset-fashion-mnist)" % DATA)
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def simulate(self, *extra):
        run_dir = os.path.join(self.tmp.name, "run")
        rc = simulate.main(["--bin_dir", BIN_DIR, "--run_dir", run_dir, "--target_accuracy",
                            "0.5"] + JOB + list(extra))
        return rc, run_dir

    def test_bsp_job_with_a_straggler(self):
        rc, run_dir = self.simulate("--mode", "bsp")
        self.assertEqual(rc, 0)
        s = load(os.path.join(run_dir, "summary.json"))
        self.assertTrue(s["ok"], s.get("error"))
        self.assertEqual(s["simulated"]["compute_ms"], 1.0)
        # bsp waits for worker 1 every step: 30 steps of 4 x 20 ms, plus worker 0's evaluations
        # after steps 10 and 20 and its final one (5 ms each), plus transfers of microseconds.
        self.assertGreaterEqual(s["wall_s"], 30 * 0.080)
        self.assertLess(s["wall_s"], 30 * 0.080 + 3 * 0.005 + 0.05)
        self.assertEqual(s["steps"], 30)
        self.assertEqual([e["step"] for e in s["evals"]], [10, 20, 30])
        self.assertTrue(all(e["worker"] == 0 for e in s["evals"]))
        # Worker 0's step 9 starts once worker 1 has pushed step 8 (at 9 x 80 ms) and takes its
        # 20 ms floor; the record of the evaluation that follows counts from its end (5 ms later),
        # as a real worker's record arrives then.
        self.assertAlmostEqual(s["evals"][0]["t"], 9 * 0.080 + 0.020 + 0.005, delta=0.005)
        self.assertGreater(s["test_accuracy"], 0.5)
        self.assertIsNotNone(s["time_to_target_s"])
        # 30 steps x 4 tensors (two layers' weights and biases) on one shard.
        self.assertEqual(s["applied_updates"], 30 * 4)
        for w in (0, 1):
            self.assertTrue(os.path.exists(os.path.join(run_dir, "worker-%d.jsonl" % w)))

    def test_adaptive_consistency_leaves_the_straggler_behind(self):
        # adaptive:5 decides from the relayed compute times every 5 steps: bsp for steps 1-5 (at
        # worker 1's 80 ms), then backup:1 (worker 0's 20 ms, worker 1 skipping to the current
        # step).
        rc, run_dir = self.simulate("--mode", "adaptive:5")
        self.assertEqual(rc, 0)
        s = load(os.path.join(run_dir, "summary.json"))
        self.assertTrue(s["ok"], s.get("error"))
        self.assertGreaterEqual(s["wall_s"], 5 * 0.080)
        self.assertLess(s["wall_s"], 0.5 * 30 * 0.080)
        self.assertEqual(s["steps"], 30)

    def test_the_rings_run_on_the_simulated_ring(self):
        # The synchronous ring waits for worker 1 every step (30 x 80 ms); the solo ring's rounds
        # go on without it, until they have carried 2 x 30 gradients.
        rc, run_dir = self.simulate("--mode", "allreduce")
        self.assertEqual(rc, 0)
        ring = load(os.path.join(run_dir, "summary.json"))
        self.assertTrue(ring["ok"], ring.get("error"))
        self.assertGreaterEqual(ring["wall_s"], 30 * 0.080)
        self.assertLess(ring["wall_s"], 30 * 0.080 + 3 * 0.005 + 0.05)
        rc, run_dir = self.simulate("--mode", "allreduce:solo")
        self.assertEqual(rc, 0)
        solo = load(os.path.join(run_dir, "summary.json"))
        self.assertTrue(solo["ok"], solo.get("error"))
        self.assertLess(solo["wall_s"], 0.7 * ring["wall_s"])
        self.assertGreater(solo["test_accuracy"], 0.5)

    def test_modes_it_does_not_model_are_refused_by_name(self):
        rc, run_dir = self.simulate("--mode", "async", "--reassign", "true")
        self.assertEqual(rc, 2)
        s = load(os.path.join(run_dir, "summary.json"))
        self.assertFalse(s["ok"])
        self.assertIn("reassignment", s["error"])
        rc, run_dir = self.simulate("--mode", "bsp", "--crash_workers", "1:5")
        self.assertEqual(rc, 2)
        self.assertIn("crash", load(os.path.join(run_dir, "summary.json"))["error"])

    def test_a_simulated_suite_writes_what_a_real_one_does(self):
        suite = os.path.join(self.tmp.name, "tiny.yaml")
        with open(suite, "w") as f:
            f.write("name: tiny\nseeds: 2\ntarget_accuracy: 0.5\n"
                    "base: {workers: 2, steps: 20, train_limit: 2000, test_limit: 500, "
                    "eval_every: 10, log_every: 10, layers: 784-32-10, min_step_ms: 20, "
                    "timeout: 120, data_dir: %s}\n"
                    "cells:\n  - {name: bsp, mode: bsp}\n  - {name: async, mode: async}\n" % DATA)
        out = os.path.join(self.tmp.name, "out")
        rc = run_suite.main([suite, "--out", out, "--bin_dir", BIN_DIR, "--simulate",
                             "--sim_flag=--compute_ms=1", "--sim_flag=--eval_ms=5"])
        self.assertEqual(rc, 0)
        with open(os.path.join(out, "results.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(sorted((r["cell"], r["seed"]) for r in rows),
                         [("async", "1"), ("async", "2"), ("bsp", "1"), ("bsp", "2")])
        self.assertTrue(all(r["ok"] == "True" for r in rows), rows)
        self.assertTrue(load(os.path.join(out, "suite.json"))["simulated"])
        # The same job is the same simulation: the seed changes the data order, not the clock.
        bsp = [float(r["wall_s"]) for r in rows if r["cell"] == "bsp"]
        self.assertAlmostEqual(bsp[0], 20 * 0.020, delta=0.05)
        # The simulated runs beside themselves are within any tolerance.
        rows = validate_sim.compare(validate_sim.cell_runs(out), validate_sim.cell_runs(out), 0.01)
        self.assertEqual([r["cell"] for r in rows], ["async", "bsp"])
        self.assertTrue(all(r["within"] for r in rows))

    def test_a_suite_that_only_the_simulator_runs(self):
        suite = os.path.join(self.tmp.name, "sim-only.yaml")
        with open(suite, "w") as f:
            f.write("name: sim-only\nseeds: 1\ntarget_accuracy: 0.5\n"
                    "simulate: [--compute_ms=1, --eval_ms=5]\n"
                    "base: {workers: 2, steps: 20, train_limit: 2000, test_limit: 500, "
                    "eval_every: 10, log_every: 10, layers: 784-32-10, min_step_ms: 20, "
                    "data_dir: %s}\n" % DATA)
        out = os.path.join(self.tmp.name, "out")
        # No --simulate: the suite asks for the simulator, with its flags first.
        self.assertEqual(run_suite.main([suite, "--out", out, "--bin_dir", BIN_DIR]), 0)
        self.assertTrue(load(os.path.join(out, "suite.json"))["simulated"])
        with open(os.path.join(out, "results.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(len(rows), 1)
        self.assertEqual(rows[0]["ok"], "True", rows)
        self.assertAlmostEqual(float(rows[0]["wall_s"]), 20 * 0.020, delta=0.05)

    def test_calibration_from_one_real_worker(self):
        # The two real runs give their figures; whether the real model's transfers outlast the
        # tiny one's on a loaded machine is a measurement, not something a test can hold, so the
        # arithmetic is checked on given figures below.
        with tempfile.TemporaryDirectory() as tmp:
            run = calibrate_sim.one_worker(BIN_DIR, "784-256-10", 100, os.path.join(tmp, "m"),
                                           DATA, 0)
            ms = calibrate_sim.eval_ms(BIN_DIR, "784-256-10", os.path.join(tmp, "e"), DATA)
        self.assertEqual(run["parameters"], 784 * 256 + 256 + 256 * 10 + 10)
        self.assertGreaterEqual(run["records"], 1)  # Every 50 steps of 100, the first left out.
        for key in ("compute_ms", "pull_ms", "push_ms"):
            self.assertGreater(run[key], 0, key)
        self.assertGreater(ms, 0)

    def test_calibration_arithmetic(self):
        big = {"compute_ms": 2.5, "pull_ms": 1.2, "push_ms": 1.0, "parameters": 250_000}
        tiny = {"compute_ms": 0.1, "pull_ms": 0.2, "push_ms": 0.2, "parameters": 7_000}
        c = calibrate_sim.derive(big, tiny, 30.0, 0, 2)
        # L = (0.2 + 0.2) / 4 = 0.1 ms; transfer = 1.1 - 0.2 = 0.9 ms for 1e6 bytes.
        self.assertEqual(c["loopback_latency_us"], 100.0)
        self.assertEqual(c["model_bytes"], 1_000_000)
        self.assertAlmostEqual(c["loopback_gbps"], 8e6 / 0.9e-3 / 1e9, places=3)
        self.assertEqual(c["sim_flags"], ["--compute_ms=2.5", "--eval_ms=30.0",
                                          "--loopback_latency_us=100.0",
                                          "--loopback_gbps=%s" % c["loopback_gbps"], "--cores=2"])
        # A real model no slower than the tiny one: no rate, said with both runs' figures.
        with self.assertRaisesRegex(RuntimeError, r"took no longer than the tiny model's "
                                                  r"\(0.200, 0.200 ms\)"):
            calibrate_sim.derive(dict(big, pull_ms=0.2, push_ms=0.2), tiny, 30.0, 0, 2)


def fake_run(root, name, started, walls, ttt, steps):
    """A run directory as a launch leaves it: summary.json and step records (each worker's
    `steps`: (step, compute, delay, pull, push) in ms)."""
    d = os.path.join(root, "runs", name)
    os.makedirs(d)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump({"ok": True, "worker_started_s": started, "time_to_target_s": ttt,
                   "per_worker": [{"wall_s": w} for w in walls]}, f)
    for w in range(len(started)):
        with open(os.path.join(d, "worker-%d.jsonl" % w), "w") as f:
            for step, compute, delay, pull, push in steps:
                f.write(json.dumps({"event": "step", "step": step, "compute_ms": compute,
                                    "delay_ms": delay, "pull_ms": pull, "push_ms": push}) + "\n")


class SimScaleTest(unittest.TestCase):
    """experiments/sim_scale.py's quick corner with the real scale_study."""

    def test_quick_studies_and_their_report(self):
        binary = os.path.join(BIN_DIR, "sim", "scale_study")
        with tempfile.TemporaryDirectory() as out:
            try:
                sim_scale.run(binary, out, quick=True, log=lambda _: None)
            except report.ReportError as e:  # No matplotlib: the figures are still checked.
                print("sim_scale report skipped: %s" % e)
            with open(os.path.join(out, "grid.csv"), newline="") as f:
                grid = {(r["workers"], r["mode"], r["pattern"]): r for r in csv.DictReader(f)}
            with open(os.path.join(out, "shards.csv"), newline="") as f:
                shards = list(csv.DictReader(f))
        self.assertEqual(len(grid), len(sim_scale.QUICK_GRID[0][0].split(",")) * 2 * 9)

        def epoch(mode, pattern, column="epoch_s"):
            return float(grid[("16", mode, pattern)][column])
        # A worker 4x slower holds bsp and the synchronous ring to its pace (100 ms -> 400 ms of
        # compute a step); the solo ring's rounds go on without it.
        self.assertGreater(epoch("bsp", "constant"), 3 * epoch("bsp", "none"))
        self.assertGreater(epoch("allreduce", "constant"), 3 * epoch("allreduce", "none"))
        self.assertLess(epoch("allreduce:solo", "constant"), 1.2 * epoch("allreduce", "none"))
        # async's fixed shares wait for the straggler's; its rate does not.
        self.assertGreater(epoch("async", "constant"), 3 * epoch("async", "none"))
        self.assertLess(epoch("async", "constant", "rate_epoch_s"),
                        1.2 * epoch("async", "none", "rate_epoch_s"))
        # The ring's step: 100 ms of compute and 2 (N-1) / N of the model over the NIC.
        ring = [r for r in shards if r["mode"] == "allreduce" and r["model_mb"] == "100" and
                r["nic_gbps"] == "25"]
        self.assertEqual(len(ring), 1)
        self.assertAlmostEqual(float(ring[0]["step_s"]), 0.1 + 2 * 15 / 16 * 100e6 / 3.125e9,
                               delta=0.002)
        # More shards never slow bsp down here, and one shard is the slowest.
        bsp = sorted((int(r["shards"]), float(r["step_s"])) for r in shards
                     if r["mode"] == "bsp" and r["model_mb"] == "100" and r["nic_gbps"] == "25")
        self.assertEqual([k for k, _ in bsp], [1, 4, 16])
        self.assertGreater(bsp[0][1], bsp[-1][1])


class ValidateSimTest(unittest.TestCase):

    def test_figures_origin_and_ratios(self):
        with tempfile.TemporaryDirectory() as tmp:
            real, sim = os.path.join(tmp, "real"), os.path.join(tmp, "sim")
            # Real: the last worker started at 1.0 s; training took 10 and 12 s after it.
            fake_run(real, "bsp.seed-1", [0.5, 1.0], [10.2, 10.0], 6.0,
                     [(10, 2, 8, 5, 5), (20, 2, 8, 5, 5)])
            fake_run(real, "bsp.seed-2", [0.8, 1.0], [11.5, 12.0], 8.0,
                     [(10, 2, 8, 5, 5), (20, 2, 8, 5, 5)])
            # Simulated: started at 0; wall 11.5 (ratio 1.045, outside 3%), ttt 5.5 (0.917),
            # waiting 0.475 against 0.5 (0.95).
            fake_run(sim, "bsp.seed-1", [0.0, 0.0], [11.5, 11.5], 5.5,
                     [(10, 2, 8.5, 4.75, 4.75), (20, 2, 8.5, 4.75, 4.75)])
            rows = validate_sim.compare(validate_sim.cell_runs(real),
                                        validate_sim.cell_runs(sim), 0.10)
            self.assertEqual(len(rows), 1)
            r = rows[0]
            self.assertAlmostEqual(r["real_wall_s"], 11.0)
            self.assertAlmostEqual(r["real_ttt_s"], 6.0)
            self.assertAlmostEqual(r["real_waiting"], 0.5)
            self.assertAlmostEqual(r["wall_s_ratio"], 11.5 / 11.0)
            self.assertAlmostEqual(r["ttt_s_ratio"], 5.5 / 6.0)
            self.assertAlmostEqual(r["waiting_ratio"], 0.475 / 0.5)
            self.assertTrue(r["within"])
            strict = validate_sim.compare(validate_sim.cell_runs(real),
                                          validate_sim.cell_runs(sim), 0.03)
            self.assertFalse(strict[0]["within"])


if __name__ == "__main__":
    sys.exit(pyunit.main("experiments/simulate_test"))
