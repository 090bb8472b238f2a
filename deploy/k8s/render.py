"""Renders Rubato's Kubernetes jobs offline, for tests (manifests_test, the replay):

    tools = render.Tools()                      # node and the validator's packages; ToolMissing
    objects = render.job("bsp", form="jobset")  # make_job.py on deploy/k8s/jobs/bsp.yaml
    text = render.dump(objects)
    rc, out = tools.validate(text)              # validate.js: rc 0 when every object is ok
    children = render.jobset_children(render.find(objects, "JobSet", "rubato-bsp"))

Files are found through the test's runfiles: deploy/k8s's job files are data of the test, and the
real path of validate.js leads back to the source tree, where `./rubato setup` installed
deploy/k8s/validate/node_modules (it is not a Bazel input: 33 MB of npm packages).
"""

import copy
import json
import os
import re
import shutil
import subprocess

from deploy.k8s import make_job

# The runfiles root: this file is deploy/k8s/render.py below it.
RUNFILES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(RUNFILES, "deploy", "k8s")
JOBS = sorted(f[:-len(".yaml")] for f in os.listdir(os.path.join(K8S, "jobs"))
              if f.endswith(".yaml"))

SETUP_HINT = "run ./rubato setup (it installs them), then rerun the test"


class ToolMissing(Exception):
    """node or the validator's node_modules are missing (the message says which)."""


class Tools:
    """node with deploy/k8s/validate's packages."""

    def __init__(self):
        self.node = shutil.which("node") or shutil.which("nodejs")
        if not self.node:
            raise ToolMissing("node is not on PATH: it runs the validator; " + SETUP_HINT)
        self.validate_js = os.path.realpath(os.path.join(K8S, "validate", "validate.js"))
        modules = os.path.join(os.path.dirname(self.validate_js), "node_modules")
        for package in ("kubernetes-models", "yaml", "ajv"):
            if not os.path.isdir(os.path.join(modules, package)):
                raise ToolMissing("%s has no %s: %s" % (modules, package, SETUP_HINT))

    def run_validator(self, args, text):
        """(rc, stdout + stderr) of `node validate.js ARGS -` with `text` on stdin."""
        done = subprocess.run([self.node, self.validate_js] + list(args) + ["-"], input=text,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=120)
        return done.returncode, done.stdout

    def validate(self, text):
        return self.run_validator([], text)


def job_file(name):
    return os.path.join(K8S, "jobs", name + ".yaml")


def job(name, form="jobset", settings=(), **kwargs):
    """make_job's objects for deploy/k8s/jobs/NAME.yaml with `settings` ("key=value")."""
    return make_job.render(make_job.load(job_file(name), settings), form, **kwargs)


def dump(objects):
    return make_job.dump(objects)


def find(objects, kind, name):
    """The object of that kind and name, or None."""
    for obj in objects:
        if obj.get("kind") == kind and obj.get("metadata", {}).get("name") == name:
            return obj
    return None


def jobset_children(jobset):
    """What the JobSet controller (kubernetes-sigs/jobset v0.9) makes of a JobSet: for each
    replicated job R and job index j, the Job <jobset>-R-j with the template's labels, the JobSet's
    labels (jobset.sigs.k8s.io/...) and, with DNS host names, the pods' subdomain; and the headless
    Service named the subdomain, selecting every pod of the JobSet. Jobs in replicatedJobs order."""
    name = jobset["metadata"]["name"]
    spec = jobset["spec"]
    network = spec.get("network", {})
    dns = network.get("enableDNSHostnames", True)
    subdomain = network.get("subdomain") or name
    children = []
    if dns:
        children.append({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": subdomain},
            "spec": {"clusterIP": "None",
                     "publishNotReadyAddresses": network.get("publishNotReadyAddresses", True),
                     "selector": {"jobset.sigs.k8s.io/jobset-name": name}}})
    for rjob in spec["replicatedJobs"]:
        for j in range(rjob.get("replicas", 1)):
            job = copy.deepcopy(rjob["template"])
            job_name = "%s-%s-%d" % (name, rjob["name"], j)
            added = {"jobset.sigs.k8s.io/jobset-name": name,
                     "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                     "jobset.sigs.k8s.io/job-index": str(j)}
            meta = job.setdefault("metadata", {})
            meta["name"] = job_name
            meta.setdefault("labels", {}).update(added)
            pod_meta = job["spec"]["template"].setdefault("metadata", {})
            pod_meta.setdefault("labels", {}).update(added)
            if dns:
                job["spec"]["template"]["spec"]["subdomain"] = subdomain
            children.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                             "spec": job["spec"]})
    return children


def as_run(objects):
    """The objects a cluster would run: a JobSet replaced by its children."""
    out = []
    for obj in objects:
        out += jobset_children(obj) if obj["kind"] == "JobSet" else [obj]
    return out


def cluster_spec(objects):
    """A rough reading of the cluster spec in the job's ConfigMap (only what the topology checks
    need): {"servers": [...], "workers": [...], "num_workers": N, "mode": "BSP", "staleness": S}."""
    config = next(o for o in objects if o["kind"] == "ConfigMap"
                  and o["metadata"]["name"].endswith("-cluster"))
    text = config["data"]["cluster.pbtxt"]
    text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    spec = {
        "servers": re.findall(r'\bservers:\s*"([^"]*)"', text),
        "workers": re.findall(r'\bworkers:\s*"([^"]*)"', text),
    }
    for field, pattern in (("num_workers", r"\bnum_workers:\s*(\d+)"),
                           ("staleness", r"\bstaleness:\s*(\d+)")):
        m = re.search(pattern, text)
        spec[field] = int(m.group(1)) if m else None
    m = re.search(r"\bmode:\s*([A-Z_]+)", text)
    spec["mode"] = m.group(1) if m else None
    return spec


def to_json(objects):
    return json.loads(json.dumps(objects))


def pod_failure_action(job_spec, container, exit_code, disrupted=False):
    """What the Job controller does with a failed pod of this Job (its podFailurePolicy, Kubernetes
    1.31): "Ignore" (replaced, not counted), "FailJob", or "Count" (counted against its index's
    backoffLimitPerIndex, then replaced). The first rule that matches decides; `disrupted`: the pod
    has the condition DisruptionTarget (evicted, preempted, its node drained or lost)."""
    for rule in job_spec.get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is not None:
            if codes.get("containerName", container) != container:
                continue
            hit = exit_code in codes["values"]
            if (hit if codes["operator"] == "In" else not hit) and exit_code != 0:
                return rule["action"]
        for condition in rule.get("onPodConditions", []):
            if (condition["type"] == "DisruptionTarget" and disrupted
                    and condition.get("status", "True") == "True"):
                return rule["action"]
    return "Count"
