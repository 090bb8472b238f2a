#!/usr/bin/env python3
"""A worker that cannot reach a server says why, told apart: a host name that does not resolve, a
refused connection, and no answer at all (a host cut off the network); and a worker whose server's
host vanishes mid-job gives it up within seconds, not at its call's deadline. Real rubato_worker
(and rubato_server) processes in network namespaces (tests/netns.py), so that names, routes and
cuts are real and no packet leaves the machine.

    bazel test //tests:net_errors_test      (needs root for the namespaces; skips otherwise)
"""

import os
import subprocess
import sys
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bazel import pyunit  # noqa: E402
from tests import netns  # noqa: E402
from tests.binaries import SERVER, WORKER  # noqa: E402

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

    def test_server_host_that_vanishes_mid_job(self):
        # A shard on host b, its worker on host a. Once the worker is training, host b is taken off
        # the network for good: no reset, no close, as when a machine loses power. The worker's
        # call in flight (a push whose bytes go unacknowledged, or a pull parked at the barrier on
        # an idle connection) must fail within about 15 s, the liveness limit of both transports
        # (gRPC's keepalive, the data plane's TCP keepalive and user timeout), and then within the
        # 3 s of retries asked for here. Its deadline is 110 s (--wait_timeout_ms + 10 s): a call
        # that only ends there (the data plane without liveness checks) fails this test.
        b = self.net.host("b")
        server = subprocess.Popen(
            self.net.exec_prefix("b") + [SERVER, "--listen=0.0.0.0:5000", "--num_workers=1",
                                         "--insecure", "--wait_timeout_ms=100000"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.addCleanup(server.wait)
        self.addCleanup(server.kill)
        worker = subprocess.Popen(
            self.net.exec_prefix("a") + [WORKER, "--worker_id=0", "--num_workers=1",
                                         "--steps=100000", "--train_limit=500", "--test_limit=100",
                                         "--insecure", "--servers=%s:5000" % b,
                                         "--connect_timeout_ms=10000", "--retry_timeout_ms=3000",
                                         "--wait_timeout_ms=100000", "--min_step_ms=20",
                                         "--log_every=1", "--eval_every=1000000"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.addCleanup(worker.wait)
        self.addCleanup(worker.kill)
        stderr = []
        reader = threading.Thread(target=lambda: stderr.extend(worker.stderr), daemon=True)
        reader.start()
        steps = 0
        for line in worker.stdout:  # One progress record a step.
            steps += '"step"' in line
            if steps >= 20:
                break
        self.assertGreaterEqual(steps, 20, "the worker never trained: " + "".join(stderr)[-3000:])
        cut = time.monotonic()
        self.net.cut("b")
        try:
            threading.Thread(target=lambda: worker.stdout.read(), daemon=True).start()
            rc = worker.wait(timeout=150)
        finally:
            self.net.restore("b")
        gone = time.monotonic() - cut
        reader.join(timeout=10)
        errors = [l for l in stderr if l.startswith("rubato_worker: error:")]
        self.assertEqual(rc, 1, "".join(stderr)[-3000:])
        self.assertEqual(len(errors), 1, "".join(stderr)[-3000:])
        self.assertIn("parameter server shard 0 at %s:5000 unreachable" % b, errors[0])
        self.assertLess(gone, 45, "the worker gave up %.1f s after its server's host vanished: %s"
                        % (gone, errors[0]))
        print("\nthe worker gave up %.1f s after its server's host vanished" % gone, flush=True)


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/net_errors_test"))
