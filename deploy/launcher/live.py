"""The live view: what the launcher knows of each worker from its JSON-lines progress (WorkerView),
the worker table (render), stdout (Screen: the table redrawn in place on a terminal) and job.log.

A worker's progress is read in chunks, whatever its pipe holds, not a line at a time: each chunk is
appended to worker-N.jsonl with one write and one flush, and only the records that the table or the
summary read are parsed. Of the step records, which come every --log_every steps, only the newest
matters and it is parsed when the table is drawn (at most once a --refresh), not as it arrives; the
other kinds that the launcher does not read (noise, overlap, rejoin, ...) are only copied."""

import json
import os
import re
import sys
import threading
import time

# The record kinds that the live view and the summary read, parsed as they arrive.
KEPT_KINDS = ("start", "eval", "done", "batch")
# A record's kind, as rubato_worker writes it ({"event":"step",...}); a line that does not start so
# is parsed to find out.
_KIND = re.compile(r'^\{\s*"event"\s*:\s*"([A-Za-z_]+)"')
# Bytes asked of a worker's stdout at a time.
READ_SIZE = 1 << 16


def record_kind(line):
    """The event kind of a progress line from its first bytes, or None when they do not say."""
    match = _KIND.match(line)
    return match.group(1) if match else None


def parse_record(line):
    """The JSON object on a progress line, or None when the line holds something else."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def read_lines(stream, size=READ_SIZE):
    """Yields, for each chunk read from `stream` (a pipe or file, read by its descriptor), the list
    of the complete lines in it (bytes, without their newlines); the last line, if it has no
    newline, comes at end of file."""
    fd = stream.fileno()
    tail = b""
    while True:
        chunk = os.read(fd, size)
        if not chunk:
            break
        lines = (tail + chunk).split(b"\n")
        tail = lines.pop()
        if lines:
            yield lines
    if tail:
        yield [tail]


class WorkerView:
    """What the live view knows of one worker, fed by its JSON-lines progress."""

    def __init__(self, index, jsonl_path):
        """`jsonl_path`: where the records are copied (None: nowhere, for records read from a
        file already, as experiments/simulate.py does)."""
        self.index = index
        self.jsonl = open(jsonl_path, "w") if jsonl_path is not None else None
        self.lock = threading.Lock()
        self.start = {}
        self._step = {}
        self._new_steps = []  # Step lines not parsed yet, oldest first (see step).
        self.eval = {}
        self.done = {}
        self.evals = []  # (seconds since launch, test accuracy) of every evaluation.
        self.eval_steps = []  # The step of each of self.evals.
        self.eval_epochs = []  # The epochs drawn by each of self.evals (None: not reported).
        self.batch_changes = []  # Adaptive batch: worker 0's "batch" records, in step order.
        self.started_at = None  # Seconds since launch when the worker's start record came.

    def feed(self, stream, began):
        """Reads the worker's stdout to its end; `began`: time.monotonic() at the launch."""
        for lines in read_lines(stream):
            self.take(lines, began)

    def take(self, raw_lines, began, now=None):
        """One chunk's complete lines (bytes): copied to worker-N.jsonl, and the records read, as
        arriving `now` seconds after the launch (default: time.monotonic() - `began`)."""
        lines = [l for l in (raw.decode("utf-8", "replace").strip() for raw in raw_lines) if l]
        if not lines:
            return
        if self.jsonl is not None:
            self.jsonl.write("".join(line + "\n" for line in lines))
            self.jsonl.flush()
        if now is None:
            now = time.monotonic() - began
        steps, records = [], []
        for line in lines:
            kind = record_kind(line)
            if kind == "step":
                steps.append(line)
            elif kind is None or kind in KEPT_KINDS:
                record = parse_record(line)
                if record is None:
                    continue
                if record.get("event") == "step":  # Written some other way.
                    steps.append(line)
                else:
                    records.append(record)
        with self.lock:
            self._new_steps += steps
            for record in records:
                self._add(record, now)

    def _add(self, record, now):
        """One parsed record, other than a step record; `now`: seconds since the launch."""
        event = record.get("event")
        if event in ("start", "eval", "done"):
            setattr(self, event, record)
        if event == "start" and self.started_at is None:
            self.started_at = now
        # A done record repeats its final eval's accuracy; count that evaluation once.
        if event == "eval" and "test_accuracy" in record:
            self.evals.append((now, record["test_accuracy"]))
            self.eval_steps.append(record.get("step"))
            self.eval_epochs.append(record.get("epochs"))
        elif event == "done" and "test_accuracy" in record and not self.evals:
            self.evals.append((now, record["test_accuracy"]))
            self.eval_steps.append(record.get("steps"))
            self.eval_epochs.append(None)
        elif event == "batch":
            self.batch_changes.append(record)

    def _newest_step(self):
        """The newest step record; parses the newest step line that came since the last call
        (the caller holds self.lock)."""
        while self._new_steps:
            record = parse_record(self._new_steps.pop())
            if record is not None and record.get("event") == "step":
                self._step = record
                break
        self._new_steps.clear()
        return self._step

    @property
    def step(self):
        with self.lock:
            return self._newest_step()

    def snapshot(self):
        """Copies of the newest step, eval and start records, for the table."""
        with self.lock:
            return dict(self._newest_step()), dict(self.eval), dict(self.start)

    def batch_records(self):
        with self.lock:
            return list(self.batch_changes)


