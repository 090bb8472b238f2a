"""The launcher's command line: its options and their help (the launcher's manual: `rubato launch
--help`), and their checks. The options forwarded to the binaries come from commands.py's tables."""

import argparse
import os
import re
import shlex

from . import commands, slurm
from .hosts import DEFAULT_BASE_PORT, HostfileError, Plan, parse_host_list, parse_hostfile
from .programs import CNN_PARAMETERS, DEFAULT_LAYERS
from .remote import DEFAULT_RSH

DESCRIPTION = """\
Run a Rubato job as local processes on 127.0.0.1, or across the hosts of a host file (--hostfile), \
and show its progress: one row per worker, redrawn in place on a terminal.

  rubato launch --bin_dir bazel-bin --servers 1 --workers 2 --epochs 3
  rubato launch --hostfile hosts --servers 2 --workers 8 --epochs 3

Local mode (no --hostfile): servers start first on free ports (each writes its bound address to a \
port file in the run directory); workers are then given the addresses. Every process gets the \
job's shared secret (--auth_secret_file) and a gRPC message limit derived from the model's size \
(--max_message_mb). Children are killed by the kernel if the launcher itself dies."""

HOSTS_HELP = """\
Start the processes on the hosts of a host file through a remote shell instead of on 127.0.0.1, \
in the manner of mpirun and horovodrun. Without --hostfile these flags are not allowed.

Servers are spread round-robin over --server_hosts, each taking --server_slots of its host's \
slots (1 by default); workers are placed on --worker_hosts by --map_by in the slots left; a host \
takes at most its `slots` processes unless --oversubscribe. Each process gets its local rank, \
its place among the job's processes on its host (workers first, by id): LOCAL_RANK and \
LOCAL_WORLD_SIZE in its environment, and a worker --local_rank, which picks its GPU. \
Every process listens on a fixed port (see --base_port) and is advertised as HOST:PORT with HOST \
spelled as in the host file, so the whole --servers or --peers list is known before anything \
starts (every host must resolve every other host's name).

Processes start as `RSH HOST sh -c SCRIPT`: SCRIPT is quoted once more for a remote shell that \
joins its arguments into a command line for a login shell (ssh), not for one that passes them on \
as argv (ip netns exec); which one it is is found out first (`RSH HOST echo "'probe'"`). SCRIPT \
runs the binary with its output on the rsh's and stops it (SIGTERM, SIGKILL 5 s later) when its \
stdin, a pipe the launcher holds open, ends: the launcher closing it, or dying, tears the remote \
process down. The job's secret travels on that stdin, never on a command line, into a mode-0600 \
file in a `mktemp -d` directory removed at exit. The rsh exits with the binary's status (128 + N \
when signal N killed it).

Before anything starts, a preflight over --rsh checks on every host that it answers, that the \
binaries under --remote_bin_dir are executable, that the data set's four files are in --data_dir \
on worker hosts and that the other hosts' names resolve; it reports every host that lacks \
something, and what, then exits 2. Each process's stderr goes to <run_dir>/NAME.log and, each line \
prefixed `[NAME@HOST] `, to <run_dir>/job.log and above the live table. A server's final \
statistics come from the {"event":"stats",...} line it prints on stdout, so no shared file system \
is needed. TLS files (--tls_cert, --tls_key, --tls_ca) travel the same way as the secret: read \
here, sent on the remote shell's stdin, written to that directory. -x NAME[=VALUE] exports \
variables to every process. --restart_servers restarts a shard on its host through the remote \
shell, as locally; its --checkpoint_dir is on that host."""

