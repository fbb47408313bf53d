"""What a shaped inter-site link is, and the `tc` commands that build it on a veth.

Every site has one access link to the WAN, shaped in both directions at `rate_mbit`.
A packet from site A to site B leaves A's uplink (rate, then the one-way delay, jitter
and loss) and enters B's downlink (rate). So the one-way delay between two sites is
`delay_ms`, the round trip 2 x delay_ms, and a transfer between two sites runs at
`rate_mbit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class LinkSpec:
    rate_mbit: float  # each direction of each site's access link
    delay_ms: float = 0.0  # one way, site to site
    jitter_ms: float = 0.0  # +- uniform around delay_ms
    loss_pct: float = 0.0  # random loss on the uplink
    queue_ms: float = 100.0  # longest wait for the rate limiter before tail drop (tbf's `latency`)

    def validate(self) -> None:
        # Messages name the command-line flags every WAN tool uses for these fields.
        if not self.rate_mbit > 0:
            raise ValueError(f"--rate-mbit {self.rate_mbit} must be > 0")
        if not (self.delay_ms >= 0 and self.jitter_ms >= 0):
            raise ValueError(f"--delay-ms {self.delay_ms} and --jitter-ms {self.jitter_ms} must be >= 0")
        if self.jitter_ms > self.delay_ms:
            raise ValueError(f"--jitter-ms {self.jitter_ms} must not exceed --delay-ms {self.delay_ms}")
        if not 0 <= self.loss_pct < 100:
            raise ValueError(f"--loss-pct {self.loss_pct} must be in [0, 100)")
        if not self.queue_ms > 0:
            raise ValueError(f"--queue-ms {self.queue_ms} must be > 0")

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def bytes_per_second(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def _tbf(self, dev: str, parent: List[str]) -> List[str]:
        # burst: at least one 64 KB GSO packet, else tbf must split every packet.
        burst = max(65536, int(self.bytes_per_second / 250))
        return ["tc", "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{self.rate_mbit}mbit",
                "burst", str(burst), "latency", f"{self.queue_ms}ms"]

    def uplink_commands(self, dev: str) -> List[List[str]]:
        """Site side, egress: tbf rate at the root, netem (delay, jitter, loss) as its child, so
        packets are delayed first and then paced, and the queue sits in netem."""
        cmds = [self._tbf(dev, ["root", "handle", "1:"])]
        if self.needs_netem:
            netem = ["netem", "delay", f"{self.delay_ms}ms"]
            if self.jitter_ms:
                netem += [f"{self.jitter_ms}ms"]
            if self.loss_pct:
                netem += ["loss", f"{self.loss_pct}%"]
            # netem's queue must hold a delay's worth of full-size packets plus the tbf queue.
            limit = int(self.bytes_per_second * (self.delay_ms + self.jitter_ms + self.queue_ms) / 1e3 / 1500) + 1000
            cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *netem,
                         "limit", str(limit)])
        return cmds

    def downlink_commands(self, dev: str) -> List[List[str]]:
        """WAN side of the site's veth, egress toward the site: rate only."""
        return [self._tbf(dev, ["root"])]
