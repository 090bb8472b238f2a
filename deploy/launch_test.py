#!/usr/bin/env python3
"""Tests of deploy/launch.py: its pure helpers, and whole jobs run against fake binaries.

    python3 deploy/launch_test.py        (or: bazel test //deploy:launch_test)

The fake rubato_server and rubato_worker below speak just enough of the real ones' contract (port
file, stats file at SIGTERM, JSON-lines progress, one-line errors, exit statuses) to exercise how
the launcher reacts to each way a process can end, in a second or two and without a build.
"""

import json
import math
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import unittest
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import launch  # noqa: E402

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")

# One program for both fakes; it tells them apart by its own name. FAKE_WORKERS says what each
# worker does ("1:sigkill,2:error"; the others finish), FAKE_SERVER what server-0 does.
FAKE = textwrap.dedent('''\
    import json, os, signal, sys, time
    flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
    sys.stderr.write("argv: %s\\n" % json.dumps(sys.argv[1:]))
    sys.stderr.flush()

    if os.path.basename(sys.argv[0]) == "rubato_server":
        def stop(*_):
            with open(flags["stats_file"], "w") as f:
                json.dump({"appliedUpdates": 7, "droppedWorkers": 1}, f)
            sys.exit(0)
        signal.signal(signal.SIGTERM, stop)
        with open(flags["port_file"], "w") as f:
            f.write("127.0.0.1:1\\n")
        if os.environ.get("FAKE_SERVER") == "error":
            time.sleep(0.3)
            sys.stderr.write("rubato_server: error: disk on fire\\n")
            sys.exit(2)
        while True:
            time.sleep(0.05)

    me = int(flags["worker_id"])
    what = dict(item.split(":") for item in os.environ.get("FAKE_WORKERS", "").split(",") if item)
    what = what.get(str(me), "finish")
    def out(**record):
        print(json.dumps(record), flush=True)
    out(event="start", steps=10, batch_size=8, argv=sys.argv[1:])
    sys.stderr.write("I worker-%d: connected\\n" % me)
    sys.stderr.flush()
    time.sleep(0.2)
    out(event="step", step=5, epoch=0, loss=1.0)
    if what == "sigkill":
        # A line that mentions an error, quoting another process: not this worker's own error.
        sys.stderr.write("W worker-%d: pull retried: rubato_server: error: busy\\n" % me)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "crash":
        sys.stderr.write("rubato_worker: injected crash at step 5\\n")
        sys.exit(3)
    if what == "error":
        sys.stderr.write("rubato_worker: error: my own problem\\n")
        sys.stderr.write("W worker-%d: after that, server said rubato_server: error: x\\n" % me)
        sys.exit(1)
    if what == "hang":
        time.sleep(60)
    if what == "ring":  # Allreduce: this rank notices its dead peer a while later.
        time.sleep(0.8)
        sys.stderr.write("rubato_worker: error: peer 1 (127.0.0.1:2) is gone\\n")
        sys.exit(1)
    time.sleep(0.8)  # Finishes well after any other worker has died.
    out(event="eval", step=10, test_accuracy=0.9)
    out(event="done", steps=10, test_accuracy=0.9)
''')


