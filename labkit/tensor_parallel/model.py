"""The tensor-parallel GPT: the reference GPT with its parts replaced by :func:`gpt_plan`.

Every rank of the TP group constructs the same reference :class:`labkit.model.GPT` (same
seed) and keeps only its shard (:meth:`TensorParallelGPT.from_reference`, which applies
:func:`labkit.tensor_parallel.parallelize` with :func:`gpt_plan`; the forward is the reference
GPT's own, embedding -> blocks -> head):

* ``embedding.wte``: :class:`VocabParallelEmbedding` (V/t rows here);
  ``embedding.wpe``: replicated position embedding;
* each block: replicated LayerNorms, :class:`ParallelAttention` (h/t heads here),
  :class:`ParallelMLP` (ffn/t columns of A, rows of B here);
* ``head.ln_f`` replicated, ``head.lm_head``: :class:`ColumnParallelLinear` with
  ``gather_output=False`` (this rank's V/t logits), followed by
  :func:`vocab_parallel_cross_entropy`.

With ``sequence_parallel`` (Korthikanti et al. 2022 sec. 4.2.2) the embedding reduce-scatters
its lookup along the sequence and adds this rank's positions, every block's input and output is
``[B, S/t, H]``, the head all-gathers before the output layer; the parameters marked
``sequence_parallel`` (LayerNorms, row-parallel biases, the position embedding) need
:func:`labkit.tensor_parallel.allreduce_layernorm_grads` after backward. ``recompute``
("none" | "selective" | "full", Megatron-Core's ``recompute_granularity``) is each block's.

Parameter names equal the reference's, so ``gather_full_tensors(model)`` returns a dict
comparable key by key with ``reference.named_parameters()``.

Communication per training step (B*S = N tokens, hidden H, L layers, fp32):
forward ``1 + 2L`` all-reduces of ``N*H`` elements (embedding, then attention and MLP of
each block) and 3 of N (cross-entropy); backward ``2L + 1`` all-reduces of ``N*H``
(f of attention and MLP of each block, f of the output layer): the planner's
:func:`labkit.plan.comm.tp_comm`.
"""
from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn as nn

from ..checkpoint import checkpoint
from ..model import GPT
from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelMLP, VocabParallelEmbedding, mark_sequence_parallel
from .mappings import all_gather_along_dim, tp_rank, tp_size
from .parallelize import parallelize

__all__ = ["TensorParallelGPT", "ParallelEmbedding", "ParallelBlock", "ParallelHead", "ParallelTransformerLayer",
           "gpt_plan", "gather_full_tensors", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "full")


