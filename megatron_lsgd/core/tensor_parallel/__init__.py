from megatron_lsgd.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lsgd.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_partition,
)
from megatron_lsgd.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seeds

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "RNGStatesTracker",
    "model_parallel_seeds",
    "set_partition",
    "vocab_parallel_cross_entropy",
]
