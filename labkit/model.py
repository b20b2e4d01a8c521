"""The single-device reference GPT that every parallel version is compared with.

A decoder-only transformer as in GPT-2 (Radford et al. 2019) with pre-LayerNorm blocks:

    x = tok_emb[idx] + pos_emb[0:S]                  # [B, S, H]
    for each block:  x = x + Attn(LN1(x));  x = x + MLP(LN2(x))
    logits = LN_f(x) @ W_out^T                       # [B, S, V]

``MLP(x) = GeLU(x A) B`` with A: H -> 4H and B: 4H -> H, the two matrices Megatron-LM
splits by columns and rows (Shoeybi et al. 2019, sec. 3). Attention keeps separate query,
key and value projections so that the tensor-parallel version can split each by heads;
``n_kv_head < n_head`` gives grouped-query attention (each K/V head serves
``n_head // n_kv_head`` query heads).

The model is three parts, ``embedding``, ``blocks`` and ``head``, and either end may be absent
(as in torchtitan's model): :meth:`GPT.slice` keeps some blocks, and the embedding only on the
first pipeline stage and the head only on the last, so one forward (embedding -> blocks ->
head) serves the whole model, a pipeline stage and, with its parts replaced by
:func:`labkit.tensor_parallel.parallelize`, the tensor-parallel model. Construction is
deterministic from ``seed``.
"""
from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .data import VOCAB_SIZE


@dataclass
class GPTConfig:
    """Sizes: ``vocab_size`` V, ``block_size`` (longest sequence S), ``n_layer`` L,
    ``n_head`` heads, ``n_kv_head`` key/value heads (None: = n_head), ``n_embd`` H,
    ``ffn_mult`` (FFN width = ffn_mult * H), ``dropout`` probability, ``bias``;
    ``share_embeddings_and_output_weights`` (Megatron-Core's name; "weight tying", Press & Wolf
    2017): the output projection uses the input embedding matrix ``wte`` [V, H]."""

    vocab_size: int = VOCAB_SIZE
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 64
    ffn_mult: int = 4
    dropout: float = 0.0
    bias: bool = True
    share_embeddings_and_output_weights: bool = False

    def __post_init__(self):
        """Raises ValueError naming the field, its value and the rule: every size an integer
        >= 1 (``n_kv_head`` too, once defaulted), ``n_embd % n_head == 0``, ``n_head % n_kv_head
        == 0``, ``0 <= dropout < 1``. Sizes are checked before they are divided by."""
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_mult"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if not (isinstance(self.dropout, numbers.Real) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"dropout must be a probability in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dropout: nn.Module | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v for q: [B, h, S, d], k, v: [B, h_kv, S, d].

    With h_kv < h each K/V head is repeated for its h / h_kv query heads (GQA).
    Returns [B, h, S, d]. Written out (not a fused kernel) so each head's arithmetic is
    the same whether all heads sit on one device or are split across ranks.
    """
    h, h_kv = q.shape[1], k.shape[1]
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=1)
        v = v.repeat_interleave(h // h_kv, dim=1)
    S = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if dropout is not None:
        att = dropout(att)
    return att @ v


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Input and output [B, S, H]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=cfg.bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.core = None   # None: causal_attention; context parallelism sets its (q, k, v) -> y here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        y = causal_attention(q, k, v, self.attn_drop) if self.core is None else self.core(q, k, v)
        y = y.transpose(1, 2).reshape(B, S, self.n_head * self.head_dim)
        return self.resid_drop(self.out_proj(y))


class MLP(nn.Module):
    """GeLU(x A) B: ``fc1`` is A (H -> ffn_mult*H), ``fc2`` is B. Input/output [B, S, H]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.n_embd, cfg.ffn_mult * cfg.n_embd, bias=cfg.bias)
        self.fc2 = nn.Linear(cfg.ffn_mult * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + Attn(LN(x)), then x + MLP(LN(x)). [B, S, H] -> [B, S, H]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embedding(nn.Module):
    """Token + learned position embedding. idx [B, S] (long) -> [B, S, H]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.block_size = cfg.block_size
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.positions = None   # None: 0..S-1; context parallelism sets the positions this rank holds

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        S = idx.shape[1]
        if S > self.block_size:
            raise ValueError(f"sequence length {S} exceeds block_size={self.block_size}")
        pos = torch.arange(S, device=idx.device) if self.positions is None else self.positions.to(idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))


def check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise ValueError naming the first bad ids unless every target lies in ``[0, V)`` or equals
    ``ignore_index`` (checked before any communication, so every rank fails alike)."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab_size))
    if bool(bad.any()):
        raise ValueError(f"targets must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
                         f"got {targets[bad][:8].tolist()}")


class Head(nn.Module):
    """Final LayerNorm and output projection. [B, S, H] -> logits [B, S, V]; :meth:`loss` is the
    mean next-token cross-entropy of those logits (the tensor-parallel head has its own)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
             reduction: str = "mean") -> torch.Tensor:
        return lm_loss(logits, targets, ignore_index, reduction)