class ParallelEmbedding(nn.Module):
    """Token embedding split by vocabulary (:class:`VocabParallelEmbedding`) + replicated position
    embedding. ``ids [B, S] -> [B, S, H]`` replicated (one all-reduce), or with
    ``sequence_parallel`` this rank's tokens ``[B, S/t, H]`` (one reduce-scatter; positions
    ``r S/t .. (r+1) S/t - 1`` added here, so ``wpe`` is marked ``sequence_parallel``).
    Raises ValueError for S > block_size, or (SP) S not divisible by t, before communicating."""

    def __init__(self, ref: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        self.block_size, self.group = ref.block_size, group
        self.sequence_parallel = bool(sequence_parallel) and tp_size(group) > 1
        self.wte = VocabParallelEmbedding.from_full(ref.wte, group, sequence_parallel=self.sequence_parallel)
        self.wpe = copy.deepcopy(ref.wpe)
        self.positions = None   # None: 0..S-1 (or this TP rank's S/t under SP); context parallelism sets its own
        self.drop = copy.deepcopy(ref.drop)
        if self.sequence_parallel:
            mark_sequence_parallel(self.wpe.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        S = idx.shape[1]
        if S > self.block_size:
            raise ValueError(f"sequence length {S} exceeds block_size={self.block_size}")
        # context parallelism: this CP rank's S global positions (else 0..S-1); SP keeps its TP rank's S/t
        pos = self.positions.to(idx.device) if self.positions is not None else torch.arange(S, device=idx.device)
        if self.sequence_parallel:
            t = tp_size(self.group)
            if S % t:
                raise ValueError(f"sequence parallelism needs the sequence length S={S} divisible by t={t}")
            start = tp_rank(self.group) * (S // t)
            pos = pos[start:start + S // t]
        return self.drop(self.wte(idx) + self.wpe(pos))


class ParallelBlock(nn.Module):
    """Pre-LN block ``x + Attn(LN1(x))``, ``x + MLP(LN2(x))`` with Megatron's TP attention and MLP,
    optionally sequence parallel, optionally recomputed (Korthikanti et al. 2022).

    Args:
        ref: a :class:`labkit.model.Block` (the same on every rank); this rank keeps its shard
            (heads ``h/t``, FFN columns ``ffn/t``); parameter names equal the reference's.
        group: the tensor-parallel process group (degree t).
        sequence_parallel: False: input/output ``[B, S, H]`` replicated; True: this rank's block
            of tokens ``[B, S/t, H]``; call :func:`labkit.tensor_parallel.allreduce_layernorm_grads`
            after backward.
        recompute: "none" (save everything), "selective" (recompute the attention core: QK^T,
            mask, softmax, dropout, the weighted sum of V; sec. 5) or "full" (checkpoint the whole
            block, keep only its input). ``recompute_granularity``: Megatron-Core's spelling
            (None | "selective" | "full"), used when given.
        regather_in_backward: under SP, save only the input shard of the column-parallel layers
            and all-gather it again in backward (True, the paper's and Megatron's choice:
            activations ``34 sbh / t``), or save the gathered input (False).

    Communication per block, N = B*S tokens, payload bytes of this rank's tensors:
    TP: forward 2 all-reduces of N*H, backward 2 (f). TP+SP: forward 2 all-gathers (N*H/t)
    and 2 reduce-scatters (N*H), backward the same again, plus 2 re-gathers (N*H/t) when
    ``regather_in_backward``; "full" repeats the forward's in backward.
    Raises ValueError at construction for an unknown ``recompute`` or a t that does not divide
    the heads or FFN width, and in forward when t does not divide S.

    Dropout in the sequence-parallel regions acts on each rank's own tokens with its own RNG
    (Megatron forks a separate RNG stream for them): with dropout > 0 the masks differ from a
    single-device run's. Equality tests use dropout 0.
    """

    def __init__(self, ref: nn.Module, group, sequence_parallel: bool = False, recompute: str | None = "none",
                 regather_in_backward: bool = True, recompute_granularity: str | None = None):
        super().__init__()
        which = "recompute"
        if recompute_granularity is not None:
            recompute, which = recompute_granularity, "recompute_granularity"
        recompute = "none" if recompute is None else recompute
        if recompute not in RECOMPUTE:
            raise ValueError(f"{which} must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
        self.group, self.t = group, tp_size(group)
        self.sequence_parallel, self.recompute = bool(sequence_parallel), recompute
        kw = {"sequence_parallel": self.sequence_parallel, "regather_in_backward": regather_in_backward}
        self.ln1 = copy.deepcopy(ref.ln1)
        self.attn = ParallelAttention.from_reference(ref.attn, group, recompute_core=recompute == "selective", **kw)
        self.ln2 = copy.deepcopy(ref.ln2)
        self.mlp = ParallelMLP.from_reference(ref.mlp, group, **kw)
        self.to(ref.ln1.weight.dtype)          # the shards are built in fp32; match a bf16 reference
        if self.sequence_parallel:
            # Parameters that see only this rank's tokens (the row-parallel biases are marked by
            # their layers): Megatron all-reduces their gradients over the TP group.
            mark_sequence_parallel(*self.ln1.parameters(), *self.ln2.parameters())

    @property
    def recompute_granularity(self) -> str | None:
        """Megatron-Core's name: None, "selective" or "full"."""
        return None if self.recompute == "none" else self.recompute

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full":
            return checkpoint(self._block, x)
        return self._block(x)

    def extra_repr(self) -> str:
        return f"t={self.t}, sequence_parallel={self.sequence_parallel}, recompute={self.recompute!r}"


ParallelTransformerLayer = ParallelBlock   # the former name (one block class serves TP and TP+SP)


class ParallelHead(nn.Module):
    """Final LayerNorm (replicated; under SP on this rank's tokens, marked ``sequence_parallel``)
    and the column-parallel output layer (``gather_output=False``): ``[B, S, H]`` (SP:
    ``[B, S/t, H]``, all-gathered first) -> this rank's vocabulary block of the logits
    ``[B, S, V/t]``. :meth:`loss` is :func:`vocab_parallel_cross_entropy` over the group."""

    def __init__(self, ref: nn.Module, group, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        sp = bool(sequence_parallel) and tp_size(group) > 1
        self.ln_f = copy.deepcopy(ref.ln_f)
        self.lm_head = ColumnParallelLinear.from_full(ref.lm_head, group, gather_output=False, sequence_parallel=sp)
        self.vocab_size = ref.lm_head.weight.shape[0]     # V: the loss refuses logits that are not V/t wide
        if sp:
            mark_sequence_parallel(*self.ln_f.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))      # [B, S, V/t]: this rank's vocabulary block

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, ignore_index=ignore_index, group=self.group,
                                            reduction=reduction, vocab_size=self.vocab_size)


def gpt_plan(sequence_parallel: bool = False, recompute: str = "none") -> dict:
    """The GPT's split rules (Megatron-LM sec. 3; Korthikanti et al. 2022 sec. 4-5) as a plan
    table for :func:`labkit.tensor_parallel.parallelize`: module name -> rule(module, group)."""
    return {
        "embedding": partial(ParallelEmbedding, sequence_parallel=sequence_parallel),
        "blocks.*": partial(ParallelBlock, sequence_parallel=sequence_parallel, recompute=recompute),
        "head": partial(ParallelHead, sequence_parallel=sequence_parallel),
    }


class TensorParallelGPT(GPT):
    """Megatron-style tensor-parallel GPT over ``group`` (degree t): the reference GPT's forward
    on the parts :func:`gpt_plan` builds.

    ``forward(idx, targets=None, ignore_index=-100)``: idx ``[B, S]``; returns this rank's
    vocab-parallel logits ``[B, S, V/t]``, or with ``targets`` ``[B, S]`` the mean cross-entropy
    (0-d, nats per token, identical on every rank and equal to the reference GPT's; targets equal
    to ``ignore_index`` are left out, as in ``F.cross_entropy``). ``sequence_parallel`` and
    ``recompute`` as in :class:`ParallelBlock`. ``reference`` is not modified.
    Raises ValueError at construction (no communication) when t does not divide V,
    n_head, n_kv_head or the FFN width.
    """

    def __init__(self, reference: GPT, group, sequence_parallel: bool = False, recompute: str = "none"):
        nn.Module.__init__(self)
        self.cfg, self.group, self.layer_ids = reference.cfg, group, list(reference.layer_ids)
        self.embedding, self.blocks, self.head = reference.embedding, nn.ModuleList(reference.blocks), reference.head
        parallelize(self, group, gpt_plan(sequence_parallel, recompute))

    @classmethod
    def from_reference(cls, gpt: GPT, group, **kwargs) -> "TensorParallelGPT":
        """Shard the full reference ``gpt`` (identical on every rank) onto this rank."""
        return cls(gpt, group, **kwargs)


@torch.no_grad()
def gather_full_tensors(model: nn.Module, group, what: str = "grad") -> dict:
    """Rebuild full-shape tensors from the shards: ``{name: tensor}`` for every parameter.

    ``what``: "grad" (parameter gradients; None stays None) or "param" (the weights).
    Sharded parameters (attribute ``tensor_model_parallel``) are all-gathered along their
    ``partition_dim`` (one all-gather each); replicated ones are returned as they are.
    Collective: every rank of ``group`` must call it.
    """
    if what not in ("grad", "param"):
        raise ValueError(f"what must be 'grad' or 'param', got {what!r}")
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p.detach()
        if t is None:
            out[name] = None
        elif getattr(p, "tensor_model_parallel", False) and tp_size(group) > 1:
            out[name] = all_gather_along_dim(t, p.partition_dim, group)
        else:
            out[name] = t.clone()
    return out
