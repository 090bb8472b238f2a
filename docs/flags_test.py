"""docs/flags.md is what docs/gen_flags.py makes of the binaries' --helpfull: the test fails when
the flags changed and the reference was not regenerated, naming the command that regenerates it.
The reader of --helpfull is checked on a sample too.

    bazel test //docs:flags_test
    RUBATO_SERVER_BIN=... RUBATO_WORKER_BIN=... python3 docs/flags_test.py   # by hand
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import gen_flags  # noqa: E402
from bazel import pyunit  # noqa: E402

SAMPLE = """\
rubato_x: One Rubato thing. See the docs.

  Flags from ./absl/flags/parse.cc:
    --flagfile (comma-separated list of files to load flags from); default: ;
    --undefok (comma-separated list of flag names that it is okay to specify on
      the command line even if the program does not define a flag with that
      name); default: ;


  Flags from common/cluster_flags.cc:
    --mode (Consistency model: bsp (default), async, backup:B, ssp:S.);
      default: ;
    --lease_ms (Worker lease in ms (default 10000): once training has started, a
      worker silent for longer is dropped; a|b.); default: ;

  Flags from worker/worker_main.cc:
    --backend (Compute backend: cpu (Eigen), or auto (cuda when
      usable, else cpu).); default: "auto";
    --seed (Seed.); default: 1; currently: 7;

Try --helpfull to get a list of all flags or --help=substring shows help for
flags which include specified substring in either in the name, or description or
path.
"""


class ParseTest(unittest.TestCase):

    def test_reads_rubato_flags_and_skips_abseils(self):
        self.assertEqual(gen_flags.parse(SAMPLE), {
            "common/cluster_flags.cc": [
                ("lease_ms", "", "Worker lease in ms (default 10000): once training has started, "
                 "a worker silent for longer is dropped; a|b."),
                ("mode", "", "Consistency model: bsp (default), async, backup:B, ssp:S."),
            ],
            "worker/worker_main.cc": [
                ("backend", '"auto"',
                 "Compute backend: cpu (Eigen), or auto (cuda when usable, else cpu)."),
                ("seed", "1", "Seed."),
            ],
        })

    def test_third_party_files(self):
        for path in ("./absl/flags/parse.cc", "absl/log/flags.cc", "/usr/src/x.cc",
                     "external/com_github_grpc/src/core/x.cc"):
            self.assertFalse(gen_flags.is_rubato_file(path), path)
        for path in ("common/cluster_flags.cc", "worker/ps/client_flags.cc", "./server/main.cc"):
            self.assertTrue(gen_flags.is_rubato_file(path), path)

    def test_an_unreadable_entry_is_an_error(self):
        with self.assertRaises(gen_flags.FlagsError):
            gen_flags.parse("  Flags from server/server_main.cc:\n    --port no help\n")

    def test_shared_files_are_listed_once_and_pipes_escaped(self):
        parsed = gen_flags.parse(SAMPLE)
        own = {"worker/worker_main.cc": parsed.pop("worker/worker_main.cc")}
        text = gen_flags.render({"rubato_server": dict(parsed),
                                 "rubato_worker": dict(parsed, **own)})
        self.assertEqual(text.count("### common/cluster_flags.cc"), 1)
        self.assertLess(text.index("## Both binaries"), text.index("## rubato_worker"))
        self.assertNotIn("## rubato_server", text)
        self.assertIn("dropped; a\\|b. |", text)
        self.assertIn('| `--backend` | `"auto"` |', text)
        self.assertIn("| `--mode` |  |", text)

    def test_the_stale_message_names_the_command(self):
        self.assertIsNone(gen_flags.stale_message("same\n", "same\n"))
        message = gen_flags.stale_message("old\n", "new\n")
        self.assertIn(gen_flags.REGENERATE, message)
        self.assertIn("-old", message)
        self.assertIn("+new", message)


class FlagsMdTest(unittest.TestCase):

    def test_flags_md_is_current(self):
        server = gen_flags.default_binary("rubato_server")
        worker = gen_flags.default_binary("rubato_worker")
        expected = gen_flags.generate(server, worker)
        with open(gen_flags.FLAGS_MD) as f:
            current = f.read()
        message = gen_flags.stale_message(current, expected)
        if message:
            self.fail("\n" + message)


if __name__ == "__main__":
    sys.exit(pyunit.main("docs/flags_test"))