EPILOG = """\
Failures: a worker that dies does not end the job. In the parameter-server modes the servers drop \
it once its lease (--lease_ms) runs out and the others finish; in the allreduce mode the other \
ranks end by themselves, naming the dead peer. A server that fails while workers still run ends \
the job at once. Servers end by themselves (status 0) once every worker has finished or been \
dropped; once the workers have ended they get the lease plus 5 s to do so before they are \
stopped, and the workers get as long once a server has ended that way. Only a process that ended \
by itself with a non-zero status (or a server that ended with none while the workers did not) \
counts as failed, with its own last error line as the reason. Whatever still runs at the end, on \
a failure that ends the job or on Ctrl-C, is stopped.

Exit status: 0 when every worker finished (an injected crash, --crash_workers or \
--crash_at_step, does not count); 1 when any worker failed (once the others have finished), when \
a server failed, when no worker finished, or when the job timed out; 2 for bad arguments, a bad \
host file, workers that do not fit their hosts' slots, or a failed preflight; 130 on Ctrl-C.

The run directory (default runs/<time>) holds each process's log, each worker's JSON-lines \
progress (worker-N.jsonl), job.secret, job.log (several hosts) and summary.json, which records \
every process's host and outcome."""

SLURM_HELP = """\
Inside a Slurm allocation (an sbatch script: deploy/slurm/rubato.sbatch), --slurm takes the hosts \
from SLURM_JOB_NODELIST and their slots from SLURM_TASKS_PER_NODE (ask for --ntasks = servers + \
workers), places the processes as across hosts (--server_slots, --server_hosts, --worker_hosts, \
--map_by, --base_port apply) and starts them with one srun step per role; each task takes its id \
from SLURM_PROCID and its local rank from SLURM_LOCALID. The run directory (default \
runs/slurm-<job id>, which every node must see) holds the job's secret and identity, made once \
per Slurm job, and its checkpoints (default --checkpoint_dir <run_dir>/checkpoints); a requeued \
job resumes from them. Each attempt's logs and summary.json are in <run_dir>/attempt-N. A \
shard's roll-back exit (75) is restarted by its task; SIGTERM (scancel, the time limit) stops \
the job; SIGUSR1 (sbatch --signal=B:USR1@SECONDS) stops it and requeues it. The job's time limit \
is its --timeout unless one is given."""

# Launcher flags that are also cluster flags but have a default of the launcher's own.
OWN_HELP = {
    "max_message_mb": "Largest gRPC message, in MiB, that every server and worker accepts "
                      "(passed as --max_message_mb). Default: from the model that --model (or "
                      "--layers) describes, max(4, ceil(1.25 * model bytes / MiB) + 1), model "
                      "bytes being 4 * sum(in * out + out) over consecutive layer sizes for "
                      "mlp:SIZES and 4 * 454922 for cnn.",
}


class _Paragraphs(argparse.HelpFormatter):
    """Fills each paragraph of a description or epilog on its own; indented lines stay as
    written (examples)."""

    def _fill_text(self, text, width, indent):
        out = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith("  "):
                out.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                out.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(out)


def make_parser():
    """The launcher's command line (also how experiment suites check their flags)."""
    p = argparse.ArgumentParser(prog="rubato launch", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=_Paragraphs)
    _add_job_options(p)
    _add_failure_options(p)
    p.add_argument("--target_accuracy", type=float, default=0.8,
                   help="The summary reports when a worker's test accuracy first reached this.")
    _add_auth_options(p)
    _add_tls_options(p)
    p.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="Export NAME to every server and worker (as mpirun -x): VALUE, or NAME's "
                        "value here when none is given. Repeatable.")
    _add_host_options(p.add_argument_group("several hosts", HOSTS_HELP))
    p.add_argument_group("Slurm", SLURM_HELP).add_argument(
        "--slurm", action="store_true",
        help="Run inside this Slurm allocation (sbatch, salloc): hosts and slots from it, one srun "
             "step for the servers and one for the workers (deploy/slurm/README.md).")
    for name in commands.CLUSTER_FLAGS + commands.WORKER_FLAGS + commands.SERVER_FLAGS:
        p.add_argument("--" + name, default=None, help=OWN_HELP.get(name) or
                       "Passed to rubato_%s as --%s." % (
                           "server and rubato_worker" if name in commands.CLUSTER_FLAGS else
                           "worker" if name in commands.WORKER_FLAGS else "server", name))
    return p


