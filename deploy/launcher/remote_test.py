#!/usr/bin/env python3
"""Tests of deploy/launcher/remote.py: the remote wrapper (run here by sh directly), the quoting
for each kind of remote shell, and the preflight through fake remote shells.

    python3 deploy/launcher/remote_test.py    (or: bazel test //deploy:launcher_remote_test)
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import hosts, programs, remote  # noqa: E402
from bazel import pyunit  # noqa: E402


class RemoteScriptTest(unittest.TestCase):
    """The wrapper that runs a program on a host, run here by sh directly."""

    def run_script(self, argv, secret=None, close_after=None):
        """Starts `sh -c remote_script(argv)`; sends the secret; closes its stdin after
        `close_after` seconds (None: at once, after the secret). Returns (status, stdout,
        stderr)."""
        flags = ["auth_secret_file"] if secret is not None else []
        p = subprocess.Popen(["sh", "-c", remote.remote_script(argv, flags)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if secret is not None:
            p.stdin.write(remote.encode_secret(secret) + b"\n")
            p.stdin.flush()
        if close_after is not None:
            try:
                p.wait(timeout=close_after)  # (communicate would close stdin at once.)
            except subprocess.TimeoutExpired:
                pass
        p.stdin.close()
        out, err = p.stdout.read(), p.stderr.read()  # Small: no pipe fills up.
        p.wait(timeout=15)
        return p.returncode, out.decode(), err.decode()

    def test_status_and_output_pass_through(self):
        rc, out, err = self.run_script(["sh", "-c", "echo out; echo err >&2; exit 7"],
                                       close_after=5)
        self.assertEqual((rc, out, err), (7, "out\n", "err\n"))

    def test_arguments_are_quoted(self):
        odd = ["a b", "it's", '"q"', "$HOME", "`x`", "*", "back\\slash", ""]
        rc, out, _ = self.run_script([sys.executable, "-c",
                                      "import json, sys; print(json.dumps(sys.argv[1:]))"] + odd,
                                     close_after=5)
        self.assertEqual((rc, json.loads(out)), (0, odd))

    def test_secret_file(self):
        # Any bytes: a newline, a NUL, a backslash, a quote.
        secret = bytes(range(256)) + b"\n\\0101'"
        probe = ("import json, os, sys; p = sys.argv[-1].partition('=')[2]; "
                 "print(json.dumps([p, open(p, 'rb').read().hex(), os.stat(p).st_mode & 0o777]))")
        rc, out, err = self.run_script([sys.executable, "-c", probe], secret=secret,
                                       close_after=5)
        self.assertEqual(rc, 0, err)
        path, content, mode = json.loads(out)
        self.assertEqual((bytes.fromhex(content), mode), (secret, 0o600))
        self.assertFalse(os.path.exists(os.path.dirname(path)))  # Removed at exit.

    def test_several_files_and_the_environment(self):
        # The secret and the TLS files, each on its own stdin line, each to its own flag; -x's
        # variables and the local rank exported.
        files = {"auth_secret_file": b"s3cret", "tls_cert": b"-----BEGIN CERTIFICATE-----\nMII\n",
                 "tls_key": b"key\n", "tls_ca": b"ca\n"}
        probe = ("import json, os, sys; print(json.dumps([[a.split('=')[0], open(a.split('=')[1],"
                 " 'rb').read().hex()] for a in sys.argv[1:]] + [os.environ.get('LOCAL_RANK'), "
                 "os.environ.get('X_Y')]))")
        script = remote.remote_script([sys.executable, "-c", probe], list(files),
                                      {"LOCAL_RANK": "3", "X_Y": "a 'b' $c"})
        p = subprocess.Popen(["sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        for v in files.values():
            p.stdin.write(remote.encode_secret(v) + b"\n")
        p.stdin.flush()
        p.wait(timeout=15)  # Before stdin ends, which would stop it.
        p.stdin.close()
        out, err = p.stdout.read(), p.stderr.read()
        self.assertEqual(p.returncode, 0, err)
        got = json.loads(out)
        self.assertEqual(got[:-2], [["--" + k, v.hex()] for k, v in files.items()])
        self.assertEqual(got[-2:], ["3", "a 'b' $c"])

    def test_a_missing_tls_file_is_named(self):
        p = subprocess.Popen(["sh", "-c", remote.remote_script(["true"], ["auth_secret_file",
                                                                         "tls_cert"])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(remote.encode_secret(b"s") + b"\n", timeout=10)
        self.assertEqual(p.returncode, 125)
        self.assertEqual(err.decode(), "rubato remote: error: no --tls_cert on stdin\n")

    def test_no_secret_on_stdin(self):
        p = subprocess.Popen(["sh", "-c", remote.remote_script(["true"], ["auth_secret_file"])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = p.communicate(b"", timeout=10)
        self.assertEqual(p.returncode, 125)
        self.assertEqual(err.decode(), "rubato remote: error: no job secret on stdin\n")

    def test_end_of_stdin_stops_the_program(self):
        start = time.monotonic()
        rc, _, _ = self.run_script(["sleep", "60"], close_after=0.5)
        self.assertEqual(rc, 128 + 15)  # SIGTERM
        self.assertLess(time.monotonic() - start, 5)

    def test_end_of_stdin_then_sigkill(self):
        start = time.monotonic()
        rc, _, _ = self.run_script(
            [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
             "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"], close_after=1)
        self.assertEqual(rc, 128 + 9)  # SIGKILL, 5 s after the SIGTERM it ignored.
        self.assertGreater(time.monotonic() - start, 5)
        self.assertLess(time.monotonic() - start, 12)

    def test_rsh_argv(self):
        self.assertEqual(remote.rsh_argv(["ip", "netns", "exec"], "h", "echo 'a b'", False),
                         ["ip", "netns", "exec", "h", "sh", "-c", "echo 'a b'"])
        self.assertEqual(remote.rsh_argv(["ssh"], "h", "echo 'a b'", True),
                         ["ssh", "h", "sh -c 'echo '\"'\"'a b'\"'\"''"])

    def test_encode_secret(self):
        self.assertEqual(remote.encode_secret(b"a\n\x00"), b"\\0141\\0012\\0000")
        out = subprocess.run(["sh", "-c", "printf '%b' \"$1\"", "sh",
                              remote.encode_secret(bytes(range(256))).decode()],
                             stdout=subprocess.PIPE, check=True).stdout
        self.assertEqual(out, bytes(range(256)))


# Fake remote shells, `RSH HOST ARGS...`: one passes ARGS on as argv (as `ip netns exec` does), one
# joins them into a command line for sh (as ssh does), one never reaches its host.
RSH_EXEC = '#!/bin/sh\nshift\nexec "$@"\n'
RSH_SSH = '#!/bin/sh\nshift\nexec sh -c "$*"\n'
RSH_DOWN = '#!/bin/sh\necho "fake: connect to host $1 port 22: No route to host" >&2\nexit 255\n'


class PreflightTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.rsh = {}
        for name, text in (("exec", RSH_EXEC), ("ssh", RSH_SSH), ("down", RSH_DOWN)):
            path = os.path.join(self.tmp.name, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
            self.rsh[name] = [path]

    def test_probe_tells_the_kinds_of_rsh_apart(self):
        self.assertEqual(remote.probe_host(self.rsh["exec"], "exec", "h", 10), (False, None))
        self.assertEqual(remote.probe_host(self.rsh["ssh"], "ssh", "h", 10), (True, None))
        joins, why = remote.probe_host(self.rsh["down"], "down", "h", 10)
        self.assertIsNone(joins)
        self.assertEqual(why, "unreachable through --rsh 'down' (exited with status 255): fake: "
                              "connect to host h port 22: No route to host")
        joins, why = remote.probe_host([os.path.join(self.tmp.name, "nothing")], "nothing", "h",
                                       10)
        self.assertIsNone(joins)
        self.assertIn("unreachable through --rsh 'nothing' (exited with status 127)", why)

    def test_preflight_script_names_what_is_missing(self):
        present = os.path.join(self.tmp.name, "present")
        open(present, "w").close()
        script = remote.preflight_script(
            [sys.executable, present], [present, os.path.join(self.tmp.name, "gone")], [])
        out = subprocess.run(["sh", "-c", script], stdout=subprocess.PIPE, text=True).stdout
        self.assertEqual(out.splitlines(), ["not executable: " + present,
                                            "missing: " + os.path.join(self.tmp.name, "gone"),
                                            remote.PREFLIGHT_OK])

    def test_preflight_findings(self):
        self.assertEqual(remote.preflight_findings(0, "%s\n" % remote.PREFLIGHT_OK, "", 5), [])
        self.assertEqual(remote.preflight_findings(
            0, "missing: /d/x\nnoise\ncannot resolve: b\n%s\n" % remote.PREFLIGHT_OK, "", 5),
            ["missing: /d/x", "cannot resolve: b"])
        self.assertEqual(remote.preflight_findings(None, "", "", 5),
                         ["the checks did not finish within 5 s"])
        self.assertEqual(remote.preflight_findings(2, "", "sh: syntax error\n", 5),
                         ["the checks failed (exited with status 2): sh: syntax error"])

    def test_preflight_over_each_kind_of_rsh(self):
        bins = os.path.join(self.tmp.name, "bin")
        needs = {"a": ([sys.executable], [], ["localhost"]),
                 "b": ([os.path.join(bins, "worker", "rubato_worker")], [], [])}
        for kind, joins in (("exec", False), ("ssh", True)):
            got, problems = remote.preflight(self.rsh[kind], kind, needs, 10)
            self.assertEqual(got, joins, kind)
            self.assertEqual(problems, {"b": ["not executable: " +
                                              os.path.join(bins, "worker", "rubato_worker")]})
        joins, problems = remote.preflight(self.rsh["down"], "down", needs, 10)
        self.assertEqual(sorted(problems), ["a", "b"])

    def test_preflight_needs(self):
        args = argparse.Namespace(servers=1, workers=2, base_port=5000, server_hosts="c",
                                  worker_hosts="a,b", map_by="slot", oversubscribe=False,
                                  mode=None, data_dir="/data", server_slots=1)
        plan = hosts.Plan(args, [("a", 1), ("b", 1), ("c", 1), ("unused", 1)])
        needs = remote.preflight_needs(args, plan, "/bin")
        data = [os.path.join("/data", f) for f in programs.DATA_FILES]
        self.assertEqual(needs, {
            "a": (["/bin/worker/rubato_worker"], data, ["c"]),
            "b": (["/bin/worker/rubato_worker"], data, ["c"]),
            "c": (["/bin/server/rubato_server"], [], [])})
        args.mode = "allreduce"  # Ranks dial each other.
        self.assertEqual(remote.preflight_needs(args, plan, "/bin")["a"][2], ["a", "b"])


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/remote_test"))
