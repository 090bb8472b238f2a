"""Starts one container of a replayed Kubernetes pod (tests/k8s_replay_test.py), as root in fresh
mount and UTS namespaces (and the pod's network namespace), without touching the machine's files:

    ip netns exec NS unshare --mount --uts --propagation private -- python3 k8s_pod_launcher.py SPEC

SPEC (JSON) says: "files", each {"path", "mode", "uid", "gid"} and either "source" (a file to copy:
the image's binaries) or "content_b64" (a ConfigMap's or Secret's key); "dirs", each {"path",
"source", "read_only"}: a directory of this machine bind-mounted there (a writable volume: a
claim, an emptyDir); "hostname"; "uid", "gid",
"groups"; "env" (the container's whole environment); "argv" (its command and arguments, expanded).
Every file must be under /opt, which gets a tmpfs of its own (the image's /opt/rubato/bin and the
volumes mounted under it), remounted read-only once written, as the image and those volumes are;
a directory under /opt or at /tmp. /tmp gets an empty read-only tmpfs (readOnlyRootFilesystem)
unless a volume is mounted there (an emptyDir). Then it becomes uid:gid with exactly
the supplementary groups given, no capabilities and no_new_privs (runAsUser, runAsGroup, fsGroup,
drop ALL, allowPrivilegeEscalation false) and execs argv with exactly env.
"""

import base64
import json
import os
import socket
import subprocess
import sys

ROOT = "/opt"


def mount(*args):
    subprocess.run(["mount"] + list(args), check=True)


def main(spec_path):
    with open(spec_path) as f:
        spec = json.load(f)
    # Mounts made here stay in this mount namespace (unshare --propagation private).
    mount("-t", "tmpfs", "-o", "mode=0755,size=256m", "rubato-pod", ROOT)
    for item in spec["files"]:
        path = os.path.normpath(item["path"])
        if not path.startswith(ROOT + "/"):
            raise SystemExit("k8s_pod_launcher: %s is not under %s" % (path, ROOT))
        parent = os.path.dirname(path)
        os.makedirs(parent, mode=0o755, exist_ok=True)
        if "source" in item:
            with open(item["source"], "rb") as f:
                data = f.read()
        else:
            data = base64.b64decode(item["content_b64"])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chown(path, item["uid"], item["gid"])
        os.chmod(path, item["mode"])
    dirs = [dict(item, path=os.path.normpath(item["path"])) for item in spec.get("dirs", [])]
    for item in dirs:  # Writable volumes (a claim, an emptyDir): bind mounts.
        if item["path"] == "/tmp":
            continue
        if not item["path"].startswith(ROOT + "/"):
            raise SystemExit("k8s_pod_launcher: %s is not under %s or /tmp" % (item["path"], ROOT))
        os.makedirs(item["path"], mode=0o755, exist_ok=True)
    mount("-o", "remount,ro", ROOT)
    if not any(item["path"] == "/tmp" for item in dirs):
        mount("-t", "tmpfs", "-o", "ro,mode=0755,size=1m", "rubato-pod-tmp", "/tmp")
    for item in dirs:
        mount("--bind", item["source"], item["path"])
        if item.get("read_only"):
            mount("-o", "remount,bind,ro", item["path"])
    socket.sethostname(spec["hostname"])
    os.chdir("/")  # the image sets no WORKDIR

    setpriv = ["setpriv", "--reuid", str(spec["uid"]), "--regid", str(spec["gid"]),
               "--groups", ",".join(str(g) for g in spec["groups"]),
               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    # setpriv execs argv[0] (an absolute path, or found on the container's PATH) with env as is.
    os.execve("/usr/bin/setpriv", setpriv + spec["argv"], spec["env"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: k8s_pod_launcher.py SPEC.json")
    main(sys.argv[1])
