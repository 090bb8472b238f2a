"""Process supervision: watching a started job until it ends, judging each way a process can end,
restarting server shards (--restart_servers, and roll-backs), the grace periods, and stopping
whatever still runs.

A worker that dies does not end the job: the servers drop it after its lease (allreduce: the other
ranks end by themselves). A server that ends by itself (status 0) may do so just before the last
workers' processes end; it has the grace (the lease and 5 s) for them to end, and so do the servers
once the workers have ended. Any other end of a server is at once a failure that ends the job,
unless --restart_servers starts it again."""

import subprocess
import time

from .commands import restart_command
from .live import render
from .process import LaunchError, Proc, RemoteProc
from .programs import DEFAULT_LEASE_MS, MAX_ROLLBACKS, ROLLBACK_EXIT, SERVER_PROGRAM
from .programs import exit_description


def server_grace(args):
    """Seconds that servers have to end by themselves once the workers have ended (and workers
    have to end once a server has ended by itself): the lease, in which a server drops a worker
    that vanished, plus 5 s."""
    try:
        return float(args.lease_ms or DEFAULT_LEASE_MS) / 1000.0 + 5.0
    except ValueError:
        return float(DEFAULT_LEASE_MS) / 1000.0 + 5.0


def wait_for_port_file(proc, path, deadline):
    """The address that a local server wrote to its port file; LaunchError if it ends first or
    writes none by `deadline` (time.monotonic())."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            error = proc.error_line()
            raise LaunchError("%s %s before serving%s" % (
                proc.name, exit_description(proc.poll()), ": " + error if error else ""))
        try:
            with open(path) as f:
                address = f.read().strip()
            if address:
                return address
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    raise LaunchError("%s did not start serving within the start-up timeout" % proc.name)


def judge_servers(servers, ended, workers_over, now, grace):
    """Decides, once, whether each server that has ended did so after the workers (True) or before
    the job ended (False): a non-zero status, or status 0 while workers still ran past the grace."""
    for p in servers:
        if ended[p] and p.after_workers is None:
            if workers_over:
                p.after_workers = True
            elif p.returncode() != 0 or now - p.ended_at > grace:
                p.after_workers = False


class Supervisor:
    """Watches a started Job (job.py) until it ends: run() returns why it ended early (a failure),
    or None when the workers ended and the servers after them."""

    def __init__(self, job):
        self.job = job
        self.args = job.args
        self.noted = set()  # Workers whose failure or crash has been noted.
        self.restarts = [0] * len(job.servers)
        self.rollbacks = [0] * len(job.servers)
        self.workers_over_at = None
        self.grace = server_grace(job.args) + job.output_lag_s

    def run(self):
        job = self.job
        while True:
            now = time.monotonic()
            ended = {p: p.poll(now) is not None for p in job.procs}  # One timestamp per round.
            workers_over = all(ended[p] for p in job.workers)
            judge_servers(job.servers, ended, workers_over, now, self.grace)
            states = self.note_workers()
            job.screen.table(render(job.views, states, None, job.worker_hosts()))
            if job.interrupted:
                return "interrupted"
            for s in range(len(job.servers)):
                if self.should_restart(s):
                    ended[self.restart(s)] = False
            failure = self.early_server_failure()
            if failure:
                return failure
            if workers_over:
                if self.workers_over_at is None:
                    self.workers_over_at = now
                if all(ended[p] for p in job.servers) or now - self.workers_over_at > self.grace:
                    return None
            if now - job.began > self.args.timeout:
                return "job did not finish within --timeout=%gs" % self.args.timeout
            time.sleep(self.args.refresh)

    def note_workers(self):
        """Notes each worker that failed or crashed, once; returns every worker's state."""
        outcomes = [p.outcome() for p in self.job.workers]
        for p, (state, reason) in zip(self.job.workers, outcomes):
            if state in ("FAILED", "crashed") and p.name not in self.noted:
                if (self.args.mode or "").partition(":")[0] != "allreduce":
                    reason += ("; the servers drop it after its lease (%s ms) and the others "
                               "carry on" % (self.args.lease_ms or DEFAULT_LEASE_MS))
                elif not self.noted:
                    reason += "; the ring is broken: the other ranks will end with an error"
                self.noted.add(p.name)
                self.job.screen.note("rubato: %s %s: %s" % (p.name, state, reason))
        return [s for s, _ in outcomes]

    def should_restart(self, s):
        """--restart_servers: a shard that died early is started again, at most N times; a
        bsp or backup shard that exits with ROLLBACK_EXIT stopped to roll back to a restarted
        shard's checkpoint, and is started again without counting against N (at most
        MAX_ROLLBACKS times)."""
        p = self.job.servers[s]
        if self.job.restarts_in_place:  # Under Slurm each shard's task restarts it.
            return False
        rollback = p.returncode() == ROLLBACK_EXIT and self.rollbacks[s] < MAX_ROLLBACKS
        return (p.after_workers is False and not p.restarted
                and self.args.restart_servers > 0
                and (rollback or self.restarts[s] < self.args.restart_servers))

    def restart(self, s):
        """Starts server shard `s` again on its address, from its checkpoints; the workers retry it
        meanwhile. Returns the new process."""
        job = self.job
        p = job.servers[s]
        rollback = p.returncode() == ROLLBACK_EXIT and self.rollbacks[s] < MAX_ROLLBACKS
        p.restarted = True
        if rollback:
            self.rollbacks[s] += 1
        else:
            self.restarts[s] += 1
        name = "server-%d.%s-%d" % (s, "rollback" if rollback else "restart",
                                    self.rollbacks[s] if rollback else self.restarts[s])
        if job.plan:  # On its host, through the remote shell, on its fixed ports.
            where = "%s:%d" % (job.plan.server_hosts[s], job.plan.server_ports[s])
            new = job.remote(name, SERVER_PROGRAM, s, job.plan.server_hosts[s], job.server_argv[s])
        else:
            where = job.addresses[s]
            new = Proc(name, SERVER_PROGRAM, restart_command(job.server_argv[s], where),
                       job.run_dir, env=job.env(SERVER_PROGRAM, s))
        if rollback:
            job.screen.note("rubato: server-%d stopped to roll back to another shard's "
                            "checkpoint; restarting it on %s" % (s, where))
        else:
            job.screen.note("rubato: server-%d %s; restarting it on %s from its checkpoints "
                            "(%d of %d)" % (s, p.outcome()[1], where, self.restarts[s],
                                            self.args.restart_servers))
        job.procs.append(new)
        job.servers[s] = new
        return new

    def early_server_failure(self):
        """Without every shard no worker can finish: a server that ends first ends the job."""
        early = sorted((p for p in self.job.servers if p.after_workers is False),
                       key=Proc.end_order)
        if not early:
            return None
        return "%s%s %s" % (early[0].name, "@" + early[0].host if self.job.plan else "",
                            early[0].outcome()[1])


def run_supervised(job, stop_all):
    """Starts `job` (job.Job, slurm.SlurmJob) and supervises it; whatever still runs at the end
    is stopped by `stop_all()`. Returns why the job ended early, or None."""
    failure = None
    try:
        job.start()
        failure = Supervisor(job).run()
    except LaunchError as e:
        failure = str(e)
    finally:
        stop_all()
    return failure


def stop(procs, grace=5.0):
    """Stops everything still running: SIGTERM to a local process, then SIGKILL after `grace`
    seconds; a remote one's stdin is closed (its wrapper sends SIGTERM, then SIGKILL after 5 s),
    and its rsh is killed if it has not ended after REMOTE_STOP_GRACE seconds. A process stopped
    here has not failed, however it exits."""
    start = time.monotonic()
    for p in procs:
        if p.poll() is None:
            p.stopped = True
            p.terminate()
    for p in procs:
        deadline = start + max(grace, p.stop_grace())
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait()
        if isinstance(p, RemoteProc):
            p.close_stdin()  # Also for those that ended by themselves: the pipe is not needed.
        p.poll()  # Records when it ended.
