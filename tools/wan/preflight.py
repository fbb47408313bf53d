"""Can this machine emulate a WAN? Say exactly what is missing if not."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from tools.wan.netns import WanError, delete_namespace, run

BACKENDS = ("auto", "tc", "tun")


@dataclass(frozen=True)
class Capabilities:
    tbf: bool  # kernel has sch_tbf
    netem: bool  # kernel has sch_netem (delay, jitter, loss)
    tun: bool  # /dev/net/tun can be opened (the userspace wire)


def require_tools() -> None:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (CAP_NET_ADMIN and CAP_SYS_ADMIN to create network namespaces; run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (install iproute2)")
    if missing:
        raise WanError("WAN emulation needs " + " and ".join(missing) +
                       ". Without it, use the in-process simulated link: --simulate-inter-site-bandwidth / "
                       "--simulate-inter-site-latency.")


def probe(tag: str = "lsgdwan-probe") -> Capabilities:
    """Create a throwaway namespace with a veth pair and try each qdisc on it."""
    require_tools()
    ns = f"{tag}{os.getpid()}"
    created = run(["ip", "netns", "add", ns], check=False)
    if created.returncode != 0:
        raise WanError(f"creating a network namespace was refused (`ip netns add {ns}`: "
                       f"{created.stderr.strip()}); WAN emulation needs namespaces (a container may need "
                       f"--privileged or CAP_SYS_ADMIN)")
    try:
        run(["ip", "-n", ns, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])

        def qdisc_ok(*qdisc: str) -> bool:
            return run(["tc", "-n", ns, "qdisc", "replace", "dev", "p0", "root", *qdisc], check=False).returncode == 0

        tbf = qdisc_ok("tbf", "rate", "10mbit", "burst", "32kb", "latency", "50ms")
        netem = qdisc_ok("netem", "delay", "1ms")
    finally:
        delete_namespace(ns)
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
        tun = True
    except OSError:
        tun = False
    return Capabilities(tbf=tbf, netem=netem, tun=tun)


def choose_backend(requested: str, needs_netem: bool, caps: Capabilities) -> str:
    """`tc`: veth + tbf/netem in the kernel (preferred). `tun`: the userspace wire, for kernels
    without sch_netem (or sch_tbf)."""
    if requested not in BACKENDS:
        raise WanError(f"link backend {requested!r}: choose one of {', '.join(BACKENDS)}")
    tc_ok = caps.tbf and (caps.netem or not needs_netem)
    if requested == "tc" or (requested == "auto" and tc_ok):
        if not tc_ok:
            lacking = [q for q, ok in (("sch_tbf", caps.tbf), ("sch_netem", caps.netem or not needs_netem)) if not ok]
            raise WanError(f"the kernel lacks {' and '.join(lacking)} (tc qdisc kind unknown); use the userspace "
                           f"link (--link-backend tun) or load the module (modprobe {lacking[0]})")
        return "tc"
    if not caps.tun:
        raise WanError("the kernel lacks sch_netem/sch_tbf for `tc` shaping and /dev/net/tun cannot be opened for "
                       "the userspace link; nothing can emulate the WAN here")
    return "tun"
