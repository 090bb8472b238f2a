"""experiments/analysis.py on known inputs: accuracy at a time, the budget, the median band, the
straggler severity of a cell's flags, and the per-worker timeline's split into compute,
communication and waiting.

    bazel test //experiments:analysis_test
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from experiments import analysis  # noqa: E402

EVALS = [{"t": 2.0, "test_accuracy": 0.6}, {"t": 4.0, "test_accuracy": 0.7},
         {"t": 4.5, "test_accuracy": 0.65}, {"t": 9.0, "test_accuracy": 0.8}]


class AnalysisTest(unittest.TestCase):

    def test_accuracy_at_a_time_is_the_latest_evaluation_by_then(self):
        self.assertIsNone(analysis.accuracy_at(EVALS, 1.9))
        self.assertEqual(analysis.accuracy_at(EVALS, 2.0), 0.6)
        self.assertEqual(analysis.accuracy_at(EVALS, 4.2), 0.7)
        self.assertEqual(analysis.accuracy_at(EVALS, 8.9), 0.65)  # Latest, not best.
        self.assertEqual(analysis.accuracy_at(EVALS, 100), 0.8)
        self.assertEqual(analysis.accuracy_at(list(reversed(EVALS)), 5), 0.65)
        self.assertIsNone(analysis.accuracy_at([], 5))

    def test_the_budget_is_the_fastest_cells_median_wall_time(self):
        rows = [{"cell": "a", "ok": True, "wall_s": "10"}, {"cell": "a", "ok": True, "wall_s": 30},
                {"cell": "a", "ok": True, "wall_s": "12"}, {"cell": "b", "ok": True, "wall_s": 20},
                {"cell": "b", "ok": True, "wall_s": "21"}, {"cell": "c", "ok": False,
                                                           "wall_s": "1"}]
        self.assertEqual(analysis.pick_budget(rows), 12.0)  # a: median 12; b: 20.5; c failed.
        self.assertEqual(analysis.pick_budget(rows, 7), 7.0)
        self.assertIsNone(analysis.pick_budget([{"cell": "c", "ok": False, "wall_s": "1"}]))

    def test_the_band_is_the_median_and_the_extremes_of_the_runs(self):
        runs = [[{"t": 1, "test_accuracy": 0.5}, {"t": 3, "test_accuracy": 0.7}],
                [{"t": 2, "test_accuracy": 0.6}],
                [{"t": 1, "test_accuracy": 0.2}, {"t": 2, "test_accuracy": 0.9}]]
        self.assertEqual(analysis.band(runs, [0.5, 1, 2, 3]),
                         [None, (0.35, 0.2, 0.5), (0.6, 0.5, 0.9), (0.7, 0.6, 0.9)])

    def test_severity_of_a_cells_flags(self):
        self.assertEqual(analysis.severity({"slow_workers": "3:4"}), 4.0)
        self.assertEqual(analysis.severity({"slow_workers": "1:1.5,3:2", "slowdown": 9}), 2.0)
        self.assertEqual(analysis.severity({"slowdown": 3}), 3.0)
        self.assertEqual(analysis.severity({"mode": "bsp"}), 1.0)

    def test_labels_name_what_varies(self):
        cells = [("a", {"mode": "bsp", "workers": 4, "slow_workers": "3:4"}),
                 ("b", {"mode": "async", "workers": 4, "slow_workers": "3:4"}),
                 ("c", {"mode": "bsp", "workers": 4})]
        varying = analysis.varying_flags(cells)
        self.assertEqual(varying, ["mode", "slow_workers"])
        self.assertEqual(analysis.label(cells[0][1], varying, ("slow_workers",)), "bsp")
        self.assertEqual(analysis.label(cells[2][1], varying), "mode=bsp,slow_workers=-")

    def test_timeline_splits_waiting_from_communication(self):
        # Two workers, log every 10 steps. Worker 1 is the straggler: it computes 40 ms a step
        # (10 ms of it injected) and exchanges in 2 ms; worker 0 computes 10 ms and spends 32 ms
        # pulling and pushing, 30 ms of which is waiting for worker 1.
        records = {
            0: [{"step": 10, "t": 0.45, "compute_ms": 10, "delay_ms": 0, "comm_ms": 32},
                {"step": 20, "t": 0.9, "compute_ms": 10, "delay_ms": 0, "comm_ms": 32}],
            1: [{"step": 10, "t": 0.44, "compute_ms": 30, "delay_ms": 10, "comm_ms": 2},
                {"step": 20, "t": 0.88, "compute_ms": 30, "delay_ms": 10, "comm_ms": 2}],
        }
        lines = analysis.timeline(records, {0: 1.0, 1: 1.1})
        (b0, p0), (b1, p1) = lines[0]
        self.assertEqual((b0, b1), (1.0, 1.45))  # Each interval begins at the previous record.
        self.assertAlmostEqual(p0["compute"], 0.1)
        self.assertAlmostEqual(p0["communication"], 0.02)
        self.assertAlmostEqual(p0["waiting"], 0.30)
        self.assertAlmostEqual(p0["other"], 0.45 - 0.42)
        straggler = analysis.totals(lines[1])
        self.assertAlmostEqual(straggler["compute"], 0.8)
        self.assertAlmostEqual(straggler["waiting"], 0.0)
        self.assertAlmostEqual(straggler["communication"], 0.04)
        self.assertAlmostEqual(sum(straggler.values()), 0.88)
        self.assertEqual(lines[1][0][0], 1.1)

    def test_timeline_parts_never_exceed_the_interval(self):
        # Separately measured parts can add up to a little more than the interval's wall time.
        records = {0: [{"step": 5, "t": 0.1, "compute_ms": 15, "comm_ms": 6}]}
        (_, parts), = analysis.timeline(records, {0: 0.0})[0]
        self.assertAlmostEqual(sum(parts.values()), 0.1)
        self.assertEqual(parts["other"], 0)
        self.assertAlmostEqual(parts["compute"] / parts["communication"], 15 / 6)
        self.assertEqual(analysis.timeline(records, {}), {})  # Never started: no line.


if __name__ == "__main__":
    sys.exit(pyunit.main("experiments/analysis_test"))
