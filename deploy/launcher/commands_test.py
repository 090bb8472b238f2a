#!/usr/bin/env python3
"""Tests of deploy/launcher/commands.py: the command lines of rubato_server and rubato_worker.

    python3 deploy/launcher/commands_test.py    (or: bazel test //deploy:launcher_commands_test)
"""

import os
import stat
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import commands, flags  # noqa: E402
from bazel import pyunit  # noqa: E402


def args_of(*argv):
    return flags.parse_args(list(argv))


class SecretTest(unittest.TestCase):

    def test_job_secret(self):
        with tempfile.TemporaryDirectory() as d:
            old = os.umask(0)  # The mode must not depend on the umask.
            try:
                path = commands.write_job_secret(d)
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
            commands.write_job_secret(d)
            self.assertFalse(os.path.islink(path))
            with open(target) as f:
                self.assertEqual(f.read(), "keep")
            with open(path) as f:
                self.assertNotEqual(f.read(), first)

    def test_auth_flags(self):
        with tempfile.TemporaryDirectory() as d:
            self.assertEqual(commands.auth_flags(args_of("--insecure"), d), ["--insecure"])
            self.assertFalse(os.path.exists(os.path.join(d, "job.secret")))
            made = commands.auth_flags(args_of(), d)
            self.assertEqual(made[0], "--auth_secret_file=" + os.path.join(os.path.abspath(d),
                                                                          "job.secret"))
            self.assertEqual(len(made), 2)
            self.assertRegex(made[1], r"^--job_id=rubato-[A-Za-z0-9._-]*-[0-9a-f]{16}$")
            given = os.path.join(d, "given")
            open(given, "w").close()
            kept = commands.auth_flags(args_of("--auth_secret_file", given), d)
            self.assertEqual(kept[0], "--auth_secret_file=" + os.path.abspath(given))
            # A kept secret file, and still a fresh job id each time: no token of one job is
            # accepted by the next.
            again = commands.auth_flags(args_of("--auth_secret_file", given), d)
            self.assertEqual(again[0], kept[0])
            self.assertNotEqual(again[1], kept[1])

    def test_new_job_id_is_a_valid_one(self):
        for run_dir in ("runs/20261203-041207", "/tmp/a b/ü+x", "/"):
            job_id = commands.new_job_id(run_dir)
            self.assertRegex(job_id, r"^rubato-([A-Za-z0-9._-]+-)?[0-9a-f]{16}$")
            self.assertLessEqual(len(job_id), 128)


