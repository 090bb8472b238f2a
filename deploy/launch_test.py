#!/usr/bin/env python3
"""Whole jobs through deploy/launch.py, run against fake binaries. The launcher's modules have their
own tests beside them (deploy/launcher/*_test.py).

    python3 deploy/launch_test.py        (or: bazel test //deploy:launch_test)

The fake rubato_server and rubato_worker below speak just enough of the real ones' contract (port
file, stats file and stdout line, ending by themselves once the workers are done, JSON-lines
progress, one-line errors, exit statuses) to exercise how the launcher reacts to each way a process
can end, in a second or two and without a build. RemoteJobTest runs the same jobs, and more, across
fake hosts (directories) through fake remote shells, one that passes its arguments on as argv (as
`ip netns exec` does) and one that joins them into a command line (as ssh does); the real binaries
across real hosts (network namespaces) are tests/multihost_test.py's.
"""

import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from launcher import programs, remote  # noqa: E402
from bazel import pyunit  # noqa: E402

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch.py")

# One program for both fakes; it tells them apart by its own name. FAKE_WORKERS says what each
# worker does ("1:sigkill,2:error"; the others finish), FAKE_SERVER what server-0 does: by default
# it ends by itself, printing its statistics, once every worker has left its mark in FAKE_DIR (as
# a real server does once every worker has finished or been dropped). FAKE_HOST is set by the fake
# remote shells below; a fake records its pid, and what it read as its secret, in FAKE_DIR.
FAKE = textwrap.dedent('''\
    import json, os, signal, sys, time
    flags = dict(a[2:].partition("=")[::2] for a in sys.argv[1:] if a.startswith("--"))
    sys.stderr.write("argv: %s\\n" % json.dumps(sys.argv[1:]))
    sys.stderr.flush()
    fake_dir = os.environ["FAKE_DIR"]
    server = os.path.basename(sys.argv[0]) == "rubato_server"
    name = "server-%s" % flags.get("shard_id", "0") if server else "worker-%s" % flags["worker_id"]
    with open(os.path.join(fake_dir, ".pid-" + name), "w") as f:
        f.write("%d %s" % (os.getpid(), os.environ.get("FAKE_HOST", "-")))
    os.replace(os.path.join(fake_dir, ".pid-" + name), os.path.join(fake_dir, "pid-" + name))
    if "auth_secret_file" in flags:
        path = flags["auth_secret_file"]
        with open(path, "rb") as f:
            secret = f.read()
        with open(os.path.join(fake_dir, ".secret-" + name), "w") as f:
            json.dump({"path": path, "hex": secret.hex(), "mode": os.stat(path).st_mode & 0o777}, f)
        os.replace(os.path.join(fake_dir, ".secret-" + name),
                   os.path.join(fake_dir, "secret-" + name))

    if server:
        def stats():
            record = {"applied_updates": 7, "dropped_workers": 1}
            if "stats_file" in flags:
                with open(flags["stats_file"], "w") as f:
                    json.dump(record, f)
            print(json.dumps(dict(record, event="stats")), flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, lambda *_: stats())
        if "port_file" in flags:
            with open(flags["port_file"], "w") as f:
                f.write("127.0.0.1:1\\n")
        what = os.environ.get("FAKE_SERVER", "")
        if what == "error":
            time.sleep(0.3)
            sys.stderr.write("rubato_server: error: disk on fire\\n")
            sys.exit(2)
        if what == "early":  # Ends by itself, status 0, while workers still run.
            time.sleep(0.3)
            sys.exit(0)
        died = os.path.join(fake_dir, "died-" + name)
        if what == "dies-once" and not os.path.exists(died):  # SIGKILLed; its restart lives.
            open(died, "w").close()
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        rolled = os.path.join(fake_dir, "rolled-" + name)
        if what == "rolls-back-twice" and len([m for m in os.listdir(fake_dir)
                                               if m.startswith("rolled-")]) < 2:
            open(rolled + "-%d" % os.getpid(), "w").close()
            time.sleep(0.3)
            sys.exit(75)  # Stopped to roll back (bsp): its supervisor starts it again.
        while True:
            time.sleep(0.05)
            marks = [m for m in os.listdir(fake_dir) if m.startswith("left-")]
            if what != "linger" and len(marks) >= int(flags["num_workers"]):
                stats()

    me = int(flags["worker_id"])
    what = dict(item.split(":") for item in os.environ.get("FAKE_WORKERS", "").split(",") if item)
    what = what.get(str(me), "finish")
    def out(**record):
        print(json.dumps(record), flush=True)
    def leave():  # What the servers would notice: this worker finished, or its lease ran out.
        open(os.path.join(fake_dir, "left-%d" % me), "w").close()
    out(event="start", steps=10, batch_size=8, argv=sys.argv[1:])
    sys.stderr.write("I worker-%d: connected\\n" % me)
    sys.stderr.flush()
    time.sleep(0.2)
    out(event="step", step=5, epoch=0, loss=1.0)
    if what == "sigkill":
        # A line that mentions an error, quoting another process: not this worker's own error.
        sys.stderr.write("W worker-%d: pull retried: rubato_server: error: busy\\n" % me)
        sys.stderr.flush()
        leave()
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "crash":
        sys.stderr.write("rubato_worker: injected crash at step 5\\n")
        leave()
        sys.exit(3)
    if what == "error":
        sys.stderr.write("rubato_worker: error: my own problem\\n")
        sys.stderr.write("W worker-%d: after that, server said rubato_server: error: x\\n" % me)
        leave()
        sys.exit(1)
    if what == "slow":  # Finishes, but only after a server has had time to die and come back.
        time.sleep(1.5)
    if what == "hang":
        time.sleep(60)
    if what == "stubborn":  # Ignores SIGTERM: only SIGKILL ends it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    if what == "ring":  # Allreduce: this rank notices its dead peer a while later.
        time.sleep(0.8)
        sys.stderr.write("rubato_worker: error: peer 1 (127.0.0.1:2) is gone\\n")
        leave()
        sys.exit(1)
    time.sleep(0.8)  # Finishes well after any other worker has died.
    out(event="eval", step=10, test_accuracy=0.9)
    out(event="done", steps=10, test_accuracy=0.9)
    leave()
''')

