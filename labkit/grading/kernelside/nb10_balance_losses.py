"""Kernel side of notebook 10_balance_losses's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb10_balance_losses` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations

import torch


def _loss_with_grad(answer, logits, indices, extra: tuple):
    """Kernel side: the learner's loss on logits that require grad, and d loss / d logits
    (None when the loss cannot be backpropagated)."""
    x = logits.clone().requires_grad_(True)
    got = answer(x, indices.clone(), *extra)
    grad = None
    try:
        if isinstance(got, torch.Tensor) and got.numel() == 1 and got.requires_grad:
            got.reshape(()).backward()
            grad = x.grad
    except Exception:  # noqa: BLE001 - the case reports the missing gradient
        pass
    return got, grad


def _bias_update(update_bias, bias, loads, gamma):
    """Kernel side: the learner's update; its result, or the bias it updated in place."""
    b = bias.clone()
    got = update_bias(b, loads.clone(), gamma)
    return b if got is None else got