def _add_job_options(p):
    p.add_argument("--bin_dir", default="bazel-bin", help="Where server/ and worker/ binaries are.")
    p.add_argument("--servers", type=int, default=1, help="Parameter-server shards (default 1).")
    p.add_argument("--workers", type=int, default=2, help="Workers (default 2).")
    p.add_argument("--run_dir", default=None, help="Logs and metrics (default runs/<time>).")
    p.add_argument("--timeout", type=float, default=None,
                   help="Stop every process and fail after this many seconds (default 3600; "
                        "under --slurm 30 days: the job's time limit governs).")
    p.add_argument("--startup_timeout", type=float, default=30,
                   help="Seconds for a server to start serving (local mode; across hosts the "
                        "workers wait for the servers up to their --connect_timeout_ms).")
    p.add_argument("--refresh", type=float, default=0.5,
                   help="Live view refresh, seconds: the table is drawn, and the workers' newest "
                        "step records read, at most this often (elsewhere than on a terminal the "
                        "table is printed every 5 s).")


def _add_failure_options(p):
    p.add_argument("--slow_workers", default=None, metavar="ID:FACTOR,...",
                   help="Give these workers --slowdown=FACTOR (e.g. 1:4,3:2), instead of "
                        "--slowdown if that is given too.")
    p.add_argument("--restart_servers", type=int, default=0, metavar="N",
                   help="Restart a server shard that dies before the job ends, on its address and "
                        "from its --checkpoint_dir, at most N times each (local runs). The "
                        "workers retry it meanwhile and register again; under bsp and backup "
                        "they then roll the other shards back to its checkpoint's step, which "
                        "restarts them too (exit status 75; not counted in N).")
    p.add_argument("--resume", action="store_true",
                   help="Continue the job whose checkpoints are in --checkpoint_dir: the shards "
                        "restore their newest ones and the workers go on from that step. Without "
                        "it, a local --checkpoint_dir that holds checkpoints is refused, so that a "
                        "new job never silently resumes an old one.")
    p.add_argument("--crash_workers", default=None, metavar="ID:STEP,...",
                   help="Make these workers crash at that step (e.g. 2:50). A worker that exits "
                        "by an injected crash does not fail the job.")


def _add_auth_options(p):
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--auth_secret_file", default=None, metavar="PATH",
                      help="Give every server and worker this existing secret file (passed as "
                           "--auth_secret_file). Default: a fresh secret for each job, 32 random "
                           "bytes in hex, written to <run_dir>/job.secret with mode 0600; across "
                           "hosts each process gets a copy through its remote shell's stdin.")
    auth.add_argument("--insecure", action="store_true",
                      help="Pass --insecure to every server and worker and make no secret: any "
                           "local process could then call the servers and workers.")


def _add_tls_options(p):
    for name, what in (("tls_cert", "this process's certificate chain (PEM)"),
                       ("tls_key", "its private key (PEM)"),
                       ("tls_ca", "the CA that every peer's certificate must chain to (PEM)")):
        p.add_argument("--" + name, default=None, metavar="PATH",
                       help="Mutual TLS on every connection: %s, given to every server and worker "
                            "(--%s); across hosts its content is sent on the remote shell's "
                            "stdin. All three, or none." % (what, name))


