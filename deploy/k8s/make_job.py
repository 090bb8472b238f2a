#!/usr/bin/env python3
"""make_job.py: every Kubernetes object of one Rubato job, from one job file.

    deploy/k8s/make_job.py deploy/k8s/jobs/bsp.yaml > job.yaml     # a JobSet (the default form)
    deploy/k8s/make_job.py deploy/k8s/jobs/bsp.yaml --form jobs    # plain Indexed Jobs instead
    deploy/k8s/make_job.py jobs/bsp.yaml --set shards=8 --set workers=32 --set name=big
    kubectl apply -f job.yaml

The job file (YAML) holds the job's size and training in one place: its name, the number of
shards and workers, the consistency mode, model, optimizer and length, the image, storage and
queue. Everything that depends on them follows from it here, so that nothing can disagree: the
cluster spec's server and worker addresses, the Jobs' completions and parallelism, the DNS names
in the TLS certificates, the NetworkPolicy's ports, object names (all prefixed by the job's name,
so that several jobs share a namespace). FIELDS below lists every key, its default and meaning.

Each rendering is one run: a fresh job id (common/auth.h, mixed into every token) and, unless
`--secret external`, a fresh job secret in a Secret of its own, so that no secret is reused across
runs. Checkpoints and outputs go to <run>/ on the job's volume, <run> being the job id; to resume
an earlier run, `--resume RUN` names its directory (and keeps its job id). With
`--secret external --job_id ID` the output is deterministic (GitOps): the Secret <name>-auth is
then made outside (`kubectl create secret generic NAME-auth --from-file=job.secret`).

Objects (form jobset): Secret <name>-auth, ConfigMap <name>-cluster, PersistentVolumeClaim
<name>-data, NetworkPolicy <name>, JobSet <name> (replicated jobs ps and worker; worker alone for
allreduce). Form jobs: the same with two Indexed Jobs <name>-ps-0 and <name>-worker-0 and the
headless Service <name> in place of the JobSet; pod names are the same in both forms
(<name>-ps-0-<i>.<name>, <name>-worker-0-<i>.<name>). Failure handling: deploy/k8s/README.md.
"""

import argparse
import base64
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time

import yaml

UID = 65532
SERVER_PORT, DATA_PORT, RING_PORT, RING_DATA_PORT, HEALTH_PORT = 5000, 5001, 6000, 6001, 8081
ROLLBACK_EXIT = 75   # server_main.cc kExitRollback: restart me, I rolled back to a checkpoint.
USAGE_EXIT = 2       # Bad flags or spec: a restart cannot help.
MODES = ("bsp", "ssp", "async", "backup", "adaptive", "allreduce")
MOUNT = "/opt/rubato"

