"""Replays deploy/k8s's jobs (make_job.py's JobSets) as Kubernetes would run them, without a
cluster. The JobSet becomes its Jobs and headless Service as the JobSet controller makes them
(render.jobset_children); every pod of every Indexed Job (one per completion index) runs the
container's exact command, arguments and environment ($(VAR) expanded as the kubelet does,
JOB_COMPLETION_INDEX and downward-API fields filled in) on a host of its own, a Linux network
namespace (tests/netns.py), where the headless Service's DNS names (rubato-bsp-ps-0-0.rubato-bsp,
...) resolve. Each container sees the image's /opt/rubato/bin, its ConfigMap and Secret volumes
with the modes and owners the kubelet gives them, the job's claim and its own emptyDir at /tmp, in
a mount namespace of its own, and runs as the pod's user, groups and capabilities
(tests/k8s_pod_launcher.py). A "kubelet" host sends each pod the readiness probe's gRPC health
check (tests/grpc_health_probe.py); the workers start once every server is ready (dependsOn Ready).

A failed pod is handled as the Job controller does (Controller): its podFailurePolicy decides
(render.pod_failure_action) whether it is ignored, counted against its index's
backoffLimitPerIndex or fails the job, and a replacement with the same host name starts after the
back-off (Kubernetes' 10 s doubling, scaled down 10x here) once the failed one is gone
(podReplacementPolicy Failed).

Checks, per job: every index succeeds exactly once (the servers after the workers), the workers
reach the expected test accuracy and final step, every pod's health port answered SERVING, the
outputs are on the claim; with failures injected (an eviction of a server mid-job, the roll-back
of the other shard, a worker killed), the job still ends so, with the failures counted as the
policy says. Needs root and iproute2 (skipped, with the reason, where namespaces cannot be made)
and deploy/k8s/validate/node_modules (fails without them: ./rubato setup).
"""

import base64
import json
import os
import random
import re
import shutil
import signal
import string
import subprocess
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, RUNFILES)
import netns  # noqa: E402
from bazel import pyunit  # noqa: E402
from deploy.k8s import render  # noqa: E402

LAUNCHER = os.path.join(HERE, "k8s_pod_launcher.py")
PROBE = os.path.join(HERE, "grpc_health_probe.py")
NAMESPACE = "default"
CLUSTER_DOMAIN = "cluster.local"
# The image (deploy/image): the binaries in /opt/rubato/bin, its only ENV.
IMAGE_FILES = {"/opt/rubato/bin/rubato_server": "server/rubato_server",
               "/opt/rubato/bin/rubato_worker": "worker/rubato_worker",
               "/opt/rubato/bin/rubato_worker_avx2": "worker/rubato_worker_avx2"}
IMAGE_ENV = {"PATH": "/opt/rubato/bin"}

