"""What the launcher knows of the two programs it runs, rubato_server and rubato_worker: their
names, the exit statuses that mean something, the defaults it needs, and how to say how a process
ended."""

import signal

SERVER_PROGRAM = "rubato_server"
WORKER_PROGRAM = "rubato_worker"

# rubato_worker's exit status after --crash_at_step: an injected failure, not a failed job.
INJECTED_CRASH = 3
# rubato_server's exit status when it stops to roll back (bsp, backup; see ARCHITECTURE.md), and
# how many such restarts of one shard the launcher makes.
ROLLBACK_EXIT = 75
MAX_ROLLBACKS = 8

# The binaries' defaults that the launcher itself needs to know.
DEFAULT_LAYERS = "784-256-10"
DEFAULT_LEASE_MS = "10000"
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DATA_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
              "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")
# Parameters of --model=cnn (worker/model/model_spec.h, CnnModelSpec).
CNN_PARAMETERS = 454922


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "an unknown signal"


def exit_description(rc):
    """How a process ended, from Popen's returncode: "exited with status 1", "killed by SIGKILL
    (signal 9)"."""
    if rc >= 0:
        return "exited with status %d" % rc
    return "killed by %s (signal %d)" % (signal_name(-rc), -rc)
