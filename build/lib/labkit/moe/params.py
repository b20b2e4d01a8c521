"""Parameter counting for MoE transformers: total vs. active per token.

The lecture's point: only the FFNs are experts. "Mixtral 8x7B" is not 56B parameters but
about 47B (attention, embeddings and norms are shared by the 8 experts), and a token passes
through 2 of the 8 FFNs, so about 13B parameters are active per token. DeepSeek-V3: 671B
total, about 37B active (256 fine-grained routed experts, 8 active, plus 1 shared).

Counted per layer: attention (GQA projections, or DeepSeek MLA with its low-rank query and
key/value compressions and their RMSNorms), the FFN (dense, or router + routed + shared
experts; SwiGLU has 3 matrices), and two RMSNorms; plus the token embedding, the final norm
and the (untied) output head. Both published configs have no linear biases.
The router's aux-loss-free bias (DeepSeek-V3) is a buffer, counted here as E numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ModelSpec", "ParamCount", "count_parameters", "MIXTRAL_8X7B", "DEEPSEEK_V3"]


@dataclass(frozen=True)
class ModelSpec:
    """A published model configuration (names after the HF / DeepSeek configs).

    ``attention``: "gqa" (n_heads, n_kv_heads, head_dim) or "mla" (q_lora_rank, kv_lora_rank,
    qk_nope_head_dim, qk_rope_head_dim, v_head_dim). FFN: ``n_dense_layers`` first layers use
    a dense FFN of width ``dense_ffn``; the others are MoE with ``n_routed_experts`` of width
    ``moe_ffn``, ``n_activated_experts`` per token and ``n_shared_experts``.
    ``ffn_matrices`` 3 for SwiGLU, 2 for GeLU. ``n_mtp_modules``: DeepSeek-V3 multi-token
    prediction modules (sec. 2.2), counted only with ``include_mtp=True``.
    """

    name: str
    vocab_size: int
    hidden: int
    n_layers: int
    n_heads: int
    attention: str = "gqa"
    n_kv_heads: int = 0
    head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    n_dense_layers: int = 0
    dense_ffn: int = 0
    moe_ffn: int = 0
    n_routed_experts: int = 1
    n_activated_experts: int = 1
    n_shared_experts: int = 0
    ffn_matrices: int = 3
    router_bias: bool = False
    tie_embeddings: bool = False
    n_mtp_modules: int = 0


@dataclass
class ParamCount:
    """``total`` and ``active`` (per token) parameter counts, and a ``breakdown`` dict of totals."""

    total: int
    active: int
    breakdown: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"total {self.total / 1e9:.1f}B, active per token {self.active / 1e9:.1f}B"


def _attention(s: ModelSpec) -> int:
    H = s.hidden
    if s.attention == "gqa":
        q = H * s.n_heads * s.head_dim
        kv = 2 * H * s.n_kv_heads * s.head_dim
        return q + kv + s.n_heads * s.head_dim * H
    if s.attention == "mla":   # DeepSeek-V2 sec. 2.1.2: low-rank joint KV compression, decoupled RoPE
        qk_head = s.qk_nope_head_dim + s.qk_rope_head_dim
        q = H * s.q_lora_rank + s.q_lora_rank + s.q_lora_rank * s.n_heads * qk_head   # W_DQ, norm, W_UQ (+W_QR)
        kv = (H * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank                # W_DKV (+W_KR), norm
              + s.kv_lora_rank * s.n_heads * (s.qk_nope_head_dim + s.v_head_dim))      # W_UK, W_UV
        return q + kv + s.n_heads * s.v_head_dim * H                                    # W_O
    raise ValueError(f"attention must be 'gqa' or 'mla', got {s.attention!r}")


def _layer(s: ModelSpec, moe: bool) -> tuple[int, int]:
    """(total, active) parameters of one transformer layer."""
    H, norms = s.hidden, 2 * s.hidden
    attn = _attention(s)
    if not moe:
        ffn = s.ffn_matrices * H * s.dense_ffn
        return attn + ffn + norms, attn + ffn + norms
    expert = s.ffn_matrices * H * s.moe_ffn
    router = s.n_routed_experts * H + (s.n_routed_experts if s.router_bias else 0)
    shared = s.n_shared_experts * expert
    total = attn + norms + router + shared + s.n_routed_experts * expert
    active = attn + norms + router + shared + s.n_activated_experts * expert
    return total, active


def count_parameters(spec: ModelSpec, include_mtp: bool = False) -> ParamCount:
    """Total and per-token active parameters of ``spec``.

    Active = every shared weight (embedding row lookups counted as the whole embedding matrix,
    as the published figures do) plus k of the E routed experts in each MoE layer.
    ``include_mtp=True`` adds DeepSeek-V3's MTP module(s) as stored in the released checkpoint:
    a projection [H, 2H], two RMSNorms, one MoE layer, and its own copy of embedding and head.
    """
    dense_t, dense_a = _layer(spec, moe=False)
    moe_t, moe_a = _layer(spec, moe=True)
    n_moe = spec.n_layers - spec.n_dense_layers
    embed = spec.vocab_size * spec.hidden
    head = 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden
    final_norm = spec.hidden
    total = spec.n_dense_layers * dense_t + n_moe * moe_t + embed + head + final_norm
    active = spec.n_dense_layers * dense_a + n_moe * moe_a + embed + head + final_norm
    breakdown = {
        "attention": spec.n_layers * _attention(spec),
        "routed experts": n_moe * spec.n_routed_experts * spec.ffn_matrices * spec.hidden * spec.moe_ffn,
        "embedding + head": embed + head,
    }
    if include_mtp and spec.n_mtp_modules:
        mtp = spec.n_mtp_modules * (2 * spec.hidden * spec.hidden + 2 * spec.hidden + moe_t + embed + head + final_norm)
        breakdown["mtp"] = mtp
        total += mtp
    return ParamCount(total, active, breakdown)


# Mixtral 8x7B (Jiang et al. 2024; HF config): SwiGLU experts, GQA 32 heads / 8 KV heads.
MIXTRAL_8X7B = ModelSpec(
    name="Mixtral 8x7B", vocab_size=32000, hidden=4096, n_layers=32, n_heads=32, attention="gqa",
    n_kv_heads=8, head_dim=128, moe_ffn=14336, n_routed_experts=8, n_activated_experts=2)

# DeepSeek-V3 (DeepSeek-AI 2024, sec. 4.2 / config): 61 layers, first 3 dense, MLA, 256 routed + 1 shared.
DEEPSEEK_V3 = ModelSpec(
    name="DeepSeek-V3", vocab_size=129280, hidden=7168, n_layers=61, n_heads=128, attention="mla",
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_dense_layers=3, dense_ffn=18432, moe_ffn=2048, n_routed_experts=256, n_activated_experts=8,
    n_shared_experts=1, router_bias=True, n_mtp_modules=1)
