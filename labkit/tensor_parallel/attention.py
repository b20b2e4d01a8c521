"""Tensor-parallel causal self-attention: heads split across ranks (Megatron-LM sec. 3,
Fig. 3b).

Each attention head is independent of the others until the output projection, so rank r
keeps heads ``[r*h/t, (r+1)*h/t)``: the query, key and value projections are
column-parallel (each rank computes only its heads' q, k, v, no communication), the
attention itself runs locally, and the output projection is row-parallel (its input is
exactly this rank's heads), ending with one all-reduce (g). Backward: one all-reduce of
dL/dX in ``f``, shared by q, k and v (Megatron fuses them into one ``linear_qkv``).

Grouped-query attention (n_kv_head < n_head): query head j reads key/value head
``j // (h / h_kv)``. Splitting both the h query heads and the h_kv key/value heads into t
contiguous blocks keeps every query head on the same rank as its key/value head, so
t must divide both h and h_kv.

Sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2): the input is this rank's block of
tokens ``[B, S/t, H]``, all-gathered once for q, k and v, and the output projection
reduce-scatters back to ``[B, S/t, H]``. Selective recomputation (sec. 5): the attention core
``softmax(QK^T/sqrt(d)) V`` with its dropout holds ``5 a s^2 b`` bytes (16-bit) but costs few
FLOPs; ``recompute_core=True`` checkpoints only it and keeps q, k and v.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..checkpoint import checkpoint
from ..model import causal_attention
from .layers import ColumnParallelLinear, RowParallelLinear, column_parallel_linears, divide
from .mappings import tp_size

__all__ = ["ParallelAttention"]


class ParallelAttention(nn.Module):
    """Causal self-attention with ``n_head / t`` query heads and ``n_kv_head / t`` key/value
    heads on this rank.

    Args: ``hidden`` H, ``n_head`` h, ``n_kv_head`` h_kv (None: = h), ``bias``,
    ``dropout`` (attention-probability and residual dropout; 0 for equality tests), ``group``,
    ``sequence_parallel`` and ``regather_in_backward`` (see :mod:`.layers`), ``recompute_core``
    (selective recomputation of the attention core).
    Input/output ``[B, S, H]`` replicated (SP: ``[B, S/t, H]``). Communication: forward 1
    all-reduce of ``B*S*H`` elements (g after ``out_proj``), backward 1 all-reduce (f before
    q/k/v); SP: an all-gather entering and a reduce-scatter leaving, each way.
    Raises ValueError at construction (no communication) when t does not divide the
    number of attention heads or of key/value heads.

    Dropout: the attention-probability dropout acts on this rank's heads with this rank's
    RNG, so with dropout > 0 the masks differ from a single-device run's (Megatron keeps a
    separate per-rank RNG stream for this region); equality tests use dropout 0.
    """

    def __init__(self, hidden: int, n_head: int, n_kv_head: int | None = None, bias: bool = True,
                 dropout: float = 0.0, group=None, sequence_parallel: bool = False, regather_in_backward: bool = True,
                 recompute_core: bool = False):
        super().__init__()
        self.sequence_parallel, self.regather_in_backward = bool(sequence_parallel), regather_in_backward
        self.recompute_core = bool(recompute_core)
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if hidden % n_head:
            raise ValueError(f"hidden={hidden} must be divisible by n_head={n_head}")
        self.group, t = group, tp_size(group)
        self.head_dim = hidden // n_head
        self.n_head_local = divide(n_head, t, "the number of attention heads n_head")
        self.n_kv_head_local = divide(n_kv_head, t, "the number of key/value heads n_kv_head")
        self.n_head, self.n_kv_head = n_head, n_kv_head
        d = self.head_dim
        # copy_input=False: one f for all three projections (see module docstring)
        self.q_proj = ColumnParallelLinear(hidden, n_head * d, bias, gather_output=False, group=group, copy_input=False)
        kv = dict(gather_output=False, group=group, copy_input=False)
        self.k_proj = ColumnParallelLinear(hidden, n_kv_head * d, bias, **kv)
        self.v_proj = ColumnParallelLinear(hidden, n_kv_head * d, bias, **kv)
        self.out_proj = RowParallelLinear(n_head * d, hidden, bias, input_is_parallel=True, group=group,
                                          sequence_parallel=sequence_parallel)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.core = None   # None: causal_attention; context parallelism (labkit.parallel) sets its (q, k, v) -> y

    @classmethod
    def from_reference(cls, attn: nn.Module, group, **kwargs) -> "ParallelAttention":
        """Shard a :class:`labkit.model.CausalSelfAttention` (q/k/v/out projections) onto this rank
        (``kwargs``: ``sequence_parallel``, ``regather_in_backward``, ``recompute_core``)."""
        hidden = attn.q_proj.in_features
        m = cls(hidden, attn.n_head, attn.n_kv_head, bias=attn.q_proj.bias is not None,
                dropout=attn.attn_drop.p, group=group, **kwargs)
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            ref = getattr(attn, name)
            getattr(m, name).load_full_weight(ref.weight, ref.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = column_parallel_linears(x, (self.q_proj, self.k_proj, self.v_proj), self.group,   # one f (or g)
                                          self.sequence_parallel, self.regather_in_backward)
        B, S, _ = q.shape                                                 # the whole sequence, under SP too
        d = self.head_dim
        q = q.view(B, S, self.n_head_local, d).transpose(1, 2)
        k = k.view(B, S, self.n_kv_head_local, d).transpose(1, 2)
        v = v.view(B, S, self.n_kv_head_local, d).transpose(1, 2)
        if self.core is not None:   # context parallelism's (q, k, v) -> y; selective: its inputs kept only
            y = checkpoint(self.core, q, k, v) if self.recompute_core else self.core(q, k, v)
        elif self.recompute_core:   # keep q, k, v; recompute the s^2 part (scores, softmax, dropout, sum)
            y = checkpoint(causal_attention, q, k, v, self.attn_drop)
        else:
            y = causal_attention(q, k, v, self.attn_drop)                 # local heads only
        y = y.transpose(1, 2).reshape(B, S, self.n_head_local * d)
        return self.resid_drop(self.out_proj(y))                          # g inside out_proj
