"""Attention on one block of keys, returning the log-sum-exp, and the merge of partial results.

For one query row q and a block of keys K_j, V_j (scale 1/sqrt(d)):

    s_j = q K_j^T / sqrt(d)     lse_j = log sum exp(s_j)     o_j = softmax(s_j) V_j

Full attention over the union of blocks a and b is recovered exactly from the two partial
results (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"; FlashAttention,
Dao et al. 2022, sec. 3.1; ring attention, Liu et al. 2023):

    lse = log(exp(lse_a) + exp(lse_b))
    o   = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b

The probabilities of one block are normalised by that block's own sum; the weights
exp(lse_j - lse) rescale them to the full sum. Averaging o_a and o_b, or adding them, is wrong
unless both blocks carry the same total weight.

Shapes: q [B, h, Sq, d]; k, v [B, h_kv, Sk, d] (grouped-query: each K/V head serves h / h_kv
query heads); positions q_pos [Sq], k_pos [Sk] (global token indices: the causal mask is
k_pos <= q_pos); out [B, h, Sq, d]; lse [B, h, Sq] (-inf for a row whose keys are all masked).
"""
from __future__ import annotations

import math

import torch


def expand_kv(k: torch.Tensor, h: int) -> torch.Tensor:
    """[B, h_kv, S, d] -> [B, h, S, d]: K/V head i serves query heads i*g .. (i+1)*g-1."""
    return k if k.shape[1] == h else k.repeat_interleave(h // k.shape[1], dim=1)


def reduce_kv_grad(dk: torch.Tensor, h_kv: int) -> torch.Tensor:
    """Adjoint of :func:`expand_kv`: [B, h, S, d] -> [B, h_kv, S, d] (sum over each group)."""
    B, h, S, d = dk.shape
    return dk if h == h_kv else dk.view(B, h_kv, h // h_kv, S, d).sum(2)


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Bool [Sq, Sk]: True where key position <= query position."""
    return k_pos[None, :] <= q_pos[:, None]


def _safe(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)


def block_scores(q, k, q_pos, k_pos, causal: bool):
    """Scaled scores [B, h, Sq, Sk] with masked entries -inf (k expanded to h heads)."""
    s = (q @ expand_kv(k, q.shape[1]).transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(~causal_mask(q_pos, k_pos).to(s.device), float("-inf"))
    return s


def block_attention(q, k, v, q_pos=None, k_pos=None, causal: bool = True):
    """Attention of ``q`` on one block of keys: returns ``(out, lse)`` (shapes above).
    Differentiable by autograd (plain tensor operations)."""
    s = block_scores(q, k, q_pos, k_pos, causal)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _safe(lse)[..., None])
    return p @ expand_kv(v, q.shape[1]), lse


def merge_partials(out_a, lse_a, out_b, lse_b):
    """The log-sum-exp merge of two partial attention results over disjoint key blocks
    (module docstring): returns ``(out, lse)``. Rows masked in both blocks stay 0 and -inf."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _safe(lse)
    wa = torch.exp(lse_a - safe)[..., None]
    wb = torch.exp(lse_b - safe)[..., None]
    return wa * out_a + wb * out_b, lse


def block_attention_backward(q, k, v, dout, lse, delta, q_pos, k_pos, causal: bool):
    """Gradients of one block's share of full attention, given the FINAL ``lse`` [B, h, Sq]
    and ``delta = (dout * out).sum(-1)`` [B, h, Sq] (FlashAttention-2, Dao 2023, Algorithm 2):

        p = exp(s - lse)    dv = p^T dout    ds = p (dout v^T - delta)
        dq = ds k / sqrt(d)    dk = ds^T q / sqrt(d)

    Returns ``(dq [B, h, Sq, d], dk, dv [B, h_kv, Sk, d])``."""
    h, h_kv, scale = q.shape[1], k.shape[1], 1.0 / math.sqrt(q.shape[-1])
    ke, ve = expand_kv(k, h), expand_kv(v, h)
    s = block_scores(q, k, q_pos, k_pos, causal)
    p = torch.exp(s - _safe(lse)[..., None])
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ ve.transpose(-2, -1) - delta[..., None])
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    return dq, reduce_kv_grad(dk, h_kv), reduce_kv_grad(dv, h_kv)


def block_has_work(q_pos, k_pos, causal: bool) -> bool:
    """False when a causal mask hides every (query, key) pair of the block (it is skipped)."""
    return (not causal) or bool(k_pos.min() <= q_pos.max())


def block_work(q_pos, k_pos, causal: bool) -> int:
    """Unmasked (query, key) pairs of the block: the work units per batch row and head."""
    if not causal:
        return int(q_pos.numel() * k_pos.numel())
    return int(causal_mask(q_pos, k_pos).sum())
