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

Sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2, Fig. 5; Megatron-Core's
``sequence_parallel`` flag on these layers): outside the tensor-parallel regions the activations
are split along the SEQUENCE, ``[B, S/t, H]`` (rank r holds tokens ``[r S/t, (r+1) S/t)``).
Entering a column region the shards are all-gathered (``g``, replacing ``f``; backward a
reduce-scatter of dL/dX); leaving a row region the partial sums are reduce-scattered along the
sequence (``g-bar``, replacing the all-reduce ``g``; backward an all-gather). A ring all-reduce
is a reduce-scatter plus an all-gather, so the bytes on the wire are those of plain TP. The
column layer keeps only the input SHARD for backward and all-gathers it again there (sec. 4.2.2,
end; ``regather_in_backward``). Parameters that see only this rank's tokens (the row layer's
bias, and the LayerNorms around) carry ``sequence_parallel = True``: their gradients are partial
sums, all-reduced over the TP group after backward
(:func:`labkit.tensor_parallel.allreduce_layernorm_grads`).

Sharded parameters carry Megatron's attributes ``tensor_model_parallel = True`` and
``partition_dim`` (the dimension of the full tensor that is split), which
:func:`labkit.tensor_parallel.model.gather_full_tensors` uses to rebuild full shapes.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..grid import even_part
from .mappings import (
    SEQUENCE_DIM,
    all_gather_along_dim,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_along_dim,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_along_dim,
    tp_rank,
    tp_size,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelMLP", "divide",
           "column_parallel_linears"]


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


def mark_sequence_parallel(*params) -> None:
    """Mark parameters that see only this rank's S/t tokens (Megatron-Core's attribute)."""
    for p in params:
        if p is not None:
            p.sequence_parallel = True


def _runs(t: torch.Tensor | None) -> bool:
    """Inside a backward: will autograd run the node that made ``t`` in this pass? (A split
    backward asks for the input gradient first and the weight gradients later.)"""
    return t is not None and t.grad_fn is not None and torch._C._will_engine_execute_node(t.grad_fn)


