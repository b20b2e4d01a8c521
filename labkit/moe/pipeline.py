"""The MoE GPT under pipeline parallelism: balance losses and the aux-loss-free bias per stage.

A pipeline stage returns ONE tensor (its activations) and the runtime differentiates only the
last stage's loss (:mod:`labkit.pipeline.runtime`). An MoE layer on a middle stage also makes a
balance loss, which must reach the gradient exactly once per microbatch, scaled like the LM
loss (1/M: the runtime divides each microbatch's loss by M). Returning it through the pipeline
does not work with one-tensor stages, and adding it to the last stage's loss would need it to
travel there. Megatron-Core's answer (``MoEAuxLossAutoScaler``) is used here:

    x = attach_aux_loss(x, aux, scale)        # forward: x unchanged
                                              # backward: dL/dx passes through, and d(aux) = scale

so when the schedule runs the backward of that microbatch on that stage, the aux loss's
gradient ``scale * d aux / d theta`` joins in; no schedule needs to know. Only a forward whose
graph is backpropagated contributes: the forward without grad of activation recomputation
(``recompute=True``) and the runtime's shape probe (run with autograd on, its graph dropped)
add nothing, and the recomputed forward in the backward contributes once.

The aux-loss-free bias (DeepSeek-V3 sec. 2.1.2) must move once per GLOBAL batch from the loads
summed over all microbatches and all data-parallel ranks: each stage adds up the loads of the
forwards whose backward ran (the attached function's backward counts them: exactly one per
microbatch and step, with or without recomputation), and :func:`finish_step` all-reduces them
over the DP group, updates the bias and clears the sums. Reported failure modes in production
trainers, prevented here: the aux loss scaled by 1 instead of 1/M, counted twice under
recomputation, lost on middle stages, or the bias updated once per microbatch.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..pipeline.schedules import stage_rank
from ..pipeline.stages import stage_layers
from .expert_parallel import all_reduce_loads
from .model import MoEBlock, MoEGPT

__all__ = ["attach_aux_loss", "MoEGPTStage", "split_moe_gpt", "moe_stages_for_rank", "finish_step",
           "moe_param_name"]


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on x whose backward also starts the backward of ``aux`` with gradient ``scale``
    and calls ``on_backward()`` (once: a graph is backpropagated once)."""

    @staticmethod
    def forward(ctx, x, aux, scale, on_backward):
        ctx.save_for_backward(aux)
        ctx.scale, ctx.on_backward = scale, on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        if ctx.on_backward is not None:
            ctx.on_backward()
        aux_grad = torch.full_like(aux, ctx.scale) if ctx.needs_input_grad[1] else None
        return grad, aux_grad, None, None


def attach_aux_loss(x: torch.Tensor, aux: torch.Tensor, scale: float, on_backward=None) -> torch.Tensor:
    """Return x (same values) so that backpropagating through it also adds ``scale * d aux``
    (aux a 0-d tensor) and calls ``on_backward()``. Unchanged x when nothing needs a gradient."""
    if not (x.requires_grad or aux.requires_grad):
        return x
    return _AttachAuxLoss.apply(x, aux, float(scale), on_backward)


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
            if isinstance(block, MoEBlock):
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
        return {lid: b.moe for lid, b in zip(self.layer_ids, self.blocks) if isinstance(b, MoEBlock)}


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


@torch.no_grad()
def finish_step(stages, dp_group=None) -> dict:
    """After a schedule's step: sum each MoE layer's loads over the DP group (all-reduce; None:
    no DP), update its aux-loss-free bias once, clear the sums. Returns {block index: loads [E]}.
    Every DP rank must call it (the all-reduces are collective)."""
    done = {}
    for st in stages:
        for lid, layer in st.moe_layers().items():
            load = st.loads.pop(lid, None)
            if load is None:
                load = torch.zeros(layer.cfg.n_routed_experts, dtype=torch.long, device=layer.router.weight.device)
            if dp_group is not None:
                load = all_reduce_loads(load, dp_group)
            layer.update_bias(load)
            done[lid] = load
        st.aux_values.clear()
    return done


def moe_param_name(stage: MoEGPTStage, name: str) -> str:
    """Name in the single-device MoEGPT of a stage parameter or buffer (``blocks.0.x`` ->
    ``blocks.<global>.x``)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"blocks.{stage.layer_ids[int(i)]}.{rest}"
    return name
