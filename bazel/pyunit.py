"""Runs a Python unittest module under Bazel and writes one <testcase> per test to
$XML_OUTPUT_FILE, from which ./rubato test (bazel/test_summary.py) counts cases; without it Bazel
reports the whole target as one. A skipped test (self.skipTest) is written as skipped, with its
reason. Each case's wall time is printed after it and kept in the XML's time attribute.

A py_test with shard_count = N runs as N processes, each the cases whose index (in unittest's
order) is its shard index modulo N (Bazel's TEST_TOTAL_SHARDS and TEST_SHARD_INDEX), so the cases
of a long test run side by side.

    if __name__ == "__main__":
        sys.exit(pyunit.main("deploy/launch_test"))
"""

import os
import time
import unittest
import xml.etree.ElementTree as ET


class RecordingResult(unittest.TextTestResult):
    """Also keeps the tests that passed, which unittest only counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = []
        self.seconds = {}  # test id -> wall time
        self._began = None

    def startTest(self, test):
        self._began = time.monotonic()
        super().startTest(test)

    def stopTest(self, test):
        self.seconds[test.id()] = time.monotonic() - self._began
        super().stopTest(test)
        self.stream.writeln("  (%s: %.1f s)" % (test.id().rsplit(".", 1)[-1],
                                                 self.seconds[test.id()]))
        self.stream.flush()

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test)


def write_junit_xml(path, suite_name, result):
    suite = ET.Element("testsuite", name=suite_name, tests=str(result.testsRun),
                       failures=str(len(result.failures)), errors=str(len(result.errors)))
    cases = [(t, None, None) for t in result.passed]
    cases += [(t, "failure", text) for t, text in result.failures]
    cases += [(t, "error", text) for t, text in result.errors]
    cases += [(t, "skipped", text) for t, text in result.skipped]
    for test, kind, text in cases:
        case = ET.SubElement(suite, "testcase", name=test.id(), status="run",
                             time="%.3f" % result.seconds.get(test.id(), 0.0))
        if kind:
            message = text.strip().splitlines()[-1] if text else ""
            ET.SubElement(case, kind, message=message).text = text
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


class ShardingLoader(unittest.TestLoader):
    """Loads the cases of this shard only (every case without sharding)."""

    def __init__(self):
        super().__init__()
        self.total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
        self.index = int(os.environ.get("TEST_SHARD_INDEX", "0"))
        if os.environ.get("TEST_SHARD_STATUS_FILE"):  # Tells Bazel this test knows sharding.
            open(os.environ["TEST_SHARD_STATUS_FILE"], "a").close()

    def _mine(self, suite):
        return self.suiteClass([t for i, t in enumerate(_flatten(suite))
                                if i % self.total == self.index])

    def loadTestsFromModule(self, module, *args, **kwargs):
        return self._mine(super().loadTestsFromModule(module, *args, **kwargs))

    def loadTestsFromNames(self, names, module=None):
        return self._mine(super().loadTestsFromNames(names, module))


def main(suite_name):
    """Runs the __main__ module's tests (this shard's); returns the exit status (0 when all
    passed)."""
    program = unittest.main(exit=False, verbosity=2, testLoader=ShardingLoader(),
                            testRunner=unittest.TextTestRunner(resultclass=RecordingResult,
                                                               verbosity=2))
    if os.environ.get("XML_OUTPUT_FILE"):
        write_junit_xml(os.environ["XML_OUTPUT_FILE"], suite_name, program.result)
    return 0 if program.result.wasSuccessful() else 1
