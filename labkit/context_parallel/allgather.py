"""All-gather K/V context parallelism (Llama 3, Dubey et al. 2024, sec. 3.3.2).

Each rank all-gathers the keys and values of the whole sequence over the CP group (K/V are small
under grouped-query attention: h_kv = 8 of 128 heads in Llama 3 405B), then computes attention of
its own queries, load-balanced chunks and causal mask by global position, locally. Backward: the
gradients of the gathered K/V are reduce-scattered back to their owners.

Bytes per rank (all-gather payload = the local shard b = B h_kv (S/cp) d e): forward two
all-gathers of b each (k and v); backward two reduce-scatters of cp b each (their input).
"""
from __future__ import annotations

import time

import torch

from .. import comm
from .blockwise import block_attention, block_work


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 2 (sequence) of [B, h, s, d]; backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        cp = comm._group_size(group)
        xt = x.permute(2, 0, 1, 3).contiguous()
        out = torch.empty((cp * xt.shape[0], *xt.shape[1:]), dtype=x.dtype, device=x.device)
        comm.all_gather_into_tensor(out, xt, group)
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, g):
        cp = comm._group_size(ctx.group)
        gt = g.permute(2, 0, 1, 3).contiguous()
        out = torch.empty((gt.shape[0] // cp, *gt.shape[1:]), dtype=g.dtype, device=g.device)
        comm.reduce_scatter_tensor(out, gt, ctx.group)
        return out.permute(1, 2, 0, 3), None


def allgather_attention(q, k, v, group, positions, causal: bool = True, stats: list | None = None):
    """Attention of this rank's queries on the whole sequence, K/V all-gathered.

    Args as :func:`labkit.context_parallel.ring.ring_attention`: q [B, h, S/cp, d],
    k, v [B, h_kv, S/cp, d], the CP ``group``, ``positions`` (cp tensors [S/cp]), ``causal``;
    ``stats``: if a list, one dict is appended: ``work`` (unmasked query-key pairs per batch row
    and head: this rank's queries on all S keys, :func:`labkit.context_parallel.causal_work`),
    ``heads`` (h, every head computes that work) and ``seconds`` (forward compute time, gather
    excluded). The masked scores are computed too (one dense [S/cp, S] block per head), so the
    time follows S/cp * S, not the work, unless a kernel skips masked tiles.
    Returns [B, h, S/cp, d]. Differentiable (autograd through the gather and the local math).
    """
    import torch.distributed as dist
    me = dist.get_process_group_ranks(group).index(dist.get_rank())
    k_all, v_all = _GatherSeq.apply(k, group), _GatherSeq.apply(v, group)
    k_pos = torch.cat(positions)
    t0 = time.perf_counter()
    out, _ = block_attention(q, k_all, v_all, positions[me], k_pos, causal)
    if stats is not None:
        stats.append({"work": block_work(positions[me], k_pos, causal), "heads": q.shape[1],
                      "seconds": time.perf_counter() - t0})
    return out
