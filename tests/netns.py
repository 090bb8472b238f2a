"""Hosts made of Linux network namespaces, for multi-host tests on one machine.

    net = netns.Network(["a", "b", "c"])     # three "hosts" on one switch
    net.host("a")                            # "rb1234-a": the namespace, and its host name
    net.ip("a")                              # "10.213.17.1"
    subprocess.run(net.exec_prefix("a") + ["rubato_server", ...])
    net.cut("b"); ...; net.restore("b")     # pull host b's cable for a while
    net.close()                              # (or use it as a context manager)

Each host is a namespace with loopback up and one veth into a switch namespace that holds a
bridge, so nothing is added to the machine's own network: the namespaces are the whole network,
on a private /24 picked per instance. Host names resolve in every host (each namespace's
/etc/netns/NAME/hosts, which `ip netns exec` mounts over /etc/hosts), also under extra names given
to `add_names` (a Kubernetes Service's DNS names, for instance). Any other name fails to resolve
at once and without traffic: each host's resolv.conf names 127.0.0.1 (inside the namespace),
where no DNS server listens. A host's namespace name is its host name, so `ip netns exec` works as
a remote shell (`--rsh 'ip netns exec'`).

Needs root and `ip` (iproute2). `skip_reason()` says why namespaces cannot be made here, or None.
"""

import os
import random
import shutil
import subprocess

NETNS_ETC = "/etc/netns"


def _ip(*args, check=True):
    return subprocess.run(["ip"] + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, check=check)


def skip_reason():
    """None when this process can create network namespaces, else why not (for a test's skip)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root (running as uid %d)" % os.geteuid()
    probe = "rbprobe-%d" % os.getpid()
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return "cannot create a network namespace here: %s" % made.stderr.strip()
    _ip("netns", "del", probe, check=False)
    return None


class Network:
    """Hosts (network namespaces) on one private switch. Every method raises CalledProcessError
    with ip's own message when a command fails."""

    def __init__(self, names, prefix=None):
        self.prefix = prefix or "rb%d" % (os.getpid() % 100000)
        # A /24 in 10.200.0.0/13 that no other instance of this process is likely to use.
        rng = random.Random(os.getpid() * 7919 + id(self))
        self.subnet = "10.%d.%d" % (200 + rng.randrange(8), rng.randrange(256))
        self.switch = self.prefix + "-sw"
        self._hosts = {}  # name -> (namespace, ip, switch-side veth)
        self._names = {}  # extra DNS name -> ip
        self._made = []   # namespaces created, to delete
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                self._add_host(name, i + 1)
            self._write_hosts_files()
        except Exception:
            self.close()
            raise

    def _add_ns(self, ns):
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _add_host(self, name, index):
        ns = "%s-%s" % (self.prefix, name)
        ip = "%s.%d" % (self.subnet, index)
        self._add_ns(ns)
        inside, outside = "eth0", "v%s%d" % (self.prefix[-6:], index)
        _ip("link", "add", outside, "type", "veth", "peer", "name", "tmp%s%d" % (self.prefix[-6:], index))
        _ip("link", "set", "tmp%s%d" % (self.prefix[-6:], index), "netns", ns, "name", inside)
        _ip("link", "set", outside, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", outside, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", ip + "/24", "dev", inside)
        _ip("-n", ns, "link", "set", inside, "up")
        self._hosts[name] = (ns, ip, outside)

    def _write_hosts_files(self):
        lines = ["127.0.0.1 localhost"]
        lines += ["%s %s" % (ip, ns) for ns, ip, _ in self._hosts.values()]
        lines += ["%s %s" % (ip, name) for name, ip in sorted(self._names.items())]
        for ns, _, _ in self._hosts.values():
            d = os.path.join(NETNS_ETC, ns)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "hosts"), "w") as f:
                f.write("\n".join(lines) + "\n")
            with open(os.path.join(d, "resolv.conf"), "w") as f:
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def host(self, name):
        """The namespace of host `name`, which is also its host name on this network."""
        return self._hosts[name][0]

    def hosts(self):
        return [ns for ns, _, _ in self._hosts.values()]

    def ip(self, name):
        return self._hosts[name][1]

    def exec_prefix(self, name):
        """argv prefix that runs a command on host `name`."""
        return ["ip", "netns", "exec", self.host(name)]

    def add_names(self, names):
        """Makes each extra DNS name (a dict name -> host) resolve to that host, everywhere."""
        for dns, host in names.items():
            self._names[dns] = self.ip(host)
        self._write_hosts_files()

    def cut(self, name):
        """Takes host `name` off the switch: packets to and from it are lost (no reset), as when a
        cable is pulled, until restore()."""
        _ip("-n", self.switch, "link", "set", self._hosts[name][2], "down")

    def restore(self, name):
        _ip("-n", self.switch, "link", "set", self._hosts[name][2], "up")

    def close(self):
        """Deletes every namespace (and with them their links and whatever still runs there keeps
        only its loopback) and the hosts files. Idempotent."""
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
        self._made = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
