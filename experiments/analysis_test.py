"""experiments/analysis.py on known inputs: accuracy at a time, the budget, the median band, the
straggler severity of a cell's flags, the per-worker timeline's split into compute,
communication and waiting, and the runs of a suite that sweeps the global batch (lines per
configuration, per-cell figures, the measured noise scale).

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

    def test_updates_are_steps_in_bsp_and_every_workers_steps_in_async(self):
        evals = [{"t": 2.0, "step": 10, "test_accuracy": 0.5},
                 {"t": 4.0, "step": 20, "test_accuracy": 0.7}]
        steps = {0: [{"t": 0.5, "step": 10}, {"t": 2.5, "step": 20}],
                 1: [{"t": 1.5, "step": 10}, {"t": 3.5, "step": 20}]}
        bsp = analysis.updates_at_evals(evals, steps, [0.0, 0.0], False)
        self.assertEqual([e["updates"] for e in bsp], [10, 20])
        # Worker 1 started 1 s later: at t=2 it has logged nothing yet; at t=4, step 10.
        async_ = analysis.updates_at_evals(evals, steps, [0.0, 1.0], True)
        self.assertEqual([e["updates"] for e in async_], [10, 30])
        self.assertEqual(analysis.accuracy_at_updates(async_, 29), 0.5)
        self.assertEqual(analysis.accuracy_at_updates(async_, 30), 0.7)
        self.assertIsNone(analysis.accuracy_at_updates(async_, 9))
        self.assertTrue(analysis.per_gradient("ssp:2"))
        self.assertFalse(analysis.per_gradient("backup:1"))
        self.assertEqual(analysis.model_updates({"mode": "bsp", "steps": 705}), 705)
        self.assertEqual(analysis.model_updates(
            {"mode": "async", "steps": 705, "per_worker": [{"computed_steps": 705},
                                                          {"computed_steps": 600}]}), 1305)
        rows = [{"cell": "bsp", "ok": True, "model_updates": 705},
                {"cell": "async", "ok": True, "model_updates": "2820"},
                {"cell": "x", "ok": False, "model_updates": 5}]
        self.assertEqual(analysis.pick_update_budget(rows), 705.0)
        self.assertIsNone(analysis.pick_update_budget(rows[2:]))

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


def lr_cell(batch, recipe, workers=4):
    """A cell of a small lr-scaling suite: the batch axis sets batch_size and eval_every (tied to
    it), the recipe axis the optimizer."""
    flags = {"workers": workers, "mode": "bsp", "batch_size": batch // workers,
             "eval_every": 4096 // batch}
    flags.update({"sgd": {"optimizer": "sgd", "momentum": 0.9},
                  "lamb": {"optimizer": "lamb", "weight_decay": 0.01}}[recipe])
    return ("batch=%d,recipe=%s" % (batch, recipe), flags)


LR_CELLS = [lr_cell(b, r) for b in (64, 1024, 256) for r in ("sgd", "lamb")]


def row(cell, seed, ok="True", **values):
    out = {"cell": cell, "seed": str(seed), "ok": ok}
    out.update({k: str(v) for k, v in values.items()})
    return out


class GlobalBatchTest(unittest.TestCase):

    def test_the_global_batch_is_workers_times_batch_size(self):
        self.assertEqual(analysis.global_batch({"workers": 4, "batch_size": 16}), 64)
        self.assertEqual(analysis.global_batch({"workers": "4", "batch_size": "2048"}), 8192)
        self.assertEqual(analysis.global_batch({"workers": 8}), 512)  # batch_size 64 by default.
        self.assertEqual(analysis.global_batch({}), 128)  # 2 workers by default.

    def test_a_line_per_configuration_with_its_batches_in_order(self):
        series = analysis.batch_series(LR_CELLS)
        self.assertEqual(list(series), ["recipe=sgd", "recipe=lamb"])  # eval_every is tied too.
        self.assertEqual(series["recipe=sgd"], [(64, "batch=64,recipe=sgd"),
                                                (256, "batch=256,recipe=sgd"),
                                                (1024, "batch=1024,recipe=sgd")])  # As numbers.
        self.assertEqual([b for b, _ in series["recipe=lamb"]], [64, 256, 1024])

    def test_a_sweep_still_running_keeps_its_labels(self):
        done = [LR_CELLS[0], LR_CELLS[1], LR_CELLS[4]]  # sgd at 64 and 256, lamb at 64 only.
        self.assertEqual(analysis.batch_series(done, planned=LR_CELLS),
                         {"recipe=sgd": [(64, "batch=64,recipe=sgd"),
                                         (256, "batch=256,recipe=sgd")],
                          "recipe=lamb": [(64, "batch=64,recipe=lamb")]})
        self.assertIsNone(analysis.batch_series(LR_CELLS[:2], planned=LR_CELLS))  # Only 64 yet.
        # Alone, these two would look as if the batch named the recipe too.
        done = [LR_CELLS[0], LR_CELLS[5]]
        self.assertEqual(analysis.batch_series(done, planned=LR_CELLS),
                         {"recipe=sgd": [(64, "batch=64,recipe=sgd")],
                          "recipe=lamb": [(256, "batch=256,recipe=lamb")]})
        self.assertEqual(list(analysis.batch_series(done)), ["all"])

    def test_cells_of_one_global_batch_are_no_sweep(self):
        cells = [("bsp", {"workers": 4, "batch_size": 64, "mode": "bsp"}),
                 ("wide", {"workers": 2, "batch_size": 128, "mode": "bsp"}),
                 ("async", {"workers": 4, "batch_size": 64, "mode": "async"})]
        self.assertIsNone(analysis.batch_series(cells))
        self.assertIsNone(analysis.batch_series([("base", {})]))

    def test_labels_keep_a_cells_own_name_and_drop_what_the_batch_names(self):
        cells = [("small", {"batch_size": 16}), ("large", {"batch_size": 256})]
        self.assertEqual(analysis.batch_series(cells),
                         {"all": [(32, "small"), (512, "large")]})
        cells = [("%s,workers=%d" % (m, w), {"mode": m, "workers": w})
                 for m in ("bsp", "async") for w in (2, 8)]
        self.assertEqual(analysis.batch_series(cells),
                         {"bsp": [(128, "bsp,workers=2"), (512, "bsp,workers=8")],
                          "async": [(128, "async,workers=2"), (512, "async,workers=8")]})

    def test_per_cell_figures_count_finished_runs_and_reached_targets(self):
        series = analysis.batch_series([c for c in LR_CELLS if "=1024," not in c[0]])
        rows = [row("batch=64,recipe=sgd", 1, test_accuracy=0.86, steps_to_target=600,
                    noise_scale=276.0),
                row("batch=64,recipe=sgd", 2, test_accuracy=0.85, steps_to_target="",
                    noise_scale=""),
                row("batch=64,recipe=sgd", 3, test_accuracy=0.87, steps_to_target=400,
                    noise_scale=200.0),
                row("batch=64,recipe=sgd", 4, ok="False", test_accuracy="", noise_scale=1.0,
                    steps_to_target=5),
                row("batch=256,recipe=sgd", 1, test_accuracy=0.1, steps_to_target="",
                    noise_scale="nan"),
                row("batch=64,recipe=lamb", 1, test_accuracy=0.8, steps_to_target=900,
                    noise_scale=300)]
        grid = {(g["label"], g["batch"]): g for g in analysis.batch_grid(series, rows)}
        self.assertEqual(list(grid), [("recipe=sgd", 64), ("recipe=sgd", 256),
                                      ("recipe=lamb", 64), ("recipe=lamb", 256)])
        sgd = grid[("recipe=sgd", 64)]
        self.assertEqual((sgd["runs"], sgd["ok"]), (4, 3))
        self.assertEqual(sgd["accuracy"], [0.86, 0.85, 0.87])
        self.assertEqual(sgd["steps"], [600, 400])  # The run that never reached it is missing.
        self.assertEqual(sgd["noise"], 238.0)  # The failed run's and the blank left out.
        diverged = grid[("recipe=sgd", 256)]
        self.assertEqual((diverged["steps"], diverged["noise"]), ([], None))
        self.assertEqual(grid[("recipe=lamb", 256)]["runs"], 0)

    def test_the_noise_scale_over_the_suite_and_per_batch(self):
        flags = dict(LR_CELLS)
        reached = {"steps_to_target": 100}
        rows = [row("batch=64,recipe=sgd", 1, noise_scale=100, **reached),
                row("batch=64,recipe=lamb", 1, noise_scale=300, **reached),
                row("batch=64,recipe=lamb", 2, noise_scale=400, **reached),
                row("batch=64,recipe=lamb", 3, noise_scale="nan", **reached),
                row("batch=256,recipe=sgd", 1, noise_scale="", **reached),
                row("batch=256,recipe=lamb", 1, noise_scale="inf", **reached),
                row("batch=1024,recipe=sgd", 1, noise_scale=900, **reached),
                row("batch=1024,recipe=sgd", 2, noise_scale=1000, **reached),
                row("batch=1024,recipe=lamb", 1, noise_scale=50, **reached),
                row("batch=1024,recipe=lamb", 2, noise_scale=3, steps_to_target=""),  # diverged
                row("batch=1024,recipe=lamb", 3, ok="False", noise_scale=1e9, **reached),
                row("not-in-the-suite", 1, noise_scale=1e9, **reached)]
        noise = analysis.noise_summary(rows, flags)
        # The smallest batch's median: the runs trained furthest.
        self.assertEqual((noise["median"], noise["batch"], noise["runs"]), (300, 64, 3))
        self.assertEqual(noise["by_batch"], {64: (300, 3), 1024: (900, 3)})
        self.assertEqual((noise["low"], noise["high"]), ((64, 300), (1024, 900)))
        self.assertIsNone(analysis.noise_summary(rows[4:6], flags))
        self.assertIsNone(analysis.noise_summary([rows[9]], flags))  # Only a diverged run.
        self.assertIsNone(analysis.noise_summary([], flags))


if __name__ == "__main__":
    sys.exit(pyunit.main("experiments/analysis_test"))
