"""What a converted checkpoint needs to resume training, read from a checkpoint and split
for a new layout: every site's model, optimizer and synchronizer state by parameter
(parameter_state.py) and the schedule and data positions of metadata.json.

A training run's checkpoint holds the optimizer state per rank (ZeRO-1 shards); a
converted one holds it per (TP rank, stage, site) in the by-parameter form, in
`mp_rank_TT[_PPP]/optimizer_site_SSS.pt`, which any DP_intra loads. Both are read here, so
a converted checkpoint converts again.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_lsgd.training.checkpointing import layout
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.lazy_tensors import LazyTensors, OpenFiles, detached, shape_of
from megatron_lsgd.training.checkpointing.parameter_state import from_rank_states, gather_values, merge_values
from megatron_lsgd.training.checkpointing.stage_split import Slot, merge_plan, merge_slices, split_slot

BY_PARAMETER = "by_parameter"  # metadata.json "optimizer_layout" of a converted checkpoint
# metadata.json fields carried as they are: the LR schedule, each site's position, the algorithm.
CARRIED = ("scheduler", "site_schedulers", "site_iterations", "site_consumed_samples", "consumed_valid_samples",
           "ended", "lsgd_algorithm")


@dataclass
class SiteState:
    params: Mapping  # the site's full model: name -> full tensor (made on access, lazy_tensors.py)
    tensors: Dict[str, Mapping]  # key -> name -> full tensor (parameter_state.py), made on access
    values: Dict


@dataclass
class ResumeState:
    sites: List[SiteState]
    metadata: Dict  # the CARRIED fields of the source's metadata.json
    source_pp: List[int]  # every site's pipeline-parallel size in the source


def check_target_layout(state: ResumeState, pp: int) -> None:
    """Refuse a pipeline change for an algorithm whose state is organised by stage."""
    from megatron_lsgd.core.lsgd import catalog  # noqa: F401 (registers every algorithm)
    from megatron_lsgd.core.lsgd.registry import synchronizer_class

    algorithm = state.metadata.get("lsgd_algorithm", "sync")
    sizes = sorted(set(state.source_pp))
    if sizes != [pp] and len(state.sites) > 1 and synchronizer_class(algorithm).state_follows_pipeline:
        # sites of different PP sizes: no one target size keeps every site's stages
        keep = f"Keep --target-pipeline-parallel-size {sizes[0]} (TP and DP_intra may change), or convert" \
            if len(sizes) == 1 else "The sites' pipeline sizes differ, so convert"
        raise CheckpointError(
            f"cannot reshard the --lsgd-algorithm {algorithm} state from pipeline-parallel size "
            f"{','.join(map(str, state.source_pp)) if len(sizes) > 1 else sizes[0]} to {pp}: it is organised by "
            f"pipeline stage (fragments or schedules of a stage's units). {keep} with --model-only (the optimizer "
            f"and synchronizer start fresh)")


class CheckpointFiles:
    """The files of one checkpoint iteration, opened memory-mapped through `files` (kept
    until `files.release()`), each checked against metadata.json's size and checksum.
    `tp`, `pp` and `dp` are site 0's (`for_site`: another site's, whose files follow its
    own layout when the sites' sizes differ)."""

    def __init__(self, iter_dir: str, meta: Dict, files: Optional[OpenFiles] = None, site: int = 0):
        self.iter_dir, self.meta = iter_dir, meta
        self.files = files or OpenFiles()
        saved = meta["layout"]
        self.tp = saved["site_tp"][site] if saved.get("site_tp") else saved["tp"]
        self.pp = saved["site_pp"][site] if saved.get("site_pp") else saved["pp"]
        self.dp = saved["site_dp"][site] if saved.get("site_dp") else saved["dp_intra"]

    def for_site(self, site: int) -> "CheckpointFiles":
        """The same files (and open handles) seen with `site`'s TP, PP and DP."""
        return CheckpointFiles(self.iter_dir, self.meta, self.files, site)

    def read(self, rel: str) -> Dict:
        return self.files.torch_file(os.path.join(self.iter_dir, rel), self.meta["files"].get(rel),
                                     self.meta.get("sha256", {}).get(rel))

    def slots(self) -> List[Slot]:
        return [(t, p) for p in range(self.pp) for t in range(self.tp)]

    def model_rel(self, slot: Slot, site: int) -> str:
        return os.path.join(layout.mp_rank_dir_name(slot[0], slot[1], self.pp), layout.model_file_name(site))