def init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class GPT(nn.Module):
    """The reference GPT: ``embedding`` -> ``blocks`` (L of them) -> ``head``.

    ``forward(idx, targets=None, ignore_index=-100)``: idx [B, S] long token ids; returns logits
    [B, S, V], or the mean cross-entropy (a 0-d tensor, nats per token; targets equal to
    ``ignore_index`` left out) when ``targets`` [B, S] is given. ``seed`` makes the initial
    weights reproducible without touching the global RNG.

    A slice (:meth:`slice`, :meth:`from_parts`) may lack the embedding (its input is then the
    hidden states [B, S, H]) or the head (it returns hidden states); ``layer_ids`` are the global
    indices of its blocks, so its parameter ``blocks.i.x`` is the full model's
    ``blocks.<layer_ids[i]>.x`` (:meth:`reference_name`).
    """

    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embedding = Embedding(cfg)
            self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
            self.head = Head(cfg)
            init_weights(self)
            self.tie_weights()
        self.layer_ids = list(range(cfg.n_layer))

    def tie_weights(self) -> None:
        """With ``share_embeddings_and_output_weights`` and both ends held: one matrix,
        logits = LN_f(x) @ wte^T (the output layer uses the embedding's weight)."""
        if self.cfg.share_embeddings_and_output_weights and self.embedding is not None and self.head is not None:
            self.head.lm_head.weight = self.embedding.wte.weight

    @classmethod
    def from_parts(cls, cfg: GPTConfig, embedding: nn.Module | None, blocks, head: nn.Module | None,
                   layer_ids=None) -> "GPT":
        """A GPT made of the given modules (no copy, no initialisation): ``embedding`` and
        ``head`` may be None; ``layer_ids`` (default 0..len(blocks)-1) name the blocks' global
        indices. Raises ValueError when their number differs from the blocks'."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model.cfg, model.embedding, model.blocks, model.head = cfg, embedding, nn.ModuleList(blocks), head
        model.layer_ids = list(range(len(model.blocks)) if layer_ids is None else layer_ids)
        model.tie_weights()
        if len(model.layer_ids) != len(model.blocks):
            raise ValueError(f"layer_ids {model.layer_ids} name {len(model.layer_ids)} blocks, "
                             f"got {len(model.blocks)} blocks")
        return model

    def slice(self, layer_ids, embedding: bool, head: bool) -> "GPT":
        """Deep copies of the blocks ``layer_ids`` (global indices of this model), with the
        embedding and/or the head when asked: a pipeline stage. A matrix the embedding and the
        head share (tied) stays shared in a slice holding both."""
        local = {g: i for i, g in enumerate(self.layer_ids)}
        missing = [j for j in layer_ids if j not in local]
        if missing or (embedding and self.embedding is None) or (head and self.head is None):
            raise ValueError(f"cannot slice blocks {list(layer_ids)}, embedding={embedding}, head={head} out of a "
                             f"GPT holding blocks {self.layer_ids}, embedding={self.embedding is not None}, "
                             f"head={self.head is not None}")
        emb, hd = copy.deepcopy((self.embedding if embedding else None, self.head if head else None))
        return type(self).from_parts(self.cfg, emb, [copy.deepcopy(self.blocks[local[j]]) for j in layer_ids],
                                     hd, layer_ids)

    def reference_name(self, name: str) -> str:
        """The full model's name of this slice's parameter ``name`` (``blocks.i.x`` -> ``blocks.<global>.x``)."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{self.layer_ids[int(i)]}.{rest}"
        return name

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                ignore_index: int = -100) -> torch.Tensor:
        return self.run(idx, targets, ignore_index, lambda block, x: block(x))

    def run(self, idx: torch.Tensor, targets: torch.Tensor | None, ignore_index: int, apply) -> torch.Tensor:
        """The one forward of the GPT family: embedding -> every block through ``apply(block, x) -> x``
        -> head (and the loss when ``targets`` are given). :class:`labkit.moe.MoEGPT` passes an
        ``apply`` that also collects its MoE blocks' statistics. Raises ValueError for targets on a
        slice without the head, or targets outside the vocabulary."""
        if targets is not None:
            if self.head is None:
                raise ValueError("targets were given to a GPT slice without the head (only the last "
                                 "pipeline stage computes the loss)")
            check_targets(targets, self.cfg.vocab_size, ignore_index)   # before any communication
        x = idx if self.embedding is None else self.embedding(idx)
        for block in self.blocks:
            x = apply(block, x)
        if self.head is None:
            return x
        logits = self.head(x)
        return logits if targets is None else self.head.loss(logits, targets, ignore_index)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
            reduction: str = "mean") -> torch.Tensor:
    """Mean next-token cross-entropy: logits [B, S, V], targets [B, S] -> 0-d tensor (nats);
    targets equal to ``ignore_index`` are left out (``F.cross_entropy``'s rule: NaN when every
    target is ignored). ``reduction="sum"``: the sum over the valid targets (0 when none), what a
    piece of a parallel step needs (:mod:`labkit.parallel.loss`)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
