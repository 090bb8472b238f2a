"""A real Slurm cluster on one machine, for tests: munged, slurmctld and one slurmd per host, each
host a network namespace (tests/netns.py), from Debian's slurmctld, slurmd and munge packages.

    with SlurmCluster(tmp, ["h0", "h1", "h2"]) as cluster:
        job = cluster.sbatch(["--nodes=3", "--ntasks=6"], script, args)
        cluster.wait(job, ("COMPLETED",), timeout=300)

Everything lives in `tmp`: the munge key and socket (one munged, outside the namespaces: a Unix
socket on a path crosses network namespaces), slurm.conf, the controller's state, each slurmd's
spool and every log. The controller runs in a namespace of its own. Each daemon runs under
`ip netns exec` (which gives it the namespace's /etc/hosts, where every host's name resolves) and
`unshare --uts` with its host's name as host name, so that slurmd, the batch script, srun and the
tasks all see the node they are on; in that private mount namespace /sys/fs/cgroup gets a tmpfs
with a freezer hierarchy, which slurmd's cgroup plugin insists on finding (processes are tracked
by process group: ProctrackType=proctrack/pgid, TaskPlugin=task/none). Nodes claim 4 CPUs each
whatever the machine has (SlurmdParameters=config_overrides).

Needs root, `ip`, `unshare`, `mount` and the daemons; skip_reason() says what is missing.
"""

import os
import re
import shutil
import subprocess
import time

from tests import netns

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "scancel")
NODE_CPUS = 4
# The node wrapper: host name, a cgroup mount point for slurmd, then the daemon.
_NODE_SH = ('hostname "$0" && mount -t tmpfs rubato-cgroup /sys/fs/cgroup && '
            'mkdir /sys/fs/cgroup/freezer && '
            'mount -t cgroup -o freezer rubato-freezer /sys/fs/cgroup/freezer && exec "$@"')


def skip_reason():
    """None when a cluster can be made here, else why not."""
    reason = netns.skip_reason()
    if reason:
        return reason
    missing = [d for d in DAEMONS + ("unshare", "mount")
               if shutil.which(d) is None and not os.path.exists("/usr/sbin/" + d)]
    if missing:
        return ("%s not installed (Debian's slurmctld, slurmd, slurm-client and munge; "
                "./rubato setup installs them where no init system would start them)"
                % ", ".join(missing))
    return None


class SlurmError(RuntimeError):
    pass


