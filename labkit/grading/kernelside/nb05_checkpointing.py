"""Kernel side of notebook 05_checkpointing's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb05_checkpointing` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..registry import CheckFailure


def _net(seed: int, p: float, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Dropout(p), nn.Linear(2 * width, width),
                         nn.Dropout(p))


def _run(net, x, G, seed, fn):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_(True)
    y = fn(net, x)
    if not isinstance(y, torch.Tensor):
        raise CheckFailure(f"MyCheckpoint.apply returned {type(y).__name__}, not a tensor")
    try:
        y.backward(G)
    except RuntimeError as e:
        if "does not require grad" in str(e):
            raise CheckFailure("backward: the recomputed output has no autograd graph: the recomputation ran "
                               "with gradients disabled (as autograd runs every backward), so it recorded "
                               "nothing to backpropagate through") from None
        raise
    after = torch.rand(3)  # the RNG stream right after forward + backward
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in net.named_parameters()}
    net.zero_grad()
    return y.detach(), x.grad, grads, after


def _ckpt_outputs(answer, p: float, seed: int, segments: int, x, G):
    """Kernel side: ``segments`` applications of the learner's Function; what _run returns."""
    if not (isinstance(answer, type) and issubclass(answer, torch.autograd.Function)):
        raise CheckFailure(f"expected a torch.autograd.Function subclass, got {type(answer).__name__}")
    net = _net(seed, p)

    def ckpt(net, x):
        for _ in range(segments):
            x = answer.apply(net, x)
        return x

    return _run(net, x, G, seed + 2, ckpt)
