"""DeepSpeed-Ulysses (Jacobs et al. 2023, sec. 3): all-to-all from sequence-sharded to head-sharded.

Before attention each rank holds all h heads of S/cp tokens; an all-to-all over the CP group
gives it h/cp heads of all S tokens, attention runs per head locally on the full sequence, and a
second all-to-all returns the output to sequence-sharded. Heads are the unit of the split, so
h and h_kv must both be divisible by cp (:func:`check_ulysses`).

Bytes per rank (all-to-all payload = what this rank sends, its whole local tensor): forward q, k, v
and the output (B (2h + 2h_kv) (S/cp) d e in all), backward the same four again.
"""
from __future__ import annotations

import numbers
import time

import torch

from .. import comm
from .blockwise import block_attention, block_work


def check_ulysses(n_head: int, n_kv_head: int, cp: int) -> None:
    """Raise ValueError (one line) unless cp divides both n_head and n_kv_head."""
    for name, val in (("n_head", n_head), ("n_kv_head", n_kv_head), ("cp", cp)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
    if n_head % cp or n_kv_head % cp:
        raise ValueError(f"Ulysses splits attention heads over the CP group: n_head={n_head} and "
                         f"n_kv_head={n_kv_head} must both be divisible by cp={cp}")


def _seq_to_head(x, group):
    """[B, h, s, d] (this rank's s tokens) -> [B, h/cp, cp*s, d] (its h/cp heads, all tokens,
    ranks' token blocks in rank order)."""
    cp = comm._group_size(group)
    B, h, s, d = x.shape
    send = x.reshape(B, cp, h // cp, s, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * s, d)


def _head_to_seq(x, group):
    """Inverse of :func:`_seq_to_head`: [B, h/cp, cp*s, d] -> [B, h, s, d]."""
    cp = comm._group_size(group)
    B, hc, S, d = x.shape
    send = x.reshape(B, hc, cp, S // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(B, hc * cp, S // cp, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_head(x, group)

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g.contiguous(), ctx.group), None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _head_to_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g.contiguous(), ctx.group), None


def ulysses_attention(q, k, v, group, positions, causal: bool = True, stats: list | None = None):
    """Attention of this rank's queries on the whole sequence, by two all-to-alls over heads.

    Args as :func:`labkit.context_parallel.ring.ring_attention`: q [B, h, S/cp, d],
    k, v [B, h_kv, S/cp, d], ``positions`` (cp tensors [S/cp]), ``causal``; ``stats``: if a
    list, one dict is appended: ``work`` (unmasked query-key pairs per batch row and head: every
    position's queries on every key, S (S+1)/2 causal, whatever the placement), ``heads`` (h/cp,
    the heads this rank computes it for) and ``seconds`` (forward compute time, all-to-alls
    excluded). Every rank computes the same work: balance here comes from the head split, the
    chunk placement changes nothing.
    Returns [B, h, S/cp, d]. Raises ValueError when cp does not divide h and h_kv.
    """
    cp = comm._group_size(group)
    check_ulysses(q.shape[1], k.shape[1], cp)
    pos = torch.cat(positions)
    qh, kh, vh = (_SeqToHead.apply(t, group) for t in (q, k, v))
    t0 = time.perf_counter()
    out, _ = block_attention(qh, kh, vh, pos, pos, causal)
    if stats is not None:
        stats.append({"work": block_work(pos, pos, causal), "heads": qh.shape[1],
                      "seconds": time.perf_counter() - t0})
    return _HeadToSeq.apply(out, group)