def _add_host_options(hosts):
    hosts.add_argument("--hostfile", default=None, metavar="FILE",
                       help="One host per line, optionally `slots=N` (how many processes it "
                            "takes, default 1); `#` comments. Host names are also the processes' "
                            "advertised addresses and must resolve on every host.")
    hosts.add_argument("-H", "--host", default=None, metavar="H1:SLOTS,H2,...",
                       help="The hosts inline instead of a host file (as mpirun -H): "
                            "comma-separated, each with :SLOTS (default 1).")
    hosts.add_argument("--server_slots", type=int, default=None, metavar="N",
                       help="Slots that each server takes on its host (default 1; 0: servers "
                            "take none, and the workers may fill every slot).")
    hosts.add_argument("--server_hosts", default=None, metavar="H1,H2,...",
                       help="Hosts for the servers, spread round-robin (default: every host).")
    hosts.add_argument("--worker_hosts", default=None, metavar="H1,H2,...",
                       help="Hosts for the workers (default: every host).")
    hosts.add_argument("--map_by", default="slot", choices=("slot", "host"),
                       help="slot (default): fill each worker host's slots in turn; host: one "
                            "worker per host in turn.")
    hosts.add_argument("--oversubscribe", action="store_true",
                       help="Allow more workers than slots (the extra ones go round-robin).")
    hosts.add_argument("--rsh", default=None, metavar="COMMAND",
                       help="Remote shell, run as COMMAND HOST sh -c SCRIPT (default: %r; "
                            "e.g. 'ip netns exec')." % DEFAULT_RSH)
    hosts.add_argument("--remote_bin_dir", default=None, metavar="DIR",
                       help="Where server/ and worker/ binaries are on every host (default: "
                            "--bin_dir, made absolute).")
    hosts.add_argument("--base_port", type=int, default=None, metavar="PORT",
                       help="Server shard i listens on PORT + i (its Push and Pull data plane on "
                            "PORT + servers + i), allreduce rank r on PORT + r "
                            "and its data connection on PORT + workers + r (default %d)."
                            % DEFAULT_BASE_PORT)
    hosts.add_argument("--preflight_timeout", type=float, default=None, metavar="S",
                       help="Seconds for each host to answer a preflight check (default 30).")


def parse_args(argv):
    p = make_parser()
    args = p.parse_args(argv)
    _check_job(p, args)
    _check_checkpoints(p, args)
    args.plan = None
    _check_env(p, args)
    _check_tls(p, args)
    if args.slurm:
        slurm.configure(p, args)
    elif args.hostfile is not None and args.host is not None:
        p.error("--hostfile and -H: give the hosts one way")
    if args.slurm:
        pass
    elif args.hostfile is None and args.host is None:
        remote_only = [f for f in ("server_hosts", "worker_hosts", "rsh", "remote_bin_dir",
                                   "base_port", "preflight_timeout", "server_slots")
                       if getattr(args, f) is not None]
        remote_only += ["map_by"] if args.map_by != "slot" else []
        remote_only += ["oversubscribe"] if args.oversubscribe else []
        if remote_only:
            p.error("--%s: only with --hostfile or -H" % remote_only[0])
    else:
        args.plan = _plan(p, args)
    if args.auth_secret_file is not None and not os.path.isfile(args.auth_secret_file):
        p.error("--auth_secret_file: no such file: %s" % args.auth_secret_file)
    _check_message_limit(p, args)
    return args


def _check_job(p, args):
    if args.servers < 1 or args.workers < 1:
        p.error("--servers and --workers must be >= 1")
    if (args.mode or "").partition(":")[0] == "allreduce":
        args.servers = 0  # The workers form a ring; no parameter servers.
    if args.timeout is None:
        args.timeout = slurm.SLURM_TIMEOUT if args.slurm else 3600.0
    if args.timeout <= 0 or args.startup_timeout <= 0 or args.refresh <= 0:
        p.error("--timeout, --startup_timeout and --refresh must be > 0")
    try:
        args.slow_workers = parse_slow_workers(args.slow_workers, args.workers)
    except ValueError as e:
        p.error("--slow_workers: %s" % e)
    try:
        args.crash_workers = parse_crash_workers(args.crash_workers, args.workers)
    except ValueError as e:
        p.error("--crash_workers: %s" % e)


