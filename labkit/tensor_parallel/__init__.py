"""Megatron-LM tensor parallelism (Shoeybi et al. 2019, sec. 3) and sequence parallelism
(Korthikanti et al. 2022, sec. 4.2.2) on explicit process groups.

* :mod:`.mappings`: the conjugate operators f / g, scatter / gather along the last dimension or
  the sequence, g / g-bar of sequence parallelism;
* :mod:`.layers`: ColumnParallelLinear, RowParallelLinear (``sequence_parallel=``), ParallelMLP,
  VocabParallelEmbedding;
* :mod:`.attention`: ParallelAttention (heads split across ranks, GQA included);
* :mod:`.cross_entropy`: vocab_parallel_cross_entropy;
* :mod:`.parallelize`: parallelize(model, group, plan), a plan table of split rules;
* :mod:`.model`: the GPT's plan (gpt_plan: ParallelEmbedding, ParallelBlock with
  ``sequence_parallel`` and ``recompute`` none | selective | full, ParallelHead),
  TensorParallelGPT, gather_full_tensors;
* :mod:`.sequence_parallel`: allreduce_layernorm_grads, allreduce_sequence_parallel_grads, measure_activation_bytes.
"""
from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear, VocabParallelEmbedding
from .mappings import (
    all_gather_along_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_along_dim,
)
from .model import (
    RECOMPUTE,
    ParallelBlock,
    ParallelEmbedding,
    ParallelHead,
    ParallelTransformerLayer,
    TensorParallelGPT,
    gather_full_tensors,
    gpt_plan,
)
from .parallelize import parallelize
from .sequence_parallel import allreduce_layernorm_grads, allreduce_sequence_parallel_grads, measure_activation_bytes

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
    "parallelize",
    "gpt_plan",
    "RECOMPUTE",
    "TensorParallelGPT",
    "ParallelEmbedding",
    "ParallelBlock",
    "ParallelHead",
    "gather_full_tensors",
    "reduce_scatter_along_dim",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "ParallelTransformerLayer",
    "allreduce_layernorm_grads",
    "allreduce_sequence_parallel_grads",
    "measure_activation_bytes",
]
