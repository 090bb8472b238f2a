"""One job: its run directory, secret and processes. Job.start() starts the servers and then the
workers, locally (servers on free ports, reported through port files) or across hosts (through the
remote shell, every address fixed beforehand); Job.run() starts it, supervises it and stops what is
left."""

import os
import shlex
import sys
import threading
import time

from . import commands
from .hosts import free_ports
from .live import JobLog, Screen, WorkerView
from .process import Proc, RemoteProc
from .programs import SERVER_PROGRAM, WORKER_PROGRAM
from .remote import remote_script, rsh_argv
from .supervise import run_supervised, stop, wait_for_port_file


def bin_dir(args):
    """Where the binaries are: --bin_dir locally; across hosts --remote_bin_dir, or --bin_dir made
    absolute."""
    if args.plan:
        return args.remote_bin_dir or os.path.abspath(args.bin_dir)
    return args.bin_dir


class Job:

    restarts_in_place = False  # The Supervisor restarts shards (--restart_servers).
    output_lag_s = 0.0  # Added to the grace periods (supervise.py): how late an exit is seen.

    def __init__(self, args, run_dir, joins=False):
        self.args = args
        self.plan = args.plan  # None: local processes.
        self.run_dir = run_dir
        self.joins = joins  # Whether the rsh joins its arguments (remote.probe_host).
        self.rsh = shlex.split(args.rsh) if self.plan else None
        bins = bin_dir(args)
        self.server_bin = os.path.join(bins, "server", SERVER_PROGRAM)
        self.worker_bin = os.path.join(bins, "worker", WORKER_PROGRAM)
        auth = commands.auth_flags(args, run_dir)
        # Several hosts: the secret's and the TLS files' bytes, sent on each remote stdin; the
        # remote wrapper adds --auth_secret_file and the --tls_* flags, naming its own copies.
        self.file_flags, self.files = [], []
        if self.plan:
            self.file_flags = commands.file_flags(args)
            paths = {"auth_secret_file": auth[0].partition("=")[2] if not args.insecure else None}
            paths.update({n: getattr(args, n) for n in commands.TLS_FLAGS})
            for flag in self.file_flags:
                with open(paths[flag], "rb") as f:
                    self.files.append(f.read())
            auth = [a for a in auth if not a.startswith("--auth_secret_file=")]  # The job id stays.
            self.cluster = commands.cluster_flags(args, auth)
        else:
            self.cluster = commands.cluster_flags(args, auth) + commands.tls_flags(args)
        self.procs, self.servers, self.workers, self.views, self.readers = [], [], [], [], []
        self.server_argv = []  # The argv of each server, for --restart_servers.
        self.addresses = []  # Local servers: the address of each.
        self.interrupted = []  # Set by the SIGINT and SIGTERM handlers.
        self.screen = Screen(sys.stdout.isatty())
        self.job_log = JobLog(os.path.join(run_dir, "job.log"), self.screen) if self.plan else None
        self.began = time.monotonic()

    def summary_extra(self):
        """Fields summary.json adds for this kind of job (slurm.SlurmJob's Slurm section)."""
        return {}

    def worker_hosts(self):
        """Each worker's host across hosts; None for a local job."""
        return self.plan.worker_hosts if self.plan else None

    def run(self):
        """Starts the job and supervises it; returns why it ended early, or None. Whatever still
        runs at the end is stopped, and the output readers are done."""
        return run_supervised(self, self._stop_all)

    def _stop_all(self):
        stop(self.procs)
        for t in self.readers:
            t.join(timeout=5)
        for p in self.procs:
            p.join()

    def start(self):
        if self.plan:
            where = self._start_remote_servers()
        else:
            where = self._start_local_servers()
        for w in range(self.args.workers):
            self._start_worker(w, where)

    def env(self, program, index):
        """-x's variables and the process's local rank (commands.process_env)."""
        return commands.process_env(self.args, *commands.local_rank(self.args, program, index))

    def remote(self, name, program, index, host, argv, **kwargs):
        """Starts `argv` on `host` through the remote shell (also how a shard restarts there)."""
        script = remote_script(argv, self.file_flags, self.env(program, index))
        return RemoteProc(name, program, host, rsh_argv(self.rsh, host, script, self.joins),
                          self.run_dir, self.job_log, files=self.files, **kwargs)

    def _start_remote_servers(self):
        """Every address is fixed: servers (or ranks) and workers all start at once; workers
        wait for the servers (--connect_timeout_ms), ranks for each other. Returns the workers'
        --servers or --peers flag."""
        args, plan = self.args, self.plan
        for s in range(args.servers):
            argv = commands.server_command(args, self.server_bin, s, self.cluster, plan=plan)
            self.server_argv.append(argv)
            proc = self.remote("server-%d" % s, SERVER_PROGRAM, s, plan.server_hosts[s], argv)
            self.procs.append(proc)
            self.servers.append(proc)
        if (args.mode or "").partition(":")[0] == "allreduce":
            print("rubato: allreduce ring of %d worker(s) (%s) through --rsh '%s'; run "
                  "directory %s" % (args.workers, plan.peers(), args.rsh, self.run_dir),
                  flush=True)
            return "--peers=" + plan.peers()
        print("rubato: %d server(s) at %s; starting %d worker(s) on %s through --rsh "
              "'%s'; run directory %s" % (
                  args.servers, plan.servers(), args.workers,
                  ",".join(plan.worker_hosts), args.rsh, self.run_dir), flush=True)
        return "--servers=" + plan.servers()

    def _start_local_servers(self):
        """Servers first, each on a free port reported through its port file. The allreduce mode
        has no servers: the workers listen on free ports chosen here and form a ring. Returns the
        workers' --servers or --peers flag."""
        args, run_dir = self.args, self.run_dir
        allreduce = (args.mode or "").partition(":")[0] == "allreduce"
        for s in range(0 if allreduce else args.servers):
            port_file = commands.port_file(run_dir, s)
            if os.path.exists(port_file):
                os.remove(port_file)
            argv = commands.server_command(args, self.server_bin, s, self.cluster,
                                           run_dir=run_dir)
            self.server_argv.append(argv)
            proc = Proc("server-%d" % s, SERVER_PROGRAM, argv, run_dir,
                        env=self.env(SERVER_PROGRAM, s))
            self.procs.append(proc)
            self.servers.append(proc)
        for s, proc in enumerate(self.servers):
            self.addresses.append(wait_for_port_file(
                proc, commands.port_file(run_dir, s), time.monotonic() + args.startup_timeout))
        if allreduce:
            where = commands.peers_flag("127.0.0.1:%d" % p for p in free_ports(args.workers))
            print("rubato: allreduce ring of %d worker(s) (%s); run directory %s"
                  % (args.workers, where[len("--peers="):], run_dir), flush=True)
            return where
        print("rubato: %d server(s) at %s; starting %d worker(s); run directory %s"
              % (args.servers, ",".join(self.addresses), args.workers, run_dir), flush=True)
        return commands.servers_flag(self.addresses)

    def _start_worker(self, w, where):
        argv = commands.worker_command(self.args, self.worker_bin, w, where, self.cluster,
                                       self.plan)
        crash = commands.crash_step(argv)
        view = WorkerView(w, os.path.join(self.run_dir, "worker-%d.jsonl" % w))
        self.views.append(view)
        if self.plan:
            proc = self.remote("worker-%d" % w, WORKER_PROGRAM, w, self.plan.worker_hosts[w],
                               argv, crash_at_step=crash,
                               stdout_sink=lambda stream: view.feed(stream, self.began))
        else:
            proc = Proc("worker-%d" % w, WORKER_PROGRAM, argv, self.run_dir,
                        capture_stdout=True, crash_at_step=crash, env=self.env(WORKER_PROGRAM, w))
            t = threading.Thread(target=view.feed, args=(proc.popen.stdout, self.began),
                                 daemon=True)
            t.start()
            self.readers.append(t)
        self.procs.append(proc)
        self.workers.append(proc)
