"""Cross-entropy over vocab-parallel logits, without ever gathering them
(Megatron-LM sec. 3: "fuse the output embedding GEMM with the cross entropy loss", which
reduces the communication from b*s*v elements to b*s).

Rank r holds the logits of its vocabulary block ``z[:, r*V/t : (r+1)*V/t]``. For N tokens:

1. ``m = max_v z_v``: local max, **all-reduce (MAX)** of N elements. Subtracting the
   global max keeps ``exp`` from overflowing (softmax does not change).
2. ``z_y - m`` for the target y: the rank owning y contributes it, the others 0,
   **all-reduce (SUM)** of N elements.
3. ``sum_v exp(z_v - m)``: local sums, **all-reduce (SUM)** of N elements.

Then ``loss = log(sum_v exp(z_v - m)) - (z_y - m)``: 3 all-reduces of N elements (4*N
bytes in fp32 each) whatever V is.

Label smoothing eps (PyTorch's definition, ``F.cross_entropy(label_smoothing=eps)`` on the
full logits, with the global V): ``loss = (1-eps) * nll + eps * mean_v(-log p_v)`` and
``mean_v(-log p_v) = log(sum exp) - (1/V) sum_v (z_v - m)``. The sum of logits over the
vocabulary is one more value per token; we send it in the SAME all-reduce as step 3
(a ``[2, N]`` tensor), so smoothing costs no extra all-reduce, only N more elements
(3 all-reduces, the last of 2N elements).

Gradient (computed locally, no communication): ``dloss/dz_v = p_v - (1-eps) 1[v=y] - eps/V``
times the incoming per-token gradient; ignored tokens get zero.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import comm
from .mappings import tp_rank, tp_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss ``[N]`` from local logits ``[N, V/t]`` and targets ``[N]``."""

    @staticmethod
    def forward(ctx, logits, target, valid, label_smoothing, group):
        t, r = tp_size(group), tp_rank(group)
        n_local = logits.shape[-1]
        V = n_local * t
        start = r * n_local
        ctx.in_dtype = logits.dtype
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits

        # 1. global max over the vocabulary (all-reduce MAX)
        logits_max = logits.max(dim=-1).values
        if t > 1:
            comm.all_reduce(logits_max, group=group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        # 2. the target's shifted logit, from the rank that owns it (all-reduce SUM)
        mine = valid & (target >= start) & (target < start + n_local)
        local_target = (target - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~mine, 0.0)
        if t > 1:
            comm.all_reduce(target_logit, group=group)

        # 3. sum of exponentials (and, with smoothing, sum of logits) (all-reduce SUM)
        exp = shifted.exp()
        if label_smoothing > 0:
            sums = torch.stack([exp.sum(dim=-1), shifted.sum(dim=-1)])   # [2, N]
        else:
            sums = exp.sum(dim=-1).unsqueeze(0)                          # [1, N]
        if t > 1:
            comm.all_reduce(sums, group=group)
        sum_exp = sums[0]
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit                               # -log p_y
        if label_smoothing > 0:
            mean_neg_logp = log_sum_exp - sums[1] / V                   # mean_v(-log p_v)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * mean_neg_logp
        loss = loss.masked_fill(~valid, 0.0)

        softmax = exp / sum_exp.unsqueeze(-1)                           # local p_v, [N, V/t]
        ctx.save_for_backward(softmax, local_target, mine, valid)
        ctx.label_smoothing, ctx.V = label_smoothing, V
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= (1.0 - eps) * mine.to(grad.dtype)   # - (1-eps) one-hot
        if eps > 0:
            grad -= eps / ctx.V
        grad *= (grad_loss * valid.to(grad.dtype)).unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, ignore_index: int = -100, group=None,
                                 reduction: str = "mean", vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of logits split by vocabulary across the TP group.

    Args:
        vocab_parallel_logits: ``[*, V/t]``, this rank's vocabulary block (block r holds
            ids ``[r*V/t, (r+1)*V/t)``), e.g. a ColumnParallelLinear with
            ``gather_output=False``.
        target: ``[*]`` long ids in ``[0, V)`` or ``ignore_index``.
        label_smoothing: eps in [0, 1), as in ``torch.nn.functional.cross_entropy``.
        ignore_index: targets equal to it contribute to neither the loss nor the count.
        group: the tensor-parallel process group.
        reduction: "mean" (default, like F.cross_entropy: sum over non-ignored tokens divided
            by their number; NaN if every token is ignored), "sum", or "none" (per-token
            loss ``[*]``, 0 at ignored tokens).
        vocab_size: the full vocabulary V (optional): when given, the logits' last dimension
            must be this rank's shard V/t, so that logits already gathered over TP (``[*, V]``,
            which would add log t to every loss) are refused. The head of a labkit GPT
            (:class:`labkit.tensor_parallel.model.ParallelHead`) always passes it.

    Returns the loss (nats), identical on every rank. Communication: 3 all-reduces
    (MAX of N, SUM of N, SUM of N elements; with label smoothing the last carries 2N).
    Raises ValueError, before any communication, for targets outside ``[0, V)`` other
    than ``ignore_index``, for shapes that do not match, for logits whose last dimension is not
    ``vocab_size / t`` (with ``vocab_size``), or a bad eps/reduction.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_parallel_logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(vocab_parallel_logits.shape)} and target {tuple(target.shape)} "
                         f"must agree in all but the last (vocabulary) dimension")
    t = tp_size(group)
    if vocab_size is not None and vocab_parallel_logits.shape[-1] * t != vocab_size:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(vocab_parallel_logits.shape)} (target "
                         f"{tuple(target.shape)}) must end in this "
                         f"rank's vocabulary shard V/t = {vocab_size}/{t} = {vocab_size / t:g}, got "
                         f"{vocab_parallel_logits.shape[-1]} (logits already gathered over the t={t} TP ranks "
                         f"would add log t to the loss)")
    V = vocab_parallel_logits.shape[-1] * t
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= V))
    if bool(bad.any()):
        raise ValueError(f"target ids must lie in [0, V={V}) or equal ignore_index={ignore_index}; "
                         f"got {target[bad][:8].tolist()}")
    shape = target.shape
    logits2d = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(logits2d, target.reshape(-1), valid.reshape(-1),
                                            float(label_smoothing), group)
    if reduction == "none":
        return loss.reshape(shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
