#!/usr/bin/env python3
"""Tests of deploy/launcher/hosts.py: the host file, placement and ports.

    python3 deploy/launcher/hosts_test.py    (or: bazel test //deploy:launcher_hosts_test)
"""

import argparse
import os
import socket
import sys
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))]
from launcher import hosts as hostfile  # noqa: E402
from bazel import pyunit  # noqa: E402


class HostfileTest(unittest.TestCase):
    """The host file, and where processes go."""

    def test_parse(self):
        text = textwrap.dedent("""\
            # the cluster
            a slots=2
              b          # one slot

            c slots=4 # four
            10.0.0.7
            """)
        self.assertEqual(hostfile.parse_hostfile(text, "hosts"),
                         [("a", 2), ("b", 1), ("c", 4), ("10.0.0.7", 1)])

    def test_bad_lines_name_the_line(self):
        cases = [
            ("a\nb slots=0\n", "hosts:2: slots must be a whole number >= 1, got '0'"),
            ("a\n\n# x\nb slots=x\n", "hosts:4: slots must be a whole number >= 1, got 'x'"),
            ("a cores=2\n", "hosts:1: expected slots=N after the host name, got 'cores=2'"),
            ("a slots\n", "hosts:1: expected slots=N after the host name, got 'slots'"),
            ("a slots=1 slots=2\n", "hosts:1: slots given twice"),
            ("slots=2\n", "hosts:1: expected a host name first, got 'slots=2'"),
            ("a\nb\na slots=2\n", "hosts:3: host a is already on line 1"),
            ("fe80::1\n", "hosts:1: bad host name 'fe80::1'"),
            ("a:22\n", "hosts:1: bad host name 'a:22'"),
            ("# nothing\n\n", "hosts: no hosts in the file"),
        ]
        for text, message in cases:
            with self.assertRaises(hostfile.HostfileError, msg=text) as e:
                hostfile.parse_hostfile(text, "hosts")
            self.assertTrue(str(e.exception).startswith(message), (text, str(e.exception)))

    def test_select_hosts(self):
        hosts = [("a", 2), ("b", 1), ("c", 3)]
        self.assertEqual(hostfile.select_hosts(hosts, None, "--worker_hosts"), hosts)
        self.assertEqual(hostfile.select_hosts(hosts, "c,a", "--worker_hosts"),
                         [("c", 3), ("a", 2)])
        with self.assertRaisesRegex(ValueError, r"--server_hosts: unknown hosts x, y \(the host "
                                                r"file lists a, b, c\)"):
            hostfile.select_hosts(hosts, "a,x,y", "--server_hosts")
        with self.assertRaisesRegex(ValueError, "--worker_hosts: a given twice"):
            hostfile.select_hosts(hosts, "a,b,a", "--worker_hosts")

    def test_place_servers_round_robin(self):
        self.assertEqual(hostfile.place_servers([("a", 1), ("b", 9)], 5), ["a", "b", "a", "b", "a"])

    def test_place_workers(self):
        hosts = [("a", 2), ("b", 1), ("c", 3)]
        place = hostfile.place_workers
        self.assertEqual(place(hosts, 6, "slot"), ["a", "a", "b", "c", "c", "c"])
        self.assertEqual(place(hosts, 4, "slot"), ["a", "a", "b", "c"])
        self.assertEqual(place(hosts, 6, "host"), ["a", "b", "c", "a", "c", "c"])
        self.assertEqual(place(hosts, 2, "host"), ["a", "b"])
        # Oversubscribed: the slots first, then round-robin over every host.
        self.assertEqual(place(hosts, 8, "slot", True), ["a", "a", "b", "c", "c", "c", "a", "b"])
        self.assertEqual(place(hosts, 8, "host", True), ["a", "b", "c", "a", "c", "c", "a", "b"])
        with self.assertRaises(ValueError) as e:
            place(hosts, 7, "slot")
        self.assertEqual(str(e.exception),
                         "7 worker(s) do not fit in the 6 slot(s) their hosts have left (a:2, b:1, "
                         "c:3): give hosts more slots (slots=N in the host file), more "
                         "--worker_hosts, fewer --workers, --server_slots 0 (servers then take "
                         "none), or --oversubscribe")

    def test_select_hosts_needs_a_name(self):
        with self.assertRaisesRegex(ValueError, "--worker_hosts: no host names in ' , '"):
            hostfile.select_hosts([("a", 1)], " , ", "--worker_hosts")

    def test_place_workers_rejects_an_unknown_map_by(self):
        with self.assertRaisesRegex(ValueError, "--map_by: expected slot or host, got 'core'"):
            hostfile.place_workers([("a", 2)], 1, "core")


