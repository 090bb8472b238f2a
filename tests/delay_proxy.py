#!/usr/bin/env python3
"""A TCP proxy that adds latency: every chunk read from either side is held for --delay_ms before
it is written to the other, in order. The kernel here has no netem (tc qdisc ... netem delay), so
this stands in for a slow link, in user space.

    python3 tests/delay_proxy.py --listen 127.0.0.1:29500 --target 10.213.17.1:29500 --delay_ms 20

Prints "delay_proxy: listening on HOST:PORT" on stdout once it accepts connections, and
"delay_proxy: connection from HOST:PORT" for each one, then runs until killed (SIGTERM, SIGINT). Each accepted connection gets one connection to the target; a side's end
of file is passed on (after the data before it) as a half-close, and an error on either side
closes both. The delay is per chunk (up to 64 KiB as read), measured from when the proxy read it,
so a stream of chunks keeps its rate and gains D ms of latency each way: a round trip through the
proxy takes 2 D longer. Nothing is dropped or reordered; memory is not bounded (a test tool).

Also a library: DelayProxy(listen, target, delay_s).start() runs one in a thread of this process.
"""

import argparse
import asyncio
import signal
import sys
import threading

CHUNK = 65536


async def _pump(reader, writer, delay_s):
    """Copies reader to writer, each chunk delayed by delay_s from when it was read."""
    loop = asyncio.get_running_loop()
    queue = asyncio.Queue()

    async def send():
        while True:
            due, data = await queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if data is None:  # End of file: half-close, after everything before it.
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(send())
    try:
        while True:
            data = await reader.read(CHUNK)
            queue.put_nowait((loop.time() + delay_s, data or None))
            if not data:
                break
        await sender
    finally:
        sender.cancel()


async def _handle(client_reader, client_writer, target, delay_s, log):
    if log:
        print("delay_proxy: connection from %s:%d" % client_writer.get_extra_info("peername")[:2],
              flush=True)
    try:
        server_reader, server_writer = await asyncio.open_connection(*target)
    except OSError:
        client_writer.close()
        return
    pumps = [asyncio.ensure_future(_pump(client_reader, server_writer, delay_s)),
             asyncio.ensure_future(_pump(server_reader, client_writer, delay_s))]
    try:
        # Both directions to their end of file, or the first error, which ends both.
        done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        for p in pending:
            p.cancel()
    finally:
        for w in (client_writer, server_writer):
            w.close()


def _split(address):
    host, _, port = address.rpartition(":")
    return host, int(port)


async def _serve(listen, target, delay_s, ready, log=False):
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, target, delay_s, log), *listen, reuse_address=True)
    ready(server.sockets[0].getsockname()[:2])
    async with server:
        await server.serve_forever()


class DelayProxy:
    """One proxy in a daemon thread of this process: start() returns its (host, port)."""

    def __init__(self, listen, target, delay_s):
        self.listen, self.target, self.delay_s = _split(listen), _split(target), delay_s
        self.address = None
        self._ready = threading.Event()

    def start(self):
        def ready(address):
            self.address = address
            self._ready.set()
        threading.Thread(target=lambda: asyncio.run(
            _serve(self.listen, self.target, self.delay_s, ready)), daemon=True).start()
        if not self._ready.wait(10):
            raise RuntimeError("delay proxy did not start")
        return self.address


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="host:port to accept connections on")
    p.add_argument("--target", required=True, help="host:port to forward them to")
    p.add_argument("--delay_ms", type=float, required=True, help="delay of each chunk, each way")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def ready(address):
        print("delay_proxy: listening on %s:%d" % address, flush=True)
    try:
        asyncio.run(_serve(_split(args.listen), _split(args.target), args.delay_ms / 1000.0,
                           ready, log=True))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
