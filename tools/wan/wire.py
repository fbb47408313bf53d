"""A userspace WAN link over TUN devices, for kernels without sch_netem (or sch_tbf).

One process holds a TUN device `wan0` inside every site's namespace. IPv4 packets a site
sends to another site's address come out of its TUN here; the hub paces them through
the sender's uplink (rate, tail drop after `queue_ms` of backlog), adds the one-way delay
(plus uniform jitter, never reordering a flow) and random loss, paces them through the
receiver's downlink, and writes them into the receiver's TUN: the same link model as
the `tc` backend (see link.py). The devices are not persistent, so they vanish with this
process whatever ends it.

    python -m tools.wan.wire --namespaces ns0,ns1 --addresses 10.77.0.1,10.77.0.2 \\
        --rate-mbit 100 --delay-ms 20        # prints "ready" once the TUNs exist
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import heapq
import os
import random
import select
import signal
import socket
import struct
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

try:
    from tools.wan.link import LinkSpec
except ImportError:  # run as a script from tools/wan
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tools.wan.link import LinkSpec

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
CLONE_NEWNET = 0x40000000
_ARRIVE, _DELIVER = 0, 1


def open_tun_in_namespace(ns: str, ifname: str) -> int:
    """Create TUN `ifname` inside namespace `ns` (setns there and back: the fd stays bound)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", ifname.encode(), IFF_TUN | IFF_NO_PI))
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace")
    finally:
        os.close(own)
        os.close(target)
    return fd


class Hub:
    """The link model as a discrete-event scheduler (pure: no I/O, the clock is passed in)."""

    def __init__(self, spec: LinkSpec, addresses: Sequence[str], seed: int = 0):
        self.spec = spec
        self.site_of: Dict[bytes, int] = {socket.inet_aton(a): i for i, a in enumerate(addresses)}
        n = len(addresses)
        self.up_free = [0.0] * n  # when each uplink finishes sending what it already holds
        self.down_free = [0.0] * n
        self.last_arrival: Dict[Tuple[int, int], float] = {}
        self.events: List[Tuple[float, int, int, int, bytes]] = []  # (time, seq, stage, dst site, packet)
        self.seq = 0
        self.rng = random.Random(seed)
        self.stats = {"packets": 0, "bytes": 0, "dropped_queue": 0, "dropped_loss": 0, "ignored": 0}

    def _push(self, t: float, stage: int, dst: int, pkt: bytes) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, stage, dst, pkt))

    def ingress(self, src: int, pkt: bytes, now: float) -> None:
        spec = self.spec
        dst = self.site_of.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
        if dst is None or dst == src:  # IPv6 chatter, other subnets: not WAN traffic
            self.stats["ignored"] += 1
            return
        start = max(now, self.up_free[src])
        if start - now > spec.queue_ms / 1e3:
            self.stats["dropped_queue"] += 1
            return
        self.up_free[src] = start + len(pkt) / spec.bytes_per_second
        if spec.loss_pct and self.rng.random() * 100 < spec.loss_pct:
            self.stats["dropped_loss"] += 1  # it used the uplink, then got lost on the way
            return
        delay = spec.delay_ms + (self.rng.uniform(-spec.jitter_ms, spec.jitter_ms) if spec.jitter_ms else 0.0)
        arrive = max(self.up_free[src] + delay / 1e3, self.last_arrival.get((src, dst), 0.0))
        self.last_arrival[(src, dst)] = arrive
        self._push(arrive, _ARRIVE, dst, pkt)

    def due(self, now: float) -> List[Tuple[int, bytes]]:
        """Advance to `now`; return (destination site, packet) pairs to deliver."""
        out = []
        while self.events and self.events[0][0] <= now:
            t, _, stage, dst, pkt = heapq.heappop(self.events)
            if stage == _DELIVER:
                out.append((dst, pkt))
                self.stats["packets"] += 1
                self.stats["bytes"] += len(pkt)
                continue
            start = max(t, self.down_free[dst])
            if start - t > self.spec.queue_ms / 1e3:
                self.stats["dropped_queue"] += 1
                continue
            self.down_free[dst] = start + len(pkt) / self.spec.bytes_per_second
            self._push(self.down_free[dst], _DELIVER, dst, pkt)
        return out

    def next_time(self) -> Optional[float]:
        return self.events[0][0] if self.events else None


def serve(hub: Hub, fds: Sequence[int], should_stop, clock=time.monotonic) -> None:
    site_of_fd = {fd: i for i, fd in enumerate(fds)}
    while not should_stop():
        nxt = hub.next_time()
        timeout = 0.2 if nxt is None else min(0.2, max(0.0, nxt - clock()))
        try:
            readable, _, _ = select.select(list(fds), [], [], timeout)
        except InterruptedError:
            continue
        now = clock()
        for fd in readable:
            while True:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                hub.ingress(site_of_fd[fd], pkt, now)
        for dst, pkt in hub.due(clock()):
            try:
                os.write(fds[dst], pkt)
            except OSError as err:  # interface going down at teardown: the packet is lost, like on a wire
                if err.errno not in (errno.EIO, errno.EAGAIN, errno.ENOBUFS, errno.EINVAL):
                    raise


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--namespaces", required=True, help="comma-separated, one per site")
    p.add_argument("--addresses", required=True, help="comma-separated IPv4 address of each site")
    p.add_argument("--ifname", default="wan0")
    p.add_argument("--rate-mbit", type=float, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss-pct", type=float, default=0.0)
    p.add_argument("--queue-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    namespaces, addresses = a.namespaces.split(","), a.addresses.split(",")
    if len(namespaces) != len(addresses):
        p.error("--namespaces and --addresses need one entry per site")
    spec = LinkSpec(a.rate_mbit, a.delay_ms, a.jitter_ms, a.loss_pct, a.queue_ms)
    try:
        spec.validate()
    except ValueError as err:
        p.error(str(err))

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.append(True))
    fds = [open_tun_in_namespace(ns, a.ifname) for ns in namespaces]
    print("ready", flush=True)
    hub = Hub(spec, addresses, a.seed)
    try:
        serve(hub, fds, lambda: bool(stop))
    finally:
        for fd in fds:
            os.close(fd)
        print(f"wire: {hub.stats}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