def _figure(record, key, fmt):
    """record[key] in `fmt`, or "-" without it. A figure that is not finite comes as a string
    ("NaN", "Infinity": proto/progress.proto) and shows as nan or inf."""
    try:
        return fmt % float(record[key])
    except (KeyError, TypeError, ValueError):
        return "-"


def render(views, states, total_steps, hosts=None):
    """The live table: one row per worker; with `hosts` (several hosts), a host column."""
    fmt = "%-8s " + ("%-12s " if hosts else "%s") + "%-8s %13s %6s %8s %9s %9s %9s %9s %6s"
    rows = [fmt % ("worker", "host" if hosts else "", "state", "step", "epoch", "loss",
                   "test_acc", "steps/s", "comm_ms", "delay_ms", "stale")]
    # Adaptive batch: the job's steps follow the plan; worker 0's newest batch record says how many.
    changes = []
    for v in views:
        changes += v.batch_records()
    planned = max(changes, key=lambda c: c.get("step", 0)).get("steps") if changes else None
    for i, (v, state) in enumerate(zip(views, states)):
        step, ev, start = v.snapshot()
        total = planned or start.get("steps", total_steps or 0)
        rows.append(fmt % (
            v.index, hosts[i] if hosts else "", state,
            "%d/%d" % (step.get("step", 0), total),
            step.get("epoch", "-"),
            _figure(step, "loss", "%.4f"),
            _figure(ev, "test_accuracy", "%.4f"),
            _figure(step, "steps_per_s", "%.1f"),
            _figure(step, "comm_ms", "%.2f"),
            _figure(step, "delay_ms", "%.1f"),
            _figure(step, "staleness", "%.1f")))
    return rows


class Screen:
    """Stdout: on a terminal the worker table is redrawn in place, elsewhere printed every 5 s;
    notes (the launcher's, and remote processes' stderr lines) go above the table."""

    def __init__(self, tty, out=None):
        self.tty = tty
        self.out = out  # None: sys.stdout at each write.
        self.drawn = 0  # Lines of the table now on the terminal.
        self.last_plain = 0.0
        self.rows = []  # The table last drawn, redrawn below the notes on a terminal.
        self.lock = threading.Lock()  # Notes come from reader threads too.

    def _write(self, text):
        out = self.out or sys.stdout
        out.write(text)
        out.flush()

    def table(self, rows, force=False):
        with self.lock:
            now = time.monotonic()
            self.rows = rows
            if self.tty:
                self._write(("\x1b[%dF" % self.drawn if self.drawn else "") +
                            "".join("\x1b[2K" + r + "\n" for r in rows))
                self.drawn = len(rows)
            elif force or now - self.last_plain >= 5:
                self.last_plain = now
                self._write("\n".join(rows) + "\n")

    def note(self, text):
        with self.lock:
            if self.tty and self.drawn:
                # Clear the table, print the note where it was, and draw the table again below.
                self._write("\x1b[%dF\x1b[J" % self.drawn + text + "\n" +
                            "".join("\x1b[2K" + r + "\n" for r in self.rows))
                self.drawn = len(self.rows)
            else:
                self._write(text + "\n")


class JobLog:
    """<run_dir>/job.log: every remote process's stderr, each line prefixed `[NAME@HOST] `, also
    echoed above the live table."""

    def __init__(self, path, screen):
        self.file = open(path, "w")
        self.screen = screen
        self.lock = threading.Lock()

    def line(self, name, host, text):
        text = "[%s@%s] %s" % (name, host, text)
        with self.lock:
            self.file.write(text + "\n")
            self.file.flush()
        self.screen.note(text)
