"""Dispatch: getting each token to its k experts and the results back.

Two ways that give the same result:

* **Sort-based** (what Megatron-Core's "alltoall" token dispatcher and DeepSeek's code do):
  flatten the T*k slots, drop the ones over capacity, sort the kept slots by expert id
  (``permute``), run expert e on its contiguous block of ``tokens_per_expert[e]`` rows, and
  ``unpermute``: scatter-add each row, times its gating weight, back to its token.
  Memory O(T*k*H); no padding.
* **Dense one-hot** (GShard, Lepikhin et al. 2020, sec. 2.2 / Algorithm 1): a ``dispatch``
  tensor [T, E, C] with a 1 where token t fills slot c of expert e, and ``combine`` [T, E, C]
  holding the gating weight there. ``expert_in = einsum("tec,th->ech")``, experts run on
  [E, C, H], ``y = einsum("tec,ech->th", combine, expert_out)``. Readable, but the tensors
  are T*E*C = k*T^2*capacity_factor entries: kept here as the reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = ["Permutation", "permute", "unpermute", "sorted_moe", "dense_dispatch_tensors", "dense_moe",
           "run_experts"]


@dataclass
class Permutation:
    """Bookkeeping of :func:`permute`: ``token_index`` [N] the source token of each permuted
    row, ``slot`` [N] its flat slot index t*k+j, ``tokens_per_expert`` [E] long (rows per expert,
    kept slots only), ``num_tokens`` T."""

    token_index: torch.Tensor
    slot: torch.Tensor
    tokens_per_expert: torch.Tensor
    num_tokens: int


def permute(x: torch.Tensor, indices: torch.Tensor, keep: torch.Tensor, num_experts: int):
    """Group the kept slots by expert. x [T, H], indices/keep [T, k] -> (rows [N, H], Permutation)
    with N = number of kept slots; rows of expert 0 first, then expert 1, ... (token order
    within an expert: the sort is stable)."""
    T, k = indices.shape
    slot = torch.nonzero(keep.reshape(-1), as_tuple=False).squeeze(1)            # kept flat slots
    expert = indices.reshape(-1)[slot]
    order = torch.argsort(expert, stable=True)
    slot = slot[order]
    token_index = slot // k
    counts = torch.bincount(expert, minlength=num_experts)
    return x[token_index], Permutation(token_index, slot, counts, T)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute` with the weighting: ``y[t] = sum_j w[t, j] * rows[(t, j)]``
    over kept slots. rows [N, H], weights [T, k] -> y [T, H]."""
    w = weights.reshape(-1)[perm.slot].unsqueeze(1).to(rows.dtype)
    y = rows.new_zeros(perm.num_tokens, rows.shape[1])
    return y.index_add(0, perm.token_index, rows * w)


def run_experts(rows: torch.Tensor, tokens_per_expert: Sequence[int], experts: Sequence[Callable]) -> torch.Tensor:
    """Apply ``experts[e]`` to its contiguous block of rows ([N, H] -> [N, H]). An expert with
    zero rows is still called on an empty [0, H] block, so every expert's parameters take part
    in autograd (zero gradient) on every rank."""
    chunks = torch.split(rows, [int(c) for c in tokens_per_expert], dim=0)
    return torch.cat([expert(c) for expert, c in zip(experts, chunks)], dim=0) if chunks else rows


def sorted_moe(x, weights, indices, keep, experts) -> torch.Tensor:
    """Sort-based MoE on one device: permute, run experts, unpermute and weight. x [T, H] -> [T, H]."""
    rows, perm = permute(x, indices, keep, len(experts))
    out = run_experts(rows, perm.tokens_per_expert.tolist(), experts)
    return unpermute(out, perm, weights)


def dense_dispatch_tensors(weights: torch.Tensor, indices: torch.Tensor, keep: torch.Tensor, num_experts: int,
                           capacity: int | None = None):
    """GShard's one-hot tensors: (dispatch [T, E, C] float 0/1, combine [T, E, C] float weights, C).

    A kept slot (t, j) goes to position c = (number of earlier kept slots of the same expert,
    token-major order). ``capacity=None``: C = the largest number of kept slots of any expert.
    Raises ValueError when the kept slots do not fit in C.
    """
    T, k = indices.shape
    flat_e, flat_keep = indices.reshape(-1), keep.reshape(-1)
    onehot = F.one_hot(flat_e, num_experts) * flat_keep[:, None]                 # [T*k, E]
    position = ((onehot.cumsum(0) - 1) * onehot).sum(1)                          # slot within its expert
    needed = int(onehot.sum(0).max()) if onehot.numel() else 0
    C = needed if capacity is None else int(capacity)
    if needed > C:
        raise ValueError(f"an expert has {needed} kept slots but capacity C={C}")
    C = max(C, 1)
    kept = flat_keep.nonzero().squeeze(1)
    where = (kept // k, flat_e[kept], position[kept])                             # (t, e, c) of each kept slot
    dispatch = weights.new_zeros(T, num_experts, C).index_put(where, weights.new_ones(kept.numel()))
    combine = weights.new_zeros(T, num_experts, C).index_put(where, weights.reshape(-1)[kept])
    return dispatch, combine, C


def dense_moe(x, weights, indices, keep, experts, capacity: int | None = None) -> torch.Tensor:
    """Dense one-hot (GShard) MoE on one device. x [T, H] -> [T, H]; same result as :func:`sorted_moe`."""
    dispatch, combine, C = dense_dispatch_tensors(weights, indices, keep, len(experts), capacity)
    expert_in = torch.einsum("tec,th->ech", dispatch, x)                          # [E, C, H]
    expert_out = torch.stack([expert(expert_in[e]) for e, expert in enumerate(experts)])
    return torch.einsum("tec,ech->th", combine, expert_out)
