"""Kernel side of notebook 09_moe_routing's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb09_moe_routing` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations


def _gate_with_grad(top_k_gate, logits, k: int, renormalize: bool, g):
    """Kernel side: the learner's gate on logits that require grad, and d(sum(w * g))/d logits
    with w sorted by expert id (None when that cannot be computed)."""
    x = logits.clone().requires_grad_(True)
    got = top_k_gate(x, k, renormalize=renormalize)
    grad = None
    try:
        w, i = got
        (w.gather(1, i.long().argsort(-1)) * g).sum().backward()
        grad = x.grad
    except Exception:  # noqa: BLE001 - the checks in the case say what is wrong with the result
        pass
    return got, grad
