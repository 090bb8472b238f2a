"""Experiment suites (issue 14): declarative files in experiments/suites/ that say which jobs to
run, each a set of `./rubato launch` flags, repeated over seeds.

A suite is YAML:

    name: stragglers                 # required: [a-z0-9-]+, names the output directory
    description: Four workers, ...   # optional
    seeds: 3                         # repeats of every cell (>= 1; --seeds overrides)
    target_accuracy: 0.80            # for time to target (0 < t < 1)
    base:                            # launch flags every run gets
      workers: 4
      min_step_ms: 20
    cells:                           # optional: named cells, each more flags
      - {name: bsp, mode: bsp, slow_workers: "3:4"}
    axes:                            # optional: flags swept as a cartesian product
      slowdown: [1, 2, 4]
      recipe:                        # or named sets of flags, swept together
        - {name: sgd, optimizer: sgd, lr_scaling: linear}
        - {name: lamb, optimizer: lamb, learning_rate: 0.002}
    budget_s: 30                     # optional: the wall-clock budget at which the report
                                     # compares accuracy (default: the fastest cell's median
                                     # wall time)
    timeline: [bsp, async]           # optional: cells whose per-worker timeline is drawn
                                     # (default: the first four)
    simulate: [--hosts=apart]        # optional: a suite only the simulator runs (jobs larger
                                     # than this machine): `./rubato experiment` runs it as with
                                     # --simulate, with these rubato_sim flags first

With both, every cell is crossed with every combination of the axes; with neither, the suite is
the base alone. A cell's flags override the base's, an axis's override both. Flag names are the
launcher's long options without "--" (deploy/launch.py make_parser); --run_dir, --bin_dir and
--seed belong to the runner. Anything wrong is a SuiteError whose message names the file, the line
and the problem.
"""

import itertools
import os
import re
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from deploy import launch  # noqa: E402

SUITES_DIR = os.path.join(HERE, "suites")
# Set by the runner for each run, never by a suite.
RUNNER_FLAGS = ("run_dir", "bin_dir", "seed", "help")
TOP_KEYS = ("name", "description", "seeds", "target_accuracy", "base", "cells", "axes",
            "budget_s", "timeline", "simulate")


class SuiteError(ValueError):
    """A suite file that cannot be run: the message names the file, the line and why."""


def _launch_flags():
    """{flag name: True if it takes no value (a switch)} for every launcher option."""
    flags = {}
    for action in launch.make_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                flags[option[2:]] = action.nargs == 0
    return flags


class Run:
    """One job of a suite: its cell, its seed, and the launch flags (name -> value)."""

    def __init__(self, cell, seed, flags):
        self.cell = cell
        self.seed = seed
        self.flags = flags

    @property
    def name(self):
        return "%s.seed-%d" % (self.cell, self.seed)

    def argv(self):
        """The flags as launcher arguments (switches only when true), --seed last."""
        out = []
        for key, value in self.flags.items():
            if isinstance(value, bool):
                if value:
                    out.append("--" + key)
            else:
                out += ["--" + key, _text(value)]
        out += ["--seed", str(self.seed)]
        if "straggler_seed" not in self.flags:  # Random delays differ from seed to seed too.
            out += ["--straggler_seed", str(self.seed)]
        return out