class CommandLineTest(unittest.TestCase):

    def test_worker_flags(self):
        args = args_of("--workers", "3", "--slowdown", "2", "--slow_workers", "1:4",
                       "--crash_workers", "2:9", "--crash_at_step", "5", "--seed", "7")
        self.assertEqual(commands.worker_flags(args, 0),
                         ["--seed=7", "--slowdown=2", "--crash_at_step=5"])
        self.assertEqual(commands.worker_flags(args, 1),
                         ["--seed=7", "--crash_at_step=5", "--slowdown=4"])
        self.assertEqual(commands.worker_flags(args, 2),
                         ["--seed=7", "--slowdown=2", "--crash_at_step=9"])

    def test_local_server(self):
        args = args_of("--servers", "2", "--learning_rate", "0.1", "--update_threads", "2",
                       "--seed", "3", "--insecure")
        cluster = commands.cluster_flags(args, ["--insecure"])
        self.assertEqual(cluster, ["--learning_rate=0.1", "--max_message_mb=4",
                                   "--num_workers=2", "--insecure"])
        argv = commands.server_command(args, "bin/server/rubato_server", 1, cluster,
                                       run_dir="run")
        self.assertEqual(argv, ["bin/server/rubato_server", "--shard_id=1", "--num_shards=2",
                                "--listen=127.0.0.1:0", "--port_file=run/server-1.port",
                                "--stats_file=run/server-1.stats.json"] + cluster
                         + ["--update_threads=2"])
        # A restart listens where the workers know it is, and writes no port file.
        self.assertEqual(commands.restart_command(argv, "127.0.0.1:4242"),
                         ["bin/server/rubato_server", "--shard_id=1", "--num_shards=2",
                          "--listen=127.0.0.1:4242", "--stats_file=run/server-1.stats.json"]
                         + cluster + ["--update_threads=2"])

    def plan(self, *argv):
        with tempfile.NamedTemporaryFile("w", suffix=".hosts") as f:
            f.write("a slots=2\nb slots=2\n")
            f.flush()
            return args_of("--hostfile", f.name, "--base_port", "7000", *argv)

    def test_servers_and_workers_across_hosts(self):
        args = self.plan("--servers", "2", "--workers", "3", "--server_slots", "0")
        cluster = commands.cluster_flags(args, [])
        self.assertEqual(commands.server_command(args, "s", 1, cluster, plan=args.plan),
                         ["s", "--shard_id=1", "--num_shards=2", "--listen=0.0.0.0:7001",
                          "--data_port=7003"] + cluster)
        where = commands.servers_flag([args.plan.servers()])
        self.assertEqual(where, "--servers=a:7000,b:7001")
        # Worker 2 is the first process on host b: local rank 0 (its GPU), before shard 1 there.
        self.assertEqual(commands.worker_command(args, "w", 2, where, cluster, args.plan),
                         ["w", "--worker_id=2", where, "--local_rank=0"] + cluster)
        self.assertEqual(commands.local_rank(args, "rubato_server", 1), (1, 2))
        self.assertEqual(commands.process_env(args, 1, 2),
                         {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})

    def test_allreduce_ranks_across_hosts_listen(self):
        args = self.plan("--workers", "3", "--mode", "allreduce")
        cluster = commands.cluster_flags(args, [])
        where = commands.peers_flag([args.plan.peers()])
        self.assertEqual(commands.worker_command(args, "w", 2, where, cluster, args.plan),
                         ["w", "--worker_id=2", "--peers=a:7000,a:7001,b:7002",
                          "--listen=0.0.0.0:7002", "--ring_data_port=7005", "--local_rank=0"]
                         + cluster)
        # Locally the ranks' addresses are in --peers: nothing more to listen on.
        local = args_of("--workers", "3", "--mode", "allreduce")
        self.assertEqual(commands.worker_command(local, "w", 1, "--peers=x", [], None),
                         ["w", "--worker_id=1", "--peers=x", "--local_rank=1"])

    def test_crash_step_and_flag_names(self):
        self.assertEqual(commands.crash_step(["w", "--seed=1", "--crash_at_step=12"]), "12")
        self.assertIsNone(commands.crash_step(["w", "--seed=1"]))
        self.assertEqual(commands.flag_names(["bin", "--a=1", "--b_c", "-x", "--d=e=f", "g"]),
                         {"a", "b_c", "d"})

    def test_forwarded_flag_names_cover_every_table_and_added_flag(self):
        names = commands.forwarded_flag_names()
        server, worker = set(names["rubato_server"]), set(names["rubato_worker"])
        self.assertTrue(set(commands.CLUSTER_FLAGS) <= server & worker)
        self.assertTrue(set(commands.SERVER_FLAGS) <= server)
        self.assertTrue(set(commands.WORKER_FLAGS) <= worker)
        self.assertFalse(set(commands.WORKER_FLAGS) & server)
        self.assertFalse(set(commands.SERVER_FLAGS) & worker)
        tls = ("tls_cert", "tls_key", "tls_ca")
        for added in ("shard_id", "num_shards", "listen", "port_file", "stats_file", "data_port",
                      "num_workers", "auth_secret_file", "insecure") + tls:
            self.assertIn(added, server)
        for added in ("worker_id", "servers", "peers", "listen", "ring_data_port", "num_workers",
                      "auth_secret_file", "insecure", "local_rank") + tls:
            self.assertIn(added, worker)


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/commands_test"))
