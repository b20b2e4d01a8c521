"""Kernel side of notebook 10_balance_losses's exercises: the code that runs next to the learner's
code (``answer.run(fn, ...)`` in the cases of :mod:`labkit.grading.exercises.nb10_balance_losses`).

It lives outside ``labkit.grading.exercises`` because the graded kernel cannot read that
package (:mod:`labkit.grading.session`); nothing here computes an expected value.
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
