"""./rubato experiment end to end (experiments/run_suite.py) on a tiny suite with the real
binaries: 2 cells x 2 seeds of a few steps, plus a cell whose runs fail. Its CSVs have the expected
rows, a failed run is recorded and the sweep goes on, its plots are valid PNG and SVG files that
report.html links (report.md links the PNGs only), and running it again into the same directory
reruns nothing (an interrupted sweep resumes).

    bazel test //experiments:run_suite_test
"""

import csv
import json
import os
import re
import struct
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ElementTree
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from experiments import run_suite  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
BIN_DIR = ROOT if os.path.exists(os.path.join(ROOT, "server", "rubato_server")) else \
    os.path.join(ROOT, "bazel-bin")

TINY = """\
name: tiny
seeds: 2
target_accuracy: 0.5
base: {workers: 2, steps: 20, train_limit: 2000, test_limit: 500, eval_every: 10,
       log_every: 10, layers: 784-32-10, timeout: 120, data_dir: %s}
cells:
  - {name: bsp, mode: bsp}
  - {name: async, mode: async}
  - {name: broken, mode: bsp, layers: 784-0-10}
"""


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def png_size(path):
    """(width, height) of a well-formed PNG: its signature, every chunk's CRC, IHDR first and
    IEND last. Raises ValueError naming what is wrong otherwise."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("%s: not a PNG signature" % path)
    at, kinds, size = 8, [], None
    while at < len(data):
        if at + 12 > len(data):
            raise ValueError("%s: truncated chunk at byte %d" % (path, at))
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        crc, = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        if len(body) != length or zlib.crc32(kind + body) != crc:
            raise ValueError("%s: chunk %r at byte %d is damaged" % (path, kind, at))
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        kinds.append(kind)
        at += 12 + length
    if not kinds or kinds[0] != b"IHDR" or kinds[-1] != b"IEND" or b"IDAT" not in kinds:
        raise ValueError("%s: chunks %r" % (path, kinds))
    return size


class RunSuiteTest(unittest.TestCase):

    def setUp(self):
        if not os.path.isdir(DATA):
            self.skipTest("no Fashion-MNIST at %s (Debian's dataset-fashion-mnist)" % DATA)
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.suite = os.path.join(self.tmp.name, "tiny.yaml")
        with open(self.suite, "w") as f:
            f.write(TINY % DATA)
        self.out = os.path.join(self.tmp.name, "out")

    def run_suite(self, *extra):
        return run_suite.main([self.suite, "--out", self.out, "--bin_dir", BIN_DIR] + list(extra))

    def test_a_tiny_suite_end_to_end_and_resumed(self):
        self.assertEqual(self.run_suite(), 0)
        rows = read(os.path.join(self.out, "results.csv"))
        self.assertEqual([(r["cell"], r["seed"]) for r in rows],
                         [("bsp", "1"), ("bsp", "2"), ("async", "1"), ("async", "2"),
                          ("broken", "1"), ("broken", "2")])
        for r in rows[:4]:
            self.assertEqual(r["ok"], "True", r)
            self.assertGreater(float(r["test_accuracy"]), 0.3, r)  # 20 steps: well above 0.1
            self.assertGreater(float(r["applied_updates"]), 0, r)
            self.assertNotEqual(r["cpu_busy"], "", r)
        for r in rows[4:]:
            self.assertEqual(r["ok"], "False", r)
            self.assertNotEqual(r["error"], "", r)
        summary = {r["cell"]: r for r in read(os.path.join(self.out, "summary.csv"))}
        self.assertEqual(list(summary), ["bsp", "async", "broken"])
        bsp = summary["bsp"]
        self.assertEqual((bsp["runs"], bsp["failed"], bsp["test_accuracy_n"]), ("2", "0", "2"))
        mean = (float(rows[0]["test_accuracy"]) + float(rows[1]["test_accuracy"])) / 2
        self.assertAlmostEqual(float(bsp["test_accuracy_mean"]), mean, places=4)
        self.assertLessEqual(float(bsp["test_accuracy_ci95_lo"]), mean)
        self.assertGreaterEqual(float(bsp["test_accuracy_ci95_hi"]), mean)
        self.assertEqual((summary["broken"]["failed"], summary["broken"]["test_accuracy_n"]),
                         ("2", "0"))
        for r in rows:
            name = "%s.seed-%s" % (r["cell"], r["seed"])
            self.assertTrue(os.path.exists(os.path.join(self.out, "runs", name + ".log")), name)
            if r["ok"] == "True":
                self.assertTrue(os.path.exists(os.path.join(self.out, "runs", name,
                                                            "summary.json")), name)
        with open(os.path.join(self.out, "runs", "broken.seed-1.log")) as f:
            self.assertIn("784-0-10", f.read())  # The launcher's own error, kept.
        # Accuracy at an equal budget: the fastest cell's median wall time, for every finished run.
        budget = float(rows[0]["budget_s"])
        medians = [(float(rows[k]["wall_s"]) + float(rows[k + 1]["wall_s"])) / 2 for k in (0, 2)]
        # Two runs: their mean, which results.csv rounds to 3 decimals (2.1275 may be written
        # 2.127 or 2.128), so within half a unit of the last place.
        self.assertLessEqual(abs(budget - min(medians)), 0.0005 + 1e-9)
        for r in rows[:4]:
            self.assertEqual(float(r["budget_s"]), budget, r)
            if float(r["wall_s"]) <= budget:  # Finished by then: its last evaluation counts.
                self.assertEqual(r["accuracy_at_budget"], r["test_accuracy"], r)
        self.assertNotEqual(summary["bsp"]["accuracy_at_budget_n"], "0")
        self.check_report()

        # Again into the same directory: every finished run is kept, none is run again, except
        # one whose launcher was interrupted (as a killed sweep leaves its last run).
        logs = {n: os.path.getmtime(os.path.join(self.out, "runs", n + ".log"))
                for n in ("bsp.seed-1", "async.seed-2")}
        interrupted = os.path.join(self.out, "runs", "async.seed-1", "summary.json")
        with open(interrupted, "w") as f:
            json.dump({"ok": False, "error": "interrupted"}, f)
        self.assertEqual(self.run_suite("--only", "^(bsp|async)$"), 0)
        for name, mtime in logs.items():
            self.assertEqual(os.path.getmtime(os.path.join(self.out, "runs", name + ".log")),
                             mtime, name + " was run again")
        with open(interrupted) as f:
            self.assertTrue(json.load(f)["ok"], "the interrupted run was not run again")
        self.assertEqual(len(read(os.path.join(self.out, "results.csv"))), 4)

    def check_report(self):
        plots = os.path.join(self.out, "plots")
        names = sorted(n[:-4] for n in os.listdir(plots) if n.endswith(".png"))
        for expected in ("accuracy_vs_time", "time_to_target", "throughput", "staleness",
                         "timeline"):
            self.assertIn(expected, names)
        for name in names:
            width, height = png_size(os.path.join(plots, name + ".png"))
            self.assertGreater(min(width, height), 100, name)
            root = ElementTree.parse(os.path.join(plots, name + ".svg")).getroot()
            self.assertTrue(root.tag.endswith("svg"), name)
        with open(os.path.join(self.out, "report.md")) as f:
            md = f.read()
        with open(os.path.join(self.out, "report.html")) as f:
            page = f.read()
        ElementTree.fromstring(page.split("\n", 1)[1])  # Well-formed, past <!DOCTYPE html>.
        for name in names:
            self.assertIn("](plots/%s.png)" % name, md)
            self.assertNotIn("(plots/%s.svg)" % name, md)  # PNGs only: results keep no SVGs.
            self.assertIn('<img src="plots/%s.png"' % name, page)
            self.assertIn('<a href="plots/%s.svg">' % name, page)
        # Every image the report names exists.
        for link in re.findall(r"plots/[^)\"]+", md + page):
            self.assertTrue(os.path.exists(os.path.join(self.out, link)), link)
        for cell in ("bsp", "async", "broken"):
            self.assertIn("| %s |" % cell, md)
        self.assertIn("./rubato experiment", md)
        self.assertIn("broken seed 1:", md)  # The failed runs, with their errors.
        self.assertIn("CPUs", md)  # The machine.

    def test_bad_arguments_are_usage_errors(self):
        self.assertEqual(self.run_suite("--only", "nothing-matches"), 2)
        self.assertEqual(self.run_suite("--only", "(unclosed"), 2)
        self.assertEqual(run_suite.main([os.path.join(self.tmp.name, "missing.yaml")]), 2)


if __name__ == "__main__":
    sys.exit(pyunit.main("experiments/run_suite_test"))
