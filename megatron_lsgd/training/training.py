"""`pretrain(datasets_provider, model_provider, forward_step_func)` and the Trainer.

The Trainer builds the run (model, optimizer, synchronizer, data) and owns what both training
loops share: the run's Position, one step, evaluation, saving, the log line and the run's
end. It runs one of two loops, chosen once by the synchronizer's declared `lockstep`, never
by its name; what depends on that choice (the stop rule, the checkpoint's name, the log
line, what a resume restores) is the loop's:
- lockstep_loop.py: every site takes the same steps; log, evaluate, save and stop at
  iteration counts (Megatron's loop);
- meeting_loop.py: sites take different numbers of steps and agree only at the
  synchronizer's meetings, where the loop evaluates, saves and stops.
The loops hand the synchronizer the parts of an inner step to compose, call its hooks at
fixed points and never ask which algorithm is running (the order is documented in
megatron_lsgd/core/lsgd/protocol.py).
"""

from __future__ import annotations

import math
import os
import re
import resource
import sys
from typing import Callable, Dict, List, NoReturn, Optional

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Clock
from megatron_lsgd.core.datasets import data_passes
from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
from megatron_lsgd.core.lsgd.catalog import synchronizer_class
from megatron_lsgd.core.lsgd.comm import InterSiteComm, InterSiteTimeout, SimulatedLink
from megatron_lsgd.core.lsgd.devices import InterSiteDevices, backend_device
from megatron_lsgd.core.lsgd.membership import AllSites, MixedLayoutSites, UnequalSites
from megatron_lsgd.core.lsgd.protocol import Stop, SyncContext
from megatron_lsgd.core.optimizer.lr_scheduler import LRScheduler
from megatron_lsgd.core.optimizer.sharded_optimizer import ShardedOptimizer, build_grad_scaler
from megatron_lsgd.core.pipeline_parallel.schedules import ScheduleSpec, get_forward_backward_func
from megatron_lsgd.core.transformer.compile import CompileReport, compile_layers
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
from megatron_lsgd.training.lockstep_loop import LockstepLoop
from megatron_lsgd.training.logging_utils import (TensorboardWriter, mean_across_sites, peak_cuda_memory_mb,
                                                  print_rank, training_log_line)
from megatron_lsgd.training.meeting_loop import MeetingLoop
from megatron_lsgd.training.model_build import build_model
from megatron_lsgd.training.run_state import BeforeHeal, Interval, Position, Run, Taken, TrainingResult
from megatron_lsgd.training.scenario import build_simulated_clock, describe, optimizer_shard_scale, trained_parameters
from megatron_lsgd.training.signals import Interrupted, RunSignals
from megatron_lsgd.training.stragglers import Straggler
from megatron_lsgd.training.traffic_summary import cross_site_traffic, summary_line
from megatron_lsgd.training.tokenizer import build_tokenizer, padded_vocab_size


