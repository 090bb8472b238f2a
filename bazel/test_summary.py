#!/usr/bin/env python3
"""Counts test cases from `bazel test --test_summary=short` logs and their test.xml files.

    bazel test //... --test_summary=short 2>&1 | tee log; python3 bazel/test_summary.py log
    python3 bazel/test_summary.py log fuzz_log --testlogs DIR --expect //fuzz:a_test ...

Several logs may be given (./rubato test passes the `bazel test //...` log and the fuzz tests'
log, which come from another output base). Options apply to the log named just before them:
`--testlogs DIR` is where that log's test.xml files are (default: bazel-testlogs), `--expect
TARGET` a test that must have a result in it (one without counts as a failure: NO RESULT, e.g.
when the build could not even start), and `--skipped TARGET` a test that was deliberately not run
(counted as skipped).

Prints one line per test target and ends with `N passed, N failed, N skipped` (gtest cases: a
GTEST_SKIP counts as skipped). A target that failed without a failing case in its XML (a crash,
a timeout, a build failure) counts as one failure. Exit status: 0 only if nothing failed and at
least one case ran.
"""

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

LINE = re.compile(r"^(//\S+:\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|FLAKY|"
                  r"NO STATUS|INCOMPLETE|SKIPPED)\b")


MAX_FAILED_LOGS = 4
FAILED_LOG_LINES = 25


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


def target_cases(target_dir):
    """(passed, failed, skipped) cases of one target's newest run, or None if unreadable: its
    test.xml, or the sum over its shards' (shard_K_of_N/test.xml) where they are newer. Stale
    files of an earlier run with another shard count are left out."""
    def mtime(path):
        try:
            return os.path.getmtime(path)
        except OSError:
            return -1.0
    top = os.path.join(target_dir, "test.xml")
    groups = {}  # N -> its shards' test.xml files
    for path in glob.glob(os.path.join(target_dir, "shard_*_of_*", "test.xml")):
        groups.setdefault(path.rsplit("_of_", 1)[1].split(os.sep)[0], []).append(path)
    if not groups:
        return count_cases(top)
    newest = max(groups.values(), key=lambda paths: max(map(mtime, paths)))
    if mtime(top) > max(map(mtime, newest)):
        return count_cases(top)
    total = [0, 0, 0]
    for path in newest:
        counts = count_cases(path)
        if counts is None:
            return None
        total = [a + b for a, b in zip(total, counts)]
    return tuple(total)


def read_results(log_path):
    """{target: status} from one bazel test log; {} if it cannot be read."""
    results = {}
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                m = LINE.match(line.strip())
                if m:
                    results[m.group(1)] = m.group(2)
    except OSError:
        pass
    return results


def parse_args(argv):
    """[(log, testlogs, expected targets, skipped targets)] from the command line, or None."""
    runs = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--testlogs", "--expect", "--skipped"):
            if not runs or i + 1 >= len(argv):
                return None
            value = argv[i + 1]
            if arg == "--testlogs":
                runs[-1]["testlogs"] = value
            else:
                runs[-1][arg[2:]].append(value)
            i += 2
        elif arg.startswith("--"):
            return None
        else:
            runs.append({"log": arg, "testlogs": "bazel-testlogs", "expect": [], "skipped": []})
            i += 1
    return runs or None


def main(argv):
    runs = parse_args(argv)
    if runs is None:
        print(__doc__.strip().split("\n\n")[1], file=sys.stderr)
        return 2
    passed = failed = skipped = 0
    failed_logs = []  # test.log of each failed target, shown again just above the totals.
    for run in runs:
        results = read_results(run["log"])
        for target in run["expect"]:
            results.setdefault(target, "NO RESULT")
        for target in run["skipped"]:
            results[target] = "SKIPPED"
        if not results:
            print("no test results found in %s" % run["log"])
            failed += 1
        for target, status in sorted(results.items()):
            pkg, name = target[2:].split(":", 1)
            counts = target_cases(os.path.join(run["testlogs"], pkg, name))
            p, f_, s = counts if counts else (0, 0, 0)
            if status in ("PASSED", "FLAKY"):
                if counts is None:
                    p = 1
            elif status == "SKIPPED":
                p, f_, s = 0, 0, max(s, 1)
            else:
                f_ = max(f_, 1)
                if status in ("FAILED TO BUILD", "NO RESULT"):
                    p, s = 0, 0
                failed_logs.append((target, os.path.join(run["testlogs"], pkg, name, "test.log")))
            passed, failed, skipped = passed + p, failed + f_, skipped + s
            print("%-50s %-16s %4d passed %3d failed %3d skipped" % (target, status, p, f_, s))
    # A CI report keeps only the end of the output: repeat why each failure failed here.
    for target, path in failed_logs[:MAX_FAILED_LOGS]:
        print("\n== %s: the last %d lines of %s" % (target, FAILED_LOG_LINES, path))
        try:
            with open(path, errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as e:
            lines = ["(cannot read it: %s)" % e]
        for line in lines[-FAILED_LOG_LINES:]:
            print("  " + line[:400])
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
