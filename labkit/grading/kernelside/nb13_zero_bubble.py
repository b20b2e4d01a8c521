"""Kernel side of notebook 13_zero_bubble's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb13_zero_bubble` (what runs here and why: :mod:`labkit.grading.kernelside`).

What it reports is data the grader judges: the learner's returned gradients and what ``.grad``
holds after the call.
"""
from __future__ import annotations

import torch


def _split_run(split_linear_backward, weight, bias, x, grad_out, held):
    """Kernel side: the learner's split backward on a Linear with these parameters whose
    ``.grad`` (and x's) already hold ``held`` = (x, weight, bias) gradients, as after earlier
    microbatches. Returns (its result, detached; what x's, the weight's and the bias's ``.grad``
    hold after the call). The grader judges both: a split backward leaves ``.grad`` as it was
    (an answer that accumulated into ``.grad``, or cleared it and ran ``.backward()``, shows it)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    x.grad, layer.weight.grad, layer.bias.grad = (h.clone() for h in held)
    got = split_linear_backward(layer, x, grad_out)
    if isinstance(got, (tuple, list)):
        got = type(got)(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in got)
    after = tuple(None if t.grad is None else t.grad.detach().clone() for t in (x, layer.weight, layer.bias))
    return got, after