# key: (default, meaning). Types follow the defaults (an int field takes an int, and so on).
FIELDS = {
    "name": ("rubato", "the job's name: a DNS label; every object's name starts with it"),
    "shards": (2, "parameter-server shards (0 with mode allreduce)"),
    "workers": (3, "workers (ranks with allreduce)"),
    "mode": ("bsp", "consistency: " + " | ".join(MODES)),
    "staleness": (2, "ssp: the bound s"),
    "backup_workers": (1, "backup: b, gradients not waited for each step"),
    "adaptive_every_steps": (20, "adaptive: K, the steps between the servers' choices of bsp or "
                                 "backup:b"),
    "allreduce_quorum": ("all", "allreduce: all (the synchronous ring), majority or solo (a round "
                                "goes on once half the ranks, or one, have a gradient ready)"),
    "model": ("mlp:784-256-10", "rubato_worker --model"),
    "optimizer": ({"type": "sgd", "learning_rate": 0.1},
                  "rubato.OptimizerConfig's fields (proto/cluster.proto)"),
    "lr_schedule": ({}, "rubato.LearningRateSchedule's fields"),
    "epochs": (1, "passes over the training set"),
    "batch_size": (64, "examples per worker per step"),
    "max_message_bytes": (4194304, "the cluster spec's bound on one message: raise it for large "
                                   "models (the model's bytes with headroom)"),
    "worker_args": ([], "more rubato_worker flags, e.g. [--slow_workers=1:4]"),
    "server_args": ([], "more rubato_server flags"),
    "image": ("rubato:cpu", "the image of every pod (./rubato image); gpu: true uses gpu_image "
                            "for workers"),
    "gpu": (False, "one nvidia.com/gpu per worker, --backend=cuda, gpu_image"),
    "gpu_image": ("rubato:gpu", "the workers' image with gpu: true"),
    "storage_class": ("", "the volume's StorageClass (empty: the cluster's default)"),
    "storage_access_mode": ("ReadWriteMany", "ReadWriteMany (pods on several nodes) or "
                                             "ReadWriteOnce (one node)"),
    "storage_size": ("1Gi", "the volume for checkpoints and outputs"),
    "checkpoint_every_steps": (100, "rubato_server --checkpoint_every_steps"),
    "queue": ("", "Kueue LocalQueue (label kueue.x-k8s.io/queue-name); admits the JobSet whole"),
    "deadline_seconds": (3600, "the job is stopped after this long"),
    "ttl_seconds": (86400, "finished objects and their pods are deleted this long after"),
    "restarts_per_index": (3, "failed pods of one shard or worker, not counting roll-backs and "
                              "disruptions, before its Job fails"),
    "max_restarts": (3, "jobset: whole-job restarts from the checkpoints after a Job failed"),
    "server_restart_timeout_s": (600, "how long workers wait for a lost shard to be replaced "
                                      "(crash-loop back-off runs to 300 s; node loss longer)"),
    "health_from": ("0.0.0.0/0", "CIDR admitted to the health port 8081 (the kubelets' probes "
                                 "come from the nodes)"),
    "tls": (False, "mutual TLS on every connection: servers and workers each get their own key "
                   "pair, signed by a throwaway CA (needs openssl)"),
}
OPTIMIZER_FIELDS = {"type", "learning_rate", "weight_decay", "momentum", "nesterov", "beta1",
                    "beta2", "epsilon", "trust_coefficient", "exclude_from_weight_decay",
                    "exclude_from_layer_adaptation", "clip_global_norm"}
LR_SCHEDULE_FIELDS = {"reference_batch", "scaling", "warmup_steps", "warmup_epochs", "decay",
                      "decay_steps", "decay_factor", "power", "final_lr_fraction"}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
# The binaries' flags, from the generated reference (docs/gen_flags.py): worker_args and
# server_args are checked against it, so that a misspelt flag is refused here, not by every pod
# (which would exit 2 and fail the job).
FLAGS_MD = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.realpath(__file__)))), "docs", "flags.md")
# Flags make_job gives the pods itself.
OWN_FLAGS = {"shard_id", "listen", "data_port", "cluster_spec", "auth_secret_file", "job_id",
             "health_listen", "checkpoint_dir", "stats_file", "worker_id", "records_file",
             "export_model", "summary_file", "tls_cert", "tls_key", "tls_ca", "ring_data_port"}


class JobError(Exception):
    """A job file or setting that cannot make a valid job; the message names it."""


def load(path, settings=()):
    """The job's fields: FIELDS' defaults, then the file's, then `settings` ("key=value", the value
    read as YAML). Raises JobError naming a bad key, type or value."""
    job = {k: v[0] for k, v in FIELDS.items()}
    if path:
        try:
            with open(path) as f:
                given = yaml.safe_load(f)
        except OSError as e:
            raise JobError("cannot read the job file %s: %s" % (path, e.strerror))
        except yaml.YAMLError as e:
            raise JobError("%s is not YAML: %s" % (path, e))
        if given is None:
            given = {}
        if not isinstance(given, dict):
            raise JobError("%s: a job file is a mapping of FIELDS, got %s"
                           % (path, type(given).__name__))
        job.update(_checked(given, path))
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq:
            raise JobError("--set %s: expected KEY=VALUE" % setting)
        job.update(_checked({key: yaml.safe_load(value) if value else ""}, "--set"))
    validate(job)
    return job


def _checked(given, where):
    out = {}
    for key, value in given.items():
        if key not in FIELDS:
            raise JobError("%s: unknown field %r (known: %s)" % (where, key, ", ".join(FIELDS)))
        default = FIELDS[key][0]
        want = type(default)
        ok = isinstance(value, want) and not (want is int and isinstance(value, bool))
        if want is float and isinstance(value, int):
            ok = True
        if not ok:
            raise JobError("%s: %s must be %s, got %r" % (where, key, want.__name__, value))
        out[key] = value
    return out


