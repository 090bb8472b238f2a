#!/usr/bin/env python3
"""Tests of deploy/launcher/live.py: reading the workers' progress in chunks, the table, the screen.

    python3 deploy/launcher/live_test.py    (or: bazel test //deploy:launcher_live_test)
"""

import io
import json
import os
import random
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import live  # noqa: E402
from bazel import pyunit  # noqa: E402


def line_by_line(data):
    """The launcher's earlier reading, a parse and a flush per line: (jsonl text, start, step, eval,
    done, [(accuracy, step, epochs)] of evals, batch records, whether a start record came)."""
    out, state = [], {"start": {}, "step": {}, "eval": {}, "done": {}}
    evals, batches, started = [], [], False
    for raw in io.BytesIO(data):
        line = raw.decode("utf-8", "replace").strip()
        if not line:
            continue
        out.append(line + "\n")
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):  # (The earlier reader's thread ended here.)
            continue
        event = record.get("event")
        if event in ("start", "step", "eval", "done"):
            state[event] = record
        if event == "start":
            started = True
        if event == "eval" and "test_accuracy" in record:
            evals.append((record["test_accuracy"], record.get("step"), record.get("epochs")))
        elif event == "done" and "test_accuracy" in record and not evals:
            evals.append((record["test_accuracy"], record.get("steps"), None))
        elif event == "batch":
            batches.append(record)
    return ("".join(out), state["start"], state["step"], state["eval"], state["done"], evals,
            batches, started)


def progress(steps=400):
    """A worker's stdout as rubato_worker writes it, with the odd line that is not a record."""
    lines = [b'{"event":"start","worker":0,"steps":%d,"batch_size":8}' % steps,
             b"not json", b"", b"   ", b"caf\xc3\xa9 \xff", b"[1, 2]"]
    for step in range(1, steps + 1):
        lines.append(b'{"event":"noise","worker":0,"step":%d,"b_small":8,"b_big":16}' % step)
        if step % 20 == 0:
            lines.append(b'{"event":"step","worker":0,"step":%d,"epoch":0,"t":%d.5,'
                         b'"loss":%.5f,"steps_per_s":100.00}' % (step, step, 1.0 / step))
            lines.append(b'{"event":"overlap","worker":0,"step":%d,"pushes":[]}' % step)
        if step % 100 == 0:
            lines.append(b'{"event":"eval","worker":0,"step":%d,"t":1.0,"test_accuracy":%.4f,'
                         b'"epochs":%.3f}' % (step, step / 1000.0, step / 300.0))
        if step == 150:
            lines.append(b'{"event":"batch","worker":0,"step":150,"batch_size":16,"steps":300}')
            lines.append(b'  {"event": "step", "step": 150, "loss": 9.0}  ')  # Spelled otherwise.
    lines.append(b'{"event":"step","step":%d,"loss":' % steps)  # Cut short: not a record.
    lines.append(b'{"event":"done","worker":0,"steps":%d,"test_accuracy":0.4}' % steps)
    return b"\n".join(lines)  # The last line without its newline.


class FeedTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def feed(self, data, chunks):
        """Feeds `data` through a pipe, written in `chunks` pieces; returns (view, jsonl text)."""
        path = os.path.join(self.tmp.name, "worker-0.jsonl")
        view = live.WorkerView(0, path)
        r, w = os.pipe()
        cuts = sorted(random.Random(chunks).sample(range(1, len(data)), chunks - 1))

        def write():
            for a, b in zip([0] + cuts, cuts + [len(data)]):
                os.write(w, data[a:b])
                time.sleep(0.001)
            os.close(w)

        writer = threading.Thread(target=write)
        writer.start()
        with os.fdopen(r, "rb") as stream:
            view.feed(stream, time.monotonic())
        writer.join()
        view.jsonl.close()
        with open(path) as f:
            return view, f.read()

    def test_same_file_and_records_as_line_by_line(self):
        data = progress()
        want = line_by_line(data)
        for chunks in (1, 2, 7, 50, 400):
            view, jsonl = self.feed(data, chunks)
            got = (jsonl, view.start, view.step, view.eval, view.done,
                   [(acc, s, e) for (_, acc), s, e in zip(view.evals, view.eval_steps,
                                                          view.eval_epochs)],
                   view.batch_changes, view.started_at is not None)
            self.assertEqual(got, want, chunks)
        self.assertEqual(view.step["step"], 400)  # The cut-short one does not count.
        self.assertEqual(len(view.evals), 4)
        self.assertIn("caf\u00e9 \ufffd\n", jsonl)

    def test_done_stands_for_an_eval_when_none_came(self):
        data = (b'{"event":"start","steps":2}\n{"event":"done","steps":2,"test_accuracy":0.7}\n')
        view, _ = self.feed(data, 2)
        self.assertEqual(([a for _, a in view.evals], view.eval_steps, view.eval_epochs),
                         ([0.7], [2], [None]))
        self.assertEqual(line_by_line(data)[5], [(0.7, 2, None)])

    def test_newest_step_is_parsed_when_read(self):
        view = live.WorkerView(0, os.path.join(self.tmp.name, "w.jsonl"))
        view.take([b'{"event":"step","step":20}', b'{"event":"step","step":40}'], 0.0)
        self.assertEqual(len(view._new_steps), 2)  # Not parsed yet.
        self.assertEqual(view.step, {"event": "step", "step": 40})
        self.assertEqual(view._new_steps, [])
        view.take([b'{"event":"step","step":60}', b'{"event":"step","step":'], 0.0)
        self.assertEqual(view.snapshot()[0], {"event": "step", "step": 60})
        view.take([b'{"event":"step","step":'], 0.0)  # Nothing valid since: the newest stands.
        self.assertEqual(view.step["step"], 60)

    def test_record_kind(self):
        self.assertEqual(live.record_kind('{"event":"noise","step":1}'), "noise")
        self.assertEqual(live.record_kind('{ "event" : "step"}'), "step")
        self.assertIsNone(live.record_kind('{"step":1,"event":"step"}'))
        self.assertIsNone(live.record_kind("I worker-0: connected"))

    def test_read_lines(self):
        r, w = os.pipe()
        os.write(w, b"a\nb")
        os.close(w)
        with os.fdopen(r, "rb") as stream:
            self.assertEqual(list(live.read_lines(stream, size=2)),
                             [[b"a"], [b"b"]])
        r, w = os.pipe()
        os.write(w, b"ab\ncd\n\nef\n")
        os.close(w)
        with os.fdopen(r, "rb") as stream:
            self.assertEqual(list(live.read_lines(stream)), [[b"ab", b"cd", b"", b"ef"]])


