"""Optimizer and synchronizer state by parameter: the layout-free form convert.py reshards.

A training run saves each rank's state as the rank holds it (flat ZeRO-1 shards of its
buckets) together with records of which parameter values each saved tensor holds
(`ShardedOptimizer.parameter_layout`, `Synchronizer.per_parameter_state`). From those,
`from_rank_states` gathers the state of one (TP rank, pipeline stage, site) into

    {"tensors": {key: {name: tensor shaped like parameter `name`'s local TP slice}},
     "values":  {"hparams": {name: the torch param group's hyperparameters},
                 "torch_scalars": {key: {name: value}}       (AdamW's step count),
                 "grad_scaler": {...} or None,
                 "synchronizer": its state without the per-parameter entries,
                 "synchronizer_paths": [the per-parameter entries' paths]}}

with keys "torch/<key>" (exp_avg, exp_avg_sq, ...), "main" (the fp32 copy a bf16/fp16 model
keeps), "muon" (Muon momentum) and "sync/<path>" (e.g. sync/outer/anchors). The tensors are
merged across TP ranks and stages and split again like the model's weights
(full_model.py); a converted checkpoint stores this form per (TP rank, stage, site) and
every rank of the loading run takes its pieces (`ShardedOptimizer.load_parameter_state`,
`load_synchronizer_state`), whatever its DP_intra, ZeRO-1 and bucket layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_lsgd.training.checkpointing.errors import CheckpointError

SYNC_PREFIX = "sync/"


# ---- saving: where the synchronizer's per-parameter values are this rank's ----------------------
def synchronizer_layout(synchronizer) -> Dict[str, List[List[int]]]:
    """path -> [[main shard, lo, hi], ...]: the ranges of the entry's tensors this rank owns."""
    return {path: [[r.shard, r.lo, r.hi] for views in owned for r in views.ranges]
            for path, owned in synchronizer.per_parameter_state().items()}


# ---- nested state paths ---------------------------------------------------------------------------
def get_path(state: Dict, path: str):
    for key in path.split("/"):
        if not isinstance(state, dict) or key not in state:
            return None
        state = state[key]
    return state


def set_path(state: Dict, path: str, value) -> Dict:
    """A copy of `state` (copied along the path only) with `value` at `path`."""
    head, _, rest = path.partition("/")
    out = dict(state)
    out[head] = set_path(state.get(head, {}), rest, value) if rest else value
    return out


def _valued_tensor(value, where: str) -> Optional[str]:
    """The path of the first tensor holding values inside `value`, or None."""
    if isinstance(value, torch.Tensor):
        return where if value.numel() else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for k, v in items:
        found = _valued_tensor(v, f"{where}/{k}" if where else str(k))
        if found:
            return found
    return None


def _first_difference(a, b, where: str = "") -> Optional[str]:
    """Where two plain values (no valued tensors) differ, or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and torch.equal(a, b)
        return None if same else where or "(top)"
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}/{k}" if where else str(k)
            found = _first_difference(a[k], b[k], f"{where}/{k}" if where else str(k))
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return where or "(top)"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{where}/{i}" if where else str(i))
            if found:
                return found
        return None
    return None if a == b else where or "(top)"


# ---- gathering one (TP rank, stage, site) from its ranks' files ------------------------------------
@dataclass(frozen=True)
class Piece:
    """Values [lo, hi) of a parameter's flattened state are tensor `path` of data-parallel
    rank `dp`'s file, flattened, [a:b] of it (the whole tensor when a is None)."""
    dp: int
    path: Tuple
    a: Optional[int]
    b: Optional[int]
    lo: int
    hi: int


def resolve(state, path: Tuple):
    for key in path:
        state = state[key]
    return state