def validate(job):
    name = job["name"]
    if not DNS_LABEL.match(name):
        raise JobError("name %r is not a DNS label (lower-case letters, digits and '-', starting "
                       "with a letter)" % name)
    if job["mode"] not in MODES:
        raise JobError("mode %r is not one of %s" % (job["mode"], ", ".join(MODES)))
    allreduce = job["mode"] == "allreduce"
    if job["workers"] < 1:
        raise JobError("workers must be >= 1, got %d" % job["workers"])
    if allreduce and job["shards"] != 0:
        raise JobError("mode allreduce has no parameter servers: set shards: 0 (got %d)"
                       % job["shards"])
    if not allreduce and job["shards"] < 1:
        raise JobError("shards must be >= 1 with mode %s, got %d" % (job["mode"], job["shards"]))
    # The longest host name, <name>-worker-0-<last index>, must be a DNS label (63 characters).
    longest = max(len(pod_host(job, "worker", job["workers"] - 1)),
                  0 if allreduce else len(pod_host(job, "ps", job["shards"] - 1)))
    if longest > 63:
        raise JobError("name %r is too long for %d pods: host names such as %s must be at most "
                       "63 characters" % (name, job["workers"], pod_host(job, "worker",
                                                                         job["workers"] - 1)))
    if job["mode"] == "backup" and not 0 < job["backup_workers"] < job["workers"]:
        raise JobError("backup_workers must be in [1, workers), got %d" % job["backup_workers"])
    if job["allreduce_quorum"] not in ("all", "majority", "solo"):
        raise JobError("allreduce_quorum must be all, majority or solo, not %r"
                       % job["allreduce_quorum"])
    if job["allreduce_quorum"] != "all" and not allreduce:
        raise JobError("allreduce_quorum %s applies to mode allreduce, not %s"
                       % (job["allreduce_quorum"], job["mode"]))
    if job["mode"] == "adaptive" and job["adaptive_every_steps"] < 1:
        raise JobError("adaptive_every_steps must be >= 1, got %d" % job["adaptive_every_steps"])
    if job["mode"] == "ssp" and job["staleness"] < 0:
        raise JobError("staleness must be >= 0, got %d" % job["staleness"])
    for key in ("epochs", "batch_size", "max_message_bytes", "checkpoint_every_steps",
                "deadline_seconds", "ttl_seconds", "server_restart_timeout_s"):
        if job[key] < 1:
            raise JobError("%s must be >= 1, got %d" % (key, job[key]))
    for key in ("restarts_per_index", "max_restarts"):
        if job[key] < 0:
            raise JobError("%s must be >= 0, got %d" % (key, job[key]))
    for key, known in (("optimizer", OPTIMIZER_FIELDS), ("lr_schedule", LR_SCHEDULE_FIELDS)):
        unknown = sorted(set(job[key]) - known)
        if unknown:
            raise JobError("%s: unknown field(s) %s (proto/cluster.proto)" % (key, unknown))
    if "type" not in job["optimizer"] or "learning_rate" not in job["optimizer"]:
        raise JobError("optimizer needs type and learning_rate")
    if job["storage_access_mode"] not in ("ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"):
        raise JobError("storage_access_mode %r is not ReadWriteMany, ReadWriteOnce or "
                       "ReadWriteOncePod" % job["storage_access_mode"])
    if not re.match(r"^\d+(\.\d+)?(Ki|Mi|Gi|Ti)?$", job["storage_size"]):
        raise JobError("storage_size %r is not a quantity such as 1Gi" % job["storage_size"])
    if not re.match(r"^\d{1,3}(\.\d{1,3}){3}/\d{1,2}$", job["health_from"]):
        raise JobError("health_from %r is not an IPv4 CIDR such as 10.0.0.0/8"
                       % job["health_from"])
    known = binary_flags()
    check_args("worker_args", job["worker_args"], "rubato_worker", known)
    check_args("server_args", job["server_args"], "rubato_server", known)


