"""The canonical (layout-free) form of the model's parameters (core/models/gpt/canonical_layout.py),
on which sites of different TP x PP exchange: for a TP2 x PP2 model and a TP1 model of the
same seed (tied embeddings, SwiGLU and grouped-query attention, whose TP slices interleave),

- every unit's canonical buffer, written from the ranks' local slices at their canonical
  positions (each value once: `counts_here`), is the same for both layouts and is the
  single-rank model's parameters concatenated, bit for bit;
- reading each rank's slices back from it gives the rank's parameters (shard -> canonical ->
  shard is the identity), and they are what the checkpoint converter's `split_slot` cuts
  from the full model (the two share the mapping).
"""

from __future__ import annotations

import torch

from megatron_lsgd.core.models.gpt.canonical_layout import canonical_units, counts_here
from megatron_lsgd.core.models.gpt.gpt_model import GPTModel
from megatron_lsgd.core.parallel_state import ParallelDims, ProcessGroups, RankCoords
from megatron_lsgd.core.tensor_parallel import layers
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.training.checkpointing.model_io import partition_info
from megatron_lsgd.training.checkpointing.stage_split import split_slot


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, swiglu=True,
                             padded_vocab_size=64, seq_length=8)


class _TPSlot:
    """Stands for a TP group when a model is built in one process: the layers read only its size
    and this rank's place in it (`layers._tp_size_rank`, patched)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


def _ranks(config, tp, pp, monkeypatch):
    """{(tp_rank, pp_rank): {single-rank name: local tensor}} of a model built per rank, in this
    process (building and initializing it talks to no group)."""
    monkeypatch.setattr(layers, "_tp_size_rank", lambda g: (1, 0) if g is None else (g.size, g.rank))
    dims = ParallelDims(tp=tp, pp=pp, dp_intra=1, sites=1)
    out = {}
    for p in range(pp):
        for t in range(tp):
            pgs = ProcessGroups(dims=dims, rank=dims.rank_of(t, 0, p, 0), coords=RankCoords(t, 0, p, 0),
                                tp=_TPSlot(tp, t))
            model = GPTModel(config, pgs, RNGStatesTracker(torch.device("cpu")), pre_process=p == 0,
                             post_process=p == pp - 1)
            model.initialize(seed=5)
            out[(t, p)] = {name: param.detach() for name, param in model.global_named_parameters()}
    return out


def _canonical(config, ranks, tp, pp):
    buffers = {}
    for unit in canonical_units(config):
        buf = torch.full((unit.numel,), float("nan"))
        for (t, p), params in ranks.items():
            for param in unit.params:
                if param.name in params and counts_here(param, config, t, p, pp):
                    index = param.local_index(tp, t)
                    assert torch.isnan(buf[index]).all(), f"{param.name} written twice"
                    buf[index] = params[param.name].reshape(-1)
        buffers[unit.name] = buf
    return buffers


def test_canonical_form_is_the_same_for_tp2_pp2_and_tp1_and_round_trips(monkeypatch):
    config = _config()
    tp2pp2, tp1 = _ranks(config, 2, 2, monkeypatch), _ranks(config, 1, 1, monkeypatch)
    a, b = _canonical(config, tp2pp2, 2, 2), _canonical(config, tp1, 1, 1)
    full = tp1[(0, 0)]
    qkv = "layers.0.self_attention.linear_qkv.weight"
    assert tp2pp2[(1, 0)][qkv].shape[0] * 2 == full[qkv].shape[0], "the TP2 model should hold halves"
    assert list(a) == ["embedding"] + [f"layers.{i}" for i in range(4)] + ["output"]
    for unit in canonical_units(config):
        assert not torch.isnan(a[unit.name]).any(), f"{unit.name}: a value no rank wrote"
        assert torch.equal(a[unit.name], b[unit.name]), unit.name
        assert torch.equal(a[unit.name], torch.cat([full[p.name].reshape(-1) for p in unit.params]))
    partition = {name: partition_info(p) for name, p in
                 GPTModel(config, ProcessGroups(dims=ParallelDims(), rank=0, coords=RankCoords(0, 0, 0, 0)),
                          RNGStatesTracker(torch.device("cpu"))).global_named_parameters()}
    for (t, p), params in tp2pp2.items():
        cut = split_slot(full, partition, (t, p), 2, 2, config.num_layers, True)
        assert sorted(cut) == sorted(params)
        for unit in canonical_units(config):
            for param in unit.params:
                if param.name in params:  # every copy reads back, counted or not (the tied one)
                    back = a[unit.name][param.local_index(2, t)].view(params[param.name].shape)
                    assert torch.equal(back, params[param.name]), param.name
                    assert torch.equal(cut[param.name], params[param.name]), param.name
