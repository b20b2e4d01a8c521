"""Tensor-parallel layers: column- and row-parallel linear, the parallel MLP and the
vocab-parallel embedding (Shoeybi et al. 2019, "Megatron-LM", sec. 3).

Notation: t is the tensor-parallel degree (size of ``group``), r this rank's index in it.
A linear layer computes ``Y = X W + b`` with ``W`` of shape ``[in, out]`` (stored, as in
``nn.Linear``, transposed: ``weight`` is ``[out, in]``).

* Column-parallel: ``W = [W_0 | ... | W_{t-1}]`` split by output columns; rank r computes
  ``Y_r = X W_r + b_r``, one 1/t slice of the output features. No communication forward
  (the input X is replicated); the backward of the ``f`` operator sums dL/dX.
* Row-parallel: ``W`` split by input rows; rank r holds ``X_r`` (the matching slice of the
  input features) and computes the partial product ``X_r W_r``; ``Y = sum_r X_r W_r + b``
  needs one all-reduce (the ``g`` operator). The bias is added once, after the reduction.

Why the MLP needs no communication before GeLU (sec. 3, eq. 3): with A split by columns,
``GeLU(X [A_0 | A_1]) = [GeLU(X A_0) | GeLU(X A_1)]`` because GeLU acts element by
element; splitting A by rows instead would need ``GeLU(X_0 A_0 + X_1 A_1)``, a sum before
the nonlinearity, i.e. a synchronisation. So A is column-parallel, B row-parallel, and the
whole MLP costs one all-reduce forward (g) and one backward (f).

Sharded parameters carry Megatron's attributes ``tensor_model_parallel = True`` and
``partition_dim`` (the dimension of the full tensor that is split), which
:func:`labkit.tensor_parallel.model.gather_full_tensors` uses to rebuild full shapes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_along_dim,
    tp_rank,
    tp_size,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelMLP", "divide"]


def divide(n: int, t: int, what: str) -> int:
    """``n // t``, or ValueError naming ``what`` when the TP degree t does not divide n."""
    if n % t:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel degree t={t} "
                         f"({n} % {t} = {n % t}); every rank must get an equal share")
    return n // t


def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    return param


def _init_like_linear(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with the *full* fan_in.
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-bound, bound)
        if bias is not None:
            bias.uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """``Y = X W + b`` with W split by output columns: this rank holds ``out_features / t``.

    Args:
        in_features, out_features: full sizes of the layer (H_in, H_out).
        bias: add a bias (split like the output: ``[out_features / t]``).
        gather_output: True: all-gather the output slices, return ``[*, out_features]``;
            False: return this rank's slice ``[*, out_features / t]`` (to feed a
            :class:`RowParallelLinear` with ``input_is_parallel=True``).
        group: the tensor-parallel process group (t = its size).
        copy_input: apply ``f`` (:func:`copy_to_tensor_model_parallel_region`) to the input.
            Pass False when the caller already did, so several column-parallel layers that
            read the same input (q, k and v in attention, like Megatron's fused
            ``linear_qkv``) share ONE backward all-reduce.

    Input ``[*, in_features]`` (replicated on every rank). Parameters: ``weight``
    ``[out_features / t, in_features]``, ``bias`` ``[out_features / t]``.
    Communication: backward 1 all-reduce of dL/dX (if ``copy_input``); forward 1
    all-gather if ``gather_output``.
    Raises ValueError (construction, no communication) when t does not divide out_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 group=None, copy_input: bool = True):
        super().__init__()
        self.group = group
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, self.t, "ColumnParallelLinear out_features")
        self.gather_output, self.copy_input = gather_output, copy_input
        self.weight = _mark(nn.Parameter(torch.empty(self.out_per_rank, in_features)), 0)
        self.bias = _mark(nn.Parameter(torch.empty(self.out_per_rank)), 0) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_full(cls, linear: nn.Linear, group, **kwargs) -> "ColumnParallelLinear":
        """Build from a full ``nn.Linear`` (same on every rank): keep this rank's rows of
        ``linear.weight`` (= columns of W) and slice of ``linear.bias``."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group, **kwargs)
        layer.load_full_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard out of the full ``weight`` ``[out, in]`` (and ``bias`` ``[out]``)."""
        self.weight.copy_(split_along_dim(weight.detach(), 0, self.group))
        if self.bias is not None:
            self.bias.copy_(split_along_dim(bias.detach(), 0, self.group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tensor_model_parallel_region(x, self.group)      # f
        y = F.linear(x, self.weight, self.bias)                          # Y_r = X W_r + b_r
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (t={self.t}: "
                f"{self.out_per_rank} here), bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Y = X W + b`` with W split by input rows: this rank holds ``in_features / t`` of them.

    Args:
        in_features, out_features: full sizes of the layer.
        bias: add a bias ``[out_features]``, replicated, added ONCE after the all-reduce
            (adding it on every rank before the sum would add it t times).
        input_is_parallel: True: the input is already this rank's slice
            ``[*, in_features / t]`` (e.g. from a ColumnParallelLinear with
            ``gather_output=False``); False: the input is full ``[*, in_features]`` and
            is scattered first.
        group: the tensor-parallel process group.

    Output ``[*, out_features]``, replicated. Parameters: ``weight``
    ``[out_features, in_features / t]``, ``bias`` ``[out_features]``.
    Communication: forward 1 all-reduce of the output (``g``); backward 1 all-gather of
    dL/dX only if ``input_is_parallel`` is False.
    Raises ValueError (construction, no communication) when t does not divide in_features.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 group=None):
        super().__init__()
        self.group = group
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.t, "RowParallelLinear in_features")
        self.input_is_parallel = input_is_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.in_per_rank)), 1)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_full(cls, linear: nn.Linear, group, **kwargs) -> "RowParallelLinear":
        """Build from a full ``nn.Linear``: keep this rank's columns of ``linear.weight``
        (= rows of W) and the whole bias."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group, **kwargs)
        layer.load_full_weight(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's shard out of the full ``weight`` ``[out, in]``; the bias is whole."""
        self.weight.copy_(split_along_dim(weight.detach(), 1, self.group))
        if self.bias is not None:
            self.bias.copy_(bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.group)
        partial = F.linear(x, self.weight)                               # X_r W_r
        y = reduce_from_tensor_model_parallel_region(partial, self.group)  # g: sum_r X_r W_r
        return y if self.bias is None else y + self.bias                 # + b, once

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (t={self.t}: {self.in_per_rank} here), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}")