def binary_flags(path=FLAGS_MD):
    """{"rubato_server": names, "rubato_worker": names} from docs/flags.md; None without it (a copy
    of make_job.py outside the repository: the flags are then not checked)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    flags = {"rubato_server": set(), "rubato_worker": set()}
    section = None
    for line in text.splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            section = list(flags) if title == "Both binaries" else \
                [title] if title in flags else []
        m = re.match(r"^\| `--([A-Za-z0-9_]+)` \|", line)
        if m and section:
            for binary in section:
                flags[binary].add(m.group(1))
    return flags


def check_args(key, args, binary, known):
    for arg in args:
        if not isinstance(arg, str) or not arg.startswith("--"):
            raise JobError("%s: %r is not a --flag" % (key, arg))
        name = arg[2:].partition("=")[0]
        if name in OWN_FLAGS:
            raise JobError("%s: --%s is set by make_job.py (see the job file's fields)"
                           % (key, name))
        # Abseil's --noFLAG form of a boolean flag.
        if known is not None and name not in known[binary] and not (
                name.startswith("no") and name[2:] in known[binary]):
            raise JobError("%s: --%s is not a flag of %s (docs/flags.md)" % (key, name, binary))


# --- names ---------------------------------------------------------------------------------------

def pod_host(job, role, index):
    """The host name JobSet gives pod `index` of replicated job `role` (job index 0); the plain
    Jobs are named so that theirs are the same."""
    return "%s-%s-0-%d" % (job["name"], role, index)


def pod_address(job, role, index, port):
    return "%s.%s:%d" % (pod_host(job, role, index), job["name"], port)


def labels(job, component=None):
    out = {"app.kubernetes.io/name": "rubato", "app.kubernetes.io/instance": job["name"],
           "app.kubernetes.io/managed-by": "rubato-make-job"}
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def meta(job, name, component=None):
    return {"name": name, "labels": labels(job, component)}


# --- the cluster spec -------------------------------------------------------------------------------

def _pbtxt_value(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"%s"' % str(value).replace("\\", "\\\\").replace('"', '\\"')


def _pbtxt_message(fields):
    parts = []
    for key, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            parts.append("%s: %s" % (key, _pbtxt_value(v)))
    return " ".join(parts)


def cluster_spec(job):
    """rubato.ClusterSpec in text format (proto/cluster.proto) for the job."""
    lines = ["# rubato.ClusterSpec (proto/cluster.proto) of job %s, made by deploy/k8s/make_job.py"
             % job["name"]]
    if job["mode"] == "allreduce":
        lines += ['workers: "%s"' % pod_address(job, "worker", i, RING_PORT)
                  for i in range(job["workers"])]
    else:
        lines += ['servers: "%s"' % pod_address(job, "ps", i, SERVER_PORT)
                  for i in range(job["shards"])]
    lines.append("num_workers: %d" % job["workers"])
    consistency = "mode: %s" % job["mode"].upper()
    if job["mode"] == "ssp":
        consistency += " staleness: %d" % job["staleness"]
    if job["mode"] == "backup":
        consistency += " backup_workers: %d" % job["backup_workers"]
    if job["mode"] == "adaptive":
        consistency += " adaptive_every_steps: %d" % job["adaptive_every_steps"]
    if job["allreduce_quorum"] != "all":
        consistency += " allreduce_quorum: QUORUM_%s" % job["allreduce_quorum"].upper()
    lines.append("consistency { %s }" % consistency)
    lines.append("optimizer { %s }" % _pbtxt_message(job["optimizer"]))
    if job["lr_schedule"]:
        lines.append("lr_schedule { %s }" % _pbtxt_message(job["lr_schedule"]))
    lines.append("max_message_bytes: %d" % job["max_message_bytes"])
    return "\n".join(lines) + "\n"


# --- pods ----------------------------------------------------------------------------------------

def _security_context():
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]}}


def _pod_security_context():
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _common_args(job, role, run):
    args = ["--cluster_spec=%s/config/cluster.pbtxt" % MOUNT,
            "--auth_secret_file=%s/secret/job.secret" % MOUNT,
            "--job_id=" + run,  # In every token: no other run's token is accepted.
            "--health_listen=0.0.0.0:%d" % HEALTH_PORT]
    if job["tls"]:
        args += ["--tls_cert=%s/secret/%s.crt" % (MOUNT, role),
                 "--tls_key=%s/secret/%s.key" % (MOUNT, role),
                 "--tls_ca=%s/secret/ca.crt" % MOUNT]
    return args


def _volumes(job, role):
    """(volumes, mounts) of a pod: the cluster spec, its role's secrets, the job's volume, /tmp."""
    items = [{"key": "job.secret", "path": "job.secret"}]
    if job["tls"]:
        items += [{"key": "ca.crt", "path": "ca.crt"},
                  {"key": role + ".crt", "path": role + ".crt"},
                  {"key": role + ".key", "path": role + ".key"}]
    volumes = [
        {"name": "cluster", "configMap": {"name": job["name"] + "-cluster"}},
        # Only this role's key: a worker never holds the servers' key, nor a server the workers'.
        {"name": "secret", "secret": {"secretName": job["name"] + "-auth", "defaultMode": 0o440,
                                      "items": items}},
        {"name": "data", "persistentVolumeClaim": {"claimName": job["name"] + "-data"}},
        # readOnlyRootFilesystem: /tmp is the one writable scratch place (the CUDA JIT cache too).
        {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    mounts = [{"name": "cluster", "mountPath": MOUNT + "/config", "readOnly": True},
              {"name": "secret", "mountPath": MOUNT + "/secret", "readOnly": True},
              {"name": "data", "mountPath": MOUNT + "/data"},
              {"name": "tmp", "mountPath": "/tmp"}]
    return volumes, mounts


def _container(job, role, image, args, ports, resources):
    volumes, mounts = _volumes(job, role)
    container = {
        "name": role,
        "image": image,
        "command": ["/opt/rubato/bin/rubato_%s" % ("server" if role == "server" else "worker")],
        "args": args,
        "ports": ports + [{"name": "health", "containerPort": HEALTH_PORT}],
        # Ready once it serves (the health service is SERVING from start-up). No liveness probe:
        # SERVING says nothing of a stuck training loop, and a kill is a restart (the wait
        # deadlines of pulls, pushes and ring steps are what end a stuck job, naming who hangs).
        "readinessProbe": {"grpc": {"port": HEALTH_PORT}, "periodSeconds": 5},
        "resources": resources,
        "securityContext": _security_context(),
        "volumeMounts": mounts,
    }
    return container, volumes


def _pod_template(job, component, container, volumes, grace, extra=None):
    spec = {
        "restartPolicy": "Never",  # A failed pod is replaced (podFailurePolicy decides what counts).
        "terminationGracePeriodSeconds": grace,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": _pod_security_context(),
        "containers": [container],
        "volumes": volumes,
    }
    spec.update(extra or {})
    return {"metadata": {"labels": labels(job, component)}, "spec": spec}


def server_template(job, run):
    args = ["--shard_id=$(JOB_COMPLETION_INDEX)",
            "--listen=0.0.0.0:%d" % SERVER_PORT,
            "--data_port=%d" % DATA_PORT] + _common_args(job, "server", run) + [
        "--checkpoint_dir=%s/data/%s/checkpoints" % (MOUNT, run),
        "--checkpoint_every_steps=%d" % job["checkpoint_every_steps"],
        "--stats_file=%s/data/%s/outputs/server-$(JOB_COMPLETION_INDEX).json" % (MOUNT, run),
    ] + job["server_args"]
    ports = [{"name": "grpc", "containerPort": SERVER_PORT},
             {"name": "data", "containerPort": DATA_PORT}]
    # Guaranteed QoS (requests = limits): a throttled shard would slow every bsp step.
    resources = {"requests": {"cpu": "1", "memory": "512Mi"},
                 "limits": {"cpu": "1", "memory": "512Mi"}}
    container, volumes = _container(job, "server", job["image"], args, ports, resources)
    # A server's shutdown waits up to 30 s for its last checkpoint and 5 s to drain: 60 s grace.
    return _pod_template(job, "parameter-server", container, volumes, grace=60)


def worker_template(job, run):
    allreduce = job["mode"] == "allreduce"
    args = ["--worker_id=$(JOB_COMPLETION_INDEX)"] + _common_args(job, "worker", run) + [
        "--epochs=%d" % job["epochs"],
        "--batch_size=%d" % job["batch_size"],
        "--model=%s" % job["model"],
        # Pods start in any order and a lost one is replaced after a back-off of up to 300 s.
        "--connect_timeout_ms=%d" % (job["server_restart_timeout_s"] * 1000),
        "--records_file=%s/data/%s/outputs/worker-$(JOB_COMPLETION_INDEX).jsonl" % (MOUNT, run),
        # Worker 0 writes these two: the trained model, and the job's summary (start and done).
        "--export_model=%s/data/%s/outputs/model.rubato" % (MOUNT, run),
        "--summary_file=%s/data/%s/outputs/summary.json" % (MOUNT, run),
    ]
    if not allreduce:
        args.append("--server_restart_timeout_s=%d" % job["server_restart_timeout_s"])
    ports = []
    if allreduce:
        args += ["--listen=0.0.0.0:%d" % RING_PORT, "--ring_data_port=%d" % RING_DATA_PORT]
        ports = [{"name": "ring", "containerPort": RING_PORT},
                 {"name": "ring-data", "containerPort": RING_DATA_PORT}]
    image = job["image"]
    # Guaranteed QoS: CPU limits above the request throttle a worker into an artificial straggler.
    # A worker holds Fashion-MNIST as floats (about 250 MB); a GPU worker also its CUDA context.
    memory = "4Gi" if job["gpu"] else "1Gi"
    resources = {"requests": {"cpu": "2", "memory": memory},
                 "limits": {"cpu": "2", "memory": memory}}
    extra = {}
    if job["gpu"]:
        args.append("--backend=cuda")
        image = job["gpu_image"]
        resources["limits"]["nvidia.com/gpu"] = 1
        resources["requests"]["nvidia.com/gpu"] = 1
        extra["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists",
                                 "effect": "NoSchedule"}]
    args += job["worker_args"]
    container, volumes = _container(job, "worker", image, args, ports, resources)
    return _pod_template(job, "worker", container, volumes, grace=30, extra=extra)


def failure_rules(container):
    """What a failed pod means. Any other exit (1: a runtime error; 143: SIGTERM before the job
    was over, a liveness kill or `kubectl delete pod`; 137: OOM or SIGKILL) counts against its
    index's backoffLimitPerIndex, and the pod is replaced."""
    rules = [
        # Eviction, preemption, node drain or loss: not the job's fault, not counted.
        {"action": "Ignore",
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        # Bad flags or cluster spec: no restart can help.
        {"action": "FailJob", "onExitCodes": {"containerName": container, "operator": "In",
                                              "values": [USAGE_EXIT]}},
    ]
    if container == "server":
        # A bsp shard that rolled back to another's checkpoint asks to be started again.
        rules.insert(1, {"action": "Ignore", "onExitCodes": {
            "containerName": container, "operator": "In", "values": [ROLLBACK_EXIT]}})
    return rules


def job_spec(job, count, template, container):
    """An Indexed Job's spec: every pod at once, each index retried on its own."""
    return {
        "completionMode": "Indexed",
        "completions": count,
        "parallelism": count,
        # Each index may fail this often (roll-backs and disruptions excepted, below); one that
        # fails more fails the Job at once (maxFailedIndexes 0): a job without one shard or
        # worker cannot finish.
        "backoffLimitPerIndex": job["restarts_per_index"],
        "maxFailedIndexes": 0,
        # The replacement starts once the failed pod is gone: the host name is free again.
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {"rules": failure_rules(container)},
        "activeDeadlineSeconds": job["deadline_seconds"],
        "template": template,
    }


# --- objects ---------------------------------------------------------------------------------------

def data_claim(job):
    spec = {"accessModes": [job["storage_access_mode"]],
            "resources": {"requests": {"storage": job["storage_size"]}}}
    if job["storage_class"]:
        spec["storageClassName"] = job["storage_class"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": meta(job, job["name"] + "-data"), "spec": spec}


def network_policy(job):
    """Only the job's own pods reach its ports; the health port admits the probes' addresses.
    Egress: the job's pods and DNS."""
    own = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": job["name"]}}}
    if job["mode"] == "allreduce":
        ports = [RING_PORT, RING_DATA_PORT]
    else:
        ports = [SERVER_PORT, DATA_PORT]
    tcp = [{"protocol": "TCP", "port": p} for p in ports]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": meta(job, job["name"]),
        "spec": {
            "podSelector": own["podSelector"],
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [
                {"from": [own], "ports": tcp},
                {"from": [{"ipBlock": {"cidr": job["health_from"]}}],
                 "ports": [{"protocol": "TCP", "port": HEALTH_PORT}]},
            ],
            "egress": [
                {"to": [own], "ports": tcp},
                {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
            ],
        },
    }


def secret(job, key, tls_files):
    data = {"job.secret": key}
    data.update(tls_files)
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": meta(job, job["name"] + "-auth"),
            "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())}}


def config_map(job):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(job, job["name"] + "-cluster"),
            "data": {"cluster.pbtxt": cluster_spec(job)}}


def replicated(job, run):
    """[(role, count, template, container name)] of the job's Indexed Jobs, servers first."""
    out = []
    if job["mode"] != "allreduce":
        out.append(("ps", job["shards"], server_template(job, run), "server"))
    out.append(("worker", job["workers"], worker_template(job, run), "worker"))
    return out


def jobset(job, run):
    rjobs = []
    parts = replicated(job, run)
    for i, (role, count, template, container) in enumerate(parts):
        rjob = {"name": role, "replicas": 1,
                "template": {"metadata": {"labels": labels(job, template["metadata"]["labels"][
                    "app.kubernetes.io/component"])},
                             "spec": job_spec(job, count, template, container)}}
        if i > 0:
            rjob["dependsOn"] = [{"name": parts[0][0], "status": "Ready"}]  # servers serve first
        rjobs.append(rjob)
    metadata = meta(job, job["name"])
    if job["queue"]:
        metadata["labels"]["kueue.x-k8s.io/queue-name"] = job["queue"]
    ends = "ps" if job["mode"] != "allreduce" else "worker"
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            # Pod i of replicated job R is <name>-R-0-<i>.<name>: JobSet's headless Service.
            "network": {"enableDNSHostnames": True, "subdomain": job["name"],
                        "publishNotReadyAddresses": True},
            # Servers end by themselves once every worker has finished (or ranks, allreduce).
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [ends]},
            # A Job that failed (an index out of retries) restarts the whole job, which resumes
            # from the shards' checkpoints in <run>/checkpoints; bad flags fail it for good.
            "failurePolicy": {
                "maxRestarts": job["max_restarts"],
                "restartStrategy": "BlockingRecreate",
                "rules": [{"name": "usage-error", "action": "FailJobSet",
                           "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "ttlSecondsAfterFinished": job["ttl_seconds"],
            "replicatedJobs": rjobs,
        },
    }


def plain_jobs(job, run):
    out = [{"apiVersion": "v1", "kind": "Service", "metadata": meta(job, job["name"]),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {"app.kubernetes.io/instance": job["name"]}}}]
    for role, count, template, container in replicated(job, run):
        template["spec"]["subdomain"] = job["name"]
        spec = job_spec(job, count, template, container)
        spec["ttlSecondsAfterFinished"] = job["ttl_seconds"]
        component = template["metadata"]["labels"]["app.kubernetes.io/component"]
        obj = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": meta(job, "%s-%s-0" % (job["name"], role), component), "spec": spec}
        if job["queue"]:
            obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = job["queue"]
        out.append(obj)
    return out