def _check_checkpoints(p, args):
    """--restart_servers and --resume against --checkpoint_dir."""
    if args.restart_servers < 0:
        p.error("--restart_servers must be >= 0")
    if args.restart_servers and args.checkpoint_dir is None and not args.slurm:
        p.error("--restart_servers needs --checkpoint_dir: a restarted shard without checkpoints "
                "would start empty")
    if args.resume and args.checkpoint_dir is None and not args.slurm:
        p.error("--resume needs --checkpoint_dir: the directory of the job to continue")
    if args.checkpoint_dir is not None and args.hostfile is None and args.host is None \
            and not args.slurm:  # Under Slurm: slurm.configure.
        # Local runs: the directory is here to look at (remote hosts have their own).
        found = checkpoint_files(args.checkpoint_dir)
        if found and not args.resume:
            p.error("--checkpoint_dir %s holds checkpoints of an earlier job (%s%s): pass "
                    "--resume to continue it, or give an empty directory"
                    % (args.checkpoint_dir, ", ".join(found[:3]),
                       ", ..." if len(found) > 3 else ""))
        if args.resume and not found:
            p.error("--resume: no checkpoints in --checkpoint_dir %s to resume from"
                    % args.checkpoint_dir)


def _check_env(p, args):
    """-x NAME[=VALUE] -> args.env_vars, {NAME: VALUE}."""
    args.env_vars = {}
    for item in args.env:
        name, eq, value = item.partition("=")
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            p.error("-x %s: %r is not a variable name" % (item, name))
        if not eq:
            if name not in os.environ:
                p.error("-x %s: %s is not set here; give -x %s=VALUE" % (name, name, name))
            value = os.environ[name]
        if name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            p.error("-x %s: the launcher sets it for each process" % name)
        args.env_vars[name] = value


def _check_tls(p, args):
    given = [n for n in ("tls_cert", "tls_key", "tls_ca") if getattr(args, n) is not None]
    if given and len(given) != 3:
        p.error("--%s: mutual TLS needs --tls_cert, --tls_key and --tls_ca together" % given[0])
    if given and args.insecure:
        p.error("--tls_cert: not with --insecure (TLS without the job's secret authenticates "
                "nothing but the certificates)")
    for name in given:
        path = getattr(args, name)
        if not os.path.isfile(path):
            p.error("--%s: no such file: %s" % (name, path))
        setattr(args, name, os.path.abspath(path))


def _plan(p, args):
    """Several hosts: the remote options' defaults and checks, the host file or -H, and the
    Plan."""
    args.rsh = args.rsh if args.rsh is not None else DEFAULT_RSH
    args.base_port = args.base_port if args.base_port is not None else DEFAULT_BASE_PORT
    if args.preflight_timeout is None:
        args.preflight_timeout = 30.0
    if not shlex.split(args.rsh):
        p.error("--rsh: empty command")
    if not 1 <= args.base_port <= 65535:
        p.error("--base_port: expected a port in [1, 65535], got %d" % args.base_port)
    if args.preflight_timeout <= 0:
        p.error("--preflight_timeout must be > 0")
    args.server_slots = 1 if args.server_slots is None else args.server_slots
    if args.server_slots < 0:
        p.error("--server_slots must be >= 0")
    try:
        if args.host is not None:
            hosts = parse_host_list(args.host)
        else:
            with open(args.hostfile) as f:
                hosts = parse_hostfile(f.read(), args.hostfile)
    except OSError as e:
        p.error("--hostfile: %s" % e)
    except HostfileError as e:
        p.error(str(e) if args.host is not None else "--hostfile: %s" % e)
    try:
        return Plan(args, hosts)
    except ValueError as e:
        p.error(str(e))


def _check_message_limit(p, args):
    if args.max_message_mb is None:
        try:
            args.max_message_mb = str(max_message_mb(model_flag_bytes(args.model, args.layers)))
        except ValueError as e:
            p.error("%s: %s" % ("--layers" if args.model is None else "--model", e))
    elif not args.max_message_mb.isdigit() or int(args.max_message_mb) < 1:
        p.error("--max_message_mb: expected a whole number of MiB >= 1, got %r"
                % args.max_message_mb)


