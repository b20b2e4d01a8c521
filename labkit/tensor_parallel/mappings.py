"""The four conjugate communication operators of Megatron-LM tensor parallelism.

Shoeybi et al. 2019, "Megatron-LM", sec. 3, Fig. 3: a tensor-parallel MLP or attention
block is wrapped in two operators,

* ``f`` = :func:`copy_to_tensor_model_parallel_region`: forward identity (every rank
  already holds the whole input X), backward all-reduce (each rank computed only its
  part of dL/dX, the true gradient is their sum);
* ``g`` = :func:`reduce_from_tensor_model_parallel_region`: forward all-reduce (each rank
  holds a partial sum of the output), backward identity (dL/dY is replicated).

``f`` and ``g`` are *conjugate*: what one does forward, the other does backward. The same
holds for the last-dimension split and all-gather:

* :func:`scatter_to_tensor_model_parallel_region`: forward keep this rank's slice of the
  last dimension, backward all-gather the gradient slices;
* :func:`gather_from_tensor_model_parallel_region`: forward all-gather the slices along
  the last dimension, backward keep this rank's slice of the gradient.

Every operator takes the tensor-parallel process group explicitly (degree t = its size)
and communicates only through :mod:`labkit.comm`, so :class:`labkit.comm.CommLog`
counts it. With t = 1 they are all identities and communicate nothing.

Names follow Megatron-Core (``megatron/core/tensor_parallel/mappings.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "tp_size",
    "tp_rank",
    "split_along_dim",
    "all_gather_along_dim",
]


def tp_size(group) -> int:
    """Tensor-parallel degree t: the number of ranks in ``group`` (no communication)."""
    return dist.get_world_size(group)


def tp_rank(group) -> int:
    """This rank's index 0..t-1 inside ``group`` (no communication)."""
    return dist.get_rank(group)


def split_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous 1/t slice of ``x`` along ``dim`` (no communication).

    Raises ValueError when t does not divide ``x.shape[dim]``.
    """
    t = tp_size(group)
    if t == 1:
        return x
    n = x.shape[dim]
    if n % t:
        raise ValueError(f"cannot split dimension {dim} of size {n} into t={t} equal parts")
    return x.narrow(dim, tp_rank(group) * (n // t), n // t).contiguous()


def all_gather_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (same shape) along ``dim`` in rank order.

    Shape ``[..., n, ...] -> [..., t*n, ...]``. One all-gather of ``x.numel()`` elements
    per rank (counted as ``"all_gather"``). Not differentiable by itself.
    """
    t = tp_size(group)
    if t == 1:
        return x
    x = x.contiguous()
    # all_gather_into_tensor stacks along dim 0: gather into [t, *shape], then move the
    # rank axis next to ``dim`` and merge the two.
    if x.dim() == 0:
        raise ValueError("all_gather_along_dim needs a tensor with at least one dimension")
    out = x.new_empty((t * x.shape[0],) + tuple(x.shape[1:]))
    comm.all_gather_into_tensor(out, x, group=group)
    parts = out.reshape((t,) + tuple(x.shape)).unbind(0)
    return torch.cat(parts, dim=dim)


class _CopyToModelParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce (sum) over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if tp_size(ctx.group) == 1:
            return grad, None
        grad = grad.contiguous().clone()
        return comm.all_reduce(grad, group=ctx.group), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: forward all-reduce (sum) over the TP group, backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        if tp_size(group) == 1:
            return x.view_as(x)
        # clone: the all-reduce works in place and must not overwrite a tensor autograd saved
        return comm.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim; backward: all-gather along it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, -1, ctx.group), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_along_dim(grad, -1, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The paper's ``f``: returns ``x`` unchanged; in backward all-reduces dL/dx over ``group``.

    Shape unchanged ``[*, H]``. Communication: backward 1 all-reduce of ``x.numel()``
    elements. Megatron-LM sec. 3, Fig. 3(a).
    """
    return _CopyToModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The paper's ``g``: sums the partial results ``x`` of all ranks; backward identity.

    Shape unchanged ``[*, H]``. Communication: forward 1 all-reduce of ``x.numel()``
    elements. Megatron-LM sec. 3, Fig. 3(b).
    """
    return _ReduceFromModelParallelRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[*, n] -> [*, n/t]``: this rank's contiguous slice of the last dimension.

    Backward all-gathers the gradient slices (1 all-gather). Raises ValueError when t
    does not divide n.
    """
    return _ScatterToModelParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[*, n/t] -> [*, n]``: concatenates every rank's slice along the last dimension.

    Forward 1 all-gather; backward keeps this rank's slice of the gradient (no communication).

    The backward ASSUMES that the incoming gradient dL/dY [*, n] is the same on every rank of
    ``group``, which holds when everything after the gather is replicated (every rank computes
    the same function of the same gathered Y, e.g. ``ColumnParallelLinear(gather_output=True)``
    followed by replicated layers and the same loss). Then rank i's slice of dL/dY is the whole
    gradient of its shard. If ranks use Y differently (different losses, data or dropout masks
    after the gather), the true gradient of shard i is the SUM over ranks of their slice i,
    i.e. a reduce-scatter, and this operator silently returns only this rank's term. Megatron-
    Core's operator makes the same assumption.
    """
    return _GatherFromModelParallelRegion.apply(x, group)
