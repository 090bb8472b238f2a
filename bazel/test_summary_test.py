#!/usr/bin/env python3
"""bazel/test_summary.py's counting of a target's cases: one test.xml, or its shards'."""

import os
import shutil
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bazel import pyunit, test_summary  # noqa: E402


def xml(passed=0, failed=0, skipped=0):
    cases = ['<testcase name="p%d" status="run"/>' % i for i in range(passed)]
    cases += ['<testcase name="f%d" status="run"><failure message="x"/></testcase>' % i
              for i in range(failed)]
    cases += ['<testcase name="s%d" status="run"><skipped message="y"/></testcase>' % i
              for i in range(skipped)]
    return "<testsuites><testsuite>%s</testsuite></testsuites>" % "".join(cases)


class TargetCasesTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.dir)
        self.when = 1000000

    def write(self, rel, text):
        """Writes `text` to rel under the target's directory, each file newer than the last."""
        path = os.path.join(self.dir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        self.when += 10
        os.utime(path, (self.when, self.when))

    def test_one_xml(self):
        self.write("test.xml", xml(3, 1, 2))
        self.assertEqual(test_summary.target_cases(self.dir), (3, 1, 2))

    def test_shards_are_summed(self):
        self.write("test.xml", xml(9))  # An earlier, unsharded run.
        self.write("shard_1_of_2/test.xml", xml(2))
        self.write("shard_2_of_2/test.xml", xml(1, 1))
        self.assertEqual(test_summary.target_cases(self.dir), (3, 1, 0))

    def test_a_newer_unsharded_run_wins(self):
        self.write("shard_1_of_2/test.xml", xml(2))
        self.write("shard_2_of_2/test.xml", xml(1))
        self.write("test.xml", xml(5))
        self.assertEqual(test_summary.target_cases(self.dir), (5, 0, 0))

    def test_stale_shards_of_another_count_are_left_out(self):
        self.write("shard_1_of_3/test.xml", xml(1))
        self.write("shard_2_of_3/test.xml", xml(1))
        self.write("shard_3_of_3/test.xml", xml(1))
        self.write("shard_1_of_2/test.xml", xml(2))
        self.write("shard_2_of_2/test.xml", xml(0, 0, 1))
        self.assertEqual(test_summary.target_cases(self.dir), (2, 0, 1))

    def test_an_unreadable_shard_makes_it_unreadable(self):
        self.write("shard_1_of_2/test.xml", xml(2))
        self.write("shard_2_of_2/test.xml", "<testsuites")
        self.assertIsNone(test_summary.target_cases(self.dir))


if __name__ == "__main__":
    sys.exit(pyunit.main("bazel/test_summary_test"))
