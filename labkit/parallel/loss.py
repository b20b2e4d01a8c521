"""The loss of a training step with ignored targets: the mean over every valid target of the step.

One device computes ``F.cross_entropy(logits, targets, ignore_index=-100)`` over the whole global
batch: the sum of the per-token losses of the N valid targets, divided by N. A parallel run cuts
the step into pieces (the d DP ranks' rows, the cp CP ranks' sequence chunks, the M microbatches
of the pipeline), and each piece differentiates its own loss; the pieces' gradients are then
combined in fixed ways: the pipeline runtime divides each microbatch's loss by M
(:mod:`labkit.pipeline.runtime`) and data parallelism averages the gradients over the D = d cp
ranks that share a stage (DDP, ZeRO-1/2/3, HSDP: :mod:`labkit.data_parallel`). So piece (r, m)
must hand the runtime::

    loss[r, m] = sum of its valid per-token losses * M * D / N          (N counted over the whole step)

and ``sum_{r, m} loss[r, m] / (M D)`` is then the step's token mean, whatever the pieces hold.
Taking each piece's own token mean (``loss[r, m] = mean``, "mean of means": what the pipeline's
1/M and DDP's 1/D compute from per-microbatch means) is the token mean only when every piece holds
the same number of valid targets; a piece with none gives 0/0. This is the bug of the 2024
gradient-accumulation reports and of Megatron-LM issue #7452 (finding 9, context parallelism).

N must be known before the first backward: each rank counts the valid targets of its own rows
and chunks (all its microbatches), and ONE all-reduce of that count over the D ranks of the
data-parallel (x context-parallel) group gives N (:meth:`StepTokenCount.count`: a 0-d int64, 8
bytes; the tensor-parallel ranks hold the same targets and the pipeline's other stages compute
no loss, so neither takes part). A step with no valid target has N = 0: every piece's loss is 0,
the gradients are zero and the reported loss is 0 (never NaN), and :class:`ParallelGPT
<labkit.parallel.ParallelGPT>` warns that the step had nothing to learn from.

The MoE balance losses are not token losses and keep their own normalization: they are computed
per token group (one microbatch of one DP rank, all of its tokens, ignored targets included) and
averaged over the d M groups (Switch Transformer eq. 4, GShard's per-group ``l_aux``, DeepSeek's
sequence-wise loss per sequence): :mod:`labkit.moe.losses`.

Sources: PyTorch ``F.cross_entropy`` (``reduction="mean"`` with ``ignore_index``); Megatron-Core's
``calculate_per_token_loss`` (the loss function returns the sum and the token count, and the
gradients are scaled by the count summed over DP); the Hugging Face gradient-accumulation fix
(``num_items_in_batch``, October 2024).
"""
from __future__ import annotations

import torch

from .. import comm

__all__ = ["microbatch_losses", "loss_scale", "StepTokenCount", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def loss_scale(n_step: int, M: int, D: int) -> float:
    """The factor each piece multiplies its SUM of valid token losses by: ``M D / N`` (0 when the
    step has no valid target, N = 0). ``M``: microbatches per step the runtime divides by; ``D``:
    the ranks data parallelism averages the gradients over (d, times cp with context parallelism)."""
    return 0.0 if n_step == 0 else M * D / n_step


def microbatch_losses(token_losses: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The loss each piece of a step hands the pipeline runtime, on one process (the reference of
    notebook 02's exercise 2.4).

    Args:
        token_losses: ``[D, M, ...]`` float, the per-token losses of DP rank r's microbatch m
            (anything at ignored positions).
        valid: ``[D, M, ...]`` bool, True where the target is valid (not ``ignore_index``).

    Returns ``[D, M]``: ``loss[r, m] = sum(token_losses[r, m][valid[r, m]]) * M D / N``, N the valid
    targets of the whole step, differentiable in ``token_losses``; all zeros when N = 0. Then
    ``loss.sum() / (M D)`` (the runtime's 1/M, DP's average over D) is the step's token mean.
    Raises ValueError when the shapes differ or have fewer than two dimensions."""
    if token_losses.shape != valid.shape or token_losses.dim() < 2:
        raise ValueError(f"token_losses {tuple(token_losses.shape)} and valid {tuple(valid.shape)} must both be "
                         f"[D, M, ...]")
    D, M = token_losses.shape[:2]
    sums = token_losses.masked_fill(~valid, 0.0).reshape(D, M, -1).sum(-1)
    return sums * loss_scale(int(valid.sum()), M, D)


class StepTokenCount:
    """The valid targets N of a training step, counted once before its first backward.

    ``count(target, group)``: this rank's targets (its DP rows, its CP chunk; ``[b, s]`` long,
    ``ignore_index`` where ignored), summed over ``group`` (the D ranks of the data-parallel x
    context-parallel group; None: this rank alone) in one all-reduce of a 0-d int64 (8 bytes,
    counted by :class:`labkit.comm.CommLog` and in the planner's ``"loss"`` axis). Sets ``n`` and
    ``scale`` = :func:`loss_scale` ``(n, M, D)``. ``piece_loss(sum)``: a piece's loss from the sum of
    its valid token losses."""

    def __init__(self, M: int, D: int, ignore_index: int = IGNORE_INDEX):
        self.M, self.D, self.ignore_index = M, D, ignore_index
        self.n, self.scale = None, None

    def count(self, target: torch.Tensor, group=None) -> int:
        n = (target != self.ignore_index).sum().to(torch.int64).reshape(())
        if group is not None and self.D > 1:
            comm.all_reduce(n, group)
        self.n = int(n)
        self.scale = loss_scale(self.n, self.M, self.D)
        return self.n

    def piece_loss(self, token_loss_sum: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("StepTokenCount.count must run before the step's first loss")
        return token_loss_sum * self.scale
