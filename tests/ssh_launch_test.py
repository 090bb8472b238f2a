#!/usr/bin/env python3
"""`./rubato launch --hostfile` through real OpenSSH: the launcher's default remote shell.

    bazel test //tests:ssh_launch_test       (root, /usr/sbin/sshd; each case skips, naming why)

Four network namespaces (tests/netns.py) on one private switch: hosts h1, h2, h3, each running its
own throwaway sshd (`/usr/sbin/sshd -D -e -f <temp config>`: a fresh ed25519 host key, listening
on the host's address only, public-key login as root with a fresh client key, no PAM, no password),
and a control host `ctl` where the launcher itself runs (`ip netns exec ctl python3 launch.py`),
so that every ssh connection goes over the namespaces' network. Nothing leaves the machine and
nothing of the machine's own network or sshd is used or changed (the client runs with `-F
/dev/null`, so the machine's ssh_config does not apply either; only /run/sshd, sshd's privilege
separation directory, is created when missing).

Jobs: the default MLP on the first 6000 Fashion-MNIST training images for 2 epochs, tested on the
first 2000 test images (as tests/multihost_test, with half its epochs). multihost_test measured
0.6785 test accuracy after 2 epochs in bsp (deterministic with the default seed); an untrained
model scores about 0.1. ACCURACY, 0.60, is far above chance and a little under the measured
figure, so a job that lost a worker's training or its servers' updates fails it.

- test_parameter_servers_bsp: 2 servers, 3 workers. Exit 0, every worker `done` with a done
  record, servers ended by themselves (`done`, status 0), accuracy above ACCURACY; and while it
  runs, /proc/*/cmdline of every process on the machine is scanned: the job's secret
  (<run_dir>/job.secret) is never on one, and the remote workers were seen, each with
  --auth_secret_file naming its own copy in a `mktemp -d` directory.
- test_allreduce: 3 ranks, the binaries under a path with a space and quotes (ssh joins its
  arguments into one command line: the launcher must quote the script once more); the same
  checks, and every rank ends with the same parameters.
- test_preflight_failure: a --remote_bin_dir that does not exist: exit 2, each host's problem
  reported through ssh with the path intact, nothing started.
- test_exit_status_through_ssh: an injected crash (status 3) reads as `crashed`, not a failure;
  a worker SIGKILLed on its host reads as signal 9 (ssh hands back 128 + 9) and fails the job.
- test_sigint_tears_down_remote_processes / test_sigkill_launcher_...: SIGINT (exit 130) or
  SIGKILL to the launcher mid-job; within TEARDOWN_S seconds no rubato_server or rubato_worker is
  left in any host namespace, nor an ssh client in ctl, which holds only if the remote side ends
  them when the ssh connection's stdin closes.

About 75 s, six jobs of about 9 s each.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bazel import pyunit  # noqa: E402
from tests import netns  # noqa: E402
from tests.binaries import BIN_DIR, LAUNCH, check_final_records, read_jsonl  # noqa: E402
SSHD = "/usr/sbin/sshd"
ACCURACY = 0.60
JOB = ["--train_limit", "6000", "--test_limit", "2000", "--epochs", "2", "--log_every", "1"]
JOB_TIMEOUT = 180
# Seconds from the SIGINT (or SIGKILL) of the launcher by which every remote process must be gone:
# each ssh's stdin closes at once and the remote wrapper sends SIGTERM, SIGKILL 5 s later; under
# the launcher's REMOTE_STOP_GRACE (8 s), after which it would kill the ssh clients. Measured:
# 0.2 s. Without the wrapper's kills the workers still die (SIGPIPE on their closed stdout) but the
# servers stay: both teardown cases then fail.
TEARDOWN_S = 7
PROGRAMS = ("rubato_server", "rubato_worker")
HOSTS = ("h1", "h2", "h3")


def namespace_pids(ns):
    out = subprocess.run(["ip", "netns", "pids", ns], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True).stdout
    return [int(p) for p in out.split()]


def comm(pid):
    try:
        with open("/proc/%d/comm" % pid) as f:
            return f.read().strip()
    except OSError:
        return ""


def cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def kill_namespace(ns):
    """SIGKILLs every process still in namespace `ns` (all of them this test's: sshd and what it
    started)."""
    for pid in namespace_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class SshLaunchTest(unittest.TestCase):
    skip = None

    @classmethod
    def setUpClass(cls):
        if os.geteuid() != 0:
            cls.skip = "sshd in network namespaces needs root (running as uid %d)" % os.geteuid()
        elif not os.access(SSHD, os.X_OK):
            cls.skip = "no %s (Debian package openssh-server; ./rubato setup installs it)" % SSHD
        elif shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
            cls.skip = "no ssh or ssh-keygen (Debian package openssh-client)"
        else:
            cls.skip = netns.skip_reason()
        if cls.skip:
            return
        cls.tmp = tempfile.mkdtemp(prefix="ssh-launch-")
        cls.addClassCleanup(shutil.rmtree, cls.tmp, ignore_errors=True)
        cls.net = netns.Network(["ctl"] + list(HOSTS))
        cls.addClassCleanup(cls.net.close)
        cls.sshds = []
        cls.addClassCleanup(cls._stop_sshds)
        # sshd's privilege separation directory; Debian's package creates it only when its
        # service starts.
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        cls.key = os.path.join(cls.tmp, "client_key")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rubato-test",
                        "-f", cls.key], check=True, stdin=subprocess.DEVNULL)
        authorized = os.path.join(cls.tmp, "authorized_keys")
        shutil.copyfile(cls.key + ".pub", authorized)
        for h in HOSTS:
            cls._start_sshd(h, authorized)
        cls.rsh = ("ssh -F /dev/null -o BatchMode=yes -o StrictHostKeyChecking=no "
                   "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5 "
                   "-i " + cls.key)
        for h in HOSTS:
            cls._wait_for_sshd(h)

    @classmethod
    def _start_sshd(cls, h, authorized):
        d = os.path.join(cls.tmp, "sshd-" + h)
        os.mkdir(d)
        host_key = os.path.join(d, "host_key")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", host_key],
                       check=True, stdin=subprocess.DEVNULL)
        config = os.path.join(d, "sshd_config")
        with open(config, "w") as f:
            f.write("\n".join([
                "ListenAddress %s" % cls.net.ip(h),
                "Port 22",
                "HostKey " + host_key,
                "PidFile " + os.path.join(d, "sshd.pid"),
                "AuthorizedKeysFile " + authorized,
                "PermitRootLogin prohibit-password",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",  # The keys are in temporary directories.
                "PrintMotd no",
                "X11Forwarding no",
                "AllowTcpForwarding no",
                "MaxStartups 50",
            ]) + "\n")
        log = open(os.path.join(d, "sshd.log"), "wb")
        proc = subprocess.Popen(cls.net.exec_prefix(h) + [SSHD, "-D", "-e", "-f", config],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        log.close()
        cls.sshds.append((h, proc, os.path.join(d, "sshd.log")))

    @classmethod
    def _stop_sshds(cls):
        for h, proc, _ in cls.sshds:
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Sessions that outlived their listener, and anything they started.
        for h in HOSTS:
            kill_namespace(cls.net.host(h))

    @classmethod
    def _sshd_log(cls, h):
        for name, _, path in cls.sshds:
            if name == h:
                with open(path, errors="replace") as f:
                    return f.read()
        return ""

    @classmethod
    def _wait_for_sshd(cls, h):
        """Until `ssh HOST true` from ctl succeeds: sshd listens and the key is accepted."""
        deadline = time.monotonic() + 20
        while True:
            done = subprocess.run(cls.net.exec_prefix("ctl") + cls.rsh.split() +
                                  [cls.net.host(h), "true"], stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode == 0:
                return
            proc = [p for name, p, _ in cls.sshds if name == h][0]
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("sshd on %s is not usable: ssh said %r; sshd's log:\n%s" % (
                    h, done.stdout.strip(), cls._sshd_log(h)))
            time.sleep(0.2)

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)

    def hostfile(self):
        path = os.path.join(self.tmp, "hosts")
        with open(path, "w") as f:
            f.write("".join("%s slots=1\n" % self.net.host(h) for h in HOSTS))
        return path

    def start(self, flags, name):
        run_dir = os.path.join(self.tmp, "run-" + name)
        argv = self.net.exec_prefix("ctl") + [
            sys.executable, LAUNCH, "--bin_dir", BIN_DIR, "--hostfile", self.hostfile(),
            "--rsh", self.rsh, "--run_dir", run_dir, "--refresh", "0.5",
            "--timeout", str(JOB_TIMEOUT), "--server_slots", "0"] + JOB + flags
        out = open(os.path.join(self.tmp, "launcher-%s.out" % name), "w+b")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
        self.addCleanup(self._reap, proc)
        return proc, run_dir, out

    def _reap(self, proc):
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for h in HOSTS:  # Nothing of this case outlives it, whatever happened.
            for pid in namespace_pids(self.net.host(h)):
                if comm(pid) in PROGRAMS:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def finish(self, proc, out, began):
        try:
            proc.wait(timeout=JOB_TIMEOUT + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        wall = time.monotonic() - began
        out.seek(0)
        tail = "\n".join(out.read().decode("utf-8", "replace").splitlines()[-40:])
        return wall, tail

    def remote_processes(self):
        """{host: [(pid, comm, argv)]} of the rubato processes in each host namespace."""
        found = {}
        for h in HOSTS:
            for pid in namespace_pids(self.net.host(h)):
                c = comm(pid)
                if c in PROGRAMS:
                    found.setdefault(h, []).append((pid, c, cmdline(pid)))
        return found

    def check_job(self, proc, run_dir, tail):
        self.assertEqual(proc.returncode, 0, "launcher failed:\n" + tail)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertTrue(summary["ok"], summary.get("error"))
        workers = summary["workers"]
        self.assertEqual([o["state"] for o in summary["worker_outcomes"]], ["done"] * workers)
        self.assertEqual([o["host"] for o in summary["worker_outcomes"]],
                         [self.net.host(h) for h in HOSTS])
        done = []
        for w in range(workers):
            records = [r for r in read_jsonl(os.path.join(run_dir, "worker-%d.jsonl" % w))
                       if r.get("event") == "done"]
            self.assertEqual(len(records), 1, "worker-%d has no done record" % w)
            done.append(records[0])
        check_final_records(self, summary["mode"], done, ACCURACY)
        self.assertGreater(summary["test_accuracy"], ACCURACY)
        for o in summary["server_outcomes"]:  # Ended by themselves, once the workers were done.
            self.assertEqual((o["state"], o["exit_status"]), ("done", 0), o)
        self.assertEqual(self.remote_processes(), {})
        return summary, done

    def test_parameter_servers_bsp(self):
        began = time.monotonic()
        proc, run_dir, out = self.start(["--servers", "2", "--workers", "3", "--mode", "bsp"],
                                        "bsp")
        # While it runs: every command line on the machine, against the job's secret.
        secret_path = os.path.join(run_dir, "job.secret")
        seen, leaks, secret = {}, [], []
        stop = threading.Event()

        def scan():
            while not stop.is_set():
                if not secret:
                    try:
                        with open(secret_path, "rb") as f:
                            s = f.read().strip()
                        if s:
                            secret.append(s)
                    except OSError:
                        pass
                if secret:
                    for entry in os.listdir("/proc"):
                        if entry.isdigit():
                            argv = cmdline(int(entry))
                            if any(secret[0] in a for a in argv):
                                leaks.append(argv)
                    for h, procs in self.remote_processes().items():
                        for pid, c, argv in procs:
                            if any(argv):  # Empty once it has exited (a zombie).
                                seen[(h, c)] = argv
                stop.wait(0.1)
        scanner = threading.Thread(target=scan, daemon=True)
        scanner.start()
        try:
            wall, tail = self.finish(proc, out, began)
        finally:
            stop.set()
            scanner.join(timeout=10)
        summary, _ = self.check_job(proc, run_dir, tail)
        self.assertEqual(leaks, [], "the job secret is on a command line")
        self.assertTrue(secret, "no job.secret in the run directory")
        # The scan saw the remote processes (so it ran while they did), each reading the secret
        # from its own file, not the launcher's.
        self.assertEqual(sorted(seen), sorted([("h1", "rubato_server"), ("h2", "rubato_server")] +
                                              [(h, "rubato_worker") for h in HOSTS]))
        for (h, c), argv in seen.items():
            files = [a for a in argv if a.startswith(b"--auth_secret_file=")]
            self.assertEqual(len(files), 1, (h, c, argv))
            self.assertRegex(files[0].decode(), r"/rubato\.[^/]+/job\.secret$")
            self.assertNotEqual(files[0].decode().split("=", 1)[1], secret_path)
        self.assertEqual([o["host"] for o in summary["server_outcomes"]],
                         [self.net.host("h1"), self.net.host("h2")])
        self.assertGreater(summary["applied_updates"], 0)  # The servers' stats, over ssh.
        with open(os.path.join(run_dir, "job.log")) as f:
            self.assertIn("[worker-2@%s] " % self.net.host("h3"), f.read())
        print("\nbsp over ssh: test accuracy %.4f, %.1f s wall (launcher), %.1f worker steps/s"
              % (summary["test_accuracy"], wall, summary["worker_steps_per_s"]), flush=True)

    def test_allreduce(self):
        # The binaries under a path with a space and a quote, which ssh's joined command line
        # must carry intact: the launcher quotes the script once more for it.
        odd = os.path.join(self.tmp, "bin dir's \"copy\"")
        os.symlink(BIN_DIR, odd)
        began = time.monotonic()
        proc, run_dir, out = self.start(["--mode", "allreduce", "--workers", "3",
                                         "--remote_bin_dir", odd], "allreduce")
        wall, tail = self.finish(proc, out, began)
        summary, done = self.check_job(proc, run_dir, tail)
        self.assertEqual(summary["server_outcomes"], [])
        fingerprints = {d["params_fnv1a"] for d in done}
        self.assertEqual(len(fingerprints), 1, fingerprints)
        print("\nallreduce over ssh: test accuracy %.4f, %.1f s wall (launcher)"
              % (summary["test_accuracy"], wall), flush=True)

    def test_preflight_failure(self):
        # Nothing starts; every host's problem comes back through ssh, the path intact.
        missing = "/nonexistent/it's a \"dir\""
        proc, run_dir, out = self.start(["--servers", "1", "--workers", "3",
                                         "--remote_bin_dir", missing], "preflight")
        _, tail = self.finish(proc, out, time.monotonic())
        self.assertEqual(proc.returncode, 2, tail)
        self.assertIn("preflight failed on 3 of 3 host(s)", tail)
        for h in HOSTS:
            self.assertIn("%s: not executable: %s/worker/rubato_worker" % (self.net.host(h),
                                                                           missing), tail)
        self.assertIn("%s: not executable: %s/server/rubato_server" % (self.net.host("h1"),
                                                                       missing), tail)
        self.assertFalse(os.path.exists(run_dir))

    def test_exit_status_through_ssh(self):
        # worker-2 exits with status 3 at step 5 (an injected crash), which ssh must hand back for
        # the launcher to tell it from a failure; the servers drop it after its 3 s lease and the
        # others finish. Then worker-1 is SIGKILLed on its host: ssh returns 128 + 9, read as
        # signal 9, and the job fails (status 1).
        began = time.monotonic()
        proc, run_dir, out = self.start(["--servers", "2", "--workers", "3", "--mode", "bsp",
                                         "--lease_ms", "3000", "--crash_workers", "2:5"],
                                        "crash")
        wall, tail = self.finish(proc, out, began)
        self.assertEqual(proc.returncode, 0, tail)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        outcomes = summary["worker_outcomes"]
        self.assertEqual([o["state"] for o in outcomes], ["done", "done", "crashed"], outcomes)
        self.assertEqual(outcomes[2]["exit_status"], 3)

        proc, run_dir, out = self.start(["--servers", "2", "--workers", "3", "--mode", "bsp",
                                         "--lease_ms", "3000", "--min_step_ms", "200"], "killed")
        deadline = time.monotonic() + 60
        while True:
            workers = [p for p, c, _ in self.remote_processes().get("h2", [])
                       if c == "rubato_worker"]
            steps = [r for r in read_jsonl(os.path.join(run_dir, "worker-1.jsonl"))
                     if r.get("event") == "step"]
            if workers and steps:
                os.kill(workers[0], signal.SIGKILL)
                break
            self.assertLess(time.monotonic(), deadline, "worker-1 never started its steps")
            time.sleep(0.1)
        _, tail = self.finish(proc, out, time.monotonic())
        self.assertEqual(proc.returncode, 1, tail)
        with open(os.path.join(run_dir, "summary.json")) as f:
            outcomes = json.load(f)["worker_outcomes"]
        self.assertEqual(outcomes[1]["state"], "failed", outcomes)
        self.assertEqual((outcomes[1]["exit_status"], outcomes[1].get("signal")),
                         (-9, "SIGKILL"), outcomes)
        self.assertEqual([o["state"] for o in outcomes[::2]], ["done", "done"], outcomes)
        self.assertEqual(self.remote_processes(), {})

    def test_sigkill_launcher_tears_down_remote_processes(self):
        # The launcher dies without a word: its ssh clients (each in its own process group) live
        # on, but their stdin pipes reach end of file, which ssh passes on to the remote side.
        proc, run_dir, out = self.start(["--servers", "2", "--workers", "3", "--mode", "bsp",
                                         "--min_step_ms", "200"], "sigkill")
        self.wait_for_steps(proc, run_dir, out)
        began = time.monotonic()
        proc.kill()
        proc.wait()
        left = self.remote_processes()
        while left and time.monotonic() - began < TEARDOWN_S:
            time.sleep(0.1)
            left = self.remote_processes()
        gone = time.monotonic() - began
        self.assertEqual(left, {}, "still running %.0f s after SIGKILL" % TEARDOWN_S)
        while time.monotonic() - began < TEARDOWN_S:
            clients = [p for p in namespace_pids(self.net.host("ctl")) if comm(p) == "ssh"]
            if not clients:
                break
            time.sleep(0.1)
        self.assertEqual(clients, [], "ssh clients left after the launcher's SIGKILL")
        print("\nSIGKILL of the launcher over ssh: every remote process gone %.1f s after it"
              % gone, flush=True)

    def wait_for_steps(self, proc, run_dir, out):
        """Until every worker has done 3 steps; then asserts that all five processes run."""
        deadline = time.monotonic() + 60
        while True:
            steps = [[r["step"] for r in read_jsonl(os.path.join(run_dir, "worker-%d.jsonl" % w))
                      if r.get("event") == "step"] for w in range(3)]
            if all(s and s[-1] >= 3 for s in steps):
                break
            out.seek(0)
            self.assertIsNone(proc.poll(), "launcher ended early:\n" + out.read().decode())
            self.assertLess(time.monotonic(), deadline, "the workers never reached step 3")
            time.sleep(0.1)
        running = self.remote_processes()
        self.assertEqual(sorted((h, c) for h, ps in running.items() for _, c, _ in ps),
                         sorted([("h1", "rubato_server"), ("h2", "rubato_server")] +
                                [(h, "rubato_worker") for h in HOSTS]))
        return running

    def test_sigint_tears_down_remote_processes(self):
        # Slow steps (200 ms at least), so that the job is well under way and far from its end.
        proc, run_dir, out = self.start(["--servers", "2", "--workers", "3", "--mode", "bsp",
                                         "--min_step_ms", "200"], "sigint")
        running = self.wait_for_steps(proc, run_dir, out)
        began = time.monotonic()
        proc.send_signal(signal.SIGINT)
        left = running
        while left and time.monotonic() - began < TEARDOWN_S:
            time.sleep(0.1)
            left = self.remote_processes()
        gone = time.monotonic() - began
        self.assertEqual(left, {}, "still running %.0f s after SIGINT" % TEARDOWN_S)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.fail("the launcher did not exit within 30 s of SIGINT")
        launcher_s = time.monotonic() - began
        out.seek(0)
        tail = out.read().decode("utf-8", "replace")
        self.assertEqual(proc.returncode, 130, tail)
        # No ssh client of the job is left either (each in its own process group, in ctl).
        clients = [p for p in namespace_pids(self.net.host("ctl")) if comm(p) == "ssh"]
        self.assertEqual(clients, [])
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        self.assertFalse(summary["ok"])
        print("\nSIGINT over ssh: every remote process gone %.1f s after the signal; launcher "
              "exited (130) after %.1f s" % (gone, launcher_s), flush=True)


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/ssh_launch_test"))
