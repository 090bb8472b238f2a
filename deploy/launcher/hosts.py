"""Hosts and placement: the mpirun-style host file, which hosts take the servers and the workers,
and the ports every process listens on (fixed across hosts, free loopback ports locally)."""

import re
import socket

DEFAULT_BASE_PORT = 29500

# A host name or IPv4 address: what can precede ":PORT" in --servers and --peers.
HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class HostfileError(ValueError):
    pass


def parse_hostfile(text, path="hostfile"):
    """mpirun-style host file -> [(host, slots)] in file order. One host per line, optionally
    followed by `slots=N` (default 1); `#` starts a comment; blank lines are skipped. Errors name
    the file and line: "hosts:3: ..."."""
    hosts, seen = [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = "%s:%d: " % (path, number)
        words = line.split()
        host = words[0]
        if "=" in host:
            raise HostfileError(where + "expected a host name first, got %r" % host)
        if not HOST_NAME.match(host):
            raise HostfileError(where + "bad host name %r (letters, digits, '.', '-' and '_'; "
                                "IPv6 addresses are not supported, give a name)" % host)
        if host in seen:
            raise HostfileError(where + "host %s is already on line %d" % (host, seen[host]))
        seen[host] = number
        hosts.append((host, _slots(words[1:], where)))
    if not hosts:
        raise HostfileError("%s: no hosts in the file" % path)
    return hosts


def parse_host_list(text):
    """-H's inline list, "a:2,b,c:4" -> [(host, slots)] (slots 1 when not given), as mpirun's
    -H takes it. Errors name the entry."""
    hosts, seen = [], set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise HostfileError("-H: empty entry in %r" % text)
        host, colon, slots = item.partition(":")
        if not HOST_NAME.match(host):
            raise HostfileError("-H: bad host name %r (letters, digits, '.', '-' and '_')" % host)
        if host in seen:
            raise HostfileError("-H: host %s given twice" % host)
        seen.add(host)
        if colon and (not slots.isdigit() or int(slots) < 1):
            raise HostfileError("-H: slots must be a whole number >= 1, got %r in %r"
                                % (slots, item))
        hosts.append((host, int(slots) if colon else 1))
    return hosts


def _slots(words, where):
    """The `slots=N` that follows a host name (1 when none)."""
    slots = None
    for word in words:
        key, eq, value = word.partition("=")
        if key != "slots" or not eq:
            raise HostfileError(where + "expected slots=N after the host name, got %r" % word)
        if slots is not None:
            raise HostfileError(where + "slots given twice")
        if not value.isdigit() or int(value) < 1:
            raise HostfileError(where + "slots must be a whole number >= 1, got %r" % value)
        slots = int(value)
    return slots or 1


def select_hosts(hosts, names, flag):
    """The hosts that --server_hosts or --worker_hosts (`names`, comma-separated, or None for every
    host) names, with their slots, in the flag's order."""
    if names is None:
        return list(hosts)
    slots = dict(hosts)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    if not chosen:
        raise ValueError("%s: no host names in %r" % (flag, names))
    unknown = [n for n in chosen if n not in slots]
    if unknown:
        raise ValueError("%s: unknown host%s %s (the host file lists %s)" % (
            flag, "s" if len(unknown) > 1 else "", ", ".join(unknown), ", ".join(slots)))
    twice = sorted({n for n in chosen if chosen.count(n) > 1})
    if twice:
        raise ValueError("%s: %s given twice" % (flag, ", ".join(twice)))
    return [(n, slots[n]) for n in chosen]


def place_servers(hosts, n):
    """Shard i goes to host i mod len(hosts): round-robin."""
    return [hosts[i % len(hosts)][0] for i in range(n)]


def slots_left(hosts, server_hosts, server_slots, oversubscribe):
    """`hosts` with the slots that the servers (`server_hosts`, each taking `server_slots`) leave
    for workers. Servers that do not fit their host's slots are an error unless
    `oversubscribe`."""
    taken = {}
    for h in server_hosts:
        taken[h] = taken.get(h, 0) + server_slots
    slots = dict(hosts)
    over = [h for h in taken if h in slots and taken[h] > slots[h]]
    if over and not oversubscribe:
        raise ValueError(
            "the servers on %s take %s slot(s) of its %d (--server_slots %d each): give it more "
            "slots, spread the servers (--server_hosts), --server_slots 0, or --oversubscribe"
            % (over[0], taken[over[0]], slots[over[0]], server_slots))
    return [(h, max(0, s - taken.get(h, 0))) for h, s in hosts]


def local_ranks(hosts_of):
    """Each process's rank among the job's processes on its host, and how many those are:
    `hosts_of` lists every process's host in rank order (workers by id, then servers by shard), so
    that a host's workers get local ranks 0, 1, ... (a GPU each: --local_rank) before its servers.
    Returns ([local rank of each], {host: count})."""
    ranks, counts = [], {}
    for h in hosts_of:
        ranks.append(counts.get(h, 0))
        counts[h] = counts.get(h, 0) + 1
    return ranks, counts


def place_workers(hosts, n, map_by="slot", oversubscribe=False):
    """The host of each of `n` workers. map_by "slot": fill each host's slots in order, so that
    consecutive ranks share a host; "host": one worker per host in turn, skipping full hosts. A
    host takes at most its slots: more workers than slots is an error unless `oversubscribe`, and
    then the extra workers go round-robin over every host."""
    total = sum(s for _, s in hosts)
    if n > total and not oversubscribe:
        raise ValueError(
            "%d worker(s) do not fit in the %d slot(s) their hosts have left (%s): give hosts "
            "more slots (slots=N in the host file), more --worker_hosts, fewer --workers, "
            "--server_slots 0 (servers then take none), or --oversubscribe"
            % (n, total, ", ".join("%s:%d" % h for h in hosts)))
    placement = []
    if map_by == "slot":
        for host, slots in hosts:
            placement += [host] * min(slots, n - len(placement))
    elif map_by == "host":
        used = dict.fromkeys((h for h, _ in hosts), 0)
        while len(placement) < min(n, total):
            for host, slots in hosts:
                if used[host] < slots and len(placement) < n:
                    used[host] += 1
                    placement.append(host)
        # Worker ids in host order within each round: rank r on host r mod len(hosts).
    else:
        raise ValueError("--map_by: expected slot or host, got %r" % map_by)
    for i in range(n - len(placement)):  # Oversubscribed.
        placement.append(hosts[i % len(hosts)][0])
    return placement


class Plan:
    """Where each process runs, and its address, for a job across hosts."""

    def __init__(self, args, hosts):
        self.hosts = hosts
        self.server_hosts = place_servers(select_hosts(hosts, args.server_hosts,
                                                       "--server_hosts"), args.servers)
        # Servers take --server_slots slots each on their hosts (1 by default); workers the rest.
        left = slots_left(hosts, self.server_hosts, args.server_slots, args.oversubscribe)
        self.worker_hosts = place_workers(select_hosts(left, args.worker_hosts,
                                                       "--worker_hosts"),
                                          args.workers, args.map_by, args.oversubscribe)
        ranks, self.local_sizes = local_ranks(self.worker_hosts + self.server_hosts)
        self.worker_local_ranks = ranks[:args.workers]
        self.server_local_ranks = ranks[args.workers:]
        # Fixed ports, so that every address is known before anything starts. Only one kind
        # listens in a job: servers (parameter-server modes) or ranks (allreduce).
        self.server_ports = [args.base_port + i for i in range(args.servers)]
        self.rank_ports = [args.base_port + r for r in range(args.workers)]
        self.rank_data_ports = [args.base_port + args.workers + r for r in range(args.workers)]
        self.server_data_ports = [args.base_port + args.servers + i for i in range(args.servers)]
        if args.base_port + max(2 * args.servers, 2 * args.workers) > 65536:
            raise ValueError("--base_port %d leaves too few ports" % args.base_port)

    def servers(self):
        return ",".join("%s:%d" % a for a in zip(self.server_hosts, self.server_ports))

    def peers(self):
        return ",".join("%s:%d" % a for a in zip(self.worker_hosts, self.rank_ports))


def free_ports(n):
    """n distinct loopback ports that were free a moment ago (the workers bind them next)."""
    socks, ports = [], []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in socks:
        sock.close()
    return ports
