"""Kernel side of notebook 02_gpipe's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb02_gpipe` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations

import torch

from ...model import GPT, GPTConfig

# A smaller GPT than the pipeline's: one device, a few SGD steps per case.
ACC_BATCH, ACC_SEQ, ACC_LR = 8, 8, 0.5
ACC_CFG = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)
ACC_STAT = 1.0  # weight of BatchStatGPT's batch-statistic term


class BatchStatGPT(GPT):
    """The GPT of exercise 2.3's check: its loss adds ``ACC_STAT * |mean_batch(h)|^2``, the squared mean over
    the call's batch (and positions) of the last block's output h, a per-call statistic as BatchNorm's.

    That term is not linear in the batch: one call on the whole batch and M calls on its M microbatches give
    different gradients, so the gradients alone (data) show whether the batch was cut into M microbatches,
    each loss scaled by 1/M. Parameter names are the GPT's."""

    def forward(self, idx, targets=None, ignore_index=-100):
        last = []

        def apply(block, x):
            x = block(x)
            last[:] = [x]
            return x

        out = self.run(idx, targets, ignore_index, apply)
        if targets is None or not last:
            return out
        mean = last[0].mean(dim=(0, 1))
        return out + ACC_STAT * (mean * mean).sum()


def _acc_batch(seed: int):
    g = torch.Generator().manual_seed(2300 + seed)
    return (torch.randint(0, 256, (ACC_BATCH, ACC_SEQ), generator=g),
            torch.randint(0, 256, (ACC_BATCH, ACC_SEQ), generator=g))


def _sgd_run(step_grads, steps: int, seed: int, calls: list | None = None) -> tuple[dict, dict]:
    """``steps`` steps of plain SGD (lr ACC_LR) on a fresh tiny :class:`BatchStatGPT`; ``step_grads(model, x, y)`` fills
    .grad each step. Returns (gradients of the first step, parameters after the last). With ``calls``
    (a list), the batch size of every call of the model in the first step is appended to it."""
    model = BatchStatGPT(ACC_CFG, seed=seed)
    state = {"step": 0}
    if calls is not None:
        def record(module, args, kwargs):
            idx = args[0] if args else kwargs.get("idx")
            if state["step"] == 0 and len(calls) < 64 and isinstance(idx, torch.Tensor) and idx.dim() > 0:
                calls.append(int(idx.shape[0]))
        model.register_forward_pre_hook(record, with_kwargs=True)
    first = {}
    for step in range(steps):
        state["step"] = step
        model.zero_grad(set_to_none=True)
        x, y = _acc_batch(seed * 10 + step)
        step_grads(model, x, y)
        if step == 0:
            first = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
        with torch.no_grad():  # plain SGD, w <- w - lr * g (torch.optim would import torch._dynamo: 1 s)
            for p in model.parameters():
                if p.grad is not None:
                    p -= ACC_LR * p.grad
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}


def _accumulate_run(accumulate_microbatches, M: int, steps: int, seed: int):
    """Kernel side: the learner's accumulation in :func:`_sgd_run`: its gradients, its parameters and
    the batch sizes of the model's calls in the first step (for the message only, never the verdict)."""
    calls: list = []
    grads, params = _sgd_run(lambda model, x, y: accumulate_microbatches(model, x, y, M), steps, seed, calls)
    return grads, params, calls


def _step_loss_run(microbatch_losses, token_losses, valid):
    """Kernel side of exercise 2.4: the learner's ``microbatch_losses`` on ``token_losses`` that require
    grad, as data: ``(returned, jacobian)``. ``returned`` is what the function returned (a tensor
    detached, anything else as it is); ``jacobian`` [d, M, *token_losses.shape] holds, for each
    returned ``[r, m]``, the gradient that its backward sends to ``token_losses`` (zeros where
    nothing flows), or None when the return is not a [d, M] tensor that requires grad."""
    x = token_losses.clone().requires_grad_(True)
    got = microbatch_losses(x, valid.clone())
    d, M = token_losses.shape[:2]
    if not isinstance(got, torch.Tensor):
        return got, None
    if tuple(got.shape) != (d, M) or not got.requires_grad:
        return got.detach(), None
    rows = []
    for r in range(d):
        for m in range(M):
            (g,) = torch.autograd.grad(got[r, m], x, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros_like(x) if g is None else g.detach())
    return got.detach(), torch.stack(rows).reshape(d, M, *x.shape)