class _Gather:
    """Where the values of each per-key, per-parameter tensor lie in the ranks' files (no
    value is read), in the order first met, with the check that they cover every value."""

    def __init__(self, shapes: Dict[str, Tuple[int, ...]]):
        self.shapes = shapes
        self.pieces: Dict[str, Dict[str, List[Piece]]] = {}

    def key(self, key: str) -> None:
        self.pieces.setdefault(key, {})

    def put(self, key: str, name: str, lo: int, hi: int, dp: int, path: Tuple, a: Optional[int] = None,
            b: Optional[int] = None) -> None:
        if name not in self.shapes:
            raise CheckpointError(f"optimizer state for {name}, which the model file does not hold")
        self.key(key)
        self.pieces[key].setdefault(name, []).append(Piece(dp, path, a, b, lo, hi))

    def check_complete(self, where: str) -> None:
        for key, by_name in self.pieces.items():
            for name, pieces in by_name.items():
                n = math.prod(self.shapes[name])
                covered, end = 0, 0
                for lo, hi in sorted((max(0, min(p.lo, n)), max(0, min(p.hi, n))) for p in pieces):
                    lo = max(lo, end)
                    if hi > lo:
                        covered += hi - lo
                        end = hi
                if covered < n:
                    raise CheckpointError(f"{where}: the ranks' files hold {covered} of the {n} values of {key} for "
                                          f"{name} (a rank file is missing or from another layout)")


def gather_values(pieces: List[Piece], shape: Tuple[int, ...], rank_state: Callable[[int], Dict]) -> torch.Tensor:
    """One parameter's state (fp32, shaped like its local TP slice) from its pieces;
    `rank_state(dp)`: data-parallel rank dp's file."""
    out = torch.zeros(shape, dtype=torch.float32)
    flat = out.view(-1)
    for p in pieces:
        values = resolve(rank_state(p.dp), p.path)
        if p.a is not None:
            values = values[p.a:p.b]
        flat[p.lo:p.hi] = values.detach().reshape(-1).float().cpu()
    return out


