"""Cross-site (lsgd) configuration. Later algorithms add their fields here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LsgdConfig:
    algorithm: str = "sync"
    warmup_iters: int = 0  # fully synchronous steps before a local-SGD algorithm starts

    def validate(self, num_sites: int) -> None:
        from megatron_lsgd.core.lsgd.registry import synchronizer_class

        cls = synchronizer_class(self.algorithm)
        if cls.requires_multiple_sites and num_sites < 2:
            raise ValueError(f"--lsgd-algorithm {self.algorithm} needs --num-sites >= 2 (got {num_sites})")
        if self.warmup_iters < 0:
            raise ValueError("--lsgd-warmup-iters must be >= 0")
