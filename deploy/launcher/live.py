"""The live view: what the launcher knows of each worker from its JSON-lines progress (WorkerView),
the worker table (render), stdout (Screen: the table redrawn in place on a terminal) and job.log."""

import json
import sys
import threading
import time

class WorkerView:
    """What the live view knows of one worker, fed by its JSON-lines progress."""

    def __init__(self, index, jsonl_path):
        self.index = index
        self.jsonl = open(jsonl_path, "w")
        self.lock = threading.Lock()
        self.start = {}
        self.step = {}
        self.eval = {}
        self.done = {}
        self.evals = []  # (seconds since launch, test accuracy) of every evaluation.
        self.eval_steps = []  # The step of each of self.evals.
        self.eval_epochs = []  # The epochs drawn by each of self.evals (None: not reported).
        self.batch_changes = []  # Adaptive batch: worker 0's "batch" records, in step order.
        self.started_at = None  # Seconds since launch when the worker's start record came.

    def feed(self, stream, began):
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            self.jsonl.write(line + "\n")
            self.jsonl.flush()
            try:
                record = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                event = record.get("event")
                if event in ("start", "step", "eval", "done"):
                    setattr(self, event, record)
                if event == "start" and self.started_at is None:
                    self.started_at = time.monotonic() - began
                # A done record repeats its final eval's accuracy; count that evaluation once.
                if event == "eval" and "test_accuracy" in record:
                    self.evals.append((time.monotonic() - began, record["test_accuracy"]))
                    self.eval_steps.append(record.get("step"))
                    self.eval_epochs.append(record.get("epochs"))
                elif event == "done" and "test_accuracy" in record and not self.evals:
                    self.evals.append((time.monotonic() - began, record["test_accuracy"]))
                    self.eval_steps.append(record.get("steps"))
                    self.eval_epochs.append(None)
                elif event == "batch":
                    self.batch_changes.append(record)


def render(views, states, total_steps, hosts=None):
    """The live table: one row per worker; with `hosts` (several hosts), a host column."""
    fmt = "%-8s " + ("%-12s " if hosts else "%s") + "%-8s %13s %6s %8s %9s %9s %9s %9s %6s"
    rows = [fmt % ("worker", "host" if hosts else "", "state", "step", "epoch", "loss",
                   "test_acc", "steps/s", "comm_ms", "delay_ms", "stale")]
    # Adaptive batch: the job's steps follow the plan; worker 0's newest batch record says how many.
    changes = []
    for v in views:
        with v.lock:
            changes += v.batch_changes
    planned = max(changes, key=lambda c: c.get("step", 0)).get("steps") if changes else None
    for i, (v, state) in enumerate(zip(views, states)):
        with v.lock:
            step, ev, start = dict(v.step), dict(v.eval), dict(v.start)
        total = planned or start.get("steps", total_steps or 0)
        acc = ev.get("test_accuracy")
        rows.append(fmt % (
            v.index, hosts[i] if hosts else "", state,
            "%d/%d" % (step.get("step", 0), total),
            step.get("epoch", "-"),
            "%.4f" % step["loss"] if "loss" in step else "-",
            "%.4f" % acc if acc is not None else "-",
            "%.1f" % step["steps_per_s"] if "steps_per_s" in step else "-",
            "%.2f" % step["comm_ms"] if "comm_ms" in step else "-",
            "%.1f" % step["delay_ms"] if "delay_ms" in step else "-",
            "%.1f" % step["staleness"] if "staleness" in step else "-"))
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
