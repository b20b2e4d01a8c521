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
from .router import RouterOutput, TopKRouter, Gate, route, compute_capacity, capacity_mask, update_expert_bias
from .losses import (switch_aux_loss, z_loss, expert_balance_loss, device_balance_loss, comm_balance_loss,
                     sequence_balance_loss, expert_fraction, router_probs)
from .dispatch import permute, unpermute, sorted_moe, dense_moe, dense_dispatch_tensors, run_experts
from .experts import Expert, MoEConfig, MoEStats, MoELayer, MoE, fine_grained
from .expert_parallel import (ExpertParallelMoE, all_to_all, all_to_all_uneven, exchange_splits,
                              sync_replicated_grads, to_expert_parallel, all_reduce_loads)
from .model import MoEBlock, MoEGPT, total_aux_loss, moe_config_for
from .eplb import rebalance_experts
from .replicas import ReplicatedExpertParallelMoE, sync_replica_grads, to_replicated_expert_parallel
