#!/usr/bin/env python3
"""Every flag that the launcher can put on a rubato_server or rubato_worker command line is one that
the binary has: the names come from the launcher's own command-line builders
(commands.forwarded_flag_names), the binary's flags from its --helpfull.

    bazel test //deploy:launcher_forwarded_flags_test
    python3 deploy/launcher/forwarded_flags_test.py [--bin_dir DIR]     (default: $RUBATO_BIN_DIR,
        else bazel-bin beside the source tree)

Under Bazel the binaries are in the test's runfiles (ROOT/server/rubato_server and
ROOT/worker/rubato_worker), as for tests/binaries.py.
"""

import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), ROOT]
from launcher import commands, programs  # noqa: E402
from bazel import pyunit  # noqa: E402

# A flag's own line in absl's --helpfull ("    --name (help...); default: ...;"); the lines that
# continue a help text are indented further.
FLAG_LINE = re.compile(r"^    --([A-Za-z0-9_]+) \(", re.MULTILINE)


def bin_dir(argv):
    """--bin_dir DIR, else $RUBATO_BIN_DIR, else the runfiles (Bazel), else ROOT/bazel-bin."""
    for i, arg in enumerate(argv):
        if arg.startswith("--bin_dir="):
            del argv[i]
            return arg.partition("=")[2]
        if arg == "--bin_dir" and i + 1 < len(argv):
            value = argv[i + 1]
            del argv[i:i + 2]
            return value
    if os.environ.get("RUBATO_BIN_DIR"):
        return os.environ["RUBATO_BIN_DIR"]
    if any(os.path.exists(os.path.join(ROOT, d, "rubato_" + d)) for d in ("server", "worker")):
        return ROOT
    return os.path.join(ROOT, "bazel-bin")


BIN_DIR = bin_dir(sys.argv) if __name__ == "__main__" else bin_dir([])


def defined_flags(program):
    """The flag names that `program` (server/rubato_server or worker/rubato_worker) lists in its
    --helpfull."""
    path = os.path.join(BIN_DIR, program)
    if not os.access(path, os.X_OK):
        raise AssertionError("no binary at %s (build it, or give --bin_dir or $RUBATO_BIN_DIR)"
                             % path)
    # absl exits with status 1 after printing the help.
    done = subprocess.run([path, "--helpfull"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    names = set(FLAG_LINE.findall(done.stdout + done.stderr))
    if len(names) < 10:
        raise AssertionError("%s --helpfull (status %d) listed %d flags:\n%s" % (
            path, done.returncode, len(names), (done.stdout + done.stderr)[-2000:]))
    return names


class ForwardedFlagsTest(unittest.TestCase):

    def check(self, program, directory):
        forwarded = commands.forwarded_flag_names()[program]
        defined = defined_flags(os.path.join(directory, program))
        missing = sorted(set(forwarded) - defined)
        self.assertEqual(missing, [], "the launcher can pass these flags to %s, which does not "
                                      "have them (deploy/launcher/commands.py): %s"
                         % (program, ", ".join("--" + m for m in missing)))

    def test_server_has_every_forwarded_flag(self):
        self.check(programs.SERVER_PROGRAM, "server")

    def test_worker_has_every_forwarded_flag(self):
        self.check(programs.WORKER_PROGRAM, "worker")

    def test_the_forwarded_names_are_many(self):
        # A guard on the test itself: the builders were really exercised.
        names = commands.forwarded_flag_names()
        self.assertGreater(len(names[programs.SERVER_PROGRAM]), 30)
        self.assertGreater(len(names[programs.WORKER_PROGRAM]), 50)


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/forwarded_flags_test"))
