"""Suite files (experiments/suite.py) and confidence intervals (experiments/stats.py): every
mistake in a suite is an error naming its line, the built-in suites load and expand as their
files say, and the intervals match values computed independently for known samples.

    bazel test //experiments:suite_test
"""

import math
import os
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from bazel import pyunit  # noqa: E402
from experiments import stats, suite  # noqa: E402


class SuiteFileTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def write(self, text):
        path = os.path.join(self.tmp.name, "s.yaml")
        with open(path, "w") as f:
            f.write(textwrap.dedent(text))
        return path

    def assert_error(self, text, *fragments):
        path = self.write(text)
        with self.assertRaises(suite.SuiteError) as caught:
            suite.load(path)
        message = str(caught.exception)
        for fragment in fragments:
            self.assertIn(fragment.replace("PATH", path), message)
        return message

    def test_cells_crossed_with_axes_override_the_base_in_order(self):
        s = suite.load(self.write("""\
            name: tiny
            seeds: 2
            target_accuracy: 0.7
            base: {workers: 2, steps: 10, mode: bsp}
            cells:
              - {name: sync}
              - {name: async, mode: async}
            axes:
              slowdown: [1, 1.5]
            """))
        self.assertEqual((s.name, s.seeds, s.target_accuracy), ("tiny", 2, 0.7))
        self.assertEqual([c for c, _ in s.cells], ["sync,slowdown=1", "sync,slowdown=1.5",
                                                   "async,slowdown=1", "async,slowdown=1.5"])
        flags = dict(s.cells)["async,slowdown=1.5"]
        self.assertEqual(flags, {"workers": 2, "steps": 10, "mode": "async", "slowdown": 1.5})
        runs = s.runs()
        self.assertEqual(len(runs), 8)
        self.assertEqual(runs[0].name, "sync,slowdown=1.seed-1")
        self.assertEqual(runs[1].argv(), ["--workers", "2", "--steps", "10", "--mode", "bsp",
                                          "--slowdown", "1", "--seed", "2",
                                          "--straggler_seed", "2"])
        self.assertEqual(len(s.runs(seeds=3, only="^async")), 6)
        # --skip leaves out runs by name: here the third seed of one cell.
        kept = s.runs(seeds=3, only="^async", skip=r"slowdown=1\.5\.seed-3$")
        self.assertEqual([r.name for r in kept],
                         ["async,slowdown=1.seed-1", "async,slowdown=1.seed-2",
                          "async,slowdown=1.seed-3", "async,slowdown=1.5.seed-1",
                          "async,slowdown=1.5.seed-2"])

    def test_a_switch_is_given_only_when_true(self):
        s = suite.load(self.write("""\
            name: switches
            base: {workers: 1, oversubscribe: true, resume: false}
            """))
        self.assertEqual(s.cells, [("base", {"workers": 1, "oversubscribe": True,
                                             "resume": False})])
        self.assertEqual(s.runs(seeds=1)[0].argv(), ["--workers", "1", "--oversubscribe",
                                                     "--seed", "1", "--straggler_seed", "1"])

    def test_an_axis_of_named_flag_sets(self):
        s = suite.load(self.write("""\
            name: recipes
            base: {workers: 4}
            axes:
              batch_size: [16, 64]
              recipe:
                - {name: sgd-linear, optimizer: sgd, lr_scaling: linear}
                - {name: lamb, optimizer: lamb, learning_rate: 0.002}
            """))
        self.assertEqual([c for c, _ in s.cells],
                         ["batch_size=16,recipe=sgd-linear", "batch_size=16,recipe=lamb",
                          "batch_size=64,recipe=sgd-linear", "batch_size=64,recipe=lamb"])
        self.assertEqual(dict(s.cells)["batch_size=64,recipe=lamb"],
                         {"workers": 4, "batch_size": 64, "optimizer": "lamb",
                          "learning_rate": 0.002})
        bad = "name: x\naxes:\n  recipe:\n    - {name: a, optimizer: sgd}\n"
        self.assert_error(bad + "    - sgd\n", "PATH:5: axis 'recipe' mixes single values")
        self.assert_error(bad + "    - {optimizer: lamb}\n",
                          "PATH:5: a value of axis 'recipe' without a name")
        self.assert_error(bad + "    - {name: a, optimizer: lamb}\n",
                          "PATH:5: axis 'recipe' repeats 'a' (first on line 4)")
        self.assert_error(bad + "    - {name: b, optimiser: lamb}\n",
                          "PATH:5: 'optimiser' is not a ./rubato launch flag")
        self.assert_error("name: x\naxes:\n  Recipe:\n    - {name: a}\n",
                          "PATH:3: axis name 'Recipe'")

    def test_budget_and_timeline(self):
        s = suite.load(self.write("""\
            name: t
            budget_s: 12.5
            cells: [{name: a, mode: bsp}, {name: b, mode: async}, {name: c}, {name: d}, {name: e}]
            base: {straggler_seed: 7}
            """))
        self.assertEqual(s.budget_s, 12.5)
        self.assertEqual(s.timeline, ["a", "b", "c", "d"])  # By default the first four cells.
        self.assertEqual(s.runs(seeds=1)[0].argv()[-4:], ["--mode", "bsp", "--seed", "1"])
        s = suite.load(self.write("name: t\ncells: [{name: a}, {name: b}]\ntimeline: [b]\n"))
        self.assertEqual((s.budget_s, s.timeline), (None, ["b"]))
        self.assert_error("name: t\ncells: [{name: a}]\ntimeline: [z]\n",
                          "PATH:3: timeline: no cell 'z' (cells: a)")
        self.assert_error("name: t\ntimeline: a\n", "PATH:2: timeline must be a list")
        self.assert_error("name: t\nbudget_s: -1\n", "PATH:2: budget_s must be a number")

    def test_a_simulated_only_suite_carries_its_flags(self):
        s = suite.load(self.write("name: t\nsimulate: [--hosts=apart, --nic_gbps=25]\n"))
        self.assertEqual(s.simulate, ["--hosts=apart", "--nic_gbps=25"])
        self.assertIsNone(suite.load(self.write("name: t\n")).simulate)
        self.assert_error("name: t\nsimulate: --hosts=apart\n", "PATH:2", "must be a list")
        self.assert_error("name: t\nsimulate: [hosts]\n", "PATH:2", "'hosts' is not a flag")

    def test_every_mistake_names_its_line(self):
        self.assert_error("name: x\nbase:\n  workers: 2\n  wokers: 3\n",
                          "PATH:4: 'wokers' is not a ./rubato launch flag")
        self.assert_error("name: x\nbase: {min_step: 3}\n", "PATH:2:", "not a ./rubato launch flag")
        self.assert_error("name: x\naxes:\n  mode: bsp\n",
                          "PATH:3: axis 'mode' must be a non-empty list of values")
        self.assert_error("name: x\naxes:\n  mode: []\n", "PATH:3: axis 'mode'")
        self.assert_error("name: x\naxes:\n  mode: [bsp, async, bsp]\n",
                          "PATH:3: axis 'mode' repeats 'bsp'")
        self.assert_error("name: x\naxes:\n  modes: [bsp]\n", "PATH:3: 'modes' is not")
        self.assert_error("name: x\ncells:\n  - {mode: bsp}\n", "PATH:3: a cell without a name")
        self.assert_error("name: x\ncells:\n  - {name: a}\n  - {name: a}\n",
                          "PATH:4: cell 'a' again (first on line 3)")
        self.assert_error("name: x\nbase: {run_dir: /tmp/x}\n",
                          "PATH:2: --run_dir is set by the runner")
        self.assert_error("name: x\nbase: {seed: 3}\n", "PATH:2: --seed is set by the runner")
        self.assert_error("name: x\nbase: {oversubscribe: 3}\n",
                          "--oversubscribe is a switch: give true or false")
        self.assert_error("name: x\nbase: {workers: }\n", "PATH:2: --workers needs a value")
        self.assert_error("name: x\nbase: {workers: [1, 2]}\n",
                          "PATH:2: flag 'workers' must be a single value")
        self.assert_error("name: x\nseeds: 0\n", "PATH:2: seeds must be a whole number >= 1")
        self.assert_error("name: x\ntarget_accuracy: 80\n",
                          "PATH:2: target_accuracy must be between 0 and 1")
        self.assert_error("name: x\nbase: {}\nbase: {}\n", "PATH:3: the suite repeats 'base'")
        self.assert_error("name: x\nsteps: 3\n", "PATH:2: unknown key 'steps'")
        self.assert_error("name: Big Name\n", "PATH:1: name 'Big Name'")
        self.assert_error("base: {}\n", "PATH: no name")
        self.assert_error("name: x\nbase: [\n", "PATH:", "not YAML")
        self.assert_error("", "PATH: empty")

    def test_a_missing_suite_names_the_built_in_ones(self):
        with self.assertRaises(suite.SuiteError) as caught:
            suite.load("no-such-suite")
        self.assertIn("the built-in suites are", str(caught.exception))
        self.assertIn("stragglers", str(caught.exception))

    def test_the_built_in_suites_load(self):
        stragglers = suite.load("stragglers")
        self.assertEqual(stragglers.seeds, 3)
        names = [c for c, _ in stragglers.cells]
        self.assertEqual(names[:2], ["bsp-no-straggler", "allreduce-no-straggler"])
        for mode in ("bsp", "backup-1", "ssp-1", "ssp-2", "ssp-8", "async",
                     "async-staleness-aware", "allreduce", "adaptive"):
            self.assertIn(mode, names)
            self.assertEqual(dict(stragglers.cells)[mode]["slow_workers"], "3:4")
        self.assertEqual(dict(stragglers.cells)["bsp"]["workers"], 4)
        self.assertEqual(stragglers.timeline, ["bsp", "backup-1", "ssp-2", "async", "allreduce"])
        severity = suite.load("severity")
        self.assertEqual(len(severity.cells), 8 * 5)
        delays = suite.load("random-delays")
        self.assertEqual(len(delays.cells), 5 * 3)
        self.assertEqual({f["delay_distribution"] for _, f in delays.cells},
                         {"exponential", "lognormal", "pareto"})
        crash = suite.load("crash")
        self.assertTrue(all(f["crash_workers"] == "3:250" for _, f in crash.cells))
        scaling = suite.load("scaling")
        self.assertEqual(sorted({f["workers"] for _, f in scaling.cells}), [1, 2, 4, 8])
        study = suite.load("lr-scaling")
        self.assertEqual(len(study.cells), 5 * 6)
        globals_ = {f["workers"] * f["batch_size"] for _, f in study.cells}
        self.assertEqual(sorted(globals_), [64, 256, 1024, 4096, 8192])
        self.assertEqual({f["optimizer"] for _, f in study.cells},
                         {"sgd", "lars", "larc", "lamb"})
        patterns = suite.load("patterns")
        self.assertEqual(len(patterns.cells), 9 * 7)  # Modes x patterns (none included).
        reassign = dict(patterns.cells)["mode=reassign,pattern=constant-x4"]
        self.assertEqual((reassign["mode"], reassign["reassign"]), ("async", "true"))
        rotating = dict(patterns.cells)["mode=bsp,pattern=rotating"]
        self.assertEqual((rotating["slowdown"], rotating["rotate_slow"],
                          rotating["slow_period_steps"]), (4, "true", 60))
        self.assertNotIn("slow_workers", dict(patterns.cells)["mode=async,pattern=none"])
        for s in (stragglers, severity, delays, crash, scaling, study, patterns):
            self.assertGreaterEqual(s.seeds, 3, s.name)