def tls_files(job):
    """{ca.crt, server.crt, server.key, worker.crt, worker.key}: a CA made for this run (its key
    is thrown away), and one key pair per role naming every pod of the role."""
    def names(role, count):
        out = []
        for i in range(count):
            host = "%s.%s" % (pod_host(job, role, i), job["name"])
            out += [host, host + ".svc.cluster.local"]
        return out
    roles = {"worker": names("worker", job["workers"])}
    if job["mode"] != "allreduce":
        roles["server"] = names("ps", job["shards"])
    out = {}
    with tempfile.TemporaryDirectory(prefix="rubato-tls-") as d:
        def openssl(*args):
            done = subprocess.run(["openssl"] + list(args), cwd=d, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                raise JobError("openssl %s failed: %s" % (args[0], done.stdout.strip()))
        try:
            openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                    "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
                    "-subj", "/CN=rubato job %s CA" % job["name"])
        except FileNotFoundError:
            raise JobError("tls: true needs openssl on PATH")
        for role, sans in sorted(roles.items()):
            with open(os.path.join(d, role + ".ext"), "w") as f:
                f.write("subjectAltName=" + ",".join("DNS:" + n for n in sans) + "\n"
                        "extendedKeyUsage=serverAuth,clientAuth\n")
            openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", role + ".key", "-out", role + ".csr",
                    "-subj", "/CN=rubato %s %s" % (job["name"], role))
            openssl("x509", "-req", "-in", role + ".csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                    "-CAcreateserial", "-days", "30", "-extfile", role + ".ext",
                    "-out", role + ".crt")
        for name in ["ca.crt"] + sorted(r + s for r in roles for s in (".crt", ".key")):
            with open(os.path.join(d, name), "rb") as f:
                out[name] = f.read()
    return out


