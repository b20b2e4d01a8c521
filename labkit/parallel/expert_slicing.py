"""Expert slicing with tensor-parallel non-expert layers: a composition of two axes (DeepSpeed-MoE,
Rajbhandari et al. 2022, sec. 5; the slice itself is :class:`labkit.moe.inference.SlicedExpert`).

Parallelism (DeepSpeed-MoE sec. 5.2, "expert-slicing"): with more GPUs than experts, expert
parallelism alone leaves GPUs idle, so each expert's FFN is itself split over an
*expert-slicing group* of s GPUs with Megatron's split (fc1 by columns, fc2 by rows; the GeLU
needs no communication in between). P ranks: rank = ep_rank * s + slice_rank, P/s EP groups,
each holding E / (P/s) experts, every one of them sliced s ways. The non-expert layers
(attention, dense FFN, embedding, head) are tensor-parallel over t consecutive ranks, with
data parallelism over the P/t TP groups.

One MoE layer on one rank (:class:`ExpertSlicedMoE`):

1. the input is replicated over the TP group, so each TP rank keeps 1/t of the tokens
   ("drop tokens" in DeepSpeed: no token is routed twice);
2. route them; every kept slot of expert e goes to the slicing group that holds e, to the
   member with this rank's slice index (all-to-all over all P ranks, uneven);
3. inside the slicing group every member needs every row for its experts: an uneven
   all-gather of the rows (and their expert ids);
4. each member computes its slice's partial output ``GeLU(x A_j) B_j`` (fc2's bias only on
   slice 0), and a reduce-scatter (uneven, written as an all-to-all plus a sum) gives every
   member the full output of the rows it received in step 2;
5. the combine all-to-all returns them to their tokens, which are weighted and summed; an
   all-gather over the TP group restores the replicated activations.

The decode cost of a model (bytes read per token) is a formula: :func:`labkit.plan.params.decode_cost`.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..grid import Mesh, even_part
from ..moe.expert_parallel import all_to_all, exchange_splits
from ..moe.experts import MoELayer
from ..moe.inference import SlicedExpert
from ..moe.model import MoEBlock, MoEGPT
from ..tensor_parallel.attention import ParallelAttention
from ..tensor_parallel.layers import ColumnParallelLinear, ParallelMLP, VocabParallelEmbedding
from ..tensor_parallel.mappings import all_gather_along_dim

__all__ = ["ExpertSlicedMoE", "ExpertSlicedMoEGPT", "make_slicing_groups", "SlicingGroups"]


@dataclass
class SlicingGroups:
    """This rank's groups: ``world`` (all P ranks), ``slicing`` (its s ranks), ``tp`` (its t
    ranks, non-expert layers); ``ep_rank``, ``slice_rank``, ``tp_rank``, sizes ``P``, ``s``, ``t``."""

    world: object
    slicing: object
    tp: object
    rank: int
    P: int
    s: int
    t: int

    @property
    def ep_rank(self) -> int:
        return _slicing_mesh(self.P, self.s).coords(self.rank)["ep"]

    @property
    def slice_rank(self) -> int:
        return _slicing_mesh(self.P, self.s).coords(self.rank)["slice"]

    @property
    def tp_rank(self) -> int:
        return _tp_mesh(self.P, self.t).coords(self.rank)["tp"]


def _slicing_mesh(P: int, s: int) -> Mesh:
    """P ranks as P/s expert-parallel groups of s consecutive ranks, each slicing the same experts."""
    return Mesh(ep=P // s, slice=s)


def _tp_mesh(P: int, t: int) -> Mesh:
    """P ranks as P/t TP groups of t consecutive ranks (the non-expert layers)."""
    return Mesh(dp=P // t, tp=t)


def make_slicing_groups(ctx, s: int, t: int) -> SlicingGroups:
    """Slicing groups of s consecutive ranks and TP groups of t consecutive ranks on ``ctx``
    (collective: every rank calls it). Raises ValueError when s or t does not divide P."""
    P = ctx.world_size
    for name, v in (("expert-slicing degree s", s), ("tensor-parallel degree t", t)):
        if v < 1 or P % v:
            raise ValueError(f"{name}={v} must divide the {P} ranks")

    slicing = _slicing_mesh(P, s).new_groups(ctx, "slice")   # every rank creates every group, same order
    tp = _tp_mesh(P, t).new_groups(ctx, "tp")
    return SlicingGroups(ctx.group, slicing, tp, ctx.rank, P, s, t)


def _uneven_all_gather(x: torch.Tensor, group) -> tuple[torch.Tensor, list[int]]:
    """Every member's x [n_i, ...] concatenated in rank order (differentiable: the backward
    returns each member the sum of the gradients of its rows). Returns (rows, [n_i])."""
    s = dist.get_world_size(group)
    counts = exchange_splits([x.shape[0]] * s, group, x.device)
    return all_to_all(torch.cat([x] * s), counts, [x.shape[0]] * s, group), counts


class ExpertSlicedMoE(nn.Module):
    """The MoE layer for inference with expert slicing (module docstring, steps 1-5).

    Built with :meth:`from_dense` from a single-device :class:`~labkit.moe.experts.MoELayer`
    (``capacity_factor=None``: inference drops no token). ``forward(x [..., H])`` with x
    replicated over the TP group -> (y [..., H], replicated, MoEStats of this rank's 1/t of the
    tokens). Raises ValueError when P/s does not divide E, or t does not divide the tokens.
    """

    def __init__(self, layer: MoELayer, groups: SlicingGroups):
        super().__init__()
        cfg = layer.cfg
        E, n_ep = cfg.n_routed_experts, groups.P // groups.s
        if E % n_ep:
            raise ValueError(f"n_routed_experts={E} must be divisible by the P/s={n_ep} expert-parallel groups")
        if cfg.capacity_factor is not None or cfg.token_groups != 1:
            raise ValueError("expert-sliced inference routes every token: use capacity_factor=None, token_groups=1")
        self.cfg, self.g = cfg, groups
        self.n_local = E // n_ep
        self.expert_offset = even_part(E, n_ep, groups.ep_rank).start
        self.router = copy.deepcopy(layer.router)
        self.experts = nn.ModuleList([SlicedExpert(layer.experts[self.expert_offset + i], groups.slice_rank, groups.s)
                                      for i in range(self.n_local)])
        self.shared_experts = copy.deepcopy(layer.shared_experts)

    route_tokens = MoELayer.route_tokens          # the same routing code as the single-device layer
    balance_losses = MoELayer.balance_losses
    compute_balance_losses = True

    @classmethod
    def from_dense(cls, layer: MoELayer, groups: SlicingGroups) -> "ExpertSlicedMoE":
        return cls(layer, groups)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        g, shape = self.g, x.shape
        x_all = x.reshape(-1, shape[-1])
        if x_all.shape[0] % g.t:
            raise ValueError(f"{x_all.shape[0]} tokens cannot be split over the TP degree t={g.t}")
        tp = Mesh(tp=g.t)
        x2 = tp.shard(x_all, "tp", g.tp_rank)                             # 1. my 1/t of the tokens
        if mask is not None:
            mask = tp.shard(mask.reshape(-1), "tp", g.tp_rank)
        r, stats = self.route_tokens(x2, None, mask)
        # 2. dispatch: slot of expert e -> rank (e // n_local) * s + my slice index
        slot = r.keep.reshape(-1).nonzero().squeeze(1)
        expert = r.indices.reshape(-1)[slot]
        dest = (expert // self.n_local) * g.s + g.slice_rank
        order = torch.argsort(dest, stable=True)
        slot, expert, dest = slot[order], expert[order], dest[order]
        splits = torch.bincount(dest, minlength=g.P).tolist()
        incoming = exchange_splits(splits, g.world, x.device)
        recv_e = expert.new_empty(sum(incoming))
        comm.all_to_all_single(recv_e, expert, incoming, splits, g.world)
        rows = all_to_all(x2[slot // r.indices.shape[1]], incoming, splits, g.world)
        # 3. all-gather inside the slicing group
        all_rows, counts = _uneven_all_gather(rows, g.slicing)
        all_e, _ = _uneven_all_gather(recv_e[:, None].float(), g.slicing)
        all_e = all_e.squeeze(1).long() - self.expert_offset
        # 4. partial outputs of this slice, then reduce-scatter back to the member that got each row
        partial = all_rows.new_zeros(all_rows.shape)
        for i, ex in enumerate(self.experts):
            mine = (all_e == i).nonzero().squeeze(1)
            partial = partial.index_add(0, mine, ex(all_rows[mine]))
        parts = all_to_all(partial, [rows.shape[0]] * g.s, counts, g.slicing)
        out = parts.view(g.s, rows.shape[0], -1).sum(0)
        # 5. combine, weight, and gather the TP group's token shares back
        back = all_to_all(out, splits, incoming, g.world)
        w = r.weights.reshape(-1)[slot].unsqueeze(1)
        y = x2.new_zeros(x2.shape).index_add(0, slot // r.indices.shape[1], back * w)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return all_gather_along_dim(y, 0, g.tp).view(shape), stats


class _TPMoEBlock(nn.Module):
    def __init__(self, block, groups: SlicingGroups):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelAttention.from_reference(block.attn, groups.tp)
        self.is_moe = isinstance(block, MoEBlock)
        self.ffn = (ExpertSlicedMoE(block.moe, groups) if self.is_moe
                    else ParallelMLP.from_reference(block.mlp, groups.tp))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y = self.ffn(self.ln2(x))
        return x + (y[0] if self.is_moe else y)


class ExpertSlicedMoEGPT(nn.Module):
    """Inference layout of an :class:`~labkit.moe.model.MoEGPT` (DeepSpeed-MoE sec. 5.2):
    embedding (vocab-parallel), attention and dense FFNs tensor-parallel over the t ranks of
    ``groups.tp``; MoE layers :class:`ExpertSlicedMoE`. ``forward(idx [B, S]) -> logits
    [B, S, V]`` (full vocabulary, replicated over the TP group), equal to the reference's
    logits for the same batch. Every rank of a TP group passes the same batch."""

    def __init__(self, reference: MoEGPT, groups: SlicingGroups):
        super().__init__()
        self.groups = groups
        self.wte = VocabParallelEmbedding.from_full(reference.embedding.wte, groups.tp)
        self.wpe = copy.deepcopy(reference.embedding.wpe)
        self.blocks = nn.ModuleList([_TPMoEBlock(b, groups) for b in reference.blocks])
        self.ln_f = copy.deepcopy(reference.head.ln_f)
        self.lm_head = ColumnParallelLinear.from_full(reference.head.lm_head, groups.tp, gather_output=True)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
