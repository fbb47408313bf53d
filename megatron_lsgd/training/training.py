"""The training loop: `pretrain(datasets_provider, model_provider, forward_step_func)`.

The loop hands the synchronizer the parts of an inner step to compose, calls its hooks at
fixed points and never asks which algorithm is running (the order is documented in
megatron_lsgd/core/lsgd/protocol.py).

Lockstep synchronizers (every site takes the same steps) run Megatron's loop: log, evaluate,
save and stop at iteration counts. A non-lockstep synchronizer (`lockstep = False`, A-EDiT)
lets sites take different numbers of steps; then
- the job's length is a budget of samples (--train-samples / --train-tokens, or --train-iters
  global batches), and each site's data stream is sized for the fastest site (one site could
  consume the whole budget);
- the sites agree only at *meetings* the synchronizer holds (`agree_to_stop`, `meeting()`):
  the loop evaluates, saves and stops there, naming the point by the job's progress
  (samples of all sites // global batch), which is also the checkpoint's iteration; every
  site keeps its own iteration, LR schedule and sample position in the checkpoint;
- every site's last rank logs its own line (its own steps, loss and tokens, tagged with the
  site, plus every site's steps at the last meeting), with no cross-site collective.
"""

from __future__ import annotations

import math
import os
import re
import resource
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NoReturn, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
from megatron_lsgd.core.lsgd.catalog import synchronizer_class
from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteTimeout, SimulatedLink
from megatron_lsgd.core.lsgd.devices import InterSiteDevices, backend_device
from megatron_lsgd.core.lsgd.membership import AllSites
from megatron_lsgd.core.lsgd.protocol import Stop, SyncContext
from megatron_lsgd.core.optimizer.lr_scheduler import LRScheduler
from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer, build_grad_scaler
from megatron_lsgd.core.pipeline_parallel.schedules import ScheduleSpec, get_forward_backward_func
from megatron_lsgd.core.transformer.recompute import recomputing
from megatron_lsgd.training.arguments import RunConfig, build_config, parse_args
from megatron_lsgd.training.checkpointing.checkpointer import load_checkpoint, save_checkpoint
from megatron_lsgd.training.compat_runtime import CompatRuntime, check_attention_backend
from megatron_lsgd.training.compat_runtime import flops_per_sample as compat_flops_per_sample
from megatron_lsgd.training.data_samplers import build_data_iterator
from megatron_lsgd.training.elastic import elastic_site, register_healing_state
from megatron_lsgd.training.guard import (RUN_ERRORS, STARTUP_ERRORS, NonFiniteError, check_finite_loss,
                                          exit_with_error, first_to_report, is_out_of_memory,
                                          out_of_memory_message, take_save_lock)
from megatron_lsgd.training.initialize import init_distributed, initialize
from megatron_lsgd.training.inner_step import InnerStep, UnitHookPhase
from megatron_lsgd.training.json_log import JsonLog
from megatron_lsgd.training.logging_utils import TensorboardWriter, peak_cuda_memory_mb, print_rank, training_log_line
from megatron_lsgd.training.scenario import build_simulated_clock, describe, trained_parameters
from megatron_lsgd.training.signals import Interrupted, RunSignals
from megatron_lsgd.training.stragglers import Straggler
from megatron_lsgd.training.termination import Termination
from megatron_lsgd.training.traffic_summary import cross_site_traffic, summary_line
from megatron_lsgd.training.tokenizer import build_tokenizer, padded_vocab_size


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
    config: Optional[RunConfig] = None