class HelpersTest(unittest.TestCase):

    def test_model_bytes(self):
        # 784*256 + 256 + 256*10 + 10 = 203530 floats.
        self.assertEqual(launch.model_bytes("784-256-10"), 4 * 203530)
        self.assertEqual(launch.model_bytes("3-2"), 4 * (3 * 2 + 2))
        for bad in ("784", "784-x-10", "784-0-10", "", "784--10"):
            with self.assertRaises(ValueError, msg=bad):
                launch.model_bytes(bad)

    def test_max_message_mb(self):
        self.assertEqual(launch.max_message_mb("784-256-10"), 4)  # 0.8 MB: gRPC's default floor.
        for layers in ("784-4096-4096-10", "784-2048-10", "1024-1024", "784-16384-16384-10"):
            want = max(4, math.ceil(launch.model_bytes(layers) * 1.25 / 2**20) + 1)
            self.assertEqual(launch.max_message_mb(layers), want, layers)
        self.assertEqual(launch.max_message_mb("784-4096-4096-10"), 97)
        # 1023 * 1024 + 1024 floats = 4 MiB, exactly 5 MiB with the headroom: ceil adds nothing.
        self.assertEqual(launch.max_message_mb("1023-1024"), 6)

    def test_exit_description(self):
        self.assertEqual(launch.exit_description(1), "exited with status 1")
        self.assertEqual(launch.exit_description(-9), "killed by SIGKILL (signal 9)")
        self.assertEqual(launch.exit_description(-15), "killed by SIGTERM (signal 15)")

    def test_end_order(self):
        def ended(name, program, at):
            p = launch.Proc.__new__(launch.Proc)  # No process: only what end_order reads.
            p.name, p.program, p.ended_at = name, program, at
            return p
        procs = [ended("worker-0", launch.WORKER_PROGRAM, 2.0),
                 ended("worker-1", launch.WORKER_PROGRAM, 1.0),
                 ended("server-0", launch.SERVER_PROGRAM, 2.0)]
        self.assertEqual([p.name for p in sorted(procs, key=launch.Proc.end_order)],
                         ["worker-1", "server-0", "worker-0"])

    def test_job_secret(self):
        with tempfile.TemporaryDirectory() as d:
            old = os.umask(0)  # The mode must not depend on the umask.
            try:
                path = launch.write_job_secret(d)
            finally:
                os.umask(old)
            self.assertEqual(path, os.path.join(os.path.abspath(d), "job.secret"))
            self.assertEqual(stat.S_IMODE(os.stat(path).st_mode), 0o600)
            with open(path) as f:
                first = f.read()
            self.assertRegex(first, r"^[0-9a-f]{64}$")  # 32 random bytes.
            # A reused run directory gets a new secret, and a planted link is replaced, not
            # followed.
            target = os.path.join(d, "elsewhere")
            with open(target, "w") as f:
                f.write("keep")
            os.remove(path)
            os.symlink(target, path)
            launch.write_job_secret(d)
            self.assertFalse(os.path.islink(path))
            with open(target) as f:
                self.assertEqual(f.read(), "keep")
            with open(path) as f:
                self.assertNotEqual(f.read(), first)

    def test_parse_args_max_message_mb(self):
        self.assertEqual(launch.parse_args([]).max_message_mb, "4")
        self.assertEqual(launch.parse_args(["--layers", "784-4096-4096-10"]).max_message_mb, "97")
        self.assertEqual(launch.parse_args(["--layers", "784-4096-4096-10",
                                            "--max_message_mb", "16"]).max_message_mb, "16")

    def test_parse_args_rejects(self):
        with tempfile.NamedTemporaryFile() as secret:
            for argv in (["--layers", "784"],
                         ["--insecure", "--auth_secret_file", secret.name],
                         ["--auth_secret_file", secret.name + ".missing"],
                         ["--max_message_mb", "0"], ["--max_message_mb", "1.5"]):
                with self.assertRaises(SystemExit, msg=argv), open(os.devnull, "w") as null:
                    stderr, sys.stderr = sys.stderr, null
                    try:
                        launch.parse_args(argv)
                    finally:
                        sys.stderr = stderr


