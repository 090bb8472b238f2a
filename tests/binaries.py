"""Where the Python multi-process tests find Rubato's binaries and the launcher, and how they read
the JSON-lines files a job leaves behind.

Under Bazel the binaries are in the runfiles, beside this package (ROOT/server/rubato_server,
ROOT/worker/rubato_worker: a test may have either or both);
run by hand from the source tree, in ROOT/bazel-bin.
"""

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN_DIR = ROOT if any(os.path.exists(os.path.join(ROOT, d, "rubato_" + d))
                      for d in ("server", "worker")) else os.path.join(ROOT, "bazel-bin")
LAUNCH = os.path.join(ROOT, "deploy", "launch.py")
SERVER = os.path.join(BIN_DIR, "server", "rubato_server")
WORKER = os.path.join(BIN_DIR, "worker", "rubato_worker")


def read_jsonl(path):
    """The JSON records of a JSON-lines file, skipping lines that are not JSON; [] if missing."""
    records = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return records


def check_final_records(test, mode, finals, accuracy):
    """Checks the workers' done records (worker id order) of a finished job: worker 0's test
    accuracy is above `accuracy`; under bsp the other workers evaluated nothing (every worker holds
    the same weights, which their fingerprints show), in other modes each evaluated too."""
    test.assertGreater(finals[0]["test_accuracy"], accuracy, "worker-0")
    for w, done in enumerate(finals[1:], 1):
        if mode == "bsp":
            test.assertNotIn("test_accuracy", done, "worker-%d evaluated under bsp" % w)
            test.assertEqual(done["params_fnv1a"], finals[0]["params_fnv1a"],
                             "worker-%d's final weights differ from worker 0's" % w)
        else:
            test.assertGreater(done["test_accuracy"], accuracy, "worker-%d" % w)
