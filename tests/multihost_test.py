#!/usr/bin/env python3
"""Jobs across three hosts: `./rubato launch --hostfile` with the real binaries, each host a network
namespace (tests/netns.py) reached through `--rsh 'ip netns exec'`.

    bazel test //tests:multihost_test        (root; each case skips, naming why, without it)

Every job trains the default MLP on the first 6000 Fashion-MNIST training images for 4 epochs (128
steps of 64 per worker with 3 workers, whose shards are 2000 images each) and tests on the first
2000 test images. Measured here: test accuracy 0.7805 in bsp and in allreduce (both deterministic
with the default seed), 0.6785 after 2 epochs; an untrained model scores about 0.1. The threshold,
ACCURACY, is 0.70: above the half-way mark, so a job that lost much of its training fails it, and
below the full run by a margin for the nondeterministic cases (ssp, a rejoin, the proxy's timing).

Each case asserts that the launcher exits 0, that every worker wrote its `done` record and ended
`done`, that the test accuracy is above ACCURACY, and that every server ended by itself with status
0 once the workers were done (its outcome `done`, not `stopped`).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from tests import delay_proxy, netns  # noqa: E402
from tests.binaries import BIN_DIR, LAUNCH, check_final_records, read_jsonl  # noqa: E402

PROXY = os.path.join(ROOT, "tests", "delay_proxy.py")
ACCURACY = 0.70
JOB = ["--train_limit", "6000", "--test_limit", "2000", "--epochs", "4", "--log_every", "1"]
# The launcher's own time limit for one job; the test's is a little longer.
JOB_TIMEOUT = 240


class MultihostTest(unittest.TestCase):

    def setUp(self):
        reason = netns.skip_reason()
        if reason:
            self.skipTest(reason)
        self.tmp = tempfile.mkdtemp(prefix="multihost-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.net = netns.Network(["a", "b", "c"])
        self.addCleanup(self.net.close)
        self.runs = 0

    def host(self, name):
        return self.net.host(name)

    def launch(self, flags, during=None):
        """Runs one job on hosts a, b and c (slots=1 each, so worker i lands on the i-th host).
        `during(run_dir)` runs in a thread while it does. Returns (summary, run_dir, wall_s) once
        it has asserted what every case asserts."""
        self.runs += 1
        run_dir = os.path.join(self.tmp, "run-%d" % self.runs)
        hostfile = os.path.join(self.tmp, "hosts")
        with open(hostfile, "w") as f:
            f.write("# three namespaces on one switch\n")
            f.write("".join("%s slots=1\n" % self.host(h) for h in "abc"))
        argv = [sys.executable, LAUNCH, "--bin_dir", BIN_DIR, "--hostfile", hostfile,
                "--rsh", "ip netns exec", "--run_dir", run_dir, "--refresh", "0.5",
                "--timeout", str(JOB_TIMEOUT), "--server_slots", "0"] + JOB + flags
        began = time.monotonic()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        errors = []
        if during:
            def run():
                try:
                    during(run_dir)
                except Exception as e:  # noqa: BLE001  (reported by the test's thread)
                    errors.append(e)
            helper = threading.Thread(target=run, daemon=True)
            helper.start()
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
        finally:
            if proc.poll() is None:
                proc.kill()
        wall = time.monotonic() - began
        if during:
            helper.join(timeout=60)
        out = out.decode("utf-8", "replace")
        tail = "\n".join(out.splitlines()[-40:])
        self.assertEqual(errors, [])
        if proc.returncode != 0:  # Each process's own log says more than the launcher's tail.
            for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
                if name.endswith(".log") and name != "job.log":
                    with open(os.path.join(run_dir, name), errors="replace") as f:
                        tail += "\n== %s (last 30 lines)\n" % name
                        tail += "\n".join(f.read().splitlines()[-30:])
        self.assertEqual(proc.returncode, 0, "launcher failed:\n" + tail)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertTrue(summary["ok"], summary.get("error"))
        workers = summary["workers"]
        self.assertEqual([o["state"] for o in summary["worker_outcomes"]], ["done"] * workers)
        finals = []
        for w in range(workers):
            done = [r for r in read_jsonl(os.path.join(run_dir, "worker-%d.jsonl" % w))
                    if r.get("event") == "done"]
            self.assertEqual(len(done), 1, "worker-%d has no done record" % w)
            finals.append(done[0])
        check_final_records(self, summary["mode"], finals, ACCURACY)
        self.assertGreater(summary["test_accuracy"], ACCURACY)
        for o in summary["server_outcomes"]:  # Ended by themselves, once the workers were done.
            self.assertEqual((o["state"], o["exit_status"]), ("done", 0), o)
        print("\n%s: %s, test accuracy %.4f, %.1f s wall (launcher), %.1f worker steps/s, "
              "dropped workers %d" % (self.id().rsplit(".", 1)[1], " ".join(flags),
                                      summary["test_accuracy"], wall,
                                      summary["worker_steps_per_s"],
                                      summary.get("dropped_workers", 0)), flush=True)
        return summary, run_dir, wall

    def done_records(self, run_dir, workers):
        return [[r for r in read_jsonl(os.path.join(run_dir, "worker-%d.jsonl" % w))
                 if r.get("event") == "done"][0] for w in range(workers)]

    def test_parameter_servers_bsp(self):
        summary, run_dir, _ = self.launch(["--servers", "2", "--workers", "3", "--mode", "bsp"])
        self.assertEqual([o["host"] for o in summary["server_outcomes"]],
                         [self.host("a"), self.host("b")])
        self.assertEqual([o["host"] for o in summary["worker_outcomes"]],
                         [self.host(h) for h in "abc"])
        self.assertGreater(summary["applied_updates"], 0)  # From the servers' stdout stats.
        with open(os.path.join(run_dir, "job.log")) as f:
            self.assertIn("[worker-2@%s] " % self.host("c"), f.read())

    def test_allreduce(self):
        summary, run_dir, _ = self.launch(["--mode", "allreduce", "--workers", "3"])
        self.assertEqual(summary["server_outcomes"], [])
        fingerprints = {d["params_fnv1a"] for d in self.done_records(run_dir, 3)}
        self.assertEqual(len(fingerprints), 1, fingerprints)

    # A 10 s link cut on host c (worker-2 only) once it has done CUT_AT_STEP steps. Steps take at
    # least 100 ms (--min_step_ms), so the job is still running when the link comes back.
    CUT_AT_STEP = 15
    CUT_S = 10

    @staticmethod
    def wait_for_step(run_dir, worker, step, timeout=120):
        """Until worker `worker`'s progress records reach `step`; AssertionError after `timeout`
        seconds."""
        path = os.path.join(run_dir, "worker-%d.jsonl" % worker)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = [r["step"] for r in read_jsonl(path) if r.get("event") == "step"]
            if steps and steps[-1] >= step:
                return
            time.sleep(0.05)
        raise AssertionError("worker-%d never reached step %d" % (worker, step))

    def cut_worker_2(self, run_dir):
        self.wait_for_step(run_dir, 2, self.CUT_AT_STEP)
        self.net.cut("c")
        try:
            time.sleep(self.CUT_S)
        finally:
            self.net.restore("c")

    def test_link_cut_bsp(self):
        # --lease_ms 30000, longer than the cut: worker-2 is never dropped, the others wait for it
        # at the barrier (--wait_timeout_ms 120 s) and it resumes when its retries get through
        # (--retry_timeout_ms 30 s). Deterministic: nobody is dropped.
        summary, _, wall = self.launch(["--servers", "2", "--workers", "3", "--mode", "bsp",
                                        "--lease_ms", "30000", "--min_step_ms", "100"],
                                       during=self.cut_worker_2)
        self.assertEqual(summary["dropped_workers"], 0)
        self.assertGreater(wall, self.CUT_S)

    def test_link_cut_ssp(self):
        # --lease_ms 3000, well under the cut: the servers drop worker-2 about 3 s into it, the
        # others carry on (ssp does not wait for a dropped worker), and once the link is back
        # worker-2's heartbeat or retried call is told that it was dropped and it registers again.
        # Deterministic too: 10 s is far past the lease, and at 200 ms a step the others still
        # have more than 10 s of training left when the link comes back, so worker-2 rejoins
        # before the job could end without it.
        summary, run_dir, _ = self.launch(["--servers", "2", "--workers", "3", "--mode", "ssp:2",
                                           "--lease_ms", "3000", "--min_step_ms", "200"],
                                          during=self.cut_worker_2)
        self.assertGreaterEqual(summary["dropped_workers"], 1)
        self.assertGreaterEqual(self.done_records(run_dir, 3)[2].get("rejoins", 0), 1)

    def test_latency_through_a_delaying_proxy(self):
        # One server on host a; worker-2 on host c reaches it through a proxy on host c that holds
        # every chunk for 20 ms each way: on host c the server's name resolves to 127.0.0.1, where
        # the proxy listens on the server's port and forwards to host a's address.
        flags = ["--servers", "1", "--workers", "3", "--mode", "bsp", "--server_hosts",
                 self.host("a")]
        plain, _, _ = self.launch(flags)
        hosts_file = os.path.join(netns.NETNS_ETC, self.host("c"), "hosts")
        with open(hosts_file) as f:
            lines = [l for l in f.read().splitlines() if not l.endswith(" " + self.host("a"))]
        with open(hosts_file, "w") as f:
            f.write("\n".join(lines + ["127.0.0.1 %s" % self.host("a")]) + "\n")
        proxy = subprocess.Popen(
            self.net.exec_prefix("c") + [sys.executable, PROXY, "--listen", "127.0.0.1:29500",
                                         "--target", "%s:29500" % self.net.ip("a"),
                                         "--delay_ms", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.addCleanup(proxy.wait)
        self.addCleanup(proxy.terminate)
        self.assertIn(b"listening on 127.0.0.1:29500", proxy.stdout.readline())
        delayed, run_dir, _ = self.launch(flags)
        proxy.terminate()
        out, _ = proxy.communicate(timeout=10)
        self.assertIn(b"delay_proxy: connection from 127.0.0.1:", out)  # worker-2 went through it.
        # Its steps wait for at least a round trip through the proxy (2 x 20 ms): for the pushes
        # and the pulls behind them, after the backward pass (push_ms) or in the next step's
        # forward pass, layer by layer (pull_ms); comm_ms is both.
        comm = [r["comm_ms"] for r in read_jsonl(os.path.join(run_dir, "worker-2.jsonl"))
                if r.get("event") == "step" and "comm_ms" in r]
        self.assertGreater(sorted(comm)[len(comm) // 2], 40.0)
        print("\nsteps/s: %.1f without the proxy, %.1f with worker-2 behind a 20 ms proxy "
              "(BSP: every step waits for the slowest worker)"
              % (plain["worker_steps_per_s"], delayed["worker_steps_per_s"]), flush=True)
        self.assertLess(delayed["worker_steps_per_s"], plain["worker_steps_per_s"])


    def make_tls(self):
        """A CA and one certificate naming hosts a, b and c (server and client use), for mutual
        TLS: {flag: path}."""
        d = os.path.join(self.tmp, "tls")
        os.makedirs(d)
        ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
        run = lambda *a: subprocess.run(["openssl"] + list(a), cwd=d, check=True,  # noqa: E731
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
            "-subj", "/CN=multihost CA")
        with open(os.path.join(d, "ext"), "w") as f:
            f.write("subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\n"
                    % ",".join("DNS:" + self.host(h) for h in "abc"))
        run("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=multihost")
        run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "ext", "-out", "tls.crt")
        return {"--tls_cert": os.path.join(d, "tls.crt"), "--tls_key": os.path.join(d, "tls.key"),
                "--tls_ca": os.path.join(d, "ca.crt")}

    @staticmethod
    def processes(program, mark):
        """{pid: (argv, environment)} of this machine's processes running `program` whose
        environment has RUBATO_MARK=`mark` (this job's: other tests may run beside it)."""
        out = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open("/proc/%s/comm" % pid) as f:
                    if f.read().strip() != program:
                        continue
                with open("/proc/%s/cmdline" % pid, "rb") as f:
                    argv = [a.decode() for a in f.read().split(b"\0") if a]
                with open("/proc/%s/environ" % pid, "rb") as f:
                    env = dict(e.decode().partition("=")[::2] for e in f.read().split(b"\0") if e)
            except OSError:
                continue
            if env.get("RUBATO_MARK") == mark:
                out[int(pid)] = (argv, env)
        return out

    def test_shard_restarted_on_its_host_with_tls_and_environment(self):
        """--restart_servers across hosts: shard 1 is killed on host b once worker 0 has done
        KILL_AT_STEP steps; the launcher starts it again there through the remote shell, from its
        checkpoint, and shard 0 then rolls back to that step (exit 75) and is started again too.
        The secret and the TLS files reach every host on the remote shell's stdin (no file of them
        on the hosts' command lines but the wrapper's own copies); -x's variable (which also tells
        this job's processes from other tests') and each process's local rank are in its
        environment."""
        tls = self.make_tls()
        ckpt = os.path.join(self.tmp, "ckpt")  # The hosts share this file system: by shard.
        seen = {}
        mark = "job in " + self.tmp  # Exported by -x to this job's processes only.

        def kill_shard_1(run_dir):
            self.wait_for_step(run_dir, 0, self.KILL_AT_STEP)
            seen["workers"] = self.processes("rubato_worker", mark)
            seen["servers"] = self.processes("rubato_server", mark)
            shard_1 = [pid for pid, (argv, _) in seen["servers"].items()
                       if "--shard_id=1" in argv]
            self.assertEqual(len(shard_1), 1, seen["servers"])
            os.kill(shard_1[0], 9)

        flags = ["--servers", "2", "--workers", "3", "--mode", "bsp", "--checkpoint_dir", ckpt,
                 "--checkpoint_every_steps", "20", "--restart_servers", "1", "--min_step_ms",
                 "50", "-x", "RUBATO_MARK=" + mark]
        for flag, path in sorted(tls.items()):
            flags += [flag, path]
        summary, run_dir, _ = self.launch(flags, during=kill_shard_1)
        restarted = {r["name"]: r for r in summary["restarted_servers"]}
        self.assertEqual(restarted["server-1"].get("signal"), "SIGKILL", restarted)
        self.assertEqual(restarted["server-1"]["host"], self.host("b"))
        self.assertEqual(restarted["server-0"]["exit_status"], 75, "shard 0 rolled back")
        self.assertTrue(any(d.get("redone_steps", 0) > 0 for d in self.done_records(run_dir, 3)))
        # Environment and command lines, as the processes had them.
        self.assertEqual((len(seen["workers"]), len(seen["servers"])), (3, 2), seen)
        for argv, env in list(seen["workers"].values()) + list(seen["servers"].values()):
            # Hosts a and b hold a worker and a server each, host c worker 2 alone.
            self.assertEqual(env.get("LOCAL_WORLD_SIZE"),
                             "1" if "--worker_id=2" in argv else "2", argv)
            for flag in ("--tls_cert=", "--tls_key=", "--tls_ca=", "--auth_secret_file="):
                given = [a for a in argv if a.startswith(flag)]
                self.assertEqual(len(given), 1, argv)
                self.assertNotIn(self.tmp, given[0], "the wrapper's copy, not the launcher's")
        for argv, env in seen["workers"].values():
            # Each worker is the first process on its host: local rank 0, its GPU 0.
            self.assertIn("--local_rank=0", argv)
            self.assertEqual(env.get("LOCAL_RANK"), "0")
        for argv, env in seen["servers"].values():
            self.assertEqual(env.get("LOCAL_RANK"), "1", argv)  # After the host's worker.

    KILL_AT_STEP = 40


class DelayProxyTest(unittest.TestCase):
    """The proxy itself, on loopback (no namespaces, no root)."""

    def test_delays_each_way_in_order(self):
        import socket
        echo = socket.socket()
        echo.bind(("127.0.0.1", 0))
        echo.listen(1)

        def serve():
            conn, _ = echo.accept()
            with conn:
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    conn.sendall(data)
        threading.Thread(target=serve, daemon=True).start()
        target = "127.0.0.1:%d" % echo.getsockname()[1]
        host, port = delay_proxy.DelayProxy("127.0.0.1:0", target, 0.05).start()
        with socket.create_connection((host, port)) as s:
            began = time.monotonic()
            s.sendall(b"ping")
            self.assertEqual(s.recv(4), b"ping")
            rtt = time.monotonic() - began
            self.assertGreaterEqual(rtt, 0.1)  # 50 ms each way.
            self.assertLess(rtt, 1.0)
            # Many chunks: all arrive, in order.
            sent = b"".join(b"%06d" % i for i in range(20000))
            threading.Thread(target=s.sendall, args=(sent,), daemon=True).start()
            got = b""
            while len(got) < len(sent):
                got += s.recv(65536)
            self.assertEqual(got, sent)
            s.shutdown(socket.SHUT_WR)  # The half-close passes through: the echo ends, so do we.
            self.assertEqual(s.recv(10), b"")


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/multihost_test"))
