"""One child process of a job, local (Proc) or started on a host through the remote shell
(RemoteProc): its log, and how it ended (its outcome: done, crashed, stopped, restarted or FAILED,
with the reason)."""

import ctypes
import json
import os
import signal
import subprocess
import threading
import time

from .programs import INJECTED_CRASH, SERVER_PROGRAM, WORKER_PROGRAM
from .programs import exit_description, signal_name
from .remote import REMOTE_ERROR, encode_secret

PR_SET_PDEATHSIG = 1
# Seconds that a remote process has, once its stdin is closed, before the launcher kills its rsh:
# the wrapper's own SIGTERM-to-SIGKILL wait (5 s) and some.
REMOTE_STOP_GRACE = 8.0


class LaunchError(Exception):
    pass


def stats_record(raw):
    """A server's {"event":"stats",...} line (bytes) as a dict, or None for any other line."""
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("event") == "stats" else None


def _die_with_parent():
    """Runs in the child before exec: ask the kernel for SIGKILL when the launcher dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # Own process group, so that a terminal's Ctrl-C reaches only the launcher, which then stops
    # the children in order.
    os.setpgid(0, 0)


def _own_process_group():
    """Runs in an rsh child before exec. No PR_SET_PDEATHSIG here: the remote process is stopped by
    its stdin reaching end of file, which the launcher's death causes too, and killing an rsh that
    runs the wrapper in place (ip netns exec) would skip the wrapper's clean-up."""
    os.setpgid(0, 0)


class Proc:
    """One child process, its log, and how it ended."""

    host = None  # Local processes; a RemoteProc's host-file name.

    def __init__(self, name, program, argv, run_dir, capture_stdout=False, crash_at_step=None,
                 env=None):
        """`env`: variables added to the launcher's environment (-x, the local rank)."""
        self._setup(name, program, run_dir, crash_at_step)
        self.log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if capture_stdout else self.log, stderr=self.log,
            env=dict(os.environ, **env) if env else None, preexec_fn=_die_with_parent)

    def _setup(self, name, program, run_dir, crash_at_step):
        self.name = name
        # "rubato_server" or "rubato_worker": the prefix of the process's own one-line error.
        self.program = program
        # A worker's --crash_at_step, if any: then its exit with status 3 is expected, no failure.
        self.crash_at_step = crash_at_step
        # Set when the launcher ends the process: however it then exits, it has not failed.
        self.stopped = False
        # Set when the launcher started another process in this one's place (--restart_servers).
        self.restarted = False
        # A server: whether every worker had ended when the launcher first saw it ended. A server
        # ends by itself (status 0) once the workers are done; before that, its end is a failure.
        self.after_workers = None
        self.ended_at = None  # time.monotonic() when the launcher first saw it exited.
        self._outcome = None  # outcome(), once the process has exited: it no longer changes.
        # A server's final statistics, its stats record (proto/progress.proto), once it has ended.
        self.stats = None
        self.log_path = os.path.join(run_dir, name + ".log")

    def returncode(self):
        """Popen's returncode (None while running; -N: killed by signal N)."""
        return self.popen.returncode

    def poll(self, now=None):
        self.popen.poll()
        rc = self.returncode()
        if rc is not None and self.ended_at is None:
            self.ended_at = now or time.monotonic()
        return rc

    def end_order(self):
        """Sort key, first ended first. Processes seen ended in the same round of polls tie, and
        servers come first: a dead server takes the workers with it, never the other way round."""
        return self.ended_at or 0.0, self.program != SERVER_PROGRAM

    def _log_lines(self):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))  # The error is the last line.
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def error_line(self):
        """The process's own last one-line error ("rubato_worker: error: ...", or the flag parser's
        "ERROR: ..."), or "" when it left none. Other lines may quote another process's error, a
        status relayed from a server for instance, so only these prefixes count."""
        for line in reversed(self._log_lines()):
            if line.startswith(self.program + ": error:") or line.startswith("ERROR: "):
                return line.strip()
        return ""

    def outcome(self):
        """(state, reason) of the process: ("running", None); ("stopped", None) when the launcher
        ended it; ("done", None) for a worker that finished or a server that ended by itself after
        the workers; ("crashed", why) for a worker's injected crash; else ("FAILED", why), why
        being how it ended and its own error line."""
        rc = self.poll()
        if rc is None:
            return "running", None
        if self._outcome is None:
            self._outcome = self._ended(rc)
        return self._outcome

    def _ended(self, rc):
        if self.stopped:
            return "stopped", None
        if self.restarted:
            error = self.error_line()
            how = exit_description(rc)
            return "restarted", "%s: %s" % (how, error) if error else how
        if rc == 0 and (self.program == WORKER_PROGRAM or self.after_workers):
            return "done", None
        if self.program == WORKER_PROGRAM and rc == INJECTED_CRASH and self.crash_at_step:
            return "crashed", "injected crash at step %s" % self.crash_at_step
        how = exit_description(rc)
        if self.program == SERVER_PROGRAM and rc == 0:
            how += " before the job ended"  # A server runs until every worker is done.
        error = self.error_line()
        return "FAILED", "%s: %s" % (how, error) if error else how

    def record(self):
        """The process's outcome for summary.json."""
        state, reason = self.outcome()
        out = {"name": self.name, "host": self.host or "127.0.0.1", "state": state.lower()}
        rc = self.returncode()
        if rc is not None:
            out["exit_status"] = rc
            if rc < 0:
                out["signal"] = signal_name(-rc)
        if reason:
            out["reason"] = reason
        return out

    def terminate(self):
        """Asks the process to stop (SIGTERM)."""
        self.popen.terminate()

    def stop_grace(self):
        return 0.0

    def join(self, timeout=5.0):
        """Waits for the threads that read the process's output (a local one has none)."""