def new_job_id(name):
    return "%s-%s-%s" % (name, time.strftime("%Y%m%dt%H%M%S", time.gmtime()).lower(),
                         secrets.token_hex(8))


def render(job, form="jobset", job_id=None, secret_key=None, external_secret=False,
           resume=None):
    """The job's objects (a list of dicts) in `form` (jobset | jobs). A fresh job id and secret
    unless given; `resume` names an earlier run whose directory and job id to use."""
    if form not in ("jobset", "jobs"):
        raise JobError("--form %r is not jobset or jobs" % form)
    if resume is not None:
        job_id = resume
    job_id = job_id or new_job_id(job["name"])
    # A job id (common/auth.h) and the run's directory name on the claim.
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", job_id):
        raise JobError("%s %r is not a job id: 1 to 128 letters, digits, '.', '_' or '-', not "
                       "starting with '.', '_' or '-'" % ("--resume" if resume else "--job_id",
                                                            job_id))
    run = job_id
    objects = [config_map(job)]
    if not external_secret:
        key = secret_key or secrets.token_hex(32).encode()
        objects.append(secret(job, key, tls_files(job) if job["tls"] else {}))
    objects += [data_claim(job), network_policy(job)]
    objects += [jobset(job, run)] if form == "jobset" else plain_jobs(job, run)
    return objects


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people: no anchors or aliases, multi-line strings as literal blocks."""

    def ignore_aliases(self, data):
        return True


def _str(dumper, value):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump(objects):
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         width=100)


def main(argv):
    parser = argparse.ArgumentParser(
        description="Every Kubernetes object of one Rubato job, from one job file (see the "
                    "module's docstring and deploy/k8s/README.md).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="fields of the job file (default: meaning):\n" + "\n".join(
            "  %-26s %s" % (k, "%s: %s" % (yaml.safe_dump(v[0], default_flow_style=True,
                                                           width=1000).strip().replace(
                                                               "\n...", ""), v[1]))
            for k, v in FIELDS.items()))
    parser.add_argument("job_file", nargs="?", help="the job file (YAML); none: the defaults")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field (the value is read as YAML)")
    parser.add_argument("--form", default="jobset", help="jobset (default) or jobs")
    parser.add_argument("--job_id", help="this run's job id (default: a new one)")
    parser.add_argument("--resume", metavar="RUN",
                        help="resume run RUN (its job id): its checkpoints and job id")
    parser.add_argument("--secret", default="generate", choices=["generate", "external"],
                        help="generate: a new Secret NAME-auth in the output; external: made "
                             "outside (GitOps), not in the output")
    parser.add_argument("--cluster_spec", action="store_true",
                        help="print only the cluster spec (text format)")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        job = load(args.job_file, args.set)
        if args.cluster_spec:
            text = cluster_spec(job)
        else:
            if args.secret == "external" and job["tls"]:
                raise JobError("tls: true puts the key pairs in the generated Secret; with "
                               "--secret external make them outside too")
            text = dump(render(job, args.form, args.job_id, external_secret=(
                args.secret == "external"), resume=args.resume))
    except JobError as e:
        print("make_job.py: %s" % e, file=sys.stderr)
        return 2
    if args.output:
        fd = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # A secret.
        with os.fdopen(fd, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