def _node(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` through a view: a node of its own that autograd runs only when ``t``'s gradient is
    wanted in this pass (the engine cannot be asked about a leaf during ``autograd.grad``)."""
    return t.view_as(t) if t is not None and t.requires_grad else t


class _GatherLinears(torch.autograd.Function):
    """All-gather a sequence shard, then apply n linear layers to the full sequence; save only
    the SHARD and all-gather it again in backward (Korthikanti et al. 2022, sec. 4.2.2, end).

    The n layers (q, k, v: Megatron's fused ``linear_qkv``) share one all-gather forward, one
    re-gather and one reduce-scatter of dL/dX backward. Inputs: ``x`` ``[B, S/t, H]``, then
    ``w_0, b_0, w_1, b_1, ...`` (b may be None). Outputs: ``y_i`` ``[B, S, out_i]``.
    Under a split backward (zero-bubble schedules: I, then W) the input gradient and its
    reduce-scatter run only in the pass that wants them, the re-gather and the weight gradients
    only in the other, so each collective runs once.
    """

    @staticmethod
    def forward(ctx, x, group, n, *wb):
        ctx.group, ctx.n = group, n
        ctx.has_bias = [wb[2 * i + 1] is not None for i in range(n)]
        total = all_gather_along_dim(x, SEQUENCE_DIM, group)
        ctx.save_for_backward(x, *wb)
        return tuple(F.linear(total, wb[2 * i], wb[2 * i + 1]) for i in range(n))

    @staticmethod
    def backward(ctx, *grads):
        x, *wb = ctx.saved_tensors
        weights, biases = wb[0::2], wb[1::2]
        need_x = ctx.needs_input_grad[0] and _runs(x)
        need_w = any(_runs(t) for t in wb)
        dx, out = None, []
        if need_w:
            total = all_gather_along_dim(x, SEQUENCE_DIM, ctx.group)   # the extra all-gather
            total2d = total.reshape(-1, total.shape[-1])
        for g, w, b in zip(grads, weights, biases):
            if need_x:
                part = g @ w                                            # dL/dX of this branch
                dx = part if dx is None else dx + part
            if need_w:
                g2d = g.reshape(-1, g.shape[-1])
                out += [g2d.t() @ total2d, g2d.sum(0) if b is not None else None]
            else:
                out += [None, None]
        if need_x:
            dx = reduce_scatter_along_dim(dx, SEQUENCE_DIM, ctx.group)  # sum over ranks, keep my tokens
        return (dx, None, None, *out)


def column_parallel_linears(x: torch.Tensor, layers, group, sequence_parallel: bool = False,
                            regather_in_backward: bool = True, copy_input: bool = True) -> list:
    """Enter a column-parallel region ONCE and apply each of ``layers`` (ColumnParallelLinear,
    sharing the input, like Megatron's fused ``linear_qkv``) to it: ``[Y_r, ...]``.

    TP: ``x`` ``[*, H]`` replicated; ``f`` (skipped with ``copy_input=False``: the caller did it).
    SP: ``x`` ``[B, S/t, H]``, all-gathered along the sequence (``g``); with
    ``regather_in_backward`` only the shard is saved and gathered again in backward.
    Communication: TP backward 1 all-reduce of dL/dX; SP forward 1 all-gather, backward 1
    reduce-scatter (+1 all-gather when re-gathering)."""
    if sequence_parallel and regather_in_backward and tp_size(group) > 1:
        args = [_node(a) for layer in layers for a in (layer.weight, layer.bias)]
        return list(_GatherLinears.apply(_node(x), group, len(layers), *args))
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, group)
    elif copy_input:
        x = copy_to_tensor_model_parallel_region(x, group)
    return [F.linear(x, layer.weight, layer.bias) for layer in layers]


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
            ``linear_qkv``) share ONE backward all-reduce (:func:`column_parallel_linears`).
        sequence_parallel: the input is this rank's sequence block ``[B, S/t, in_features]``,
            all-gathered first (Korthikanti et al. 2022 sec. 4.2.2); ``regather_in_backward``:
            save only the shard and gather it again in backward (True: the paper's choice).

    Input ``[*, in_features]`` (replicated on every rank; SP: ``[B, S/t, in_features]``).
    Output ``[*, out_features / t]`` (SP: ``[B, S, out_features / t]``). Parameters: ``weight``
    ``[out_features / t, in_features]``, ``bias`` ``[out_features / t]``.
    Communication: backward 1 all-reduce of dL/dX (if ``copy_input``); forward 1
    all-gather if ``gather_output``; SP: see :func:`column_parallel_linears`.
    Raises ValueError (construction, no communication) when t does not divide out_features, or
    for ``gather_output`` with ``sequence_parallel`` (Megatron-Core's rule).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True,
                 group=None, copy_input: bool = True, sequence_parallel: bool = False,
                 regather_in_backward: bool = True):
        super().__init__()
        self.group = group
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = divide(out_features, self.t, "ColumnParallelLinear out_features")
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel=True needs gather_output=False "
                             "(the output stays split by columns for a row-parallel layer)")
        self.gather_output, self.copy_input = gather_output, copy_input
        self.sequence_parallel, self.regather_in_backward = bool(sequence_parallel), regather_in_backward
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
        (y,) = column_parallel_linears(x, (self,), self.group, self.sequence_parallel,   # f (or g), then
                                       self.regather_in_backward, self.copy_input)     # Y_r = X W_r + b_r
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (t={self.t}: "
                f"{self.out_per_rank} here), bias={self.bias is not None}, gather_output={self.gather_output}"
                f"{', sequence_parallel=True' if self.sequence_parallel else ''}")


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
        sequence_parallel: reduce-scatter the partial sums along the sequence (``g-bar``) instead
            of all-reducing them: output ``[B, S/t, out_features]``, this rank's tokens; the bias
            is then marked ``sequence_parallel`` (Korthikanti et al. 2022 sec. 4.2.2).

    Output ``[*, out_features]``, replicated (SP: ``[B, S/t, out_features]``). Parameters:
    ``weight`` ``[out_features, in_features / t]``, ``bias`` ``[out_features]``.
    Communication: forward 1 all-reduce of the output (``g``; SP: 1 reduce-scatter, backward 1
    all-gather); backward 1 all-gather of dL/dX only if ``input_is_parallel`` is False.
    Raises ValueError (construction, no communication) when t does not divide in_features, or
    for ``sequence_parallel`` without ``input_is_parallel`` (Megatron-Core's rule).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False,
                 group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = divide(in_features, self.t, "RowParallelLinear in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True")
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, bool(sequence_parallel)
        self.weight = _mark(nn.Parameter(torch.empty(out_features, self.in_per_rank)), 1)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        _init_like_linear(self.weight, self.bias, in_features)
        if self.sequence_parallel:
            mark_sequence_parallel(self.bias)

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
        if self.sequence_parallel:                                       # g-bar: sum, keep my tokens
            y = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            y = reduce_from_tensor_model_parallel_region(partial, self.group)  # g: sum_r X_r W_r
        return y if self.bias is None else y + self.bias                 # + b, once

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (t={self.t}: {self.in_per_rank} here), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}"
                f"{', sequence_parallel=True' if self.sequence_parallel else ''}")


class ParallelMLP(nn.Module):
    """Megatron's MLP block ``Z = Dropout(GeLU(X A) B)`` (sec. 3, Fig. 3a).

    ``fc1`` (A, ``hidden -> ffn_hidden``) is column-parallel, GeLU runs on each rank's
    slice with no communication, ``fc2`` (B) is row-parallel. Input/output ``[B, S, H]``
    replicated. Communication: forward 1 all-reduce (g, ``B*S*H`` elements), backward 1
    all-reduce (f). Raises ValueError when t does not divide ``ffn_hidden``.

    Dropout acts on the replicated output; to match across ranks every TP rank must draw the
    same mask (same RNG state), as in Megatron's replicated-region RNG.

    ``sequence_parallel``: input and output ``[B, S/t, H]`` (all-gather entering fc1,
    reduce-scatter leaving fc2; see :class:`ColumnParallelLinear`, :class:`RowParallelLinear`).
    """

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True, dropout: float = 0.0, group=None,
                 sequence_parallel: bool = False, regather_in_backward: bool = True):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, bias=bias, gather_output=False, group=group,
                                        sequence_parallel=sequence_parallel, regather_in_backward=regather_in_backward)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, bias=bias, input_is_parallel=True, group=group,
                                     sequence_parallel=sequence_parallel)
        self.drop = nn.Dropout(dropout)

    @classmethod
    def from_reference(cls, mlp: nn.Module, group, **kwargs) -> "ParallelMLP":
        """Shard a :class:`labkit.model.MLP` (``fc1`` = A, ``fc2`` = B) onto this rank (``kwargs``:
        ``sequence_parallel``, ``regather_in_backward``)."""
        m = cls(mlp.fc1.in_features, mlp.fc1.out_features, bias=mlp.fc1.bias is not None,
                dropout=mlp.drop.p, group=group, **kwargs)
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
    ``sequence_parallel`` (Megatron-Core's ``reduce_scatter_embeddings``): for ids ``[B, S]`` a
    reduce-scatter along the sequence instead, output ``[B, S/t, D]`` (this rank's tokens);
    backward 1 all-gather of the gradient.
    Raises ValueError at construction when t does not divide ``num_embeddings`` and at
    forward (before the all-reduce) for ids outside ``[0, num_embeddings)``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, bool(sequence_parallel)
        self.t, self.rank = tp_size(group), tp_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.per_rank = divide(num_embeddings, self.t, "VocabParallelEmbedding vocabulary size num_embeddings")
        mine = even_part(num_embeddings, self.t, self.rank)
        self.vocab_start, self.vocab_end = mine.start, mine.stop
        self.weight = _mark(nn.Parameter(torch.empty(self.per_rank, embedding_dim)), 0)
        nn.init.normal_(self.weight)

    @classmethod
    def from_full(cls, embedding: nn.Embedding, group, sequence_parallel: bool = False) -> "VocabParallelEmbedding":
        """Shard a full ``nn.Embedding`` ``[V, D]`` onto this rank."""
        e = cls(embedding.num_embeddings, embedding.embedding_dim, group=group, sequence_parallel=sequence_parallel)
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
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.group)
        return reduce_from_tensor_model_parallel_region(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (t={self.t}: ids "
                f"[{self.vocab_start}, {self.vocab_end}) here)")
