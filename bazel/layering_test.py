"""Rubato's one layering rule, checked on the sources themselves: common/ includes neither side,
worker/ never includes server/, and server/ never includes worker/. Code that needs both (the
in-process client, tests that run both sides, fuzzers, the simulator) lives in inprocess/, fuzz/,
tests/ or sim/.

The sources arrive as the filegroups //common:sources, //server:sources, and //worker:sources with
those of its subpackages (their runfiles paths are their repository paths)."""

import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pyunit  # noqa: E402

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

# package -> the top-level packages its files must not include.
FORBIDDEN = {
    "common": ("server", "worker", "inprocess", "tests", "fuzz", "experiments", "sim"),
    "server": ("worker", "inprocess", "tests", "fuzz", "experiments", "sim"),
    "worker": ("server", "inprocess", "tests", "fuzz", "experiments", "sim"),
}


def violations(root, package):
    """(file, included header) for every forbidden include under root/package."""
    found = []
    base = os.path.join(root, package)
    for dirpath, _, files in os.walk(base):
        for name in sorted(files):
            if not name.endswith((".h", ".cc", ".cu", ".cuh")):
                continue
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            for header in INCLUDE.findall(text):
                if header.split("/", 1)[0] in FORBIDDEN[package]:
                    found.append((os.path.relpath(path, root), header))
    return found


def source_root():
    runfiles = os.environ.get("RUNFILES_DIR") or os.environ.get("TEST_SRCDIR")
    workspace = os.environ.get("TEST_WORKSPACE", "rubato")
    if runfiles and os.path.isdir(os.path.join(runfiles, workspace, "server")):
        return os.path.join(runfiles, workspace)
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LayeringTest(unittest.TestCase):
    def test_the_sources_are_there(self):
        root = source_root()
        for package in FORBIDDEN:
            files = [f for _, _, fs in os.walk(os.path.join(root, package)) for f in fs
                     if f.endswith((".h", ".cc"))]
            self.assertGreater(len(files), 5, f"no sources of {package}/ under {root}")

    def test_no_package_includes_across_the_layers(self):
        root = source_root()
        for package in FORBIDDEN:
            with self.subTest(package=package):
                self.assertEqual(violations(root, package), [],
                                 f"{package}/ may not include "
                                 f"{', '.join(FORBIDDEN[package])}/ (see inprocess/BUILD)")

    def test_a_crossing_include_is_found(self):
        # The check itself must be able to fail: a worker file that includes server/.
        import tempfile
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "worker"))
            with open(os.path.join(root, "worker", "x.cc"), "w") as f:
                f.write('#include "worker/y.h"\n  #  include "server/parameter_shard.h"\n')
            self.assertEqual(violations(root, "worker"),
                             [("worker/x.cc", "server/parameter_shard.h")])
            self.assertEqual(violations(root, "server"), [])


if __name__ == "__main__":
    sys.exit(pyunit.main("bazel/layering_test"))