# Fake remote shells: `RSH HOST ARGS...` runs ARGS in $FAKE_ROOT/HOST (a "host" is a directory:
# relative paths such as --remote_bin_dir bin resolve there, so a host can lack a file), with
# FAKE_HOST=HOST. A host that has no directory is unknown; one named down* does not answer. The
# exec one passes ARGS on as argv (as `ip netns exec` does); the ssh one joins them with spaces
# into one command line for sh (as ssh does). Each logs its argv to $FAKE_ROOT/rsh.log. On the fake
# hosts, `getent hosts NAME` knows the host directories, except those that hold a file `noname`.
FAKE_RSH = textwrap.dedent('''\
    #!/bin/sh
    host=$1; shift
    for a in "$@"; do printf '%%s\\0' "$a"; done >>"$FAKE_ROOT/rsh.log"; printf '\\n' >>"$FAKE_ROOT/rsh.log"
    case "$host" in
      down*) echo "fake_rsh: connect to host $host port 22: No route to host" >&2; exit 255;;
    esac
    [ -d "$FAKE_ROOT/$host" ] || { echo "fake_rsh: Could not resolve hostname $host" >&2; exit 255; }
    cd "$FAKE_ROOT/$host" || exit 255
    export FAKE_HOST="$host" PATH="$FAKE_ROOT/.bin:$PATH"
    %s
''')
FAKE_RSH_EXEC = FAKE_RSH % 'exec "$@"'
FAKE_GETENT = textwrap.dedent('''\
    #!/bin/sh
    [ "$1" = hosts ] && [ -d "$FAKE_ROOT/$2" ] && [ ! -e "$FAKE_ROOT/$2/noname" ] && echo "10.0.0.1 $2"
    ''')