class Trainer:
    def __init__(self, config: RunConfig, model_provider: Callable, datasets_provider: Callable,
                 forward_step_func: Callable, device: torch.device, clock: Optional[Clock] = None,
                 signals: Optional[RunSignals] = None):
        self.config = config
        self.device = device
        self.clock = clock or Clock()  # every time the run reads (core/clock.py)
        self.forward_step_func = forward_step_func
        self.pgs, self.rng_tracker = initialize(config, device)
        pgs = self.pgs
        # Last stage of the world's last site holds the loss (under fault tolerance a world is one site).
        self.log_rank = pgs.world_offset + dist.get_world_size() - 1
        # Non-lockstep runs: each site's last rank (last stage) logs that site's own line.
        self.site_log_rank = (pgs.site_rank + 1) * (config.dims.world_size // config.dims.sites) - 1

        self.tokenizer = build_tokenizer(config.tokenizer)
        config.model.padded_vocab_size = padded_vocab_size(
            self.tokenizer.vocab_size, config.tokenizer.make_vocab_size_divisible_by, config.dims.tp)

        model = model_provider(config, pgs, self.rng_tracker, pre_process=pgs.is_first_stage,
                               post_process=pgs.is_last_stage)
        model.to(device)
        model.initialize(config.training.seed)
        self.model = DistributedDataParallel(model, pgs, config.ddp)
        if config.simulation.active:  # virtual time from here on (--exit-duration-in-mins counts it from 0)
            self.clock = self._simulated_clock(model)
        sync_cls = synchronizer_class(config.lsgd.algorithm)
        self.optimizer = ShardedOptimizer([self.model], config.optimizer, pgs,
                                          build_grad_scaler(config.optimizer, config.training.fp16),
                                          separate_main=sync_cls.overlaps_optimizer_step)
        self.scheduler = LRScheduler(config.optimizer)

        link = config.lsgd.link
        devices = InterSiteDevices(group=backend_device(pgs.inter_site_backend, device), run=device,
                                   host_payloads=config.lsgd.outer.offload)
        if config.fault_tolerance.enabled:  # elastic sites: torchft's group, quorum per round (elastic.py)
            comm, self.membership = elastic_site(config, pgs, device, self.clock, devices)
        else:
            comm = InterSiteComm(pgs.dp_inter, config.dims.sites, SimulatedLink(link.latency_ms, link.bandwidth_mbit),
                                 config.training.distributed_timeout_minutes, rank=pgs.rank, site=pgs.site_rank,
                                 devices=devices, clock=self.clock)
            self.membership = AllSites(pgs.dp_inter, config.dims.sites)
        units = model.sync_units()
        self.synchronizer = sync_cls(SyncContext(pgs=pgs, config=config.lsgd, models=[self.model],
                                                 optimizer=self.optimizer, comm=comm, units=units,
                                                 membership=self.membership))
        self.comm = comm
        self.phase = UnitHookPhase()
        self._wire_unit_hooks(units)

        t = config.training
        gbs = t.global_batch_size
        self.lockstep = self.synchronizer.lockstep
        self.line_rank = self.log_rank if self.lockstep else self.site_log_rank  # prints training lines
        # The most steps one site may take: all of the budget, for a non-lockstep run.
        self.max_site_iters = t.train_iters if self.lockstep else self.job_budget_samples // (gbs // config.dims.sites)
        eval_runs = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters > 0 else 0
        # A synchronizer whose sites may take more micro-batches per step than configured
        # (ACCO/DPU's adaptive accumulation) says how many at most: size the stream for it.
        bound = self.synchronizer.microbatches_per_step_bound(config.num_microbatches)
        train_samples = self.max_site_iters * gbs if bound == config.num_microbatches else \
            t.train_iters * bound * t.micro_batch_size * config.dims.dp
        # --full-validation: one pass over the split, however many evaluations (1 sample asks for one epoch).
        valid_samples = (1 if eval_runs else 0) if t.full_validation else eval_runs * gbs
        train_ds, valid_ds, _ = datasets_provider(config, self.tokenizer,
                                                  (train_samples, valid_samples, t.eval_iters * gbs))
        self.eval_batches = self._evaluation_batches(valid_ds)
        self.consumed_samples = 0  # the whole job's (all sites)
        self.site_consumed_samples = 0  # this site's own position in its sample stream
        self._job_samples_stale = False  # sites counted differently since consumed_samples was summed
        self.train_ds = train_ds  # kept so a checkpoint load can restart the sampler at its consumed samples
        self.valid_ds = valid_ds
        self.consumed_valid_samples = 0  # the whole job's validation samples, restored on resume
        self.train_iterator = build_data_iterator(train_ds, 0, t.micro_batch_size, pgs, config.data.num_workers)
        self.train_data = _CurrentIterator(self)  # what a step reads: train_iterator, even if replaced mid-step
        self.valid_iterator = build_data_iterator(valid_ds, 0, t.micro_batch_size, pgs, config.data.num_workers,
                                                  cyclic=True)
        self.forward_backward = get_forward_backward_func(config.dims.pp)
        seq = config.model.seq_length // (config.dims.tp if config.model.sequence_parallel else 1)
        self.tensor_shape = (seq, t.micro_batch_size, config.model.hidden_size)
        self.straggler = Straggler(config.stragglers, pgs.rank, self.clock)
        self.inner_step = InnerStep(self.model, self.optimizer, self.scheduler, pgs, self.forward_backward,
                                    forward_step_func, self._schedule_spec, config.num_microbatches, self.straggler,
                                    self.phase, self.clock, samples_per_microbatch=t.micro_batch_size * config.dims.dp,
                                    empty_unused_memory_level=config.compat.empty_unused_memory_level)
        self.compat = CompatRuntime(config.compat, pgs.rank)  # --manual-gc, --profile
        self.flops_per_sample = compat_flops_per_sample(config.model, config.model.padded_vocab_size)
        self.termination = Termination(t, self.synchronizer, self.clock, range(dist.get_world_size()), signals)
        self.iteration = 0  # this site's steps
        self.agreed_iteration = 0  # non-lockstep: the job's progress at the last meeting, in global batches
        self.ended = False  # non-lockstep: a resumed run whose training had already ended
        self.last_meeting = None
        self.tb = TensorboardWriter(t.tensorboard_dir, enabled=pgs.rank == self.line_rank)
        self.json_log = JsonLog(t.json_log, enabled=pgs.rank == self.line_rank)
        self.last_saved_iteration = None
        if config.checkpoint.load and load_checkpoint(self, config.checkpoint):
            self.last_saved_iteration = self.checkpoint_iteration  # nothing new to save until the next step
        if config.fault_tolerance.enabled:
            register_healing_state(self, self.membership)

    def _simulated_clock(self, model) -> Clock:
        params = trained_parameters(model, self.pgs)  # collective: the replica's ranks
        clock = build_simulated_clock(self.config.simulation, self.config.lsgd.link, self.config.dims,
                                      self.pgs.site_rank, params)
        if self.pgs.rank == 0 or (self.pgs.rank % (self.config.dims.world_size // self.config.dims.sites) == 0):
            for line in describe(clock, self.config.simulation.scenario, params):
                print(line if self.pgs.site_rank == 0 else f"{line} [site {self.pgs.site_rank}]", flush=True)
        return clock

    @property
    def job_budget_samples(self) -> int:
        """The job's sample budget, all sites together (--train-iters x global batch if none was given)."""
        t = self.config.training
        return t.train_samples if t.train_samples is not None else t.train_iters * t.global_batch_size

    @property
    def checkpoint_iteration(self) -> int:
        """The agreed point a checkpoint is named by: this step count (lockstep, where every
        site has the same), or the job's progress at the last meeting (non-lockstep)."""
        return self.iteration if self.lockstep else self.agreed_iteration

    def save_checkpoint(self) -> None:
        self.synchronizer.quiesce()  # nothing in flight: the saved state is complete
        self._sum_site_samples()
        save_checkpoint(self, self.config.checkpoint)
        self.last_saved_iteration = self.checkpoint_iteration

    def _follow_job_schedule(self, meeting) -> None:
        """Non-lockstep: a site's LR schedule is the job's, not its own step count's. Its
        schedule spans the job's --train-iters global batches, so a fast site counting its
        own steps would finish the decay early and run its last steps at --min-lr; at every
        meeting that syncs its position becomes the job's agreed progress (between them it
        advances one global batch per own step, as if every site kept its pace)."""
        self.scheduler.num_steps = meeting.samples if self.scheduler.by_samples \
            else meeting.samples // self.config.training.global_batch_size

    # ---- hooks -----------------------------------------------------------------------------
    def _wire_unit_hooks(self, units) -> None:
        """Unit hooks fire in training only (the phase says so) and know the micro-batch."""
        sync, phase = self.synchronizer, self.phase

        def before_forward(unit):
            if phase.training and not recomputing():  # once per forward, not again when backward recomputes
                sync.before_unit_forward(unit, phase.current())

        if sync.uses_unit_forward_hooks:
            for unit in units:
                unit.modules[0].register_forward_pre_hook(lambda _m, _a, unit=unit: before_forward(unit))
        if sync.uses_unit_backward_hooks:  # backward runs in training only
            # The clock first, so that what the synchronizer issues starts at the unit's place
            # in the pass (a simulated clock); a unit's share of the backward is its share of
            # this rank's unit parameters (matmul FLOPs go with parameters).
            sizes = {id(u): sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units}
            total = max(1, sum(sizes.values()))
            self.model.add_unit_backward_listener(units, lambda unit: self.clock.backward_done(sizes[id(unit)] / total))
            self.model.add_unit_backward_listener(units, lambda unit: sync.after_unit_backward(unit, phase.last()))

    def _schedule_spec(self, forward_only: bool, num_microbatches: Optional[int] = None,
                       on_forward: Optional[Callable[[int], None]] = None,
                       loss_divisor: Optional[int] = None) -> ScheduleSpec:
        return ScheduleSpec(num_microbatches=num_microbatches or self.config.num_microbatches,
                            tensor_shape=self.tensor_shape, dtype=self.config.model.params_dtype, device=self.device,
                            forward_only=forward_only, loss_scale=self.optimizer.loss_scale, on_forward=on_forward,
                            per_token_loss=self.config.model.calculate_per_token_loss, loss_divisor=loss_divisor)

    def _count_samples(self, num_microbatches: int, same_on_every_site: bool) -> Optional[int]:
        """This site's position advances by its own micro-batches; the job's total is that
        times the number of sites when every site computed as many, else the sum of every
        site's own position, taken (_sum_site_samples) where the loop logs or saves.
        Returns the step's global batch when known (None: sites differed)."""
        site_samples = num_microbatches * self.config.training.micro_batch_size * self.config.dims.dp_intra
        self.site_consumed_samples += site_samples
        if not self.lockstep:  # the job's total is agreed at meetings only (the loop sets it there)
            return site_samples * self.config.dims.sites
        if same_on_every_site and not self._job_samples_stale:
            self.consumed_samples += site_samples * self.config.dims.sites
            return site_samples * self.config.dims.sites
        self._job_samples_stale = True
        return None

    def _sum_site_samples(self) -> None:
        """consumed_samples = the sum over sites of each site's own consumed samples (exact);
        a few bytes across sites, only after steps whose counts differed (collective)."""
        if not self._job_samples_stale:
            return
        total = torch.tensor([self.site_consumed_samples], dtype=torch.int64, device=self.device)
        self.membership.sum_over_sites(total)
        self.consumed_samples = int(total.item())
        self._job_samples_stale = False

    def _reduce_site_losses(self, losses: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Mean over micro-batches and over the site's data-parallel ranks (last stage)."""
        if not self.pgs.is_last_stage or not losses:
            return {}
        out = {}
        for key in losses[0]:
            stacked = torch.stack([d[key].float() for d in losses])
            if stacked.dim() == 2:  # (loss sum, tokens) per micro-batch (--calculate-per-token-loss)
                pair = stacked.sum(0)
                if self.config.dims.dp_intra > 1:
                    dist.all_reduce(pair, group=self.pgs.dp_intra)
                out[key] = (pair[0] / pair[1].clamp(min=1)).reshape(1)
                continue
            value = stacked.mean().reshape(1)
            if self.config.dims.dp_intra > 1:
                value /= self.config.dims.dp_intra
                dist.all_reduce(value, group=self.pgs.dp_intra)
            out[key] = value
        return out

    def _mean_across_sites(self, values: Dict[str, torch.Tensor]) -> Dict[str, float]:
        if self.config.dims.sites > 1 and values:
            stacked = torch.cat(list(values.values()))
            self.membership.mean_over_sites(stacked)  # a few bytes, at log intervals only
            values = dict(zip(values.keys(), stacked.split(1)))
        return {k: float(v.item()) for k, v in values.items()}

    # ---- evaluation ----------------------------------------------------------------------------
    def _evaluation_batches(self, valid_ds) -> int:
        """Global batches per evaluation: --eval-iters, or with --full-validation as many whole
        batches as the validation split holds."""
        t = self.config.training
        if not t.full_validation or valid_ds is None:
            return t.eval_iters
        batches = len(valid_ds) // t.global_batch_size
        if batches == 0:
            raise ValueError(f"--full-validation: the validation split (--split {self.config.data.split}) holds "
                             f"{len(valid_ds)} samples, fewer than one global batch ({t.global_batch_size}); give it "
                             f"a larger share")
        if self.pgs.rank == self.log_rank:
            print(f"> full validation: {batches} global batches ({batches * t.global_batch_size} samples) per "
                  f"evaluation", flush=True)
        return batches

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        t = self.config.training
        if self.valid_iterator is None or t.eval_iters == 0:
            return None
        if t.full_validation:  # the whole split from its first sample, every time
            self.valid_iterator = build_data_iterator(self.valid_ds, 0, t.micro_batch_size, self.pgs,
                                                      self.config.data.num_workers)
        self.synchronizer.quiesce()  # evaluate a consistent model, nothing in flight
        self.compat.around_eval()
        self.model.eval()
        collected: List[Dict[str, torch.Tensor]] = []
        for _ in range(self.eval_batches):
            collected += self.forward_backward(self.forward_step_func, self.valid_iterator, self.model,
                                               self._schedule_spec(True), self.pgs)
            self.clock.compute(self.config.num_microbatches, forward_only=True)
        self.consumed_valid_samples += self.eval_batches * t.global_batch_size
        self.model.train()
        self.compat.around_eval()
        reduced = self._mean_across_sites(self._reduce_site_losses(collected)) if self.pgs.is_last_stage else {}
        loss = reduced.get("lm loss")
        if loss is not None and self.pgs.rank == self.log_rank:
            ppl = math.exp(min(20.0, loss))
            line = f" validation loss at iteration {self.iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} |"
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
            self.tb.scalars({"lm loss validation": loss, "lm loss validation ppl": ppl}, self.iteration)
        return loss

    # ---- the loop ----------------------------------------------------------------------------
    def _log_interval(self, acc: "_Interval", result: TrainingResult) -> None:
        """One log line (and tensorboard scalars and a JSON record) for the interval just ended.
        Lockstep: the job's line, losses averaged over sites. Non-lockstep: this site's own."""
        t = self.config.training
        elapsed = self.clock.now() - acc.start
        if self.lockstep:
            self._sum_site_samples()  # exact job total (collective only when sites' counts differed)
            samples = self.consumed_samples - acc.consumed_before  # the job's
        else:
            samples = self.site_consumed_samples - acc.site_consumed_before  # this site's
        gbs = acc.gbs if acc.gbs is not None else round(samples / acc.iters)  # of the last step, or the mean
        tokens = samples * self.config.model.seq_length
        if self.lockstep:
            means = self._mean_across_sites({k: v / acc.iters for k, v in acc.sums.items()}) \
                if self.pgs.is_last_stage else {}
        else:  # no cross-site collective: sites are at different steps
            means = {k: float((v / acc.iters).item()) for k, v in acc.sums.items()} if self.pgs.is_last_stage else {}
        if "lm loss" in means:
            result.logged_losses.append(means["lm loss"])
        comm_now = self.comm.snapshot()
        moved_mb = (comm_now["bytes_sent"] + comm_now["bytes_received"]
                    - acc.comm["bytes_sent"] - acc.comm["bytes_received"]) / 2**20
        exposed_ms = 1e3 * (comm_now["exposed_seconds"] - acc.comm["exposed_seconds"]) / acc.iters
        tokens_per_s = tokens / elapsed
        result.tokens_per_second = tokens_per_s
        if self.pgs.rank == self.line_rank:
            norm = acc.norm_sum / acc.norm_count if acc.norm_count else None
            extra = {"tokens/s": f"{tokens_per_s:.1f}", "inter-site MB": f"{moved_mb:.2f}",
                     "exposed comm ms": f"{exposed_ms:.1f}"}
            if self.config.compat.log_throughput:  # Megatron's field: model FLOP/s per rank
                ranks = self.config.dims.world_size // (1 if self.lockstep else self.config.dims.sites)
                tflops = self.flops_per_sample * samples / elapsed / ranks / 1e12
                extra["throughput per GPU (TFLOP/s/GPU)"] = f"{tflops:.3f}"
            consumed, of_iters = self.consumed_samples, t.train_iters
            record = {}
            if not self.lockstep:  # this site's steps (at most all of the budget) and the job's agreed progress
                consumed, of_iters = self.site_consumed_samples, self.max_site_iters
                extra = {"site": str(self.pgs.site_rank), "job iteration": f"{self.agreed_iteration}/{t.train_iters}",
                         **extra}
                record["site"] = self.pgs.site_rank
                if self.last_meeting is not None:
                    extra["site steps at last meeting"] = "/".join(map(str, self.last_meeting.site_iterations))
            extra.update({k: f"{v:.4g}" for k, v in self.synchronizer.stats().items()})
            print(training_log_line(self.iteration, of_iters, consumed, 1e3 * elapsed / acc.iters,
                                    self.scheduler.current_lr, gbs, means, self.optimizer.loss_scale, norm,
                                    acc.skipped, acc.nans, extra), flush=True)
            self.tb.scalars({**{k: v for k, v in means.items()},
                             "learning-rate": self.scheduler.current_lr, "grad-norm": norm,
                             "loss-scale": self.optimizer.loss_scale, "batch-size": gbs,
                             "iteration-time": elapsed / acc.iters, "tokens-per-sec": tokens_per_s,
                             "inter-site-MB": moved_mb, "exposed-comm-ms": exposed_ms,
                             **self.synchronizer.stats()}, self.iteration)
            self.json_log.write({"iteration": self.iteration, "interval_iters": acc.iters,
                                 "elapsed_s": elapsed, "wall_s": self.clock.now() - acc.run_start,
                                 "tokens": tokens, "tokens_per_s": tokens_per_s,
                                 "losses": means, "inter_site_bytes": moved_mb * 2**20,
                                 "exposed_comm_s": exposed_ms * acc.iters / 1e3,
                                 "sync_stats": self.synchronizer.stats(), **record})
        acc.reset(comm_now, self.consumed_samples, self.site_consumed_samples, self.clock.now())

    @staticmethod
    def _crossed(before: int, now: int, interval: Optional[int]) -> bool:
        """A multiple of `interval` lies in (before, now]."""
        return bool(interval) and now // interval > before // interval

    def train(self) -> TrainingResult:
        run = _Run(result=TrainingResult(model=self.model.module, config=self.config),
                   acc=_Interval(comm=self.comm.snapshot(), start=self.clock.now(),
                                 consumed_before=self.consumed_samples,
                                 site_consumed_before=self.site_consumed_samples),
                   start_iter=self.iteration, start_agreed=self.agreed_iteration)  # a resumed run counts its own
        run.start = run.acc.run_start
        if self.lockstep:
            self._train_in_lockstep(run)
        else:
            self._train_at_own_pace(run)
        return self._finish(run)

    def _train_in_lockstep(self, run: "_Run") -> None:
        """Every site takes the same steps: log, evaluate, save and stop by iteration."""
        t = self.config.training
        while self.iteration < t.train_iters:
            self._step(run)
            if self.iteration % t.log_interval == 0 or self.iteration == t.train_iters:
                self._log_interval(run.acc, run.result)
            stop = self.termination.after_step(self.iteration, self.site_consumed_samples)
            eval_due = self.iteration % t.eval_interval == 0
            save_due = bool(self.config.checkpoint.save_interval) and \
                self.iteration % self.config.checkpoint.save_interval == 0
            if self._act(run, stop, eval_due, save_due):
                return

    def _train_at_own_pace(self, run: "_Run") -> None:
        """Sites take their own numbers of steps (a-edit): the job's progress is agreed at the
        synchronizer's meetings, and only there does the run evaluate, save and stop."""
        t = self.config.training
        while not self.ended:
            self._step(run)
            stop = self.termination.after_step(self.iteration, self.site_consumed_samples)
            meeting = self.synchronizer.meeting()
            before = self.agreed_iteration
            if meeting is not None:  # agreed on every rank
                self.last_meeting = meeting
                self.consumed_samples = meeting.samples
                self.agreed_iteration = meeting.samples // t.global_batch_size
                if meeting.synced:  # not at a pause's extra meeting: a resumed run stays exact
                    self._follow_job_schedule(meeting)
                if stop is None and self._crossed(before, self.agreed_iteration, t.exit_interval):
                    stop = Stop(False, f"--exit-interval {t.exit_interval}")
            if self.iteration % t.log_interval == 0 or stop is not None:
                self._log_interval(run.acc, run.result)
            eval_due = meeting is not None and self._crossed(before, self.agreed_iteration, t.eval_interval)
            save_due = meeting is not None and self._crossed(before, self.agreed_iteration,
                                                             self.config.checkpoint.save_interval)
            if self._act(run, stop, eval_due, save_due):
                return
            if self.iteration >= self.max_site_iters:
                raise RuntimeError(f"--lsgd-algorithm {self.config.lsgd.algorithm}: site {self.pgs.site_rank} took "
                                   f"{self.iteration} steps, all its data, without the sites agreeing to stop")

    def _step(self, run: "_Run") -> None:
        """One training step and what the log line accumulates from it."""
        t, acc = self.config.training, run.acc
        self.inner_step.iteration = self.iteration
        batch_schedule = self.config.compat.batch_schedule
        if batch_schedule is not None:
            self.inner_step.set_num_microbatches(batch_schedule.num_microbatches(self.consumed_samples))
        step = self.synchronizer.train_step(self.inner_step, self.train_data, self.iteration)
        losses, ok, grad_norm = step.losses, step.update_successful, step.grad_norm
        self.iteration += 1
        acc.gbs = self._count_samples(step.num_microbatches, step.same_count_on_every_site)
        acc.iters += 1
        self.compat.after_step(self.iteration)
        if not ok:
            acc.skipped += 1
            run.skipped += 1
        elif grad_norm is not None:
            if math.isnan(grad_norm):
                acc.nans += 1
            acc.norm_sum, acc.norm_count = acc.norm_sum + grad_norm, acc.norm_count + 1
        site_losses = self._reduce_site_losses(losses)
        if self.config.optimizer.check_for_nan_in_grad and (ok or not t.fp16):
            check_finite_loss(site_losses, t.fp16)
        for k, v in site_losses.items():
            acc.sums[k] = acc.sums.get(k, torch.zeros_like(v)) + v

    def _act(self, run: "_Run", stop: Optional[Stop], eval_due: bool, save_due: bool) -> bool:
        """After a step's decisions: close training, evaluate, save; True when the loop stops."""
        if stop is not None and stop.ends_training:  # before the final evaluation and save
            self.synchronizer.finish_training(self.iteration)
            self.ended = True
        if self.config.training.eval_iters > 0 and eval_due:
            before = self.clock.now()
            loss = self.evaluate()
            if loss is not None:
                run.result.validation_losses.append(loss)
                run.result.validation_seconds.append(before - run.start - run.result.evaluation_seconds)
                run.result.validation_iterations.append(self.iteration)
            run.acc.start = self.clock.now()
            run.result.evaluation_seconds += run.acc.start - before
        if self.config.checkpoint.save and save_due:
            self.save_checkpoint()
        if stop is None:
            return False
        if not stop.ends_training:
            print_rank(f"exiting at iteration {self.iteration} ({stop.reason})", self.pgs.rank, self.line_rank)
        elif not self.lockstep:
            print_rank(f"training ends at iteration {self.iteration} of site {self.pgs.site_rank} "
                       f"({stop.reason})", self.pgs.rank, self.line_rank)
        return True

    def _finish(self, run: "_Run") -> TrainingResult:
        """Quiesce, the last save, the run's summary and its log lines."""
        result, run_start, start_iter, start_agreed = run.result, run.start, run.start_iter, run.start_agreed
        total_skipped, lockstep = run.skipped, self.lockstep
        self.synchronizer.quiesce()
        self.termination.close()
        self._sum_site_samples()
        result.iteration = self.iteration
        result.skipped_iterations = total_skipped
        result.consumed_samples, result.site_consumed_samples = self.consumed_samples, self.site_consumed_samples
        if self.config.checkpoint.save and self.last_saved_iteration != self.checkpoint_iteration and \
                self.iteration > 0:
            self.save_checkpoint()
        result.comm, result.sync_stats = self.comm.snapshot(), self.synchronizer.stats()
        result.clock_seconds = self.clock.now() - run_start
        result.synchronizer = self.synchronizer
        if self.config.dims.sites > 1:  # collective: what crossed sites against per-step sync (each rank's own steps)
            result.traffic = cross_site_traffic(self.comm, self.optimizer.views().grad, self.iteration - start_iter,
                                                self.device)
        if self.pgs.rank == self.line_rank:
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            where = "" if lockstep else f" on site {self.pgs.site_rank}"
            clock = " on the simulated clock" if self.clock.simulated else ""
            print(f" done: {self.iteration} iterations{where} in {self.clock.now() - run_start:.1f} s{clock} | "
                  f"skipped iterations: {total_skipped} | peak RSS (MB): {rss_mb:.0f}", flush=True)
            record = {} if lockstep else {"site": self.pgs.site_rank}
            cuda_memory = peak_cuda_memory_mb(self.device)
            if cuda_memory:
                print(f" peak CUDA memory (MB): {cuda_memory['peak_cuda_allocated_mb']:.0f} allocated, "
                      f"{cuda_memory['peak_cuda_reserved_mb']:.0f} reserved", flush=True)
                record.update(cuda_memory)
            if result.traffic and self.pgs.rank == self.log_rank:
                steps = self.iteration - start_iter if lockstep else self.checkpoint_iteration - start_agreed
                ranks = f"site {self.pgs.site_rank}'s ranks" if self.config.fault_tolerance.enabled else "all ranks"
                print(summary_line(self.config.lsgd.algorithm, steps, result.traffic, ranks), flush=True)
            self.json_log.write({"event": "done", "iteration": self.iteration, "peak_rss_mb": rss_mb,
                                 "wall_s": self.clock.now() - run_start,
                                 "straggler_sleep_s": self.straggler.slept_seconds, **record})
        self.json_log.close()
        self.tb.close()
        self.compat.close()
        self.membership.close()
        return result


class _CurrentIterator:
    """The trainer's train_iterator of the moment: a site healed at a round's start gets a
    live peer's data position in the middle of train_step (elastic.py), whose reads must
    come from the new stream."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.trainer.train_iterator)


@dataclass
class _Run:
    """One call of Trainer.train: its result so far and where it started."""

    result: TrainingResult
    acc: "_Interval"
    start_iter: int
    start_agreed: int
    start: float = 0.0  # the run clock's time at the start
    skipped: int = 0  # skipped iterations (fp16 overflow)


@dataclass
class _Interval:
    """What the loop accumulates between two log lines."""

    comm: Dict[str, float]
    start: float  # the run clock's time when the interval began
    consumed_before: int = 0  # the job's consumed samples when the interval began (lockstep)
    site_consumed_before: int = 0  # this site's (non-lockstep)
    sums: Dict[str, torch.Tensor] = field(default_factory=dict)
    iters: int = 0
    gbs: Optional[int] = 0  # the global batch of the last step (None: sites computed different counts)
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


def _exit_on_bad_input(err: Exception, prefix: str = "") -> NoReturn:
    """Bad flags, files or a diverged run: one clear line on stderr and exit code 2, no traceback."""
    exit_with_error(err, prefix)


# How a failed collective reads: torch's DistError, or gloo's own transport errors, which its
# synchronous collectives raise as plain RuntimeErrors. Anything else is a bug: keep its traceback.
_COLLECTIVE_FAILURE = re.compile(r"gloo/transport|Connection (closed|reset) by peer|NCCL (error|communicator)|"
                                 r"[Ss]ocket [Tt]imeout|Timed out waiting")


def _is_lost_peer(err: BaseException) -> bool:
    return isinstance(err, (InterSiteTimeout, dist.DistError)) or (
        isinstance(err, RuntimeError) and bool(_COLLECTIVE_FAILURE.search(str(err))))


def _exit_on_lost_peer(err: Exception, pgs) -> NoReturn:
    """A collective failed mid-run (a peer rank or site stopped, or the network between them
    failed): every rank that saw it says so in one line and exits 2, without a traceback and
    without waiting for the peers that are gone."""
    if isinstance(err, InterSiteTimeout):
        message = str(err)
    else:
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = (f"rank {pgs.rank} (site {pgs.site_rank}): a collective failed: another rank or site stopped or "
                   f"the network between them failed; its own log says why [{cause}]")
    if first_to_report(every_rank_without_store=True):  # a peer that failed first has said why
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2) from err


def pretrain(train_valid_test_datasets_provider: Callable, model_provider: Callable, forward_step_func: Callable,
             argv: Optional[List[str]] = None, extra_args_provider: Optional[Callable] = None) -> TrainingResult:
    """Megatron's entry point: parse flags, initialize, build, train. Returns the result
    (and the model) so tests and benchmarks can inspect the run."""
    clock = Clock()  # --exit-duration-in-mins counts from here, as Megatron's does
    args = parse_args(argv, extra_args_provider)
    signals = RunSignals(args.exit_signal_handler, watch_launcher="TORCHELASTIC_RUN_ID" in os.environ).install()
    try:
        return _pretrain(args, clock, signals, train_valid_test_datasets_provider, model_provider,
                         forward_step_func)
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, the launcher gone: one line for the job
        _exit_on_interrupt(err)
    finally:
        signals.restore()


def _exit_on_interrupt(err: KeyboardInterrupt) -> NoReturn:
    what = err.describe() if isinstance(err, Interrupted) else "SIGINT received"
    launcher_gone = isinstance(err, Interrupted) and err.launcher_gone  # torchrun held the store: rank 0 speaks
    if (os.environ.get("RANK", "0") == "0") if launcher_gone else first_to_report():
        print(f"stopped: {what}. Checkpoints already in --save are intact (a save in progress was removed)",
              file=sys.stderr, flush=True)
    raise SystemExit(err.exit_code if isinstance(err, Interrupted) else 130) from None


def _pretrain(args, clock: Clock, signals: RunSignals, train_valid_test_datasets_provider: Callable,
              model_provider: Callable, forward_step_func: Callable) -> TrainingResult:
    try:
        device = init_distributed(args.distributed_backend, args.distributed_timeout_minutes, args.device)
    except ValueError as err:
        _exit_on_bad_input(err)
    try:
        config = build_config(args, dist.get_world_size())
    except ValueError as err:
        _exit_on_bad_input(err)
    if dist.get_rank() == 0:
        d = config.dims
        print(f"> megatron_lsgd: world {d.world_size} = TP {d.tp} x PP {d.pp} x DP {d.dp_intra} per site x "
              f"{d.sites} sites | algorithm {config.lsgd.algorithm} | micro-batches per step "
              f"{config.num_microbatches} | device {device}", flush=True)
    lock = None
    try:
        try:  # user input: flags, tokenizer and data files, the checkpoint to load, --save
            check_attention_backend(config.model, device)
            lock = take_save_lock(config.checkpoint.save)
            trainer = Trainer(config, model_provider, train_valid_test_datasets_provider, forward_step_func, device,
                              clock, signals)
        except STARTUP_ERRORS as err:
            _exit_on_bad_input(err)
        except RuntimeError as err:  # the model or optimizer state does not fit
            if not is_out_of_memory(err):
                raise
            _exit_on_bad_input(ValueError(out_of_memory_message(err, config)))
        if dist.get_rank() == 0:
            n = sum(p.numel() for p in trainer.model.module.parameters())
            print(f"> parameters on rank 0 (TP {trainer.pgs.tp_rank}, PP stage {trainer.pgs.pp_rank}): {n:,}",
                  flush=True)
        try:  # a diverged run, a failed save (disk full), a corrupt sample, a lost peer
            return trainer.train()
        except RUN_ERRORS as err:
            _exit_on_bad_input(err, prefix=f"iteration {trainer.iteration + 1}: " if isinstance(
                err, NonFiniteError) else "")
        except RuntimeError as err:
            if is_out_of_memory(err):
                _exit_on_bad_input(ValueError(out_of_memory_message(err, config)))
            if not _is_lost_peer(err):
                raise
            _exit_on_lost_peer(err, trainer.pgs)
    finally:
        if lock is not None:
            lock.release()
