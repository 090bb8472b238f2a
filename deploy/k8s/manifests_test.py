"""Every job file of deploy/k8s/jobs renders (make_job.py) in both forms, JobSet and plain Jobs,
and every object validates against its schema (validate/validate.js: the Kubernetes API's from
kubernetes-models, JobSet's from its vendored CRD, strict about unknown fields); each rendered job
holds together (the cluster spec names exactly the pods the Jobs make, the Service and the
NetworkPolicy select them, the certificates name them, the pods are locked down and fail as
documented) at 1x1, 2x3 and 8x32; two jobs share a namespace; every rendering is a new run; bad
job files are refused naming the problem; and the validator does fail on bad input. Needs node
and deploy/k8s/validate/node_modules (`./rubato setup`): fails, naming what is missing, without.
"""

import base64
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from contextlib import redirect_stderr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bazel import pyunit  # noqa: E402
from deploy.k8s import make_job, render  # noqa: E402

UID = 65532
SERVER_SHUTDOWN_S = 35  # server_main.cc: up to 30 s for the last checkpoint, 5 s to drain.


def pods_of(job):
    """(host name, labels) of each pod an Indexed Job makes."""
    name = job["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    return [("%s-%d" % (name, i), labels) for i in range(job["spec"]["completions"])]


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


class ManifestsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tools = render.Tools()  # ToolMissing: the class errors, naming what is missing

    def render_and_validate(self, *jobs):
        """Validates every object of `jobs` (lists of objects), in one run of the validator."""
        objects = [o for job in jobs for o in job]
        rc, out = self.tools.validate(render.dump(objects))
        self.assertEqual(rc, 0, "does not validate:\n%s" % out)
        oks = sum(line.startswith("ok ") for line in out.splitlines())
        self.assertEqual(oks, len(objects), out)

    # --- one job holds together ----------------------------------------------------------------

    def check_job(self, objects, fields):
        """Everything that must agree in one rendered job (either form)."""
        name = fields["name"]
        allreduce = fields["mode"] == "allreduce"
        for obj in objects:
            meta = obj["metadata"]
            self.assertTrue(meta["name"].startswith(name), meta["name"])
            self.assertEqual(meta["labels"]["app.kubernetes.io/instance"], name)
            self.assertNotIn("namespace", meta, "the manifests are namespace-agnostic")
        run = render.as_run(objects)
        jobs = {o["metadata"]["name"]: o for o in run if o["kind"] == "Job"}
        ps_name, worker_name = name + "-ps-0", name + "-worker-0"
        self.assertEqual(sorted(jobs), sorted([worker_name] + ([] if allreduce else [ps_name])))
        spec = render.cluster_spec(objects)
        self.assertEqual(spec["mode"], fields["mode"].upper())
        self.assertEqual(spec["num_workers"], fields["workers"])
        self.assertEqual(jobs[worker_name]["spec"]["completions"], fields["workers"])
        services = [o for o in run if o["kind"] == "Service"]
        self.assertEqual(len(services), 1, "one headless Service names every pod")
        service = services[0]
        self.assertEqual(service["spec"]["clusterIP"], "None")
        self.assertIs(service["spec"]["publishNotReadyAddresses"], True)
        # The cluster spec's addresses are exactly the pods' DNS names (host.subdomain:port).
        names = {}
        for job in jobs.values():
            pod = job["spec"]["template"]["spec"]
            self.assertEqual(pod["subdomain"], service["metadata"]["name"])
            for host, labels in pods_of(job):
                self.assertTrue(selects(service["spec"]["selector"], labels), host)
                names.setdefault(job["metadata"]["name"], []).append(
                    "%s.%s" % (host, pod["subdomain"]))
        if allreduce:
            self.assertEqual(spec["servers"], [])
            self.assertEqual(spec["workers"], [n + ":6000" for n in names[worker_name]])
        else:
            self.assertEqual(jobs[ps_name]["spec"]["completions"], fields["shards"])
            self.assertEqual(spec["servers"], [n + ":5000" for n in names[ps_name]])
            self.assertEqual(spec["workers"], [])
        for n in sum(names.values(), []):
            self.assertLessEqual(len(n.split(".")[0]), 63, n)
        run_id = self.check_pods(objects, jobs, fields)
        self.check_network_policy(objects, jobs, allreduce)
        self.check_storage(objects, fields)
        secret = render.find(objects, "Secret", name + "-auth")
        self.assertIsNotNone(secret)
        if fields["tls"]:
            self.check_certificates(secret, names, allreduce)
        else:
            self.assertEqual(sorted(secret["data"]), ["job.secret"])
        return run_id

    def check_pods(self, objects, jobs, fields):
        runs = set()
        for job_name, job in jobs.items():
            spec = job["spec"]
            role = "server" if job_name.endswith("-ps-0") else "worker"
            self.assertEqual(spec["completionMode"], "Indexed")
            self.assertEqual(spec["completions"], spec["parallelism"], "all pods at once")
            self.assertEqual(spec["backoffLimitPerIndex"], fields["restarts_per_index"])
            self.assertEqual(spec["maxFailedIndexes"], 0, "a job without one index cannot end")
            self.assertEqual(spec["podReplacementPolicy"], "Failed")
            self.assertGreater(spec["activeDeadlineSeconds"], 0)
            # What a failed pod means (render.pod_failure_action reads the policy as the Job
            # controller does).
            act = lambda code, disrupted=False: render.pod_failure_action(  # noqa: E731
                spec, role, code, disrupted)
            self.assertEqual(act(143, disrupted=True), "Ignore", "an eviction is not counted")
            self.assertEqual(act(75), "Ignore" if role == "server" else "Count")
            self.assertEqual(act(2), "FailJob", "a usage error ends the job")
            for code in (1, 137, 143):
                self.assertEqual(act(code), "Count", code)
            template = spec["template"]
            pod = template["spec"]
            self.assertEqual(pod["restartPolicy"], "Never")
            self.assertEqual(pod["securityContext"], {
                "runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
                "seccompProfile": {"type": "RuntimeDefault"}}, job_name)
            self.assertIs(pod["automountServiceAccountToken"], False)
            self.assertIs(pod["enableServiceLinks"], False)
            if role == "server":
                self.assertGreater(pod["terminationGracePeriodSeconds"], SERVER_SHUTDOWN_S)
            self.assertEqual(len(pod["containers"]), 1)
            c = pod["containers"][0]
            self.assertEqual(c["name"], role)
            self.assertEqual(c["securityContext"], {
                "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]}}, job_name)
            # Guaranteed QoS: no throttling below the limit, no straggler made by the cluster.
            self.assertEqual(c["resources"]["requests"], c["resources"]["limits"], job_name)
            self.assertLessEqual({"cpu", "memory"}, set(c["resources"]["limits"]))
            self.assertEqual(c["readinessProbe"]["grpc"], {"port": 8081})
            self.assertNotIn("livenessProbe", c, "SERVING says nothing of progress")
            self.assertEqual(c["command"], ["/opt/rubato/bin/rubato_" + role])
            args = c["args"]
            self.assertIn("--health_listen=0.0.0.0:8081", args)
            job_id = [a.split("=", 1)[1] for a in args if a.startswith("--job_id=")]
            self.assertEqual(len(job_id), 1)
            runs.add(job_id[0])
            data = "/opt/rubato/data/%s/" % job_id[0]
            if role == "server":
                self.assertIn("--shard_id=$(JOB_COMPLETION_INDEX)", args)
                self.assertIn("--checkpoint_dir=%scheckpoints" % data, args)
                self.assertIn("--stats_file=%soutputs/server-$(JOB_COMPLETION_INDEX).json" % data,
                              args)
            else:
                self.assertIn("--worker_id=$(JOB_COMPLETION_INDEX)", args)
                self.assertIn("--records_file=%soutputs/worker-$(JOB_COMPLETION_INDEX).jsonl"
                              % data, args)
                self.assertIn("--export_model=%soutputs/model.rubato" % data, args)
                self.assertIn("--summary_file=%soutputs/summary.json" % data, args)
                self.assertIn("--epochs=%d" % fields["epochs"], args)
                self.assertIn("--model=" + fields["model"], args)
                if fields["gpu"]:
                    self.assertIn("--backend=cuda", args)
                    self.assertEqual(c["image"], fields["gpu_image"])
                    self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
                else:
                    self.assertEqual(c["image"], fields["image"])
                    self.assertNotIn("nvidia.com/gpu", c["resources"]["limits"])
            mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
            volumes = {v["name"]: v for v in pod["volumes"]}
            self.assertIn("emptyDir", volumes[mounts["/tmp"]["name"]], "a writable /tmp")
            self.assertIn("persistentVolumeClaim", volumes[mounts["/opt/rubato/data"]["name"]])
            for path in ("/opt/rubato/config", "/opt/rubato/secret"):
                self.assertIs(mounts[path].get("readOnly"), True, path)
            secret = volumes[mounts["/opt/rubato/secret"]["name"]]["secret"]
            self.assertEqual(secret["defaultMode"], 0o440)
            keys = sorted(item["key"] for item in secret["items"])
            expected = ["job.secret"]
            if fields["tls"]:
                expected = sorted(expected + ["ca.crt", role + ".crt", role + ".key"])
                self.assertIn("--tls_key=/opt/rubato/secret/%s.key" % role, args)
            self.assertEqual(keys, expected, "%s holds only its own role's key" % job_name)
        self.assertEqual(len(runs), 1, "one job id: %s" % runs)
        return runs.pop()

    def check_network_policy(self, objects, jobs, allreduce):
        policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
        self.assertEqual(len(policies), 1)
        spec = policies[0]["spec"]
        self.assertEqual(spec["policyTypes"], ["Ingress", "Egress"])
        pod_labels = [labels for job in jobs.values() for _, labels in pods_of(job)]
        for labels in pod_labels:
            self.assertTrue(selects(spec["podSelector"]["matchLabels"], labels))
        ports = {p["containerPort"] for job in jobs.values()
                 for p in job["spec"]["template"]["spec"]["containers"][0]["ports"]}
        self.assertEqual(ports, {8081} | ({6000, 6001} if allreduce else {5000, 5001}))
        own, probes = spec["ingress"]
        # The job's ports: only from the job's own pods.
        self.assertEqual({p["port"] for p in own["ports"]}, ports - {8081})
        self.assertEqual(len(own["from"]), 1)
        self.assertEqual(own["from"][0]["podSelector"], spec["podSelector"])
        self.assertEqual([p["port"] for p in probes["ports"]], [8081])
        self.assertIn("ipBlock", probes["from"][0])

    def check_storage(self, objects, fields):
        claims = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
        self.assertEqual([c["metadata"]["name"] for c in claims], [fields["name"] + "-data"])
        spec = claims[0]["spec"]
        self.assertEqual(spec["accessModes"], [fields["storage_access_mode"]])
        self.assertEqual(spec["resources"]["requests"]["storage"], fields["storage_size"])
        self.assertEqual(spec.get("storageClassName", ""), fields["storage_class"])

    def check_certificates(self, secret, names, allreduce):
        data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
        roles = {"worker": [n for job, ns in names.items() if job.endswith("-worker-0")
                            for n in ns]}
        if not allreduce:
            roles["server"] = [n for job, ns in names.items() if job.endswith("-ps-0") for n in ns]
        self.assertEqual(sorted(data), sorted(["ca.crt", "job.secret"] + [
            r + s for r in roles for s in (".crt", ".key")]))
        for role, hosts in roles.items():
            text = subprocess.run(["openssl", "x509", "-noout", "-text"], input=data[role + ".crt"],
                                  stdout=subprocess.PIPE, check=True).stdout.decode()
            sans = set(re.findall(r"DNS:([^,\s]+)", text))
            self.assertEqual(sans, set(hosts) | {h + ".svc.cluster.local" for h in hosts}, role)
            with tempfile.TemporaryDirectory() as d:
                for f in ("ca.crt", role + ".crt"):
                    with open(os.path.join(d, f), "wb") as out:
                        out.write(data[f])
                verify = subprocess.run(["openssl", "verify", "-CAfile", "ca.crt", role + ".crt"],
                                        cwd=d, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.assertEqual(verify.returncode, 0, verify.stdout)
            self.assertNotEqual(data[role + ".key"], b"")
        if not allreduce:
            self.assertNotEqual(data["server.key"], data["worker.key"], "one key pair per role")

    # --- the job files -------------------------------------------------------------------------

    def test_every_job_file_in_both_forms(self):
        rendered = []
        for name in render.JOBS:
            fields = make_job.load(render.job_file(name))
            for form in ("jobset", "jobs"):
                with self.subTest(job=name, form=form):
                    objects = render.job(name, form)
                    rendered.append(objects)
                    self.check_job(objects, fields)
        self.render_and_validate(*rendered)

    def test_the_two_forms_run_the_same_pods(self):
        for name in ("bsp", "allreduce"):
            a = render.job(name, "jobset", job_id="run-1", secret_key=b"k")
            b = render.job(name, "jobs", job_id="run-1", secret_key=b"k")
            jobs_a = {o["metadata"]["name"]: o for o in render.as_run(a) if o["kind"] == "Job"}
            jobs_b = {o["metadata"]["name"]: o for o in b if o["kind"] == "Job"}
            self.assertEqual(sorted(jobs_a), sorted(jobs_b))
            for job_name in jobs_a:
                self.assertEqual(jobs_a[job_name]["spec"]["template"]["spec"],
                                 jobs_b[job_name]["spec"]["template"]["spec"], job_name)

    def test_jobset_policies(self):
        objects = render.job("bsp")
        jobset = render.find(objects, "JobSet", "rubato-bsp")
        spec = jobset["spec"]
        self.assertEqual([r["name"] for r in spec["replicatedJobs"]], ["ps", "worker"])
        # The job is over when the servers are: they end once every worker has finished.
        self.assertEqual(spec["successPolicy"], {"operator": "All", "targetReplicatedJobs": ["ps"]})
        # A failed Job restarts the whole JobSet (from the checkpoints), but a usage error ends it.
        failure = spec["failurePolicy"]
        self.assertGreater(failure["maxRestarts"], 0)
        self.assertEqual(failure["rules"], [{"name": "usage-error", "action": "FailJobSet",
                                             "onJobFailureReasons": ["PodFailurePolicy"]}])
        self.assertEqual(spec["replicatedJobs"][1]["dependsOn"], [{"name": "ps", "status": "Ready"}])
        allreduce = render.find(render.job("allreduce"), "JobSet", "rubato-allreduce")
        self.assertEqual(allreduce["spec"]["successPolicy"]["targetReplicatedJobs"], ["worker"])
        queued = render.find(render.job("kueue"), "JobSet", "rubato-queued")
        self.assertEqual(queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"], "team-a")

    def test_sizes(self):
        rendered = []
        for shards, workers in ((1, 1), (2, 3), (8, 32)):
            for tls in (False, True):
                with self.subTest(shards=shards, workers=workers, tls=tls):
                    settings = ["shards=%d" % shards, "workers=%d" % workers,
                                "name=job-%dx%d-%s" % (shards, workers, "tls" if tls else "plain"),
                                "tls=%s" % tls]
                    fields = make_job.load(render.job_file("bsp"), settings)
                    objects = render.job("bsp", "jobset", settings)
                    rendered.append(objects)
                    self.check_job(objects, fields)
        for workers in (1, 32):
            settings = ["workers=%d" % workers, "tls=true", "name=ring-%d" % workers]
            fields = make_job.load(render.job_file("allreduce"), settings)
            objects = render.job("allreduce", "jobs", settings)
            rendered.append(objects)
            self.check_job(objects, fields)
        self.render_and_validate(*rendered)

    def test_two_jobs_share_a_namespace(self):
        a = render.job("bsp", settings=["name=alpha"])
        b = render.job("bsp", settings=["name=beta"])
        keys = lambda objs: {(o["kind"], o["metadata"]["name"])  # noqa: E731
                             for o in render.as_run(objs)}
        self.assertEqual(keys(a) & keys(b), set())
        policy_a = render.find(a, "NetworkPolicy", "alpha")["spec"]["podSelector"]["matchLabels"]
        for job in [o for o in render.as_run(b) if o["kind"] == "Job"]:
            for _, labels in pods_of(job):
                self.assertFalse(selects(policy_a, labels), "alpha's policy selects beta's pods")

    def test_every_rendering_is_a_new_run(self):
        fields = make_job.load(render.job_file("bsp"))
        first, second = render.job("bsp"), render.job("bsp")
        run1, run2 = self.check_job(first, fields), self.check_job(second, fields)
        self.assertNotEqual(run1, run2)
        self.assertNotEqual(render.find(first, "Secret", "rubato-bsp-auth")["data"],
                            render.find(second, "Secret", "rubato-bsp-auth")["data"])
        # Resuming names the earlier run: its checkpoints, its job id.
        resumed = render.job("bsp", resume=run1)
        self.assertEqual(self.check_job(resumed, fields), run1)
        # GitOps: a given job id and the Secret made outside: the same text every time.
        texts = {render.dump(render.job("bsp", job_id="run-7", external_secret=True))
                 for _ in range(2)}
        self.assertEqual(len(texts), 1)
        self.assertNotIn("kind: Secret", texts.pop())

    def test_bad_job_files_are_refused_naming_the_problem(self):
        cases = [
            (["nme=x"], "unknown field 'nme'"),
            (["workers=three"], "workers must be int"),
            (["workers=0"], "workers must be >= 1"),
            (["name=Rubato"], "is not a DNS label"),
            (["name=" + "a" * 55, "workers=32"], "must be at most 63 characters"),
            (["mode=paxos"], "mode 'paxos' is not one of"),
            (["mode=allreduce"], "set shards: 0"),
            (["optimizer={type: sgd, learning_rate: 0.1, momentun: 0.9}"], "momentun"),
            (["optimizer={type: sgd}"], "needs type and learning_rate"),
            (["storage_access_mode=ReadOnlyMany"], "storage_access_mode"),
            (["worker_args=[slow]"], "'slow' is not a --flag"),
            (["worker_args=[--slow_worker=1:4]"], "--slow_worker is not a flag of rubato_worker"),
            (["server_args=[--batch_size=3]"], "--batch_size is not a flag of rubato_server"),
            (["worker_args=[--worker_id=3]"], "--worker_id is set by make_job.py"),
            (["mode=backup", "backup_workers=3"], "backup_workers must be in [1, workers)"),
            (["shards"], "expected KEY=VALUE"),
        ]
        for settings, message in cases:
            with self.subTest(settings=settings):
                with self.assertRaises(make_job.JobError) as caught:
                    make_job.load(render.job_file("bsp"), settings)
                self.assertIn(message, str(caught.exception))
        for bad in ("../etc", "run 1", "x" * 129):
            with self.assertRaisesRegex(make_job.JobError, "is not a job id"):
                render.job("bsp", job_id=bad)
        with self.assertRaisesRegex(make_job.JobError, "--resume '../x' is not a job id"):
            render.job("bsp", resume="../x")
        with self.assertRaises(make_job.JobError) as caught:
            make_job.load("/nonexistent/job.yaml")
        self.assertIn("cannot read the job file /nonexistent/job.yaml", str(caught.exception))
        err = io.StringIO()
        with redirect_stderr(err):
            self.assertEqual(make_job.main([render.job_file("bsp"), "--set", "shards=-1"]), 2)
        self.assertIn("make_job.py: shards must be >= 1", err.getvalue())

    def test_a_partial_ring_is_the_allreduce_job_with_a_quorum(self):
        fields = make_job.load(render.job_file("allreduce"), ["allreduce_quorum=majority"])
        self.assertIn("consistency { mode: ALLREDUCE allreduce_quorum: QUORUM_MAJORITY }",
                      make_job.cluster_spec(fields))
        self.assertNotIn("allreduce_quorum", make_job.cluster_spec(
            make_job.load(render.job_file("allreduce"))))
        with self.assertRaisesRegex(make_job.JobError, "applies to mode allreduce, not bsp"):
            render.job("bsp", settings=["allreduce_quorum=solo"])
        with self.assertRaisesRegex(make_job.JobError, "must be all, majority or solo"):
            render.job("allreduce", settings=["allreduce_quorum=most"])

    def test_an_adaptive_job_names_its_period(self):
        fields = make_job.load(render.job_file("bsp"), ["mode=adaptive", "adaptive_every_steps=10"])
        self.assertIn("consistency { mode: ADAPTIVE adaptive_every_steps: 10 }",
                      make_job.cluster_spec(fields))
        self.assertNotIn("adaptive_every_steps", make_job.cluster_spec(
            make_job.load(render.job_file("bsp"))))
        with self.assertRaisesRegex(make_job.JobError, "adaptive_every_steps must be >= 1"):
            render.job("bsp", settings=["mode=adaptive", "adaptive_every_steps=0"])

    def test_every_cluster_spec_is_one_the_server_takes(self):
        """Each job file's cluster spec, given to the real rubato_server as its pods give it:
        it serves (a bad spec would exit 2 at once), and stops at SIGTERM with 143."""
        server = os.path.join(render.RUNFILES, "server", "rubato_server")
        with tempfile.TemporaryDirectory() as d:
            for name in render.JOBS:
                fields = make_job.load(render.job_file(name))
                if fields["mode"] == "allreduce":
                    continue
                spec, port = os.path.join(d, name + ".pbtxt"), os.path.join(d, name + ".port")
                with open(spec, "w") as f:
                    f.write(make_job.cluster_spec(fields))
                proc = subprocess.Popen(
                    [server, "--cluster_spec=" + spec, "--shard_id=%d" % (fields["shards"] - 1),
                     "--listen=127.0.0.1:0", "--port_file=" + port, "--insecure"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                try:
                    deadline = time.monotonic() + 30
                    while not os.path.exists(port) and proc.poll() is None \
                            and time.monotonic() < deadline:
                        time.sleep(0.05)
                    if proc.poll() is not None:
                        self.fail("%s: the server exited %d: %s" % (
                            name, proc.returncode, proc.stderr.read().decode(errors="replace")))
                    self.assertTrue(os.path.exists(port), name)
                    proc.send_signal(signal.SIGTERM)
                    self.assertEqual(proc.wait(timeout=30), 128 + signal.SIGTERM, name)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.wait()
                    proc.stderr.close()

    def test_the_flag_reference_is_read(self):
        flags = make_job.binary_flags()
        self.assertIsNotNone(flags, make_job.FLAGS_MD)
        self.assertIn("slow_workers", flags["rubato_worker"])
        self.assertIn("checkpoint_keep", flags["rubato_server"])
        self.assertIn("learning_rate", flags["rubato_server"] & flags["rubato_worker"])
        self.assertNotIn("batch_size", flags["rubato_server"])
        make_job.check_args("worker_args", ["--nooverlap", "--overlap=false"], "rubato_worker",
                            flags)

    def test_field_lists_follow_the_contract(self):
        with open(os.path.join(render.RUNFILES, "proto", "cluster.proto")) as f:
            proto = f.read()

        def fields(message):
            body = re.search(r"message %s \{(.*?)\n\}" % message, proto, re.S).group(1)
            return set(re.findall(r"^\s*(?:optional |repeated )?\w+ (\w+) = \d+;", body, re.M))
        self.assertEqual(make_job.OPTIMIZER_FIELDS, fields("OptimizerConfig"))
        self.assertEqual(make_job.LR_SCHEDULE_FIELDS, fields("LearningRateSchedule"))

    # --- the validator fails where it should ---------------------------------------------------

    def text(self, form):
        return render.dump(render.job("bsp", form, job_id="run-1", secret_key=b"k"))

    def assert_invalid(self, text, *expected):
        rc, out = self.tools.validate(text)
        self.assertEqual(rc, 1, out)
        for e in expected:
            self.assertIn(e, out)

    def test_validator_fails_on_a_wrong_type(self):
        text = self.text("jobs").replace("  parallelism: 3\n", "  parallelism: three\n", 1)
        self.assertNotEqual(text, self.text("jobs"))
        self.assert_invalid(text, "FAIL Job/rubato-bsp-worker-0: /spec/parallelism must be integer",
                            "ok Job/rubato-bsp-ps-0")
        text = self.text("jobset").replace("maxRestarts: 3", "maxRestarts: many", 1)
        self.assert_invalid(text, "FAIL JobSet/rubato-bsp: /spec/failurePolicy/maxRestarts must "
                                  "be integer")

    def test_validator_fails_on_an_unknown_kind(self):
        self.assert_invalid(self.text("jobs").replace("kind: Job\n", "kind: Jobb\n", 1),
                            "unknown kind Jobb in batch/v1")
        self.assert_invalid(self.text("jobset").replace("jobset.x-k8s.io/v1alpha2",
                                                        "jobset.x-k8s.io/v1", 1),
                            "unknown kind JobSet in jobset.x-k8s.io/v1")

    def test_validator_fails_on_an_unknown_field(self):
        text = self.text("jobs").replace("publishNotReadyAddresses: true",
                                         "publishNotReadyAdresses: true", 1)
        self.assert_invalid(text, "FAIL Service/rubato-bsp: /spec/publishNotReadyAdresses: "
                                  "unknown field")
        objects = render.job("bsp", job_id="run-1", secret_key=b"k")
        jobset = render.find(objects, "JobSet", "rubato-bsp")
        container = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"][0]
        container["securityContext"]["runAsUsr"] = 1
        self.assert_invalid(render.dump(objects), "FAIL JobSet/rubato-bsp: /spec/replicatedJobs/0/template/spec/"
                                  "template/spec/containers/0/securityContext/runAsUsr: "
                                  "unknown field")
        text = self.text("jobset").replace("  successPolicy:", "  sucessPolicy:", 1)
        self.assert_invalid(text, "/spec/sucessPolicy: unknown field")

    def test_validator_fails_on_what_the_api_server_refuses(self):
        text = self.text("jobs").replace("restartPolicy: Never", "restartPolicy: Always", 1)
        self.assert_invalid(text, "a Job's pods need restartPolicy Never or OnFailure, got Always")
        text = self.text("jobs").replace("restartPolicy: Never", "restartPolicy: OnFailure", 1)
        self.assert_invalid(text, "a podFailurePolicy needs the pods' restartPolicy Never")
        text = self.text("jobset").replace("restartPolicy: Never", "restartPolicy: OnFailure", 1)
        self.assert_invalid(text, "replicated job ps: a podFailurePolicy needs the pods' "
                                  "restartPolicy Never")
        text = self.text("jobs").replace("name: rubato-bsp-ps-0\n", "name: rubato_bsp\n", 1)
        self.assert_invalid(text, 'metadata.name "rubato_bsp" is not a valid')

    def test_validator_refuses_bad_yaml_and_empty_input(self):
        rc, out = self.tools.validate("kind: Job\n  metadata: [\n")
        self.assertEqual(rc, 2, out)
        rc, out = self.tools.validate("")
        self.assertEqual(rc, 1, out)
        self.assertIn("no objects", out)


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/k8s/manifests_test"))
