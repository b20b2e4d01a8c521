"""Expert slicing (DeepSpeed-MoE, Rajbhandari et al. 2022, sec. 5.2): one expert's FFN split
with Megatron's column/row rule over an expert-slicing group of s ranks.

:class:`SlicedExpert` is the slice itself (plain MoE, no process group). Running sliced experts
with tensor-parallel non-expert layers on a grid is a composition of two axes and lives in
:mod:`labkit.parallel.expert_slicing` (``ExpertSlicedMoE``, ``ExpertSlicedMoEGPT``,
``make_slicing_groups``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..grid import even_part
from .experts import Expert

__all__ = ["SlicedExpert"]


class SlicedExpert(nn.Module):
    """Slice j of s of an :class:`~labkit.moe.experts.Expert` (Megatron split, DeepSpeed-MoE
    expert-slicing): GeLU: ``fc1`` rows j*F/s..(j+1)*F/s of the full [F, H] weight (and its
    bias), ``fc2`` the same columns of the [H, F] weight; SwiGLU: ``w1``, ``w3`` by rows and
    ``w2`` by columns. ``forward(x [N, H]) -> [N, H]`` this slice's PARTIAL output; the sum over
    the s slices is the expert's output (fc2's bias is added by slice 0 only).
    Raises ValueError when s does not divide the expert width F."""

    def __init__(self, expert: Expert, slice_rank: int, n_slices: int):
        super().__init__()
        full = expert.fc1 if expert.activation == "gelu" else expert.w1
        F_ = full.out_features
        if n_slices < 1 or F_ % n_slices:
            raise ValueError(f"expert width {F_} is not divisible by the expert-slicing degree s={n_slices}")
        self.activation, self.first = expert.activation, slice_rank == 0
        cols = even_part(F_, n_slices, slice_rank)

        def rows_of(lin):
            new = nn.Linear(lin.in_features, F_ // n_slices, bias=lin.bias is not None)
            with torch.no_grad():
                new.weight.copy_(lin.weight[cols])
                if lin.bias is not None:
                    new.bias.copy_(lin.bias[cols])
            return new

        def cols_of(lin):
            new = nn.Linear(F_ // n_slices, lin.out_features, bias=lin.bias is not None)
            with torch.no_grad():
                new.weight.copy_(lin.weight[:, cols])
                if lin.bias is not None:
                    new.bias.copy_(lin.bias)
            return new

        if self.activation == "gelu":
            self.fc1, self.fc2 = rows_of(expert.fc1), cols_of(expert.fc2)
        else:
            self.w1, self.w3, self.w2 = rows_of(expert.w1), rows_of(expert.w3), cols_of(expert.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            h, out = F.gelu(self.fc1(x)), self.fc2
        else:
            h, out = F.silu(self.w1(x)) * self.w3(x), self.w2
        y = F.linear(h, out.weight)
        return y + out.bias if (out.bias is not None and self.first) else y
