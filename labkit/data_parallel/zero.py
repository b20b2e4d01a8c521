"""ZeRO stage 1: shard the optimizer state over the d data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", sec. 5.1 (P_os): with Adam each parameter carries two fp32 moments; instead of every
DP rank keeping the state of the whole model, rank r keeps (and updates) only the state of its
1/d partition. One step, as in Megatron-LM's distributed optimizer:

1. flatten this rank's local gradients into one buffer of n elements (padded to a multiple of
   d) and **reduce-scatter** it: rank r receives the sum over ranks of partition r, and divides
   by d (the DP mean);
2. the wrapped optimizer (``optimizer_class``, e.g. ``torch.optim.Adam``) steps the partition
   r of the flat parameters: state exists for n/d elements only;
3. **all-gather** the updated partitions so every rank has the whole updated model again.

Communication per step: a reduce-scatter of n elements and an all-gather of n/d per rank; in a
ring each moves (d-1)/d * n elements per rank, 2(d-1)/d * n in total, the same as the
all-reduce of plain DP (a ring all-reduce *is* a reduce-scatter then an all-gather).
:class:`labkit.comm.CommLog` counts the reduce-scatter's input (n elements) and the
all-gather's input (n/d).

The optimizer must be elementwise (Adam, AdamW, SGD with momentum and weight decay are), so the
sharded update equals the unsharded one element by element; gradient clipping by the global
norm would need an extra all-reduce and is not done here.

Name and signature follow ``torch.distributed.optim.ZeroRedundancyOptimizer(params,
optimizer_class, process_group, **defaults)``; the flat reduce-scatter / all-gather follows
Megatron-Core's ``DistributedOptimizer`` (torch's partitions whole parameters and broadcasts).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..grid import even_part

__all__ = ["ZeroRedundancyOptimizer", "optimizer_state_bytes"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, per_element_only: bool = True) -> int:
    """Bytes of the tensors in ``optimizer.state``. ``per_element_only``: only the state that
    has one value per parameter element (Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer),
    i.e. what ZeRO-1 divides by d; else also the scalars (Adam's ``step``, 4 bytes each)."""
    total = 0
    for param, state in optimizer.state.items():
        for v in state.values():
            if torch.is_tensor(v) and (not per_element_only or v.shape == param.shape):
                total += v.numel() * v.element_size()
    return total


class ZeroRedundancyOptimizer:
    """ZeRO-1 over ``process_group`` (d ranks) around ``optimizer_class(**defaults)``.

    Args:
        params: the model parameters (the same list, in the same order, on every DP rank);
            they should start equal on all ranks (see :func:`~.ddp.broadcast_parameters`).
        optimizer_class: an elementwise ``torch.optim.Optimizer`` class.
        process_group: the DP group; None: the default group.
        expert_params: parameters among ``params`` that differ across the DP ranks (the local
            experts of an MoE layer with EP folded onto DP, EP = d: their expert-data-parallel
            group is this rank alone, Megatron-Core's ``expert_data_parallel_size`` = 1). They stay
            out of the flat buffer: their gradients are divided by d (the DP mean of the loss, no
            communication) and a second ``optimizer_class`` keeps their whole state.
        **defaults: passed to ``optimizer_class`` (``lr``, ``betas``, ``momentum``, ...).

    Gradients are the *local* ones (no DDP all-reduce before): :meth:`step` reduce-scatters
    them. ``param.grad`` is left as it was (local); :attr:`grad_shard` holds this rank's
    averaged partition between :meth:`reduce_gradients` and the update. ``partition`` = (start,
    end) of this rank's elements in the flat order. Raises ValueError (no communication) for no
    parameters or parameters of mixed dtypes/devices.
    """

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class=torch.optim.Adam, process_group=None,
                 expert_params: Iterable[nn.Parameter] = (), **defaults):
        params = [p for p in params if p.requires_grad]
        experts = {id(p) for p in expert_params}
        if experts - {id(p) for p in params}:
            raise ValueError("expert_params must be among the optimizer's parameters that require grad")
        self.params = [p for p in params if id(p) not in experts]
        self.expert_params = [p for p in params if id(p) in experts]
        self.expert_optim = optimizer_class(self.expert_params, **defaults) if self.expert_params else None
        if not self.params:
            raise ValueError("ZeroRedundancyOptimizer got no parameters that require grad")
        if len({(p.dtype, p.device) for p in self.params}) > 1:
            raise ValueError("all parameters must share one dtype and device")
        self.process_group = process_group
        self.d = d = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.numel = n = sum(p.numel() for p in self.params)
        self.padded = -(-n // d) * d
        mine = even_part(self.padded, d, self.rank)
        self.partition = (mine.start, min(n, mine.stop))
        p0 = self.params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        self._flatten_into(flat, [p.detach() for p in self.params])
        # this rank's partition of the parameters: the only tensor the inner optimizer sees
        self.shard = nn.Parameter(flat[mine].clone())
        self.optim = optimizer_class([self.shard], **defaults)
        self.grad_shard = None
        self._flat_grad = torch.zeros_like(flat)
        self._flat_param = flat

    @property
    def param_groups(self):
        return self.optim.param_groups + (self.expert_optim.param_groups if self.expert_optim else [])

    @property
    def state(self):
        return self.optim.state

    def _flatten_into(self, buf: torch.Tensor, tensors) -> None:
        offset = 0
        for p, t in zip(self.params, tensors):
            n = p.numel()
            if t is None:
                buf[offset:offset + n].zero_()
            else:
                buf[offset:offset + n].copy_(t.reshape(-1))
            offset += n
        buf[offset:].zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params + self.expert_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def reduce_gradients(self) -> torch.Tensor:
        """Step 1 alone: reduce-scatter the local gradients; returns (and keeps as
        :attr:`grad_shard`) this rank's averaged partition [ceil(n/d)]. The local experts' ``.grad``
        are divided by d in place (their whole reduction)."""
        for p in self.expert_params:
            if p.grad is not None:
                p.grad.div_(self.d)
        shard = self.shard.numel()
        self._flatten_into(self._flat_grad, [p.grad for p in self.params])
        g = torch.empty(shard, dtype=self._flat_grad.dtype, device=self._flat_grad.device)
        comm.reduce_scatter_tensor(g, self._flat_grad, self.process_group)
        g.div_(self.d)
        self.grad_shard = g
        return g

    @torch.no_grad()
    def gather_gradients(self) -> None:
        """For inspection only (a lab's verdict): all-gather the averaged partitions and write
        the full averaged gradient into every ``param.grad`` (one extra all-gather of n/d per
        rank, NOT part of ZeRO-1's step). Call after :meth:`reduce_gradients`."""
        if self.grad_shard is None:
            raise RuntimeError("gather_gradients() needs reduce_gradients() first")
        full = torch.empty_like(self._flat_grad)
        comm.all_gather_into_tensor(full, self.grad_shard, self.process_group)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = full[offset:offset + n].view_as(p).clone()
            offset += n

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter the gradients (unless :meth:`reduce_gradients` already did), step this
        rank's partition, all-gather the parameters."""
        if self.grad_shard is None:
            self.reduce_gradients()
        self.shard.grad = self.grad_shard
        self.optim.step()
        if self.expert_optim is not None:
            self.expert_optim.step()
        self.grad_shard = None
        comm.all_gather_into_tensor(self._flat_param, self.shard.detach(), self.process_group)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(self._flat_param[offset:offset + n].view_as(p))
            offset += n

    def state_bytes(self, per_element_only: bool = True) -> int:
        """Optimizer-state bytes held on this rank: ceil(n/d) elements per state tensor, 1/d of
        the unsharded optimizer's (see :func:`optimizer_state_bytes`), plus the whole state of the
        local experts."""
        return optimizer_state_bytes(self.optim, per_element_only) + (
            optimizer_state_bytes(self.expert_optim, per_element_only) if self.expert_optim else 0)

    def state_dict(self):
        """The shard optimizer's state dict (with local experts: ``{"shard": ..., "experts": ...}``)."""
        if self.expert_optim is None:
            return self.optim.state_dict()
        return {"shard": self.optim.state_dict(), "experts": self.expert_optim.state_dict()}
