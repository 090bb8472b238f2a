#!/usr/bin/env python3
"""The CPU backend's training step in the baseline x86-64 build and in the AVX2+FMA build
(bazel/isa.bzl), run in turn on this machine, and the AVX2 build's speed-up.

    bazel run //worker/model:isa_benchmark -- --model=cnn --batch=64 [--rounds 3]

Each round runs model_benchmark once in each build (RUBATO_CPU_ISA=baseline keeps the baseline;
without it the baseline binary execs its AVX2 build), one thread, and reads its step time (the
median of its --reps steps). The machine is shared: the builds alternate, and each figure is the
best of the rounds. Other flags go to model_benchmark."""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
STEP = re.compile(r"^backend (.+): step ([0-9.]+) ms")


def find_benchmark():
    for candidate in (os.path.join(HERE, "model_benchmark"),
                      os.path.join(os.environ.get("RUNFILES_DIR", ""), "rubato", "worker",
                                   "model", "model_benchmark")):
        if os.access(candidate, os.X_OK):
            return candidate
    sys.exit("isa_benchmark: error: no model_benchmark beside %s (bazel run it)" % HERE)


def step(binary, isa, flags):
    env = dict(os.environ, RUBATO_CPU_ISA=isa)
    out = subprocess.run([binary, "--backends=cpu"] + flags, env=env, capture_output=True,
                         text=True, timeout=600)
    for line in out.stdout.splitlines():
        m = STEP.match(line)
        if m:
            return m.group(1), float(m.group(2))
    sys.exit("isa_benchmark: error: model_benchmark (RUBATO_CPU_ISA=%s) printed no step time:"
             "\n%s%s" % (isa, out.stdout[-2000:], out.stderr[-2000:]))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args, flags = p.parse_known_args(argv)
    binary = find_benchmark()
    best = {}
    for r in range(args.rounds):
        for isa in ("baseline", "auto"):
            name, ms = step(binary, isa, flags)
            print("round %d: %-22s %8.2f ms" % (r + 1, name, ms), flush=True)
            if isa not in best or ms < best[isa][1]:
                best[isa] = (name, ms)
    (base_name, base), (fast_name, fast) = best["baseline"], best["auto"]
    print("\nbest of %d: %s %.2f ms, %s %.2f ms: %.2fx" % (args.rounds, base_name, base,
                                                         fast_name, fast, base / fast))
    if fast_name == base_name:
        print("(the AVX2 build did not run: this processor lacks AVX2 or FMA, or it is missing)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
