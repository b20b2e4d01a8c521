"""Kernel side of notebook 13_zero_bubble's exercises: the code that runs next to the learner's
code (``answer.run(fn, ...)`` in the cases of :mod:`labkit.grading.exercises.nb13_zero_bubble`).

It lives outside ``labkit.grading.exercises`` because the graded kernel cannot read that
package (:mod:`labkit.grading.session`); nothing here computes an expected value.
"""
from __future__ import annotations

import torch


def _split_run(split_linear_backward, weight, bias, x, grad_out):
    """Kernel side: the learner's split backward on a Linear with these parameters; its result
    (detached) and whether it wrote a .grad (x's or the layer's)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    got = split_linear_backward(layer, x, grad_out)
    wrote = layer.weight.grad is not None or x.grad is not None
    if isinstance(got, (tuple, list)):
        got = type(got)(t.detach() if isinstance(t, torch.Tensor) else t for t in got)
    return got, wrote
