"""The MoE GPT cut into pipeline stages (MoE x PP): each stage attaches its MoE layers' balance
losses to its activations (:func:`labkit.moe.pipeline.attach_aux_loss`) and counts the loads of
the forwards whose backward ran, for the aux-loss-free bias (:func:`labkit.moe.pipeline.finish_step`).
Why and how: :mod:`labkit.moe.pipeline`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..moe.expert_parallel import ExpertParallelMoE
from ..moe.model import MoEBlock, MoEGPT
from ..moe.pipeline import attach_aux_loss
from ..pipeline.schedules import stage_rank
from ..pipeline.stages import stage_layers
from ..tensor_parallel import ParallelAttention

__all__ = ["MoEGPTStage", "split_moe_gpt", "moe_stages_for_rank", "moe_param_name", "ParallelMoEBlock",
           "moe_block_rule"]


class ParallelMoEBlock(nn.Module):
    """x + Attn_TP(LN1 x), then x + MoE_EP(LN2 x): Megatron's TP attention over ``tp_group`` (None:
    a copy of the reference's) and the experts spread over ``ep_group``
    (:class:`labkit.moe.expert_parallel.ExpertParallelMoE`; rank ``ep_rank`` holds experts
    ``ep_rank*E/ep_size ..``). The MoE input is replicated over TP, so the t ranks of a TP group
    hold the same experts and compute the same thing (as for a LayerNorm). ``recompute_core``:
    selective recompute of the attention core (Korthikanti et al. 2022 sec. 5), as in the dense
    blocks. ``[B, S, H] -> ([B, S, H], MoEStats)``."""

    def __init__(self, ref: MoEBlock, tp_group, ep_group, ep_rank: int, ep_size: int, recompute_core: bool = False):
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(ref.ln1), copy.deepcopy(ref.ln2)
        self.attn = (ParallelAttention.from_reference(ref.attn, tp_group, recompute_core=recompute_core)
                     if tp_group is not None or recompute_core else copy.deepcopy(ref.attn))
        self.moe = ExpertParallelMoE.from_dense(ref.moe, ep_group, ep_rank, ep_size)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        y, stats = self.moe(self.ln2(x))
        return x + y, stats


def moe_block_rule(ep_group, ep_rank: int, ep_size: int, dense_rule=None, recompute_core: bool = False):
    """A plan rule for ``"blocks.*"`` of the MoE GPT (:func:`labkit.tensor_parallel.parallelize`): an
    MoE block becomes a :class:`ParallelMoEBlock`, a dense block goes to ``dense_rule`` (None: kept)."""
    def rule(block, group):
        if isinstance(block, MoEBlock):
            return ParallelMoEBlock(block, group, ep_group, ep_rank, ep_size, recompute_core)
        return dense_rule(block, group) if dense_rule is not None else block
    return rule


def _is_moe(block) -> bool:
    return hasattr(block, "moe")       # MoEBlock or ParallelMoEBlock (a dense block has ``mlp``)


class MoEGPTStage(nn.Module):
    """One pipeline stage of the :class:`~labkit.moe.model.MoEGPT`: optional ``embedding``,
    some ``blocks`` (Block or MoEBlock), optional ``head``; ``forward(ids [b, S] or x [b, S, H])
    -> x [b, S, H] or logits [b, S, V]``, with the balance loss of every MoE block attached to
    its output (scale ``aux_loss_scale``, set to 1/M by :func:`split_moe_gpt`).

    ``loads`` {global block index: [E] long}: loads summed over the forwards whose backward ran
    since the last :func:`finish_step`; ``aux_values`` the (unscaled) aux losses of those forwards."""

    def __init__(self, embedding, blocks, head, layer_ids, aux_loss_scale: float):
        super().__init__()
        self.embedding, self.head = embedding, head
        self.blocks = nn.ModuleList(blocks)
        self.layer_ids = list(layer_ids)
        self.aux_loss_scale = aux_loss_scale
        self.loads: dict[int, torch.Tensor] = {}
        self.aux_values: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for lid, block in zip(self.layer_ids, self.blocks):
            if _is_moe(block):
                x, stats = block(x)
                if torch.is_grad_enabled():
                    # counted when this forward's backward runs: exactly once per microbatch and step
                    # (not for the runtime's shape probe, nor for the no-grad forward of recomputation)
                    count = self._counter(lid, stats.tokens_per_expert.clone(), stats.aux_loss.item())
                    x = attach_aux_loss(x, stats.aux_loss, self.aux_loss_scale, count)
            else:
                x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x

    def _counter(self, lid: int, load: torch.Tensor, aux: float):
        def count():
            self.loads[lid] = self.loads[lid] + load if lid in self.loads else load
            self.aux_values.append(aux)
        return count

    def moe_layers(self) -> dict:
        """{global block index: MoE layer} of this stage."""
        return {lid: b.moe for lid, b in zip(self.layer_ids, self.blocks) if _is_moe(b)}

    def reference_name(self, name: str) -> str:
        """The single-device MoEGPT's name of this stage's parameter or buffer ``name``."""
        return moe_param_name(self, name)


def split_moe_gpt(model: MoEGPT, n_stages: int, n_microbatches: int, stages=None) -> list[MoEGPTStage]:
    """Deep copies of ``model``'s parts as ``n_stages`` stages (only the indices in ``stages``
    when given), by layers as :func:`labkit.pipeline.stages.split_gpt`; each stage's
    ``aux_loss_scale`` is 1/M. Raises ScheduleError when the layers do not divide evenly."""
    L = model.cfg.n_layer
    stage_layers(L, n_stages, 0)
    if n_microbatches < 1:
        raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
    out = []
    for i in (range(n_stages) if stages is None else stages):
        ids = stage_layers(L, n_stages, i)
        out.append(MoEGPTStage(copy.deepcopy(model.embedding) if i == 0 else None,
                               [copy.deepcopy(model.blocks[j]) for j in ids],
                               copy.deepcopy(model.head) if i == n_stages - 1 else None,
                               ids, 1.0 / n_microbatches))
    return out


def moe_stages_for_rank(model: MoEGPT, K: int, v: int, rank: int, n_microbatches: int) -> list[MoEGPTStage]:
    """The v stages of pipeline rank ``rank`` with looped placement (stage i on rank i % K)."""
    n = K * v
    return split_moe_gpt(model, n, n_microbatches, [s for s in range(n) if stage_rank(s, K) == rank])


def moe_param_name(stage: MoEGPTStage, name: str) -> str:
    """Name in the single-device MoEGPT of a stage parameter or buffer (``blocks.0.x`` ->
    ``blocks.<global>.x``)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{stage.layer_ids[int(i)]}.{rest}"
    return name