def from_rank_states(rank_states: List[Dict], shapes: Dict[str, Tuple[int, ...]], algorithm: str,
                     where: str) -> Dict:
    """Where the by-parameter form of one (TP rank, stage, site) lies in its DP_intra ranks'
    saved states ({"optimizer", "synchronizer", "synchronizer_layout"}; memory-mapped: no
    value is read here): {"pieces": {key: {name: [Piece]}}, "values": ...}; `gather_values`
    makes a tensor from its pieces. `shapes`: each parameter's local slice shape (from the
    stage's model file)."""
    gather = _Gather(shapes)
    hparams: Dict[str, Dict] = {}
    scalars: Dict[str, Dict] = {}
    scalers, rests, paths = [], [], []
    for dp, state in enumerate(rank_states):
        opt = state["optimizer"]
        layout = opt.get("layout")
        if layout is None or "synchronizer_layout" not in state:
            raise CheckpointError(f"{where}: saved before checkpoints recorded which parameter each optimizer "
                                  f"value belongs to, so its optimizer state cannot be resharded; convert the "
                                  f"model alone with --model-only")
        torch_state = opt["optimizer"]
        index = 0
        for group in torch_state["param_groups"]:
            group_hparams = {k: v for k, v in group.items() if k != "params"}
            for i in group["params"]:
                entry = layout["torch"][index]
                index += 1
                if entry is None:
                    continue
                name, lo, hi = entry
                hparams[name] = group_hparams
                for key, value in torch_state["state"].get(i, {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        gather.put(f"torch/{key}", name, lo, hi, dp, ("optimizer", "optimizer", "state", i, key))
                    else:
                        scalars.setdefault(key, {})[name] = value
        if "main_shards" in opt:
            gather.key("main")
            for shard, pieces in enumerate(layout["main"]):
                for name, p_lo, p_hi, s_lo, s_hi in pieces:
                    gather.put("main", name, p_lo, p_hi, dp, ("optimizer", "main_shards", shard), s_lo, s_hi)
        if "muon" in opt:
            gather.key("muon")
            for j, (name, lo, hi) in enumerate(layout["muon"][:len(opt["muon"]["momentum"])]):
                gather.put("muon", name, lo, hi, dp, ("optimizer", "muon", "momentum", j))
        scalers.append(opt.get("grad_scaler"))
        rest, rank_paths = _split_synchronizer(state["synchronizer"], state["synchronizer_layout"], layout,
                                               gather, algorithm, f"{where} (data-parallel rank {dp})", dp)
        rests.append(rest)
        paths.append(rank_paths)
    gather.check_complete(where)
    values = {"hparams": hparams, "torch_scalars": scalars, "grad_scaler": scalers[0],
              "synchronizer": rests[0], "synchronizer_paths": paths[0]}
    for dp in range(1, len(rank_states)):
        _check_same(values, {"grad_scaler": scalers[dp], "synchronizer": rests[dp], "synchronizer_paths": paths[dp]},
                    algorithm, f"{where}: data-parallel ranks 0 and {dp}")
    return {"pieces": gather.pieces, "values": values}


def _split_synchronizer(state: Dict, owned: Dict[str, List[List[int]]], layout: Dict, gather: _Gather,
                        algorithm: str, where: str, dp: int) -> Tuple[Dict, List[str]]:
    """Move the per-parameter entries into `gather`; return the rest (checked to hold no
    values that depend on the layout) and the entries' paths."""
    rest = state
    for path, ranges in owned.items():
        tensors = get_path(state, path)
        if not isinstance(tensors, list):
            raise CheckpointError(f"{where}: the {algorithm} state has no list at {path}")
        key = SYNC_PREFIX + path
        gather.key(key)
        if tensors:
            for shard, lo, hi in ranges:
                for name, p_lo, p_hi, s_lo, s_hi in layout["main"][shard]:
                    a, b = max(lo, s_lo), min(hi, s_hi)
                    if a < b:
                        gather.put(key, name, p_lo + a - s_lo, p_lo + b - s_lo, dp,
                                   ("synchronizer", *path.split("/"), shard), a, b)
        rest = set_path(rest, path, None)
    found = _valued_tensor(rest, "")
    if found:
        raise CheckpointError(f"cannot reshard the --lsgd-algorithm {algorithm} state of {where}: {found} holds "
                              f"rank-specific tensors (e.g. error feedback, values in flight) that convert.py "
                              f"cannot map to parameters. Resume on the source layout, or convert with "
                              f"--model-only (the optimizer and synchronizer start fresh)")
    return rest, sorted(owned)


def _check_same(a: Dict, b: Dict, algorithm: str, where: str) -> None:
    if _first_difference(a["grad_scaler"], b["grad_scaler"]):
        raise CheckpointError(f"{where} hold different loss scaler states")
    if a["synchronizer_paths"] != b["synchronizer_paths"]:
        raise CheckpointError(f"{where} record different per-parameter {algorithm} state")
    found = _first_difference(a["synchronizer"], b["synchronizer"])
    if found:
        raise CheckpointError(f"cannot reshard the --lsgd-algorithm {algorithm} state: {where} differ at {found}, "
                              f"state that belongs to its rank. Resume on the source layout, or convert with "
                              f"--model-only (the optimizer and synchronizer start fresh)")


def merge_values(parts: List[Dict], algorithm: str, where: str) -> Dict:
    """The values of a site's (TP rank, stage) parts as one: per-parameter entries united,
    the rest checked to agree."""
    out = {"hparams": {}, "torch_scalars": {}, "grad_scaler": parts[0]["grad_scaler"],
           "synchronizer": parts[0]["synchronizer"], "synchronizer_paths": parts[0]["synchronizer_paths"]}
    for i, part in enumerate(parts):
        _check_same(out, part, algorithm, f"{where}: the files of TP rank/stage 0 and {i}")
        out["hparams"].update(part["hparams"])
        for key, by_name in part["torch_scalars"].items():
            out["torch_scalars"].setdefault(key, {}).update(by_name)
    return out


# ---- loading into a run -----------------------------------------------------------------------------
def load_synchronizer_state(synchronizer, optimizer, record: Dict) -> None:
    """Give `synchronizer` its state from the by-parameter form: each per-parameter entry is
    rebuilt laid out like this rank's main shards."""
    values, tensors = record["values"], record["tensors"]
    wanted = sorted(synchronizer.per_parameter_state())
    saved = list(values["synchronizer_paths"])
    if wanted != saved:
        raise ValueError(f"the checkpoint holds per-parameter {synchronizer.name} state {saved or 'none'}, this "
                         f"run keeps {wanted or 'none'} (a different --num-sites or algorithm settings?)")
    state = values["synchronizer"]
    for path in wanted:
        by_name = tensors.get(SYNC_PREFIX + path, {})
        state = set_path(state, path, optimizer.tensors_like_main(by_name) if by_name else [])
    synchronizer.load_state_dict(state)