def parse_crash_workers(text, workers):
    """"2:50" -> {2: 50}: worker id -> step of its injected crash."""
    crash = {}
    if text is None:
        return crash
    for item in text.split(","):
        worker, _, step = item.strip().partition(":")
        try:
            w, k = int(worker), int(step)
        except ValueError:
            raise ValueError("expected ID:STEP,... such as 2:50, got %r" % text)
        if not 0 <= w < workers or k < 0 or w in crash:
            raise ValueError("bad or repeated worker id or step in %r" % item)
        crash[w] = k
    return crash


def parse_slow_workers(text, workers):
    """"1:4,3:2" -> {1: "4", 3: "2"}: worker id -> --slowdown value, ids in [0, workers)."""
    slow = {}
    if text is None:
        return slow
    for item in text.split(","):
        worker, _, factor = item.strip().partition(":")
        try:
            w, f = int(worker), float(factor)
        except ValueError:
            raise ValueError("expected ID:FACTOR,... such as 1:4,3:2, got %r" % text)
        if not 0 <= w < workers:
            raise ValueError("worker id %s is not in [0, --workers=%d)" % (worker, workers))
        if not f >= 1 or f == float("inf"):
            raise ValueError("worker %d: factor must be >= 1, got %s" % (w, factor))
        if w in slow:
            raise ValueError("worker %d given twice" % w)
        slow[w] = factor.strip()
    return slow


def checkpoint_files(directory):
    """The shard checkpoints (shard-<id>-step-<step>.ckpt) in `directory`, sorted; [] if none
    or no such directory."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(n for n in names if re.match(r"^shard-\d+-step-\d{12}\.ckpt$", n))


def model_bytes(layers):
    """Bytes of the float32 MLP that --layers describes ("784-256-10"): for each consecutive pair
    of sizes (in, out), an [in, out] weight and an [out] bias."""
    try:
        sizes = [int(s) for s in layers.split("-")]
    except ValueError:
        sizes = []
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError("expected two or more positive sizes such as 784-256-10, got %r" % layers)
    return 4 * sum(n_in * n_out + n_out for n_in, n_out in zip(sizes, sizes[1:]))


def model_flag_bytes(model, layers):
    """Bytes of the float32 model that --model (mlp:SIZES, cnn or resnet[:BLOCKS]) or its old
    spelling --layers names; ValueError for anything else."""
    if model is not None and layers is not None:
        raise ValueError("give --model or its old spelling --layers, not both")
    if model is None:
        return model_bytes(layers or DEFAULT_LAYERS)
    if model == "cnn":
        return 4 * CNN_PARAMETERS
    if model.startswith("mlp:"):
        return model_bytes(model[len("mlp:"):])
    match = re.match(r"^resnet(?::(\d+))?$", model)
    if match and 1 <= int(match.group(1) or 3) <= 16:
        return 4 * resnet_parameters(int(match.group(1) or 3))
    raise ValueError("unknown model %r (expected mlp:IN-HIDDEN...-CLASSES, cnn, resnet or "
                     "resnet:BLOCKS with 1-16 blocks per stage)" % model)


def resnet_parameters(blocks):
    """Parameters of --model=resnet:BLOCKS (worker/model/model_spec.h's ResNetModelSpec): a 3x3
    stem to 16 channels, three stages of BLOCKS blocks of two 3x3 convolutions at 16, 32 and 64
    channels, a 3x3 widening convolution before the second and third, and a 3136->10 dense layer."""
    conv = lambda cin, cout: 9 * cin * cout + cout  # noqa: E731
    stages = sum(2 * blocks * conv(c, c) for c in (16, 32, 64))
    return conv(1, 16) + conv(16, 32) + conv(32, 64) + stages + 3136 * 10 + 10


def max_message_mb(layers):
    """The largest gRPC message, in MiB, that a job training this model must accept: the model's
    bytes (a whole-model pull or push, or the ring's largest chunk, is at most that) plus a quarter
    for message framing, rounded up, plus one; at least gRPC's default of 4."""
    mib = 1 << 20
    nbytes = layers if isinstance(layers, int) else model_bytes(layers)
    return max(4, -(-nbytes * 5 // (4 * mib)) + 1)  # ceil(bytes * 1.25 / MiB) + 1
