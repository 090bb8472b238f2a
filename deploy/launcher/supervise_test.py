#!/usr/bin/env python3
"""Tests of deploy/launcher/supervise.py: grace periods, judging servers, restarts, stopping.

    python3 deploy/launcher/supervise_test.py    (or: bazel test //deploy:launcher_supervise_test)
"""

import argparse
import os
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import process, programs, supervise  # noqa: E402
from bazel import pyunit  # noqa: E402


class FakeProc:
    """What judge_servers and the Supervisor read of a process."""

    def __init__(self, name, rc=None, ended_at=None, program=programs.SERVER_PROGRAM):
        self.name, self.rc, self.ended_at, self.program = name, rc, ended_at, program
        self.after_workers, self.restarted, self.host = None, False, None
        self.state = ("running", None) if rc is None else ("FAILED", "exited with status %d" % rc)

    def returncode(self):
        return self.rc

    def outcome(self):
        return self.state

    def end_order(self):
        return process.Proc.end_order(self)


class Notes:
    def __init__(self):
        self.notes = []

    def note(self, text):
        self.notes.append(text)


class FakeJob:
    restarts_in_place = False
    output_lag_s = 0.0

    def __init__(self, servers=(), workers=(), plan=None, **args):
        self.servers, self.workers, self.plan = list(servers), list(workers), plan
        self.procs = self.servers + self.workers
        self.screen = Notes()
        self.args = argparse.Namespace(lease_ms=None, mode=None, restart_servers=0, refresh=0.01,
                                       timeout=60)
        for key, value in args.items():
            setattr(self.args, key, value)


class GraceTest(unittest.TestCase):

    def test_server_grace(self):
        self.assertEqual(supervise.server_grace(argparse.Namespace(lease_ms=None)), 15.0)
        self.assertEqual(supervise.server_grace(argparse.Namespace(lease_ms="2000")), 7.0)
        self.assertEqual(supervise.server_grace(argparse.Namespace(lease_ms="x")), 15.0)

    def test_judge_servers(self):
        done, early, failed, running = (FakeProc("s0", 0, 10.0), FakeProc("s1", 0, 1.0),
                                        FakeProc("s2", 2, 9.5), FakeProc("s3"))
        servers = [done, early, failed, running]
        ended = {done: True, early: True, failed: True, running: False}
        supervise.judge_servers(servers, ended, False, 10.0, 5.0)
        # Status 0 within the grace: not judged yet; past it: ended early. Any other status: at
        # once.
        self.assertEqual([s.after_workers for s in servers], [None, False, False, None])
        supervise.judge_servers(servers, ended, True, 11.0, 5.0)
        self.assertEqual([s.after_workers for s in servers], [True, False, False, None])


