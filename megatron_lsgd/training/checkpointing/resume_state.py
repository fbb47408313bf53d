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
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from megatron_lsgd.training.checkpointing import layout
from megatron_lsgd.training.checkpointing.errors import CheckpointError
from megatron_lsgd.training.checkpointing.parameter_state import from_rank_states, merge_values
from megatron_lsgd.training.checkpointing.safe_io import load_file
from megatron_lsgd.training.checkpointing.stage_split import Slot, merge_layout, split_layout

BY_PARAMETER = "by_parameter"  # metadata.json "optimizer_layout" of a converted checkpoint
# metadata.json fields carried as they are: the LR schedule, each site's position, the algorithm.
CARRIED = ("scheduler", "site_schedulers", "site_iterations", "site_consumed_samples", "consumed_valid_samples",
           "ended", "lsgd_algorithm")


@dataclass
class SiteState:
    params: Dict[str, torch.Tensor]  # the site's full model
    tensors: Dict[str, Dict[str, torch.Tensor]]  # key -> name -> full tensor (parameter_state.py)
    values: Dict


@dataclass
class ResumeState:
    sites: List[SiteState]
    metadata: Dict  # the CARRIED fields of the source's metadata.json
    source_pp: int = 1


def check_target_layout(state: ResumeState, pp: int) -> None:
    """Refuse a pipeline change for an algorithm whose state is organised by stage."""
    from megatron_lsgd.core.lsgd import catalog  # noqa: F401 (registers every algorithm)
    from megatron_lsgd.core.lsgd.registry import synchronizer_class

    algorithm = state.metadata.get("lsgd_algorithm", "sync")
    if pp != state.source_pp and len(state.sites) > 1 and synchronizer_class(algorithm).state_follows_pipeline:
        raise CheckpointError(
            f"cannot reshard the --lsgd-algorithm {algorithm} state from pipeline-parallel size {state.source_pp} to "
            f"{pp}: it is organised by pipeline stage (fragments or schedules of a stage's units). Keep "
            f"--target-pipeline-parallel-size {state.source_pp} (TP and DP_intra may change), or convert with "
            f"--model-only (the optimizer and synchronizer start fresh)")


def read_file(iter_dir: str, meta: Dict, rel: str) -> Dict:
    return load_file(os.path.join(iter_dir, rel), meta["files"].get(rel), meta.get("sha256", {}).get(rel))


def read_site_models(iter_dir: str, meta: Dict, site: int) -> Tuple[Dict[Slot, Dict[str, torch.Tensor]],
                                                                      Dict[str, list]]:
    """One site's model files: {(tp_rank, pp_rank): {name: local slice}} and the partition info."""
    tp, pp = meta["layout"]["tp"], meta["layout"]["pp"]
    pieces, partition = {}, {}
    for p in range(pp):
        for t in range(tp):
            state = read_file(iter_dir, meta, os.path.join(layout.mp_rank_dir_name(t, p, pp),
                                                           layout.model_file_name(site)))
            pieces[(t, p)] = state["params"]
            partition.update(state["partition"])
    return pieces, partition


def read_resume_state(iter_dir: str, meta: Dict) -> ResumeState:
    """Every site's model and its optimizer/synchronizer state, full tensors by name."""
    tp, pp, sites = meta["layout"]["tp"], meta["layout"]["pp"], meta["layout"]["sites"]
    if meta["layout"].get("site_dp"):
        raise CheckpointError(f"{iter_dir} was saved by sites of different data-parallel sizes "
                              f"({','.join(map(str, meta['layout']['site_dp']))}): converting such a checkpoint is "
                              f"not supported yet; resume it with the same --site-data-parallel-sizes")
    algorithm = meta.get("lsgd_algorithm", "sync")
    out = []
    for site in range(sites):
        models, partition = read_site_models(iter_dir, meta, site)
        parts: Dict[Slot, Dict] = {}
        for (t, p), params in models.items():
            mp_dir = layout.mp_rank_dir_name(t, p, pp)
            where = os.path.join(iter_dir, mp_dir, f"(site {site})")
            if meta.get("optimizer_layout") == BY_PARAMETER:
                parts[(t, p)] = read_file(iter_dir, meta, os.path.join(mp_dir, layout.optimizer_file_name(site)))
            else:
                ranks = [read_file(iter_dir, meta, os.path.join(mp_dir, layout.rank_file_name(site, dp)))
                         for dp in range(meta["layout"]["dp_intra"])]
                shapes = {name: tuple(v.shape) for name, v in params.items()}
                parts[(t, p)] = from_rank_states(ranks, shapes, algorithm, where)
        keys = sorted({k for part in parts.values() for k in part["tensors"]})
        tensors = {k: merge_layout({slot: part["tensors"].get(k, {}) for slot, part in parts.items()}, partition,
                                   tp, pp) for k in keys}
        values = merge_values([parts[slot]["values"] for slot in sorted(parts)], algorithm,
                              f"{iter_dir} (site {site})")
        out.append(SiteState(merge_layout(models, partition, tp, pp), tensors, values))
    return ResumeState(out, {k: meta[k] for k in CARRIED if k in meta}, source_pp=pp)


def pad_rows(state: ResumeState, names, padded: int) -> None:
    """Zero rows for a vocabulary padded to a new TP size (the model's rows are padded alike)."""
    for site in state.sites:
        for by_name in [site.params] + list(site.tensors.values()):
            for name in names:
                if name in by_name and by_name[name].shape[0] < padded:
                    t = by_name[name]
                    by_name[name] = torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])])


def split_site(site: SiteState, partition: Dict[str, list], tp: int, pp: int, num_layers: int, tied: bool
               ) -> Dict[Slot, Dict]:
    """{(tp_rank, pp_rank): the optimizer file of this site} for a target layout."""
    per_key = {k: split_layout(by_name, partition, tp, pp, num_layers, tied) for k, by_name in site.tensors.items()}
    return {(t, p): {"tensors": {k: split[(t, p)] for k, split in per_key.items()}, "values": site.values}
            for t in range(tp) for p in range(pp)}

