#!/usr/bin/env python3
"""Counts test cases from a `bazel test --test_summary=short` log and the test.xml files.

    bazel test //... --test_summary=short 2>&1 | tee log; python3 bazel/test_summary.py log

Prints one line per test target and ends with `N passed, N failed, N skipped` (gtest cases: a
GTEST_SKIP counts as skipped). A target that failed without a failing case in its XML (a crash,
a timeout, a build failure) counts as one failure. Exit status: 0 only if nothing failed and at
least one case ran.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

LINE = re.compile(r"^(//\S+:\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|FLAKY|"
                  r"NO STATUS|INCOMPLETE|SKIPPED)\b")


def count_cases(xml_path):
    """(passed, failed, skipped) gtest cases in one test.xml, or None if it is unreadable."""
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    passed = failed = skipped = 0
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            skipped += 1
        elif case.get("status", "run") == "run":
            passed += 1
    return passed, failed, skipped


def main(log_path, testlogs="bazel-testlogs"):
    with open(log_path, errors="replace") as f:
        results = {}
        for line in f:
            m = LINE.match(line.strip())
            if m:
                results[m.group(1)] = m.group(2)
    passed = failed = skipped = 0
    for target, status in sorted(results.items()):
        pkg, name = target[2:].split(":", 1)
        counts = count_cases(os.path.join(testlogs, pkg, name, "test.xml"))
        p, f_, s = counts if counts else (0, 0, 0)
        if status in ("PASSED", "FLAKY"):
            if counts is None:
                p = 1
        elif status == "SKIPPED":
            p, f_, s = 0, 0, max(s, 1)
        else:
            f_ = max(f_, 1)
            if status == "FAILED TO BUILD":
                p, s = 0, 0
        passed, failed, skipped = passed + p, failed + f_, skipped + s
        print("%-50s %-16s %4d passed %3d failed %3d skipped" % (target, status, p, f_, s))
    if not results:
        print("no test results found in %s" % log_path)
        failed = max(failed, 1)
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: test_summary.py BAZEL_TEST_LOG")
    sys.exit(main(sys.argv[1]))
