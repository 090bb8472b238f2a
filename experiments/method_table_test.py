"""Tests of experiments/method_table.py on hand-made summary rows."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import method_table  # noqa: E402


def row(mode, pattern, mean=None, lo=None, hi=None, n=1):
    r = {"cell": "mode=%s,pattern=%s" % (mode, pattern)}
    for key, value in (("mean", mean), ("ci95_lo", lo), ("ci95_hi", hi)):
        r["time_to_target_s_" + key] = "" if value is None else str(value)
    r["time_to_target_s_n"] = str(n if mean is not None else 0)
    return r


class MethodTableTest(unittest.TestCase):

    def test_the_best_fixed_mode_and_each_method_relative_to_bsp_without_a_straggler(self):
        rows = [row("bsp", "none", 10.0, 9.0, 11.0, 3), row("async", "none", 5.0),
                row("bsp", "constant-x4", 30.0), row("backup:1", "constant-x4", 12.0, 10.0, 14.0, 3),
                row("async", "constant-x4", 15.0), row("reassign", "constant-x4", 6.0),
                row("majority", "constant-x4"),  # Never reached the target.
                row("bsp", "transient", 20.0)]
        header, table, notes = method_table.table(rows)
        self.assertEqual(header, ["pattern", "best fixed mode", "reassignment",
                                  "majority all-reduce"])  # No adaptive cell: no column.
        self.assertEqual(table[0], ["none", "0.50 (async)", "not reached", "not reached"])
        self.assertEqual(table[1], ["constant-x4", "1.20 [1.00, 1.40] (backup:1)", "0.60",
                                    "not reached"])
        self.assertEqual(table[2][:2], ["transient", "2.00 (bsp)"])
        self.assertIn("10.0 s", notes[0])

    def test_suites_without_the_axes_or_the_reference_have_no_table(self):
        self.assertIsNone(method_table.table([{"cell": "bsp"}, {"cell": "async"}]))
        self.assertIsNone(method_table.table([row("async", "none", 5.0)]))
        self.assertIsNone(method_table.table([row("bsp", "none")]))  # Reference never reached.

    def test_axes_of_a_cell_name(self):
        self.assertEqual(method_table.axes_of("mode=ssp:2,pattern=pareto-1.5"),
                         {"mode": "ssp:2", "pattern": "pareto-1.5"})
        self.assertEqual(method_table.axes_of("bsp-linear"), {})


if __name__ == "__main__":
    unittest.main()