FAKE_RSH_SSH = FAKE_RSH % 'exec sh -c "$*"'


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
        self.fake_dir = tempfile.mkdtemp(dir=self.tmp.name)
        env = dict(os.environ, FAKE_WORKERS=workers, FAKE_SERVER=server, FAKE_DIR=self.fake_dir)
        done = subprocess.run(
            [sys.executable, LAUNCH, "--bin_dir", self.bin_dir, "--run_dir", self.run_dir,
             "--refresh", "0.05"] + flags,
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
        try:
            with open(os.path.join(self.run_dir, "summary.json")) as f:
                summary = json.load(f)
        except FileNotFoundError:  # Bad arguments, a failed preflight: nothing was started.
            summary = None
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
        # The server ended by itself once the workers were done: done, not failed.
        self.assertEqual(self.states(summary, "server_outcomes"), ["done"])
        self.assertEqual(summary["server_outcomes"][0]["exit_status"], 0)
        self.assertEqual(summary["failed_workers"], 0)
        self.assertEqual(summary["applied_updates"], 7)  # The server's stats file.
        self.assertIn("rubato: done in", out)
        self.assertEqual([o["host"] for o in summary["worker_outcomes"]], ["127.0.0.1"] * 2)

    def test_server_that_does_not_end_is_stopped_after_the_grace(self):
        # An older server that runs until stopped: the lease and 5 s later it is stopped, which is
        # no failure, and its stats (written at SIGTERM) still count.
        start = time.monotonic()
        rc, out, err, summary = self.launch(["--workers", "1", "--lease_ms", "100"],
                                            server="linger")
        self.assertEqual(rc, 0, err)
        self.assertGreaterEqual(time.monotonic() - start, 5.0)
        self.assertEqual(self.states(summary, "server_outcomes"), ["stopped"])
        self.assertEqual(summary["applied_updates"], 7)

    def test_server_ending_before_the_workers_fails(self):
        # A server that ends by itself while workers still run: once the workers have not ended
        # within the grace (lease + 5 s), the server has failed and the job ends.
        rc, out, err, summary = self.launch(["--workers", "2", "--lease_ms", "100"],
                                            workers="0:hang,1:hang", server="early")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary, "server_outcomes"), ["failed"])
        self.assertEqual(summary["server_outcomes"][0]["reason"],
                         "exited with status 0 before the job ended")
        self.assertEqual(self.states(summary), ["stopped", "stopped"])

    def test_killed_worker_does_not_end_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--lease_ms", "2000"],
                                            workers="1:sigkill")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["done", "failed", "done"])
        self.assertEqual(summary["failed_workers"], 1)
        killed = summary["worker_outcomes"][1]
        self.assertEqual(killed["reason"], "killed by SIGKILL (signal 9)")  # Not the W line.
        self.assertEqual((killed["exit_status"], killed["signal"]), (-9, "SIGKILL"))
        self.assertEqual(self.states(summary, "server_outcomes"), ["done"])
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

    def test_restart_servers_restarts_a_dead_shard_from_its_checkpoints(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        rc, out, err, summary = self.launch(
            ["--workers", "2", "--servers", "2", "--restart_servers", "1", "--checkpoint_dir",
             ckpt, "--checkpoint_every_steps", "5"], workers="0:slow,1:slow", server="dies-once")
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary), ["done", "done"])
        self.assertEqual(self.states(summary, "server_outcomes"), ["done", "done"])
        self.assertEqual(self.states(summary, "restarted_servers"), ["restarted", "restarted"])
        self.assertEqual(summary["restarted_servers"][0]["signal"], "SIGKILL")
        self.assertIn("restarting it on 127.0.0.1:1 from its checkpoints (1 of 1)", out + err)
        argv = self.argv("server-1.restart-1")
        self.assertIn("--listen=127.0.0.1:1", argv)  # The address the workers know.
        self.assertIn("--checkpoint_dir=" + ckpt, argv)
        self.assertIn("--checkpoint_every_steps=5", argv)
        self.assertFalse([a for a in argv if a.startswith("--port_file")])

    def test_a_shard_that_stops_to_roll_back_is_restarted_without_counting_against_n(self):
        ckpt = os.path.join(self.tmp.name, "ckpt")
        rc, out, err, summary = self.launch(
            ["--workers", "2", "--restart_servers", "1", "--checkpoint_dir", ckpt],
            workers="0:slow,1:slow", server="rolls-back-twice")
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary, "server_outcomes"), ["done"])
        self.assertEqual(self.states(summary, "restarted_servers"), ["restarted", "restarted"])
        self.assertEqual([r["exit_status"] for r in summary["restarted_servers"]], [75, 75])
        self.assertIn("server-0 stopped to roll back to another shard's checkpoint; restarting it",
                      out + err)
        self.assertIn("--checkpoint_dir=" + ckpt, self.argv("server-0.rollback-2"))

    def test_a_roll_back_without_a_supervisor_ends_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "2"], workers="0:hang,1:hang",
                                            server="rolls-back-twice")
        self.assertEqual(rc, 1)
        self.assertEqual(summary["server_outcomes"][0]["exit_status"], 75)

    def test_a_checkpoint_dir_of_an_earlier_job_needs_resume(self):
        ckpt = os.path.join(self.tmp.name, "old-job")
        os.makedirs(ckpt)
        open(os.path.join(ckpt, "shard-0-step-000000000100.ckpt"), "w").close()
        rc, out, err, summary = self.launch(["--workers", "1", "--checkpoint_dir", ckpt])
        self.assertEqual(rc, 2)
        self.assertIn("holds checkpoints of an earlier job (shard-0-step-000000000100.ckpt): "
                      "pass --resume to continue it", err)
        rc, out, err, summary = self.launch(
            ["--workers", "1", "--checkpoint_dir", ckpt, "--resume"])
        self.assertEqual(rc, 0, err)
        empty = os.path.join(self.tmp.name, "empty")
        rc, out, err, summary = self.launch(
            ["--workers", "1", "--checkpoint_dir", empty, "--resume"])
        self.assertEqual(rc, 2)
        self.assertIn("--resume: no checkpoints in --checkpoint_dir", err)
        rc, out, err, summary = self.launch(["--workers", "1", "--resume"])
        self.assertEqual(rc, 2)
        self.assertIn("--resume needs --checkpoint_dir", err)

    def test_restart_servers_needs_a_checkpoint_dir(self):
        rc, out, err, summary = self.launch(["--workers", "1", "--restart_servers", "1"])
        self.assertEqual(rc, 2)
        self.assertIn("--restart_servers needs --checkpoint_dir", err)

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
        job_ids = set()
        for name in ("server-0", "worker-0", "worker-1"):
            argv = self.argv(name)
            self.assertIn("--auth_secret_file=" + secret, argv, name)
            self.assertIn("--max_message_mb=97", argv, name)
            self.assertNotIn("--insecure", argv, name)
            job_ids |= {a for a in argv if a.startswith("--job_id=rubato-")}
        self.assertEqual(len(job_ids), 1, job_ids)  # One job id, the same for every process.
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
        first = [a for a in self.argv("worker-0") if a.startswith("--job_id=")]
        # The same secret file again: a new job id, so the first job's tokens are worthless here.
        rc, out, err, summary = self.launch(["--workers", "1", "--auth_secret_file", given,
                                             "--max_message_mb", "64"])
        self.assertEqual(rc, 0, err)
        second = [a for a in self.argv("worker-0") if a.startswith("--job_id=")]
        self.assertEqual((len(first), len(second)), (1, 1))
        self.assertNotEqual(first, second)

    def test_insecure(self):
        rc, out, err, summary = self.launch(["--workers", "1", "--mode", "allreduce",
                                             "--insecure"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.secret")))
        argv = self.argv("worker-0")
        self.assertIn("--insecure", argv)
        self.assertFalse([a for a in argv if a.startswith(("--auth_secret_file", "--job_id"))])


def _alive(pid):
    """Whether process `pid` still runs (a zombie does not count)."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


class RemoteJobTest(JobTest):
    """Whole jobs across fake hosts: directories under FAKE_ROOT, reached through a fake rsh."""

    HOSTS = ("hosta", "hostb", "hostc")

    def setUp(self):
        super().setUp()
        self.root = os.path.join(self.tmp.name, "hosts")
        for host in self.HOSTS:
            self.make_host(host)
        os.makedirs(os.path.join(self.root, ".bin"))
        for name, text in (("rsh_exec", FAKE_RSH_EXEC), ("rsh_ssh", FAKE_RSH_SSH),
                           ("hosts/.bin/getent", FAKE_GETENT)):
            path = os.path.join(self.tmp.name, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        self.rsh_exec = os.path.join(self.tmp.name, "rsh_exec")
        self.rsh_ssh = os.path.join(self.tmp.name, "rsh_ssh")
        self.hostfile = os.path.join(self.tmp.name, "hosts.txt")
        self.write_hostfile("hosta slots=2\nhostb\nhostc  # three hosts\n")

    def make_host(self, host, lacks=()):
        d = os.path.join(self.root, host)
        for role in ("server", "worker"):
            os.makedirs(os.path.join(d, "bin", role))
            if "rubato_" + role not in lacks:
                os.symlink(os.path.join(self.bin_dir, role, "rubato_" + role),
                           os.path.join(d, "bin", role, "rubato_" + role))
        os.makedirs(os.path.join(d, "data"))
        for name in programs.DATA_FILES:
            if name not in lacks:
                open(os.path.join(d, "data", name), "w").close()

    def write_hostfile(self, text):
        with open(self.hostfile, "w") as f:
            f.write(text)

    def test_restart_servers_restarts_a_dead_shard_from_its_checkpoints(self):
        # Across hosts a dead shard is started again on its host, through the remote shell, on
        # its fixed ports; its --checkpoint_dir is that host's.
        rc, out, err, summary = self.launch(
            ["--workers", "2", "--servers", "2", "--restart_servers", "1", "--checkpoint_dir",
             "ckpt", "--checkpoint_every_steps", "5"], workers="0:slow,1:slow", server="dies-once")
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary), ["done", "done"])
        self.assertEqual(self.states(summary, "server_outcomes"), ["done", "done"])
        self.assertEqual(self.states(summary, "restarted_servers"), ["restarted", "restarted"])
        self.assertEqual(summary["restarted_servers"][0]["signal"], "SIGKILL")
        self.assertIn("restarting it on hostb:29501 from its checkpoints (1 of 1)", out + err)
        self.assertEqual(self.pids()["server-1"][1], "hostb")
        argv = self.argv("server-1.restart-1")
        self.assertIn("--listen=0.0.0.0:29501", argv)  # The address the workers know.
        self.assertIn("--checkpoint_dir=ckpt", argv)

    # A shard that stops to roll back (exit 75) is restarted on its host as locally: the case
    # above, inherited.
    # The remote hosts' directories are theirs: the launcher cannot look into them.
    test_a_checkpoint_dir_of_an_earlier_job_needs_resume = None

    def remote_flags(self, rsh=None):
        # --server_slots 0: the placements these cases were written for (servers beside workers).
        return ["--hostfile", self.hostfile, "--rsh", rsh or self.rsh_exec,
                "--remote_bin_dir", "bin", "--data_dir", "data", "--preflight_timeout", "10",
                "--server_slots", "0"]

    def launch(self, flags, workers="", server="", timeout=40, rsh=None):
        os.environ["FAKE_ROOT"] = self.root
        return super().launch(self.remote_flags(rsh) + flags, workers, server, timeout)

    def pids(self):
        """name -> (pid, host) of every fake process that started."""
        out = {}
        for name in os.listdir(self.fake_dir):
            if name.startswith("pid-"):
                with open(os.path.join(self.fake_dir, name)) as f:
                    pid, host = f.read().split()
                out[name[len("pid-"):]] = (int(pid), host)
        return out

    def argv(self, name):
        with open(os.path.join(self.run_dir, name + ".log")) as f:
            for line in f:
                if line.startswith("argv: "):
                    return json.loads(line[len("argv: "):])
        self.fail("no argv line in %s.log" % name)

    def assert_all_gone(self, within=8.0):
        deadline = time.monotonic() + within
        while True:
            alive = {n: p for n, (p, _) in self.pids().items() if _alive(p)}
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.assertEqual(alive, {}, "fake remote processes still running")

    # The local-mode cases, run again across hosts (JobTest's tests, with these flags).

    def test_all_finish(self):
        rc, out, err, summary = self.launch(["--servers", "2", "--workers", "3"])
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary), ["done"] * 3)
        self.assertEqual(self.states(summary, "server_outcomes"), ["done", "done"])
        self.assertEqual([o["host"] for o in summary["worker_outcomes"]],
                         ["hosta", "hosta", "hostb"])
        self.assertEqual([o["host"] for o in summary["server_outcomes"]], ["hosta", "hostb"])
        self.assertEqual(summary["applied_updates"], 14)  # From each server's stdout line.
        self.assertEqual(summary["hosts"], [{"host": "hosta", "slots": 2},
                                            {"host": "hostb", "slots": 1},
                                            {"host": "hostc", "slots": 1}])
        pids = self.pids()
        self.assertEqual({n: h for n, (_, h) in pids.items()},
                         {"server-0": "hosta", "server-1": "hostb", "worker-0": "hosta",
                          "worker-1": "hosta", "worker-2": "hostb"})
        self.assertEqual(self.argv("server-1")[:3],
                         ["--shard_id=1", "--num_shards=2", "--listen=0.0.0.0:29501"])
        for w in range(3):
            argv = self.argv("worker-%d" % w)
            self.assertIn("--servers=hosta:29500,hostb:29501", argv)
            self.assertIn("--data_dir=data", argv)
            self.assertFalse([a for a in argv if a.startswith("--listen")])
        # The table has a host column.
        final_table = out[out.rindex("worker   host"):]
        self.assertRegex(final_table, r"\n0 +hosta +done .*\n1 +hosta +done .*\n2 +hostb +done ")
        self.assert_all_gone(within=0)

    def test_secret_and_message_limit_reach_every_process(self):
        rc, out, err, summary = self.launch(["--workers", "2", "--layers", "784-4096-4096-10",
                                             "--map_by", "host"])
        self.assertEqual(rc, 0, err)
        with open(os.path.join(self.run_dir, "job.secret")) as f:
            secret = f.read()
        for name in ("server-0", "worker-0", "worker-1"):
            argv = self.argv(name)
            self.assertIn("--max_message_mb=97", argv, name)
            self.assertNotIn("--insecure", argv, name)
            with open(os.path.join(self.fake_dir, "secret-" + name)) as f:
                got = json.load(f)
            # Each process read the job's secret from a file of its own, mode 0600, named on its
            # command line, and that file's directory is gone now.
            self.assertEqual(bytes.fromhex(got["hex"]).decode(), secret, name)
            self.assertEqual(got["mode"], 0o600, name)
            self.assertIn("--auth_secret_file=" + got["path"], argv)
            self.assertNotEqual(os.path.dirname(got["path"]), os.path.abspath(self.run_dir))
            self.assertFalse(os.path.exists(os.path.dirname(got["path"])), name)
        # The secret appears on no command line that the rsh was given (nor encoded).
        with open(os.path.join(self.root, "rsh.log"), "rb") as f:
            rsh_log = f.read()
        self.assertNotIn(secret.encode(), rsh_log)
        self.assertNotIn(remote.encode_secret(secret.encode()), rsh_log)

    def test_given_secret_and_message_limit(self):
        given = os.path.join(self.tmp.name, "my.secret")
        with open(given, "wb") as f:
            f.write(b"\x00\n" * 16)  # Any bytes.
        rc, out, err, summary = self.launch(["--workers", "1", "--auth_secret_file", given,
                                             "--max_message_mb", "64"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.secret")))
        for name in ("server-0", "worker-0"):
            self.assertIn("--max_message_mb=64", self.argv(name))
            with open(os.path.join(self.fake_dir, "secret-" + name)) as f:
                self.assertEqual(bytes.fromhex(json.load(f)["hex"]), b"\x00\n" * 16)

    def test_insecure(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--mode", "allreduce",
                                             "--insecure", "--base_port", "7000"])
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(os.path.join(self.run_dir, "job.secret")))
        for w, host in enumerate(["hosta", "hosta", "hostb"]):
            argv = self.argv("worker-%d" % w)
            self.assertIn("--insecure", argv)
            self.assertIn("--peers=hosta:7000,hosta:7001,hostb:7002", argv)
            self.assertIn("--listen=0.0.0.0:%d" % (7000 + w), argv)
            self.assertFalse([a for a in argv if a.startswith("--auth_secret_file")])
        self.assertEqual(summary["server_outcomes"], [])

    def test_ssh_style_rsh(self):
        # A remote shell that joins its arguments into one command line: the wrapper is quoted
        # once more, and odd flag values still arrive intact.
        odd = "it's \"odd\" $HOME `x` *"
        rc, out, err, summary = self.launch(["--workers", "2", "--delay_distribution", odd],
                                            rsh=self.rsh_ssh)
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.states(summary), ["done", "done"])
        for w in range(2):
            self.assertIn("--delay_distribution=" + odd, self.argv("worker-%d" % w))
        with open(os.path.join(self.root, "rsh.log"), "rb") as f:
            calls = [c.split(b"\0")[:-1] for c in f.read().split(b"\n") if c]
        # The probe, the checks and the processes: each a single command string after the host.
        self.assertEqual(calls[0], [b"echo", b"'rubato-probe'"])
        self.assertTrue(all(len(c) == 1 or c[0] == b"echo" for c in calls), calls)

    def test_exec_style_rsh_passes_argv(self):
        rc, out, err, summary = self.launch(["--workers", "1"])
        self.assertEqual(rc, 0, err)
        with open(os.path.join(self.root, "rsh.log"), "rb") as f:
            calls = [c.split(b"\0")[:-1] for c in f.read().split(b"\n") if c]
        self.assertTrue(all(c[:2] == [b"sh", b"-c"] and len(c) == 3 for c in calls[1:]), calls)

    def test_stderr_is_prefixed(self):
        rc, out, err, summary = self.launch(["--workers", "3"])
        self.assertEqual(rc, 0, err)
        with open(os.path.join(self.run_dir, "job.log")) as f:
            job_log = f.read()
        for w, host in enumerate(["hosta", "hosta", "hostb"]):
            line = "[worker-%d@%s] I worker-%d: connected\n" % (w, host, w)
            self.assertIn(line, job_log)
            self.assertIn(line, out)  # Echoed above the table.
        self.assertIn("[server-0@hosta] argv: ", job_log)
        # Each process's own log has its lines as they were.
        with open(os.path.join(self.run_dir, "worker-2.log")) as f:
            self.assertIn("I worker-2: connected\n", f.read().splitlines(True))

    def test_killed_worker_does_not_end_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--lease_ms", "2000"],
                                            workers="1:sigkill")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["done", "failed", "done"])
        killed = summary["worker_outcomes"][1]
        # The wrapper's status 137 reads as the signal.
        self.assertEqual(killed["reason"], "killed by SIGKILL (signal 9)")
        self.assertEqual((killed["exit_status"], killed["signal"]), (-9, "SIGKILL"))
        self.assertIn("1 of 3 worker(s) failed: worker-1@hosta killed by SIGKILL (signal 9)", err)

    def test_allreduce_ranks_end_by_themselves(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--mode", "allreduce"],
                                            workers="0:ring,1:sigkill,2:ring")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["failed", "failed", "failed"])
        self.assertIn("3 of 3 worker(s) failed, first worker-1@hosta killed by SIGKILL", err)

    def test_server_failure_ends_the_job(self):
        rc, out, err, summary = self.launch(["--workers", "2"], workers="0:hang,1:hang",
                                            server="error")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["stopped", "stopped"])
        self.assertIn("error: server-0@hosta exited with status 2: rubato_server: error: disk on "
                      "fire", err)
        self.assert_all_gone(within=0)

    def test_preflight_reports_every_host(self):
        self.make_host("hostd", lacks=("rubato_worker", "t10k-labels-idx1-ubyte.gz"))
        self.make_host("hoste", lacks=("rubato_server",))
        self.make_host("hostg")
        open(os.path.join(self.root, "hostg", "noname"), "w").close()  # Its name resolves nowhere.
        self.write_hostfile("hosta\nhostd\nhoste\nnosuchhost\ndownf\nhostg\n")
        rc, out, err, summary = self.launch(["--servers", "2", "--workers", "6",
                                             "--server_hosts", "hoste,hostg"])
        self.assertEqual(rc, 2, err)
        self.assertIsNone(summary)
        self.assertIn("preflight failed on 6 of 6 host(s); nothing was started:", err)
        self.assertIn("  hosta: cannot resolve: hostg\n", err)
        self.assertIn("  hostd: not executable: bin/worker/rubato_worker\n", err)
        self.assertIn("  hostd: missing: data/t10k-labels-idx1-ubyte.gz\n", err)
        self.assertIn("  hoste: not executable: bin/server/rubato_server\n", err)
        self.assertIn("  nosuchhost: unreachable through --rsh '%s' (exited with status 255): "
                      "fake_rsh: Could not resolve hostname nosuchhost\n" % self.rsh_exec, err)
        self.assertIn("  downf: unreachable through --rsh", err)
        self.assertNotIn("hosta: not executable", err)
        self.assertEqual(self.pids(), {})
        self.assertFalse(os.path.exists(self.run_dir))

    def test_preflight_checks_only_what_a_host_needs(self):
        # A host that only runs a server needs no worker binary and no data.
        self.make_host("hostd", lacks=("rubato_worker",) + programs.DATA_FILES)
        self.write_hostfile("hosta\nhostd\n")
        rc, out, err, summary = self.launch(["--workers", "1", "--server_hosts", "hostd",
                                             "--worker_hosts", "hosta"])
        self.assertEqual(rc, 0, err)
        self.assertEqual(self.pids()["server-0"][1], "hostd")

    def test_teardown_at_timeout(self):
        rc, out, err, summary = self.launch(["--workers", "3", "--timeout", "2"],
                                            workers="0:hang,1:hang,2:stubborn")
        self.assertEqual(rc, 1)
        self.assertEqual(self.states(summary), ["stopped"] * 3)
        self.assertEqual(self.states(summary, "server_outcomes"), ["stopped"])
        self.assertEqual(len(self.pids()), 4)
        self.assert_all_gone(within=0)  # Even the one that ignores SIGTERM.

    def start_and_wait(self, workers, n):
        """Starts a job whose n fake processes hang; returns the launcher's Popen once all run."""
        self.fake_dir = tempfile.mkdtemp(dir=self.tmp.name)
        env = dict(os.environ, FAKE_WORKERS=workers, FAKE_DIR=self.fake_dir, FAKE_ROOT=self.root)
        p = subprocess.Popen([sys.executable, LAUNCH, "--bin_dir", self.bin_dir, "--run_dir",
                              self.run_dir, "--refresh", "0.05"] + self.remote_flags()
                             + ["--workers", str(n - 1)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.addCleanup(lambda: p.poll() is None and p.kill())
        deadline = time.monotonic() + 20
        while len(self.pids()) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(len(self.pids()), n)
        return p

    def test_teardown_on_sigint(self):
        p = self.start_and_wait("0:hang,1:hang,2:stubborn", 4)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=20)
        self.assertEqual(p.returncode, 130, err)
        self.assertIn(b"error: interrupted", err)
        self.assert_all_gone(within=0)

    def test_teardown_when_the_launcher_is_killed(self):
        p = self.start_and_wait("0:hang,1:hang,2:stubborn", 4)
        secret_dirs = []
        for name in ("server-0", "worker-0"):
            with open(os.path.join(self.fake_dir, "secret-" + name)) as f:
                secret_dirs.append(os.path.dirname(json.load(f)["path"]))
        p.kill()  # SIGKILL: no clean-up of its own. Its stdin pipes close with it.
        p.wait()
        self.assert_all_gone(within=8)  # SIGTERM at once; the stubborn one SIGKILL after 5 s.
        deadline = time.monotonic() + 3
        while any(os.path.exists(d) for d in secret_dirs) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual([d for d in secret_dirs if os.path.exists(d)], [])


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launch_test"))
