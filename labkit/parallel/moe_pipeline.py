"""The MoE GPT cut into pipeline stages (MoE x PP): each stage attaches its MoE layers' balance
losses to its activations (:func:`labkit.moe.pipeline.attach_aux_loss`) and counts the loads of
the forwards whose backward ran, for the aux-loss-free bias (:func:`labkit.moe.pipeline.finish_step`).
Why and how: :mod:`labkit.moe.pipeline`.
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.nn as nn

from ..checkpoint import checkpoint
from ..moe.expert_parallel import ExpertParallelMoE
from ..moe.experts import MoEStats
from ..moe.model import MoEBlock, MoEGPT
from ..moe.pipeline import attach_aux_loss
from ..pipeline.schedules import stage_rank
from ..pipeline.stages import stage_layers
from ..tensor_parallel import ParallelAttention
from ..tensor_parallel.layers import mark_sequence_parallel
from ..tensor_parallel.mappings import all_gather_along_dim, gather_from_sequence_parallel_region, tp_size
from ..tensor_parallel.model import RECOMPUTE

__all__ = ["MoEGPTStage", "split_moe_gpt", "moe_stages_for_rank", "moe_param_name", "ParallelMoEBlock",
           "moe_block_rule"]


class ParallelMoEBlock(nn.Module):
    """x + Attn_TP(LN1 x), then x + MoE_EP(LN2 x): Megatron's TP attention over ``tp_group`` (None:
    a copy of the reference's) and the experts spread over ``ep_group``
    (:class:`labkit.moe.expert_parallel.ExpertParallelMoE`; rank ``ep_rank`` holds experts
    ``ep_rank*E/ep_size ..``). Each TP rank holds whole experts (expert TP 1, Megatron-Core's
    ``expert_tensor_parallel_size=1``).

    ``sequence_parallel=False``: the MoE input is replicated over TP, so the t ranks of a TP group
    route the same tokens and compute the same thing (as for a LayerNorm). ``True`` (Korthikanti
    et al. 2022 sec. 4.2.2, t > 1): input and output are this rank's ``[b, S/t, H]``; the attention
    all-gathers and reduce-scatters as in :class:`labkit.tensor_parallel.ParallelBlock`, and the
    MoE layer routes only this rank's S/t tokens and dispatches them over ``ep_group`` (the EP
    ranks with this TP rank; Megatron-Core's token dispatcher works on the SP-local tokens the
    same way, no all-gather of hidden states). The LayerNorms, the router, the experts and the
    shared experts then saw S/t tokens: they are marked ``sequence_parallel`` and their gradients
    are summed over TP after backward (:func:`labkit.tensor_parallel.allreduce_layernorm_grads`,
    or ZeRO-2/3's partial-gradient hooks). The balance losses need the whole group of b*S tokens
    (f and P are means over it; the sequence-wise loss per sequence): they are computed on the
    router logits all-gathered over TP along the sequence (backward: reduce-scatter,
    :func:`labkit.tensor_parallel.mappings.gather_from_sequence_parallel_region`) and the indices
    all-gathered, the same value on every TP rank; each rank attaches ``aux_loss_share`` = 1/t of
    it (:class:`MoEGPTStage`), so the gradients summed over TP are the reference's. The loads
    ``tokens_per_expert`` are this rank's tokens' (summed over TP and DP for the aux-loss-free
    bias, :func:`labkit.moe.pipeline.finish_step`). Not with capacity dropping (whose choices need
    the whole group): :class:`labkit.parallel.ParallelGPT` refuses it, with SP and with CP.

    ``cp_group`` (context parallelism, cp > 1; None: no CP): the block's input holds this CP rank's
    share of every sequence (``[b, S/cp, H]``, with SP ``[b, S/(cp t), H]``), and the MoE layer
    routes and dispatches those tokens over ``ep_group`` (the EP ranks with this CP and TP rank;
    Megatron-Core's MoE under CP routes each CP rank's local tokens). The balance losses are
    computed on the whole group: the logits (and indices) gathered over TP (SP) and then over the
    CP group along the sequence, so each row is one whole sequence (the CP ranks' chunks in rank
    order: every loss is a mean over tokens, the sequence-wise one per sequence, so the order of
    the tokens inside a sequence does not change it). The gradients of a CP rank then average over
    the d cp ranks of a stage (the LM loss of a rank is the mean over its tokens), so every rank
    attaches the whole loss (1/t with SP): the backward reduce-scatter over CP sums the cp ranks'
    shares into each rank's dlogits, and the average over CP gives the reference's. The router
    and shared experts are replicated over the d cp ranks (averaged with the dense parameters);
    the local experts' gradients are summed over CP by :class:`labkit.parallel.ParallelGPT`.

    ``recompute``: "selective" checkpoints the attention core (Korthikanti et al. 2022 sec. 5), as
    in the dense blocks; "full" checkpoints the whole block (:func:`labkit.checkpoint.checkpoint`
    of a function returning ``(x, aux_loss, tokens_per_expert)``: only the input is kept, and the
    forward, its all-to-alls and gathers included, runs again in backward). ``[b, S, H] (SP: [b,
    S/t, H]) -> (same shape, MoEStats)``; with "full" the stats hold only ``aux_loss`` and
    ``tokens_per_expert``."""

    def __init__(self, ref: MoEBlock, tp_group, ep_group, ep_rank: int, ep_size: int, recompute_core: bool = False,
                 sequence_parallel: bool = False, recompute: str = "none", cp_group=None):
        super().__init__()
        if recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        self.tp_group, self.recompute = tp_group, recompute
        self.sequence_parallel = bool(sequence_parallel) and tp_group is not None and tp_size(tp_group) > 1
        recompute_core = recompute_core or recompute == "selective"
        self.ln1, self.ln2 = copy.deepcopy(ref.ln1), copy.deepcopy(ref.ln2)
        self.attn = (ParallelAttention.from_reference(ref.attn, tp_group, recompute_core=recompute_core,
                                                      sequence_parallel=self.sequence_parallel)
                     if tp_group is not None or recompute_core else copy.deepcopy(ref.attn))
        self.moe = ExpertParallelMoE.from_dense(ref.moe, ep_group, ep_rank, ep_size)
        self.aux_loss_share = 1.0
        self.cp_group = cp_group if cp_group is not None and tp_size(cp_group) > 1 else None
        if self.sequence_parallel or self.cp_group is not None:
            self.moe.compute_balance_losses = False          # computed on the whole group in _group_losses
        if self.sequence_parallel:
            self.aux_loss_share = 1.0 / tp_size(tp_group)    # summed over TP (CP: averaged, a share of 1)
            mark_sequence_parallel(*self.ln1.parameters(), *self.ln2.parameters(), *self.moe.parameters())

    def _block(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        y, stats = self.moe(h)
        if self.sequence_parallel or self.cp_group is not None:
            stats.losses = self._group_losses(stats.router, h.shape[0], h.shape[1])
            stats.aux_loss = sum(stats.losses.values()) if stats.losses else h.new_zeros(())
        return x + y, stats

    def _group_losses(self, r, b: int, s: int) -> dict:
        """The balance losses of the whole group from this rank's routing ``r`` of its ``[b, s]``
        tokens (s = S/t with SP, S/cp with CP, S/(cp t) with both): logits all-gathered along the
        sequence (differentiable, backward reduce-scatter) and indices all-gathered, over TP (SP;
        the reference's token order) and then over CP (each row one whole sequence), [b, S]."""
        if not any(getattr(self.moe.cfg, c) for c in ("aux_loss_coeff", "z_loss_coeff", "seq_aux_loss_coeff",
                                                         "device_loss_coeff", "comm_loss_coeff")):
            return {}
        logits, indices = r.logits.view(b, s, -1), r.indices.reshape(b, s, -1)
        for group in (self.tp_group if self.sequence_parallel else None, self.cp_group):
            if group is not None:
                logits = gather_from_sequence_parallel_region(logits, group)
                indices = all_gather_along_dim(indices, 1, group)
        S = logits.shape[1]
        whole = SimpleNamespace(logits=logits.reshape(b * S, -1), indices=indices.reshape(b * S, -1))
        return self.moe.balance_losses([whole], [None], S)

    def _block_tensors(self, x):
        y, stats = self._block(x)
        return y, stats.aux_loss, stats.tokens_per_expert

    def forward(self, x):
        if self.recompute == "full":
            y, aux, load = checkpoint(self._block_tensors, x)
            return y, MoEStats(aux, {}, load)
        return self._block(x)


def moe_block_rule(ep_group, ep_rank: int, ep_size: int, dense_rule=None, recompute_core: bool = False,
                   sequence_parallel: bool = False, recompute: str = "none", cp_group=None):
    """A plan rule for ``"blocks.*"`` of the MoE GPT (:func:`labkit.tensor_parallel.parallelize`): an
    MoE block becomes a :class:`ParallelMoEBlock` (``sequence_parallel``, ``recompute``, ``cp_group``
    as there), a dense block goes to ``dense_rule`` (None: kept)."""
    def rule(block, group):
        if isinstance(block, MoEBlock):
            return ParallelMoEBlock(block, group, ep_group, ep_rank, ep_size, recompute_core, sequence_parallel,
                                    recompute, cp_group)
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
                    # SP: every TP rank holds the whole group's loss and attaches its 1/t share
                    share = getattr(block, "aux_loss_share", 1.0)
                    x = attach_aux_loss(x, stats.aux_loss, self.aux_loss_scale * share, count)
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
