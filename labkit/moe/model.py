"""The MoE variant of the reference GPT.

Same embedding, attention and head as :class:`labkit.model.GPT`; in every
``moe_layer_freq``-th block the MLP is replaced by an MoE layer (GShard, Lepikhin et al.
2020, sec. 2.1: "replace every other FFN layer with an MoE layer"; ``moe_layer_freq=1``: every
block, as in Switch/Mixtral). Block i is MoE when ``i % moe_layer_freq == moe_layer_freq - 1``
(so with 2, the odd blocks 1, 3, ...).

``MoEGPT.forward(idx, targets=None) -> (logits or mean lm loss, [MoEStats per MoE layer])``;
training adds ``total_aux_loss(stats)`` to the loss. Under expert parallelism
(:func:`labkit.moe.expert_parallel.to_expert_parallel`) the same model holds only its local
experts.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from ..model import GPT, Block, Embedding, GPTConfig, Head, init_weights
from .experts import MoEConfig, MoELayer, MoEStats

__all__ = ["MoEBlock", "MoEGPT", "total_aux_loss", "moe_config_for"]


class MoEBlock(Block):
    """Pre-LN block whose MLP is an MoE layer: x + Attn(LN1 x), then x + MoE(LN2 x).
    ``forward(x [B, S, H], mask=None) -> (x, MoEStats)``; ``mask`` [B, S] (1 = real token, 0 =
    padding) goes to the MoE layer (padded tokens count in no balance loss)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig):
        super().__init__(cfg)
        del self.mlp
        self.moe = MoELayer(moe)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        x = x + self.attn(self.ln1(x))
        y, stats = self.moe(self.ln2(x), mask)
        return x + y, stats


def moe_config_for(cfg: GPTConfig, **overrides) -> MoEConfig:
    """An MoEConfig matching a GPTConfig: H = n_embd, expert width ffn_mult * H (each expert the
    size of the dense MLP, as in Switch/Mixtral), GeLU, the GPT's bias setting."""
    base = MoEConfig(n_embd=cfg.n_embd, moe_ffn_dim=cfg.ffn_mult * cfg.n_embd, activation="gelu", bias=cfg.bias)
    return replace(base, **overrides)


class MoEGPT(GPT):
    """GPT with MoE FFNs. ``embedding``, ``blocks`` (Block or MoEBlock), ``head`` as in GPT, and
    GPT's forward (:meth:`labkit.model.GPT.run`). Deterministic from ``seed`` (does not touch the
    global RNG). Its embeddings are never tied.

    ``forward(idx [B, S], targets=None, mask=None)``: ``mask`` [B, S] (1 = real token, 0 =
    padding) keeps padded tokens out of every MoE layer's balance losses and loads; to keep
    them out of the LM loss too, set their ``targets`` to -100 (cross-entropy's ignore_index)."""

    def __init__(self, cfg: GPTConfig, moe: MoEConfig, moe_layer_freq: int = 2, seed: int = 0):
        nn.Module.__init__(self)       # GPT's parts, built here with MoE blocks (GPT.__init__ builds dense ones)
        if moe_layer_freq < 1:
            raise ValueError(f"moe_layer_freq must be >= 1, got {moe_layer_freq}")
        if moe.n_embd != cfg.n_embd:
            raise ValueError(f"MoEConfig.n_embd={moe.n_embd} must equal GPTConfig.n_embd={cfg.n_embd}")
        self.cfg, self.moe_cfg, self.moe_layer_freq = cfg, moe, moe_layer_freq
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embedding = Embedding(cfg)
            self.blocks = nn.ModuleList([
                MoEBlock(cfg, moe) if i % moe_layer_freq == moe_layer_freq - 1 else Block(cfg)
                for i in range(cfg.n_layer)])
            self.head = Head(cfg)
            init_weights(self)
            for m in self.modules():               # init_weights resets Linear layers; the gate too
                if isinstance(m, MoELayer):
                    nn.init.normal_(m.router.weight, std=0.02)
        self.layer_ids = list(range(cfg.n_layer))

    def moe_layers(self) -> list[MoELayer]:
        return [b.moe for b in self.blocks if isinstance(b, MoEBlock)]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        stats: list[MoEStats] = []

        def apply(block, x):
            if not isinstance(block, MoEBlock):
                return block(x)
            x, s = block(x, mask)
            stats.append(s)
            return x
        return self.run(idx, targets, -100, apply), stats


def total_aux_loss(stats: list[MoEStats]) -> torch.Tensor:
    """Sum of the weighted balance losses of all MoE layers (0-d tensor; 0 when none is on)."""
    if not stats:
        return torch.zeros(())
    return torch.stack([s.aux_loss for s in stats]).sum()
