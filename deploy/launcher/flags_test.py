#!/usr/bin/env python3
"""Tests of deploy/launcher/flags.py: the launcher's options, their checks and its help.

    python3 deploy/launcher/flags_test.py    (or: bazel test //deploy:launcher_flags_test)
"""

import contextlib
import io
import math
import os
import re
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import commands, flags as cli  # noqa: E402
from bazel import pyunit  # noqa: E402

LAUNCH = os.path.join(os.path.dirname(HERE), "launch.py")


def rejected(argv):
    """parse_args's error message for `argv` (it exits 2), or None when it accepts them."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            cli.parse_args(argv)
        except SystemExit as e:
            assert e.code == 2, e.code
            return err.getvalue()
    return None


class ParseArgsTest(unittest.TestCase):

    def test_model_bytes(self):
        # 784*256 + 256 + 256*10 + 10 = 203530 floats.
        self.assertEqual(cli.model_bytes("784-256-10"), 4 * 203530)
        self.assertEqual(cli.model_bytes("3-2"), 4 * (3 * 2 + 2))
        for bad in ("784", "784-x-10", "784-0-10", "", "784--10"):
            with self.assertRaises(ValueError, msg=bad):
                cli.model_bytes(bad)

    def test_max_message_mb(self):
        self.assertEqual(cli.max_message_mb("784-256-10"), 4)  # 0.8 MB: gRPC's default floor.
        for layers in ("784-4096-4096-10", "784-2048-10", "1024-1024", "784-16384-16384-10"):
            want = max(4, math.ceil(cli.model_bytes(layers) * 1.25 / 2**20) + 1)
            self.assertEqual(cli.max_message_mb(layers), want, layers)
        self.assertEqual(cli.max_message_mb("784-4096-4096-10"), 97)
        # 1023 * 1024 + 1024 floats = 4 MiB, exactly 5 MiB with the headroom: ceil adds nothing.
        self.assertEqual(cli.max_message_mb("1023-1024"), 6)

    def test_parse_args_max_message_mb(self):
        self.assertEqual(cli.parse_args([]).max_message_mb, "4")
        self.assertEqual(cli.parse_args(["--layers", "784-4096-4096-10"]).max_message_mb, "97")
        self.assertEqual(cli.parse_args(["--layers", "784-4096-4096-10",
                                            "--max_message_mb", "16"]).max_message_mb, "16")
        self.assertEqual(cli.parse_args(["--model", "mlp:784-4096-4096-10"]).max_message_mb,
                         "97")
        self.assertEqual(cli.parse_args(["--model", "cnn"]).max_message_mb, "4")

    def test_parse_args_rejects(self):
        with tempfile.NamedTemporaryFile() as secret:
            for argv in (["--layers", "784"], ["--model", "mlp:784"], ["--model", "resnet:0"],
                         ["--model", "cnn", "--layers", "784-10"],
                         ["--insecure", "--auth_secret_file", secret.name],
                         ["--auth_secret_file", secret.name + ".missing"],
                         ["--max_message_mb", "0"], ["--max_message_mb", "1.5"]):
                with self.assertRaises(SystemExit, msg=argv), open(os.devnull, "w") as null:
                    stderr, sys.stderr = sys.stderr, null
                    try:
                        cli.parse_args(argv)
                    finally:
                        sys.stderr = stderr

    def test_model_flag_bytes(self):
        self.assertEqual(cli.model_flag_bytes(None, None), cli.model_bytes("784-256-10"))
        self.assertEqual(cli.model_flag_bytes("cnn", None), 4 * 454922)
        self.assertEqual(cli.model_flag_bytes("mlp:3-2", None), 4 * 8)
        self.assertEqual(cli.model_flag_bytes(None, "3-2"), 4 * 8)
        # worker/model/model_spec_test.cc counts the same 345,642 parameters.
        self.assertEqual(cli.model_flag_bytes("resnet", None), 4 * 345642)
        self.assertEqual(cli.model_flag_bytes("resnet:3", None), 4 * 345642)
        self.assertEqual(cli.model_flag_bytes("resnet:2", None), 4 * (345642 - 2 * (
            (9 * 16 * 16 + 16) + (9 * 32 * 32 + 32) + (9 * 64 * 64 + 64))))
        for model, layers in (("cnn", "3-2"), ("resnetx", None), ("resnet:0", None),
                              ("resnet:17", None), ("resnet:", None), ("mlp:3", None)):
            with self.assertRaises(ValueError, msg=model):
                cli.model_flag_bytes(model, layers)

    def test_parse_crash_workers(self):
        self.assertEqual(cli.parse_crash_workers(None, 3), {})
        self.assertEqual(cli.parse_crash_workers("2:50, 0:7", 3), {2: 50, 0: 7})
        for bad in ("2", "x:1", "3:1", "-1:1", "1:-1", "1:5,1:6"):
            with self.assertRaises(ValueError, msg=bad):
                cli.parse_crash_workers(bad, 3)

    def test_parse_slow_workers(self):
        self.assertEqual(cli.parse_slow_workers(None, 3), {})
        self.assertEqual(cli.parse_slow_workers("1:4,2: 1.5", 3), {1: "4", 2: "1.5"})
        for bad, message in (("1", "expected ID:FACTOR"), ("3:2", "not in [0, --workers=3)"),
                             ("1:0.5", "factor must be >= 1"), ("1:inf", "factor must be >= 1"),
                             ("1:2,1:3", "worker 1 given twice")):
            with self.assertRaisesRegex(ValueError, re.escape(message), msg=bad):
                cli.parse_slow_workers(bad, 3)

    def test_checkpoint_files(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(cli.checkpoint_files(d), [])
            for name in ("shard-1-step-000000000200.ckpt", "shard-0-step-000000000100.ckpt",
                         "shard-0-step-100.ckpt", "notes.txt",
                         "shard-0-step-000000000100.ckpt.tmp"):
                open(os.path.join(d, name), "w").close()
            self.assertEqual(cli.checkpoint_files(d), ["shard-0-step-000000000100.ckpt",
                                                         "shard-1-step-000000000200.ckpt"])
            self.assertEqual(cli.checkpoint_files(os.path.join(d, "missing")), [])

    def test_job_checks(self):
        self.assertIn("--servers and --workers must be >= 1", rejected(["--workers", "0"]))
        self.assertIn("must be > 0", rejected(["--refresh", "0"]))
        self.assertIn("--slow_workers: worker id 5", rejected(["--slow_workers", "5:2"]))
        self.assertIn("--crash_workers: bad or repeated", rejected(["--crash_workers", "9:2"]))
        self.assertIn("--restart_servers must be >= 0", rejected(["--restart_servers", "-1"]))
        args = cli.parse_args(["--mode", "allreduce", "--servers", "3",
                                 "--slow_workers", "1:2", "--crash_workers", "0:4"])
        self.assertEqual(args.servers, 0)  # A ring: no parameter servers.
        self.assertEqual((args.slow_workers, args.crash_workers), ({1: "2"}, {0: 4}))

    def test_host_options_need_a_hostfile(self):
        for argv in (["--rsh", "ssh"], ["--server_hosts", "a"], ["--base_port", "1"],
                     ["--map_by", "host"], ["--oversubscribe"], ["--preflight_timeout", "3"],
                     ["--server_slots", "0"]):
            name = argv[0]
            self.assertIn("%s: only with --hostfile" % name, rejected(argv), argv)

    def test_every_forwarded_flag_is_an_option(self):
        options = {a.dest for a in cli.make_parser()._actions}
        for name in commands.CLUSTER_FLAGS + commands.SERVER_FLAGS + commands.WORKER_FLAGS:
            self.assertIn(name, options)
        args = cli.parse_args(["--learning_rate", "0.5", "--update_threads", "3",
                                 "--batch_size", "16"])
        self.assertEqual(commands.forwarded(args, ("learning_rate", "update_threads",
                                                   "batch_size", "momentum")),
                         ["--learning_rate=0.5", "--update_threads=3", "--batch_size=16"])

    def test_help_is_the_manual(self):
        done = subprocess.run([sys.executable, LAUNCH, "--help"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        self.assertEqual(done.returncode, 0, done.stderr)
        for words in ("Exit status: 0 when every worker finished", "130 on Ctrl-C",
                      "a preflight over --rsh", "summary.json", "worker-N.jsonl",
                      "  rubato launch --hostfile hosts", "Passed to rubato_worker as --seed.",
                      "Passed to rubato_server as --checkpoint_dir.", "horovodrun"):
            self.assertIn(words, " ".join(done.stdout.split()) if not words.startswith("  ")
                          else done.stdout, words)


class HostFlagsTest(unittest.TestCase):
    """The several-hosts options, through parse_args and through launch.py."""

    def _args(self, text, *flags):
        with tempfile.NamedTemporaryFile("w", suffix=".hosts") as f:
            f.write(text)
            f.flush()
            return cli.parse_args(["--hostfile", f.name] + list(flags))

    def _rejected(self, text, *flags):
        """parse_args's error message for these flags (it exits 2)."""
        with tempfile.NamedTemporaryFile("w", suffix=".hosts") as f:
            f.write(text)
            f.flush()
            done = subprocess.run([sys.executable, LAUNCH, "--hostfile", f.name] + list(flags),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(done.returncode, 2, done.stderr)
            return done.stderr.replace(f.name, "HOSTS")

    def test_plan(self):
        args = self._args("a slots=2\nb slots=2\nc\n", "--servers", "2", "--workers", "3",
                          "--server_hosts", "c,b", "--worker_hosts", "a,b", "--map_by", "host")
        plan = args.plan
        self.assertEqual(plan.servers(), "c:29500,b:29501")
        self.assertEqual(plan.worker_hosts, ["a", "b", "a"])
        self.assertEqual(args.rsh, "ssh -o BatchMode=yes")
        args = self._args("a slots=2\nb\n", "--workers", "3", "--mode", "allreduce",
                          "--base_port", "4000")
        self.assertEqual(args.plan.peers(), "a:4000,a:4001,b:4002")
        self.assertEqual(args.plan.servers(), "")
        # Local mode has no plan, and the host flags need a host file.
        self.assertIsNone(cli.parse_args([]).plan)

    def test_parse_args_errors(self):
        self.assertIn("--hostfile: HOSTS:2: slots must be a whole number >= 1, got '-1'",
                      self._rejected("a\nb slots=-1\n"))
        # The server takes host a's slot: one is left, on b.
        self.assertIn("3 worker(s) do not fit in the 1 slot(s) their hosts have left (a:0, b:1)",
                      self._rejected("a\nb\n", "--workers", "3"))
        self.assertIn("--worker_hosts: unknown host zz (the host file lists a, b)",
                      self._rejected("a\nb\n", "--worker_hosts", "a,zz"))
        self.assertIn("--hostfile: [Errno 2] No such file or directory",
                      self._rejected("a\n", "--hostfile", "/nonexistent/hosts"))
        done = subprocess.run([sys.executable, LAUNCH, "--rsh", "ssh"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        self.assertEqual(done.returncode, 2)
        self.assertIn("--rsh: only with --hostfile", done.stderr)
        # With --oversubscribe the same job fits; with --server_slots 0, 2 workers do.
        self.assertEqual(self._args("a\nb\n", "--workers", "3", "--oversubscribe")
                         .plan.worker_hosts, ["b", "a", "b"])
        self.assertEqual(self._args("a\nb\n", "--workers", "2", "--server_slots", "0")
                         .plan.worker_hosts, ["a", "b"])

    def test_inline_hosts(self):
        args = cli.parse_args(["-H", "a:2,b:3", "--servers", "1", "--workers", "4"])
        self.assertEqual(args.plan.hosts, [("a", 2), ("b", 3)])
        self.assertEqual(args.plan.worker_hosts, ["a", "b", "b", "b"])  # The server took a slot.
        done = subprocess.run([sys.executable, LAUNCH, "-H", "a:0"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        self.assertEqual(done.returncode, 2)
        self.assertIn("-H: slots must be a whole number >= 1, got '0' in 'a:0'", done.stderr)
        self.assertIn("--hostfile and -H: give the hosts one way",
                      self._rejected("a\n", "-H", "a"))

    def test_environment_and_tls(self):
        os.environ["RUBATO_TEST_VAR"] = "from here"
        try:
            args = cli.parse_args(["-x", "A=1", "-x", "RUBATO_TEST_VAR", "-x", "B="])
        finally:
            del os.environ["RUBATO_TEST_VAR"]
        self.assertEqual(args.env_vars, {"A": "1", "RUBATO_TEST_VAR": "from here", "B": ""})
        self.assertIn("-x RUBATO_UNSET_VAR: RUBATO_UNSET_VAR is not set here",
                      rejected(["-x", "RUBATO_UNSET_VAR"]))
        self.assertIn("'1A' is not a variable name", rejected(["-x", "1A=2"]))
        self.assertIn("-x LOCAL_RANK: the launcher sets it", rejected(["-x", "LOCAL_RANK=1"]))
        with tempfile.NamedTemporaryFile("w", suffix=".pem") as f:
            args = cli.parse_args(["--tls_cert", f.name, "--tls_key", f.name, "--tls_ca", f.name])
            self.assertEqual(commands.tls_flags(args), ["--tls_cert=" + f.name,
                                                        "--tls_key=" + f.name,
                                                        "--tls_ca=" + f.name])
            self.assertEqual(commands.file_flags(args),
                             ["auth_secret_file", "tls_cert", "tls_key", "tls_ca"])
            self.assertIn("mutual TLS needs --tls_cert, --tls_key and --tls_ca together",
                          rejected(["--tls_cert", f.name]))
        self.assertIn("--tls_cert: no such file: /nonexistent.pem",
                      rejected(["--tls_cert", "/nonexistent.pem", "--tls_key", "/x",
                                "--tls_ca", "/x"]))


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/flags_test"))