class SlurmCluster:

    def __init__(self, tmp, hosts):
        self.tmp = tmp
        self.procs = []
        self.net = netns.Network(list(hosts) + ["ctl"])
        try:
            self.nodes = [self.net.host(h) for h in hosts]
            self.ctl = self.net.host("ctl")
            self._start(hosts)
        except Exception:
            self.close()
            raise

    def _path(self, *names):
        return os.path.join(self.tmp, *names)

    def _start(self, hosts):
        os.chmod(self.tmp, 0o755)  # munged checks the directories above its files.
        key = self._path("munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.socket = self._path("munge.socket")
        self._spawn("munged", ["munged", "-F", "--force", "--key-file", key, "-S", self.socket,
                               "--pid-file", self._path("munged.pid"), "--log-file",
                               self._path("munged.log"), "--seed-file", self._path("munged.seed")])
        self._wait_for(lambda: os.path.exists(self.socket), "munged's socket", 10)
        os.makedirs(self._path("state"))
        lines = [
            "ClusterName=rubatotest",
            "SlurmctldHost=%s(%s)" % (self.ctl, self.net.ip("ctl")),
            "AuthType=auth/munge", "CredType=cred/munge", "AuthInfo=socket=" + self.socket,
            "SlurmUser=root", "SlurmdUser=root",
            "StateSaveLocation=" + self._path("state"),
            "SlurmdSpoolDir=" + self._path("spool-%n"),
            "SlurmctldPidFile=" + self._path("slurmctld.pid"),
            "SlurmdPidFile=" + self._path("slurmd-%n.pid"),
            "SlurmctldLogFile=" + self._path("slurmctld.log"),
            "SlurmdLogFile=" + self._path("slurmd-%n.log"),
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "MpiDefault=none", "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "KillWait=30", "MinJobAge=3600", "SlurmdTimeout=120", "MessageTimeout=30",
        ]
        for h, node in zip(hosts, self.nodes):
            lines.append("NodeName=%s NodeAddr=%s CPUs=%d State=UNKNOWN" % (
                node, self.net.ip(h), NODE_CPUS))
        lines.append("PartitionName=test Nodes=%s Default=YES MaxTime=INFINITE State=UP"
                     % ",".join(self.nodes))
        self.conf = self._path("slurm.conf")
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(self._path("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._spawn("slurmctld", self.on(self.ctl, ["slurmctld", "-D", "-i", "-f", self.conf]))
        for node in self.nodes:
            os.makedirs(self._path("spool-" + node))
            self._spawn("slurmd-" + node,
                        self.on(node, ["slurmd", "-D", "-N", node, "-f", self.conf]))
        self._wait_for(self._nodes_idle, "every node idle in sinfo", 60)

    def on(self, ns, argv):
        """argv run on host `ns` with its host name and cgroup mount point."""
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", _NODE_SH,
                ns] + list(argv)

    def _spawn(self, name, argv):
        log = open(self._path(name + ".out"), "wb")
        self.procs.append((name, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                                  stderr=subprocess.STDOUT, env=getattr(
                                                      self, "env", None))))

    def _wait_for(self, ready, what, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    raise SlurmError("%s exited with status %s while waiting for %s: %s" % (
                        name, p.returncode, what, self.tail(name + ".out")))
            if ready():
                return
            time.sleep(0.5)
        raise SlurmError("no %s within %d s: %s" % (what, timeout, self.tail("slurmctld.log")))

    def tail(self, name, lines=15):
        try:
            with open(self._path(name), errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError:
            return "(no %s)" % name

    def command(self, argv, timeout=60, check=True):
        """A client command (sinfo, sbatch, scontrol, ...) run on the controller's host."""
        out = subprocess.run(["ip", "netns", "exec", self.ctl] + list(argv), env=self.env,
                             capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if check and out.returncode != 0:
            raise SlurmError("%s: %s" % (" ".join(argv), out.stderr.strip()))
        return out.stdout

    def _nodes_idle(self):
        out = self.command(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
        return sorted(states) == sorted(self.nodes) and all(
            s == "idle" for s in states.values())

    def sbatch(self, options, script, args=(), chdir=None):
        """Submits `script` with sbatch `options` and the script's `args`; returns the job id."""
        out = self.command(["sbatch", "--parsable"] + list(options)
                           + (["--chdir=" + chdir] if chdir else []) + [script] + list(args))
        return out.strip().split(";")[0]

    def job(self, job_id):
        """`scontrol show job`'s fields, {"JobState": "RUNNING", "ExitCode": "0:0", ...}."""
        out = self.command(["scontrol", "show", "job", "-o", job_id])
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id, states, timeout):
        """Waits until the job is in one of `states`; returns its fields. SlurmError naming the
        state it is in at `timeout`."""
        deadline = time.monotonic() + timeout
        fields = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(1)
        raise SlurmError("job %s not %s within %d s: it is %s (reason %s)" % (
            job_id, "/".join(states), timeout, fields.get("JobState"), fields.get("Reason")))

    def requeue(self, job_id):
        """Requeues the job and lets it start soon: see start_now."""
        self.command(["scontrol", "requeue", job_id])
        self.start_now(job_id)

    def start_now(self, job_id, timeout=60):
        """Slurm makes a requeued job wait 120 s (its begin time); a test need not. Once the job
        is pending and every node idle again, it may start 2 s later: a slurmd refuses a job
        whose credential is no newer (in whole seconds) than the revocation of its last run's."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.job(job_id).get("JobState") == "PENDING" and self._nodes_idle():
                time.sleep(2)
                self.command(["scontrol", "update", "JobId=" + job_id, "StartTime=now"])
                return
            time.sleep(0.5)
        raise SlurmError("job %s was not pending with every node idle within %d s: it is %s" % (
            job_id, timeout, self.job(job_id).get("JobState")))

    def close(self):
        """Cancels every job, stops the daemons, kills what is left of the jobs' processes (all
        name a path under `tmp`) and deletes the namespaces."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self.procs):
            try:
                self.command(["scancel", "--partition=test"], timeout=30, check=False)
                time.sleep(2)
            except subprocess.TimeoutExpired:
                pass
        for _, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        subprocess.run(["pkill", "-KILL", "-f", self.tmp], stdin=subprocess.DEVNULL,
                       capture_output=True)
        self.net.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
