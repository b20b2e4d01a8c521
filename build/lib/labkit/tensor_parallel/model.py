"""The tensor-parallel GPT, built from the reference GPT's full weights.

Every rank of the TP group constructs the same reference :class:`labkit.model.GPT` (same
seed) and keeps only its shard (:meth:`TensorParallelGPT.from_reference`):

* ``embedding.wte``: :class:`VocabParallelEmbedding` (V/t rows here);
  ``embedding.wpe``: replicated position embedding;
* each block: replicated LayerNorms, :class:`ParallelAttention` (h/t heads here),
  :class:`ParallelMLP` (ffn/t columns of A, rows of B here);
* ``head.ln_f`` replicated, ``head.lm_head``: :class:`ColumnParallelLinear` with
  ``gather_output=False`` (this rank's V/t logits), followed by
  :func:`vocab_parallel_cross_entropy`.

Parameter names equal the reference's, so ``gather_full_tensors(model)`` returns a dict
comparable key by key with ``reference.named_parameters()``.

Communication per training step (B*S = N tokens, hidden H, L layers, fp32):
forward ``1 + 2L`` all-reduces of ``N*H`` elements (embedding, then attention and MLP of
each block) and 3 of N (cross-entropy); backward ``2L + 1`` all-reduces of ``N*H``
(f of attention and MLP of each block, f of the output layer). See
:func:`expected_collectives`.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .attention import ParallelAttention
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, ParallelMLP, VocabParallelEmbedding
from .mappings import all_gather_along_dim, tp_size

__all__ = ["TensorParallelGPT", "ParallelBlock", "gather_full_tensors", "expected_collectives"]


class _Embedding(nn.Module):
    def __init__(self, ref, group):
        super().__init__()
        self.block_size = ref.block_size
        self.wte = VocabParallelEmbedding.from_full(ref.wte, group)
        self.wpe = copy.deepcopy(ref.wpe)
        self.drop = copy.deepcopy(ref.drop)

    def forward(self, idx):
        S = idx.shape[1]
        if S > self.block_size:
            raise ValueError(f"sequence length {S} exceeds block_size={self.block_size}")
        return self.drop(self.wte(idx) + self.wpe(torch.arange(S, device=idx.device)))


class ParallelBlock(nn.Module):
    """Pre-LN block ``x + Attn(LN1(x))``, ``x + MLP(LN2(x))`` with TP attention and MLP.
    ``[B, S, H] -> [B, S, H]``; 2 all-reduces forward, 2 backward."""

    def __init__(self, ref, group):
        super().__init__()
        self.ln1 = copy.deepcopy(ref.ln1)
        self.attn = ParallelAttention.from_reference(ref.attn, group)
        self.ln2 = copy.deepcopy(ref.ln2)
        self.mlp = ParallelMLP.from_reference(ref.mlp, group)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _Head(nn.Module):
    def __init__(self, ref, group):
        super().__init__()
        self.ln_f = copy.deepcopy(ref.ln_f)
        self.lm_head = ColumnParallelLinear.from_full(ref.lm_head, group, gather_output=False)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))      # [B, S, V/t]: this rank's vocabulary block


class TensorParallelGPT(nn.Module):
    """Megatron-style tensor-parallel GPT over ``group`` (degree t).

    ``forward(idx, targets=None)``: idx ``[B, S]``; returns this rank's vocab-parallel
    logits ``[B, S, V/t]``, or with ``targets`` ``[B, S]`` the mean cross-entropy (0-d,
    nats per token, identical on every rank and equal to the reference GPT's; targets equal
    to ``ignore_index`` are left out, as in ``F.cross_entropy``).
    Raises ValueError at construction (no communication) when t does not divide V,
    n_head, n_kv_head or the FFN width.
    """

    def __init__(self, reference: nn.Module, group):
        super().__init__()
        cfg = reference.cfg
        self.cfg, self.group = cfg, group
        self.embedding = _Embedding(reference.embedding, group)
        self.blocks = nn.ModuleList([ParallelBlock(b, group) for b in reference.blocks])
        self.head = _Head(reference.head, group)
        if getattr(cfg, "share_embeddings_and_output_weights", False):
            # tied: the vocab-parallel embedding and the column-parallel output layer hold the
            # same V/t rows on this rank, so the shards are one matrix too
            self.head.lm_head.weight = self.embedding.wte.weight

    @classmethod
    def from_reference(cls, gpt: nn.Module, group) -> "TensorParallelGPT":
        """Shard the full reference ``gpt`` (identical on every rank) onto this rank."""
        return cls(gpt, group)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100) -> torch.Tensor:
        if targets is not None:  # checked here, before the first all-reduce (the embedding's)
            V = self.cfg.vocab_size
            bad = (targets != ignore_index) & ((targets < 0) | (targets >= V))
            if bool(bad.any()):
                raise ValueError(f"targets must lie in [0, {V}) or equal ignore_index={ignore_index}; "
                                 f"got {targets[bad][:8].tolist()}")
        x = self.embedding(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if targets is None:
            return logits
        return vocab_parallel_cross_entropy(logits, targets, ignore_index=ignore_index, group=self.group)


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


def expected_collectives(n_layer: int, batch: int, seq: int, hidden: int, bytes_per_element: int = 4) -> dict:
    """The formula: all-reduces one TP training step of :class:`TensorParallelGPT` issues.

    Returns ``{"forward": (count, bytes), "backward": (count, bytes), "step": (count, bytes)}``
    for N = batch*seq tokens: forward ``2L + 1`` all-reduces of ``N*H`` elements plus 3 of
    N (cross-entropy); backward ``2L + 1`` of ``N*H``. Bytes per rank's tensor (payload).
    """
    N = batch * seq
    act = N * hidden * bytes_per_element
    fwd = (2 * n_layer + 1 + 3, (2 * n_layer + 1) * act + 3 * N * bytes_per_element)
    bwd = (2 * n_layer + 1, (2 * n_layer + 1) * act)
    return {"forward": fwd, "backward": bwd, "step": (fwd[0] + bwd[0], fwd[1] + bwd[1])}
