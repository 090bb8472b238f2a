"""The kubelet's `grpc:` probe, in the standard library: one grpc.health.v1.Health/Check call
(service "") over plaintext HTTP/2, answering the status it returns ("SERVING", ...).

    status = grpc_health_probe.check("10.0.0.1", 8081, timeout=1.0)   # raises ProbeError

As a program, run inside a network namespace by tests/k8s_replay_test.py, it probes each
HOST:PORT until it answers SERVING or the deadline passes, and prints one JSON line per target:

    python3 grpc_health_probe.py DEADLINE_S HOST:PORT...
    {"target": "10.0.0.1:8081", "status": "SERVING", "after_s": 0.31}

Only what one unary call needs is implemented: no HPACK decoding (the answer is read from the DATA
frame; a call that fails has none), no flow control beyond the default windows.
"""

import json
import signal
import socket
import struct
import sys
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


class ProbeError(Exception):
    pass


def _frame(kind, flags, stream, payload=b""):
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _hpack_string(s):
    """A string literal without Huffman coding (7-bit prefix length)."""
    b = s.encode()
    n, out = len(b), bytearray()
    if n < 127:
        out.append(n)
    else:
        out.append(127)
        n -= 127
        while n >= 128:
            out.append(n % 128 + 128)
            n //= 128
        out.append(n)
    return bytes(out) + b


def _headers(pairs):
    # "Literal header field without indexing, new name" for each: 0x00, name, value.
    return b"".join(b"\x00" + _hpack_string(k) + _hpack_string(v) for k, v in pairs)


def _read_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ProbeError("connection closed")
        data += chunk
    return data


def check(host, port, timeout=1.0, service=""):
    """The health status that HOST:PORT reports for `service`; raises ProbeError when the call
    fails (connection refused, no answer within `timeout` seconds, an error status)."""
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            request = service.encode()
            message = (b"\x0a" + bytes([len(request)]) + request) if request else b""
            headers = _headers([
                (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
                (":authority", "%s:%d" % (host, port)), ("content-type", "application/grpc"),
                ("te", "trailers")])
            sock.sendall(PREFACE + _frame(SETTINGS, 0, 0) + _frame(HEADERS, END_HEADERS, 1, headers)
                         + _frame(DATA, END_STREAM, 1,
                                  b"\x00" + struct.pack(">I", len(message)) + message))
            body = b""
            while True:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                header = _read_exact(sock, 9)
                length = struct.unpack(">I", b"\x00" + header[:3])[0]
                kind, flags, stream = struct.unpack(">BBI", header[3:])
                payload = _read_exact(sock, length)
                if kind == SETTINGS and not flags & ACK:
                    sock.sendall(_frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    sock.sendall(_frame(PING, ACK, 0, payload))
                elif kind == GOAWAY:
                    raise ProbeError("GOAWAY from the server")
                elif kind == RST_STREAM and stream == 1:
                    raise ProbeError("the call was reset")
                elif kind == DATA and stream == 1:
                    body += payload
                if stream == 1 and kind in (DATA, HEADERS) and flags & END_STREAM:
                    break
    except (OSError, socket.timeout) as e:
        raise ProbeError(str(e) or type(e).__name__)
    if len(body) < 5:
        raise ProbeError("no response message (the call failed)")
    (size,) = struct.unpack(">I", body[1:5])
    response = body[5:5 + size]
    # HealthCheckResponse { ServingStatus status = 1; }: absent means 0 (UNKNOWN).
    status = response[1] if len(response) >= 2 and response[0] == 0x08 else 0
    return STATUS.get(status, str(status))


def main(argv):
    deadline_s = float(argv[0])
    start = time.monotonic()
    pending = list(argv[1:])
    last = {t: "not probed" for t in pending}
    stop = []
    # SIGTERM ends the probing early, still reporting each target's last answer.
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    while pending and not stop and time.monotonic() - start < deadline_s:
        for target in list(pending):
            if stop:
                break
            host, port = target.rsplit(":", 1)
            try:
                last[target] = check(host, int(port), timeout=1.0)
            except ProbeError as e:
                last[target] = "error: %s" % e
            if last[target] == "SERVING":
                pending.remove(target)
                print(json.dumps({"target": target, "status": "SERVING",
                                  "after_s": round(time.monotonic() - start, 2)}), flush=True)
        time.sleep(0.1)
    for target in pending:
        print(json.dumps({"target": target, "status": last[target]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
