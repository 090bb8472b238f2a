#!/usr/bin/env python3
"""Tests of deploy/launcher/process.py (and programs.py): how a process's end reads as its outcome.

    python3 deploy/launcher/process_test.py    (or: bazel test //deploy:launcher_process_test)
"""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import process, programs  # noqa: E402
from bazel import pyunit  # noqa: E402


class HelpersTest(unittest.TestCase):

    def test_exit_description(self):
        self.assertEqual(programs.exit_description(1), "exited with status 1")
        self.assertEqual(programs.exit_description(-9), "killed by SIGKILL (signal 9)")
        self.assertEqual(programs.exit_description(-15), "killed by SIGTERM (signal 15)")

    def test_end_order(self):
        def ended(name, program, at):
            p = process.Proc.__new__(process.Proc)  # No process: only what end_order reads.
            p.name, p.program, p.ended_at = name, program, at
            return p
        procs = [ended("worker-0", programs.WORKER_PROGRAM, 2.0),
                 ended("worker-1", programs.WORKER_PROGRAM, 1.0),
                 ended("server-0", programs.SERVER_PROGRAM, 2.0)]
        self.assertEqual([p.name for p in sorted(procs, key=process.Proc.end_order)],
                         ["worker-1", "server-0", "worker-0"])


class OutcomeTest(unittest.TestCase):
    """Local processes (sh scripts) ending each way."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def ended(self, script, program=programs.WORKER_PROGRAM, crash_at_step=None, name="p"):
        p = process.Proc(name, program, ["sh", "-c", script], self.tmp.name,
                         crash_at_step=crash_at_step)
        p.popen.wait(timeout=10)
        return p

    def test_worker_that_finished(self):
        p = self.ended("exit 0")
        self.assertEqual(p.outcome(), ("done", None))
        self.assertIsNotNone(p.ended_at)
        self.assertEqual(p.record(), {"name": "p", "host": "127.0.0.1", "state": "done",
                                      "exit_status": 0})

    def test_own_error_line_is_the_reason(self):
        p = self.ended("echo 'rubato_worker: error: mine' >&2; "
                       "echo 'W relayed: rubato_server: error: theirs' >&2; exit 1")
        self.assertEqual(p.outcome(), ("FAILED", "exited with status 1: rubato_worker: error: "
                                                 "mine"))
        p = self.ended("echo 'ERROR: unknown command line flag' >&2; exit 1")
        self.assertEqual(p.outcome()[1], "exited with status 1: ERROR: unknown command line flag")

    def test_signal(self):
        p = self.ended("kill -9 $$")
        self.assertEqual(p.outcome(), ("FAILED", "killed by SIGKILL (signal 9)"))
        self.assertEqual(p.record()["signal"], "SIGKILL")
        self.assertEqual(p.record()["exit_status"], -9)

    def test_injected_crash(self):
        self.assertEqual(self.ended("exit 3", crash_at_step="7").outcome(),
                         ("crashed", "injected crash at step 7"))
        self.assertEqual(self.ended("exit 3").outcome()[0], "FAILED")  # Not injected.

    def test_server_ends(self):
        early = self.ended("exit 0", program=programs.SERVER_PROGRAM)
        self.assertEqual(early.outcome(), ("FAILED", "exited with status 0 before the job ended"))
        after = self.ended("exit 0", program=programs.SERVER_PROGRAM)
        after.after_workers = True
        self.assertEqual(after.outcome(), ("done", None))

    def test_stopped_and_restarted(self):
        p = self.ended("exit 1")
        p.stopped = True
        self.assertEqual(p.outcome(), ("stopped", None))
        p = self.ended("echo 'rubato_server: error: gone' >&2; exit 75",
                       program=programs.SERVER_PROGRAM)
        p.restarted = True
        self.assertEqual(p.outcome(), ("restarted", "exited with status 75: rubato_server: "
                                                    "error: gone"))

    def test_outcome_is_fixed_once_ended(self):
        p = self.ended("exit 1")
        self.assertEqual(p.outcome()[0], "FAILED")
        p.stopped = True  # Too late: it had ended by itself.
        self.assertEqual(p.outcome()[0], "FAILED")

    def test_running(self):
        p = process.Proc("p", programs.WORKER_PROGRAM, ["sleep", "30"], self.tmp.name)
        self.addCleanup(p.popen.wait)
        self.addCleanup(p.popen.kill)
        self.assertEqual(p.outcome(), ("running", None))
        self.assertEqual(p.record(), {"name": "p", "host": "127.0.0.1", "state": "running"})


class RemoteProcTest(unittest.TestCase):

    def test_status_through_the_rsh(self):
        p = process.RemoteProc.__new__(process.RemoteProc)  # Only what returncode reads.
        p.popen = subprocess.Popen(["true"])
        p.popen.wait()
        for rsh_status, want in ((0, 0), (1, 1), (75, 75), (128 + 9, -9), (128 + 15, -15),
                                 (255, 255)):
            p.popen.returncode = rsh_status
            self.assertEqual(p.returncode(), want, rsh_status)

    def test_a_remote_process(self):
        with tempfile.TemporaryDirectory() as d:
            lines = []

            class Log:
                def line(self, name, host, text):
                    lines.append((name, host, text))

            script = ('read -r s; printf "secret %s\\n" "$s"; echo to-stderr >&2; '
                      'echo \'{"event":"stats","applied_updates":3}\'; exit 2')
            p = process.RemoteProc("server-0", programs.SERVER_PROGRAM, "h",
                                   ["sh", "-c", script], d, Log(), files=[b"ab"])
            p.popen.wait(timeout=10)
            p.join()
            self.assertEqual(p.returncode(), 2)
            self.assertEqual(p.stats, {"event": "stats", "applied_updates": 3})
            self.assertEqual(lines, [("server-0", "h", "to-stderr")])
            with open(os.path.join(d, "server-0.log")) as f:
                log = f.read()
            self.assertIn("secret \\0141\\0142\n", log)  # encode_secret's form.
            self.assertEqual(p.outcome()[0], "FAILED")
            p.close_stdin()
            self.assertEqual(p.stop_grace(), process.REMOTE_STOP_GRACE)

    def test_rsh_error_is_the_reason(self):
        with tempfile.TemporaryDirectory() as d:
            class Log:
                def line(self, *_):
                    pass
            p = process.RemoteProc("worker-0", programs.WORKER_PROGRAM, "h",
                                   ["sh", "-c", "echo 'ssh: connect to host h: refused' >&2; "
                                    "exit 255"], d, Log())
            p.popen.wait(timeout=10)
            p.join()
            self.assertEqual(p.outcome(), ("FAILED", "exited with status 255: ssh: connect to "
                                                     "host h: refused"))


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/process_test"))
