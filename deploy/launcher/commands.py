"""The command lines of rubato_server and rubato_worker: which of the launcher's flags go to which
binary (the tables below, from which the launcher's own options are made too), the flags that the
launcher adds itself (addresses, ids, the job's secret), and every flag name it can forward
(forwarded_flag_names, which a test checks against each binary's --helpfull)."""

import argparse
import os
import re
import secrets

from .programs import SERVER_PROGRAM, WORKER_PROGRAM

# Flags that describe the cluster: given to servers and workers alike.
CLUSTER_FLAGS = ("mode", "staleness_aware_lr", "optimizer", "learning_rate", "weight_decay",
                 "momentum", "nesterov", "beta1", "beta2", "epsilon", "trust_coefficient",
                 "exclude_from_weight_decay", "exclude_from_layer_adaptation", "clip_global_norm",
                 "lr_reference_batch", "lr_scaling", "warmup_steps", "warmup_epochs", "lr_decay",
                 "lr_decay_steps", "lr_decay_factor", "lr_power", "final_lr_fraction", "lease_ms",
                 "wait_timeout_ms", "max_message_mb", "adaptive_batch", "adaptive_batch_every",
                 "reassign", "reassign_unit_batches")
# Flags given to servers only.
SERVER_FLAGS = ("update_threads", "apply_threads", "noise_ema_decay", "memory_budget_mb",
                "push_budget_mb", "checkpoint_dir", "checkpoint_every_steps", "checkpoint_keep",
                "restore_step")
# Flags given to workers only.
WORKER_FLAGS = ("model", "layers", "compute_threads", "cuda_device", "overlap", "comm_thread",
                "layerwise_forward", "push_bucket_kb", "ps_transport", "ring_spin_us", "batch_size",
                "epochs", "steps", "eval_every",
                "log_every", "train_limit", "test_limit", "seed", "data_dir", "backend",
                "connect_timeout_ms", "retry_timeout_ms", "server_restart_timeout_s",
                # Straggler injection, for every worker; --slow_workers slows chosen ones.
                "slowdown", "min_step_ms", "delay_probability", "delay_distribution",
                "delay_mean_ms", "delay_sigma", "delay_alpha", "straggler_seed", "pause_at_step",
                "pause_ms", "crash_at_step", "slow_from_step", "slow_period_steps",
                "slow_for_steps", "rotate_slow", "delay_trace", "export_model",
                # Work reassignment: replay a run's assignment.
                "reassign_replay")

# A local server's address until it has one: it picks a free port and writes it to its port file.
LOCAL_LISTEN = "--listen=127.0.0.1:0"


def forwarded(args, names):
    """--NAME=VALUE for each of `names` that the launcher's command line gave."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out.append("--%s=%s" % (name, value))
    return out


def worker_flags(args, worker):
    """The worker-only flags for one worker: --slow_workers overrides --slowdown."""
    flags = forwarded(args, WORKER_FLAGS)
    if worker in args.slow_workers:
        flags = [f for f in flags if not f.startswith("--slowdown=")]
        flags.append("--slowdown=%s" % args.slow_workers[worker])
    if worker in args.crash_workers:
        flags = [f for f in flags if not f.startswith("--crash_at_step=")]
        flags.append("--crash_at_step=%d" % args.crash_workers[worker])
    return flags


def write_private_file(path, text):
    """Writes `text` to a new file at `path`, readable by this user only (an earlier file there is
    removed first: a secret is never reused)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    # O_EXCL: the file is this call's own, never one (or a link) that someone else put there.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_job_secret(run_dir):
    """Writes a fresh secret (32 random bytes, hex) to <run_dir>/job.secret, readable by this user
    only, and returns its absolute path. Every process of the job reads it to authenticate the
    others, so that no other local process can join or drive the job."""
    path = os.path.abspath(os.path.join(run_dir, "job.secret"))
    write_private_file(path, secrets.token_hex(32))
    return path


def new_job_id(run_dir):
    """A fresh identity for one job (common/auth.h): "rubato-", the run directory's name where it
    is a valid one, and 16 random hex digits. Every token of the job is made from it and the
    secret, so a secret file kept across jobs (--auth_secret_file) never lets one job's tokens
    into another."""
    name = re.sub(r"[^A-Za-z0-9._-]", "", os.path.basename(os.path.abspath(run_dir)))[:64]
    return "-".join(p for p in ("rubato", name, secrets.token_hex(8)) if p)


def auth_flags(args, run_dir):
    """The flags that give every server and worker the job's secret and its fresh job id, or
    --insecure."""
    if args.insecure:
        return ["--insecure"]
    path = os.path.abspath(args.auth_secret_file) if args.auth_secret_file else \
        write_job_secret(run_dir)
    return ["--auth_secret_file=" + path, "--job_id=" + new_job_id(run_dir)]


TLS_FLAGS = ("tls_cert", "tls_key", "tls_ca")


def tls_flags(args):
    """--tls_cert, --tls_key and --tls_ca of a local job (across hosts the remote wrapper adds
    its own, naming the copies it was sent)."""
    return forwarded(args, TLS_FLAGS)


def file_flags(args):
    """The flags whose files a remote process is sent on its stdin (remote.remote_script), in
    order: the job's secret, then the TLS files."""
    return ([] if args.insecure else ["auth_secret_file"]) + \
        [n for n in TLS_FLAGS if getattr(args, n, None) is not None]