def _merged_shape(shapes: List[Tuple[int, ...]], info: list) -> Tuple[int, ...]:
    is_tp, dim, _ = info
    if not is_tp or len(shapes) == 1:
        return tuple(shapes[0])
    out = list(shapes[0])
    out[dim] = sum(s[dim] for s in shapes)
    return tuple(out)


def _lazy_merged(names_by_slot: Dict[Slot, Dict[str, Tuple[int, ...]]], partition: Dict[str, list], tp: int, pp: int,
                 local: Callable[[Slot, str], torch.Tensor], files: OpenFiles, tag) -> LazyTensors:
    """Full tensors by name from the TP slices and stages that hold them (stage_split's rule),
    each made on access from `local(slot, name)`."""
    plan = merge_plan({slot: list(names) for slot, names in names_by_slot.items()}, tp, pp)
    shapes = {name: _merged_shape([names_by_slot[slot][name] for slot in slots], partition[name])
              for name, slots in plan.items()}

    def produce(name: str) -> torch.Tensor:
        def make():
            files.settle()
            slices = [local(slot, name) for slot in plan[name]]
            files.read(sum(t.numel() * t.element_size() for t in slices))
            return merge_slices(slices, partition[name])
        return files.recent((tag, name), make)
    return LazyTensors(shapes, produce)


def site_model(src: CheckpointFiles, site: int) -> Tuple[LazyTensors, Dict[str, list]]:
    """One site's model, full tensors by name (made on access), and the partition info."""
    shapes, partition = {}, {}
    for slot in src.slots():
        state = src.read(src.model_rel(slot, site))
        shapes[slot] = {name: tuple(v.shape) for name, v in state["params"].items()}
        partition.update(state["partition"])
    src.files.release()

    def local(slot: Slot, name: str) -> torch.Tensor:
        return src.read(src.model_rel(slot, site))["params"][name]
    return _lazy_merged(shapes, partition, src.tp, src.pp, local, src.files, ("model", site)), partition


def _site_state(src: CheckpointFiles, site: int) -> SiteState:
    src = src.for_site(site)  # each site's files follow its own TP x PP, its ZeRO-1 shards its own DP size
    meta = src.meta
    algorithm = meta.get("lsgd_algorithm", "sync")
    params, partition = site_model(src, site)
    by_parameter = meta.get("optimizer_layout") == BY_PARAMETER
    parts: Dict[Slot, Dict] = {}
    for slot in src.slots():
        t, p = slot
        mp_dir = layout.mp_rank_dir_name(t, p, src.pp)
        if by_parameter:
            state = src.read(os.path.join(mp_dir, layout.optimizer_file_name(site)))
            pieces = {key: {name: None for name in by_name} for key, by_name in state["tensors"].items()}
            shapes = {key: {name: tuple(v.shape) for name, v in by_name.items()}
                      for key, by_name in state["tensors"].items()}
            parts[slot] = {"pieces": pieces, "shapes": shapes, "values": detached(state["values"])}
        else:
            where = os.path.join(src.iter_dir, mp_dir, f"(site {site})")
            ranks = [src.read(os.path.join(mp_dir, layout.rank_file_name(site, dp)))
                     for dp in range(src.dp)]
            local_shapes = {name: tuple(v.shape) for name, v in src.read(src.model_rel(slot, site))["params"].items()}
            part = from_rank_states(ranks, local_shapes, algorithm, where)
            shapes = {key: {name: local_shapes[name] for name in by_name} for key, by_name in part["pieces"].items()}
            parts[slot] = {"pieces": part["pieces"], "shapes": shapes, "values": detached(part["values"])}
        src.files.release()

    def local_of(key: str):
        def local(slot: Slot, name: str) -> torch.Tensor:
            t, p = slot
            mp_dir = layout.mp_rank_dir_name(t, p, src.pp)
            if by_parameter:
                return src.read(os.path.join(mp_dir, layout.optimizer_file_name(site)))["tensors"][key][name]
            return gather_values(parts[slot]["pieces"][key][name], parts[slot]["shapes"][key][name],
                                 lambda dp: src.read(os.path.join(mp_dir, layout.rank_file_name(site, dp))))
        return local

    keys = sorted({k for part in parts.values() for k in part["pieces"]})
    tensors = {k: _lazy_merged({slot: part["shapes"].get(k, {}) for slot, part in parts.items()}, partition,
                               src.tp, src.pp, local_of(k), src.files, (k, site)) for k in keys}
    values = merge_values([parts[slot]["values"] for slot in sorted(parts)], algorithm,
                          f"{src.iter_dir} (site {site})")
    return SiteState(params, tensors, values)


