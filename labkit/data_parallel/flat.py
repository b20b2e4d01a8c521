"""Flat parameters: many tensors viewed as one 1-D buffer, padded and split into d equal shards.

Every sharded data-parallel scheme (ZeRO stages 1-3, torch FSDP's ``FlatParameter``,
Megatron-Core's distributed optimizer) does the same bookkeeping: concatenate the n elements of
a group of parameters, pad with zeros to ``ceil(n/d) * d`` so that a reduce-scatter and an
all-gather over d ranks see equal pieces, and give rank r the elements
``[r * n_pad/d, (r+1) * n_pad/d)``. The padding is real traffic: collectives move n_pad
elements, not n (Rajbhandari et al. 2020, ZeRO, sec. 5; torch FSDP, Zhao et al. 2023, sec. 3.2).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Sequence

import torch

from ..grid import even_part

__all__ = ["padded_numel", "flatten", "shard_flat", "unshard_flat", "unflatten", "bucket_groups", "NoSyncMixin"]


def padded_numel(numel: int, d: int) -> int:
    """``ceil(numel / d) * d``: the flat length that d ranks can split equally. Raises
    ValueError for ``d < 1`` or ``numel < 0``."""
    if d < 1 or numel < 0:
        raise ValueError(f"padded_numel needs d >= 1 and numel >= 0, got d={d}, numel={numel}")
    return -(-numel // d) * d


def flatten(tensors: Sequence[torch.Tensor], d: int = 1) -> torch.Tensor:
    """Concatenate ``tensors`` (any shapes, one dtype) into one 1-D tensor of
    ``padded_numel(sum numel, d)`` elements, zeros at the end."""
    n = sum(t.numel() for t in tensors)
    out = torch.zeros(padded_numel(n, d), dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].copy_(t.reshape(-1))
        offset += t.numel()
    return out


def shard_flat(flat: torch.Tensor, d: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the 1-D ``flat`` (padded with zeros to a multiple of d first):
    a new tensor of ``ceil(len/d)`` elements. Raises ValueError unless ``0 <= rank < d``."""
    if not 0 <= rank < d:
        raise ValueError(f"shard_flat needs 0 <= rank < d, got rank={rank}, d={d}")
    size = padded_numel(flat.numel(), d) // d
    out = torch.zeros(size, dtype=flat.dtype, device=flat.device)
    piece = flat.reshape(-1)[even_part(size * d, d, rank)]
    out[:piece.numel()].copy_(piece)
    return out


def unshard_flat(shards: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """Inverse of :func:`shard_flat`: concatenate the d shards (rank order; what an all-gather
    returns) and drop the padding, keeping the first ``numel`` elements."""
    return torch.cat([s.reshape(-1) for s in shards])[:numel]


def unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views of ``flat`` with the given shapes, in order (the padding is left out)."""
    out, offset = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(flat[offset:offset + n].view(shape))
        offset += n
    return out


def bucket_groups(nbytes: Sequence[int], bucket_cap_mb: float) -> list[list[int]]:
    """Indices of consecutive buckets of at most ``bucket_cap_mb`` MiB for tensors of ``nbytes``
    bytes (in the order given: reverse registration order for gradient buckets); a tensor larger
    than the cap gets a bucket of its own (PyTorch DDP's rule, Li et al. 2020 sec. 3.2.3)."""
    cap = bucket_cap_mb * 2**20
    groups, cur, cur_bytes = [], [], 0
    for i, nb in enumerate(nbytes):
        if cur and cur_bytes + nb > cap:
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += nb
    if cur:
        groups.append(cur)
    return groups


class NoSyncMixin:
    """``no_sync()`` of the data-parallel wrappers (torch DDP's and FSDP's name): backwards run
    inside skip the gradient reduction (all-reduce or reduce-scatter); gradients accumulate
    locally and the first backward outside reduces them all. The wrapper reads
    ``require_backward_grad_sync`` in its hooks."""
    require_backward_grad_sync = True

    @contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old