class Suite:
    def __init__(self, path, name, description, seeds, target_accuracy, cells, budget_s=None,
                 timeline=None, simulate=None):
        self.path = path
        self.name = name
        self.description = description
        self.seeds = seeds
        self.target_accuracy = target_accuracy
        self.cells = cells  # [(cell name, {flag: value})], in file order
        self.budget_s = budget_s  # None: the report picks the fastest cell's median wall time.
        # The cells whose per-worker timelines the report draws.
        self.timeline = timeline if timeline is not None else [c for c, _ in cells[:4]]
        # Not None: the suite runs only in the simulator, with these rubato_sim flags first.
        self.simulate = simulate

    def runs(self, seeds=None, only=None, skip=None):
        """Every run, cell by cell, seeds 1..N (`seeds` overrides the suite's); `only`: a regular
        expression a cell's name must contain a match of; `skip`: one that leaves out the runs
        whose names (CELL.seed-N) contain a match."""
        n = self.seeds if seeds is None else seeds
        pattern = re.compile(only) if only else None
        leave_out = re.compile(skip) if skip else None
        runs = [Run(cell, seed, dict(flags)) for cell, flags in self.cells
                if pattern is None or pattern.search(cell) for seed in range(1, n + 1)]
        return [r for r in runs if leave_out is None or not leave_out.search(r.name)]


def _text(value):
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _where(path, node):
    return "%s:%d" % (path, node.start_mark.line + 1)


def _scalar(path, node, what):
    if not isinstance(node, yaml.ScalarNode):
        raise SuiteError("%s: %s must be a single value" % (_where(path, node), what))
    loader = yaml.SafeLoader("")  # Its constructor turns the node into a value, as safe_load.
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _mapping(path, node, what):
    if not isinstance(node, yaml.MappingNode):
        raise SuiteError("%s: %s must be a mapping (key: value lines)" % (_where(path, node), what))
    seen = {}
    for key_node, value_node in node.value:
        key = _scalar(path, key_node, "a key")
        if not isinstance(key, str):
            raise SuiteError("%s: key %r is not a name" % (_where(path, key_node), key))
        if key in seen:
            raise SuiteError("%s: %s repeats %r (first on line %d)" % (
                _where(path, key_node), what, key, seen[key][0].start_mark.line + 1))
        seen[key] = (key_node, value_node)
    return seen


def _flag(path, flags, key_node, value_node, key, known):
    if key in RUNNER_FLAGS:
        raise SuiteError("%s: --%s is set by the runner, not by a suite" % (
            _where(path, key_node), key))
    if key not in known:
        close = [k for k in known if k.replace("_", "") == key.replace("_", "").replace("-", "")]
        raise SuiteError("%s: %r is not a ./rubato launch flag%s" % (
            _where(path, key_node), key, " (did you mean %r?)" % close[0] if close else ""))
    value = _scalar(path, value_node, "flag %r" % key)
    if known[key] and not isinstance(value, bool):
        raise SuiteError("%s: --%s is a switch: give true or false, not %r" % (
            _where(path, value_node), key, value))
    if not known[key] and (value is None or isinstance(value, bool)):
        raise SuiteError("%s: --%s needs a value, not %r" % (_where(path, value_node), key, value))
    flags[key] = value


def _read(path):
    """(the path, the file's text) of a suite file or a name under experiments/suites/."""
    if not os.path.exists(path) and os.sep not in path:
        candidate = os.path.join(SUITES_DIR, path + ".yaml")
        if os.path.exists(candidate):
            path = candidate
    try:
        with open(path) as f:
            return path, f.read()
    except OSError as e:
        try:
            names = sorted(n[:-5] for n in os.listdir(SUITES_DIR) if n.endswith(".yaml"))
        except OSError:
            names = []
        raise SuiteError("%s: cannot read it (%s); the built-in suites are %s" % (
            path, e.strerror, ", ".join(names) or "missing (no %s)" % SUITES_DIR))


def _top(path, text):
    """The suite's top-level keys: {key: (key node, value node)}, every one of TOP_KEYS."""
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise SuiteError("%s:%s: not YAML: %s" % (
            path, mark.line + 1 if mark else "?", getattr(e, "problem", None) or e))
    if root is None:
        raise SuiteError("%s: empty" % path)
    top = _mapping(path, root, "the suite")
    for key, (key_node, _) in top.items():
        if key not in TOP_KEYS:
            raise SuiteError("%s: unknown key %r (a suite has %s)" % (
                _where(path, key_node), key, ", ".join(TOP_KEYS)))
    return top