class TableTest(unittest.TestCase):

    def test_render(self):
        with tempfile.TemporaryDirectory() as d:
            views = [live.WorkerView(i, os.path.join(d, "w%d" % i)) for i in range(2)]
            views[0].take([b'{"event":"start","steps":100}',
                           b'{"event":"step","step":20,"epoch":0,"loss":0.5,"steps_per_s":12.34,'
                           b'"comm_ms":1.5,"delay_ms":2,"staleness":0.25}',
                           b'{"event":"eval","test_accuracy":0.75}'], 0.0)
            rows = live.render(views, ["running", "done"], None)
            self.assertEqual(rows[0].split(), ["worker", "state", "step", "epoch", "loss",
                                               "test_acc", "steps/s", "comm_ms", "delay_ms",
                                               "stale"])
            self.assertEqual(rows[1].split(), ["0", "running", "20/100", "0", "0.5000", "0.7500",
                                               "12.3", "1.50", "2.0", "0.2"])
            self.assertEqual(rows[2].split(), ["1", "done", "0/0", "-", "-", "-", "-", "-", "-",
                                               "-"])
            # Adaptive batch: the plan's step count; and a host column across hosts.
            views[1].take([b'{"event":"batch","step":50,"batch_size":16,"steps":60}'], 0.0)
            rows = live.render(views, ["running", "running"], None, ["ha", "hb"])
            self.assertEqual(rows[0].split()[:3], ["worker", "host", "state"])
            self.assertEqual(rows[1].split()[:4], ["0", "ha", "running", "20/60"])
            # A figure that is not finite is a string in the record (proto/progress.proto).
            views[1].take([b'{"event":"step","step":30,"loss":"NaN","steps_per_s":"Infinity"}'],
                          0.0)
            rows = live.render(views, ["running", "running"], None)
            self.assertEqual(rows[2].split()[3:7], ["-", "nan", "-", "inf"])


class ScreenTest(unittest.TestCase):

    def test_plain_output_every_5_s(self):
        out = io.StringIO()
        screen = live.Screen(False, out)
        screen.table(["a", "b"])
        screen.table(["c"])  # Too soon.
        screen.note("note")
        screen.table(["d"], force=True)
        self.assertEqual(out.getvalue(), "a\nb\nnote\nd\n")

    def test_terminal_redraws_in_place(self):
        out = io.StringIO()
        screen = live.Screen(True, out)
        screen.table(["a", "b"])
        screen.table(["c", "d"])
        screen.note("note")
        self.assertEqual(out.getvalue(),
                         "\x1b[2Ka\n\x1b[2Kb\n" "\x1b[2F\x1b[2Kc\n\x1b[2Kd\n"
                         "\x1b[2F\x1b[Jnote\n\x1b[2Kc\n\x1b[2Kd\n")

    def test_job_log(self):
        with tempfile.TemporaryDirectory() as d:
            out = io.StringIO()
            log = live.JobLog(os.path.join(d, "job.log"), live.Screen(False, out))
            log.line("worker-1", "hosta", "I connected")
            with open(os.path.join(d, "job.log")) as f:
                self.assertEqual(f.read(), "[worker-1@hosta] I connected\n")
            self.assertEqual(out.getvalue(), "[worker-1@hosta] I connected\n")


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/live_test"))