def plan_args(servers=2, workers=3, base_port=5000, **kwargs):
    args = argparse.Namespace(servers=servers, workers=workers, base_port=base_port,
                              server_hosts=None, worker_hosts=None, map_by="slot",
                              oversubscribe=False, server_slots=0)
    for key, value in kwargs.items():
        setattr(args, key, value)
    return args


class PlanTest(unittest.TestCase):

    def test_ports_and_addresses(self):
        plan = hostfile.Plan(plan_args(), [("a", 2), ("b", 2)])
        self.assertEqual(plan.server_hosts, ["a", "b"])
        self.assertEqual(plan.worker_hosts, ["a", "a", "b"])
        self.assertEqual(plan.server_ports, [5000, 5001])
        self.assertEqual(plan.server_data_ports, [5002, 5003])  # PORT + servers + i
        self.assertEqual(plan.rank_ports, [5000, 5001, 5002])
        self.assertEqual(plan.rank_data_ports, [5003, 5004, 5005])  # PORT + workers + r
        self.assertEqual(plan.servers(), "a:5000,b:5001")
        self.assertEqual(plan.peers(), "a:5000,a:5001,b:5002")

    def test_chosen_hosts(self):
        plan = hostfile.Plan(plan_args(servers=3, workers=2, server_hosts="c",
                                    worker_hosts="b,a", map_by="host"),
                          [("a", 1), ("b", 1), ("c", 1)])
        self.assertEqual(plan.server_hosts, ["c", "c", "c"])
        self.assertEqual(plan.worker_hosts, ["b", "a"])

    def test_servers_take_slots(self):
        # 2 hosts of 4 slots; 2 servers take one each: 6 workers fit, 7 do not.
        plan = hostfile.Plan(plan_args(servers=2, workers=6, server_slots=1),
                             [("a", 4), ("b", 4)])
        self.assertEqual(plan.worker_hosts, ["a"] * 3 + ["b"] * 3)
        with self.assertRaisesRegex(ValueError, r"7 worker\(s\) do not fit in the 6 slot\(s\) "
                                                r"their hosts have left \(a:3, b:3\)"):
            hostfile.Plan(plan_args(servers=2, workers=7, server_slots=1), [("a", 4), ("b", 4)])
        # Servers that do not fit their own host.
        with self.assertRaisesRegex(ValueError, "the servers on a take 3 slot"):
            hostfile.Plan(plan_args(servers=3, workers=1, server_slots=1, server_hosts="a"),
                          [("a", 2), ("b", 2)])
        plan = hostfile.Plan(plan_args(servers=3, workers=1, server_slots=1, server_hosts="a",
                                       oversubscribe=True), [("a", 2), ("b", 2)])
        self.assertEqual(plan.worker_hosts, ["b"])

    def test_local_ranks_under_map_by_host(self):
        # 2 hosts x 4 slots, one worker per host in turn: host a has workers 0, 2, 4, 6, which
        # must get local ranks (and so GPUs) 0, 1, 2, 3, not worker_id mod 4 = 0, 2, 0, 2.
        plan = hostfile.Plan(plan_args(servers=2, workers=8, map_by="host", server_slots=0),
                             [("a", 4), ("b", 4)])
        self.assertEqual(plan.worker_hosts, ["a", "b"] * 4)
        self.assertEqual(plan.worker_local_ranks, [0, 0, 1, 1, 2, 2, 3, 3])
        self.assertEqual(plan.server_local_ranks, [4, 4])  # After the host's workers.
        self.assertEqual(plan.local_sizes, {"a": 5, "b": 5})

    def test_parse_host_list(self):
        self.assertEqual(hostfile.parse_host_list("a:2,b,c.example:4"),
                         [("a", 2), ("b", 1), ("c.example", 4)])
        for bad, message in (("a,,b", "empty entry"), ("a:0", "slots must be"),
                             ("a:x", "slots must be"), ("a,a", "given twice"),
                             ("[::1]:2", "bad host name")):
            with self.assertRaisesRegex(hostfile.HostfileError, message):
                hostfile.parse_host_list(bad)

    def test_too_few_ports(self):
        with self.assertRaisesRegex(ValueError, "--base_port 65531 leaves too few ports"):
            hostfile.Plan(plan_args(base_port=65531), [("a", 4)])
        hostfile.Plan(plan_args(base_port=65530), [("a", 4)])  # 65530 + 2 * 3 workers: the limit.


class FreePortsTest(unittest.TestCase):

    def test_distinct_and_free(self):
        ports = hostfile.free_ports(4)
        self.assertEqual(len(set(ports)), 4)
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", port))  # Free again: the caller's to bind.


if __name__ == "__main__":
    sys.exit(pyunit.main("deploy/launcher/hosts_test"))
