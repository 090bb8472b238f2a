"""Replays deploy/k8s's rendered overlays as Kubernetes would run them, without a cluster: every pod
of every Indexed Job (one per completion index) runs the container's exact command, arguments and
environment ($(VAR) expanded as the kubelet does, JOB_COMPLETION_INDEX and downward-API fields
filled in) on a host of its own, a Linux network namespace (tests/netns.py), where the headless
Services' DNS names (rubato-ps-0.rubato-ps, ...) resolve. Each container sees the image's
/opt/rubato/bin and its ConfigMap and Secret volumes with the modes and owners the kubelet gives
them, in a mount namespace of its own, and runs as the pod's user, groups and capabilities
(tests/k8s_pod_launcher.py). A "kubelet" host sends each pod the readiness probe's gRPC health
check (tests/grpc_health_probe.py).

Checks, per overlay: every pod exits 0 by itself (the servers once the workers are done), the
workers reach the expected test accuracy, and every pod's health port answered SERVING.
Needs root and iproute2 (skipped, with the reason, where namespaces cannot be made), kubectl and
deploy/k8s/validate/node_modules (fails without them: ./rubato setup).
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
               "/opt/rubato/bin/rubato_worker": "worker/rubato_worker"}
IMAGE_ENV = {"PATH": "/opt/rubato/bin"}

# 1 epoch of Fashion-MNIST, MLP 784-256-10, 3 workers x batch 64, SGD at 0.1 (the base's job):
# measured 0.8034 under bsp and 0.8030 under allreduce (deterministic: each sums in a fixed
# order; the stragglers overlay only delays), 0.826-0.832 under ssp:2 (arrival order varies). 0.78
# leaves room for a different libm or Eigen build, and still fails a job that did not learn (0.10)
# or lost a worker's updates for long.
MIN_ACCURACY = 0.78
JOB_DEADLINE_S = 300      # every worker done (about 15 s each on an idle 2-core machine)
SERVER_EXIT_S = 60        # servers exit by themselves this soon after the last worker
WORKER_HEAD_START_S = 1   # workers start first: they must wait for servers that come up late


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
            if source.get("items"):
                raise ValueError("%s: volume %s: items are not emulated"
                                 % (self.hostname, volume["name"]))
            obj = render.find(self.objects, kind, source[name_field])
            if obj is None:
                raise ValueError("%s: no %s %s" % (self.hostname, kind, source[name_field]))
            mode = source.get("defaultMode", 0o644)
            gid = 0
            if fs_group is not None:
                mode, gid = mode | 0o440, fs_group
            for key, value in sorted(obj.get("data", {}).items()):
                content = value if kind == "Secret" else base64.b64encode(value.encode()).decode()
                files.append({"path": os.path.join(mount["mountPath"], key),
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
            elif "emptyDir" in volume:
                source = os.path.join(volume_root, "emptydir-%s-%s" % (self.hostname,
                                                                      volume["name"]))
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
    """The pods the objects' Jobs would create, workers first. Only Indexed Jobs with every pod
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
    pods.sort(key=lambda p: (p.job != "rubato-worker", p.hostname))
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

    def __init__(self, pod, proc, log_dir):
        self.pod = pod
        self.proc = proc
        self.log_dir = log_dir
        self.exit_time = None
        self.rusage = None

    def log(self, stream):
        with open(os.path.join(self.log_dir, "%s.%s" % (self.pod.hostname, stream)),
                  errors="replace") as f:
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


class ReplayTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        signal.signal(signal.SIGTERM, on_sigterm)  # Bazel's timeout: still kill every pod
        # ip(8) lives in /usr/sbin, which a test's PATH may lack.
        path = os.environ.get("PATH", "").split(":")
        os.environ["PATH"] = ":".join(path + [d for d in ("/usr/sbin", "/sbin") if d not in path])
        cls.tools = render.Tools()  # fails (not skips) without kubectl or node_modules
        cls.skip = netns.skip_reason()
        for tool in ("unshare", "setpriv", "mount"):
            if cls.skip is None and not shutil.which(tool):
                cls.skip = "no `%s` (util-linux) on this machine" % tool
        cls.binaries = binaries()
        cls.out_dir = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR") or tempfile.mkdtemp()

    def setUp(self):
        if self.skip:
            self.skipTest(self.skip)

    def replay(self, overlay, tls=False):
        """Runs the overlay's pods (with the tls component: mutual TLS, certificates from
        make-secret.sh --tls) to the end; returns {hostname: Running} after the checks that hold
        for every overlay."""
        with render.Checkout(self.tools.kubectl) as k8s:
            if tls:
                k8s.make_tls(shards=2, workers=3)
                k8s.add_overlay(overlay + "-tls", ["../" + overlay], ["../../components/tls"])
                overlay += "-tls"
            objects = self.tools.to_objects(k8s.render(overlay))
        pods = plan(objects)
        self.assertTrue(pods, "overlays/%s makes no pods" % overlay)
        log_dir = os.path.join(self.out_dir, overlay)
        os.makedirs(log_dir, exist_ok=True)
        # A new job, new claims (a claim left from an earlier replay would resume its job).
        shutil.rmtree(os.path.join(log_dir, "volumes"), ignore_errors=True)
        running, prober = {}, None
        net = netns.Network([p.hostname for p in pods] + ["kubelet"])
        try:
            net.add_names(dns_names(pods, objects))
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
            for i, p in enumerate(pods):
                if i > 0 and p.job != pods[i - 1].job:
                    time.sleep(WORKER_HEAD_START_S)
                running[p.hostname] = self.start(net, p, log_dir)
            self.wait(running, start)
            wall = max(r.exit_time for r in running.values()) - start
            # Every shard wrote checkpoints onto the claim (the job is longer than one interval).
            shards = [p for p in pods if p.job == "rubato-ps"]
            claim = os.path.join(log_dir, "volumes", "pvc-rubato-checkpoints")
            for p in shards:
                files = [f for f in (os.listdir(claim) if os.path.isdir(claim) else [])
                         if f.startswith("shard-%d-step-" % p.index) and f.endswith(".ckpt")]
                self.assertTrue(files, "%s wrote no checkpoint into %s" % (p.hostname, claim))
        finally:
            # The prober reports what it last saw; whatever still runs (on a failure) dies with
            # its whole session; then the hosts go.
            if prober is not None:
                prober.terminate()
                try:
                    prober.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            for proc in [r.proc for r in running.values()] + [prober]:
                if proc is not None and proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            net.close()

        failed = ["%s exited %d: %s" % (h, r.proc.returncode, r.tail())
                  for h, r in running.items() if r.proc.returncode != 0]
        self.assertFalse(failed, "pods failed (logs in %s):\n" % log_dir + "\n".join(failed))

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

        workers = [r for r in running.values() if r.pod.job == "rubato-worker"]
        accuracy = {}
        finals = {}
        for r in workers:
            done = [rec for rec in r.json_lines() if rec.get("event") == "done"]
            self.assertEqual(len(done), 1, "%s: no done record: %s" % (r.pod.hostname, r.tail()))
            finals[r.pod.hostname] = done[0]
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
        print("replay %s: %d pods, wall %.1f s, test accuracy %s, peak RSS %s" % (
            overlay, len(pods), wall,
            " ".join("%s=%.4f" % kv for kv in sorted(accuracy.items())),
            " ".join("%s=%.0fMB" % (h, r.rusage.ru_maxrss / 1024)
                     for h, r in sorted(running.items()))),
            flush=True)
        return running

    def start(self, net, pod, log_dir):
        uid, gid, groups = pod.identity()
        env = dict(IMAGE_ENV)
        env["HOSTNAME"] = pod.hostname  # the container runtime sets it
        env.update(pod.env())
        spec = {"files": pod.files(self.binaries),
                "dirs": pod.writable_dirs(os.path.join(log_dir, "volumes")),
                "hostname": pod.hostname, "uid": uid, "gid": gid, "groups": groups, "env": env,
                "argv": pod.argv()}
        spec_path = os.path.join(log_dir, "%s.spec.json" % pod.hostname)
        with open(spec_path, "w") as f:
            json.dump(spec, f, indent=1)
        with open(os.path.join(log_dir, "%s.argv" % pod.hostname), "w") as f:
            f.write(" ".join(spec["argv"]) + "\n")
        with open(os.path.join(log_dir, pod.hostname + ".stdout"), "w") as out, \
                open(os.path.join(log_dir, pod.hostname + ".stderr"), "w") as err:
            proc = subprocess.Popen(
                net.exec_prefix(pod.hostname)
                + ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                   sys.executable, LAUNCHER, spec_path],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        return Running(pod, proc, log_dir)

    def wait(self, running, start):
        """Until every pod has exited: workers within JOB_DEADLINE_S, the others (the servers)
        within SERVER_EXIT_S after the last worker. Collects each exit's time and resource use."""
        while True:
            now = time.monotonic()
            for r in running.values():
                if r.exit_time is None:
                    pid, status, usage = os.wait4(r.proc.pid, os.WNOHANG)
                    if pid:
                        r.proc.returncode = os.waitstatus_to_exitcode(status)
                        r.exit_time, r.rusage = now, usage
            left = [r for r in running.values() if r.exit_time is None]
            if not left:
                return
            workers_left = [r for r in left if r.pod.job == "rubato-worker"]
            if workers_left:
                self.assertLess(now - start, JOB_DEADLINE_S, "workers still running after %d s: %s"
                                % (JOB_DEADLINE_S, [r.pod.hostname for r in workers_left]))
            else:
                last = max(r.exit_time for r in running.values() if r.pod.job == "rubato-worker")
                self.assertLess(now - last, SERVER_EXIT_S,
                                "still running %d s after the last worker finished: %s" % (
                                    SERVER_EXIT_S, [r.pod.hostname for r in left]))
            time.sleep(0.2)

    def check_servers(self, running, shards):
        servers = [r for r in running.values() if r.pod.job == "rubato-ps"]
        self.assertEqual(len(servers), shards)
        for r in servers:
            stats = [rec for rec in r.json_lines() if rec.get("event") == "stats"]
            self.assertEqual(len(stats), 1, "%s: no final stats line" % r.pod.hostname)

    def check_identical_weights(self, running):
        fingerprints = {r.pod.hostname: rec["params_fnv1a"] for r in running.values()
                        for rec in r.json_lines() if rec.get("event") == "done"}
        self.assertEqual(len(set(fingerprints.values())), 1, fingerprints)

    def test_bsp(self):
        running = self.replay("bsp")
        self.check_servers(running, 2)
        self.check_identical_weights(running)

    def test_bsp_with_tls(self):
        running = self.replay("bsp", tls=True)
        self.check_servers(running, 2)
        self.assertIn("--tls_ca=/opt/rubato/secret/ca.crt", running["rubato-ps-0"].pod.argv())

    def test_ssp(self):
        self.check_servers(self.replay("ssp"), 2)

    def test_stragglers(self):
        running = self.replay("stragglers")
        self.check_servers(running, 2)
        self.check_identical_weights(running)
        delays = {r.pod.index: sum(rec.get("delay_ms", 0) for rec in r.json_lines()
                                   if rec.get("event") == "step")
                  for r in running.values() if r.pod.job == "rubato-worker"}
        self.assertGreater(delays[1], 0, "worker 1 is the straggler: %s" % delays)
        self.assertEqual(delays[0] + delays[2], 0, delays)

    def test_allreduce(self):
        running = self.replay("allreduce")
        self.assertEqual(sorted(running), ["rubato-worker-0", "rubato-worker-1", "rubato-worker-2"])
        self.check_identical_weights(running)


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
