"""Mixture-of-Experts: routing, balance losses, experts, dispatch, expert parallelism.

Modules (one concept each): ``router`` (top-k gate, capacity, group-limited routing,
aux-loss-free bias), ``losses`` (Switch/GShard aux, z-loss, DeepSeek-V2 expert/device/
communication, DeepSeek-V3 sequence-wise), ``dispatch`` (sort-based and GShard one-hot),
``experts`` (FFN experts, shared and fine-grained, the single-device ``MoELayer``),
``expert_parallel`` (experts sharded over ranks, all-to-all dispatch), ``model`` (MoE GPT),
``eplb`` (redundant experts and their
placement), ``replicas`` (expert parallelism over the copies), ``hierarchical`` (two-level
all-to-all, bytes per level), ``inference`` (expert slicing), ``pipeline`` (the MoE
GPT under pipeline parallelism).
"""
from .dispatch import dense_dispatch_tensors, dense_moe, permute, run_experts, sorted_moe, unpermute
from .eplb import rebalance_experts
from .expert_parallel import (
                     ExpertParallelMoE,
                     all_reduce_loads,
                     all_to_all,
                     all_to_all_uneven,
                     exchange_splits,
                     sync_replicated_grads,
                     to_expert_parallel,
)
from .experts import Expert, MoE, MoEConfig, MoELayer, MoEStats, fine_grained
from .losses import (
                     comm_balance_loss,
                     device_balance_loss,
                     expert_balance_loss,
                     expert_fraction,
                     router_probs,
                     sequence_balance_loss,
                     switch_aux_loss,
                     z_loss,
)
from .model import MoEBlock, MoEGPT, moe_config_for, total_aux_loss
from .replicas import ReplicatedExpertParallelMoE, sync_replica_grads, to_replicated_expert_parallel
from .router import Gate, RouterOutput, TopKRouter, capacity_mask, compute_capacity, route, update_expert_bias
