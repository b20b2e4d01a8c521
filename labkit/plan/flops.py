"""FLOPs per training iteration by the papers' definitions, and MFU / HFU.

For a GPT (L layers, hidden h, sequence s, vocabulary V, B sequences per iteration, 4h MLP,
multi-head attention; matrix multiplications only, 2 FLOPs per multiply-add):

* model FLOPs, Korthikanti et al. 2022 eq. 7: ``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``:
  forward ``24 B s h^2 + 4 B s^2 h`` per layer (QKV, output, MLP; Q K^T and the weighted
  sum of V) and ``2 B s h V`` for the logits, times 3 (backward = 2 forwards);
* hardware FLOPs with selective recompute, eq. 8: ``72 B L s h^2 (1 + s/(3h) + V/(12 h L))``
  (the paper counts the attention core's ``12 B L s^2 h`` model FLOPs twice; the recomputed
  forward alone would be a third of that);
* hardware FLOPs with full recompute, Narayanan et al. 2021 eq. 3:
  ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))`` (every layer's forward runs once more; the
  logit layer is not recomputed).

MFU = model FLOPs / (iteration time x GPUs x peak); HFU counts the hardware FLOPs (what the
GPUs really executed, recompute included) instead (Chowdhery et al. 2022, PaLM, app. B;
Korthikanti et al. 2022 sec. 6.3). :func:`layer_forward_flops` generalises the count to
SwiGLU, grouped-query and latent (MLA) attention and MoE layers (k routed + shared experts
and the router), so the eq. 7 / 8 / 3 values are what it gives for a GPT (tests check).
"""
from __future__ import annotations

from .spec import ModelSpec

__all__ = ["korthikanti_model_flops", "korthikanti_selective_flops", "narayanan_full_recompute_flops",
           "layer_forward_flops", "iteration_flops", "mfu", "hfu"]


def korthikanti_model_flops(B: int, L: int, s: int, h: int, V: int) -> float:
    """Model FLOPs of one iteration, Korthikanti et al. 2022 eq. 7 (B sequences)."""
    return 72 * B * L * s * h * h * (1 + s / (6 * h) + V / (12 * h * L))


def korthikanti_selective_flops(B: int, L: int, s: int, h: int, V: int) -> float:
    """Hardware FLOPs with selective recompute, Korthikanti et al. 2022 eq. 8."""
    return 72 * B * L * s * h * h * (1 + s / (3 * h) + V / (12 * h * L))


def narayanan_full_recompute_flops(B: int, L: int, s: int, h: int, V: int) -> float:
    """Hardware FLOPs with full recompute, Narayanan et al. 2021 eq. 3 (l = L layers)."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def layer_forward_flops(spec: ModelSpec, moe: bool) -> tuple[float, float]:
    """(GEMM, attention-core) forward FLOPs of one layer per token: ``2 x`` the weight
    matrices' elements a token passes through (biases and norms left out, as in eq. 7), and
    ``2 s a (d_qk + d_v)`` for Q K^T and the weighted sum of V over the full (not causal)
    s x s scores, as the papers count (``4 s h`` for multi-head attention)."""
    h, a = spec.hidden, spec.n_head
    if spec.is_mla:
        split, _ = spec.attention_params()     # MLA: no biases; every projection is a matrix
        attn = split
        d_qk, d_v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim
    else:
        d = spec.head_dim
        attn = h * (a + 2 * spec.kv_heads) * d + a * d * h
        d_qk = d_v = d
    nmat = 2 if spec.mlp == "gelu" else 3
    if moe:
        mlp = (spec.n_activated_experts + spec.n_shared_experts) * nmat * h * (spec.moe_ffn or spec.ffn_hidden)
        mlp += spec.n_routed_experts * h
    else:
        mlp = nmat * h * spec.ffn_hidden
    return 2.0 * (attn + mlp), 2.0 * spec.seq_len * a * (d_qk + d_v)


def iteration_flops(spec: ModelSpec, sequences: int, recompute: str = "none") -> dict:
    """``{"model": F, "hardware": F_hw}`` of one iteration of ``sequences`` sequences of
    s tokens: model = 3 x forward (layers and logits); hardware adds what ``recompute``
    ("none" | "selective" | "full") runs again, as the papers count it. For a GPT these are
    eq. 7, eq. 8 (selective)
    and Narayanan's eq. 3 (full). Raises ValueError for an unknown ``recompute``."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    tokens = sequences * spec.seq_len
    gemm = core = 0.0
    for i in range(spec.n_layer):
        g, c = layer_forward_flops(spec, spec.is_moe_layer(i))
        gemm, core = gemm + g, core + c
    logits = 2.0 * spec.hidden * spec.vocab_size
    model = 3 * (gemm + core + logits) * tokens
    # eq. 8 counts the attention core twice (s/(3h) for s/(6h)): its 3 passes once more
    extra = {"none": 0.0, "selective": 3 * core, "full": gemm + core}[recompute] * tokens
    return {"model": model, "hardware": model + extra}


def mfu(model_flops: float, seconds: float, n_gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``model_flops / (seconds n_gpus peak_flops)`` (a fraction)."""
    return model_flops / (seconds * n_gpus * peak_flops)


def hfu(hardware_flops: float, seconds: float, n_gpus: int, peak_flops: float) -> float:
    """Hardware FLOPs utilisation: the same with the FLOPs recompute adds."""
    return hardware_flops / (seconds * n_gpus * peak_flops)
