"""What sequence parallelism adds after backward, and measuring what a layer saves.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
sec. 4.2.2. The sequence-parallel layers themselves are the TP layers with
``sequence_parallel=True`` (:mod:`.layers`, :class:`labkit.tensor_parallel.ParallelBlock`; the
operators ``g`` and ``g-bar`` are in :mod:`.mappings`). Under SP the LayerNorm weights (and the
biases added after a reduce-scatter, and the position embedding) see only S/t tokens on each
rank: their gradients are partial sums and must be all-reduced over the TP group after backward
(:func:`allreduce_layernorm_grads`, Megatron-Core's ``_allreduce_layernorm_grads`` in
``finalize_model_grads``).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..checkpoint import SavedTensorMeter
from .mappings import tp_size

__all__ = ["allreduce_layernorm_grads", "allreduce_sequence_parallel_grads", "measure_activation_bytes"]


@torch.no_grad()
def allreduce_layernorm_grads(model: nn.Module, group) -> int:
    """Sum over the TP group the gradients of every parameter marked ``sequence_parallel``
    (LayerNorm weights and biases, row-parallel biases of sequence-parallel layers; an MoE
    block's router and experts, which routed only this rank's tokens): each rank saw only its
    S/t tokens, so its gradient is a partial sum (Korthikanti et al. 2022, sec. 4.2.2;
    Megatron-Core ``finalize_model_grads``).

    The gradients are packed into ONE buffer and all-reduced once (like Megatron's coalesced
    reduction). Returns the number of elements reduced (0: nothing to do, no communication).
    Collective: every rank of ``group`` must call it, with the same model structure.
    """
    return allreduce_sequence_parallel_grads(model.parameters(), group)


@torch.no_grad()
def allreduce_sequence_parallel_grads(params, group) -> int:
    """:func:`allreduce_layernorm_grads` on the parameters ``params`` (an iterable): those marked
    ``sequence_parallel`` with a gradient, summed over ``group`` in one coalesced all-reduce.
    Returns the number of elements reduced (0: no communication)."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_size(group) == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel()


def measure_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of tensors ``module(*inputs)`` saves for backward, on this rank, measured with
    ``torch.autograd.graph.saved_tensors_hooks`` (:class:`labkit.checkpoint.SavedTensorMeter`;
    parameters excluded, tensors sharing storage counted once, the inputs included when saved).

    Runs one forward (training mode as set), counts what is alive after it, then drops the
    graph without a backward. Collective when ``module`` communicates (every TP rank calls it).
    Compare with :func:`labkit.plan.layer_activation_bytes`.
    """
    with SavedTensorMeter(exclude=list(module.parameters())) as meter:
        out = module(*inputs)
        live = meter.live
    del out
    return live