class StatsTest(unittest.TestCase):

    def test_t_quantiles(self):
        # Known values of t_{0.975, df}.
        self.assertAlmostEqual(stats.t975(1), 12.7062, places=4)
        self.assertAlmostEqual(stats.t975(2), 4.3027, places=4)
        self.assertAlmostEqual(stats.t975(10), 2.2281, places=4)
        self.assertAlmostEqual(stats.t975(31), 2.03951, places=5)
        self.assertAlmostEqual(stats.t975(60), 2.0003, places=3)
        self.assertAlmostEqual(stats.t975(120), 1.9799, places=3)
        self.assertAlmostEqual(stats.t975(10 ** 9), 1.96, places=3)
        with self.assertRaises(ValueError):
            stats.t975(0)

    def test_intervals_of_known_samples(self):
        # 1..5: mean 3, s = sqrt(2.5), t(4) = 2.776445: 3 +- 1.963243.
        lo, hi = stats.ci95([1, 2, 3, 4, 5])
        self.assertAlmostEqual(lo, 3 - 1.963243, places=5)
        self.assertAlmostEqual(hi, 3 + 1.963243, places=5)
        # Three accuracies: mean 0.813333, s = 0.015275, t(2) = 4.302653: +- 0.037945.
        lo, hi = stats.ci95([0.81, 0.80, 0.83])
        self.assertAlmostEqual((lo + hi) / 2, 0.813333, places=5)
        self.assertAlmostEqual((hi - lo) / 2, 0.037945, places=5)
        # Identical values: no spread; one value: no interval.
        self.assertEqual(stats.ci95([2.5, 2.5, 2.5]), (2.5, 2.5))
        self.assertEqual(stats.ci95([7.0]), (7.0, 7.0))
        self.assertAlmostEqual(stats.stdev([2, 4, 4, 4, 5, 5, 7, 9]), math.sqrt(32 / 7))
        with self.assertRaises(ValueError):
            stats.mean([])


if __name__ == "__main__":
    sys.exit(pyunit.main("experiments/suite_test"))
