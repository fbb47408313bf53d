"""The inner optimizer: torch AdamW (or SGD) over this rank's shard of every bucket; with
`--optimizer muon`, Muon for the hidden 2-D matrices (muon.py) and AdamW for the rest.

Without ZeRO-1 the "shard" is the whole buffer. With `--use-distributed-optimizer` each
rank of a site steps only its 1/DP_intra slice (optimizer state sharded likewise) and the
updated parameters are all-gathered inside the site. Main parameters are fp32: for fp32
models they are views of the parameter buffer itself (no copy); for bf16/fp16 models a
separate fp32 copy of the shard is kept and cast back after each step.

Cross-site synchronizers read and write the main shards through `views(units)` (the
unit <-> shard bridge, shard_views.py) and push what they changed back into the model
with `copy_main_to_model_params(views)`.

For synchronizers that step the optimizer while the model computes (ACCO/DPU, on a
background thread) the step can be told where to read gradients (`grads`: per-shard
tensors, e.g. another gradient storage), which process groups to use for its collectives
(`groups`: dedicated ones, so a second thread never shares a group with the first), and
to leave the model alone (`copy_to_model=False`); `separate_main=True` keeps an fp32 main
copy even for fp32 models so such a step never writes into parameters a forward pass is
reading; `trial_step` computes what a step would give without committing anything
(ACCO's estimate). With none of these the step's arithmetic is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron_lsgd.core.distributed.collectives import all_gather_flat
from megatron_lsgd.core.distributed.data_parallel import DistributedDataParallel
from megatron_lsgd.core.optimizer.config import OptimizerConfig
from megatron_lsgd.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron_lsgd.core.optimizer.muon import ShardedMuon, is_muon_matrix
from megatron_lsgd.core.optimizer.shard_views import BucketExtent, ShardViews, build_views
from megatron_lsgd.core.parallel_state import ProcessGroups


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm is NaN/Inf: the run diverged. Raised before any update
    is applied, so the model stays finite."""


@dataclass
class ShardPiece:
    """The part of one parameter that lives in this rank's shard."""

    param: torch.nn.Parameter
    main: torch.Tensor  # fp32, 1-D, updated by the optimizer
    grad: torch.Tensor  # fp32, 1-D view into the grad buffer
    counts_in_norm: bool
    shard: int = 0  # which main shard holds it, and where: main_shards[shard][1][lo:hi]
    lo: int = 0
    hi: int = 0
    p_lo: int = 0  # where it sits in the parameter's flattened (local TP slice) coordinates
    p_hi: int = 0