class RemoteProc(Proc):
    """One process started on a host through the remote shell: `argv` runs it there (see
    remote.remote_script). Its stdout and stderr come back through the rsh's; its stdin is a pipe
    that this launcher holds open, whose end (close_stdin, or the launcher's death) stops the remote
    process. `files` (the job secret, TLS files: bytes each, in remote_script's file_flags order)
    are sent as the pipe's first lines."""

    def __init__(self, name, program, host, argv, run_dir, job_log, files=(),
                 crash_at_step=None, stdout_sink=None):
        self._setup(name, program, run_dir, crash_at_step)
        self.host = host
        self.job_log = job_log
        self.log = open(self.log_path, "wb")
        self.log_lock = threading.Lock()
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            preexec_fn=_own_process_group)
        try:
            for content in files:
                self.popen.stdin.write(encode_secret(content) + b"\n")
            self.popen.stdin.flush()
        except OSError:  # It has ended already: its outcome says how.
            pass
        self.readers = [threading.Thread(target=self._read_stderr, daemon=True)]
        if stdout_sink is None:
            self.readers.append(threading.Thread(target=self._read_stdout, daemon=True))
        else:  # A worker: its JSON lines go to its WorkerView.
            self.readers.append(threading.Thread(target=stdout_sink, args=(self.popen.stdout,),
                                                 daemon=True))
        for t in self.readers:
            t.start()

    def returncode(self):
        """The rsh returns the remote status; 128 + N, the wrapper's status when signal N killed
        the remote process, reads as Popen's -N."""
        rc = self.popen.returncode
        if rc is not None and 128 < rc <= 128 + 64:
            return -(rc - 128)
        return rc

    def _write_log(self, raw):
        with self.log_lock:
            self.log.write(raw)
            self.log.flush()

    def _read_stderr(self):
        for raw in iter(self.popen.stderr.readline, b""):
            self._write_log(raw)
            self.job_log.line(self.name, self.host, raw.decode("utf-8", "replace").rstrip("\n"))

    def _read_stdout(self):
        """A server's stdout: its log lines, and at its end one {"event":"stats",...} line."""
        for raw in iter(self.popen.stdout.readline, b""):
            self._write_log(raw)
            self.stats = stats_record(raw) or self.stats

    def error_line(self):
        """As for a local process; failing that, the wrapper's own error, or for an rsh that
        failed (ssh: 255; the shell: 126, 127) its last line, "ssh: connect to host ..."."""
        line = super().error_line()
        if line:
            return line
        lines = [l.strip() for l in self._log_lines() if l.strip()]
        for l in reversed(lines):
            if l.startswith(REMOTE_ERROR):
                return l
        if lines and self.popen.returncode in (126, 127, 255):
            return lines[-1]
        return ""

    def close_stdin(self):
        """Ends the remote process: its wrapper sends it SIGTERM, then SIGKILL after 5 s."""
        try:
            self.popen.stdin.close()
        except OSError:
            pass

    def terminate(self):
        self.close_stdin()

    def stop_grace(self):
        return REMOTE_STOP_GRACE

    def join(self, timeout=5.0):
        for t in self.readers:
            t.join(timeout=timeout)