class SupervisorTest(unittest.TestCase):

    def test_notes_each_failed_worker_once(self):
        w = [FakeProc("worker-%d" % i, program=programs.WORKER_PROGRAM) for i in range(3)]
        w[1].state = ("FAILED", "killed by SIGKILL (signal 9)")
        w[2].state = ("crashed", "injected crash at step 5")
        job = FakeJob(workers=w, lease_ms="2000")
        sup = supervise.Supervisor(job)
        self.assertEqual(sup.note_workers(), ["running", "FAILED", "crashed"])
        sup.note_workers()
        self.assertEqual(job.screen.notes, [
            "rubato: worker-1 FAILED: killed by SIGKILL (signal 9); the servers drop it after its "
            "lease (2000 ms) and the others carry on",
            "rubato: worker-2 crashed: injected crash at step 5; the servers drop it after its "
            "lease (2000 ms) and the others carry on"])
        ring = FakeJob(workers=w, mode="allreduce")
        supervise.Supervisor(ring).note_workers()
        self.assertEqual(ring.screen.notes[0], "rubato: worker-1 FAILED: killed by SIGKILL "
                         "(signal 9); the ring is broken: the other ranks will end with an error")
        self.assertEqual(ring.screen.notes[1], "rubato: worker-2 crashed: injected crash at step 5")

    def test_should_restart(self):
        dead, rolled = FakeProc("server-0", -9, 1.0), FakeProc("server-1", 75, 1.0)
        dead.after_workers = rolled.after_workers = False
        job = FakeJob(servers=[dead, rolled], restart_servers=1)
        sup = supervise.Supervisor(job)
        self.assertTrue(sup.should_restart(0) and sup.should_restart(1))
        sup.restarts[0] = 1  # Used up; a roll-back does not count against N.
        sup.restarts[1] = 1
        self.assertEqual((sup.should_restart(0), sup.should_restart(1)), (False, True))
        sup.rollbacks[1] = programs.MAX_ROLLBACKS
        self.assertFalse(sup.should_restart(1))
        self.assertFalse(supervise.Supervisor(FakeJob(servers=[dead])).should_restart(0))
        # Under Slurm the shard's own task restarts it, never the launcher.
        in_place = FakeJob(servers=[dead, rolled], restart_servers=1)
        in_place.restarts_in_place = True
        self.assertFalse(supervise.Supervisor(in_place).should_restart(0) or
                         supervise.Supervisor(in_place).should_restart(1))
        # Across hosts too: the shard restarts on its host through the remote shell.
        self.assertTrue(supervise.Supervisor(FakeJob(servers=[dead], restart_servers=1,
                                                     plan=object())).should_restart(0))

    def test_early_server_failure(self):
        s0, s1 = FakeProc("server-0", 2, 2.0), FakeProc("server-1", 1, 1.0)
        job = FakeJob(servers=[s0, s1])
        self.assertIsNone(supervise.Supervisor(job).early_server_failure())
        s0.after_workers = s1.after_workers = False
        self.assertEqual(supervise.Supervisor(job).early_server_failure(),
                         "server-1 exited with status 1")
        s1.host = "hb"
        job.plan = object()
        self.assertEqual(supervise.Supervisor(job).early_server_failure(),
                         "server-1@hb exited with status 1")


class ProcessesTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def proc(self, name, script):
        return process.Proc(name, programs.SERVER_PROGRAM, ["sh", "-c", script], self.tmp.name)

    def test_wait_for_port_file(self):
        path = os.path.join(self.tmp.name, "port")
        p = self.proc("server-0", "sleep 0.2; echo 127.0.0.1:99 >%s; sleep 30" % path)
        self.addCleanup(supervise.stop, [p])
        self.assertEqual(supervise.wait_for_port_file(p, path, time.monotonic() + 10),
                         "127.0.0.1:99")
        silent = self.proc("server-1", "sleep 30")
        self.addCleanup(supervise.stop, [silent])
        with self.assertRaisesRegex(process.LaunchError,
                                    "server-1 did not start serving within the start-up timeout"):
            supervise.wait_for_port_file(silent, path + ".none", time.monotonic() + 0.2)
        dead = self.proc("server-2", "echo 'rubato_server: error: port in use' >&2; exit 1")
        with self.assertRaisesRegex(process.LaunchError,
                                    "server-2 exited with status 1 before serving: "
                                    "rubato_server: error: port in use"):
            supervise.wait_for_port_file(dead, path + ".none", time.monotonic() + 10)

    def test_stop(self):
        polite = self.proc("a", "sleep 30")
        stubborn = self.proc("b", "trap '' TERM; while :; do sleep 0.1; done")
        finished = self.proc("c", "exit 0")
        finished.popen.wait()
        time.sleep(0.2)  # The trap is set.
        start = time.monotonic()
        supervise.stop([polite, stubborn, finished], grace=0.5)
        self.assertLess(time.monotonic() - start, 5)
        self.assertEqual([p.returncode() for p in (polite, stubborn, finished)], [-15, -9, 0])
        self.assertEqual([p.stopped for p in (polite, stubborn, finished)], [True, True, False])
        self.assertEqual(polite.outcome(), ("stopped", None))


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/supervise_test"))