# 1 epoch of Fashion-MNIST, MLP 784-256-10, 3 workers x batch 64, SGD at 0.1 (jobs/bsp.yaml):
# measured 0.8034 under bsp and 0.8030 under allreduce (deterministic: each sums in a fixed
# order; the stragglers job only delays), 0.826-0.832 under ssp:2 (arrival order varies). 0.78
# leaves room for a different libm or Eigen build, and still fails a job that did not learn (0.10)
# or lost a worker's updates for long.
MIN_ACCURACY = 0.78
JOB_DEADLINE_S = 300      # every worker done (about 15 s each on an idle 2-core machine)
SERVER_EXIT_S = 60        # servers exit by themselves this soon after the last worker
READY_S = 60              # servers ready (SERVING) this soon after they start
STEPS = -(-60000 // (3 * 64))  # 1 epoch, 3 workers of 64: the job's final step (313)
# The Job controller's back-off before replacing a counted failure: 10 s, doubling (up to 6 min);
# scaled down 10x so that the test stays short. An ignored failure is replaced at once.
BACKOFF_S = 1.0


# --- what Kubernetes would make of the objects --------------------------------------------------

def expand(text, mapping):
    """$(VAR) expansion as Kubernetes does it (third_party/forked/golang/expansion): $(NAME)
    becomes the value when NAME is defined and stays as it is otherwise, $$ is a literal $, and
    any other $ is kept."""
    out, checkpoint, cursor = [], 0, 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            rest = text[cursor + 1:]
            if rest[0] == "$":
                out.append("$")
                advance = 1
            elif rest[0] == "(":
                end = rest.find(")")
                if end < 0:
                    out.append("$(")
                    advance = 1
                else:
                    name = rest[1:end]
                    out.append(mapping[name] if name in mapping else "$(%s)" % name)
                    advance = end + 1
            else:
                out.append("$" + rest[0])
                advance = 1
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


class Pod:
    """One pod that a Job would create, with what its container needs."""

    def __init__(self, job, index, objects):
        self.job_object = job
        self.job = job["metadata"]["name"]
        self.index = index
        self.hostname = "%s-%d" % (self.job, index)  # an Indexed Job's pods are named so
        self.name = "%s-%d-%s" % (self.job, index, "".join(
            random.choice(string.ascii_lowercase + string.digits) for _ in range(5)))
        template = job["spec"]["template"]
        self.spec = template["spec"]
        index_key = "batch.kubernetes.io/job-completion-index"
        self.labels = dict(template["metadata"].get("labels", {}))
        self.labels.update({index_key: str(index), "batch.kubernetes.io/job-name": self.job,
                            "job-name": self.job})
        self.annotations = dict(template["metadata"].get("annotations", {}))
        self.annotations[index_key] = str(index)
        self.subdomain = self.spec.get("subdomain")
        self.role = self.labels.get("app.kubernetes.io/component")
        self.objects = objects
        self.ip = None
        if len(self.spec["containers"]) != 1 or self.spec.get("initContainers"):
            raise ValueError("%s: the replay runs pods of exactly one container" % self.job)
        self.container = self.spec["containers"][0]
        # The Job controller adds JOB_COMPLETION_INDEX to every container, from the annotation.
        self.env_list = list(self.container.get("env", [])) + [{
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['%s']" % index_key}}}]

    def field(self, path):
        """A downward-API fieldRef's value."""
        m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']*)'\]", path)
        if m:
            return (self.labels if m.group(1) == "labels" else self.annotations).get(m.group(2), "")
        values = {"metadata.name": self.name, "metadata.namespace": NAMESPACE,
                  "metadata.uid": "00000000-0000-4000-8000-%012d" % self.index,
                  "spec.nodeName": "replay-node", "spec.serviceAccountName": "default",
                  "status.hostIP": self.ip, "status.podIP": self.ip, "status.podIPs": self.ip}
        if path not in values:
            raise ValueError("%s: fieldRef %s is not emulated" % (self.hostname, path))
        return values[path]

    def key_ref(self, kind, ref):
        obj = render.find(self.objects, kind, ref["name"])
        data = (obj or {}).get("data", {})
        if ref["key"] not in data:
            raise ValueError("%s: no %s %s key %s" % (self.hostname, kind, ref["name"], ref["key"]))
        value = data[ref["key"]]
        return base64.b64decode(value).decode() if kind == "Secret" else value

    def env(self):
        """The container's environment as the kubelet builds it (each value may refer to the ones
        before it), without the image's."""
        env = {}
        for var in self.env_list:
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif "valueFrom" in var:
                source = var["valueFrom"]
                if "fieldRef" in source:
                    env[var["name"]] = self.field(source["fieldRef"]["fieldPath"])
                elif "configMapKeyRef" in source:
                    env[var["name"]] = self.key_ref("ConfigMap", source["configMapKeyRef"])
                elif "secretKeyRef" in source:
                    env[var["name"]] = self.key_ref("Secret", source["secretKeyRef"])
                else:
                    raise ValueError("%s: env %s: %s is not emulated"
                                     % (self.hostname, var["name"], sorted(source)))
            else:
                env[var["name"]] = ""
        if self.container.get("envFrom"):
            raise ValueError("%s: envFrom is not emulated" % self.hostname)
        return env

    def argv(self):
        env = self.env()
        command = self.container.get("command")
        if not command:
            raise ValueError("%s: no command: the image has no entrypoint" % self.hostname)
        return [expand(a, env) for a in command + self.container.get("args", [])]

    def identity(self):
        """(uid, gid, supplementary groups) of the container's process."""
        pod_sc = self.spec.get("securityContext", {})
        sc = dict(pod_sc)
        sc.update(self.container.get("securityContext", {}))
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", 0)
        if uid is None:
            raise ValueError("%s: no runAsUser: the image's user is not emulated" % self.hostname)
        if sc.get("runAsNonRoot") and uid == 0:
            raise ValueError("%s: runAsNonRoot with runAsUser 0: the kubelet refuses"
                             % self.hostname)
        groups = {gid}
        if "fsGroup" in pod_sc:
            groups.add(pod_sc["fsGroup"])
        groups.update(pod_sc.get("supplementalGroups", []))
        return uid, gid, sorted(groups)

    def files(self, binaries):
        """The container's files under /opt: the image's, and each volume mount's keys, with the
        owner and mode the kubelet gives them (fsGroup: group fsGroup, and group read)."""
        files = [{"path": path, "source": binaries[rel], "mode": 0o755, "uid": 0, "gid": 0}
                 for path, rel in IMAGE_FILES.items()]
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        for mount in self.container.get("volumeMounts", []):
            if mount.get("subPath"):
                raise ValueError("%s: subPath mounts are not emulated" % self.hostname)
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume or "emptyDir" in volume:
                continue  # writable_dirs()
            if "configMap" in volume:
                source, kind, name_field = volume["configMap"], "ConfigMap", "name"
            elif "secret" in volume:
                source, kind, name_field = volume["secret"], "Secret", "secretName"
            else:
                raise ValueError("%s: volume %s: only configMap and secret volumes are emulated"
                                 % (self.hostname, volume["name"]))
            obj = render.find(self.objects, kind, source[name_field])
            if obj is None:
                raise ValueError("%s: no %s %s" % (self.hostname, kind, source[name_field]))
            data = obj.get("data", {})
            # items: only the keys listed, at their paths (the kubelet fails a pod whose key is
            # missing); none: every key, named so.
            items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
            for item in items:
                if item["key"] not in data:
                    raise ValueError("%s: volume %s: no key %s in %s %s" % (
                        self.hostname, volume["name"], item["key"], kind, source[name_field]))
                mode = item.get("mode", source.get("defaultMode", 0o644))
                gid = 0
                if fs_group is not None:
                    mode, gid = mode | 0o440, fs_group
                value = data[item["key"]]
                content = value if kind == "Secret" else base64.b64encode(value.encode()).decode()
                files.append({"path": os.path.join(mount["mountPath"], item["path"]),
                              "content_b64": content, "mode": mode, "uid": 0, "gid": gid})
        return files

    def writable_dirs(self, volume_root):
        """The container's writable volumes: each a directory on this machine, bind-mounted at
        its mountPath, owned root:fsGroup with mode 2775 as the kubelet makes an fsGroup volume.
        A PersistentVolumeClaim is one directory per claim, shared by every pod that mounts it
        (and outliving them, as a claim does); an emptyDir one per pod."""
        fs_group = self.spec.get("securityContext", {}).get("fsGroup", 0)
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        dirs = []
        for mount in self.container.get("volumeMounts", []):
            volume = volumes[mount["name"]]
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if render.find(self.objects, "PersistentVolumeClaim", claim) is None:
                    raise ValueError("%s: no PersistentVolumeClaim %s" % (self.hostname, claim))
                source = os.path.join(volume_root, "pvc-" + claim)
            elif "emptyDir" in volume:  # The pod's own: a replacement starts with an empty one.
                source = os.path.join(volume_root, "emptydir-%s-%s" % (self.name, volume["name"]))
            else:
                continue
            os.makedirs(source, exist_ok=True)
            os.chown(source, 0, fs_group)
            os.chmod(source, 0o2775)
            dirs.append({"path": mount["mountPath"], "source": source,
                         "read_only": bool(mount.get("readOnly"))})
        return dirs

    def health_port(self):
        probe = self.container.get("readinessProbe", {}).get("grpc")
        return probe["port"] if probe else None


def plan(objects):
    """The pods the objects' Jobs would create, servers first. Only Indexed Jobs with every pod
    at once (parallelism = completions) are emulated: that is all Rubato deploys."""
    pods = []
    for job in objects:
        if job["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Pod", "ReplicaSet"):
            raise ValueError("%s %s: not emulated" % (job["kind"], job["metadata"]["name"]))
        if job["kind"] != "Job":
            continue
        spec = job["spec"]
        if (spec.get("completionMode") != "Indexed"
                or spec.get("parallelism") != spec["completions"]):
            raise ValueError("Job %s: only Indexed Jobs with parallelism = completions are emulated"
                             % job["metadata"]["name"])
        pods += [Pod(job, i, objects) for i in range(spec["completions"])]
    pods.sort(key=lambda p: (p.role != "parameter-server", p.hostname))  # servers first
    return pods


def dns_names(pods, objects):
    """name -> pod hostname: the A records the cluster DNS serves for pods with a subdomain that
    a headless Service of that name selects, under every search suffix a pod resolves with; and
    each pod's own host name (its /etc/hosts)."""
    names = {p.hostname: p.hostname for p in pods}
    for p in pods:
        if not p.subdomain:
            continue
        service = render.find(objects, "Service", p.subdomain)
        if service is None:
            raise ValueError("%s: no Service %s for its subdomain: no DNS name"
                             % (p.hostname, p.subdomain))
        spec = service["spec"]
        selector = spec.get("selector", {})
        if spec.get("clusterIP") != "None" or not selector or any(
                p.labels.get(k) != v for k, v in selector.items()):
            raise ValueError("%s: Service %s is not headless or does not select it: no DNS name"
                             % (p.hostname, p.subdomain))
        if not spec.get("publishNotReadyAddresses"):
            raise ValueError("Service %s: names only ready pods; not emulated" % p.subdomain)
        base = "%s.%s" % (p.hostname, p.subdomain)
        for suffix in ("", "." + NAMESPACE, ".%s.svc" % NAMESPACE,
                       ".%s.svc.%s" % (NAMESPACE, CLUSTER_DOMAIN)):
            names[base + suffix] = p.hostname
    return names


# --- the replay ---------------------------------------------------------------------------------

class Running:
    """A started pod: its process (the container's, after the launcher's execs) and its logs."""

    def __init__(self, pod, proc, base):
        self.pod = pod
        self.proc = proc
        self.base = base  # its logs: BASE.stdout, BASE.stderr
        self.exit_time = None
        self.exit_code = None  # as the kubelet reports it: 128 + N when killed by signal N
        self.action = None     # a failure's: Ignore, Count or FailJob
        self.rusage = None

    def log(self, stream):
        with open("%s.%s" % (self.base, stream), errors="replace") as f:
            return f.read()

    def json_lines(self):
        records = []
        for line in self.log("stdout").splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
        return records

    def tail(self):
        return "\n".join(self.log("stderr").strip().splitlines()[-5:])


def binaries():
    """Runfiles path of each image binary (or bazel-bin's, when run from the source tree)."""
    found = {}
    for rel in IMAGE_FILES.values():
        for candidate in (os.path.join(RUNFILES, rel), os.path.join(RUNFILES, "bazel-bin", rel)):
            if os.path.isfile(candidate):
                found[rel] = candidate
                break
        else:
            raise FileNotFoundError("no %s in the runfiles (bazel build it)" % rel)
    return found


def on_sigterm(signum, frame):
    raise SystemExit("terminated (signal %d)" % signum)  # unwinds through the cleanups


class Controller:
    """The Job and JobSet controllers and the kubelet for the replayed pods: starts them (servers
    first, workers once the servers are ready: dependsOn Ready), collects their exits, applies
    each Job's podFailurePolicy to a failed pod (ignored, counted against its index's
    backoffLimitPerIndex, or failing the Job) and starts its replacement, with the same host name,
    after the back-off. A failed Job goes through the JobSet's failurePolicy: a rule naming its
    reason decides, else the whole JobSet is recreated (BlockingRecreate: every pod stopped first)
    up to maxRestarts times. `failed` says why the job failed, if it did."""

    def __init__(self, test, net, log_dir, pods, jobset):
        self.test, self.net, self.log_dir = test, net, log_dir
        self.pods, self.jobset = pods, jobset
        self.attempts = {}   # host name -> [Running], in order
        self.pending = []    # (when, Pod): replacements waiting for their back-off
        self.counted, self.ignored, self.succeeded = {}, {}, {}
        self.disrupted = set()  # Running objects given the condition DisruptionTarget
        self.restarts = 0    # Whole-JobSet restarts
        self.failed = None

    def launch(self):
        """Every pod, as the JobSet starts them: the servers, then (once they are ready) the
        rest."""
        servers = [p for p in self.pods if p.role == "parameter-server"]
        for p in servers:
            self.start(Pod(p.job_object, p.index, p.objects))
        if servers:
            ready = subprocess.run(
                self.net.exec_prefix("kubelet") + [sys.executable, PROBE, str(READY_S)]
                + ["%s:%d" % (p.ip, p.health_port()) for p in servers],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                timeout=READY_S + 30)
            statuses = [json.loads(line)["status"] for line in ready.stdout.splitlines()
                        if line.startswith("{")]
            if statuses != ["SERVING"] * len(servers):
                self.failed = "the servers were not ready within %d s: %s" % (READY_S,
                                                                             ready.stdout)
                return
        for p in self.pods:
            if p.role != "parameter-server":
                self.start(Pod(p.job_object, p.index, p.objects))

    def job_failed(self, reason, why):
        """A Job failed with `reason` (PodFailurePolicy, FailedIndexes): the JobSet's
        failurePolicy decides."""
        policy = (self.jobset or {}).get("spec", {}).get("failurePolicy")
        if policy is None:
            self.failed = why
            return
        for rule in policy.get("rules", []):
            if reason in rule.get("onJobFailureReasons", [reason]):
                if rule["action"] == "FailJobSet":
                    self.failed = "%s; the JobSet fails (rule %s)" % (why, rule["name"])
                    return
                break
        if self.restarts >= policy.get("maxRestarts", 0):
            self.failed = "%s; the JobSet has no restarts left (%d)" % (why, self.restarts)
            return
        self.restarts += 1
        # BlockingRecreate: every pod of the old Jobs is gone before the new ones start. A pod
        # deleted gets SIGTERM, SIGKILL after its grace period.
        stopping = self.running()
        for r in stopping:
            os.kill(r.proc.pid, signal.SIGTERM)
        grace = time.monotonic() + 60  # The servers' terminationGracePeriodSeconds.
        while stopping:
            for r in list(stopping):
                pid, status = os.waitpid(r.proc.pid, os.WNOHANG)
                if pid:
                    r.proc.returncode = os.waitstatus_to_exitcode(status)
                    r.exit_code, r.exit_time = r.proc.returncode, time.monotonic()
                    r.action = "deleted: JobSet restart"
                    stopping.remove(r)
                elif time.monotonic() > grace:
                    os.kill(r.proc.pid, signal.SIGKILL)
            time.sleep(0.05)
        self.pending = []
        self.counted, self.succeeded = {}, {}  # New Jobs: new counts.
        self.launch()

    def start(self, pod):
        pod.ip = self.net.ip(pod.hostname)
        r = self.test.start(self.net, pod, self.log_dir, len(self.attempts.get(pod.hostname, [])))
        self.attempts.setdefault(pod.hostname, []).append(r)
        return r

    def current(self, host):
        return self.attempts[host][-1]

    def running(self):
        return [a[-1] for a in self.attempts.values() if a[-1].exit_time is None]

    def evict(self, host):
        """What an eviction, a preemption or a drain does: the condition DisruptionTarget, then
        SIGTERM."""
        r = self.current(host)
        self.disrupted.add(r)
        os.kill(r.proc.pid, signal.SIGTERM)

    def kill(self, host):
        """A container killed outright (an OOM kill, a node's kernel): SIGKILL, exit 137."""
        os.kill(self.current(host).proc.pid, signal.SIGKILL)

    def poll(self):
        now = time.monotonic()
        for attempts in self.attempts.values():
            r = attempts[-1]
            if r.exit_time is not None:
                continue
            pid, status, usage = os.wait4(r.proc.pid, os.WNOHANG)
            if not pid:
                continue
            code = os.waitstatus_to_exitcode(status)
            r.exit_code = 128 - code if code < 0 else code  # as the kubelet reports a signal
            r.proc.returncode = code
            r.exit_time, r.rusage = now, usage
            host = r.pod.hostname
            if r.exit_code == 0:
                self.succeeded[host] = self.succeeded.get(host, 0) + 1
                continue
            spec = r.pod.job_object["spec"]
            action = render.pod_failure_action(spec, r.pod.container["name"], r.exit_code,
                                               disrupted=r in self.disrupted)
            r.action = action
            if action == "FailJob":
                self.job_failed("PodFailurePolicy", "%s exited %d: its Job fails "
                                "(podFailurePolicy): %s" % (host, r.exit_code, r.tail()))
                return
            elif action == "Ignore":
                self.ignored[host] = self.ignored.get(host, 0) + 1
                self.pending.append((now, Pod(r.pod.job_object, r.pod.index, r.pod.objects)))
            else:
                n = self.counted[host] = self.counted.get(host, 0) + 1
                if n > spec["backoffLimitPerIndex"]:
                    self.job_failed("FailedIndexes", "%s failed %d times, over its "
                                    "backoffLimitPerIndex: %s" % (host, n, r.tail()))
                    return
                else:
                    self.pending.append((now + BACKOFF_S * 2 ** (n - 1),
                                         Pod(r.pod.job_object, r.pod.index, r.pod.objects)))
        for when, pod in list(self.pending):
            if when <= now:
                self.pending.remove((when, pod))
                pod.ip = self.net.ip(pod.hostname)
                self.start(pod)


class ReplayTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        signal.signal(signal.SIGTERM, on_sigterm)  # Bazel's timeout: still kill every pod
        # ip(8) lives in /usr/sbin, which a test's PATH may lack.
        path = os.environ.get("PATH", "").split(":")
        os.environ["PATH"] = ":".join(path + [d for d in ("/usr/sbin", "/sbin") if d not in path])
        cls.tools = render.Tools()  # fails (not skips) without node_modules
        cls.skip = netns.skip_reason()
        for tool in ("unshare", "setpriv", "mount"):
            if cls.skip is None and not shutil.which(tool):
                cls.skip = "no `%s` (util-linux) on this machine" % tool
        cls.binaries = binaries()
        cls.out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tempfile.mkdtemp()

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)

    def replay(self, name, settings=(), faults=None, label=None, expect_failure=False):
        """Runs deploy/k8s/jobs/NAME.yaml (with `settings`) to the end, calling faults(controller)
        every poll to inject failures; returns the Controller after the checks that hold for every
        job (with `expect_failure`, once the job has failed, as it must)."""
        label = label or name
        objects = render.job(name, "jobset", settings)
        rc, out = self.tools.validate(render.dump(objects))
        self.assertEqual(rc, 0, out)
        run = render.as_run(objects)
        pods = plan(run)
        self.assertTrue(pods, "%s makes no pods" % name)
        log_dir = os.path.join(self.out_dir, label)
        shutil.rmtree(log_dir, ignore_errors=True)  # A new job: new claims, new logs.
        os.makedirs(log_dir)
        prober = None
        net = netns.Network([p.hostname for p in pods] + ["kubelet"])
        control = Controller(self, net, log_dir, pods,
                             next((o for o in objects if o["kind"] == "JobSet"), None))
        try:
            net.add_names(dns_names(pods, run))
            for p in pods:
                p.ip = net.ip(p.hostname)
            start = time.monotonic()
            targets = ["%s:%d" % (p.ip, p.health_port()) for p in pods if p.health_port()]
            with open(os.path.join(log_dir, "probe.stdout"), "w") as out:
                prober = subprocess.Popen(
                    net.exec_prefix("kubelet")
                    + [sys.executable, PROBE, str(JOB_DEADLINE_S)] + targets,
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True)
            control.launch()
            self.wait(control, start, faults)
            wall = max((r.exit_time for a in control.attempts.values() for r in a
                        if r.exit_time is not None), default=time.monotonic()) - start
        finally:
            # The prober reports what it last saw; whatever still runs (on a failure) dies with
            # its whole session; then the hosts go.
            if prober is not None:
                prober.terminate()
                try:
                    prober.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            procs = [r.proc for a in control.attempts.values() for r in a]
            for proc in procs + [prober]:
                if proc is not None and proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            net.close()

        if expect_failure:
            self.assertIsNotNone(control.failed, "the job did not fail (logs in %s)" % log_dir)
            return control
        self.assertIsNone(control.failed, "the job failed (logs in %s)" % log_dir)
        # Every index succeeded exactly once: nothing ran twice to completion.
        self.assertEqual(control.succeeded, {p.hostname: 1 for p in pods},
                         "logs in %s" % log_dir)

        probes = {}
        with open(os.path.join(log_dir, "probe.stdout")) as f:
            for line in f:
                if line.startswith("{"):
                    record = json.loads(line)
                    probes[record["target"]] = record
        for p in pods:
            if p.health_port():
                target = "%s:%d" % (p.ip, p.health_port())
                self.assertEqual(probes.get(target, {}).get("status"), "SERVING",
                                 "%s's gRPC health check (%s): %s"
                                 % (p.hostname, target, probes.get(target)))

        workers = [control.current(p.hostname) for p in pods if p.role == "worker"]
        accuracy, finals = {}, {}
        for r in workers:
            done = [rec for rec in r.json_lines() if rec.get("event") == "done"]
            self.assertEqual(len(done), 1, "%s: no done record: %s" % (r.pod.hostname, r.tail()))
            finals[r.pod.hostname] = done[0]
            self.assertEqual(done[0]["steps"], STEPS, r.pod.hostname)
            if "test_accuracy" in done[0]:
                accuracy[r.pod.hostname] = done[0]["test_accuracy"]
                self.assertGreaterEqual(done[0]["test_accuracy"], MIN_ACCURACY, r.pod.hostname)
        # Worker 0 always evaluates; under bsp it alone does, and the others end on its weights.
        first = min(finals)
        self.assertIn(first, accuracy)
        for host, done in finals.items():
            if host not in accuracy:
                self.assertEqual(done["params_fnv1a"], finals[first]["params_fnv1a"],
                                 "%s did not evaluate, but its weights differ from %s's"
                                 % (host, first))
        self.check_outputs(control, pods, run, log_dir)
        print("replay %s: %d pods, %d started, wall %.1f s, test accuracy %s, failures counted %s,"
              " ignored %s, peak RSS %s" % (
                  label, len(pods), sum(len(a) for a in control.attempts.values()), wall,
                  " ".join("%s=%.4f" % kv for kv in sorted(accuracy.items())),
                  control.counted, control.ignored,
                  " ".join("%s=%.0fMB" % (h, a[-1].rusage.ru_maxrss / 1024)
                           for h, a in sorted(control.attempts.items()))),
              flush=True)
        return control

    def check_outputs(self, control, pods, run, log_dir):
        """What the job left on its claim, under <run>/: every shard's checkpoints and final
        stats, every worker's records (those of every attempt), worker 0's model and summary."""
        claims = [o for o in run if o["kind"] == "PersistentVolumeClaim"]
        self.assertEqual(len(claims), 1)
        job_id = [a.split("=", 1)[1] for a in pods[0].container["args"]
                  if a.startswith("--job_id=")][0]
        root = os.path.join(log_dir, "volumes", "pvc-" + claims[0]["metadata"]["name"], job_id)
        outputs = os.path.join(root, "outputs")
        for p in pods:
            if p.role == "parameter-server":
                files = [f for f in os.listdir(os.path.join(root, "checkpoints"))
                         if f.startswith("shard-%d-step-" % p.index) and f.endswith(".ckpt")]
                self.assertTrue(files, "%s wrote no checkpoint into %s" % (p.hostname, root))
                with open(os.path.join(outputs, "server-%d.json" % p.index)) as f:
                    self.assertEqual(json.loads(f.read())["event"], "stats")
            else:
                with open(os.path.join(outputs, "worker-%d.jsonl" % p.index)) as f:
                    records = [json.loads(line) for line in f]
                logged = [rec for r in control.attempts[p.hostname] for rec in r.json_lines()]
                self.assertEqual(records, logged, "%s: the records file is its log's records"
                                 % p.hostname)
        self.assertGreater(os.path.getsize(os.path.join(outputs, "model.rubato")), 0)
        # Worker 0's summary: its start record and its last attempt's done record.
        with open(os.path.join(outputs, "summary.json")) as f:
            summary = json.load(f)
        worker_0 = control.current(next(p.hostname for p in pods if p.role == "worker"))
        records = worker_0.json_lines()
        self.assertEqual(summary["done"], [r for r in records if r["event"] == "done"][-1])
        self.assertEqual(summary["start"], [r for r in records if r["event"] == "start"][-1])

    def start(self, net, pod, log_dir, attempt):
        uid, gid, groups = pod.identity()
        env = dict(IMAGE_ENV)
        env["HOSTNAME"] = pod.hostname  # the container runtime sets it
        env.update(pod.env())
        spec = {"files": pod.files(self.binaries),
                "dirs": pod.writable_dirs(os.path.join(log_dir, "volumes")),
                "hostname": pod.hostname, "uid": uid, "gid": gid, "groups": groups, "env": env,
                "argv": pod.argv()}
        base = os.path.join(log_dir, pod.hostname + ("" if attempt == 0 else ".%d" % attempt))
        with open(base + ".spec.json", "w") as f:
            json.dump(spec, f, indent=1)
        with open(base + ".argv", "w") as f:
            f.write(" ".join(spec["argv"]) + "\n")
        with open(base + ".stdout", "w") as out, open(base + ".stderr", "w") as err:
            proc = subprocess.Popen(
                net.exec_prefix(pod.hostname)
                + ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                   sys.executable, LAUNCHER, base + ".spec.json"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        return Running(pod, proc, base)

    def wait(self, control, start, faults):
        """Until every pod has exited and no replacement is due, or the job failed: workers within
        JOB_DEADLINE_S, the servers within SERVER_EXIT_S after the last worker."""
        while control.failed is None:
            control.poll()
            if faults:
                faults(control)
            now = time.monotonic()
            left = control.running()
            if not left and not control.pending:
                return
            workers_done = all(a[-1].exit_time is not None and a[-1].exit_code == 0
                               for a in control.attempts.values()
                               if a[-1].pod.role == "worker")
            if not workers_done:
                self.assertLess(now - start, JOB_DEADLINE_S, "workers still running after %d s: %s"
                                % (JOB_DEADLINE_S, [r.pod.hostname for r in left]))
            else:
                last = max(a[-1].exit_time for a in control.attempts.values()
                           if a[-1].pod.role == "worker")
                self.assertLess(now - last, SERVER_EXIT_S,
                                "still running %d s after the last worker finished: %s" % (
                                    SERVER_EXIT_S, [r.pod.hostname for r in left]))
            time.sleep(0.2)

    def check_servers(self, control, shards):
        servers = [a[-1] for a in control.attempts.values()
                   if a[-1].pod.role == "parameter-server"]
        self.assertEqual(len(servers), shards)
        for r in servers:
            stats = [rec for rec in r.json_lines() if rec.get("event") == "stats"]
            self.assertEqual(len(stats), 1, "%s: no final stats line" % r.pod.hostname)

    def check_identical_weights(self, control):
        fingerprints = {h: rec["params_fnv1a"] for h, a in control.attempts.items()
                        for rec in a[-1].json_lines() if rec.get("event") == "done"}
        self.assertEqual(len(set(fingerprints.values())), 1, fingerprints)

    def test_bsp(self):
        control = self.replay("bsp")
        self.check_servers(control, 2)
        self.check_identical_weights(control)
        self.assertEqual((control.counted, control.ignored), ({}, {}))

    def test_bsp_with_tls(self):
        control = self.replay("bsp", ["tls=true"], label="bsp-tls")
        self.check_servers(control, 2)
        self.assertIn("--tls_key=/opt/rubato/secret/server.key",
                      control.current("rubato-bsp-ps-0-0").pod.argv())

    def test_ssp(self):
        self.check_servers(self.replay("ssp"), 2)

    def test_stragglers(self):
        control = self.replay("stragglers")
        self.check_servers(control, 2)
        self.check_identical_weights(control)
        delays = {a[-1].pod.index: sum(rec.get("delay_ms", 0) for rec in a[-1].json_lines()
                                       if rec.get("event") == "step")
                  for a in control.attempts.values() if a[-1].pod.role == "worker"}
        self.assertGreater(delays[1], 0, "worker 1 is the straggler: %s" % delays)
        self.assertEqual(delays[0] + delays[2], 0, delays)

    def test_allreduce(self):
        control = self.replay("allreduce")
        self.assertEqual(sorted(control.attempts), ["rubato-allreduce-worker-0-%d" % i
                                                    for i in range(3)])
        self.check_identical_weights(control)

    @staticmethod
    def step_of(control, host):
        """The newest step record's step of `host`'s current attempt (0 before any)."""
        steps = [rec["step"] for rec in control.current(host).json_lines()
                 if rec.get("event") == "step"]
        return steps[-1] if steps else 0

    def fingerprints(self, control):
        return {rec["params_fnv1a"] for a in control.attempts.values()
                for rec in a[-1].json_lines() if rec.get("event") == "done"}

    def test_a_failed_job_restarts_the_whole_jobset_from_the_checkpoints(self):
        """restarts_per_index 0: shard 1 killed once (SIGKILL, exit 137, counted) fails its Job;
        the JobSet's failurePolicy then recreates every pod (BlockingRecreate), the shards restore
        their newest checkpoints, the new workers go on from there, and the job ends at its final
        step on the weights of the same job without the failure."""
        ps1, w0 = "rubato-bsp-ps-0-1", "rubato-bsp-worker-0-0"
        done = []

        def faults(control):
            if not done and w0 in control.attempts and self.step_of(control, w0) >= 100:
                control.kill(ps1)
                done.append("killed")

        settings = ["checkpoint_every_steps=40", "restarts_per_index=0"]
        control = self.replay("bsp", settings, faults, label="bsp-jobset-restart")
        self.assertEqual((done, control.restarts), (["killed"], 1))
        self.assertEqual(control.attempts[ps1][0].exit_code, 137)
        self.assertEqual(len(control.attempts[w0]), 2, "every pod was recreated")
        starts = [rec for rec in control.current(w0).json_lines() if rec["event"] == "step"]
        self.assertGreater(starts[0]["step"], 0, "the new workers went on from the checkpoint")
        clean = self.replay("bsp", settings, label="bsp-jobset-no-restart")
        self.assertEqual(self.fingerprints(control), self.fingerprints(clean))
        self.assertEqual(len(self.fingerprints(control)), 1)

    def test_a_usage_error_fails_the_jobset(self):
        """A model the workers cannot build: exit 2, FailJob, and the JobSet's rule usage-error
        fails it without a restart."""
        control = self.replay("bsp", ["model=mlp:784"], label="bsp-usage-error",
                              expect_failure=True)
        self.assertIn("the JobSet fails (rule usage-error)", control.failed)
        self.assertIn("exited 2", control.failed)
        self.assertEqual(control.restarts, 0)

    def test_bsp_survives_an_eviction_a_roll_back_and_a_killed_worker(self):
        """Shard 1 is evicted mid-job (SIGTERM with DisruptionTarget: exit 143, not counted) and
        replaced under the same name; it restores its newest checkpoint, so shard 0 rolls back to
        it (exit 75, not counted) and is replaced too; later worker 2 is killed (exit 137, counted)
        and replaced after the back-off, and rejoins. The job ends at its final step, every index
        succeeded once, and the workers agree on the weights."""
        ps0, ps1 = "rubato-bsp-ps-0-0", "rubato-bsp-ps-0-1"
        w0, w2 = "rubato-bsp-worker-0-0", "rubato-bsp-worker-0-2"
        done = []

        def faults(control):
            if w0 not in control.attempts:
                return
            step = self.step_of(control, w0)
            if not done and step >= 100:
                control.evict(ps1)
                done.append("evicted")
            elif len(done) == 1 and len(control.attempts[ps1]) == 2 and step >= 200:
                control.kill(w2)
                done.append("killed")

        control = self.replay("bsp", ["checkpoint_every_steps=40"], faults, label="bsp-faults")
        self.assertEqual(done, ["evicted", "killed"])
        first_ps1 = control.attempts[ps1][0]
        self.assertEqual(first_ps1.exit_code, 143, "SIGTERM before the job is over: not success")
        self.assertEqual(first_ps1.action, "Ignore")
        self.assertIn(75, [r.exit_code for r in control.attempts[ps0]],
                      "shard 0 rolled back to shard 1's checkpoint")
        self.assertEqual(control.attempts[w2][0].exit_code, 137)
        self.assertEqual(control.counted, {w2: 1}, "only the killed worker counts")
        self.assertEqual(control.ignored[ps1], 1)
        self.assertGreaterEqual(control.ignored[ps0], 1)
        self.check_servers(control, 2)
        self.check_identical_weights(control)
        finals = [rec for a in control.attempts.values() for rec in a[-1].json_lines()
                  if rec.get("event") == "done"]
        self.assertTrue(any(rec.get("redone_steps", 0) > 0 for rec in finals),
                        "the job was rolled back: steps were computed again: %s" % finals)
        # Bit-identical recovery: the same weights as the same job without failures, unless worker
        # 2 was killed between its pushes to the two shards (each pushes its part of a step on
        # its own call), which leaves that step applied on one shard only; its replacement then
        # computes the step on weights of two versions, and says so (worker/ps/recovery.h,
        # DescribeSplitStep: a known limit, not repaired).
        split = "is half applied" in control.attempts[w2][-1].log("stderr")
        clean = self.replay("bsp", ["checkpoint_every_steps=40"], label="bsp-no-faults")
        if split:
            print("worker 2 was killed between its pushes to the two shards: its replacement "
                  "said so; bit-identity not expected")
            self.assertEqual(len({rec["params_fnv1a"] for rec in finals}), 1)
        else:
            self.assertEqual({rec["params_fnv1a"] for rec in finals}, self.fingerprints(clean))


class ExpansionTest(unittest.TestCase):
    """The kubelet's $(VAR) rules, which the replay must follow exactly."""

    def test_expand(self):
        env = {"A": "1", "B": "x$(A)"}
        self.assertEqual(expand("--id=$(A)", env), "--id=1")
        self.assertEqual(expand("$(A)$(A)-$(B)", env), "11-x$(A)")  # no recursion
        self.assertEqual(expand("$(MISSING) $$(A) $$ $x $( $", env), "$(MISSING) $(A) $ $x $( $")
        self.assertEqual(expand("", env), "")

    def test_env_and_downward_api(self):
        def field(path):
            return {"fieldRef": {"fieldPath": path}}
        container = {"name": "c", "command": ["/x", "$(POD)"],
                     "args": ["--i=$(JOB_COMPLETION_INDEX)", "--l=$(L)", "--n=$(NS)"],
                     "env": [{"name": "POD", "valueFrom": field("metadata.name")},
                             {"name": "L", "valueFrom": field("metadata.labels['a']")},
                             {"name": "NS", "valueFrom": field("metadata.namespace")}]}
        job = {"kind": "Job", "metadata": {"name": "j"},
               "spec": {"completions": 2, "parallelism": 2, "completionMode": "Indexed",
                        "template": {"metadata": {"labels": {"a": "b"}},
                                     "spec": {"containers": [container]}}}}
        pod = plan([job])[1]
        self.assertEqual(pod.hostname, "j-1")
        argv = pod.argv()
        self.assertRegex(argv[1], r"^j-1-[a-z0-9]{5}$")
        self.assertEqual(argv[2:], ["--i=1", "--l=b", "--n=default"])


if __name__ == "__main__":
    sys.exit(pyunit.main("tests/k8s_replay_test"))
