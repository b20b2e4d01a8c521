"""Sequence parallelism and selective activation recomputation for the tensor-parallel layer.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models".

Tensor parallelism (Megatron-LM) splits attention and the MLP over the t ranks, but the
LayerNorms, the dropouts and the residual adds run on the whole ``[B, S, H]`` activation on
every rank: sec. 4.2.1 counts ``10 sbh`` bytes per layer (16-bit) that do not shrink with t.
Those operations act on each token independently, so sec. 4.2.2 splits them along the
SEQUENCE instead (Fig. 5). A layer's input is then this rank's block of tokens
``[B, S/t, H]``, and the two conjugate operators change:

* entering attention or the MLP, ``g`` = :func:`gather_from_sequence_parallel_region`
  all-gathers the sequence blocks (backward: reduce-scatter of dL/dX), replacing ``f``;
* leaving them, ``g-bar`` = :func:`reduce_scatter_to_sequence_parallel_region` sums the
  row-parallel partial outputs and keeps this rank's tokens (backward: all-gather),
  replacing the all-reduce ``g``.

A ring all-reduce is a reduce-scatter followed by an all-gather, so the bytes sent are the
same as with plain TP (tested exactly). The LayerNorm weights (and the biases added after
the reduce-scatter) now see only S/t tokens on each rank: their gradients are partial sums
and must be all-reduced over the TP group after backward (:func:`allreduce_layernorm_grads`,
Megatron-Core's ``_allreduce_layernorm_grads`` in ``finalize_model_grads``).

Storing the all-gathered input of a column-parallel layer would keep a full ``[B, S, H]``
tensor; the paper (sec. 4.2.2, end) stores only the shard and all-gathers it again in
backward. :class:`ParallelTransformerLayer` does that by default (``regather_in_backward``),
which costs one extra all-gather per column-parallel input in backward.

Selective recomputation (sec. 5): the attention core ``softmax(QK^T/sqrt(d)) V`` with its
dropout holds ``5 a s^2 b`` bytes (16-bit) but costs few FLOPs; checkpoint only it and
keep everything else (``recompute_granularity="selective"``). ``"full"`` checkpoints the
whole layer (keeps its input, recomputes all of it). Names follow Megatron-Core
(``config.sequence_parallel``, ``config.recompute_granularity``).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..checkpoint import checkpoint
from ..model import causal_attention
from .attention import ParallelAttention
from .layers import ParallelMLP
from .mappings import (SEQUENCE_DIM, all_gather_along_dim, copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_along_dim, reduce_scatter_to_sequence_parallel_region, tp_size)

__all__ = ["ParallelTransformerLayer", "allreduce_layernorm_grads", "measure_activation_bytes",
           "RECOMPUTE_GRANULARITIES"]

RECOMPUTE_GRANULARITIES = (None, "selective", "full")


class _GatherLinears(torch.autograd.Function):
    """All-gather a sequence shard, then apply n linear layers to the full sequence; save only
    the SHARD and all-gather it again in backward (Korthikanti et al. 2022, sec. 4.2.2, end).

    The n layers (q, k, v: Megatron's fused ``linear_qkv``) share one all-gather forward, one
    re-gather and one reduce-scatter of dL/dX backward. Inputs: ``x`` ``[B, S/t, H]``, then
    ``w_0, b_0, w_1, b_1, ...`` (b may be None). Outputs: ``y_i`` ``[B, S, out_i]``.
    """

    @staticmethod
    def forward(ctx, x, group, n, *wb):
        ctx.group, ctx.n = group, n
        ctx.has_bias = [wb[2 * i + 1] is not None for i in range(n)]
        total = all_gather_along_dim(x, SEQUENCE_DIM, group)
        ctx.save_for_backward(x, *wb[0::2])
        return tuple(F.linear(total, wb[2 * i], wb[2 * i + 1]) for i in range(n))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        total = all_gather_along_dim(x, SEQUENCE_DIM, ctx.group)   # the extra all-gather
        total2d = total.reshape(-1, total.shape[-1])
        dx = None
        out = []
        for g, w, has_b in zip(grads, weights, ctx.has_bias):
            g2d = g.reshape(-1, g.shape[-1])
            part = g @ w                                            # dL/dX of this branch
            dx = part if dx is None else dx + part
            out += [g2d.t() @ total2d, g2d.sum(0) if has_b else None]
        dx = reduce_scatter_along_dim(dx, SEQUENCE_DIM, ctx.group)  # sum over ranks, keep my tokens
        return (dx, None, None, *out)


class ParallelTransformerLayer(nn.Module):
    """One pre-LN GPT layer ``x + Attn(LN1(x))``, ``x + MLP(LN2(x))`` with tensor parallelism,
    optional sequence parallelism and optional activation recomputation.

    Args:
        reference: a :class:`labkit.model.Block` (the same on every rank); this rank keeps
            its shard (heads ``h/t``, FFN columns ``ffn/t``); parameter names equal the
            reference's, so :func:`labkit.tensor_parallel.gather_full_tensors` rebuilds them.
        group: the tensor-parallel process group (degree t).
        sequence_parallel: False: input/output ``[B, S, H]`` replicated (Megatron-LM TP, the
            same arithmetic as :class:`labkit.tensor_parallel.ParallelBlock`); True: input and
            output are this rank's block of tokens ``[B, S/t, H]`` (rank r holds tokens
            ``[r S/t, (r+1) S/t)``); call :func:`allreduce_layernorm_grads` after backward.
        recompute_granularity: None (save everything), "selective" (recompute the attention
            core: QK^T, mask, softmax, dropout, the weighted sum of V; sec. 5) or "full"
            (checkpoint the whole layer, keep only its input).
        regather_in_backward: with sequence parallelism, save only the input shard of the
            column-parallel layers and all-gather it again in backward (True, the paper's and
            Megatron's choice: activations ``34 sbh / t``), or save the gathered input (False:
            no extra communication, ``2 sbh`` more per column-parallel input).

    Communication per layer, N = B*S tokens, payload bytes of this rank's tensors:
    TP: forward 2 all-reduces of N*H, backward 2 (f). TP+SP: forward 2 all-gathers (N*H/t)
    and 2 reduce-scatters (N*H), backward the same again, plus 2 re-gathers (N*H/t) when
    ``regather_in_backward``; the LayerNorm gradient all-reduce comes after.
    Raises ValueError at construction for an unknown ``recompute_granularity`` or a t that
    does not divide the heads or FFN width, and in forward when t does not divide S.

    Dropout in the sequence-parallel regions acts on each rank's own tokens with its own RNG
    (Megatron forks a separate RNG stream for them): with dropout > 0 the masks differ from a
    single-device run's. Equality tests use dropout 0.
    """

    def __init__(self, reference: nn.Module, group, sequence_parallel: bool = False,
                 recompute_granularity: str | None = None, regather_in_backward: bool = True):
        super().__init__()
        if recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, "
                             f"got {recompute_granularity!r}")
        self.group, self.t = group, tp_size(group)
        self.sequence_parallel = bool(sequence_parallel)
        self.recompute_granularity = recompute_granularity
        self.regather_in_backward = regather_in_backward
        self.ln1 = copy.deepcopy(reference.ln1)
        self.attn = ParallelAttention.from_reference(reference.attn, group)
        self.ln2 = copy.deepcopy(reference.ln2)
        self.mlp = ParallelMLP.from_reference(reference.mlp, group)
        self.to(reference.ln1.weight.dtype)          # the shards are built in fp32; match a bf16 reference
        if self.sequence_parallel:
            # Parameters that see only this rank's tokens: Megatron marks them
            # ``sequence_parallel`` and all-reduces their gradients over the TP group.
            for p in (*self.ln1.parameters(), *self.ln2.parameters(),
                      self.attn.out_proj.bias, self.mlp.fc2.bias):
                if p is not None:
                    p.sequence_parallel = True

    # -- entering and leaving a tensor-parallel region --------------------------------------
    def _column(self, h: torch.Tensor, layers) -> list:
        """Apply column-parallel ``layers`` (sharing one input) after f (TP) or g (SP)."""
        if self.sequence_parallel and self.regather_in_backward and self.t > 1:
            args = [a for layer in layers for a in (layer.weight, layer.bias)]
            return list(_GatherLinears.apply(h, self.group, len(layers), *args))
        if self.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, self.group)    # g: all-gather the tokens
        else:
            h = copy_to_tensor_model_parallel_region(h, self.group)    # f: identity / all-reduce
        return [F.linear(h, layer.weight, layer.bias) for layer in layers]

    def _row(self, y: torch.Tensor, layer) -> torch.Tensor:
        """Row-parallel ``layer``: partial product, then g-bar (SP) or g (TP), then the bias once."""
        partial = F.linear(y, layer.weight)
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            out = reduce_from_tensor_model_parallel_region(partial, self.group)
        return out if layer.bias is None else out + layer.bias

    # -- the two sublayers ---------------------------------------------------------------------
    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        a = self.attn
        q, k, v = self._column(h, (a.q_proj, a.k_proj, a.v_proj))
        B, S, _ = q.shape
        d = a.head_dim
        q = q.view(B, S, a.n_head_local, d).transpose(1, 2)
        k = k.view(B, S, a.n_kv_head_local, d).transpose(1, 2)
        v = v.view(B, S, a.n_kv_head_local, d).transpose(1, 2)
        if self.recompute_granularity == "selective":
            # keep q, k, v; recompute the s^2 part (scores, softmax, dropout, weighted sum)
            y = checkpoint(causal_attention, q, k, v, a.attn_drop)
        else:
            y = causal_attention(q, k, v, a.attn_drop)
        y = y.transpose(1, 2).reshape(B, S, a.n_head_local * d)
        return a.resid_drop(self._row(y, a.out_proj))

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        (u,) = self._column(h, (m.fc1,))
        return m.drop(self._row(F.gelu(u), m.fc2))

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln1(x))
        return x + self._mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_granularity == "full":
            return checkpoint(self._layer, x)
        return self._layer(x)

    def extra_repr(self) -> str:
        return (f"t={self.t}, sequence_parallel={self.sequence_parallel}, "
                f"recompute_granularity={self.recompute_granularity!r}")


@torch.no_grad()
def allreduce_layernorm_grads(model: nn.Module, group) -> int:
    """Sum over the TP group the gradients of every parameter marked ``sequence_parallel``
    (LayerNorm weights and biases, row-parallel biases of sequence-parallel layers): each rank
    saw only its S/t tokens, so its gradient is a partial sum (Korthikanti et al. 2022,
    sec. 4.2.2; Megatron-Core ``finalize_model_grads``).

    The gradients are packed into ONE buffer and all-reduced once (like Megatron's coalesced
    reduction). Returns the number of elements reduced (0: nothing to do, no communication).
    Collective: every rank of ``group`` must call it, with the same model structure.
    """
    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_size(group) == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat.numel()


def measure_activation_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of tensors ``module(*inputs)`` saves for backward, on this rank, measured with
    ``torch.autograd.graph.saved_tensors_hooks`` (:class:`labkit.checkpoint.SavedTensorMeter`;
    parameters excluded, tensors sharing storage counted once, the inputs included when saved).

    Runs one forward (training mode as set), counts what is alive after it, then drops the
    graph without a backward. Collective when ``module`` communicates (every TP rank calls it).
    Compare with :func:`labkit.plan.layer_activation_bytes`.
    """
    from ..checkpoint import SavedTensorMeter

    with SavedTensorMeter(exclude=list(module.parameters())) as meter:
        out = module(*inputs)
        live = meter.live
    del out
    return live
