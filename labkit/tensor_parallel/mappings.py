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
    "reduce_scatter_along_dim",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
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


class _Split(torch.autograd.Function):
    """Forward: keep this rank's slice of ``dim``; backward: all-gather the gradient along it.
    The last dimension (TP) or the sequence (SP) alike."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along ``dim``; backward: this rank's slice of the gradient, or, with
    ``reduce_grad`` (each rank holds a partial dL/dX), the sum over ranks of it (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad):
        ctx.dim, ctx.group, ctx.reduce_grad = dim, group, reduce_grad
        return all_gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reduce_grad:
            return reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None, None
        return split_along_dim(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Forward: sum over ranks and keep this rank's slice of ``dim``; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along_dim(grad, ctx.dim, ctx.group), None, None


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
    return _Split.apply(x, -1, group)


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
    return _Gather.apply(x, -1, group, False)


# --------------------------------------------------------------------------- sequence parallel
# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
# sec. 4.2.2, Fig. 5: in the LayerNorm and dropout regions of a layer the activations are split
# along the SEQUENCE over the TP group. Entering a tensor-parallel region the sequence shards
# are all-gathered (operator g, replacing f); leaving it the partial sums are reduce-scattered
# along the sequence (operator g-bar, replacing the all-reduce g). A ring all-reduce IS a
# reduce-scatter followed by an all-gather, so the bytes on the wire are the same.
# labkit's activations are [B, S, H]: the sequence dimension is 1 (Megatron uses [S, B, H], dim 0).

SEQUENCE_DIM = 1


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` and keep this rank's contiguous 1/t slice of ``dim``.

    Shape ``[..., n, ...] -> [..., n/t, ...]``. One reduce-scatter of ``x.numel()`` elements
    (counted as ``"reduce_scatter"``, payload = the full input). Not differentiable by itself.
    Raises ValueError when t does not divide ``x.shape[dim]``.
    """
    t = tp_size(group)
    if t == 1:
        return x
    n = x.shape[dim]
    if n % t:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {n} over t={t} ranks")
    front = x.movedim(dim, 0).contiguous()     # reduce_scatter_tensor splits dim 0
    out = front.new_empty((n // t,) + tuple(front.shape[1:]))
    comm.reduce_scatter_tensor(out, front, group=group)
    return out.movedim(0, dim).contiguous()


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, S, H] -> [B, S/t, H]``: this rank's contiguous block of the sequence (no
    communication forward); backward all-gathers the gradient (1 all-gather).

    Raises ValueError when t does not divide S. Megatron-Core name; Korthikanti et al. 2022
    sec. 4.2.2.
    """
    return _Split.apply(x, SEQUENCE_DIM, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """The paper's ``g`` (Fig. 5): ``[B, S/t, H] -> [B, S, H]``, all-gathering the sequence
    shards in rank order before a column-parallel layer.

    Backward: reduce-scatter of dL/dX along the sequence (each rank's column-parallel branch
    produced a partial gradient), or, with ``tensor_parallel_output_grad=False`` (the
    gradient is already complete on every rank), just this rank's slice.
    Communication: forward 1 all-gather (payload ``x.numel()`` per rank), backward 1
    reduce-scatter (payload ``t * x.numel()``). Korthikanti et al. 2022, sec. 4.2.2.
    """
    return _Gather.apply(x, SEQUENCE_DIM, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """The paper's ``g-bar`` (Fig. 5): ``[B, S, H] -> [B, S/t, H]``, summing the partial
    outputs of a row-parallel layer and keeping this rank's block of the sequence.

    Backward: all-gather of the gradient shards. Communication: forward 1 reduce-scatter
    (payload ``x.numel()``), backward 1 all-gather (payload ``x.numel() / t``). Together with
    :func:`gather_from_sequence_parallel_region` the bytes on the wire equal those of the
    all-reduces they replace (a ring all-reduce = reduce-scatter + all-gather).
    Raises ValueError when t does not divide S. Korthikanti et al. 2022, sec. 4.2.2.
    """
    return _ReduceScatter.apply(x, SEQUENCE_DIM, group)
