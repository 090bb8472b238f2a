#!/usr/bin/env python3
"""A worker that cannot reach a server says why, told apart: a host name that does not resolve, a
refused connection, and no answer at all (a host cut off the network). Real rubato_worker
processes in network namespaces (tests/netns.py), so that names, routes and cuts are real and no
packet leaves the machine.

    bazel test //tests:net_errors_test      (needs root for the namespaces; skips otherwise)
"""

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bazel import pyunit  # noqa: E402
from tests import netns  # noqa: E402
from tests.binaries import WORKER  # noqa: E402

DATA = "/usr/share/datasets/fashion-mnist"
JOB = ["--num_workers=1", "--steps=5", "--train_limit=500", "--test_limit=100", "--insecure"]


class NetErrorsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.reason = netns.skip_reason() or (None if os.path.isdir(DATA) else
                                             "Fashion-MNIST not found at " + DATA)
        cls.net = None if cls.reason else netns.Network(["a", "b"])

    @classmethod
    def tearDownClass(cls):
        if cls.net:
            cls.net.close()

    def setUp(self):
        if self.reason:
            self.skipTest(self.reason)

    def worker(self, flags, timeout=60):
        """Runs a worker on host a; (exit status, its one error line)."""
        r = subprocess.run(self.net.exec_prefix("a") + [WORKER, "--worker_id=0"] + JOB + flags,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
        errors = [l for l in r.stderr.splitlines() if l.startswith("rubato_worker: error:")]
        self.assertEqual(len(errors), 1, r.stderr[-3000:])
        return r.returncode, errors[0]

    def test_unresolvable_name(self):
        rc, error = self.worker(["--servers=ps-that-does-not-exist:5000",
                                 "--connect_timeout_ms=1500"])
        self.assertEqual(rc, 1)
        self.assertIn("cannot reach parameter server shard 0 at ps-that-does-not-exist:5000",
                      error)
        self.assertIn("the host name 'ps-that-does-not-exist' does not resolve", error)

    def test_refused(self):
        b = self.net.host("b")
        rc, error = self.worker(["--servers=%s:5000" % b, "--connect_timeout_ms=1500"])
        self.assertEqual(rc, 1)
        self.assertIn("connection refused by %s:5000" % b, error)
        self.assertIn("nothing listens", error)

    def test_no_answer_from_a_host_cut_off(self):
        b = self.net.host("b")
        self.net.cut("b")
        try:
            rc, error = self.worker(["--servers=%s:5000" % b, "--connect_timeout_ms=1500"])
        finally:
            self.net.restore("b")
        self.assertEqual(rc, 1)
        self.assertIn("no answer from %s:5000" % b, error)

    def test_ring_peer_that_does_not_resolve(self):
        a = self.net.host("a")
        rc, error = self.worker(["--mode=allreduce", "--num_workers=2",
                                 "--peers=%s:6000,rank-one-nowhere:6000" % a,
                                 "--listen=0.0.0.0:6000", "--wait_timeout_ms=3000"])
        self.assertEqual(rc, 1)
        self.assertIn("rank-one-nowhere:6000", error)
        self.assertIn("the host name 'rank-one-nowhere' does not resolve", error)


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/net_errors_test"))
