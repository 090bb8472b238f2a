"""The remote shell: the one-line sh wrapper that runs a program on a host and ties its life to the
wrapper's stdin, how it is quoted for an rsh that joins its arguments (ssh) or passes them on as
argv (ip netns exec), and the preflight that checks every host before anything starts."""

import os
import shlex
import subprocess
import threading

from .programs import DATA_FILES, DEFAULT_DATA_DIR, SERVER_PROGRAM, WORKER_PROGRAM
from .programs import exit_description

DEFAULT_RSH = "ssh -o BatchMode=yes"
# The remote wrapper's own one-line errors (no secret on stdin, no mktemp), with status 125.
REMOTE_ERROR = "rubato remote: error:"
REMOTE_WRAPPER_STATUS = 125
PROBE = "rubato-probe"
# The file each of remote_script's file_flags is written to, in its temporary directory.
FILE_NAMES = {"auth_secret_file": "job.secret", "tls_cert": "tls.crt", "tls_key": "tls.key",
              "tls_ca": "ca.crt"}
PREFLIGHT_OK = "rubato-preflight-ok"


def encode_secret(secret):
    """The secret's bytes as one line for the wrapper's `printf %b`: every byte as \\0NNN, so
    that any byte, a newline or NUL included, arrives intact."""
    return "".join("\\0%03o" % b for b in secret).encode("ascii")


def remote_script(argv, file_flags=(), env=None):
    """The one-line sh script that runs `argv` on a host and ties its life to the script's stdin.

    For each of `file_flags` (auth_secret_file, tls_cert, tls_key, tls_ca), in order, a stdin line
    holds a file's bytes (encode_secret): it goes to a fresh mode-0600 file in a `mktemp -d`
    directory, removed at exit, and the program gets --FLAG=that file: secrets and keys never
    appear on a command line, and the host needs no copy of them. `env` (NAME -> value) is
    exported to the program. The program runs in the background with stdin from /dev/null; a
    watcher subshell reads the rest of stdin and, at its end of file, sends it SIGTERM, then SIGKILL
    5 s later (and removes the directory, in case the script itself was killed). SIGTERM, SIGINT or
    SIGHUP to the script are passed on. The script exits with the program's status, 128 + N when
    signal N killed it. One line, since a login shell that reads it may not be sh."""
    cmd = " ".join(shlex.quote(a) for a in argv)
    fail = "{ echo '%s %%s' >&2; exit %d; }" % (REMOTE_ERROR, REMOTE_WRAPPER_STATUS)
    parts = ["d=", "exec 3<&0"]
    for name, value in sorted((env or {}).items()):
        parts.append("export %s=%s" % (name, shlex.quote(value)))
    if file_flags:
        parts += [
            "d=$(mktemp -d \"${TMPDIR:-/tmp}/rubato.XXXXXX\") || " + fail % "mktemp -d failed",
            "trap 'rm -rf \"$d\"' EXIT",
        ]
    for flag in file_flags:
        secret = flag == "auth_secret_file"
        parts += [
            "IFS= read -r s || [ -n \"$s\" ] || "
            + fail % ("no %s on stdin" % ("job secret" if secret else "--" + flag)),
            "(umask 077 && printf '%%b' \"$s\" >\"$d/%s\") || " % FILE_NAMES[flag]
            + fail % ("cannot write %s" % ("the job secret" if secret else "--" + flag)),
            "s=",
        ]
        cmd += ' "--%s=$d/%s"' % (flag, FILE_NAMES[flag])
    parts += [
        cmd + " </dev/null 3<&- &",
        "p=$!",
        "(while IFS= read -r _; do :; done; kill -TERM $p; i=0; "
        "while kill -0 $p && [ $i -lt 5 ]; do sleep 1; i=$((i+1)); done; kill -KILL $p; "
        "[ -z \"$d\" ] || rm -rf \"$d\") <&3 >/dev/null 2>&1 &",
        "w=$!",
        "exec 3<&-",
        "trap 'kill -TERM $p 2>/dev/null' HUP INT TERM",
        "wait $p; rc=$?",
        # A trapped signal interrupts wait: wait again until the program has really ended.
        "while kill -0 $p 2>/dev/null; do wait $p; rc=$?; done",
        "kill $w 2>/dev/null",
        "exit $rc",
    ]
    out = ""
    for part in parts:
        out += part + (" " if part.endswith("&") else "; ")
    return out.rstrip("; ")


def rsh_argv(rsh, host, script, joins):
    """argv that runs `sh -c script` on `host` through the remote shell `rsh` (a list). A remote
    shell that joins its arguments into one command line (ssh) gets the script quoted once more;
    one that passes them on as argv (ip netns exec) gets it as is."""
    if joins:
        return rsh + [host, "sh -c " + shlex.quote(script)]
    return rsh + [host, "sh", "-c", script]


