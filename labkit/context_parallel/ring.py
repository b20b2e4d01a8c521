"""Ring attention: K/V blocks travel around the CP ring while each rank computes on the block it holds.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers", sec. 3; the causal
variant with the load-balanced placement as in Megatron-Core context parallelism.

Forward, on rank r of cp (each holding its queries q_r and keys/values kv_r):

    step s = 0 .. cp-1:  hold block j = (r - s) mod cp;
                         post send of kv_j to rank r+1 and receive of kv_{j-1} from rank r-1,
                         compute (o_j, lse_j) of q_r on kv_j while they travel, merge by
                         log-sum-exp (blockwise.merge_partials), wait.

so every rank sees every block after cp-1 transfers of one K/V block each. A causal block
whose keys all lie after the rank's queries is skipped (no work).

Backward (hand-written, FlashAttention-2 style, from the final lse): the K/V blocks go around
the ring a second time, each travelling with its gradient accumulator dk_j, dv_j; every rank
adds its queries' share, and after cp steps the accumulator arrives back at the block's owner:
cp - 1 transfers of (k, v) and cp transfers of (dk, dv) per rank.

Bytes sent per rank (one block b = B * h_kv * (S/cp) * d * element size): forward 2 (cp-1) b,
backward 2 (cp-1) b + 2 cp b.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .. import comm
from .blockwise import block_attention, block_attention_backward, block_has_work, block_work, merge_partials


def _ring_peers(group):
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    cp = len(ranks)
    return me, cp, ranks[(me + 1) % cp], ranks[(me - 1) % cp]


def _exchange(send_buf: torch.Tensor, nxt: int, prv: int, group):
    """Post send of ``send_buf`` to ``nxt`` and receive of a same-shaped block from ``prv``;
    returns (receive buffer, works to wait on)."""
    recv_buf = torch.empty_like(send_buf)
    ops = [dist.P2POp(dist.isend, send_buf, nxt, group), dist.P2POp(dist.irecv, recv_buf, prv, group)]
    return recv_buf, comm.batch_isend_irecv(ops)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, kv_pos_all, causal, group, stats):
        me, cp, nxt, prv = _ring_peers(group)
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for s in range(cp):
            j = (me - s) % cp
            works = []
            if s < cp - 1:
                nxt_kv, works = _exchange(kv, nxt, prv, group)
            t0 = time.perf_counter()
            k_pos = kv_pos_all[j]
            if block_has_work(q_pos, k_pos, causal):
                o_j, l_j = block_attention(q, kv[0], kv[1], q_pos, k_pos, causal)
                out, lse = (o_j, l_j) if out is None else merge_partials(out, lse, o_j, l_j)
            if stats is not None:
                stats.append({"step": s, "block": j, "work": block_work(q_pos, k_pos, causal),
                              "heads": q.shape[1], "seconds": time.perf_counter() - t0})
            for w in works:
                w.wait()
            if s < cp - 1:
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.q_pos, ctx.kv_pos_all, ctx.causal, ctx.group = q_pos, kv_pos_all, causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_pos, kv_pos_all, causal, group = ctx.q_pos, ctx.kv_pos_all, ctx.causal, ctx.group
        me, cp, nxt, prv = _ring_peers(group)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)
        for s in range(cp):
            j = (me - s) % cp
            works = []
            if s < cp - 1:
                nxt_kv, works = _exchange(kv, nxt, prv, group)
            k_pos = kv_pos_all[j]
            if block_has_work(q_pos, k_pos, causal):
                dq_j, dk_j, dv_j = block_attention_backward(q, kv[0], kv[1], dout, lse, delta, q_pos, k_pos, causal)
                dq += dq_j
                dkv = dkv + torch.stack([dk_j, dv_j])
            for w in works:
                w.wait()
            if cp > 1:  # the accumulator moves on with its block; after cp moves it is home
                dkv, dworks = _exchange(dkv.contiguous(), nxt, prv, group)
                for w in dworks:
                    w.wait()
            if s < cp - 1:
                kv = nxt_kv
        return dq, dkv[0], dkv[1], None, None, None, None, None


def ring_attention(q, k, v, group, positions, causal: bool = True, stats: list | None = None):
    """Attention of this rank's queries on the whole sequence's keys, by ring attention.

    Args:
        q: [B, h, S/cp, d] this rank's queries; k, v: [B, h_kv, S/cp, d] its keys/values.
        group: the CP process group (ranks in ring order).
        positions: list of cp long tensors [S/cp], the global positions each CP rank holds
            (``[sequence_positions(S, r, cp, lb) for r in range(cp)]``).
        causal: apply the causal mask by global position.
        stats: if a list, one dict per ring step is appended: ``step``, ``block`` (owner of
            the K/V block), ``work`` (unmasked query-key pairs per batch row and head),
            ``heads`` (h: every head computes that work), ``seconds`` (compute time).

    Returns: [B, h, S/cp, d], equal to full attention's rows for this rank's queries.
    """
    me = dist.get_process_group_ranks(group).index(dist.get_rank())
    return _RingAttention.apply(q, k, v, positions[me], positions, causal, group, stats)
