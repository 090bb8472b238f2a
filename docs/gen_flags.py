"""Writes docs/flags.md, the flags reference of rubato_server and rubato_worker, from their
`--helpfull` (Abseil flags): every flag defined in Rubato's own files, with its default and help.

    ./rubato build && python3 docs/gen_flags.py      # the binaries in bazel-bin
    python3 docs/gen_flags.py --server PATH --worker PATH [--out FILE] [--check]

The binaries are, in this order of precedence: --server/--worker, $RUBATO_SERVER_BIN and
$RUBATO_WORKER_BIN, beside this package as Bazel's runfiles hold them (server/rubato_server,
worker/rubato_worker), else in bazel-bin. --check writes nothing and exits 1, showing the
difference, when the file is stale. //docs:flags_test does the same check under Bazel.

Rubato's own flags are those of every "Flags from FILE:" section whose file is not Abseil's or
another library's (THIRD_PARTY). A file's flags that both binaries have alike are listed once.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLAGS_MD = os.path.join(HERE, "flags.md")
REGENERATE = "./rubato build && python3 docs/gen_flags.py"
BINARIES = ("rubato_server", "rubato_worker")
# Top folders of the files whose flags are not Rubato's (Abseil's are "./absl/...").
THIRD_PARTY = ("absl", "external", "grpc", "src", "third_party", "google", "gflags", "glog")

_SECTION = re.compile(r"^  Flags from (.+):$")
_ENTRY = re.compile(r"^--([A-Za-z0-9_]+) \((.*)\); default: (.*?);(?: currently: (.*?);)?$",
                    re.DOTALL)


class FlagsError(RuntimeError):
    pass


def default_binary(name):
    """Where `name` (rubato_server or rubato_worker) is, unless given on the command line."""
    package = name[len("rubato_"):]
    env = os.environ.get("RUBATO_%s_BIN" % package.upper())
    if env:
        return env
    runfile = os.path.join(ROOT, package, name)
    if os.path.exists(runfile):
        return runfile
    return os.path.join(ROOT, "bazel-bin", package, name)


def helpfull(binary):
    """The binary's --helpfull text. Abseil exits 1 after printing it."""
    try:
        proc = subprocess.run([binary, "--helpfull"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise FlagsError("cannot run %s --helpfull (%s); build it first: ./rubato build" %
                         (binary, e))
    except subprocess.TimeoutExpired:
        raise FlagsError("%s --helpfull did not end within 60 s" % binary)
    text = proc.stdout + proc.stderr
    if "Flags from " not in text:
        raise FlagsError("%s --helpfull printed no flags (exit status %d):\n%s" %
                         (binary, proc.returncode, text[-2000:]))
    return text


def is_rubato_file(path):
    """Whether a "Flags from" file is one of Rubato's rather than a library's."""
    if path.startswith("./"):
        path = path[2:]
    return not os.path.isabs(path) and path.split("/", 1)[0] not in THIRD_PARTY


def parse(text):
    """{file: [(flag, default, help)]} of Rubato's files, in the order --helpfull lists them.
    Abseil wraps each entry at 80 columns, continuing it on lines indented by 6 spaces."""
    sections, entries, current = {}, None, None

    def finish():
        if current is None:
            return
        m = _ENTRY.match(" ".join(current))
        if not m:
            raise FlagsError("cannot read this --helpfull entry: %r" % " ".join(current))
        entries.append((m.group(1), m.group(3), m.group(2)))

    for line in text.splitlines():
        section = _SECTION.match(line)
        if section:
            finish()
            current = None
            path = section.group(1)
            entries = sections.setdefault(path, []) if is_rubato_file(path) else []
        elif line.startswith("    --") and entries is not None:
            finish()
            current = [line.strip()]
        elif line.startswith("      ") and current is not None:
            current.append(line.strip())
        else:
            finish()
            current = None
            if not line.strip() == "":
                entries = None  # The text after the last section.
    finish()
    return {path: sorted(flags) for path, flags in sections.items()}


def _cell(text):
    return text.replace("|", "\\|")


def _table(flags):
    out = ["| flag | default | help |", "|---|---|---|"]
    for name, default, help_text in flags:
        out.append("| `--%s` | %s | %s |" % (name, "`%s`" % default if default else "",
                                            _cell(help_text)))
    return out


def render(parsed):
    """flags.md's text from {binary: parse(its --helpfull)}."""
    files = []
    for sections in parsed.values():
        files += [f for f in sections if f not in files]
    shared, own = [], {b: [] for b in parsed}
    for f in files:
        having = [b for b in parsed if f in parsed[b]]
        if len(having) == len(parsed) and all(parsed[b][f] == parsed[having[0]][f]
                                              for b in having):
            shared.append(f)
        else:
            for b in having:
                own[b].append(f)
    count = {b: sum(len(s) for s in parsed[b].values()) for b in parsed}
    out = [
        "# Flags reference",
        "",
        "Generated by `docs/gen_flags.py` from `--helpfull` of %s; do not edit by hand. "
        "`//docs:flags_test` fails when it is stale; regenerate it with `%s`." % (
            " and ".join("`%s` (%d flags)" % (b, count[b]) for b in parsed), REGENERATE),
        "",
        "Only flags defined in Rubato's own files are listed (not Abseil's `--flagfile`, "
        "`--fromenv`, `--tryfromenv`, `--undefok`). A blank default: the flag is unset unless "
        "given; a cluster flag then takes the value of the `--cluster_spec` file, else the "
        "default its help names. `./rubato launch` forwards these flags to the processes; its "
        "own flags are in [running.md](running.md).",
        "",
    ]
    if shared:
        out += ["## Both binaries", ""]
        for f in shared:
            out += ["### %s" % f, ""] + _table(parsed[next(iter(parsed))][f]) + [""]
    for b in parsed:
        if not own[b]:
            continue
        out += ["## %s" % b, ""]
        for f in own[b]:
            out += ["### %s" % f, ""] + _table(parsed[b][f]) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def generate(server, worker):
    return render({"rubato_server": parse(helpfull(server)),
                   "rubato_worker": parse(helpfull(worker))})


def stale_message(current, expected, path=FLAGS_MD, limit=60):
    """An explanation of how `current` (the file's text) differs from `expected`, or None."""
    if current == expected:
        return None
    diff = list(difflib.unified_diff(current.splitlines(), expected.splitlines(),
                                     "docs/flags.md (committed)",
                                     "docs/flags.md (from the binaries)", lineterm=""))
    shown = diff[:limit] + (["... (%d more lines)" % (len(diff) - limit)]
                            if len(diff) > limit else [])
    return ("%s is stale: it differs from what docs/gen_flags.py makes of the binaries' "
            "--helpfull. Regenerate it from the repository root with:\n    %s\nand commit it.\n%s"
            % (path, REGENERATE, "\n".join(shown)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default=default_binary("rubato_server"))
    parser.add_argument("--worker", default=default_binary("rubato_worker"))
    parser.add_argument("--out", default=FLAGS_MD)
    parser.add_argument("--check", action="store_true",
                        help="exit 1, showing the difference, when --out is stale")
    args = parser.parse_args(argv)
    try:
        text = generate(args.server, args.worker)
    except FlagsError as e:
        print("gen_flags: error: %s" % e, file=sys.stderr)
        return 2
    if args.check:
        try:
            with open(args.out) as f:
                current = f.read()
        except OSError:
            current = ""
        message = stale_message(current, text, args.out)
        if message:
            print(message, file=sys.stderr)
            return 1
        print("%s is current" % args.out)
        return 0
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, args.out)
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