def _header(path, top):
    """(name, description, seeds, target accuracy), with their defaults."""
    if "name" not in top:
        raise SuiteError("%s: no name" % path)
    name = _scalar(path, top["name"][1], "name")
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise SuiteError("%s: name %r: lowercase letters, digits and '-' only" % (
            _where(path, top["name"][1]), name))
    description = ""
    if "description" in top:
        description = str(_scalar(path, top["description"][1], "description"))
    seeds = 3
    if "seeds" in top:
        seeds = _scalar(path, top["seeds"][1], "seeds")
        if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
            raise SuiteError("%s: seeds must be a whole number >= 1, not %r" % (
                _where(path, top["seeds"][1]), seeds))
    target = 0.8
    if "target_accuracy" in top:
        target = _scalar(path, top["target_accuracy"][1], "target_accuracy")
        if isinstance(target, bool) or not isinstance(target, (int, float)) \
                or not 0 < target < 1:
            raise SuiteError("%s: target_accuracy must be between 0 and 1, not %r" % (
                _where(path, top["target_accuracy"][1]), target))
    return name, description, seeds, target


def _base(path, top, known):
    """The flags every run gets: {flag: value}."""
    base = {}
    if "base" in top:
        for key, (key_node, value_node) in _mapping(path, top["base"][1], "base").items():
            _flag(path, base, key_node, value_node, key, known)
    return base


def _cells(path, top, known):
    """[(cell name, {flag: value})] in file order; [("", {})] when the suite has none."""
    if "cells" not in top:
        return [("", {})]
    node = top["cells"][1]
    if not isinstance(node, yaml.SequenceNode) or not node.value:
        raise SuiteError("%s: cells must be a non-empty list" % _where(path, node))
    cells, names = [], {}
    for cell_node in node.value:
        entries = _mapping(path, cell_node, "a cell")
        if "name" not in entries:
            raise SuiteError("%s: a cell without a name" % _where(path, cell_node))
        cell_name = _scalar(path, entries["name"][1], "a cell's name")
        if not isinstance(cell_name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9.:=-]*",
                                                              cell_name):
            raise SuiteError("%s: cell name %r: lowercase letters, digits and . : = - only"
                             % (_where(path, entries["name"][1]), cell_name))
        if cell_name in names:
            raise SuiteError("%s: cell %r again (first on line %d)" % (
                _where(path, cell_node), cell_name, names[cell_name]))
        names[cell_name] = cell_node.start_mark.line + 1
        flags = {}
        for key, (key_node, value_node) in entries.items():
            if key != "name":
                _flag(path, flags, key_node, value_node, key, known)
        cells.append((cell_name, flags))
    return cells


def _named_value(path, key, item, known):
    """(name, {flag: value}) of a named set of flags on axis `key`:
    {name: sgd-linear, optimizer: sgd, lr_scaling: linear}."""
    entries = _mapping(path, item, "a value of axis %r" % key)
    if "name" not in entries:
        raise SuiteError("%s: a value of axis %r without a name" % (_where(path, item), key))
    label = _scalar(path, entries["name"][1], "a value's name")
    if not isinstance(label, str) or not re.fullmatch(r"[a-z0-9][a-z0-9.:=-]*", label):
        raise SuiteError("%s: value name %r: lowercase letters, digits and "
                         ". : = - only" % (_where(path, entries["name"][1]), label))
    one = {}
    for flag, (flag_node, flag_value) in entries.items():
        if flag != "name":
            _flag(path, one, flag_node, flag_value, flag, known)
    return label, one


