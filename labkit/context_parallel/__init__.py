"""Context parallelism (CP): the sequence split over a group of ranks, attention computed three ways.

* :mod:`.sharding`  the split (contiguous or the load-balanced 2 x cp chunk placement), causal work
* :mod:`.blockwise` attention on one K/V block with its log-sum-exp; the merge of partial results
* :mod:`.ring`      ring attention: K/V passed around the ring by P2P, hand-written ring backward
* :mod:`.allgather` all-gather of K/V (Llama 3)
* :mod:`.ulysses`   all-to-all from sequence- to head-sharded and back (DeepSpeed-Ulysses)
* :mod:`.layers`    the reference attention layer and GPT run context-parallel

Every collective and P2P goes through :mod:`labkit.comm`; process groups are passed in.
"""
from .allgather import allgather_attention
from .blockwise import block_attention, merge_partials
from .layers import ATTENTIONS, ContextParallelAttention, ContextParallelGPT, check_cp_config, finish_grad_sync
from .ring import ring_attention
from .sharding import (
                     attention_work,
                     causal_work,
                     check_sequence_split,
                     chunk_placement,
                     gather_sequence,
                     sequence_positions,
                     shard_sequence,
                     unshard_sequence,
)
from .ulysses import check_ulysses, ulysses_attention

__all__ = [
    "ATTENTIONS", "ContextParallelAttention", "ContextParallelGPT", "allgather_attention", "attention_work",
    "block_attention", "causal_work", "check_cp_config", "check_sequence_split", "check_ulysses",
    "chunk_placement", "finish_grad_sync", "gather_sequence", "merge_partials", "ring_attention",
    "sequence_positions", "shard_sequence", "ulysses_attention", "unshard_sequence",
]
