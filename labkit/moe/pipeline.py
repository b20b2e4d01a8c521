"""Balance losses and the aux-loss-free bias when the MoE GPT is cut into pipeline stages.

The stages themselves (a composition of MoE and the pipeline axis) are in
:mod:`labkit.parallel.moe_pipeline`; this module holds the two MoE pieces they use.

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
over the DP group (and the TP group under sequence parallelism, where each TP rank routes its
S/t tokens), updates the bias and clears the sums. Reported failure modes in production
trainers, prevented here: the aux loss scaled by 1 instead of 1/M, counted twice under
recomputation, lost on middle stages, or the bias updated once per microbatch.
"""
from __future__ import annotations

import torch

from .expert_parallel import all_reduce_loads

__all__ = ["attach_aux_loss", "finish_step"]


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


@torch.no_grad()
def finish_step(stages, dp_group=None, tp_group=None, clear_aux_values: bool = True) -> dict:
    """After a schedule's step: sum each MoE layer's loads over the DP group (all-reduce; None:
    no DP) and, with sequence parallelism, over the TP group too (``tp_group``; each TP rank routed
    only its S/t tokens; None: the TP ranks routed the same tokens), update its aux-loss-free bias
    once, clear the sums, and the stages' ``aux_values`` unless ``clear_aux_values`` is False (a
    caller that reports them later clears them itself). Returns {block index: loads [E]}. Every
    rank of those groups must call it (the all-reduces are collective)."""
    done = {}
    for st in stages:
        for lid, layer in st.moe_layers().items():
            load = st.loads.pop(lid, None)
            if load is None:
                load = torch.zeros(layer.cfg.n_routed_experts, dtype=torch.long, device=layer.router.weight.device)
            if dp_group is not None:
                load = all_reduce_loads(load, dp_group)
            if tp_group is not None:
                load = all_reduce_loads(load, tp_group)
            layer.update_bias(load)
            done[lid] = load
        if clear_aux_values:
            st.aux_values.clear()
    return done
