"""`rubato launch`: main(argv) in its steps: the command line, the checks before anything starts
(the binaries here, or the preflight on every host), the job, and its end (summary.json, the final
lines and the exit status)."""

import os
import shlex
import signal
import sys
import time

from .flags import parse_args
from .job import Job, bin_dir
from .slurm import SlurmJob
from .live import render
from .programs import DEFAULT_DATA_DIR, SERVER_PROGRAM, WORKER_PROGRAM
from .remote import preflight, preflight_needs
from .summary import (failed_processes, failure_message, load_local_stats, print_results,
                      summarize, write_summary)


def main(argv):
    args = parse_args(argv)
    joins, status = check_before_start(args)
    if status is not None:
        return status
    if args.slurm:
        return run_in_slurm(args)
    run_dir = args.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(run_dir, exist_ok=True)
    job = Job(args, run_dir, joins)
    signal.signal(signal.SIGINT, lambda *_: job.interrupted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: job.interrupted.append(True))
    failure = job.run()
    return finish(job, failure, time.monotonic() - job.began)


def run_in_slurm(args):
    """--slurm: the job in this allocation, its attempt's directory attempt-N (N: the requeues so
    far); SIGUSR1 stops it and requeues it."""
    run_dir = os.path.join(args.run_dir, "attempt-%d" % args.slurm_alloc.restarts)
    os.makedirs(run_dir, exist_ok=True)
    job = SlurmJob(args, run_dir)

    def time_limit(*_):
        job.requeue = True
        job.interrupted.append(True)

    signal.signal(signal.SIGINT, lambda *_: job.interrupted.append(True))
    signal.signal(signal.SIGTERM, lambda *_: job.interrupted.append(True))
    signal.signal(signal.SIGUSR1, time_limit)
    failure = job.run()
    if failure == "interrupted" and job.requeue:
        failure = "stopped by SIGUSR1 (the time limit is near): to be requeued"
    status = finish(job, failure, time.monotonic() - job.began)
    if job.requeue:
        job.requeue_job()
    return status


def check_before_start(args):
    """(joins, None) when the job can start, joins telling whether the rsh joins its arguments;
    (None, exit status) when it cannot: a binary missing here, or across hosts a failed
    preflight (every host answers and has what its processes need)."""
    bins = bin_dir(args)
    if not args.plan or args.slurm:  # Under Slurm the binaries are on a shared file system.
        for b in (os.path.join(bins, "server", SERVER_PROGRAM),
                  os.path.join(bins, "worker", WORKER_PROGRAM)):
            if not os.access(b, os.X_OK):
                print("rubato launch: error: binary not found: %s (build first)" % b,
                      file=sys.stderr)
                return None, 2
        return False, None
    rsh = shlex.split(args.rsh)
    needs = preflight_needs(args, args.plan, bins)
    joins, problems = preflight(rsh, args.rsh, needs, args.preflight_timeout)
    if problems:
        print("rubato launch: error: preflight failed on %d of %d host(s); nothing was "
              "started:" % (len(problems), len(needs)), file=sys.stderr)
        for host, found in problems.items():
            for what in found:
                print("  %s: %s" % (host, what), file=sys.stderr)
        return None, 2
    print("rubato: preflight passed on %d host(s) (binaries in %s, data in %s)" % (
        len(needs), bins, args.data_dir or DEFAULT_DATA_DIR), flush=True)
    return joins, None


def finish(job, failure, wall):
    """Reports how the job ended, writes summary.json and returns the exit status."""
    args = job.args
    if not job.plan:
        load_local_stats(job.servers, job.run_dir)
    if job.views:
        job.screen.table(render(job.views, [p.outcome()[0] for p in job.workers], None,
                                job.worker_hosts()), force=True)
    failed = failed_processes(job.procs)
    at = (lambda p: "%s@%s" % (p.name, p.host)) if job.plan else (lambda p: p.name)
    for p in failed:
        print("rubato: %s FAILED: %s" % (at(p), p.outcome()[1]), flush=True)
    if failure is None:
        failure = failure_message(failed, job.workers, args.workers, at)
    summary = summarize(job.views, wall, args, failure, job.run_dir, job.workers, job.servers,
                        [p for p in job.procs if p.restarted])
    summary.update(job.summary_extra())
    write_summary(summary, job.run_dir)
    if "test_accuracy" in summary:  # Some worker finished: its results stand, failures or not.
        print_results(summary, wall, args, failure, job.run_dir)
    if failure:
        print("rubato launch: error: %s (logs in %s)" % (failure, job.run_dir), file=sys.stderr)
        return 130 if job.interrupted else 1
    return 0
