"""Mixture-of-Experts: routing, balance losses, experts, dispatch, expert parallelism."""
from .router import RouterOutput, TopKRouter, Gate, route, compute_capacity, capacity_mask, update_expert_bias
from .losses import (switch_aux_loss, z_loss, expert_balance_loss, device_balance_loss, comm_balance_loss,
                     sequence_balance_loss, expert_fraction, router_probs)
from .dispatch import permute, unpermute, sorted_moe, dense_moe, dense_dispatch_tensors, run_experts
from .experts import Expert, MoEConfig, MoEStats, MoELayer, MoE, fine_grained