class ShardedOptimizer:
    def __init__(self, models: List[DistributedDataParallel], config: OptimizerConfig, pgs: ProcessGroups,
                 grad_scaler=None, separate_main: bool = False):
        self.models = models
        self.config = config
        self.pgs = pgs
        self.grad_scaler: Optional[object] = grad_scaler
        self.sharded = any(m.config.use_distributed_optimizer for m in models) and pgs.dp_intra_size > 1
        self.shard_index = pgs.dp_intra_rank if self.sharded else 0
        # Sites of different DP sizes hold different shards of the same buckets: the gradient
        # norm is then summed lane by lane (parallel_state), in one order on every site, so
        # sites that apply the same mean gradient stay bit-identical (0: sites are equal).
        self._norm_lanes = pgs.dims.lanes if pgs.dims.heterogeneous else 0

        # One fp32 main tensor per bucket shard (a view when the model is already fp32).
        self.main_shards: List[Tuple[object, torch.Tensor, torch.Tensor]] = []  # (bucket, main, grad)
        self._buffers: List[object] = []  # the ParamAndGradBuffer of each main shard's bucket
        self.pieces: List[ShardPiece] = []
        self._layout: List[List[tuple]] = []
        for model in models:
            buffer = model.buffer
            for bucket in buffer.buckets:
                param_shard = bucket.param_shard(self.shard_index)
                main = param_shard if param_shard.dtype == torch.float32 and not separate_main \
                    else param_shard.detach().float().clone()
                grad = bucket.grad_shard(self.shard_index)
                self.main_shards.append((bucket, main, grad))
                self._buffers.append(buffer)
                self._layout.append([])
                for p, p_lo, p_hi, s_lo, s_hi in buffer.shard_pieces(bucket, self.shard_index):
                    self.pieces.append(ShardPiece(p, main[s_lo:s_hi], grad[s_lo:s_hi], self._counts_in_norm(p),
                                                  len(self.main_shards) - 1, s_lo, s_hi, p_lo, p_hi))
                    self._layout[-1].append((tuple(p.shape), p_lo, p_hi, s_lo, s_hi))

        self._param_names: Dict[int, str] = {}
        for model in models:
            module = getattr(model, "module", model)
            named = module.global_named_parameters() if hasattr(module, "global_named_parameters") \
                else module.named_parameters()
            self._param_names.update({id(p): name for name, p in named})
        self._all_param_ids = {id(p) for buffer in self._buffers for b in buffer.buckets for p in b.params}
        self._counted_names = {self._param_names.get(id(pc.param)) for pc in self.pieces if pc.counts_in_norm}
        self._views: Dict[Tuple[str, ...], ShardViews] = {}

        # Param groups: weight decay or not (biases and norms), and with --decoupled-lr the
        # embedding / output layer in groups of their own. `_group_kinds[i]` says which
        # learning rate group i takes ("default" or "decoupled").
        def kind(pc) -> str:
            if config.decoupled_lr is None:
                return "default"
            name = self._param_names.get(id(pc.param), "")
            return "decoupled" if name.endswith("word_embeddings.weight") or name.startswith("output_layer.") \
                else "default"

        # --optimizer muon: the hidden matrices go to Muon, everything else to AdamW.
        use_muon = config.optimizer == "muon"
        muon_ids = set()
        if use_muon:
            seen = set()
            muon_params = []
            for model in models:
                for bucket in model.buffer.buckets:
                    for p in bucket.params:
                        if id(p) not in seen and is_muon_matrix(self._param_names.get(id(p), ""), p):
                            seen.add(id(p))
                            muon_params.append(p)
            muon_ids = {id(p) for p in muon_params}
            self.muon: Optional[ShardedMuon] = ShardedMuon(
                [pc for pc in self.pieces if id(pc.param) in muon_ids], muon_params, pgs, self.sharded,
                config.muon_momentum, config.muon_ns_steps, config.weight_decay)
        else:
            self.muon = None
        self._muon_ids = muon_ids
        self._adam_pieces = [pc for pc in self.pieces if id(pc.param) not in muon_ids]

        groups, self._group_kinds = [], []
        for k in ("default", "decoupled"):
            decay = [pc.main for pc in self._adam_pieces if pc.param.ndim > 1 and kind(pc) == k]
            no_decay = [pc.main for pc in self._adam_pieces if pc.param.ndim <= 1 and kind(pc) == k]
            for params, wd in ((decay, config.weight_decay), (no_decay, 0.0)):
                if params:
                    groups.append({"params": params, "weight_decay": wd})
                    self._group_kinds.append(k)
        if not groups:  # a rank whose shard holds only padding still joins every collective
            groups = [{"params": [torch.zeros(1)], "weight_decay": 0.0}]
            self._group_kinds = ["default"]
        if config.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(groups, lr=config.lr, momentum=0.0, foreach=True)
        else:
            self.optimizer = torch.optim.AdamW(
                groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                **_adamw_kernel(groups, config.adam_kernel))

    def _counts_in_norm(self, p) -> bool:
        # Replicated across TP ranks: count once. Tied embedding copy on the last stage:
        # counted on the first stage only.
        if not getattr(p, "tensor_model_parallel", False) and self.pgs.tp_rank != 0:
            return False
        if getattr(p, "shared_embedding", False) and not self.pgs.is_first_stage:
            return False
        return True

    def counted_spans(self, views: ShardViews) -> List[Tuple[int, int, int]]:
        """(range, lo, hi) of the pieces of `views` this rank counts in a norm over the model
        (grad_norm's rule, `_counts_in_norm`): `sum_of_squares` over them, all-reduced over
        TP (and over dp_intra where the site's ranks hold parts), counts every value once."""
        return [(pc.range_index, pc.lo, pc.hi) for pc in views.pieces if pc.name in self._counted_names]

    # ---- the step -----------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale if self.grad_scaler is not None else 1.0

    def _piece_grads(self, grads: Optional[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
        if grads is None:
            return [pc.grad for pc in self.pieces]
        return [grads[pc.shard][pc.lo:pc.hi] for pc in self.pieces]

    def _shard_grads(self, grads: Optional[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
        return [g for _, _, g in self.main_shards] if grads is None else list(grads)

    def _found_inf(self, grads: Optional[Sequence[torch.Tensor]] = None, groups: Optional[ProcessGroups] = None
                   ) -> bool:
        shard_grads = self._shard_grads(grads)
        flag = torch.zeros(1, device=shard_grads[0].device)
        for grad in shard_grads:
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        # Everyone in the site must agree to skip (shards and stages differ).
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=(groups or self.pgs).site)
        return bool(flag.item())

    def grad_norm(self, grads: Optional[Sequence[torch.Tensor]] = None, groups: Optional[ProcessGroups] = None
                  ) -> float:
        """Global gradient norm (of `grads`, per-shard tensors, if given; collectives on
        `groups`' dp_intra and model_parallel, default this optimizer's)."""
        groups = groups or self.pgs
        device = self.main_shards[0][2].device
        piece_grads = self._piece_grads(grads)
        grads = [g for g, pc in zip(piece_grads, self.pieces) if pc.counts_in_norm]
        if self._norm_lanes:
            sq = self._lane_squares(piece_grads, device)
            if self.sharded:
                dist.all_reduce(sq, group=groups.dp_intra)  # each lane is one rank's: exact
            sq = sq.sum().reshape(1)
            if self.pgs.dims.tp * self.pgs.dims.pp > 1:
                dist.all_reduce(sq, group=groups.model_parallel)
            return math.sqrt(sq.item())
        sq = torch.zeros(1, dtype=torch.float32, device=device)
        if grads:
            sq += torch.stack([g.float().pow(2).sum() for g in grads]).sum()
        if self.sharded:
            dist.all_reduce(sq, group=groups.dp_intra)
        if self.pgs.dims.tp * self.pgs.dims.pp > 1:
            dist.all_reduce(sq, group=groups.model_parallel)
        return math.sqrt(sq.item())

    def _lane_squares(self, piece_grads: Sequence[torch.Tensor], device) -> torch.Tensor:
        """Sum of squares of the counted gradients per lane (L values; 0 for lanes this rank
        does not hold): each lane's pieces, cut at lane boundaries, summed in bucket order,
        which is the same on every site whatever its shards."""
        lanes = self._norm_lanes
        out = torch.zeros(lanes, dtype=torch.float32, device=device)
        for g, pc in zip(piece_grads, self.pieces):
            if not pc.counts_in_norm:
                continue
            bucket = self.main_shards[pc.shard][0]
            width = bucket.numel // lanes
            start = bucket.shard_range(self.shard_index)[0] + pc.lo  # the piece's place in its bucket
            end = start + (pc.hi - pc.lo)
            for lane in range(start // width, (end - 1) // width + 1):
                lo, hi = max(start, lane * width), min(end, (lane + 1) * width)
                out[lane] += g[lo - start:hi - start].float().pow(2).sum()
        return out

    @torch.no_grad()
    def step(self, lr: Union[float, Dict[str, float]], *, grads: Optional[Sequence[torch.Tensor]] = None,
             groups: Optional[ProcessGroups] = None, copy_to_model: bool = True) -> Tuple[bool, Optional[float]]:
        """`lr`: one learning rate, or {"default": lr, "decoupled": lr} (LRScheduler.next_lrs).
        Returns (update_successful, grad_norm). `grads`: per-main-shard gradient tensors to
        step with instead of the grad buffer's shards (they are unscaled/clipped in place);
        `groups`: process groups for the step's collectives (norm, inf check, and the
        all-gather when copying); `copy_to_model=False` leaves the model's parameters as they
        are (the caller copies later, e.g. once a concurrent forward pass is done)."""
        shard_grads = self._shard_grads(grads)
        if self.grad_scaler is not None:
            inv = 1.0 / self.grad_scaler.scale
            for grad in shard_grads:
                grad.mul_(inv)
            found_inf = self._found_inf(grads, groups)
            self.grad_scaler.update(found_inf)
            if found_inf:
                return False, None
        norm = self.grad_norm(grads, groups)
        if self.config.check_for_nan_in_grad and not math.isfinite(norm):
            raise NonFiniteError(f"the gradient norm is {norm}: training diverged, so no update was applied and "
                                 f"the checkpoints on disk stay finite (lower --lr or lengthen the warmup)")
        if self.config.clip_grad > 0 and norm > self.config.clip_grad:
            coeff = self.config.clip_grad / (norm + 1e-6)
            for grad in shard_grads:
                grad.mul_(coeff)
        for group, kind in zip(self.optimizer.param_groups, self._group_kinds):
            group["lr"] = lr.get(kind, lr["default"]) if isinstance(lr, dict) else lr
        muon_grads = []
        for pc, grad in zip(self.pieces, self._piece_grads(grads)):
            if id(pc.param) in self._muon_ids:
                muon_grads.append(grad)
            else:
                pc.main.grad = grad
        self.optimizer.step()
        if self.muon is not None:
            self.muon.step(muon_grads, lr["default"] if isinstance(lr, dict) else lr, groups)
        for pc in self.pieces:
            pc.main.grad = None
        if copy_to_model:
            self.copy_main_to_model_params(groups=groups)
        return True, norm

    @torch.no_grad()
    def trial_step(self, lr: Union[float, Dict[str, float]], out: Sequence[torch.Tensor], *, grads: Optional[Sequence[torch.Tensor]] = None,
                   groups: Optional[ProcessGroups] = None) -> Tuple[bool, Optional[float]]:
        """What `step` would make of the main shards, written into `out` (per-main-shard fp32
        tensors), without committing anything: main shards, optimizer state (moments, step
        counts) and the loss scaler are restored afterwards. The same code path as `step`,
        so a trial and a real step from the same state and gradients give the same bits.
        Costs a copy of the main shards and of the optimizer state for the duration."""
        saved_main = [main.clone() for _, main, _ in self.main_shards]
        saved_state = {p: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
                       for p, st in self.optimizer.state.items()}
        saved_scaler = self.grad_scaler.state_dict() if self.grad_scaler is not None else None
        saved_muon = self.muon.state_dict() if self.muon is not None else None
        try:
            ok, norm = self.step(lr, grads=grads, groups=groups, copy_to_model=False)
            for o, (_, main, _) in zip(out, self.main_shards):
                o.copy_(main)
        finally:
            for (_, main, _), saved in zip(self.main_shards, saved_main):
                main.copy_(saved)
            self._restore_state(saved_state)
            if saved_scaler is not None:
                self.grad_scaler.load_state_dict(saved_scaler)
            if saved_muon is not None:
                self.muon.load_state_dict(saved_muon)
        return ok, norm

    def _restore_state(self, saved: Dict) -> None:
        """Put the optimizer state back to `saved` (per parameter, clones), writing into the
        tensors that existed before instead of replacing them: ACCO/DPU's worker runs this on
        a CUDA stream of its own, and dropping a tensor allocated on another stream (a
        checkpoint load on the compute stream) would hand its memory back to that stream
        while the worker's queued kernels still use it. State the step created is dropped."""
        state = self.optimizer.state
        for p in list(state):
            if p not in saved:
                del state[p]
        for p, before in saved.items():
            now = state[p]
            for k in [k for k in now if k not in before]:
                del now[k]
            for k, v in before.items():
                if torch.is_tensor(v) and torch.is_tensor(now.get(k)) and now[k].shape == v.shape \
                        and now[k].dtype == v.dtype and now[k].device == v.device:
                    now[k].copy_(v)
                else:
                    now[k] = v

    @torch.no_grad()
    def copy_main_to_model_params(self, views: Optional[ShardViews] = None, *,
                                  source: Optional[Sequence[torch.Tensor]] = None,
                                  groups: Optional[ProcessGroups] = None) -> None:
        """Cast main shards into the parameter buffer (if separate) and, under ZeRO-1,
        all-gather inside the site. With `views`, only those units: their ranges are cast
        and one all-gather over dp_intra spreads their extents (see _gather_extents).
        `source`: per-main-shard tensors to put into the model instead of the main shards
        (whole model only; e.g. ACCO's estimated parameters, or parameters saved from the
        model by `model_param_shards`); `groups`: whose dp_intra the all-gather uses."""
        group = (groups or self.pgs).dp_intra
        if views is not None and not views.whole:
            if source is not None:
                raise ValueError("copy_main_to_model_params: source is for the whole model only")
            for r, main in zip(views.ranges, views.main):
                shard = self.main_shards[r.shard][0].param_shard(self.shard_index)[r.lo:r.hi]
                if main.data_ptr() != shard.data_ptr():
                    shard.copy_(main)
            if self.sharded:
                self._gather_extents(views.extents)
            return
        for i, (bucket, main, _) in enumerate(self.main_shards):
            src = main if source is None else source[i]
            shard = bucket.param_shard(self.shard_index)
            if src.data_ptr() != shard.data_ptr():
                shard.copy_(src)
            if self.sharded:
                all_gather_flat(bucket.param_data, shard.clone(), group=group)

    def model_param_shards(self) -> List[torch.Tensor]:
        """This rank's shard of the model's parameters (parameter dtype), one view per main
        shard: what the forward pass reads, as opposed to the fp32 main shards."""
        return [bucket.param_shard(self.shard_index) for bucket, _, _ in self.main_shards]

    def _gather_extents(self, extents: Sequence[BucketExtent]) -> None:
        """Spread a part of each bucket inside the site with one all-gather. Rank r holds
        [r S, (r+1) S) of a bucket (S = shard size), so its piece of an extent [lo, hi) is
        the intersection; pieces are padded to the largest one so the collective has equal
        sizes. Cost per rank: (DP_intra - 1) x sum over extents of the largest piece, which
        is about the extent's size when it spans several shards and at most DP_intra x its
        size when it sits inside one shard (a full-model gather moves every bucket)."""
        dp = self.pgs.dp_intra_size
        me = self.shard_index
        plan = []  # (bucket, [(lo, hi) per rank], padded length)
        for e in extents:
            bucket = self.main_shards[e.bucket][0]
            size = bucket.shard_size
            parts = [(max(e.lo, r * size), min(e.hi, (r + 1) * size)) for r in range(dp)]
            width = max(max(hi - lo, 0) for lo, hi in parts)
            if width:
                plan.append((bucket, parts, width))
        if not plan:
            return
        total = sum(width for _, _, width in plan)
        dtype, device = plan[0][0].param_data.dtype, plan[0][0].param_data.device
        send = torch.zeros(total, dtype=dtype, device=device)
        offset = 0
        for bucket, parts, width in plan:
            lo, hi = parts[me]
            if hi > lo:
                send[offset:offset + hi - lo] = bucket.param_data[lo:hi]
            offset += width
        recv = torch.empty(dp * total, dtype=dtype, device=device)
        all_gather_flat(recv, send, group=self.pgs.dp_intra)
        for r in range(dp):
            offset = r * total
            for bucket, parts, width in plan:
                lo, hi = parts[r]
                if hi > lo and r != me:
                    bucket.param_data[lo:hi] = recv[offset:offset + hi - lo]
                offset += width

    def views(self, units: Optional[Sequence[object]] = None) -> ShardViews:
        """This rank's share of `units` (SyncUnits; None: all of them), cached. A set that
        covers every parameter of this rank is the whole main shard, padding included."""
        key = tuple(sorted(u.name for u in units)) if units is not None else ("*",)
        cached = self._views.get(key)
        if cached is not None:
            return cached
        ids = {id(p) for u in units for p in u.parameters()} if units is not None else set(self._all_param_ids)
        whole = ids >= self._all_param_ids
        name = "all" if whole else "+".join(key)
        views = build_views(name, key, ids, self.main_shards, self._buffers, self.shard_index, self._param_names,
                            whole)
        self._views[key] = views
        return views

    def main_param_shards(self) -> List[torch.Tensor]:
        """This rank's fp32 main parameters, one flat tensor per bucket (what a cross-site
        synchronizer reads as θ_local and overwrites with the synced value)."""
        return [main for _, main, _ in self.main_shards]

    def shard_layout(self) -> List[List[tuple]]:
        """Per main shard: (param shape, lo, hi, shard_lo, shard_hi) for every param piece in
        it (flattened param coordinates [lo, hi) sit at [shard_lo, shard_hi) of the shard)."""
        return self._layout

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "layout": self.parameter_layout()}
        if any(m.data_ptr() != b.param_shard(self.shard_index).data_ptr() for b, m, _ in self.main_shards):
            state["main_shards"] = [m.clone() for _, m, _ in self.main_shards]
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        if self.muon is not None:
            state["muon"] = self.muon.state_dict()
        return state

    def _load_torch_state(self, saved: dict) -> None:
        """torch's load_state_dict takes the saved groups' kernel choice (foreach / fused) with
        their hyperparameters: keep this run's, so a checkpoint saved on a CPU resumes fused on a
        GPU and one saved on a GPU resumes on a CPU with the CPU's kernel."""
        kernel = {k: self.optimizer.param_groups[0].get(k) for k in ("foreach", "fused")}
        self.optimizer.load_state_dict(saved)
        for group in self.optimizer.param_groups:
            group.update(kernel)
        if kernel["fused"]:  # torch placed the step counts by the saved groups' kernel: fused keeps them on the device
            for param, state in self.optimizer.state.items():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)

    def parameter_layout(self) -> dict:
        """Which parameter values each saved tensor holds, so tools/checkpoint/convert.py can
        reshard this rank's state without rebuilding its buckets: `main[i]` lists
        [name, p_lo, p_hi, s_lo, s_hi] for every piece of main shard i (flattened local-slice
        coordinates [p_lo, p_hi) of parameter `name` at [s_lo, s_hi) of the shard, so also of
        any tensor laid out like the main shards); `torch[k]` is [name, p_lo, p_hi] of the
        torch optimizer's parameter k (None: the placeholder of a rank holding only padding);
        `muon[j]` the same for Muon momentum buffer j."""
        main = [[] for _ in self.main_shards]
        by_tensor = {}
        for pc in self.pieces:
            entry = [self._param_names[id(pc.param)], pc.p_lo, pc.p_hi]
            main[pc.shard].append(entry + [pc.lo, pc.hi])
            by_tensor[id(pc.main)] = entry
        torch_params = [by_tensor.get(id(t)) for g in self.optimizer.param_groups for t in g["params"]]
        muon = [by_tensor[id(pc.main)] for pc in self.muon.pieces] if self.muon is not None else []
        return {"main": main, "main_numel": [m.numel() for _, m, _ in self.main_shards], "torch": torch_params,
                "muon": muon, "sharded": self.sharded}

    @torch.no_grad()
    def tensors_like_main(self, by_name: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        """fp32 tensors laid out like the main shards, holding `by_name`'s values (each a
        parameter's local TP slice); padding is zero."""
        out = [torch.zeros_like(main) for _, main, _ in self.main_shards]
        for pc in self.pieces:
            out[pc.shard][pc.lo:pc.hi] = _piece_of(by_name, self._param_names[id(pc.param)], pc.p_lo, pc.p_hi)
        return out

    @torch.no_grad()
    def load_parameter_state(self, record: dict) -> None:
        """Load the layout-free form convert.py writes (training/checkpointing/
        parameter_state.py): record["tensors"][key][name] holds a parameter's local TP slice
        of an optimizer tensor ("torch/exp_avg", "main", "muon", ...); record["values"] the
        rest (per-parameter step counts and hyperparameters, the loss scaler). This rank
        takes its pieces, whatever its DP_intra, ZeRO-1 or bucket layout."""
        tensors, values = record["tensors"], record["values"]
        torch_keys = sorted(k[len("torch/"):] for k in tensors if k.startswith("torch/"))
        scalars, hparams = values["torch_scalars"], values["hparams"]
        layout = self.parameter_layout()["torch"]
        own = self.optimizer.state_dict()
        state, groups = {}, []
        for group in own["param_groups"]:
            first = next((layout[i][0] for i in group["params"] if layout[i] is not None), None)
            saved = hparams.get(first, {}) if first is not None else {}
            groups.append({**group, **saved, "params": group["params"]})
        for index, entry in enumerate(layout):
            if entry is None:
                continue
            name, lo, hi = entry
            if not any(name in tensors[f"torch/{k}"] for k in torch_keys) and \
                    not any(name in by_name for by_name in scalars.values()):
                continue  # never stepped in the source: torch starts its state at the first step
            piece = {k: _piece_of(tensors[f"torch/{k}"], name, lo, hi).clone() for k in torch_keys}
            piece.update({k: by_name[name] for k, by_name in scalars.items() if name in by_name})
            state[index] = piece
        self._load_torch_state({"state": state, "param_groups": groups})
        if "main" in tensors:  # a bf16/fp16 source's fp32 copy (an fp32 source's model is its own main copy)
            for pc in self.pieces:
                pc.main.copy_(_piece_of(tensors["main"], self._param_names[id(pc.param)], pc.p_lo, pc.p_hi))
            self._spread_main_loaded_into_model()
        if self.grad_scaler is not None and values.get("grad_scaler"):
            self.grad_scaler.load_state_dict(values["grad_scaler"])
        if self.muon is not None:
            if "muon" not in tensors:
                raise ValueError("the checkpoint holds no Muon state (it was saved with another --optimizer)")
            for pc, buf in zip(self.muon.pieces, self.muon.buffers):
                buf.copy_(_piece_of(tensors["muon"], self._param_names[id(pc.param)], pc.p_lo, pc.p_hi))

    def load_state_dict(self, state: dict) -> None:
        self._load_torch_state(state["optimizer"])
        if "main_shards" in state:
            for (_, main, _), saved in zip(self.main_shards, state["main_shards"]):
                main.copy_(saved)
            self._spread_main_loaded_into_model()
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        if self.muon is not None:
            self.muon.load_state_dict(state.get("muon"))


    @torch.no_grad()
    def _spread_main_loaded_into_model(self) -> None:
        """A loaded fp32 main copy (a bf16/fp16 checkpoint's) went, in an fp32 model, straight
        into this rank's shard of the parameter buffer (its main shards are views of it): under
        ZeRO-1 every other rank's shard still holds the weights rounded to bf16/fp16, so the
        site's ranks would start from different weights. Gather the shards inside the site.
        A separate main copy (bf16/fp16 models, ACCO/DPU's) stays apart from the model, whose
        loaded weights are already the same on every rank."""
        if not self.sharded:
            return
        for bucket, main, _ in self.main_shards:
            shard = bucket.param_shard(self.shard_index)
            if main.data_ptr() == shard.data_ptr():
                all_gather_flat(bucket.param_data, shard.clone(), group=self.pgs.dp_intra)


def _adamw_kernel(groups: List[dict], choice: str = "auto") -> Dict[str, bool]:
    """AdamW's implementation for these parameters (--adam-kernel): by default the fused kernel
    (one pass over the state instead of several: 12 ms instead of 33 of a 1.1B model's step on
    an H100, docs/performance.md) where every parameter is an fp32 CUDA tensor, foreach
    elsewhere, so CPU runs keep their numerics (tests/regression); `choice` forces one."""
    if choice != "auto":
        return {choice: True}
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda and p.dtype == torch.float32 for p in params)
    return {"fused": True} if fused else {"foreach": True}


def _piece_of(by_name: Dict[str, torch.Tensor], name: str, lo: int, hi: int) -> torch.Tensor:
    """Values [lo, hi) of parameter `name`'s flattened local slice in a by-name record."""
    if name not in by_name:
        raise ValueError(f"the checkpoint holds no optimizer state for parameter {name}")
    flat = by_name[name].reshape(-1)
    if flat.numel() < hi:
        raise ValueError(f"the checkpoint's optimizer state for {name} has {flat.numel()} values, this rank needs "
                         f"[{lo}, {hi})")
    return flat[lo:hi]


def build_grad_scaler(config: OptimizerConfig, fp16: bool):
    if not fp16:
        return None
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)
