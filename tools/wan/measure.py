"""Tiny TCP probes to check a shaped link: bulk throughput and round-trip time.

    ip netns exec B python -m tools.wan.measure serve --port 5201 &
    ip netns exec A python -m tools.wan.measure bulk --host 10.77.0.2 --port 5201 --bytes 4000000
    ip netns exec A python -m tools.wan.measure rtt --host 10.77.0.2 --port 5201

Each client prints one JSON line. `bulk` time runs from the first byte sent to the
server's acknowledgement that it received everything; every probe is bounded in bytes
and in time (--timeout).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time

CHUNK = 1 << 16


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(min(CHUNK, n - len(buf)))
        if not part:
            raise ConnectionError("peer closed early")
        buf += part
    return bytes(buf)


def serve(port: int, timeout: float, connections: int) -> None:
    """Each connection sends a header (kind, size): 'B' = bulk of size bytes then a 1-byte ack
    back; 'P' = size one-byte pings each echoed."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("0.0.0.0", port))
        srv.listen(4)
        srv.settimeout(timeout)
        print("listening", flush=True)
        for _ in range(connections):
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(timeout)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                kind, size = struct.unpack("!cQ", _recv_exact(conn, 9))
                if kind == b"B":
                    left = size
                    while left:
                        part = conn.recv(min(CHUNK, left))
                        if not part:
                            raise ConnectionError("sender closed early")
                        left -= len(part)
                    conn.sendall(b"k")
                else:
                    for _ in range(size):
                        conn.sendall(_recv_exact(conn, 1))


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the server may still be starting


def bulk(host: str, port: int, nbytes: int, timeout: float) -> dict:
    payload = b"\0" * CHUNK
    with _connect(host, port, timeout) as s:
        s.settimeout(timeout)
        s.sendall(struct.pack("!cQ", b"B", nbytes))
        start = time.perf_counter()
        left = nbytes
        while left:
            n = s.send(payload[:min(CHUNK, left)])
            left -= n
        if _recv_exact(s, 1) != b"k":
            raise ConnectionError("bad acknowledgement")
        seconds = time.perf_counter() - start
    return {"bytes": nbytes, "seconds": seconds, "mbit_per_s": nbytes * 8 / seconds / 1e6}


def rtt(host: str, port: int, count: int, timeout: float) -> dict:
    with _connect(host, port, timeout) as s:
        s.settimeout(timeout)
        s.sendall(struct.pack("!cQ", b"P", count))
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(b"p")
            _recv_exact(s, 1)
            samples.append(time.perf_counter() - t0)
    samples.sort()
    return {"count": count, "median_ms": 1e3 * samples[len(samples) // 2], "min_ms": 1e3 * samples[0]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["serve", "bulk", "rtt"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5201)
    p.add_argument("--bytes", type=int, default=4_000_000, help="bulk: bytes to send (at most 1 GB)")
    p.add_argument("--count", type=int, default=10, help="rtt: pings")
    p.add_argument("--connections", type=int, default=1, help="serve: connections to answer, then exit")
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args(argv)
    if not 0 < a.bytes <= 1 << 30:
        p.error("--bytes must be in 1..1 GB")
    if a.count < 1 or a.connections < 1 or not a.timeout > 0:
        p.error("--count and --connections must be >= 1 and --timeout > 0")
    try:
        if a.mode == "serve":
            serve(a.port, a.timeout, a.connections)
        elif a.mode == "bulk":
            print(json.dumps(bulk(a.host, a.port, a.bytes, a.timeout)), flush=True)
        else:
            print(json.dumps(rtt(a.host, a.port, a.count, a.timeout)), flush=True)
    except OSError as err:  # refused, unreachable, timed out, port in use
        print(f"error: {a.mode} {a.host}:{a.port}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
