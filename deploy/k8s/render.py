"""Renders the Kubernetes overlays of deploy/k8s offline, for tests (manifests_test, the replay).

    tools = render.Tools()                     # kubectl and node_modules; raises ToolMissing
    with render.Checkout() as k8s:             # a copy of deploy/k8s with a throwaway job secret
        text = k8s.render("bsp")               # kubectl kustomize overlays/bsp
        objects = tools.to_objects(text)       # YAML -> list of dicts, via validate.js --to-json
        rc, out = tools.validate(text)         # validate.js: rc 0 when every object is ok

Files are found through the test's runfiles: deploy/k8s's manifests are data of the test, and the
real path of validate.js leads back to the source tree, where `./rubato setup` installed
deploy/k8s/validate/node_modules (it is not a Bazel input: 33 MB of npm packages).
"""

import os
import secrets
import shutil
import subprocess
import tempfile

# The runfiles root: this file is deploy/k8s/render.py below it.
RUNFILES = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(RUNFILES, "deploy", "k8s")
OVERLAYS = ["allreduce", "bsp", "gpu", "ssp", "stragglers"]

SETUP_HINT = "run ./rubato setup (it installs them), then rerun the test"


class ToolMissing(Exception):
    """kubectl, node or the validator's node_modules are missing (the message says which)."""


class Tools:
    """kubectl (with kustomize) and node with deploy/k8s/validate's packages."""

    def __init__(self):
        self.kubectl = shutil.which("kubectl")
        if not self.kubectl:
            raise ToolMissing("kubectl is not on PATH: it renders the overlays (`kubectl "
                              "kustomize`, kubectl >= 1.27 for kustomize v5); install it from "
                              "your Kubernetes distribution (Debian's kubernetes-client 1.20 is "
                              "too old)")
        self.node = shutil.which("node") or shutil.which("nodejs")
        if not self.node:
            raise ToolMissing("node is not on PATH: it runs the validator; " + SETUP_HINT)
        self.validate_js = os.path.realpath(os.path.join(K8S, "validate", "validate.js"))
        modules = os.path.join(os.path.dirname(self.validate_js), "node_modules")
        for package in ("kubernetes-models", "yaml"):
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

    def to_objects(self, text):
        import json
        rc, out = self.run_validator(["--to-json"], text)
        if rc != 0:
            raise ValueError("validate.js --to-json failed (rc %d): %s" % (rc, out))
        return json.loads(out)


class Checkout:
    """A temporary copy of deploy/k8s (base, components, overlays, make-secret.sh) with
    base/job.secret and base/job.id made up for the occasion (the real ones, and any TLS files, are
    never read), so that the generators have files to read."""

    def __init__(self, kubectl=None):
        self.kubectl = kubectl or shutil.which("kubectl")
        self.dir = tempfile.mkdtemp(prefix="rubato-k8s-")
        try:
            for part in ("base", "components", "overlays"):
                shutil.copytree(os.path.join(K8S, part), os.path.join(self.dir, part),
                                ignore=shutil.ignore_patterns("job.secret", "job.id", "*.crt",
                                                              "*.key"))
            shutil.copy(os.path.join(K8S, "make-secret.sh"), self.dir)
            self.secret = secrets.token_hex(32).encode()
            path = os.path.join(self.dir, "base", "job.secret")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self.secret)
            self.job_id = "rubato-render-" + secrets.token_hex(8)
            with open(os.path.join(self.dir, "base", "job.id"), "w") as f:
                f.write(self.job_id)
        except Exception:
            self.close()
            raise

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def add_overlay(self, name, resources, components=()):
        """Writes overlays/NAME: the given resources (paths relative to it) and components."""
        os.makedirs(self.path("overlays", name))
        lines = ["apiVersion: kustomize.config.k8s.io/v1beta1", "kind: Kustomization", "resources:"]
        lines += ["  - " + r for r in resources]
        if components:
            lines += ["components:"] + ["  - " + c for c in components]
        with open(self.path("overlays", name, "kustomization.yaml"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def make_tls(self, shards, workers):
        """Runs make-secret.sh --tls SHARDS WORKERS: components/tls gets its certificate files."""
        subprocess.run([os.path.join(self.dir, "make-secret.sh"), "--tls", str(shards),
                        str(workers)], check=True, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=60)

    def render(self, overlay):
        """`kubectl kustomize overlays/OVERLAY`'s output; raises RuntimeError with its message."""
        done = subprocess.run([self.kubectl, "kustomize", self.path("overlays", overlay)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=120)
        if done.returncode != 0:
            raise RuntimeError("kubectl kustomize overlays/%s failed (rc %d): %s"
                               % (overlay, done.returncode, done.stderr.strip()))
        return done.stdout

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def find(objects, kind, name):
    """The object of that kind and name, or None."""
    for obj in objects:
        if obj.get("kind") == kind and obj.get("metadata", {}).get("name") == name:
            return obj
    return None


def generated(objects, kind, prefix):
    """The object generated by kustomize from NAME (named NAME-<hash>), or None."""
    for obj in objects:
        name = obj.get("metadata", {}).get("name", "")
        if obj.get("kind") == kind and (name == prefix or name.startswith(prefix + "-")):
            return obj
    return None


def cluster_spec(objects):
    """A rough reading of the rendered cluster.pbtxt (only what the topology checks need):
    {"servers": [...], "workers": [...], "num_workers": N, "mode": "BSP", "staleness": S}."""
    import re
    config = generated(objects, "ConfigMap", "rubato-cluster")
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