def read_resume_state(src: CheckpointFiles) -> ResumeState:
    """Every site's model and its optimizer/synchronizer state, full tensors by name, each
    made from the source files when asked for (the index of what lies where is read here:
    the files' structure, no tensor values). Sites of different data-parallel sizes or
    TP x PP layouts are each read in their own layout: the by-parameter form does not
    depend on it."""
    sites = [_site_state(src, site) for site in range(src.meta["layout"]["sites"])]
    metadata = {k: src.meta[k] for k in CARRIED if k in src.meta}
    site_dp = src.meta["layout"].get("site_dp")
    if site_dp:
        _check_in_step(src, site_dp)
        # A site's count is its share of the samples (DP_s / DP), which a layout of other
        # sizes does not keep; without it each site resumes at its share of the job's
        # count (checkpointer.py), the same position of the global order.
        metadata.pop("site_consumed_samples", None)
    return ResumeState(sites, metadata, source_pp=[src.for_site(s).pp for s in range(len(sites))])


def _check_in_step(src: CheckpointFiles, site_dp: List[int]) -> None:
    """Sites of different sizes are at one position of the global order (every algorithm
    that takes them runs in lockstep): site s has read DP_s / DP of the job's samples."""
    total, counts = src.meta.get("consumed_samples", 0), src.meta.get("site_consumed_samples")
    if counts and any(c * sum(site_dp) != total * dp for c, dp in zip(counts, site_dp)):
        raise CheckpointError(f"{src.iter_dir}: the sites' consumed samples {counts} are not their shares of the "
                              f"job's {total} for data-parallel sizes {','.join(map(str, site_dp))}, so no other "
                              f"layout can continue their data positions; resume it with the same "
                              f"--site-data-parallel-sizes")


def padded_rows(tensors: Mapping, names, padded: int) -> Mapping:
    """`tensors` with zero rows added to `names` up to `padded` rows (a vocabulary padded for
    a new TP size)."""
    grow = [n for n in names if n in tensors and shape_of(tensors, n)[0] < padded]
    if not grow:
        return tensors
    shapes = {n: (padded, *shape_of(tensors, n)[1:]) if n in grow else shape_of(tensors, n) for n in tensors}

    def produce(name: str) -> torch.Tensor:
        t = tensors[name]
        return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if name in grow else t
    return LazyTensors(shapes, produce)


def pad_rows(state: ResumeState, names, padded: int) -> None:
    """Zero rows for a vocabulary padded to a new TP size (the model's rows are padded alike)."""
    for site in state.sites:
        site.params = padded_rows(site.params, names, padded)
        site.tensors = {k: padded_rows(by_name, names, padded) for k, by_name in site.tensors.items()}


def optimizer_file(site: SiteState, partition: Dict[str, list], slot: Slot, tp: int, pp: int, num_layers: int,
                   tied: bool) -> Dict:
    """The optimizer file of target `slot` (tp_rank, pp_rank) of this site."""
    return {"tensors": {k: split_slot(by_name, partition, slot, tp, pp, num_layers, tied)
                        for k, by_name in site.tensors.items()}, "values": site.values}
