"""GPT / Llama decoder for one pipeline stage.

`pre_process` (first stage) owns the embeddings, `post_process` (last stage) the final
norm, output layer and loss. Middle stages receive their input through
`set_input_tensor`. With tied embeddings and PP > 1 the last stage keeps its own copy of
the word embedding (`output_layer.weight`), initialized identically and kept identical
by all-reducing its gradient with the first stage's over the embedding group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lsgd.core.parallel_state import ProcessGroups
from megatron_lsgd.core.tensor_parallel import mappings
from megatron_lsgd.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lsgd.core.tensor_parallel.initialize import initialize_parameters
from megatron_lsgd.core.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding, set_partition
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker
from megatron_lsgd.core.transformer.attention import RotaryEmbedding
from megatron_lsgd.core.transformer.config import TransformerConfig
from megatron_lsgd.core.transformer.layer import TransformerLayer
from megatron_lsgd.core.transformer.norm import build_norm
from megatron_lsgd.core.transformer.recompute import checkpointed, layer_chunks

SHARED_EMBEDDING_NAME = "embedding.word_embeddings.weight"


@dataclass
class SyncUnit:
    """A module chunk that synchronizers may act on as one piece (embedding, one layer,
    the output head): forward-pre hooks go on `modules[0]`."""

    name: str
    modules: List[nn.Module]

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()


class GPTEmbedding(nn.Module):
    def __init__(self, config: TransformerConfig, pgs: ProcessGroups, rng_tracker: RNGStatesTracker):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = pgs.tp
        self.rng_tracker = rng_tracker
        self.dropout = config.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size, config.hidden_size, tp_group=pgs.tp, init_std=config.init_method_std,
            params_dtype=config.params_dtype)
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                    dtype=config.params_dtype)
            set_partition(self.position_embeddings.weight, tensor_parallel=False, std=config.init_method_std)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.word_embeddings(input_ids)
        if self.position_embeddings is not None:
            h = h + self.position_embeddings(position_ids)
        h = h.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
        if self.sequence_parallel:
            h = mappings.scatter_to_sequence_parallel_region(h, self.tp_group)
            if self.training and self.dropout > 0:
                with self.rng_tracker.fork():
                    return F.dropout(h, self.dropout, True)
            return h
        return F.dropout(h, self.dropout, self.training)


class GPTModel(nn.Module):
    def __init__(self, config: TransformerConfig, pgs: ProcessGroups, rng_tracker: RNGStatesTracker,
                 pre_process: bool = True, post_process: bool = True):
        super().__init__()
        self.config = config
        self.pgs = pgs
        self.pre_process = pre_process
        self.post_process = post_process
        self.tp_group = pgs.tp
        tp_size = pgs.dims.tp
        per_stage = config.num_layers // pgs.dims.pp
        self.layer_offset = pgs.pp_rank * per_stage
        self.share_embeddings = not config.untie_embeddings_and_output_weights
        self.rng_tracker = rng_tracker  # recomputation replays its dropout states
        self.input_tensor: Optional[torch.Tensor] = None

        self.embedding = GPTEmbedding(config, pgs, rng_tracker) if pre_process else None
        self.rotary = (RotaryEmbedding(config.rotary_dim, config.rotary_base)
                       if config.position_embedding_type == "rope" else None)
        self.layers = nn.ModuleList(
            TransformerLayer(config, pgs.tp, tp_size, rng_tracker, self.layer_offset + i) for i in range(per_stage))
        if post_process:
            self.final_layernorm = build_norm(config)
            reuse_embedding = self.share_embeddings and pre_process
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, config.padded_vocab_size, tp_group=pgs.tp, bias=False,
                init_std=config.init_method_std, sequence_parallel=config.sequence_parallel,
                skip_weight_param=reuse_embedding, params_dtype=config.params_dtype)
            if self.share_embeddings and not pre_process:
                self.output_layer.weight.shared_embedding = True
        if self.share_embeddings and pre_process and pgs.dims.pp > 1:
            self.embedding.word_embeddings.weight.shared_embedding = True

    # ---- parameters ------------------------------------------------------------------
    def global_param_name(self, local_name: str) -> str:
        """Name a parameter would have in the single-rank model (layer index made global;
        the last stage's tied output weight is the word embedding)."""
        if local_name.startswith("layers."):
            _, idx, rest = local_name.split(".", 2)
            return f"layers.{int(idx) + self.layer_offset}.{rest}"
        if local_name == "output_layer.weight" and self.share_embeddings:
            return SHARED_EMBEDDING_NAME
        return local_name

    def global_named_parameters(self) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, p in self.named_parameters():
            yield self.global_param_name(name), p

    def initialize(self, seed: int, max_host_elements: Optional[int] = None) -> None:
        """Every parameter from the run seed and its global name (tensor_parallel/initialize.py);
        `max_host_elements`: per shard, in host pieces of at most that many values."""
        initialize_parameters(self.global_named_parameters(), seed, self.pgs.dims.tp, self.pgs.tp_rank,
                              max_host_elements)

    def sync_units(self) -> List[SyncUnit]:
        units = []
        if self.pre_process:
            units.append(SyncUnit("embedding", [self.embedding]))
        units += [SyncUnit(f"layers.{layer.layer_number}", [layer]) for layer in self.layers]
        if self.post_process:
            units.append(SyncUnit("output", [self.final_layernorm, self.output_layer]))
        return units

    # ---- forward ---------------------------------------------------------------------
    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def _run_layers(self, h, rotary, attention_mask, lo: int, hi: int):
        for layer in self.layers[lo:hi]:
            h = layer(h, rotary, attention_mask)
        return h

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Last stage: per-token loss [b, s] (or vocab-parallel logits [b, s, v/tp] without
        labels). Other stages: hidden states [s(/tp), b, h] for the next stage."""
        h = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        c = self.config
        for lo, hi, recomputed in layer_chunks(c.recompute_granularity, c.recompute_method,
                                               c.recompute_num_layers, len(self.layers)):
            if recomputed and self.training:
                h = checkpointed(self._run_layers, self.rng_tracker, h, rotary, attention_mask, lo, hi)
            else:
                h = self._run_layers(h, rotary, attention_mask, lo, hi)
        if not self.post_process:
            return h
        h = self.final_layernorm(h)
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        logits = self.output_layer(h, weight)  # [s, b, v/tp]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.tp_group)
        return loss.t().contiguous()
