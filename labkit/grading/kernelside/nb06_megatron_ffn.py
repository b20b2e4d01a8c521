"""Kernel side of notebook 06_megatron_ffn's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb06_megatron_ffn` (what runs here and why: :mod:`labkit.grading.kernelside`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...dist import launch
from ..registry import CheckFailure


# ----------------------------------------------------------------------------- 6.2 / 6.3
def _torch_gelu(x):
    return F.gelu(x, approximate="tanh")


def _tp_mlp_run(ctx, fn_class, which, N, H, F_, seed):
    """One forward/backward of the MLP split over ctx's ranks with the learner's f (``which`` = "f")
    or g, and NOTHING of labkit's in the other place (labkit's f and g are the references of 6.2
    and 6.3, absent from the graded kernel): testing f, the partial output is this rank's Z and
    the loss's gradient W enters it directly (what g's backward hands every rank); testing g, X
    enters the branch as is (f's forward) and this rank's dL/dX is its branch's share. The grader
    sums over the ranks what labkit's other operator would have summed. Returns this rank's
    output, dL/dX and the gradients of its shards."""
    t, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, H, generator=g)
    A = torch.randn(H, F_, generator=g) / H ** 0.5
    B = torch.randn(F_, H, generator=g) / F_ ** 0.5
    W = torch.randn(N, H, generator=g)  # dL/dZ: L = sum(Z * W)
    w = F_ // t
    x = X.clone().requires_grad_(True)
    A_r = A[:, r * w:(r + 1) * w].clone().requires_grad_(True)
    B_r = B[r * w:(r + 1) * w].clone().requires_grad_(True)
    xin = fn_class.apply(x, ctx.group) if which == "f" else x
    if not isinstance(xin, torch.Tensor):
        raise CheckFailure(f"forward of f returned {type(xin).__name__}, not a tensor")
    partial = _torch_gelu(xin @ A_r) @ B_r
    z = partial if which == "f" else fn_class.apply(partial, ctx.group)
    if not isinstance(z, torch.Tensor):
        raise CheckFailure(f"forward of g returned {type(z).__name__}, not a tensor")
    (z * W).sum().backward()
    return {"Z": z.detach().clone(), "dX": None if x.grad is None else x.grad.clone(),
            "dA": A_r.grad.clone(), "dB": B_r.grad.clone()}


def _operator_outputs(fn_class, which: str, t: int, N: int, H: int, F_: int, seed: int):
    """Kernel side: the MLP on t ranks with the learner's f (``which`` = "f") or g; per rank
    what :func:`_tp_mlp_run` measured."""
    if not (isinstance(fn_class, type) and issubclass(fn_class, torch.autograd.Function)):
        raise CheckFailure(f"expected a torch.autograd.Function subclass, got {type(fn_class).__name__}")
    return launch(_tp_mlp_run, t, fn_class, which, N, H, F_, seed, timeout=8)


def _row_run(ctx, row_parallel_linear, N, F_, H, seed):
    """One forward/backward of the learner's row-parallel linear on this rank; returns its output and the
    gradients of its input shard, weight shard and bias."""
    t, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(seed)
    X, W, b = torch.randn(N, F_, generator=g), torch.randn(H, F_, generator=g), torch.randn(H, generator=g)
    G = torch.randn(N, H, generator=g)  # dL/dy: L = sum(y * G)
    w = F_ // t
    x_r = X[:, r * w:(r + 1) * w].clone().requires_grad_(True)
    W_r = W[:, r * w:(r + 1) * w].clone().requires_grad_(True)
    bias = b.clone().requires_grad_(True)
    y = row_parallel_linear(x_r, W_r, bias, ctx.group)
    if not isinstance(y, torch.Tensor):
        raise CheckFailure(f"row_parallel_linear returned {type(y).__name__}, not a tensor")
    if tuple(y.shape) != (N, H):
        raise CheckFailure(f"row_parallel_linear returned shape {tuple(y.shape)}, expected [N, H] = {(N, H)}")
    (y * G).sum().backward()
    grad = lambda p: None if p.grad is None else p.grad.clone()  # noqa: E731
    return {"y": y.detach().clone(), "dx": grad(x_r), "dW": grad(W_r), "db": grad(bias)}


def _row_outputs(row_parallel_linear, t: int, N: int, F_: int, H: int, seed: int):
    """Kernel side: the learner's row-parallel linear on t ranks; per rank what :func:`_row_run` returns."""
    return launch(_row_run, t, row_parallel_linear, N, F_, H, seed, timeout=8)
