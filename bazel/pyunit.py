"""Runs a Python unittest module under Bazel and writes one <testcase> per test to
$XML_OUTPUT_FILE, from which ./rubato test (bazel/test_summary.py) counts cases; without it Bazel
reports the whole target as one. A skipped test (self.skipTest) is written as skipped, with its
reason.

    if __name__ == "__main__":
        sys.exit(pyunit.main("deploy/launch_test"))
"""

import os
import unittest
import xml.etree.ElementTree as ET


class RecordingResult(unittest.TextTestResult):
    """Also keeps the tests that passed, which unittest only counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = []

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
        case = ET.SubElement(suite, "testcase", name=test.id(), status="run")
        if kind:
            message = text.strip().splitlines()[-1] if text else ""
            ET.SubElement(case, kind, message=message).text = text
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(suite_name):
    """Runs the __main__ module's tests; returns the exit status (0 when all passed)."""
    program = unittest.main(exit=False, verbosity=2,
                            testRunner=unittest.TextTestRunner(resultclass=RecordingResult,
                                                               verbosity=2))
    if os.environ.get("XML_OUTPUT_FILE"):
        write_junit_xml(os.environ["XML_OUTPUT_FILE"], suite_name, program.result)
    return 0 if program.result.wasSuccessful() else 1
