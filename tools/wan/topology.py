"""S sites as network namespaces joined by shaped links; always torn down.

Each site is a namespace `<tag>-s<i>` holding interface `wan0` with address
`<subnet>.<i+1>/24` and loopback. All ranks of a site run in its namespace, so traffic
between them goes over loopback at full speed; only traffic to another site's address
crosses the shaped link.

Backends (see preflight.choose_backend):
- `tc`: a hub namespace `<tag>-wan` with a bridge; each site joins it by a veth pair
  shaped on both ends (link.py: tbf rate + netem delay/jitter/loss on the uplink).
- `tun`: the userspace wire (wire.py), for kernels without sch_netem.

    with WanTopology(2, LinkSpec(100, 20)) as wan:
        subprocess.run(wan.in_site(0, ["ping", wan.site_ip(1)]))

Namespaces are tagged with this process's id, so a run killed by SIGKILL leaves
namespaces that `cleanup_stale()` (called on every start) removes once their owner is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
from typing import List, Optional, Sequence

from tools.wan.link import LinkSpec
from tools.wan.netns import WanError, delete_namespace, in_ns, list_namespaces, run
from tools.wan.preflight import Capabilities, choose_backend, probe

PREFIX = "lsgdwan"
IFNAME = "wan0"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> List[str]:
    """Delete namespaces left by WanTopology instances whose process no longer exists."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{PREFIX}(\d+)-(s\d+|wan)", ns)
        if m and not _pid_alive(int(m.group(1))):
            delete_namespace(ns)
            removed.append(ns)
    return removed


class WanTopology:
    def __init__(self, sites: int, link: LinkSpec, backend: str = "auto", subnet: str = "10.77.0",
                 mtu: Optional[int] = None, seed: int = 0, capabilities: Optional[Capabilities] = None):
        if not 1 <= sites <= 250:
            raise ValueError(f"--sites {sites} must be in 1..250 (one /24)")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"--subnet {subnet!r}: give the first three octets of a private 10.x.y.0/24")
        link.validate()
        self.sites, self.link, self.requested_backend, self.subnet = sites, link, backend, subnet
        self.mtu, self.seed, self._caps = mtu, seed, capabilities
        self.tag = f"{PREFIX}{os.getpid()}"
        self.backend: Optional[str] = None
        self._wire: Optional[subprocess.Popen] = None
        self._created: List[str] = []

    # ---- names ------------------------------------------------------------------------------
    def site_ns(self, i: int) -> str:
        return f"{self.tag}-s{i}"

    @property
    def hub_ns(self) -> str:
        return f"{self.tag}-wan"

    def site_ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def in_site(self, i: int, cmd: Sequence[str]) -> List[str]:
        return in_ns(self.site_ns(i), cmd)

    def set_link(self, i: int, up: bool) -> None:
        """Cut site i off the WAN (`up` False) or join it again: its `wan0` goes down, so
        nothing crosses either way (TCP connections stay open and retransmit once it is
        back up; the address is kept). Either backend."""
        run(["ip", "-n", self.site_ns(i), "link", "set", IFNAME, "up" if up else "down"])

    # ---- life cycle -----------------------------------------------------------------------------
    def __enter__(self) -> "WanTopology":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        caps = self._caps or probe()
        self.backend = choose_backend(self.requested_backend, self.link.needs_netem, caps)
        cleanup_stale()
        atexit.register(self.down)  # also when the caller forgets the `with`
        try:
            for i in range(self.sites):
                self._add_ns(self.site_ns(i))
                run(["ip", "-n", self.site_ns(i), "link", "set", "lo", "up"])
            if self.backend == "tc":
                self._build_veth()
            else:
                self._build_tun()
            for i in range(self.sites):
                ns = self.site_ns(i)
                run(["ip", "-n", ns, "addr", "add", f"{self.site_ip(i)}/24", "dev", IFNAME])
                if self.mtu:
                    run(["ip", "-n", ns, "link", "set", IFNAME, "mtu", str(self.mtu)])
                run(["ip", "-n", ns, "link", "set", IFNAME, "up"])
        except BaseException:
            self.down()
            raise

    def _add_ns(self, ns: str) -> None:
        proc = run(["ip", "netns", "add", ns], check=False)
        if proc.returncode != 0:
            raise WanError(f"creating network namespace {ns} was refused: {proc.stderr.strip()}")
        self._created.append(ns)

    def _build_veth(self) -> None:
        hub = self.hub_ns
        self._add_ns(hub)
        run(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"])
        run(["ip", "-n", hub, "link", "set", "br0", "up"])
        for i in range(self.sites):
            port = f"s{i}"
            run(["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", IFNAME,
                 "netns", self.site_ns(i)])
            if self.mtu:
                run(["ip", "-n", hub, "link", "set", port, "mtu", str(self.mtu)])
            # tbf drops whole GSO packets (up to 64 KB, dozens of segments at once), which sends
            # TCP into retransmission timeouts; smaller GSO packets keep loss recovery fast.
            # Best effort: an old iproute2 without gso_max_size still gets a working link.
            for ns, dev in ((hub, port), (self.site_ns(i), IFNAME)):
                run(["ip", "-n", ns, "link", "set", dev, "gso_max_size", "16384"], check=False)
            run(["ip", "-n", hub, "link", "set", port, "master", "br0"])
            run(["ip", "-n", hub, "link", "set", port, "up"])
            for cmd in self.link.uplink_commands(IFNAME):
                run(["tc", "-n", self.site_ns(i), *cmd[1:]])
            for cmd in self.link.downlink_commands(port):
                run(["tc", "-n", hub, *cmd[1:]])

    def _build_tun(self) -> None:
        if self.mtu is None:
            self.mtu = 9000  # fewer, larger packets: the Python wire then costs little CPU
        cmd = [sys.executable, "-m", "tools.wan.wire",
               "--namespaces", ",".join(self.site_ns(i) for i in range(self.sites)),
               "--addresses", ",".join(self.site_ip(i) for i in range(self.sites)), "--ifname", IFNAME,
               "--rate-mbit", str(self.link.rate_mbit), "--delay-ms", str(self.link.delay_ms),
               "--jitter-ms", str(self.link.jitter_ms), "--loss-pct", str(self.link.loss_pct),
               "--queue-ms", str(self.link.queue_ms), "--seed", str(self.seed)]
        self._wire = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
                                      start_new_session=True)  # Ctrl-C reaches us; we stop it in order
        _prefer(self._wire.pid)
        line = self._wire.stdout.readline().strip()
        if line != "ready":
            code = self._wire.wait(timeout=10)
            raise WanError(f"the userspace link (tools/wan/wire.py) did not start (exit {code}); see its stderr")

    def down(self) -> None:
        """Idempotent: stop the wire, delete every namespace this instance created."""
        if self._wire is not None:
            if self._wire.poll() is None:
                self._wire.terminate()
                try:
                    self._wire.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._wire.kill()
                    self._wire.wait()
            self._wire.stdout.close()
            self._wire = None
        while self._created:
            delete_namespace(self._created.pop())
        atexit.unregister(self.down)


def _prefer(pid: int) -> None:
    """The userspace link is the network, not a workload: run it ahead of the training
    processes (nice -10), so that a busy machine slows the sites' compute, not the link's
    rate and delay. Needs root (the namespaces already do); without it, unchanged."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, -10)
    except OSError:
        pass