class JobTest(unittest.TestCase):
    """Whole jobs through `launch.py`, against the fakes."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.bin_dir = os.path.join(self.tmp.name, "bin")
        for role in ("server", "worker"):
            os.makedirs(os.path.join(self.bin_dir, role))
            path = os.path.join(self.bin_dir, role, "rubato_" + role)
            with open(path, "w") as f:
                f.write("#!%s\n%s" % (sys.executable, FAKE))
            os.chmod(path, 0o755)
        self.run_dir = os.path.join(self.tmp.name, "run")

    def launch(self, flags, workers="", server="", timeout=30):
        env = dict(os.environ, FAKE_WORKERS=workers, FAKE_SERVER=server)
        done = subprocess.run(
            [sys.executable, LAUNCH, "--bin_dir", self.bin_dir, "--run_dir", self.run_dir,
             "--refresh", "0.05"] + flags,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
        with open(os.path.join(self.run_dir, "summary.json")) as f:
            summary = json.load(f)
        return done.returncode, done.stdout.decode(), done.stderr.decode(), summary

    def states(self, summary, key="worker_outcomes"):
        return [o["state"] for o in summary[key]]

    def argv(self, name):
        with open(os.path.join(self.run_dir, name + ".log")) as f:
            return json.loads(f.readline()[len("argv: "):])

    def test_all_finish(self):
        rc, out, err, summary = self.launch(["--workers", "2"])
        self.assertEqual(rc, 0, err)
        self.assertTrue(summary["ok"])
        self.assertEqual(self.states(summary), ["done", "done"])
        self.assertEqual(self.states(summary, "server_outcomes"), ["stopped"])
        self.assertEqual(summary["failed_workers"], 0)
        self.assertEqual(summary["applied_updates"], 7)  # The server's stats, written at SIGTERM.
        self.assertIn("rubato: done in", out)

    def test_killed_worker_does_not_end_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--lease_ms", "2000"],
                                            workers="1:sigkill")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["done", "failed", "done"])
        self.assertEqual(summary["failed_workers"], 1)
        killed = summary["worker_outcomes"][1]
        self.assertEqual(killed["reason"], "killed by SIGKILL (signal 9)")  # Not the W line.
        self.assertEqual((killed["exit_status"], killed["signal"]), (-9, "SIGKILL"))
        self.assertEqual(self.states(summary, "server_outcomes"), ["stopped"])
        self.assertIn("worker-1 FAILED: killed by SIGKILL (signal 9)", out)
        self.assertIn("lease (2000 ms)", out)
        self.assertIn("rubato: ended in", out)  # The survivors' results are still reported.
        self.assertIn("1 of 3 worker(s) failed: worker-1 killed by SIGKILL (signal 9) (", err)
        self.assertNotIn("busy", out + err)
        final_table = out[out.rindex("worker   state"):]
        self.assertRegex(final_table, r"\n0 +done .*\n1 +FAILED .*\n2 +done ")
        self.assertEqual(summary["test_accuracy"], 0.9)

    def test_own_error_line(self):
        rc, out, err, summary = self.launch(["--workers", "2"], workers="0:error")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["failed", "done"])
        self.assertEqual(summary["worker_outcomes"][0]["reason"],
                         "exited with status 1: rubato_worker: error: my own problem")

    def test_injected_crash_does_not_fail(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--crash_workers", "2:5"],
                                            workers="2:crash")
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary), ["done", "done", "crashed"])
        self.assertEqual((summary["failed_workers"], summary["injected_crashes"]), (0, 1))
        self.assertIn("--crash_at_step=5", self.argv("worker-2"))
        self.assertEqual(summary["worker_outcomes"][2]["reason"], "injected crash at step 5")

    def test_status_3_without_injection_fails(self):
        rc, out, err, summary = self.launch(["--workers", "2"], workers="1:crash")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["done", "failed"])

    def test_only_injected_crashes_is_no_success(self):
        rc, out, err, summary = self.launch(["--workers", "1", "--crash_workers", "0:5"],
                                            workers="0:crash")
        self.assertEqual(rc, 1)
        self.assertIn("no worker finished", err)

    def test_server_failure_ends_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "2"], workers="0:hang,1:hang",
                                            server="error")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["stopped", "stopped"])
        self.assertEqual(summary["server_outcomes"][0]["reason"],
                         "exited with status 2: rubato_server: error: disk on fire")
        self.assertIn("error: server-0 exited with status 2: rubato_server: error: disk on fire",
                      err)

    def test_timeout_stops_without_failing_anyone(self):
        rc, out, err, summary = self.launch(["--workers", "2", "--timeout", "2"],
                                            workers="0:hang,1:hang")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["stopped", "stopped"])
        self.assertEqual(self.states(summary, "server_outcomes"), ["stopped"])
        self.assertEqual(summary["failed_workers"], 0)
        self.assertIn("error: job did not finish within --timeout=2s", err)
        self.assertNotIn("FAILED", out)

    def test_allreduce_ranks_end_by_themselves(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--mode", "allreduce"],
                                            workers="0:ring,1:sigkill,2:ring")
        self.assertEqual(rc, 1)
        self.assertEqual(summary["server_outcomes"], [])
        self.assertEqual(self.states(summary), ["failed", "failed", "failed"])
        reasons = [o["reason"] for o in summary["worker_outcomes"]]
        self.assertEqual(reasons[1], "killed by SIGKILL (signal 9)")
        self.assertEqual(reasons[0], "exited with status 1: rubato_worker: error: peer 1 "
                                     "(127.0.0.1:2) is gone")
        # The killed rank is named first: it ended first.
        self.assertIn("3 of 3 worker(s) failed, first worker-1 killed by SIGKILL (signal 9); "
                      "then worker-", err)
        self.assertEqual(out.count("the ring is broken"), 1)

    def test_secret_and_message_limit_reach_every_process(self):
        rc, out, err, summary = self.launch(["--workers", "2", "--layers", "784-4096-4096-10"])
        self.assertEqual(rc, 0, err)
        secret = os.path.join(os.path.abspath(self.run_dir), "job.secret")
        self.assertEqual(stat.S_IMODE(os.stat(secret).st_mode), 0o600)
        for name in ("server-0", "worker-0", "worker-1"):
            argv = self.argv(name)
            self.assertIn("--auth_secret_file=" + secret, argv, name)
            self.assertIn("--max_message_mb=97", argv, name)
            self.assertNotIn("--insecure", argv, name)
        self.assertEqual(summary["max_message_mb"], 97)

    def test_given_secret_and_message_limit(self):
        given = os.path.join(self.tmp.name, "my.secret")
        with open(given, "w") as f:
            f.write("00" * 32)
        rc, out, err, summary = self.launch(["--workers", "1", "--auth_secret_file", given,
                                             "--max_message_mb", "64"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.secret")))
        for name in ("server-0", "worker-0"):
            self.assertIn("--auth_secret_file=" + given, self.argv(name))
            self.assertIn("--max_message_mb=64", self.argv(name))

    def test_insecure(self):
        rc, out, err, summary = self.launch(["--workers", "1", "--mode", "allreduce",
                                             "--insecure"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.secret")))
        argv = self.argv("worker-0")
        self.assertIn("--insecure", argv)
        self.assertFalse([a for a in argv if a.startswith("--auth_secret_file")])


class RecordingResult(unittest.TextTestResult):
    """Also keeps the tests that passed, which unittest only counts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.passed = []

    def addSuccess(self, test):
        super().addSuccess(test)
        self.passed.append(test)


def write_junit_xml(path, result):
    """One <testcase> per test in `path`: Bazel's $XML_OUTPUT_FILE, from which ./rubato test counts
    cases (without it, Bazel reports the whole target as one)."""
    suite = ET.Element("testsuite", name="deploy/launch_test", tests=str(result.testsRun),
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


if __name__ == "__main__":
    program = unittest.main(exit=False, testRunner=unittest.TextTestRunner(
        resultclass=RecordingResult))
    if os.environ.get("XML_OUTPUT_FILE"):
        write_junit_xml(os.environ["XML_OUTPUT_FILE"], program.result)
    sys.exit(0 if program.result.wasSuccessful() else 1)