def _axis(path, key, key_node, value_node, known):
    """Axis `key`'s values: [(the value's name in cell names, {flag: value})]."""
    if not isinstance(value_node, yaml.SequenceNode) or not value_node.value:
        raise SuiteError("%s: axis %r must be a non-empty list of values" % (
            _where(path, value_node), key))
    named = isinstance(value_node.value[0], yaml.MappingNode)
    if named and not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", key):
        raise SuiteError("%s: axis name %r: lowercase letters, digits, _ and - only" % (
            _where(path, key_node), key))
    values, names = [], {}
    for item in value_node.value:
        if named != isinstance(item, yaml.MappingNode):
            raise SuiteError("%s: axis %r mixes single values and named flag sets" % (
                _where(path, item), key))
        if named:
            label, one = _named_value(path, key, item, known)
        else:
            one = {}
            _flag(path, one, key_node, item, key, known)
            label = _text(one[key])
        if label in names:
            raise SuiteError("%s: axis %r repeats %r (first on line %d)" % (
                _where(path, item), key, label, names[label]))
        names[label] = item.start_mark.line + 1
        values.append((label, one))
    return values


def _axes(path, top, known):
    """Each axis: (its name, [(the value's name in cell names, {flag: value})])."""
    if "axes" not in top:
        return []
    return [(key, _axis(path, key, key_node, value_node, known))
            for key, (key_node, value_node) in _mapping(path, top["axes"][1], "axes").items()]


def _expand(base, cells, axes):
    """Every cell crossed with every combination of the axes: [(name, {flag: value})], a cell's
    flags over the base's and an axis's over both."""
    expanded = []
    for cell_name, cell_flags in cells:
        for combination in itertools.product(*[values for _, values in axes]):
            flags = dict(base)
            flags.update(cell_flags)
            parts = [cell_name] if cell_name else []
            for (key, _), (label, value_flags) in zip(axes, combination):
                flags.update(value_flags)
                parts.append("%s=%s" % (key, label))
            expanded.append((",".join(parts) or "base", flags))
    return expanded


def _budget(path, top):
    """budget_s, or None."""
    if "budget_s" not in top:
        return None
    budget = _scalar(path, top["budget_s"][1], "budget_s")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise SuiteError("%s: budget_s must be a number of seconds > 0, not %r" % (
            _where(path, top["budget_s"][1]), budget))
    return budget


def _simulate(path, top):
    """The simulated-only suite's rubato_sim flags (a list of "--name=value"), or None."""
    if "simulate" not in top:
        return None
    node = top["simulate"][1]
    if not isinstance(node, yaml.SequenceNode):
        raise SuiteError("%s: simulate must be a list of rubato_sim flags (--name=value)"
                         % _where(path, node))
    flags = []
    for item in node.value:
        flag = _text(_scalar(path, item, "a simulate flag"))
        if not re.fullmatch(r"--[a-z][a-z0-9_]*=\S+", flag):
            raise SuiteError("%s: simulate: %r is not a flag of the form --name=value"
                             % (_where(path, item), flag))
        flags.append(flag)
    return flags


def _timeline(path, top, expanded):
    """The timeline's cells, each one of `expanded`, or None."""
    if "timeline" not in top:
        return None
    node = top["timeline"][1]
    if not isinstance(node, yaml.SequenceNode):
        raise SuiteError("%s: timeline must be a list of cell names" % _where(path, node))
    names = [c for c, _ in expanded]
    timeline = []
    for item in node.value:
        cell = _scalar(path, item, "a timeline cell")
        if cell not in names:
            raise SuiteError("%s: timeline: no cell %r (cells: %s)" % (
                _where(path, item), cell, ", ".join(names)))
        timeline.append(cell)
    return timeline


def load(path):
    """The suite in `path` (a file, or a name under experiments/suites/). SuiteError if it is
    missing, not YAML, or wrong in any way."""
    path, text = _read(path)
    top = _top(path, text)
    name, description, seeds, target = _header(path, top)
    known = _launch_flags()
    base = _base(path, top, known)
    cells = _cells(path, top, known)
    expanded = _expand(base, cells, _axes(path, top, known))
    return Suite(path, name, description, seeds, target, expanded, _budget(path, top),
                 _timeline(path, top, expanded), _simulate(path, top))