def process_env(args, local_rank, local_size):
    """The variables a process gets on top of its environment: -x's, and its local rank."""
    env = dict(getattr(args, "env_vars", {}))
    env.update({"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size)})
    return env


def local_rank(args, program, index):
    """(local rank, local world size) of worker or server `index`: across hosts the plan's; on
    127.0.0.1 every process shares the host, workers first."""
    plan = args.plan
    if plan:
        if program == WORKER_PROGRAM:
            r, host = plan.worker_local_ranks[index], plan.worker_hosts[index]
        else:
            r, host = plan.server_local_ranks[index], plan.server_hosts[index]
        return r, plan.local_sizes[host]
    servers = 0 if (args.mode or "").partition(":")[0] == "allreduce" else args.servers
    return (index if program == WORKER_PROGRAM else args.workers + index), args.workers + servers


def cluster_flags(args, auth):
    """What every server and worker of the job gets: the cluster flags, the number of workers and
    `auth` (auth_flags; [] across hosts, where the remote wrapper adds its own)."""
    return forwarded(args, CLUSTER_FLAGS) + ["--num_workers=%d" % args.workers] + auth


def port_file(run_dir, shard):
    return os.path.join(run_dir, "server-%d.port" % shard)


def stats_file(run_dir, shard):
    return os.path.join(run_dir, "server-%d.stats.json" % shard)


def server_command(args, server_bin, shard, cluster, plan=None, run_dir=None):
    """argv of server shard `shard`: across hosts (`plan`) on its fixed ports; locally on a free
    port that it writes to its port file in `run_dir`, with its statistics file there."""
    if plan:
        where = ["--listen=0.0.0.0:%d" % plan.server_ports[shard],
                 "--data_port=%d" % plan.server_data_ports[shard]]
    else:
        where = [LOCAL_LISTEN, "--port_file=" + port_file(run_dir, shard),
                 "--stats_file=" + stats_file(run_dir, shard)]
    return ([server_bin, "--shard_id=%d" % shard, "--num_shards=%d" % args.servers] + where
            + cluster + forwarded(args, SERVER_FLAGS))


def restart_command(argv, address):
    """A local server's argv (server_command) for its restart on the address it had."""
    argv = [("--listen=" + address) if a == LOCAL_LISTEN else a for a in argv]
    return [a for a in argv if not a.startswith("--port_file=")]


def servers_flag(addresses):
    return "--servers=" + ",".join(addresses)


def peers_flag(addresses):
    return "--peers=" + ",".join(addresses)


def worker_command(args, worker_bin, worker, where, cluster, plan=None):
    """argv of worker `worker`; `where`: servers_flag or peers_flag. An allreduce rank across hosts
    listens on its fixed ports. --local_rank picks its GPU on a host with several."""
    listen = []
    if plan and (args.mode or "").partition(":")[0] == "allreduce":
        listen = ["--listen=0.0.0.0:%d" % plan.rank_ports[worker],
                  "--ring_data_port=%d" % plan.rank_data_ports[worker]]
    rank = ["--local_rank=%d" % local_rank(args, WORKER_PROGRAM, worker)[0]]
    return ([worker_bin, "--worker_id=%d" % worker, where] + listen + rank + cluster
            + worker_flags(args, worker))


def crash_step(argv):
    """The worker's --crash_at_step value in `argv` (a string), or None."""
    crash = [a.partition("=")[2] for a in argv if a.startswith("--crash_at_step=")]
    return crash[0] if crash else None


def flag_names(argv):
    """The names of the --flags in `argv` ("--listen=0.0.0.0:1" -> "listen")."""
    return {m.group(1) for m in (re.match(r"^--([A-Za-z0-9_]+)(=|$)", a) for a in argv) if m}


def _every_option(mode, insecure):
    """Launcher options with every forwardable flag given, as parse_args leaves them."""
    args = argparse.Namespace(**dict.fromkeys(CLUSTER_FLAGS + SERVER_FLAGS + WORKER_FLAGS, "1"))
    args.mode = mode
    args.servers, args.workers = 2, 2
    args.slow_workers, args.crash_workers = {0: "2"}, {0: 5}
    args.insecure, args.auth_secret_file = insecure, None if insecure else "job.secret"
    args.server_hosts = args.worker_hosts = None
    args.map_by, args.oversubscribe, args.base_port = "slot", False, 20000
    args.server_slots, args.plan = 0, None
    for name in TLS_FLAGS:
        setattr(args, name, "%s.pem" % name)
    return args


def forwarded_flag_names():
    """{program: sorted names of every flag that the launcher can put on its command line}, found
    by building each kind of command line (local and across hosts, parameter servers and
    allreduce, secured and not, a restarted server) with every forwardable option given."""
    from .hosts import Plan  # Only here: commands need a plan, not the host file.
    names = {SERVER_PROGRAM: set(), WORKER_PROGRAM: set()}
    for mode in ("bsp", "allreduce"):
        for insecure in (False, True):
            args = _every_option(mode, insecure)
            auth = auth_flags(args, ".")
            for plan in (None, Plan(args, [("h", 4)])):
                args.plan = plan
                cluster = cluster_flags(args, auth) + (tls_flags(args) if plan is None else [
                    "--%s=f" % f for f in file_flags(args)])
                server = server_command(args, "s", 0, cluster, plan, ".")
                names[SERVER_PROGRAM] |= flag_names(server + restart_command(server, "h:1"))
                for where in (servers_flag(["h:1"]), peers_flag(["h:1"])):
                    names[WORKER_PROGRAM] |= flag_names(
                        worker_command(args, "w", 0, where, cluster, plan))
    return {program: sorted(n) for program, n in names.items()}
