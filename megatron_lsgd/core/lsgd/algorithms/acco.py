"""`dpu` and `acco`: gradient-synchronous training in which the cross-site gradient reduce
and the (ZeRO-1) optimizer step of one round run on a thread of their own while the next
round's gradients are computed (DESIGN.md §4.6; ACCO, Nabli et al., Algorithm 1 in
appendix B.2; DPU, Ren et al., as re-purposed there).

Notation: θ the committed parameters (the optimizer's fp32 main shards), Opt the inner
optimizer step (AdamW, clipping, LR schedule), ḡ a gradient averaged over sites with every
site weighted by the micro-batches it computed: ḡ = Σ_s n_s g_s / Σ_s n_s, where g_s is the
site's mean over its n_s micro-batches per data-parallel rank.

`dpu` (delayed parameter update), one stage per step. Step k computes g_k at the
parameters the model holds, θ_{k-1}, while the worker thread reduces g_{k-1} across sites
and applies it:

    compute  g_k at θ_{k-1}          ‖   worker  θ_k = Opt(θ_{k-1}, ḡ_{k-1})
    then     model <- θ_k; the worker starts on g_k: θ_{k+1} = Opt(θ_k, ḡ_k)

so every update uses gradients taken one update earlier (θ_{-1} = θ_0: the first two
gradients are both taken at θ_0, the paper's initialization). `--lsgd-dpu-warmup-iters W`
waits for the first W updates at the end of their own step (the model takes θ_{k+1} before
step k+1 computes): ZeRO-Offload's warm-up of undelayed steps.

`acco`, two stages per step, no stale gradient. Each site's micro-batches of a step are
split: n~ in the estimate stage, n in the real stage.

    stage 1  compute g~_k at θ~_k     ‖   worker  θ_k = Opt(θ_{k-1}, (Σn~ ḡ~_{k-1} + Σn ḡ_{k-1}) / (Σn~ + Σn))
             model <- θ_k; the worker starts the estimate on g~_k
    stage 2  compute g_k at θ_k       ‖   worker  θ~_{k+1} = Opt(θ_k, ḡ~_k), nothing committed
             model <- θ~_{k+1}; the worker starts the real step on g_k (and the kept ḡ~_k)

with θ~_0 = θ_0. The real update of θ_k combines gradients taken at θ_k and at θ~_k (one
estimated step ahead), never at an older θ.

Every step's real update is started at the end of that step and finishes during the next,
so after --train-iters T steps `finish_training` waits for the last one: T updates, and
every micro-batch computed went into exactly one of them.

Micro-batches per stage (`--lsgd-accumulation`):
- fixed: exactly the configured count (n_s = --lsgd-site-microbatches, default the count
  --global-batch-size gives; acco splits it n~ = n_s // 2, n = n_s - n~). Deterministic.
- adaptive (default): at least that count, then one more micro-batch at a time while the
  worker is still busy with the previous stage and one more is expected to end before it
  does (the last job of the same kind's length against the stage's measured micro-batch
  time; the first jobs, unmeasured, are waited for as long as they run), up to
  --lsgd-max-microbatches; a faster site computes more and weighs more. A micro-batch that
  would outlast the job is not started: it would delay this site's hand-over, and so the
  next exchange for every site (with a 4x slower site whose micro-batch was shorter than
  the exchange, starting it anyway ran 1.54 updates/s, docs/algorithms/acco.md). Every
  rank of a site must run the same number of pipeline schedules, so after each micro-batch
  beyond the minimum the site agrees (all-reduce MIN of "stop" over the site group, a few
  bytes on the fast links), and on the worker thread the counts travel across sites beside
  the gradients (an all-gather of one integer, not waited for before the mean: the sites
  average n_s g_s and divide by the mean count, see `_mean_across_sites`). The extra
  micro-batches accumulate over separate schedule calls (whole micro-batches through the
  whole pipeline), with a common loss divisor and one rescale at the end.

Threads, process groups and the ordering rule. The compute thread (the caller of
train_step) issues everything it always did: TP all-reduces and PP sends/receives inside
compute_grads, the intra-site reduce (reduce_in_site) and the intra-site all-gather that
puts new parameters into the model, the site agreement above, and the training loop's own
collectives. The worker thread issues only the round's background collectives: the count
all-gather and the gradient mean across sites on the synchronizer's own dp_inter group
(`comm.use_dedicated_group`), the optimizer's norm all-reduces on its own dp_intra and
model_parallel groups, and the loss-scale check on its own site group (parallel_state.
clone_groups). No process group is used by both threads, so each group sees one thread's
collectives, in program order, identical on every rank. The worker runs one job at a time,
in the order submitted, and the compute thread waits for job j before submitting job j+1,
so every rank runs the same job sequence. A job's collectives therefore only wait for the
same job on other ranks, which every rank submits after the same compute stage; the
compute thread waits for a job only after it has issued all its own collectives of the
stage; no cycle of waits can form.

Double buffering: the DDP layer holds two gradient storages; compute writes into one while
the worker reads the other (DistributedDataParallel.use_grad_storage). The optimizer keeps
fp32 main parameters apart from the model's (`overlaps_optimizer_step`), so the worker's
step never writes into parameters being read by a forward pass; the compute thread puts
new parameters into the model only between stages.

Checkpoints: `quiesce()` waits for the update in flight and puts the committed θ into the
model (what evaluation and the checkpoint's model files see), keeping the parameters the
next compute must use (θ_{k-1} for dpu, θ~_k for acco) as this rank's shard in the
synchronizer state; the next step restores them. Nothing else is in flight between steps.

On a GPU (core/streams.py; the same calls are no-ops on the host, and a CPU test checks
their order with a recording double):
- streams: the worker runs on a CUDA stream of its own, so the compute stream never queues
  behind its mean or optimizer step (and a `.item()` on the compute thread never waits for
  them). Two events order the handover, nothing else waits: the compute stream records one
  after the intra-site reduce that wrote the gradient storage (and after its last read of
  the main parameters the job will write); the worker's stream waits for it before the
  job. The job records one when its work is queued; the compute stream waits for it
  before the model takes the job's parameters (and so before it next writes the storage
  that job read, a stage later). Long-lived buffers (the two gradient storages, the
  main shards, θ~ and ḡ~) are never freed while a job runs; the trial step restores the
  optimizer state in place rather than dropping tensors another stream allocated.
- collectives: NCCL kernels launched from two threads on different communicators may be
  launched in a different order on different ranks, depending on timing; a kernel that
  cannot start behind another that waits for a peer (or a device-wide synchronisation
  between them) can then deadlock. So, by construction, only the compute thread launches
  NCCL kernels: on a GPU the worker's groups (its dp_inter, dp_intra, model_parallel, site
  and Muon's tp) are gloo groups (`devices.worker_group_backend`), and acco/dpu's
  inter-site backend is gloo (`--inter-site-backend nccl` is refused). The worker's inter-
  site payloads are staged through pinned host memory (devices.Staging); its intra-site
  collectives are the gradient norm's few bytes (plus, without ZeRO-1 and with DP_intra > 1,
  the all-gather of the site's split, and Muon's matrices: those cross the host, on the
  worker, hidden behind compute as long as they fit in it). The NCCL communicators are then
  used by one thread each, in program order, identical on every rank; gloo's collectives
  block only the threads that issue them, so the no-cycle argument above applies as is.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lsgd.core.clock import Job
from megatron_lsgd.core.lsgd.agreement import agree_in_site
from megatron_lsgd.core.lsgd.comm import Tally
from megatron_lsgd.core.lsgd.compressors import CompressorBank, compression_error
from megatron_lsgd.core.lsgd.devices import worker_group_backend
from megatron_lsgd.core.options import OptionGroup, option
from megatron_lsgd.core.lsgd.protocol import StepResult, SyncContext, Synchronizer
from megatron_lsgd.core.lsgd.reduction import run_blocking
from megatron_lsgd.core.lsgd.registry import register
from megatron_lsgd.core.lsgd.site_split import SiteSplit
from megatron_lsgd.core.parallel_state import clone_groups

ACCUMULATION = ("adaptive", "fixed")
DEFAULT_MAX_FACTOR = 16  # --lsgd-max-microbatches 0: this many times a stage's minimum


def parse_site_counts(text: str, num_sites: int) -> Optional[List[int]]:
    """'2,4' -> [2, 4]; '' -> None. Raises ValueError naming the flag."""
    if not text:
        return None
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if len(counts) != num_sites or any(c < 1 for c in counts):
        raise ValueError(f"--lsgd-site-microbatches {text!r}: expected one positive integer per site "
                         f"({num_sites} sites), e.g. {','.join(['2'] * num_sites)}")
    return counts


@dataclass
class OverlapOptions(OptionGroup):
    accumulation: str = option(
        "--lsgd-accumulation", "adaptive",
        "micro-batches per stage: adaptive = at least the configured count, then more while the previous "
        "stage's reduce and optimizer step still run and one more fits before they end (a faster site "
        "computes more and weighs more); "
        "fixed = exactly the configured count (deterministic)", choices=ACCUMULATION)
    site_microbatches: str = option(
        "--lsgd-site-microbatches", "",
        "micro-batches per data-parallel rank per step for each site, comma-separated (default: the count "
        "--global-batch-size gives, on every site); acco splits each into its two stages",
        metavar="N0,N1,...")
    max_microbatches: int = option(
        "--lsgd-max-microbatches", 0,
        f"adaptive: most micro-batches one stage may accumulate (0: {DEFAULT_MAX_FACTOR} x the stage's "
        f"minimum); the training data stream is sized for it")

    stages: ClassVar[int] = 1

    def site_counts(self, num_sites: int, configured: int) -> List[int]:
        return parse_site_counts(self.site_microbatches, num_sites) or [configured] * num_sites

    def stage_minimums(self, count: int) -> List[int]:
        """A site's micro-batches per step, per stage (estimate first for acco)."""
        if self.stages == 1:
            return [count]
        return [count // 2, count - count // 2]

    def stage_cap(self, minimum: int) -> int:
        if self.accumulation == "fixed":
            return minimum
        return max(minimum, self.max_microbatches or DEFAULT_MAX_FACTOR * minimum)

    def equal_counts(self, num_sites: int, configured: int) -> bool:
        return self.accumulation == "fixed" and len(set(self.site_counts(num_sites, configured))) == 1

    def validate(self, config, num_sites: int, run=None, **_) -> None:
        name = config.algorithm
        if self.accumulation not in ACCUMULATION:
            raise ValueError(f"--lsgd-accumulation {self.accumulation!r}: choose adaptive or fixed")
        counts = parse_site_counts(self.site_microbatches, num_sites)
        if self.max_microbatches < 0:
            raise ValueError(f"--lsgd-max-microbatches must be >= 0 (got {self.max_microbatches}; 0: "
                             f"{DEFAULT_MAX_FACTOR} x the stage's minimum)")
        if run is None:
            return
        if run.fp16:
            raise ValueError(f"--fp16 is not supported by --lsgd-algorithm {name}: a gradient would be computed "
                             f"under one dynamic loss scale and applied after the scaler changed it; use --bf16")
        counts = counts or [run.num_microbatches] * num_sites
        if self.stages == 2 and min(counts) < 2:
            raise ValueError(
                f"--lsgd-algorithm acco splits each step's micro-batches into an estimate and a real stage, so "
                f"every site needs at least 2 micro-batches per data-parallel rank per step (got {min(counts)}): "
                f"raise --global-batch-size to at least 2 x --micro-batch-size x the data-parallel size, or set "
                f"--lsgd-site-microbatches")
        smallest = max(min(self.stage_minimums(c)) for c in counts)
        if self.accumulation == "adaptive" and 0 < self.max_microbatches < smallest:
            raise ValueError(f"--lsgd-max-microbatches {self.max_microbatches} is below a stage's minimum "
                             f"({smallest} micro-batches)")
        if run.per_token_loss:
            raise ValueError(f"--calculate-per-token-loss is not supported by --lsgd-algorithm {name}: sites are "
                             f"weighted by the micro-batches they computed, not by loss tokens")
        if run.batch_schedule_flag and self.stages == 2:
            raise ValueError(f"{run.batch_schedule_flag} is not supported by --lsgd-algorithm acco: a small early "
                             f"global batch would leave a stage without a micro-batch (use --lsgd-algorithm dpu "
                             f"with --lsgd-accumulation fixed, or a constant --global-batch-size)")
        if run.batch_schedule_flag and (self.accumulation != "fixed" or self.site_microbatches):
            raise ValueError(f"{run.batch_schedule_flag} needs --lsgd-accumulation fixed (and no "
                             f"--lsgd-site-microbatches) under --lsgd-algorithm {name}: the schedule sets every "
                             f"site's micro-batches from the job's consumed samples")
        if run.sample_budget_flag and not (self.accumulation == "fixed" and len(set(counts)) == 1):
            raise ValueError(
                f"{run.sample_budget_flag} needs --lsgd-accumulation fixed and the same micro-batches on every "
                f"site under --lsgd-algorithm {name}: otherwise the samples per step vary and the budget cannot "
                f"be met exactly; bound the run with --train-iters or --exit-duration-in-mins instead")


@dataclass
class DpuOptions(OverlapOptions):
    warmup_iters: int = option(
        "--lsgd-dpu-warmup-iters", 0,
        "first steps whose update lands before the next step computes (no stale gradient, nothing "
        "overlapped), as ZeRO-Offload advises for its delayed parameter update; then every update is delayed",
        metavar="W")

    def validate(self, config, num_sites: int, run=None, **kw) -> None:
        super().validate(config, num_sites, run=run, **kw)
        if self.warmup_iters < 0:
            raise ValueError(f"--lsgd-dpu-warmup-iters must be >= 0 (got {self.warmup_iters})")


@dataclass
class AccoOptions(OverlapOptions):
    stages: ClassVar[int] = 2


class _Worker:
    """One daemon thread running submitted jobs one at a time, in order (a daemon, so a run
    that fails elsewhere is not kept alive by a job stuck in a collective), with the run's
    device set and a stream of its own as its current stream (core/streams.py)."""

    def __init__(self, name: str, device: torch.device, streams):
        self._jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self._device = device
        self._streams = streams
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        if self._device.type == "cuda":  # the current GPU is per thread: a new one starts on cuda:0
            torch.cuda.set_device(self._device)
        with self._streams.running_on(self._streams.side_stream()):  # never the compute stream
            while True:
                future, fn, args = self._jobs.get()
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # handed to the compute thread by future.result()
                    future.set_exception(err)


@dataclass
class _JobResult:
    kind: str
    counts: List[int]  # every site's micro-batches in this stage (per data-parallel rank)
    grad_norm: Optional[float]
    tally: Tally  # the job's inter-site bytes and rounds, settled when the compute thread has waited for it
    done: object  # event after the job's last work on the worker's stream (core/streams.py)
    lr: float  # the scheduler's LR after the job (read on the worker, which steps it)


class OverlappedGradientSync(Synchronizer):
    """Shared by dpu and acco: stages, accumulation, the worker thread, double buffering."""

    fault_tolerance_refusal = ("its worker thread reduces gradients across sites on groups of its own while the "
                               "next ones are computed, so no step boundary is free of a reduction in flight for a "
                               "quorum to rebuild the groups at")

    Options = OverlapOptions
    uses = frozenset({"compression"})
    overlaps_optimizer_step = True
    communicates_from_a_thread = True
    stage_kinds: ClassVar[Tuple[str, ...]] = ()  # per stage: "estimate" (acco's trial step) or "commit"

    def __init__(self, ctx: SyncContext):
        super().__init__(ctx)
        if len(ctx.models) != 1:
            raise ValueError(f"--lsgd-algorithm {self.name} supports one model chunk per rank")
        cfg = ctx.config
        self.opts: OverlapOptions = cfg.algo
        self.model = ctx.models[0]
        self.optimizer = ctx.optimizer
        self.comm = ctx.comm
        self.pgs = ctx.pgs
        self.sites = ctx.comm.num_sites
        timeout = ctx.comm.group_timeout()
        # Groups of the worker thread's own, gloo on GPUs (see the module docstring's ordering rule).
        ctx.comm.use_dedicated_group(ctx.pgs.dims)
        # --optimizer muon assembles its matrices over tp too, inside the worker's step
        kinds = ("dp_intra", "model_parallel", "site") + (("tp",) if ctx.uses_muon else ())
        self.worker_groups = clone_groups(ctx.pgs, kinds, timeout, worker_group_backend(ctx.device)) \
            if dist.is_initialized() else ctx.pgs
        self.storages = (self.model.active_grad_storage, self.model.add_grad_storage())
        self.computing = 0  # index into self.storages: where compute accumulates
        self.views = ctx.optimizer.views()  # the whole model: one fragment
        # Without ZeRO-1 every rank of a site holds the whole reduced gradient: each sends its
        # 1/DP_intra part across sites and the site all-gathers (as sync does).
        self.split = SiteSplit(ctx.pgs, ctx.optimizer.sharded)
        self.part = self.split.mine(self.views)
        self.device = device = self.views.main[0].device  # small control tensors live here too (NCCL)
        self.compressors = CompressorBank(cfg.compression, ctx.comm, cfg.seed)
        self.compressor = self.compressors.for_views(self.part, device) \
            if cfg.compression.enabled and self.sites > 1 and self.part.ranges else None
        if self.opts.stages == 2:
            self._theta_est = [torch.zeros_like(m) for m in ctx.optimizer.main_param_shards()]
            self._g_est = [torch.zeros_like(m) for m in ctx.optimizer.main_param_shards()]
            self._n_est = 0
        self.clock = ctx.clock
        self.streams = ctx.clock.streams  # the run device's (core/streams.py): no-ops on the host
        self._worker = _Worker(f"lsgd-{self.name}", device, self.streams)
        self._job: Optional[Future] = None
        self._job_clock: Optional[Job] = None  # the job's timeline on the run's clock
        self._job_kind = ""  # the job in flight's stage kind
        self._job_seconds: Dict[str, float] = {}  # per stage kind: how long its last job took
        self._load_after_compute: Optional[str] = None  # "main" or "estimate": what the model takes next
        self._stash: Optional[List[torch.Tensor]] = None  # the model's shard to restore (after quiesce)
        self._configured: Optional[int] = None
        self._norm: Optional[float] = None
        self._committed_lr: Optional[float] = None  # the LR of the last update waited for (what the log reads)
        self._compression_stats: Dict[str, float] = {}  # the compressor's, as of the last job waited for
        self._round_counts = [0] * self.sites
        self.last_round_counts: List[int] = []
        self.rounds = 0
        self.extra_microbatches = 0  # adaptive: micro-batches beyond the minimum, this site

    # ---- counts --------------------------------------------------------------------------------
    def microbatches_per_step_bound(self, configured: int) -> int:
        self._configured = configured
        return max(sum(self.opts.stage_cap(m) for m in self.opts.stage_minimums(c))
                   for c in self.opts.site_counts(self.sites, configured))

    def _stage_minimum(self, site: int, stage: int) -> int:
        return self.opts.stage_minimums(self.opts.site_counts(self.sites, self._configured)[site])[stage]

    # ---- the compute thread ------------------------------------------------------------------
    def train_step(self, step, data_iterator, iteration: int) -> StepResult:
        self._configured = step.num_microbatches
        if self._job is None:  # no job in flight: this thread may read the scheduler
            self._committed_lr = step.current_lr
        self._restore_stash()
        losses, total = [], 0
        for stage, kind in enumerate(self.stage_kinds):
            stage_losses, n = self._stage(step, data_iterator, stage, kind)
            losses += stage_losses
            total += n
        if iteration < self.undelayed_steps():  # the update lands now: the next step computes at it
            self._finish_job()
            self._load_model()
        norm, self._norm = self._norm, None
        equal = self.opts.equal_counts(self.sites, self._configured)
        return StepResult(losses, True, norm, total, same_count_on_every_site=equal, lr=self._committed_lr)

    def undelayed_steps(self) -> int:
        """Steps at the start whose update is waited for at the end of the step."""
        return 0

    def _stage(self, step, data_iterator, stage: int, kind: str) -> Tuple[list, int]:
        minimum = self._stage_minimum(self.pgs.site_rank, stage)
        losses, n = self._accumulate(step, data_iterator, minimum)
        self._finish_job()
        self._load_model()
        step.reduce_in_site()
        # The job may start once the compute stream has written the storage (the reduce) and
        # read the main parameters the job will write (the load): the worker's stream waits here.
        handed_over = self.streams.record()
        storage = self.storages[self.computing]
        self._job_clock = self.clock.start_job()  # the worker's timeline forks from this moment
        self._job = self._worker.submit(self._timed_job, self._job_clock, handed_over, kind, stage, storage, n, step)
        self._job_kind = kind
        self._load_after_compute = "main" if kind == "commit" else "estimate"
        self.computing ^= 1
        self.model.use_grad_storage(self.storages[self.computing])
        return losses, n

    def _accumulate(self, step, data_iterator, minimum: int) -> Tuple[list, int]:
        step.zero_grads()
        if self.opts.accumulation == "fixed":
            return step.compute_grads(data_iterator, minimum), minimum
        began = self.clock.now()
        losses = step.compute_grads(data_iterator, minimum, accumulate_only=True)
        n, cap = minimum, self.opts.stage_cap(minimum)
        ended = self.clock.now()
        microbatch = (ended - began) / minimum  # this stage's pace, updated by each extra one
        while n < cap and not self._site_agrees_to_stop(microbatch, ended):
            losses += step.compute_grads(data_iterator, 1, loss_divisor=minimum, accumulate_only=True)
            n += 1
            began, ended = ended, self.clock.now()
            microbatch = ended - began
        if n > minimum:  # every micro-batch's loss was divided by `minimum`: make it the mean over n
            self.model.scale_grads(minimum / n)
            self.extra_microbatches += n - minimum
        return losses, n

    def _site_agrees_to_stop(self, microbatch: float, now: float) -> bool:
        """Whether the site stops accumulating: True on every rank of the site once every rank
        would (MIN over the site). A rank would once its worker is done, or when one more
        micro-batch is expected to end after the job does (the last job of the same kind took
        as long as this one will): a micro-batch that outlasts the job delays this site's
        hand-over, and so the next exchange, for every site."""
        stop = self._job is None or self.clock.done_by_now(self._job_clock)
        expected = self._job_seconds.get(self._job_kind)
        if not stop and expected is not None:
            stop = self._job_clock.start + expected - now < microbatch
        flag = torch.tensor([1 if stop else 0], dtype=torch.int32, device=self.device)
        agree_in_site(flag, self.pgs, dist.ReduceOp.MIN)
        return bool(flag.item())

    def _finish_job(self) -> None:
        """Wait for the job in flight (time counted as exposed communication)."""
        if self._job is None:
            return
        # Marks, not readings: on a GPU they time the compute stream's wait for the job's end
        # where it happens, and the host does not wait for the stream here (core/clock.py).
        start = self.clock.mark()
        result: _JobResult = self._job.result()
        self.streams.wait(result.done)  # what the compute stream queues next sees the job's results
        self.clock.join(self._job_clock)
        self._job_seconds[result.kind] = self._job_clock.seconds()
        self.comm.record_exposed_between(start, self.clock.mark())
        self.comm.settle(result.tally)
        self._compression_stats = compression_error([self.compressor])  # the worker is idle now
        self._job = None
        self._round_counts = [a + b for a, b in zip(self._round_counts, result.counts)]
        if result.kind == "commit":
            self._norm = result.grad_norm
            self._committed_lr = result.lr
            self.last_round_counts, self._round_counts = self._round_counts, [0] * self.sites
            self.rounds += 1

    def _load_model(self) -> None:
        """Between stages only: put what the finished job produced into the model."""
        if self._load_after_compute == "main":
            self.optimizer.copy_main_to_model_params()
        elif self._load_after_compute == "estimate":
            self.optimizer.copy_main_to_model_params(source=self._theta_est)
        self._load_after_compute = None

    def _restore_stash(self) -> None:
        if self._stash is None:
            return
        self.optimizer.copy_main_to_model_params(source=self._stash)
        self._stash = None
        self._load_after_compute = "main"  # after the next compute the model takes θ again

    # ---- the worker thread ---------------------------------------------------------------------
    def _timed_job(self, job: Job, handed_over, *args) -> _JobResult:
        self.streams.wait(handed_over)  # the compute stream's reduce into the storage, and its reads of θ
        with self.clock.bound(job):
            result = self._job_fn(*args)
            # The job ends when its device work has run, not when this thread has queued it (an
            # optimizer step may still be on the stream): adaptive accumulation asks whether it
            # is done, and its length predicts the next one's. Only this thread waits.
            self.streams.synchronize()
            return result

    @torch.no_grad()
    def _job_fn(self, kind: str, stage: int, storage: int, count: int, step) -> _JobResult:
        with self.comm.overlapped() as tally:
            grads = self.model.grad_shards(storage)
            counts = self._mean_across_sites(grads, count, stage)
            total = sum(counts)
            per_mb = step.samples_per_microbatch // self.sites  # samples of one micro-batch on every rank of a site
            if kind == "estimate":
                for kept, g in zip(self._g_est, grads):
                    kept.copy_(g)  # the real step needs it unclipped
                self._n_est = total
                # The LR of the coming real step (exact with fixed counts; with adaptive ones the
                # real stage's count is not known yet, its minimum stands in, for sample-based LRs).
                real = sum(self._stage_minimum(s, stage + 1) for s in range(self.sites))
                _, norm = step.trial_apply(self._theta_est, grads=grads, groups=self.worker_groups,
                                           samples=(total + real) * per_mb)
            else:
                samples = total
                if self.opts.stages == 2:  # (Σn~ ḡ~ + Σn ḡ) / (Σn~ + Σn)
                    w_est = self._n_est / (self._n_est + total)
                    for g, kept in zip(grads, self._g_est):
                        g.mul_(1.0 - w_est).add_(kept, alpha=w_est)
                    samples += self._n_est
                _, norm = step.apply(grads=grads, groups=self.worker_groups, copy_to_model=False,
                                     samples=samples * per_mb)
        return _JobResult(kind, counts, norm, tally, self.streams.record(), step.current_lr)

    def _mean_across_sites(self, grads: List[torch.Tensor], count: int, stage: int) -> List[int]:
        """grads <- Σ_s n_s g_s / Σ_s n_s, identical on every site (this rank's shard); returns
        every site's n_s. Adaptive counts are not known in advance: their all-gather (a few
        bytes) is issued first and not waited for, the sites average n_s g_s beside it, and the
        result is divided by the mean count, so the counts cost no round trip of their own."""
        if self.sites == 1:
            return [count]
        fixed = self.opts.accumulation == "fixed"
        counts = [self._stage_minimum(s, stage) for s in range(self.sites)] if fixed else []
        if not fixed:  # on the group's device: the host reads them, nothing to stage (gloo on a GPU run)
            on = self.comm.devices.group
            gathered = torch.zeros(self.sites, dtype=torch.int64, device=on)
            pending = self.comm.all_gather(gathered, torch.tensor([count], dtype=torch.int64, device=on),
                                           async_op=True)
        weight = count * self.sites / sum(counts) if fixed else float(count)
        mine = self.part.select(grads) if self.split.active else grads
        if mine:
            if weight != 1.0:
                for g in mine:
                    g.mul_(weight)
            if self.compressor is None:
                handles = [self.comm.all_reduce_mean(g, async_op=True) for g in mine]
                for h in handles:
                    h.wait()
            else:
                for g, mean in zip(mine, run_blocking(self.compressor.reduce(mine))):
                    g.copy_(mean)
        if not fixed:
            pending.wait()
            counts = gathered.tolist()
            for g in mine:  # the mean of n_s g_s over the mean count
                g.mul_(self.sites / sum(counts))
        self.split.gather(grads, self.worker_groups.dp_intra)
        self.comm.count_round()
        return counts

    # ---- protocol --------------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Wait for the update in flight and put the committed θ into the model, keeping
        the parameters the next compute uses (restored by the next train_step)."""
        self._finish_job()
        if self._load_after_compute is None or self._stash is not None:
            return
        if self._load_after_compute != "main":
            raise RuntimeError("quiesce() between the stages of a step")
        self._stash = [t.clone() for t in self.optimizer.model_param_shards()]
        self.optimizer.copy_main_to_model_params()

    def finish_training(self, iteration: int) -> None:
        """The last update lands; every site ends with the same committed θ."""
        self._finish_job()
        if self._stash is None and self._load_after_compute == "main":
            self.optimizer.copy_main_to_model_params()
        self._stash, self._load_after_compute = None, None

    def state_dict(self) -> Dict:
        # quiesce() waited for the job and stashed the next compute's parameters.
        self.require_quiesced(self._job is not None or (self._load_after_compute == "main" and self._stash is None))
        return {"stash": [t.clone() for t in self._stash] if self._stash is not None else [],
                "has_stash": int(self._stash is not None), "rounds": self.rounds,
                "compressor": self.compressor.state_dict() if self.compressor is not None else {},
                # adaptive counts read the last jobs' lengths: a resumed run must stop where this one would
                "job_seconds": dict(self._job_seconds) if self.opts.accumulation == "adaptive" else {}}

    def load_state_dict(self, state: Dict) -> None:
        self.rounds = int(state["rounds"])
        self._job_seconds = {kind: float(s) for kind, s in state.get("job_seconds", {}).items()}
        if state["has_stash"]:
            shards = self.optimizer.model_param_shards()
            self._stash = [saved.to(device=s.device, dtype=s.dtype) for saved, s in zip(state["stash"], shards)]
            self._load_after_compute = "main"
        if self.compressor is not None and state["compressor"]:
            self.compressor.load_state_dict(state["compressor"])

    def stats(self) -> Dict[str, float]:
        out: Dict[str, float] = {"rounds": self.rounds}
        for s, c in enumerate(self.last_round_counts):
            out[f"mb site{s}"] = c
        if self.opts.accumulation == "adaptive":
            out["extra mb"] = self.extra_microbatches
        out.update(self._compression_stats)  # not the compressor's own: the worker may be compressing
        return out


@register
class DelayedParameterUpdate(OverlappedGradientSync):
    """Delayed parameter update: each step's gradients are reduced and applied while the next ones are computed"""

    name = "dpu"
    unequal_sites_refusal = ("its worker thread's process groups and its per-site micro-batch counts assume equal "
                             "sites")
    Options = DpuOptions
    stage_kinds = ("commit",)

    def undelayed_steps(self) -> int:
        return self.opts.warmup_iters


@register
class Acco(OverlappedGradientSync):
    """ACCO: reduce + optimizer step overlap the next gradients, with an estimate stage so none is stale"""

    name = "acco"
    unequal_sites_refusal = ("its worker thread's process groups and its per-site micro-batch counts assume "
                             "equal sites")
    Options = AccoOptions
    stage_kinds = ("estimate", "commit")