class Trainer:
    def __init__(self, config: RunConfig, model_provider: Callable, datasets_provider: Callable,
                 forward_step_func: Callable, device: torch.device, clock: Optional[Clock] = None,
                 signals: Optional[RunSignals] = None):
        self.config = config
        self.device = device
        # every time the run reads (core/clock.py), on the run's device: device-synchronised on a GPU
        self.clock = (clock or Clock()).for_device(device)
        self.forward_step_func = forward_step_func
        self.pgs, self.rng_tracker = initialize(config, device)
        pgs = self.pgs
        # Last stage of the world's last site holds the loss (under fault tolerance a world is one site).
        self.log_rank = pgs.world_offset + dist.get_world_size() - 1

        self.tokenizer = build_tokenizer(config.tokenizer)
        config.model.padded_vocab_size = padded_vocab_size(
            self.tokenizer.vocab_size, config.tokenizer.make_vocab_size_divisible_by, config.dims.vocab_tp)

        model = build_model(model_provider, config, pgs, self.rng_tracker, device)  # per shard on a GPU
        # --compile: each layer's forward on its own (hooks stay outside); reported once after warm-up
        self.compile_report = CompileReport(compile_layers(model.layers)) if config.training.compile else None
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
        self.inter_site_devices = devices  # the loop's own inter-site collectives are checked too
        if config.fault_tolerance.enabled:  # elastic sites: torchft's group, quorum per round (elastic.py)
            comm, self.membership = elastic_site(config, pgs, self.clock, devices)
        else:
            dims = config.dims
            weight = dims.site_share(pgs.site_rank) if dims.heterogeneous else None  # tokens-weighted means
            comm = InterSiteComm(pgs.dp_inter, dims.sites, SimulatedLink(link.latency_ms, link.bandwidth_mbit),
                                 config.training.distributed_timeout_minutes, rank=pgs.rank, site=pgs.site_rank,
                                 devices=devices, clock=self.clock, site_weight=weight)
            if dims.mixed_layouts:  # no group joins a (tp, pp) coordinate across sites
                site_first = pgs.rank == dims.site_start(pgs.site_rank)
                self.membership = MixedLayoutSites(pgs.last_stages, dims.sites, pgs.tp_rank == 0 and
                                                   pgs.dp_intra_rank == 0, dims.site_share(pgs.site_rank), None,
                                                   site_first)
            else:
                self.membership = UnequalSites(pgs.dp, dims.sites, devices, pgs.dp_intra_rank == 0, weight) \
                    if dims.heterogeneous else AllSites(pgs.dp_inter, dims.sites, devices)
        units = model.sync_units()
        self.synchronizer = sync_cls(SyncContext(pgs=pgs, config=config.lsgd, models=[self.model],
                                                 optimizer=self.optimizer, comm=comm, units=units,
                                                 membership=self.membership))
        self.comm = comm
        self.phase = UnitHookPhase()
        self._wire_unit_hooks(units)

        t = config.training
        gbs = t.global_batch_size
        # where the run stands: the loop advances it; a checkpoint load or a heal restores it in place
        self.position = Position()
        # The one lockstep decision, declared by the synchronizer: which loop runs. Everything that
        # depends on it (the stop rule, the checkpoint's name, the log line, what a resume restores)
        # is the loop's.
        self.loop = LockstepLoop(config, pgs, self.position, self.membership, device, self.log_rank, self.clock,
                                 signals) if self.synchronizer.lockstep else \
            MeetingLoop(config, pgs, self.position, self.synchronizer, self.scheduler, self.clock, signals)
        eval_runs = (t.train_iters // t.eval_interval + 1) * t.eval_iters if t.eval_iters > 0 else 0
        # A synchronizer whose sites may take more micro-batches per step than configured
        # (ACCO/DPU's adaptive accumulation) says how many at most: size the stream for it.
        bound = self.synchronizer.microbatches_per_step_bound(config.num_microbatches)
        train_samples = self.loop.site_step_cap * gbs if bound == config.num_microbatches else \
            t.train_iters * bound * t.micro_batch_size * config.dims.dp
        # --full-validation: one pass over the split, however many evaluations (1 sample asks for one epoch).
        valid_samples = (1 if eval_runs else 0) if t.full_validation else eval_runs * gbs
        if t.skip_train:  # evaluation only: no training stream, one evaluation of each held-out set
            train_samples, valid_samples = 0, (1 if t.full_validation else t.eval_iters * gbs)
        # The test set is evaluated once, at the end: when named (--test-data-path) or under
        # --skip-train; --split's test share only under --skip-train (as before these flags).
        evaluates_test = t.eval_iters > 0 and (bool(config.data.test_data_path) or t.skip_train)
        test_samples = ((1 if t.full_validation else t.eval_iters * gbs) if evaluates_test else 0)
        train_ds, valid_ds, test_ds = datasets_provider(config, self.tokenizer,
                                                        (train_samples, valid_samples, test_samples or
                                                         t.eval_iters * gbs))
        if not t.skip_train:
            self._report_data_passes(train_ds, adaptive=bound != config.num_microbatches)
        self.eval_batches = self._evaluation_batches(valid_ds)
        self.test_ds = test_ds if evaluates_test else None
        self.test_batches = self._evaluation_batches(self.test_ds, "test")
        self.test_iterator = build_data_iterator(self.test_ds, 0, t.micro_batch_size, pgs, config.data.num_workers,
                                                 cyclic=True)
        self.train_ds = train_ds  # kept so a checkpoint load can restart the sampler at its consumed samples
        self.valid_ds = valid_ds
        self.train_iterator = build_data_iterator(train_ds, 0, t.micro_batch_size, pgs, config.data.num_workers)
        self.train_data = _CurrentIterator(self)  # what a step reads: train_iterator, even if replaced mid-step
        self.valid_iterator = build_data_iterator(valid_ds, 0, t.micro_batch_size, pgs, config.data.num_workers,
                                                  cyclic=True)
        self.forward_backward = get_forward_backward_func(pgs.dims.pp)  # this site's layout
        seq = config.model.seq_length // (pgs.dims.tp if config.model.sequence_parallel else 1)
        self.tensor_shape = (seq, t.micro_batch_size, config.model.hidden_size)
        self.straggler = Straggler(config.stragglers, pgs.rank, self.clock)
        self.inner_step = InnerStep(self.model, self.optimizer, self.scheduler, pgs, self.forward_backward,
                                    forward_step_func, self._schedule_spec, config.num_microbatches, self.straggler,
                                    self.phase, self.clock, samples_per_microbatch=t.micro_batch_size * config.dims.dp,
                                    empty_unused_memory_level=config.compat.empty_unused_memory_level)
        self.compat = CompatRuntime(config.compat, pgs.rank)  # --manual-gc, --profile
        self.flops_per_sample = compat_flops_per_sample(config.model, config.model.padded_vocab_size)
        self.heal: Optional[BeforeHeal] = None  # elastic sites: where this site stood when it took a live peer's state
        self.tb = TensorboardWriter(t.tensorboard_dir, enabled=pgs.rank == self.loop.line_rank)
        self.json_log = JsonLog(t.json_log, enabled=pgs.rank == self.loop.line_rank)
        self.last_saved_iteration = None
        if config.checkpoint.load and load_checkpoint(self, config.checkpoint):
            self.last_saved_iteration = self.checkpoint_iteration  # nothing new to save until the next step
        if config.fault_tolerance.enabled:
            register_healing_state(self, self.membership)

    def _simulated_clock(self, model) -> Clock:
        params = trained_parameters(model, self.pgs)  # collective: the replica's ranks
        dims, site, sharded = self.config.dims, self.pgs.site_rank, self.config.ddp.use_distributed_optimizer
        clock = build_simulated_clock(self.config.simulation, self.config.lsgd.link, dims, site, params,
                                      self.clock.streams, sharded_optimizer=sharded)
        if self.pgs.rank == dims.site_start(site):
            for line in describe(clock, self.config.simulation.scenario, params,
                                 optimizer_shard_scale(dims, site, sharded)):
                print(line if self.pgs.site_rank == 0 else f"{line} [site {self.pgs.site_rank}]", flush=True)
        return clock

    @property
    def checkpoint_iteration(self) -> int:
        """The agreed point a checkpoint is named by (the loop says which)."""
        return self.loop.checkpoint_iteration

    def save_checkpoint(self) -> None:
        self.synchronizer.quiesce()  # nothing in flight: the saved state is complete
        self.loop.settle_job_samples()
        save_checkpoint(self, self.config.checkpoint)
        self.last_saved_iteration = self.checkpoint_iteration

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

    def _reduce_site_losses(self, losses: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        """Mean over micro-batches and over the site's data-parallel ranks (last stage)."""
        if not self.pgs.is_last_stage or not losses:
            return {}
        out = {}
        for key in losses[0]:
            stacked = torch.stack([d[key].float() for d in losses])
            if stacked.dim() == 2:  # (loss sum, tokens) per micro-batch (--calculate-per-token-loss)
                pair = stacked.sum(0)
                if self.pgs.dp_intra_size > 1:
                    dist.all_reduce(pair, group=self.pgs.dp_intra)
                out[key] = (pair[0] / pair[1].clamp(min=1)).reshape(1)
                continue
            value = stacked.mean().reshape(1)
            if self.pgs.dp_intra_size > 1:
                value /= self.pgs.dp_intra_size
                dist.all_reduce(value, group=self.pgs.dp_intra)
            out[key] = value
        return out

    def _report_data_passes(self, train_ds, adaptive: bool) -> None:
        """Say how often the run's budget reads its training split: past one pass the model sees
        repeated data, and its losses (and gaps between runs) are no longer held-out figures."""
        if self.pgs.rank != self.log_rank:
            return
        t = self.config.training
        budget = t.train_samples or t.train_iters * t.global_batch_size
        passes = data_passes(train_ds, budget)
        if passes is None:
            return
        tokens, n = passes
        more = " at least (adaptive accumulation adds micro-batches)" if adaptive else ""
        repeat = ": the model will see repeated data" if n > 1 else ""
        reads = f"reads it {n:.2f} times" if n >= 0.995 else f"reads {100 * n:.2g}% of it"
        print(f"> training data: {tokens:,} tokens in the train split; the budget ({budget:,} samples of "
              f"{self.config.model.seq_length}) {reads}{more}{repeat}", flush=True)

    # ---- evaluation ----------------------------------------------------------------------------
    def _evaluation_batches(self, dataset, split: str = "validation") -> int:
        """Global batches per evaluation: --eval-iters, or with --full-validation as many whole
        batches as the split holds."""
        t = self.config.training
        if not t.full_validation or dataset is None:
            return t.eval_iters
        batches = len(dataset) // t.global_batch_size
        if batches == 0:
            source = f"--{'valid' if split == 'validation' else split}-data-path" if self.config.data.per_split \
                else f"--split {self.config.data.split}"
            raise ValueError(f"--full-validation: the {split} split ({source}) holds {len(dataset)} samples, fewer "
                             f"than one global batch ({t.global_batch_size}); give it more data")
        if self.pgs.rank == self.log_rank:
            print(f"> full validation: {batches} global batches ({batches * t.global_batch_size} samples) per "
                  f"evaluation of the {split} set", flush=True)
        return batches

    @torch.no_grad()
    def evaluate(self, split: str = "valid", label: str = "") -> Optional[float]:
        """The mean loss over one evaluation of the validation set (or, split "test", the test
        set); `label` is added to the log line (Megatron's "on test set")."""
        t = self.config.training
        valid = split == "valid"
        dataset, batches = (self.valid_ds, self.eval_batches) if valid else (self.test_ds, self.test_batches)
        iterator = self.valid_iterator if valid else self.test_iterator
        if iterator is None or t.eval_iters == 0:
            return None
        if t.full_validation:  # the whole split from its first sample, every time
            iterator = build_data_iterator(dataset, 0, t.micro_batch_size, self.pgs, self.config.data.num_workers)
            if valid:
                self.valid_iterator = iterator
        self.synchronizer.quiesce()  # evaluate a consistent model, nothing in flight
        self.compat.around_eval()
        self.model.eval()
        collected: List[Dict[str, torch.Tensor]] = []
        for _ in range(batches):
            collected += self.forward_backward(self.forward_step_func, iterator, self.model,
                                               self._schedule_spec(True), self.pgs)
            self.clock.compute(self.config.num_microbatches, forward_only=True)
        if valid:
            self.position.consumed_valid_samples += batches * t.global_batch_size
        self.model.train()
        self.compat.around_eval()
        reduced = mean_across_sites(self._reduce_site_losses(collected), self.membership, self.config.dims.sites) \
            if self.pgs.is_last_stage else {}
        loss = reduced.get("lm loss")
        if loss is not None and self.pgs.rank == self.log_rank:
            ppl = math.exp(min(20.0, loss))
            line = (f" validation loss at iteration {self.position.iteration}{label} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {ppl:.6E} |")
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
            name = "validation" if valid else "test"
            self.tb.scalars({f"lm loss {name}": loss, f"lm loss {name} ppl": ppl}, self.position.iteration)
        return loss

    def evaluate_only(self) -> TrainingResult:
        """--skip-train: one evaluation of the validation set and one of the test set (each if
        there is one), the model as loaded; nothing trained, nothing saved."""
        result = TrainingResult(model=self.model.module, config=self.config, iteration=self.position.iteration)
        loss = self.evaluate("valid", " on validation set")
        if loss is not None:
            result.validation_losses.append(loss)
            result.validation_iterations.append(self.position.iteration)
        result.test_loss = self.evaluate("test", " on test set")
        self.json_log.write({"event": "evaluated", "iteration": self.position.iteration, "validation_loss": loss,
                             "test_loss": result.test_loss})
        self.json_log.close()
        self.tb.close()
        self.compat.close()
        self.membership.close()
        return result

    # ---- what both loops share: the run, a step, a log line, acting on decisions, the end -----
    def train(self) -> TrainingResult:
        """Run the loop the synchronizer's `lockstep` calls for (lockstep_loop.py or
        meeting_loop.py), then finish: the last save, the summary and the result."""
        run = Run(result=TrainingResult(model=self.model.module, config=self.config),
                  acc=Interval(comm=self.comm.snapshot(), start=self.clock.now(),
                               consumed_before=self.position.consumed_samples,
                               site_consumed_before=self.position.site_consumed_samples),
                  start_iter=self.position.iteration, start_checkpoint_iteration=self.checkpoint_iteration)
        run.start = run.acc.run_start
        self.loop.run(run, self.step, self.log_interval, self.act_on)
        return self._finish(run)

    def _count_from_heal(self, run: Run) -> None:
        """After a heal (elastic.py) the site's position jumped to a live peer's: the log line
        under way and the run's step counts (traffic summary) start again from there."""
        if self.heal is None:
            return
        heal, self.heal = self.heal, None
        run.start_iter += self.position.iteration - heal.iteration
        run.start_checkpoint_iteration += self.checkpoint_iteration - heal.checkpoint_iteration
        run.acc.reset(heal.comm, self.position.consumed_samples, self.position.site_consumed_samples, heal.time)

    def step(self, run: Run) -> Taken:
        """One training step and what the log line accumulates from it. Returns what it took,
        for the loop to count the job's samples (and the step's global batch); or the step's
        Stop when training ended inside it, before it computed anything (StepResult.ended:
        an elastic site healed to the job's final state): no step was taken, and the loop
        stops at once (finish_training is not called again)."""
        t, acc, pos = self.config.training, run.acc, self.position
        self.inner_step.iteration = pos.iteration
        batch_schedule = self.config.compat.batch_schedule
        if batch_schedule is not None:
            self.inner_step.set_num_microbatches(batch_schedule.num_microbatches(pos.consumed_samples))
        step = self.synchronizer.train_step(self.inner_step, self.train_data, pos.iteration)
        self._count_from_heal(run)  # (before this step's counts: a heal happens at a step's start)
        if step.ended is not None:
            pos.ended = True
            return Taken(ended=step.ended)
        losses, ok, grad_norm = step.losses, step.update_successful, step.grad_norm
        pos.iteration += 1
        self._report_compile()
        # This site's position advances by its own micro-batches; the loop counts the job's.
        site_samples = step.num_microbatches * t.micro_batch_size * self.pgs.dp_intra_size
        pos.site_consumed_samples += site_samples
        acc.lr = step.lr  # None: the loop owns the scheduler and reads it when it logs (after any meeting)
        acc.iters += 1
        self.compat.after_step(pos.iteration)
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
        return Taken(site_samples, step.same_count_on_every_site)

    def _report_compile(self) -> None:
        """--compile: the graph-break/recompilation line, once, from one rank per pipeline stage
        (stages compile different layers, so each speaks for its own)."""
        line = self.compile_report.after_step(self.position.iteration) if self.compile_report is not None else None
        pgs = self.pgs
        if line and pgs.tp_rank == 0 and pgs.dp_intra_rank == 0 and pgs.site_rank == 0:
            print(f"> {line}" + (f" [PP stage {pgs.pp_rank}]" if pgs.dims.pp > 1 else ""), flush=True)

    def log_interval(self, run: Run) -> None:
        """One log line (and tensorboard scalars and a JSON record) for the interval just
        ended, printed by the loop's line rank; whose samples and losses it reports (the
        job's or this site's) is the loop's part (`interval_line`)."""
        if self.heal is not None:  # healed after the step (a-edit's meeting): its numbers went with the old state
            self._count_from_heal(run)
            return
        acc, result = run.acc, run.result
        elapsed = self.clock.now() - acc.start
        line = self.loop.interval_line(acc)
        gbs = acc.gbs if acc.gbs is not None else round(line.samples / acc.iters)  # of the last step, or the mean
        tokens = line.samples * self.config.model.seq_length
        if "lm loss" in line.means:
            result.logged_losses.append(line.means["lm loss"])
        comm_now = self.comm.snapshot()
        moved_mb = (comm_now["bytes_sent"] + comm_now["bytes_received"]
                    - acc.comm["bytes_sent"] - acc.comm["bytes_received"]) / 2**20
        exposed_ms = 1e3 * (comm_now["exposed_seconds"] - acc.comm["exposed_seconds"]) / acc.iters
        tokens_per_s = tokens / elapsed
        result.tokens_per_second = tokens_per_s
        if self.pgs.rank == self.loop.line_rank:
            iteration = self.position.iteration
            norm = acc.norm_sum / acc.norm_count if acc.norm_count else None
            lr = acc.lr if acc.lr is not None else self.scheduler.current_lr
            extra = {"tokens/s": f"{tokens_per_s:.1f}", "inter-site MB": f"{moved_mb:.2f}",
                     "exposed comm ms": f"{exposed_ms:.1f}"}
            if self.config.compat.log_throughput:  # Megatron's field: model FLOP/s per rank
                tflops = self.flops_per_sample * line.samples / elapsed / line.ranks / 1e12
                extra["throughput per GPU (TFLOP/s/GPU)"] = f"{tflops:.3f}"
            extra = {**line.lead, **extra, **line.tail}
            extra.update({k: f"{v:.4g}" for k, v in self.synchronizer.stats().items()})
            print(training_log_line(iteration, line.of_iters, line.consumed, 1e3 * elapsed / acc.iters,
                                    lr, gbs, line.means, self.optimizer.loss_scale, norm,
                                    acc.skipped, acc.nans, extra), flush=True)
            self.tb.scalars({**{k: v for k, v in line.means.items()},
                             "learning-rate": lr, "grad-norm": norm,
                             "loss-scale": self.optimizer.loss_scale, "batch-size": gbs,
                             "iteration-time": elapsed / acc.iters, "tokens-per-sec": tokens_per_s,
                             "inter-site-MB": moved_mb, "exposed-comm-ms": exposed_ms,
                             **self.synchronizer.stats()}, iteration)
            self.json_log.write({"iteration": iteration, "interval_iters": acc.iters,
                                 "elapsed_s": elapsed, "wall_s": self.clock.now() - acc.run_start,
                                 "tokens": tokens, "tokens_per_s": tokens_per_s,
                                 "losses": line.means, "inter_site_bytes": moved_mb * 2**20,
                                 "exposed_comm_s": exposed_ms * acc.iters / 1e3,
                                 "inter_site_totals": comm_now,  # this process's, since it started
                                 "sync_stats": self.synchronizer.stats(), **self.loop.tags})
        acc.reset(comm_now, self.position.consumed_samples, self.position.site_consumed_samples, self.clock.now())

    def act_on(self, run: Run, stop: Optional[Stop], eval_due: bool, save_due: bool) -> bool:
        """After a step's decisions: close training, evaluate, save; True when the loop stops."""
        if stop is not None and stop.ends_training:  # before the final evaluation and save
            self.synchronizer.finish_training(self.position.iteration)
            self.position.ended = True
            if self.synchronizer.ended() is not None:  # healed to the job's final state while closing: the
                return True  # others have left (no evaluation over the sites); _finish saves it
        if self.config.training.eval_iters > 0 and eval_due:
            before = self.clock.now()
            loss = self.evaluate()
            if loss is not None:
                run.result.validation_losses.append(loss)
                run.result.validation_seconds.append(before - run.start - run.result.evaluation_seconds)
                run.result.validation_iterations.append(self.position.iteration)
            run.acc.start = self.clock.now()
            run.result.evaluation_seconds += run.acc.start - before
        if self.config.checkpoint.save and save_due:
            self.save_checkpoint()
        if stop is None:
            return False
        if not stop.ends_training:
            print_rank(f"exiting at iteration {self.position.iteration} ({stop.reason})", self.pgs.rank,
                       self.loop.line_rank)
        return True

    def _finish(self, run: Run) -> TrainingResult:
        """Quiesce, the last save, the run's summary and its log lines."""
        result, run_start, total_skipped, pos = run.result, run.start, run.skipped, self.position
        self.synchronizer.quiesce()
        if pos.ended:  # the budget is reached: a site that missed the end may take this state now
            self.membership.job_finished()
            self._count_from_heal(run)
        self.loop.termination.close()
        self.loop.settle_job_samples()
        if self.test_ds is not None:  # --test-data-path: the trained model on the test set, once
            result.test_loss = self.evaluate("test", " on test set")
        result.iteration = pos.iteration
        result.skipped_iterations = total_skipped
        result.consumed_samples, result.site_consumed_samples = pos.consumed_samples, pos.site_consumed_samples
        if self.config.checkpoint.save and self.last_saved_iteration != self.checkpoint_iteration and \
                pos.iteration > 0:
            self.save_checkpoint()
        result.comm, result.sync_stats = self.comm.snapshot(), self.synchronizer.stats()
        result.clock_seconds = self.clock.now() - run_start
        result.synchronizer = self.synchronizer
        result.compile_counts = self.compile_report.counts if self.compile_report is not None else None
        if self.config.dims.sites > 1:  # collective: what crossed sites against per-step sync (each rank's own steps)
            result.traffic = cross_site_traffic(self.comm, self.optimizer.views().grad, pos.iteration - run.start_iter,
                                                self.device)
        if self.pgs.rank == self.loop.line_rank:
            rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            clock = " on the simulated clock" if self.clock.simulated else ""
            print(f" done: {pos.iteration} iterations{self.loop.where} in {self.clock.now() - run_start:.1f} s"
                  f"{clock} | skipped iterations: {total_skipped} | peak RSS (MB): {rss_mb:.0f}", flush=True)
            record = dict(self.loop.tags)
            cuda_memory = peak_cuda_memory_mb(self.device)
            if cuda_memory:
                print(f" peak CUDA memory (MB): {cuda_memory['peak_cuda_allocated_mb']:.0f} allocated, "
                      f"{cuda_memory['peak_cuda_reserved_mb']:.0f} reserved", flush=True)
                record.update(cuda_memory)
            if result.traffic and self.pgs.rank == self.log_rank:
                steps = self.checkpoint_iteration - run.start_checkpoint_iteration  # the job's, in global batches
                ranks = f"site {self.pgs.site_rank}'s ranks" if self.config.fault_tolerance.enabled else "all ranks"
                print(summary_line(self.config.lsgd.algorithm, steps, result.traffic, ranks), flush=True)
            self.json_log.write({"event": "done", "iteration": pos.iteration, "peak_rss_mb": rss_mb,
                                 "wall_s": self.clock.now() - run_start, "inter_site_totals": result.comm,
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
        per_site = f"DP {','.join(map(str, d.site_dp))} on its" if d.heterogeneous else f"DP {d.dp_intra} per site x"
        layout = f"TP {','.join(map(str, d.site_tp))} x PP {','.join(map(str, d.site_pp))}" if d.mixed_layouts \
            else f"TP {d.tp} x PP {d.pp}"
        print(f"> megatron_lsgd: world {d.world_size} = {layout} x {per_site} "
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
            return trainer.evaluate_only() if config.training.skip_train else trainer.train()
        except RUN_ERRORS as err:
            _exit_on_bad_input(err, prefix=f"iteration {trainer.position.iteration + 1}: " if isinstance(
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