def _run_rsh(argv, timeout):
    """(status, stdout, stderr) of a short rsh command; status None on a timeout."""
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, timeout=timeout, preexec_fn=os.setpgrp)
    except subprocess.TimeoutExpired:
        return None, "", ""
    except OSError as e:  # No such rsh program.
        return 127, "", str(e)
    return (done.returncode, done.stdout.decode("utf-8", "replace"),
            done.stderr.decode("utf-8", "replace"))


def last_line(text):
    """The last non-blank line of `text`, stripped ("" if none)."""
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else ""


def probe_host(rsh, rsh_text, host, timeout):
    """Runs `RSH HOST echo "'probe'"`: (joins, None) when the host answered, joins telling whether
    the rsh joined its arguments into a command line for a shell (which then removed the quotes:
    ssh) or passed them on as argv (ip netns exec); (None, why) when it did not answer."""
    rc, out, err = _run_rsh(rsh + [host, "echo", "'%s'" % PROBE], timeout)
    if rc is None:
        return None, "no answer through --rsh '%s' within %g s" % (rsh_text, timeout)
    answer = last_line(out)
    if rc == 0 and answer in (PROBE, "'%s'" % PROBE):
        return answer == PROBE, None
    why = last_line(err) or (answer and "unexpected answer %r" % answer) or "no output"
    return None, "unreachable through --rsh '%s' (%s): %s" % (rsh_text, exit_description(rc), why)


def preflight_script(executables, files, names):
    """One-line sh script: a line "not executable: PATH", "missing: PATH" or "cannot resolve: NAME"
    per problem, then PREFLIGHT_OK."""
    q = lambda items: " ".join(shlex.quote(i) for i in items)  # noqa: E731
    parts = []
    if executables:
        parts.append('for f in %s; do [ -f "$f" ] && [ -x "$f" ] || echo "not executable: $f"; '
                     'done' % q(executables))
    if files:
        parts.append('for f in %s; do [ -f "$f" ] && [ -r "$f" ] || echo "missing: $f"; done'
                     % q(files))
    parts.append('command -v mktemp >/dev/null 2>&1 || echo "missing: the mktemp command"')
    if names:
        parts.append('if command -v getent >/dev/null 2>&1; then for h in %s; do '
                     'getent hosts "$h" >/dev/null 2>&1 || echo "cannot resolve: $h"; done; fi'
                     % q(names))
    parts.append("echo %s" % PREFLIGHT_OK)
    return "; ".join(parts)


def preflight_findings(rc, out, err, timeout):
    """The problems that a host's preflight_script answer (status, stdout, stderr) reports."""
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    found = [l for l in lines if l.split(":", 1)[0] in
             ("not executable", "missing", "cannot resolve")]
    if rc is None:
        found.append("the checks did not finish within %g s" % timeout)
    elif PREFLIGHT_OK not in lines:
        found.append("the checks failed (%s): %s" % (exit_description(rc),
                                                     last_line(err) or "no output"))
    return found


def preflight(rsh, rsh_text, needs, timeout):
    """Checks every host in parallel. `needs`: host -> (executables, files, names to resolve).
    Returns (joins, problems): whether the rsh joins its arguments (probe_host), and host ->
    [problem, ...] for every host that lacks something (empty when all is well)."""
    problems, modes = {}, {}

    def check(host):
        executables, files, names = needs[host]
        joins, why = probe_host(rsh, rsh_text, host, timeout)
        if why:
            problems[host] = [why]
            return
        modes[host] = joins
        rc, out, err = _run_rsh(
            rsh_argv(rsh, host, preflight_script(executables, files, names), joins), timeout)
        found = preflight_findings(rc, out, err, timeout)
        if found:
            problems[host] = found

    threads = [threading.Thread(target=check, args=(h,), daemon=True) for h in needs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(set(modes.values())) > 1:
        for host in modes:  # One rsh for every host: it cannot do both.
            problems.setdefault(host, []).append(
                "--rsh '%s' %s its arguments here, unlike on other hosts" % (
                    rsh_text, "joins" if modes[host] else "does not join"))
    joins = next(iter(modes.values()), False)
    return joins, {h: problems[h] for h in needs if h in problems}


def preflight_needs(args, plan, remote_bin_dir):
    """host -> (executables, files, names) that the preflight checks there."""
    data_dir = args.data_dir or DEFAULT_DATA_DIR
    used = [h for h, _ in plan.hosts if h in plan.server_hosts or h in plan.worker_hosts]
    allreduce = (args.mode or "").partition(":")[0] == "allreduce"
    needs = {}
    for host in used:
        executables, files, names = [], [], []
        if host in plan.server_hosts:
            executables.append(os.path.join(remote_bin_dir, "server", SERVER_PROGRAM))
        if host in plan.worker_hosts:
            executables.append(os.path.join(remote_bin_dir, "worker", WORKER_PROGRAM))
            files += [os.path.join(data_dir, f) for f in DATA_FILES]
            # The addresses that this host's workers dial.
            for name in (plan.worker_hosts if allreduce else plan.server_hosts):
                if name not in names:
                    names.append(name)
        needs[host] = (executables, files, names)
    return needs