class ParallelMLP(nn.Module):
    """Megatron's MLP block ``Z = Dropout(GeLU(X A) B)`` (sec. 3, Fig. 3a).

    ``fc1`` (A, ``hidden -> ffn_hidden``) is column-parallel, GeLU runs on each rank's
    slice with no communication, ``fc2`` (B) is row-parallel. Input/output ``[B, S, H]``
    replicated. Communication: forward 1 all-reduce (g, ``B*S*H`` elements), backward 1
    all-reduce (f). Raises ValueError when t does not divide ``ffn_hidden``.

    Dropout acts on the replicated output; to match across ranks every TP rank must draw the
    same mask (same RNG state), as in Megatron's replicated-region RNG.
    """

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, dropout: float = 0.0, group=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, bias=bias, gather_output=False, group=group)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, bias=bias, input_is_parallel=True, group=group)
        self.drop = nn.Dropout(dropout)

    @classmethod
    def from_reference(cls, mlp: nn.Module, group) -> "ParallelMLP":
        """Shard a :class:`labkit.model.MLP` (``fc1`` = A, ``fc2`` = B) onto this rank."""
        m = cls(mlp.fc1.in_features, mlp.fc1.out_features, bias=mlp.fc1.bias is not None,
                dropout=mlp.drop.p, group=group)
        m.fc1.load_full_weight(mlp.fc1.weight, mlp.fc1.bias)
        m.fc2.load_full_weight(mlp.fc2.weight, mlp.fc2.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows (Megatron-LM sec. 3, "input embedding").

    Rank r owns the contiguous block of ids ``[r*V/t, (r+1)*V/t)``: ``weight`` is
    ``[V/t, D]``. For ids ``[*]`` (long) each rank looks up the ids in its block, writes
    zero rows for the others (masked, so they send no gradient to any local row), and one
    all-reduce (g) sums the t partial results into the full lookup ``[*, D]``.

    Communication: forward 1 all-reduce of ``ids.numel() * D`` elements; backward none.
    Raises ValueError at construction when t does not divide ``num_embeddings`` and at
    forward (before the all-reduce) for ids outside ``[0, num_embeddings)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None):
        super().__init__()
        self.group = group
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = divide(num_embeddings, self.t, "VocabParallelEmbedding vocabulary size num_embeddings")
        self.vocab_start = self.rank * self.per_rank
        self.vocab_end = self.vocab_start + self.per_rank
        self.weight = _mark(nn.Parameter(torch.empty(self.per_rank, embedding_dim)), 0)
        nn.init.normal_(self.weight)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, group) -> "VocabParallelEmbedding":
        """Shard a full ``nn.Embedding`` ``[V, D]`` onto this rank."""
        e = cls(embedding.num_embeddings, embedding.embedding_dim, group=group)
        e.load_full_weight(embedding.weight)
        return e

    @torch.no_grad()
    def load_full_weight(self, weight: torch.Tensor) -> None:
        self.weight.copy_(split_along_dim(weight.detach(), 0, self.group))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            bad = ids[(ids < 0) | (ids >= self.num_embeddings)]
            raise ValueError(f"token ids must lie in [0, {self.num_embeddings}); got {bad[:8].tolist()}")
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)   # any valid row; zeroed below
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)               # no value, no gradient
        return reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (t={self.t}: ids "
                f"[{self.vocab_start}, {self.vocab_end}) here)")
