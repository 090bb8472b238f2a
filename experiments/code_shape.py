#!/usr/bin/env python3
"""Prints the figures of issue 30's structure targets: the longest files of server/, worker/ and
deploy/ (target: none over 800 lines) and the longest functions outside tests (target: none over
80 lines). Functions are found by their shape: C++ definitions that open at column 0 and close
with a `}` at column 0, Python `def`s by indentation. A measure, not a test.

    python3 experiments/code_shape.py [--top N]
"""

import argparse
import os
import re
import subprocess



def tracked(root):
    out = subprocess.run(["git", "ls-files"], cwd=root, stdout=subprocess.PIPE, text=True,
                         check=True).stdout
    return [f for f in out.split("\n") if f]


def is_test(path):
    base = os.path.basename(path)
    return "_test." in base or base.startswith("test_") or path.startswith(("tests/", "fuzz/"))


STRIP = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|//.*$')


def cpp_functions(lines):
    """(first line of the signature, its line number, lines to the closing brace) of each block
    opened at namespace level that is not a class, struct, enum or namespace."""
    depth = 0
    start = None
    signature = None
    for i, raw in enumerate(lines):
        line = STRIP.sub("", raw)
        if depth == 0 and signature is None and line.strip() and not line.startswith(
                (" ", "#", "}", "namespace", "template")):
            signature = i
        for ch in line:
            if ch == "{":
                if depth == 0 and line.lstrip().startswith("namespace"):
                    continue
                if depth == 0 and signature is not None and not lines[signature].startswith(
                        ("class ", "struct ", "enum ", "union ", "extern ", "const", "constexpr",
                         "static const", "ABSL_FLAG")):
                    start = signature
                depth += 1
            elif ch == "}":
                if depth == 0:
                    continue  # A namespace's close.
                depth -= 1
                if depth == 0:
                    if start is not None:
                        yield lines[start].strip()[:70], start + 1, i - start + 1
                    start = None
                    signature = None
        if depth == 0 and line.rstrip().endswith(";"):
            signature = None


def py_functions(lines):
    stack = []
    for i, line in enumerate(lines + ["END"]):
        stripped = line.lstrip()
        if not stripped or stripped.startswith("#"):
            continue
        indent = len(line) - len(stripped)
        while stack and indent <= stack[-1][0]:
            d, name, begin, last = stack.pop()
            yield name, begin + 1, last - begin + 1
        if stripped.startswith("def "):
            stack.append([indent, stripped[4:].split("(")[0], i, i])
        for entry in stack:
            entry[3] = i


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args()
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], stdout=subprocess.PIPE,
                          text=True, check=True).stdout.strip()
    files, functions = [], []
    for path in tracked(root):
        if not path.endswith((".h", ".cc", ".py", ".cu")):
            continue
        with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        if path.startswith(("server/", "worker/", "deploy/")) and not is_test(path):
            files.append((len(lines), path))
        if is_test(path) or path.startswith(("third_party/", "deploy/k8s/validate/")):
            continue
        finder = py_functions if path.endswith(".py") else cpp_functions
        for name, line, length in finder(lines):
            functions.append((length, "%s:%d" % (path, line), name))
    files.sort(reverse=True)
    functions.sort(reverse=True)
    print("files of server/, worker/, deploy/ over 800 lines: %d" % sum(n > 800 for n, _ in files))
    for n, path in files[:args.top]:
        print("  %5d  %s" % (n, path))
    print("functions outside tests over 80 lines: %d" % sum(n > 80 for n, _, _ in functions))
    for n, where, name in functions[:args.top]:
        print("  %5d  %-45s %s" % (n, where, name))


if __name__ == "__main__":
    main()
