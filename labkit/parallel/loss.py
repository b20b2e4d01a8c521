"""The loss of a training step with ignored targets: the mean over every valid target of the step.

One device computes ``F.cross_entropy(logits, targets, ignore_index=-100)`` over the whole global
batch: the sum of the per-token losses of the N valid targets, divided by N. A parallel run cuts
the step into pieces (the d DP ranks' rows, the cp CP ranks' sequence chunks, the M microbatches
of the pipeline), and each piece differentiates its own loss; the pieces' gradients are then
combined in fixed ways: the gradients of a rank's microbatches add up in ``.grad`` and data
parallelism averages the gradients over the D = d cp ranks that share a stage (DDP, ZeRO-1/2/3,
HSDP: :mod:`labkit.data_parallel`). So piece (r, m) must backpropagate::

    loss[r, m] = (sum of its valid per-token losses) * D / N          (N counted over the whole step)

and ``sum_{r, m} loss[r, m] / D`` is then the step's token mean, whatever the pieces hold
(:func:`microbatch_losses`, notebook 02's exercise 2.4). labkit's pipeline runtime divides what
its ``loss_fn`` returns by M (exercise 2.3's rule), so :class:`ParallelGPT
<labkit.parallel.ParallelGPT>`'s loss function returns M times that (:meth:`StepTokenCount.piece_loss`).
Taking each piece's own token mean divided by M ("mean of means": the 1/M rule of equal
microbatches) is the token mean only when every piece holds the same number of valid targets; a
piece with none gives 0/0. This is the bug of the 2024 gradient-accumulation reports and of
Megatron-LM issue #7452 (finding 9, context parallelism).

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


def loss_scale(n_step: int, D: int) -> float:
    """The factor each piece multiplies its SUM of valid token losses by before its backward:
    ``D / N`` (0 when the step has no valid target, N = 0). ``D``: the ranks data parallelism
    averages the gradients over (d, times cp with context parallelism)."""
    return 0.0 if n_step == 0 else D / n_step


def microbatch_losses(token_losses: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The loss each microbatch of each DP rank backpropagates, on one process (the reference of
    notebook 02's exercise 2.4): its gradients, accumulated over the M microbatches and then
    averaged over the D ranks, are those of one device's token mean.

    Args:
        token_losses: ``[D, M, ...]`` float, the per-token losses of DP rank r's microbatch m
            (anything at ignored positions).
        valid: ``[D, M, ...]`` bool, True where the target is valid (not ``ignore_index``).

    Returns ``[D, M]``: ``loss[r, m] = sum(token_losses[r, m][valid[r, m]]) * D / N``, N the valid
    targets of the whole step, differentiable in ``token_losses``; all zeros when N = 0. Then
    ``loss.sum() / D`` (DP's average over D) is the step's token mean.
    Raises ValueError when the shapes differ or have fewer than two dimensions."""
    if token_losses.shape != valid.shape or token_losses.dim() < 2:
        raise ValueError(f"token_losses {tuple(token_losses.shape)} and valid {tuple(valid.shape)} must both be "
                         f"[D, M, ...]")
    D, M = token_losses.shape[:2]
    sums = token_losses.masked_fill(~valid, 0.0).reshape(D, M, -1).sum(-1)
    return sums * loss_scale(int(valid.sum()), D)


class StepTokenCount:
    """The valid targets N of a training step, counted once before its first backward.

    ``count(target, group)``: this rank's targets (its DP rows, its CP chunk; ``[b, s]`` long,
    ``ignore_index`` where ignored), summed over ``group`` (the D ranks of the data-parallel x
    context-parallel group; None: this rank alone) in one all-reduce of a 0-d int64 (8 bytes,
    counted by :class:`labkit.comm.CommLog` and in the planner's ``"loss"`` axis). Sets ``n`` and
    ``scale`` = M :func:`loss_scale` ``(n, D)``. ``piece_loss(sum)``: what a microbatch hands the
    pipeline runtime (which divides it by M) from the sum of its valid token losses."""

    def __init__(self, M: int, D: int, ignore_index: int = IGNORE_INDEX):
        self.M, self.D, self.ignore_index = M, D, ignore_index
        self.n, self.scale = None, None

    def count(self, target: torch.Tensor, group=None) -> int:
        n = (target != self.ignore_index).sum().to(torch.int64).reshape(())
        if group is not None and self.D > 1:
            comm.all_reduce(n, group)
        self.n = int(n)
        self.scale = self.M * loss_scale(self.n, self.D)
        return self.n

    def piece_loss(self, token_loss_sum: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            raise RuntimeError("StepTokenCount.count must run before the step's first loss")
        return token_loss_sum * self.scale
