"""Where the run stands (Position), what one call of Trainer.train keeps while it runs, and
what it leaves behind; shared by the two training loops (lockstep_loop.py, meeting_loop.py)
and the Trainer's common parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_lsgd.core.lsgd.protocol import Stop
from megatron_lsgd.training.arguments import RunConfig


@dataclass
class Position:
    """Where the run stands: the counters the training loop advances (and a checkpoint or a
    heal replaces). The Trainer owns it and hands it to the loop, which needs nothing else
    of the Trainer's to count progress."""

    iteration: int = 0  # this site's steps
    consumed_samples: int = 0  # the whole job's (all sites)
    site_consumed_samples: int = 0  # this site's own position in its sample stream
    agreed_iteration: int = 0  # non-lockstep: the job's progress at the last meeting, in global batches
    consumed_valid_samples: int = 0  # the whole job's validation samples
    ended: bool = False  # training has ended (finish_training ran); a resumed non-lockstep run stops at once

    def state_dict(self) -> Dict[str, int]:
        """This rank's counters, as a checkpoint gathers them (each site's iteration and sample
        position, the job's samples) and a live site hands them to a healing one. The agreed
        iteration and `ended` are the job's: a checkpoint's name and metadata (checkpointer.py)."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "site_consumed_samples": self.site_consumed_samples,
                "consumed_valid_samples": self.consumed_valid_samples}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """In place: the loop holds this object."""
        self.iteration = int(state["iteration"])
        self.consumed_samples = int(state["consumed_samples"])
        self.site_consumed_samples = int(state["site_consumed_samples"])
        self.consumed_valid_samples = int(state["consumed_valid_samples"])


@dataclass(frozen=True)
class Taken:
    """What one of the Trainer's steps took, for the loop to count: this site's samples and
    whether every site computed as many; or `ended`, training ended inside the step before
    it computed anything (no step was taken)."""

    site_samples: int = 0
    same_on_every_site: bool = True
    ended: Optional[Stop] = None


@dataclass
class TrainingResult:
    """What a run leaves behind (used by tests and benchmarks)."""

    iteration: int = 0
    logged_losses: List[float] = field(default_factory=list)  # mean over sites, one per log interval
    validation_losses: List[float] = field(default_factory=list)
    # When each was taken: the run clock's time from the start, less the time spent evaluating
    # before it (as Megatron's iteration timers, evaluation is not training time).
    validation_seconds: List[float] = field(default_factory=list)
    validation_iterations: List[int] = field(default_factory=list)
    test_loss: Optional[float] = None  # one evaluation of the test set at the end (--test-data-path, --skip-train)
    clock_seconds: float = 0.0  # the run's length on its clock (simulated under --simulate-clock)
    evaluation_seconds: float = 0.0  # of clock_seconds, spent evaluating (quiescing included)
    skipped_iterations: int = 0  # fp16 steps skipped for inf/nan gradients
    tokens_per_second: float = 0.0
    consumed_samples: int = 0  # the whole job's, all sites
    site_consumed_samples: int = 0  # this rank's site's own
    comm: Dict[str, float] = field(default_factory=dict)  # this rank's inter-site totals (InterSiteComm)
    sync_stats: Dict[str, float] = field(default_factory=dict)  # synchronizer.stats() at the end
    synchronizer: Optional[object] = None  # for tests and tools that inspect its state
    traffic: Dict[str, float] = field(default_factory=dict)  # all ranks' cross-site bytes vs per-step sync
    model: Optional[torch.nn.Module] = None
    compile_counts: Optional[Dict[str, int]] = None  # --compile: CompileReport.counts (graphs, breaks, recompiles)
    config: Optional[RunConfig] = None


@dataclass
class Interval:
    """What the loop accumulates between two log lines."""

    comm: Dict[str, float]
    start: float  # the run clock's time when the interval began
    consumed_before: int = 0  # the job's consumed samples when the interval began (lockstep)
    site_consumed_before: int = 0  # this site's (non-lockstep)
    sums: Dict[str, torch.Tensor] = field(default_factory=dict)
    iters: int = 0
    gbs: Optional[int] = 0  # the global batch of the last step (None: sites computed different counts)
    lr: Optional[float] = None  # the last step's learning rate where another thread owns the scheduler
    skipped: int = 0
    nans: int = 0
    norm_sum: float = 0.0
    norm_count: int = 0
    run_start: float = 0.0

    def __post_init__(self):
        self.run_start = self.start

    def reset(self, comm: Dict[str, float], consumed: int, site_consumed: int, now: float) -> None:
        self.sums, self.iters, self.skipped, self.nans = {}, 0, 0, 0
        self.norm_sum, self.norm_count = 0.0, 0
        self.comm, self.consumed_before, self.site_consumed_before = comm, consumed, site_consumed
        self.start = now


@dataclass
class Run:
    """One call of Trainer.train: its result so far and where it started."""

    result: TrainingResult
    acc: Interval
    start_iter: int  # this site's steps when it started (a resumed run counts its own)
    start_checkpoint_iteration: int  # the job's agreed progress when it started
    start: float = 0.0  # the run clock's time at the start
    skipped: int = 0  # skipped iterations (fp16 overflow)


@dataclass
class BeforeHeal:
    """Where an elastic site stood when it took a live peer's state (training/elastic.py): the
    Trainer counts its log line under way and the run's steps (traffic summary) from the
    new position (`Trainer._count_from_heal`)."""

    iteration: int  # this site's steps before the heal
    checkpoint_iteration: int  # the job's agreed progress before the heal
    comm: Dict[str, float]  # the inter-site counters then (InterSiteComm.snapshot)
    time: float  # the run clock's time once the state was loaded (the next line's time starts there)


@dataclass
class IntervalLine:
    """The part of an interval's log line that depends on whose progress it reports: the
    job's (lockstep: one line, losses averaged over sites) or one site's (non-lockstep:
    every site's own line)."""

    samples: int  # consumed during the interval
    means: Dict[str, float]  # the interval's mean losses (on the last pipeline stage; else empty)
    consumed: int  # consumed so far
    of_iters: int  # what the iteration count is shown against
    ranks: int  # the ranks that did the interval's work (--log-throughput is per rank)
    lead: Dict[str, str] = field(default_factory=dict)  # fields before the interval's throughput and traffic
    tail: Dict[str, str] = field(default_factory=dict)  # fields after them (before the synchronizer's stats)
