#!/usr/bin/env python3
"""Launches a Rubato job, as local processes on 127.0.0.1 or across hosts, and shows its progress.

    deploy/launch.py --bin_dir bazel-bin --servers 1 --workers 2 --epochs 3
    deploy/launch.py --hostfile hosts --servers 2 --workers 8 --epochs 3        (several hosts)

The entry point of `./rubato launch` and `./rubato demo`; the launcher itself is the package
deploy/launcher/ (one module per concern, listed in its __init__.py), and `--help` is its manual.
"""

import os
import sys

if __package__:  # Imported as deploy.launch (experiments/suite.py reads make_parser).
    from .launcher.flags import make_parser, parse_args  # noqa: F401
    from .launcher.main import main
else:  # Run as a script, or imported as `launch` with deploy/ on sys.path.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    from launcher.flags import make_parser, parse_args  # noqa: F401,E402
    from launcher.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
