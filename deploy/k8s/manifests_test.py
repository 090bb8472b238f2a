"""Every overlay of deploy/k8s renders (`kubectl kustomize`, offline) and every object it renders
validates against the Kubernetes API schema (validate/validate.js: kubernetes-models, strict about
unknown fields); the rendered jobs hold together (the cluster spec names exactly the pods the Jobs
make, the Services select them, the pods are locked down); and the validator does fail on bad
input. Needs kubectl and deploy/k8s/validate/node_modules (`./rubato setup`): fails, naming what
is missing, without them.
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bazel import pyunit  # noqa: E402
from deploy.k8s import render  # noqa: E402

COMMON_LABELS = {
    "app.kubernetes.io/name": "rubato",
    "app.kubernetes.io/part-of": "rubato",
    "app.kubernetes.io/managed-by": "kustomize",
}
UID = 65532


class ManifestsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tools = render.Tools()  # ToolMissing: the class errors, naming what is missing
        cls.checkout = render.Checkout(cls.tools.kubectl)
        cls.rendered = {}

    @classmethod
    def tearDownClass(cls):
        cls.checkout.close()

    def render_and_validate(self, overlay):
        """The overlay's objects, after checking that it renders and that every object is ok."""
        text = self.checkout.render(overlay)
        rc, out = self.tools.validate(text)
        self.assertEqual(rc, 0, "overlays/%s does not validate:\n%s" % (overlay, out))
        objects = self.tools.to_objects(text)
        oks = sum(line.startswith("ok ") for line in out.splitlines())
        self.assertEqual(oks, len(objects), out)
        for obj in objects:
            labels = obj["metadata"].get("labels", {})
            for key, value in COMMON_LABELS.items():
                self.assertEqual(labels.get(key), value, "%s/%s: label %s"
                                 % (obj["kind"], obj["metadata"]["name"], key))
            self.assertNotIn("namespace", obj["metadata"], "the manifests are namespace-agnostic")
        return objects

    # --- checks shared by the overlays ---------------------------------------------------------

    def check_pod(self, job, restart_policy):
        """The pod template of `job`: locked down, bounded, probed, with a shell-free command."""
        name = job["metadata"]["name"]
        spec = job["spec"]
        self.assertEqual(spec.get("completionMode"), "Indexed", name)
        self.assertEqual(spec["completions"], spec["parallelism"], name + ": all pods at once")
        self.assertGreater(spec.get("activeDeadlineSeconds", 0), 0, name)
        self.assertGreater(spec.get("ttlSecondsAfterFinished", 0), 0, name)
        template = spec["template"]
        for key, value in COMMON_LABELS.items():
            self.assertEqual(template["metadata"]["labels"].get(key), value, name)
        pod = template["spec"]
        self.assertEqual(pod["restartPolicy"], restart_policy, name)
        self.assertEqual(pod["securityContext"], {
            "runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}, name)
        self.assertIs(pod.get("automountServiceAccountToken"), False, name)
        self.assertIs(pod.get("enableServiceLinks"), False, name)
        self.assertEqual(len(pod["containers"]), 1, name)
        c = pod["containers"][0]
        self.assertEqual(c["securityContext"], {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}, name)
        for kind in ("requests", "limits"):
            self.assertEqual({"cpu", "memory"} - set(c["resources"].get(kind, {})), set(),
                             "%s: resources.%s" % (name, kind))
        for probe in ("readinessProbe", "livenessProbe"):
            self.assertEqual(c[probe]["grpc"], {"port": 8081}, "%s: %s" % (name, probe))
        # No shell in the image (FROM scratch): the command is the binary itself.
        self.assertEqual(len(c["command"]), 1, name)
        self.assertTrue(c["command"][0].startswith("/opt/rubato/bin/rubato_"), c["command"])
        self.assertIn("--health_listen=0.0.0.0:8081", c["args"])
        self.assertIn("--cluster_spec=/opt/rubato/config/cluster.pbtxt", c["args"])
        self.assertIn("--auth_secret_file=/opt/rubato/secret/job.secret", c["args"])
        # Every process of the run gets the same job id, from the ConfigMap make-secret.sh's
        # base/job.id makes (renamed by its content, so a new id is a new ConfigMap).
        self.assertIn("--job_id=$(RUBATO_JOB_ID)", c["args"])
        job_id = {e["name"]: e for e in c["env"]}["RUBATO_JOB_ID"]["valueFrom"]["configMapKeyRef"]
        self.assertTrue(job_id["name"].startswith("rubato-job-id-"), job_id)
        self.assertEqual(job_id["key"], "job.id")
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        config = volumes[mounts["/opt/rubato/config"]["name"]]
        secret = volumes[mounts["/opt/rubato/secret"]["name"]]
        self.assertTrue(config["configMap"]["name"].startswith("rubato-cluster-"), config)
        self.assertTrue(secret["secret"]["secretName"].startswith("rubato-job-"), secret)
        # 0440 and fsGroup: root:65532, group-readable only, which the binaries accept.
        self.assertEqual(secret["secret"]["defaultMode"], 0o440)
        # Read-only, but for the servers' checkpoints (check_parameter_servers).
        self.assertTrue(all(m.get("readOnly") for path, m in mounts.items()
                            if path != "/opt/rubato/checkpoints"), name)
        return pod, c

    def check_headless_service(self, objects, name, ports, component):
        service = render.find(objects, "Service", name)
        self.assertIsNotNone(service, "no Service " + name)
        spec = service["spec"]
        self.assertEqual(spec["clusterIP"], "None")
        self.assertIs(spec["publishNotReadyAddresses"], True)
        self.assertEqual([p["port"] for p in spec["ports"]], ports)
        self.assertEqual(spec["selector"], {"app.kubernetes.io/name": "rubato",
                                            "app.kubernetes.io/component": component})
        return service

    def check_parameter_servers(self, objects, shards, workers, mode):
        spec = render.cluster_spec(objects)
        self.assertEqual(spec["mode"], mode)
        self.assertEqual(spec["servers"],
                         ["rubato-ps-%d.rubato-ps:5000" % i for i in range(shards)])
        self.assertEqual(spec["workers"], [])
        self.assertEqual(spec["num_workers"], workers)
        ps = render.find(objects, "Job", "rubato-ps")
        self.assertIsNotNone(ps, "no Job rubato-ps")
        self.assertEqual(ps["spec"]["completions"], shards)
        # A dead server restarts in its pod and restores its checkpoints from the shared claim.
        self.assertGreater(ps["spec"]["backoffLimit"], 0)
        pod, c = self.check_pod(ps, "OnFailure")
        self.assertEqual(pod["subdomain"], "rubato-ps")
        self.assertIn("--shard_id=$(JOB_COMPLETION_INDEX)", c["args"])
        self.assertIn("--listen=0.0.0.0:5000", c["args"])
        self.assertIn("--data_port=5001", c["args"])  # The Push and Pull data plane's port.
        self.assertLessEqual({5000, 5001}, {p["containerPort"] for p in c["ports"]})
        self.assertIn("--checkpoint_dir=/opt/rubato/checkpoints", c["args"])
        mounts = {m["name"]: m for m in c["volumeMounts"]}
        self.assertEqual(mounts["checkpoints"]["mountPath"], "/opt/rubato/checkpoints")
        self.assertFalse(mounts["checkpoints"].get("readOnly", False))
        volumes = {v["name"]: v for v in pod["volumes"]}
        claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
        pvc = render.find(objects, "PersistentVolumeClaim", claim)
        self.assertIsNotNone(pvc, "no PersistentVolumeClaim " + claim)
        self.assertEqual(pvc["spec"]["accessModes"], ["ReadWriteMany"])
        service = self.check_headless_service(objects, "rubato-ps", [5000, 5001], "parameter-server")
        for key, value in service["spec"]["selector"].items():
            self.assertEqual(ps["spec"]["template"]["metadata"]["labels"][key], value)
        return self.check_workers(objects, workers, "rubato-ps")

    def check_workers(self, objects, workers, not_selected_by):
        job = render.find(objects, "Job", "rubato-worker")
        self.assertIsNotNone(job, "no Job rubato-worker")
        self.assertEqual(job["spec"]["completions"], workers)
        self.assertGreater(job["spec"]["backoffLimit"], 0)
        pod, c = self.check_pod(job, "OnFailure")
        self.assertIn("--worker_id=$(JOB_COMPLETION_INDEX)", c["args"])
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        self.assertEqual(env.get("RUBATO_EPOCHS"), "1", "a short job by default")
        other = render.find(objects, "Service", not_selected_by)
        if other:
            labels = job["spec"]["template"]["metadata"]["labels"]
            self.assertFalse(all(labels.get(k) == v for k, v in other["spec"]["selector"].items()),
                             "Service %s selects the workers" % not_selected_by)
        return job, pod, c

    # --- the overlays --------------------------------------------------------------------------

    def test_every_overlay_is_tested(self):
        found = sorted(d for d in os.listdir(os.path.join(render.K8S, "overlays")))
        self.assertEqual(found, render.OVERLAYS)

    def test_bsp(self):
        objects = self.render_and_validate("bsp")
        self.assertEqual(sorted((o["kind"], o["metadata"]["name"].rsplit("-", 1)[0]
                                 if o["kind"] in ("ConfigMap", "Secret") else o["metadata"]["name"])
                                for o in objects),
                         [("ConfigMap", "rubato-cluster"), ("ConfigMap", "rubato-job-id"),
                          ("Job", "rubato-ps"),
                          ("Job", "rubato-worker"),
                          ("PersistentVolumeClaim", "rubato-checkpoints"),
                          ("Secret", "rubato-job"), ("Service", "rubato-ps")])
        _, _, c = self.check_parameter_servers(objects, shards=2, workers=3, mode="BSP")
        self.assertEqual(c["image"], "rubato:cpu")
        self.assertFalse([a for a in c["args"]
                          if a.startswith(("--slow", "--backend", "--listen"))])
        secret = render.generated(objects, "Secret", "rubato-job")
        self.assertEqual(sorted(secret["data"]), ["job.secret"])

    def test_ssp(self):
        objects = self.render_and_validate("ssp")
        self.check_parameter_servers(objects, shards=2, workers=3, mode="SSP")
        self.assertEqual(render.cluster_spec(objects)["staleness"], 2)

    def test_stragglers(self):
        objects = self.render_and_validate("stragglers")
        _, _, c = self.check_parameter_servers(objects, shards=2, workers=3, mode="BSP")
        self.assertEqual(c["args"][-1], "--slow_workers=1:4")

    def test_gpu(self):
        objects = self.render_and_validate("gpu")
        _, pod, c = self.check_parameter_servers(objects, shards=2, workers=3, mode="BSP")
        self.assertEqual(c["image"], "rubato:gpu")
        self.assertIn("--backend=cuda", c["args"])
        self.assertEqual(c["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertIn({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                      pod["tolerations"])
        server = render.find(objects, "Job", "rubato-ps")["spec"]["template"]["spec"]
        self.assertEqual(server["containers"][0]["image"], "rubato:cpu", "servers need no GPU")
        self.assertNotIn("nvidia.com/gpu", server["containers"][0]["resources"]["limits"])

    def test_allreduce(self):
        objects = self.render_and_validate("allreduce")
        self.assertIsNone(render.find(objects, "Job", "rubato-ps"), "allreduce has no servers")
        self.assertIsNone(render.find(objects, "Service", "rubato-ps"))
        spec = render.cluster_spec(objects)
        self.assertEqual(spec["mode"], "ALLREDUCE")
        self.assertEqual(spec["servers"], [])
        self.assertEqual(spec["workers"],
                         ["rubato-worker-%d.rubato-ring:6000" % i for i in range(3)])
        self.assertEqual(spec["num_workers"], 3)
        job, pod, c = self.check_workers(objects, 3, "rubato-ps")
        self.assertEqual(pod["subdomain"], "rubato-ring")
        self.assertIn("--listen=0.0.0.0:6000", c["args"])
        self.assertIn("--ring_data_port=6001", c["args"])  # The TCP data connection's port.
        self.assertLessEqual({6000, 6001}, {p["containerPort"] for p in c["ports"]})
        service = self.check_headless_service(objects, "rubato-ring", [6000, 6001], "worker")
        for key, value in service["spec"]["selector"].items():
            self.assertEqual(job["spec"]["template"]["metadata"]["labels"][key], value)

    def test_tls_component(self):
        # make-secret.sh --tls writes the certificate files; any overlay can then add the component.
        self.checkout.make_tls(shards=2, workers=3)
        tls_args = ["--tls_cert=/opt/rubato/secret/tls.crt", "--tls_key=/opt/rubato/secret/tls.key",
                    "--tls_ca=/opt/rubato/secret/ca.crt"]
        for overlay, jobs in (("bsp", ["rubato-ps", "rubato-worker"]),
                              ("allreduce", ["rubato-worker"])):
            self.checkout.add_overlay(overlay + "-tls", ["../" + overlay], ["../../components/tls"])
            objects = self.render_and_validate(overlay + "-tls")
            secret = render.generated(objects, "Secret", "rubato-job")
            self.assertEqual(sorted(secret["data"]), ["ca.crt", "job.secret", "tls.crt", "tls.key"])
            for name in jobs:
                pod = render.find(objects, "Job", name)["spec"]["template"]["spec"]
                self.assertEqual(pod["containers"][0]["args"][-3:], tls_args, name)

    # --- the validator fails where it should ---------------------------------------------------

    def bsp_text(self):
        if "bsp" not in self.rendered:
            self.rendered["bsp"] = self.checkout.render("bsp")
        return self.rendered["bsp"]

    def assert_invalid(self, text, *expected):
        rc, out = self.tools.validate(text)
        self.assertEqual(rc, 1, out)
        for e in expected:
            self.assertIn(e, out)

    def test_validator_fails_on_a_wrong_type(self):
        text = self.bsp_text().replace("  parallelism: 3\n", "  parallelism: three\n", 1)
        self.assertNotEqual(text, self.bsp_text())
        self.assert_invalid(text, "FAIL Job/rubato-worker: /spec/parallelism must be integer",
                            "ok Job/rubato-ps")

    def test_validator_fails_on_an_unknown_kind(self):
        text = self.bsp_text().replace("kind: Job\n", "kind: Jobb\n", 1)
        self.assert_invalid(text, "unknown kind Jobb in batch/v1")
        self.assert_invalid("apiVersion: rubato.dev/v1\nkind: Job\nmetadata:\n  name: x\n",
                            "unknown kind Job in rubato.dev/v1")

    def test_validator_fails_on_an_unknown_field(self):
        text = self.bsp_text().replace("publishNotReadyAddresses: true",
                                       "publishNotReadyAdresses: true", 1)
        self.assert_invalid(text, "FAIL Service/rubato-ps: /spec/publishNotReadyAdresses: "
                                  "unknown field")
        text = self.bsp_text().replace("readOnlyRootFilesystem: true",
                                       "readOnlyRootFilesystem: true\n          runAsUsr: 1", 1)
        self.assert_invalid(text, "/spec/template/spec/containers/0/securityContext/runAsUsr: "
                                  "unknown field")

    def test_validator_fails_on_what_the_api_server_refuses(self):
        text = self.bsp_text().replace("restartPolicy: OnFailure", "restartPolicy: Always", 1)
        self.assert_invalid(text, ": a Job's pods need restartPolicy Never or OnFailure, got Always")
        text = self.bsp_text().replace("name: rubato-ps\n", "name: rubato_ps\n", 1)
        self.assert_invalid(text, 'metadata.name "rubato_ps" is not a valid')

    def test_validator_refuses_bad_yaml_and_empty_input(self):
        rc, out = self.tools.validate("kind: Job\n  metadata: [\n")
        self.assertEqual(rc, 2, out)
        rc, out = self.tools.validate("")
        self.assertEqual(rc, 1, out)
        self.assertIn("no objects", out)


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/k8s/manifests_test"))
