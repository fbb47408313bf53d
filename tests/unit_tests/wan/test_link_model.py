"""The link model without the kernel: tc commands, backend choice and its errors, the
userspace hub's timing (rate, delay, jitter order, tail drop, loss)."""

import socket
import struct

import pytest

from tools.wan import preflight
from tools.wan.link import LinkSpec
from tools.wan.netns import WanError
from tools.wan.preflight import Capabilities, choose_backend
from tools.wan.wire import Hub

ADDRS = ["10.77.0.1", "10.77.0.2", "10.77.0.3"]


def packet(dst: str, size: int = 1000) -> bytes:
    header = bytes([0x45]) + bytes(15) + socket.inet_aton(dst)
    return header + bytes(size - len(header))


def test_uplink_is_tbf_then_netem_child_and_downlink_rate_only():
    spec = LinkSpec(100, delay_ms=20, jitter_ms=2, loss_pct=0.5)
    up = spec.uplink_commands("wan0")
    assert up[0][:8] == ["tc", "qdisc", "add", "dev", "wan0", "root", "handle", "1:"]
    assert up[0][8:11] == ["tbf", "rate", "100mbit"]
    assert up[1][5:9] == ["parent", "1:1", "handle", "10:"]
    assert up[1][9:15] == ["netem", "delay", "20ms", "2ms", "loss", "0.5%"]
    assert int(up[1][-1]) >= 100e6 / 8 * 0.072 / 1500  # limit holds delay + jitter + queue of packets
    down = spec.downlink_commands("s0")
    assert len(down) == 1 and "netem" not in down[0] and down[0][5] == "root"
    assert LinkSpec(100).uplink_commands("wan0")[1:] == []  # no netem when nothing needs it


@pytest.mark.parametrize("spec,message", [
    (LinkSpec(0), "rate"), (LinkSpec(10, delay_ms=1, jitter_ms=2), "jitter"), (LinkSpec(10, loss_pct=100), "loss")])
def test_bad_link_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()


def test_backend_choice_and_what_is_missing():
    full, no_netem = Capabilities(tbf=True, netem=True, tun=True), Capabilities(tbf=True, netem=False, tun=True)
    assert choose_backend("auto", True, full) == "tc"
    assert choose_backend("auto", True, no_netem) == "tun"
    assert choose_backend("auto", False, no_netem) == "tc"  # rate only: tbf suffices
    with pytest.raises(WanError, match="lacks sch_netem"):
        choose_backend("tc", True, no_netem)
    with pytest.raises(WanError, match="/dev/net/tun cannot be opened"):
        choose_backend("auto", True, Capabilities(tbf=True, netem=False, tun=False))


def test_missing_root_and_tools_are_named(monkeypatch):
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(preflight.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(WanError) as err:
        preflight.require_tools()
    assert "root" in str(err.value) and "`tc` (install iproute2)" in str(err.value)
    assert "`ip`" not in str(err.value) and "--simulate-inter-site-bandwidth" in str(err.value)


def drain(hub, until=10.0, step=1e-4):
    out, t = [], 0.0
    while t <= until and hub.next_time() is not None:
        t = max(t, hub.next_time())
        out += [(t, dst, pkt) for dst, pkt in hub.due(t)]
    return out


def test_hub_paces_at_rate_and_adds_one_way_delay():
    spec = LinkSpec(8, delay_ms=20, queue_ms=1000)  # 1 MB/s: a 1000-byte packet takes 1 ms per link
    hub = Hub(spec, ADDRS)
    for _ in range(100):
        hub.ingress(0, packet(ADDRS[1]), now=0.0)
    out = drain(hub)
    assert len(out) == 100 and all(dst == 1 for _, dst, _ in out)
    times = [t for t, _, _ in out]
    # first packet: 1 ms uplink + 20 ms + 1 ms downlink; then one per ms (the rate)
    assert times[0] == pytest.approx(0.022)
    assert times[-1] == pytest.approx(0.022 + 99 * 0.001)


def test_hub_tail_drops_past_queue_and_ignores_non_wan_packets():
    hub = Hub(LinkSpec(8, queue_ms=10.5), ADDRS)
    for _ in range(50):
        hub.ingress(0, packet(ADDRS[1]), now=0.0)
    hub.ingress(0, packet(ADDRS[0]), now=0.0)  # to itself
    hub.ingress(0, packet("192.168.1.1"), now=0.0)  # not a site
    hub.ingress(0, bytes([0x60]) + bytes(59), now=0.0)  # IPv6
    assert len(drain(hub)) == 11  # starts within 10.5 ms of backlog: packets 0..10
    assert hub.stats["dropped_queue"] == 39 and hub.stats["ignored"] == 3


def test_hub_downlink_is_shared_by_senders():
    hub = Hub(LinkSpec(8, queue_ms=1000), ADDRS)
    for _ in range(10):
        hub.ingress(0, packet(ADDRS[2]), now=0.0)
        hub.ingress(1, packet(ADDRS[2]), now=0.0)
    times = [t for t, _, _ in drain(hub)]
    assert times[-1] == pytest.approx(0.001 + 20 * 0.001)  # 20 packets through one 1 ms/packet downlink


def test_hub_jitter_never_reorders_and_loss_rate():
    hub = Hub(LinkSpec(1000, delay_ms=20, jitter_ms=10, loss_pct=10, queue_ms=1000), ADDRS, seed=3)
    for i in range(2000):
        pkt = packet(ADDRS[1])
        hub.ingress(0, pkt[:20] + struct.pack("!I", i) + pkt[24:], now=i * 1e-3)
    out = drain(hub, until=100)
    seqs = [struct.unpack("!I", pkt[20:24])[0] for _, _, pkt in out]
    assert seqs == sorted(seqs)
    assert 0.07 < hub.stats["dropped_loss"] / 2000 < 0.13
    delays = [t - s * 1e-3 for (t, _, _), s in zip(out, seqs)]
    assert min(delays) >= 0.010 and max(delays) > 0.025  # jitter spread seen
