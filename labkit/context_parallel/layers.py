"""Context-parallel attention layer and GPT: the reference modules, their sequence split over CP.

Context parallelism splits every activation along the sequence, so nothing but attention needs
communication: LayerNorm, the MLP, the embedding and the loss act token by token. The weights
are replicated over the CP group; each rank's gradient covers its own tokens, and the CP group
all-reduces them like data parallelism does (:func:`finish_grad_sync`; Megatron-Core folds CP
into the DP gradient reduction).

``attention`` picks the algorithm: ``"ring"`` (:mod:`.ring`), ``"allgather"`` (:mod:`.allgather`,
Llama 3) or ``"ulysses"`` (:mod:`.ulysses`, DeepSpeed).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import comm
from ..model import GPT, CausalSelfAttention, lm_loss
from .allgather import allgather_attention
from .ring import ring_attention
from .sharding import check_sequence_split, sequence_positions
from .ulysses import check_ulysses, ulysses_attention

ATTENTIONS = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


def check_cp_config(n_head: int, n_kv_head: int, S: int, cp: int, attention: str, load_balance: bool = True) -> None:
    """Every rule of a CP layout, raised as one ValueError line before any rank starts:
    ``attention`` one of ring | allgather | ulysses, S divisible by cp (2 cp when load-balanced),
    heads divisible by cp for Ulysses."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {' | '.join(ATTENTIONS)}, got {attention!r}")
    check_sequence_split(S, cp, load_balance)
    if attention == "ulysses":
        check_ulysses(n_head, n_kv_head, cp)


class ContextParallelAttention(nn.Module):
    """The reference :class:`labkit.model.CausalSelfAttention` (its weights, shared, not copied)
    on this rank's S/cp tokens. ``forward(x [B, S/cp, H]) -> [B, S/cp, H]`` equals the rows of
    the full-sequence layer for this rank's positions. ``stats``: None, or a list each forward's
    attention appends its work and compute time to (see ``ring_attention`` and the others).
    Dropout is not supported (its masks would differ from the reference's)."""

    def __init__(self, attn: CausalSelfAttention, group, attention: str = "ring",
                 load_balance: bool = True, causal: bool = True):
        super().__init__()
        cp = comm._group_size(group)
        check_cp_config(attn.n_head, attn.n_kv_head, 2 * cp, cp, attention, load_balance)
        if attn.attn_drop.p or attn.resid_drop.p:
            raise ValueError("context-parallel attention needs dropout=0 (masks would differ per rank)")
        self.attn, self.group, self.attention = attn, group, attention
        self.load_balance, self.causal, self.cp = load_balance, causal, cp
        self.stats: list | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn
        B, s, _ = x.shape
        S = s * self.cp
        check_sequence_split(S, self.cp, self.load_balance)
        positions = [sequence_positions(S, r, self.cp, self.load_balance).to(x.device) for r in range(self.cp)]
        q = a.q_proj(x).view(B, s, a.n_head, a.head_dim).transpose(1, 2)
        k = a.k_proj(x).view(B, s, a.n_kv_head, a.head_dim).transpose(1, 2)
        v = a.v_proj(x).view(B, s, a.n_kv_head, a.head_dim).transpose(1, 2)
        fn = ATTENTIONS[self.attention]
        y = fn(q, k, v, self.group, positions, causal=self.causal, stats=self.stats)
        return a.out_proj(y.transpose(1, 2).reshape(B, s, a.n_head * a.head_dim))


class ContextParallelGPT(nn.Module):
    """The reference :class:`labkit.model.GPT` (shared modules) run on this rank's tokens.

    ``forward(idx [B, S/cp], targets=None, positions=None)``: ``idx`` is this rank's share of the
    sequence (:func:`shard_sequence` with the same ``load_balance``); returns logits [B, S/cp, V]
    or the local mean cross-entropy. Since every rank holds the same number of tokens, the full
    sequence's loss is the mean of the local losses, and :func:`finish_grad_sync` averages the
    gradients over the CP group accordingly.
    """

    def __init__(self, gpt: GPT, group, attention: str = "ring", load_balance: bool = True):
        super().__init__()
        if gpt.cfg.dropout:
            raise ValueError("context-parallel GPT needs dropout=0 (masks would differ per rank)")
        self.gpt, self.group, self.load_balance = gpt, group, load_balance
        self.cp = comm._group_size(group)
        self.rank = torch.distributed.get_process_group_ranks(group).index(torch.distributed.get_rank())
        self.attns = nn.ModuleList(ContextParallelAttention(b.attn, group, attention, load_balance)
                                   for b in gpt.blocks)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        g, S = self.gpt, idx.shape[1] * self.cp
        if S > g.cfg.block_size:
            raise ValueError(f"sequence length {S} exceeds block_size={g.cfg.block_size}")
        pos = sequence_positions(S, self.rank, self.cp, self.load_balance).to(idx.device)
        e = g.embedding
        x = e.wte(idx) + e.wpe(pos)
        for block, attn in zip(g.blocks, self.attns):
            x = x + attn(block.ln1(x))
            x = x + block.mlp(block.ln2(x))
        logits = g.head(x)
        return logits if targets is None else lm_loss(logits, targets)


def finish_grad_sync(module: nn.Module, group, average: bool = True) -> int:
    """All-reduce every parameter's ``.grad`` over the CP group (one all-reduce per tensor) and,
    with ``average``, divide by cp; returns the number of tensors reduced.

    ``average=True`` after backward of the local mean loss (:class:`ContextParallelGPT`: the full
    loss is the mean of the cp local means); ``average=False`` when the upstream gradient is the
    full gradient's own rows (a layer driven by dL/dy): the full gradient is then the sum."""
    cp = comm._group_size(group)
    n = 0
    for p in module.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group)
            if average:
                p.grad /= cp
            n += 1
    return n
