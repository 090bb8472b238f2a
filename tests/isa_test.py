#!/usr/bin/env python3
"""The worker's two builds (bazel/isa.bzl) train alike: the same small job (1 server, 1 worker,
the MLP, 150 steps, the first 3000 training and 1000 test images) with the baseline x86-64 build
(RUBATO_CPU_ISA=baseline) and with the build the processor gets by default (the AVX2+FMA build
where it has both). FMA rounds differently, so the two are not bit-identical; the documented
tolerance is on what a user sees: test accuracy within 0.01 and final training loss within 2%
of each other (measured here: 0.6950 and 0.68662 in both, to the last printed decimal).

    bazel test //tests:isa_test
"""

import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from tests.binaries import BIN_DIR, LAUNCH, read_jsonl  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
JOB = ["--servers", "1", "--workers", "1", "--steps", "150", "--train_limit", "3000",
       "--test_limit", "1000", "--log_every", "10", "--data_dir", DATA, "--timeout", "300"]


def has_avx2_fma():
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    return "avx2" in flags and "fma" in flags


class IsaTest(unittest.TestCase):

    def run_job(self, tmp, isa):
        run_dir = os.path.join(tmp, isa)
        out = subprocess.run([sys.executable, LAUNCH, "--bin_dir", BIN_DIR, "--run_dir", run_dir,
                              "-x", "RUBATO_CPU_ISA=" + isa] + JOB, capture_output=True,
                             text=True, timeout=400)
        self.assertEqual(out.returncode, 0, out.stdout[-3000:] + out.stderr[-3000:])
        records = read_jsonl(os.path.join(run_dir, "worker-0.jsonl"))
        start = [r for r in records if r.get("event") == "start"][0]
        done = [r for r in records if r.get("event") == "done"][0]
        loss = [r for r in records if r.get("event") == "step"][-1]["loss"]
        with open(os.path.join(run_dir, "worker-0.log")) as f:
            note = [l for l in f if "local rank" in l]
        return start["backend"], done["test_accuracy"], loss, "".join(note)

    def test_both_builds_train_alike(self):
        if not os.path.isdir(DATA):
            self.skipTest("no Fashion-MNIST at %s" % DATA)
        with tempfile.TemporaryDirectory() as tmp:
            base = self.run_job(tmp, "baseline")
            auto = self.run_job(tmp, "auto")
        self.assertEqual(base[0], "cpu-eigen")
        self.assertIn("RUBATO_CPU_ISA=baseline", base[3])
        if not has_avx2_fma():
            self.assertEqual(auto[0], "cpu-eigen")
            self.assertIn("the processor lacks AVX2 or FMA", auto[3])
            self.skipTest("this processor lacks AVX2 or FMA: only the baseline build ran")
        self.assertEqual(auto[0], "cpu-eigen avx2+fma")
        self.assertIn("AVX2+FMA build", auto[3])
        print("\nbaseline: accuracy %.4f, loss %.5f; avx2+fma: accuracy %.4f, loss %.5f" % (
            base[1], base[2], auto[1], auto[2]), flush=True)
        self.assertGreater(base[1], 0.6)  # It learned.
        self.assertAlmostEqual(base[1], auto[1], delta=0.01)
        self.assertAlmostEqual(base[2], auto[2], delta=0.02 * base[2])


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/isa_test"))
