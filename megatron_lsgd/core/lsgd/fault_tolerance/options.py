"""The fault-tolerance flags and their checks (torchft is an optional extra)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lsgd.core.lsgd import catalog
from megatron_lsgd.core.options import OptionGroup, option

MODES = ("none", "torchft")
LONE_SITE = ("stop", "train")
INSTALL_HINT = 'pip install -e ".[ft]" (torchft==0.2.0)'


@dataclass
class FaultToleranceOptions(OptionGroup):
    title = "fault tolerance: elastic sites (docs/fault_tolerance.md)"
    mode: str = option("--lsgd-fault-tolerance", "none",
                       "torchft: each site is a torchft replica group and a torchrun job of its own (--lsgd-site); "
                       "a site may fail and rejoin while the others keep training "
                       f"({', '.join(catalog.fault_tolerant_algorithms())})", choices=MODES)
    min_sites: int = option("--lsgd-min-sites", 1,
                            "fewest sites a round may commit with; below it training waits for sites to return")
    lighthouse: str = option("--lsgd-lighthouse", "",
                             "torchft lighthouse address (http://host:port); default: $TORCHFT_LIGHTHOUSE")
    timeout_s: float = option("--lsgd-ft-timeout", 60.0,
                              "seconds a cross-site collective or a heal may take before the round is given up")
    max_wait_s: float = option("--lsgd-ft-max-wait", 3600.0,
                               "seconds a site waits for --lsgd-min-sites sites before it gives up (or, alone in "
                               "its quorum, trains alone: --lsgd-ft-lone-site); a site waiting when the others "
                               "reach the job's end takes their final state and stops at once")
    lone_site: str = option("--lsgd-ft-lone-site", "stop",
                            "what a site does when it has had no other site in its quorum for --lsgd-ft-max-wait "
                            "seconds (it came first, or after every other site had left): stop (one error line, "
                            "exit 2) or train alone, its rounds committed with itself as the only member, until "
                            "other sites come back and it rejoins their quorum (needs --lsgd-min-sites >= 2 and a "
                            "lighthouse that forms a quorum of one site: --min_replicas 1)", choices=LONE_SITE)
    max_failed_rounds: int = option("--lsgd-ft-max-failed-rounds", 10,
                                    "rounds in a row a site may fail to commit before it stops with an error (sites "
                                    "that meet but cannot reduce together never recover: two sites on one GPU under "
                                    "NCCL, say); a lost site costs one or two; 0: never stop")
    host: str = option("--lsgd-ft-host", "",
                       "address at which the other sites reach this site's rank 0 (its torchft manager and store); "
                       "default: $MASTER_ADDR")
    digests: str = option("--lsgd-ft-digests", "",
                          "directory: at each quorum every rank appends the SHA-256 of its anchor and outer momentum "
                          "(sync: its main parameters) as of the last committed round to DIR/site<k>_rank<r>.jsonl (python -m tools.bench chaos "
                          "checks that every site agrees at every round)", metavar="DIR")
    site: int = option("--lsgd-site", -1,
                       "which site this torchrun job is (0 .. --num-sites - 1): under fault tolerance each site is "
                       "its own job and torch.distributed world (tools/wan/launch.py sets it)")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def validate(self, algorithm: str = "", num_sites: int = 2, refused=(), need_site: bool = False, **_) -> None:
        """`refused`: flags the run set that fault tolerance cannot honour (the caller knows
        them: a synchronous warm-up, a simulated clock, ...), each refused by name;
        `need_site`: a training run, whose --lsgd-site says which site it is."""
        if not self.enabled:
            changed = [f for f in self.changed_flags() if f != "--lsgd-fault-tolerance"]
            if changed:
                raise ValueError(f"{changed[0]} needs --lsgd-fault-tolerance torchft")
            return
        supported = catalog.fault_tolerant_algorithms()
        if algorithm not in supported:
            why = catalog.synchronizer_class(algorithm).fault_tolerance_refusal if algorithm in \
                catalog.registered_algorithms() else "not an algorithm"
            raise ValueError(f"--lsgd-fault-tolerance {self.mode} does not support --lsgd-algorithm {algorithm}: "
                             f"{why} (supported: {', '.join(supported)})")
        if num_sites < 2:
            raise ValueError(f"--lsgd-fault-tolerance {self.mode} needs --num-sites >= 2 (got {num_sites})")
        if not 1 <= self.min_sites <= num_sites:
            raise ValueError(f"--lsgd-min-sites must be in [1, --num-sites {num_sites}] (got {self.min_sites})")
        if need_site and not 0 <= self.site < num_sites:
            raise ValueError(f"--lsgd-fault-tolerance {self.mode}: each site is its own torchrun job; give its "
                             f"--lsgd-site in [0, --num-sites {num_sites}) (got {self.site})")
        for flag, why in refused:
            raise ValueError(f"{flag} does not work with --lsgd-fault-tolerance {self.mode}: {why}")
        if self.timeout_s <= 0 or self.max_wait_s <= 0:
            raise ValueError("--lsgd-ft-timeout and --lsgd-ft-max-wait must be > 0")
        if self.lone_site == "train" and self.min_sites < 2:
            raise ValueError("--lsgd-ft-lone-site train needs --lsgd-min-sites >= 2 (with 1 a site alone trains "
                             "at once)")
        if self.max_failed_rounds < 0:
            raise ValueError(f"--lsgd-ft-max-failed-rounds must be >= 0 (0: never stop; got {self.max_failed_rounds})")
        require_torchft(self.mode)


def require_torchft(mode: str = "torchft"):
    """The torchft module, or a ValueError saying how to install it."""
    try:
        import torchft
    except ImportError as err:
        raise ValueError(f"--lsgd-fault-tolerance {mode} needs torchft, which is not installed ({err}); "
                         f"install it with {INSTALL_HINT}") from err
    return torchft
