"""Megatron-LM tensor parallelism (Shoeybi et al. 2019, sec. 3) on explicit process groups.

* :mod:`.mappings`: the conjugate operators f / g and scatter / gather;
* :mod:`.layers`: ColumnParallelLinear, RowParallelLinear, ParallelMLP, VocabParallelEmbedding;
* :mod:`.attention`: ParallelAttention (heads split across ranks, GQA included);
* :mod:`.cross_entropy`: vocab_parallel_cross_entropy;
* :mod:`.model`: TensorParallelGPT built from the reference GPT, gather_full_tensors;
* :mod:`.sequence_parallel`: ParallelTransformerLayer with sequence parallelism and
  selective / full recomputation (Korthikanti et al. 2022), allreduce_layernorm_grads.
"""
from .mappings import (
    all_gather_along_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_along_dim,
    reduce_scatter_along_dim,
    scatter_to_sequence_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear, VocabParallelEmbedding
from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .model import ParallelBlock, TensorParallelGPT, expected_collectives, gather_full_tensors
from .sequence_parallel import ParallelTransformerLayer, allreduce_layernorm_grads

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "split_along_dim",
    "all_gather_along_dim",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelMLP",
    "VocabParallelEmbedding",
    "ParallelAttention",
    "vocab_parallel_cross_entropy",
    "TensorParallelGPT",
    "ParallelBlock",
    "gather_full_tensors",
    "expected_collectives",
    "reduce_scatter_along_dim",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "ParallelTransformerLayer",
    "allreduce_layernorm_grads",
]
