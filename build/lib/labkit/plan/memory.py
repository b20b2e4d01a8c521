"""Bytes per GPU for a model and a layout: parameters, gradients, optimizer state, activations.

Model states (Rajbhandari et al. 2020, "ZeRO", sec. 3.1): with Adam and mixed precision
every parameter costs 2 bytes (bf16 weights) + 2 (bf16 gradients) + K = 12 (fp32 master
weights, first and second moments); in fp32 training 4 + 4 + 8. ZeRO stage 1 divides the
optimizer state by the DP degree d, stage 2 also the gradients, stage 3 also the parameters
(sec. 5; the flat buffers are padded to a multiple of d, as in labkit's ZeroRedundancyOptimizer).

Which parameters a rank holds (Megatron-LM): TP splits attention and MLP matrices and the
vocabulary by t (biases of row-parallel layers and the norms are replicated); PP gives rank
r the layers of its stages (L/p, in v chunks for interleaving), the input embedding to the
first rank and the final norm and output layer to the last (a tied embedding is kept on both
ends, Megatron-LM sec. 5 / Narayanan et al. 2021); expert parallelism (ep ranks, folded onto
DP) gives each rank E/ep experts.

Activations (Korthikanti et al. 2022, sec. 4): per layer and microbatch as in
:mod:`.activations`; the first pipeline rank holds the most microbatches: 1F1B min(p, M),
GPipe M, interleaved 1F1B ``p v + p - 1`` chunks of L/(p v) layers, i.e. the 1F1B's p
microbatches times ``1 + (p-1)/(p v)`` (sec. 4.2.3). Pipeline rank r of 1F1B holds p - r.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .activations import layer_activation_bytes, torch_saved_bytes_per_element
from .spec import PRECISIONS, SCHEDULES, Layout, ModelSpec

__all__ = ["RankMemory", "memory_per_rank", "most_loaded_rank", "check_layout", "in_flight_units",
           "BYTES", "rank_param_counts", "rank_chunks", "stage_in_flight"]

# bytes per parameter element: (parameter, gradient, optimizer state) -- ZeRO sec. 3.1
BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}


@dataclass
class RankMemory:
    """Bytes on one rank (pipeline rank ``pp_rank``): ``params``, ``grads``, ``optimizer``,
    ``activations``; ``total``; ``param_count`` (elements held before ZeRO-3's split);
    ``in_flight`` (microbatch-chunks whose activations are alive at the peak); ``layers``."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    param_count: int
    in_flight: int
    layers: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    def as_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def n_microbatches(spec: ModelSpec, lay: Layout) -> int:
    """M: the layout's, else ``global_batch / (b d)``."""
    return lay.M if lay.M is not None else spec.global_batch // (lay.b * lay.d)


def check_layout(spec: ModelSpec, lay: Layout) -> None:
    """Raise ValueError naming the values and the rule when ``lay`` cannot run ``spec``
    (Megatron-LM's constraints: t divides the heads, key/value heads and FFN width; p v divides
    L; b d divides the global batch; interleaving needs M % p == 0; SP needs t | s ...)."""
    a, akv = spec.n_head, spec.kv_heads
    rules = [
        (min(lay.t, lay.p, lay.d, lay.v, lay.b, lay.ep) >= 1, f"t, p, d, v, b, ep must be >= 1 (got {lay})"),
        (lay.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {lay.schedule!r}"),
        (lay.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {lay.precision!r}"),
        (lay.zero in (0, 1, 2, 3), f"ZeRO stage must be 0, 1, 2 or 3, got {lay.zero}"),
        (lay.recompute in ("none", "selective", "full"),
         f"recompute must be none, selective or full, got {lay.recompute!r}"),
    ]
    for ok, msg in rules:
        if not ok:
            raise ValueError(msg)
    rules = [
        (a % lay.t == 0 and akv % lay.t == 0, f"t={lay.t} must divide the heads a={a} and key/value heads {akv}"),
        (spec.ffn_hidden % lay.t == 0, f"t={lay.t} must divide the FFN width {spec.ffn_hidden}"),
        (spec.n_layer >= lay.p * lay.v, f"p*v={lay.p}*{lay.v} stages need at least as many layers (L={spec.n_layer})"),
        (lay.v == 1 or lay.schedule == "interleaved", f"v={lay.v} > 1 needs schedule 'interleaved'"),
        (lay.schedule != "interleaved" or lay.p > 1, "the interleaved schedule needs p > 1"),
        (not lay.sequence_parallel or spec.seq_len % lay.t == 0,
         f"sequence parallelism needs t={lay.t} to divide the sequence length s={spec.seq_len}"),
        (not spec.is_moe or (spec.n_routed_experts % lay.ep == 0 and lay.d % lay.ep == 0),
         f"ep={lay.ep} must divide the experts E={spec.n_routed_experts} and d={lay.d}"),
        (spec.is_moe or lay.ep == 1, f"ep={lay.ep} > 1 needs a MoE model"),
    ]
    if lay.M is None:
        rules.append((spec.global_batch % (lay.b * lay.d) == 0,
                      f"b*d={lay.b}*{lay.d} must divide the global batch {spec.global_batch}"))
    M = n_microbatches(spec, lay)
    rules.append((M >= 1, f"M={M} microbatches: need >= 1"))
    if lay.schedule == "interleaved":
        rules.append((M % lay.p == 0, f"the interleaved schedule needs M={M} to be a multiple of p={lay.p}"))
    for ok, msg in rules:
        if not ok:
            raise ValueError(f"layout {lay.describe()} is not valid for {spec.name}: {msg}")


def in_flight_units(lay: Layout, M: int, pp_rank: int) -> int:
    """Microbatch-chunks alive at the peak on pipeline rank ``pp_rank`` (each chunk: L/(p v)
    layers of one microbatch). GPipe ``M`` (all forwards first); 1F1B ``min(p - r, M)``;
    interleaved ``min(p v + p - 1 - 2 r, M v)``, its warm-up plus one, and ``M v`` when M = p
    (then every forward runs first, as in Megatron's ``all_warmup_microbatches``). Checked
    against labkit's schedules, counted from their actions (tests/test_plan.py)."""
    p, v, r = lay.p, lay.v, pp_rank
    if lay.schedule == "gpipe":
        return M * v
    if lay.schedule == "1f1b":
        return min(p - r, M)
    if M == p:
        return M * v
    return min(p * v + p - 1 - 2 * r, M * v)


def stage_in_flight(lay: Layout, M: int, which: str) -> int:
    """Microbatches alive at the peak on the FIRST stage (it holds the input embedding) or the
    LAST stage (the output layer and loss): GPipe M and M; 1F1B ``min(p, M)`` and 1; interleaved
    ``min(2p, M)`` and 1, or M and M when M = p (labkit's schedules, tests/test_plan.py)."""
    p = lay.p
    if lay.schedule == "gpipe" or (lay.schedule == "interleaved" and M == p):
        return M
    if which == "last":
        return 1
    return min(p, M) if lay.schedule == "1f1b" else min(2 * p, M)


def rank_chunks(n_layer: int, p: int, v: int, pp_rank: int) -> list[range]:
    """Layer ids of each of the v chunks (stages ``pp_rank``, ``pp_rank + p``, ...) of a pipeline
    rank. L / (p v) layers per stage when it divides (labkit's ``stage_layers``); otherwise the
    first ``L mod (p v)`` stages get one layer more (Megatron's uneven split)."""
    S = p * v
    base, extra = divmod(n_layer, S)
    out = []
    for c in range(v):
        s = c * p + pp_rank
        start = s * base + min(s, extra)
        out.append(range(start, start + base + (1 if s < extra else 0)))
    return out


def rank_param_counts(spec: ModelSpec, lay: Layout, pp_rank: int) -> dict:
    """Elements of parameters on one rank of pipeline rank ``pp_rank`` (any TP/DP rank):
    ``{"dense": n, "expert": n, "layers": n}`` (experts separately: their DP group is d/ep)."""
    t, p, v = lay.t, lay.p, lay.v
    layer_ids = [i for ch in rank_chunks(spec.n_layer, p, v, pp_rank) for i in ch]
    dense = expert = 0
    for i in layer_ids:
        lp = spec.layer_params(spec.is_moe and i >= spec.first_dense_layers)
        dense += lp["split"] // t + lp["replicated"]
        expert += lp["expert"] * lp["experts"] // lay.ep // t
    vocab = math.ceil(spec.vocab_size / t)
    if pp_rank == 0:
        emb_split, emb_rep = spec.embedding_params()
        dense += vocab * spec.hidden + emb_rep
    if pp_rank == p - 1:
        head_split, head_rep = spec.head_params()
        out = vocab * spec.hidden if (head_split or (spec.tied_embeddings and p > 1)) else 0
        dense += out + head_rep
    return {"dense": dense, "expert": expert, "layers": len(layer_ids)}


def _zero_shard(n: int, d: int) -> int:
    """Elements one rank keeps of a flat buffer of n split over d ranks (padded to a multiple of d)."""
    return -(-n // d)


def _layer_act(spec: ModelSpec, lay: Layout, moe: bool, device: str) -> int:
    """Activation bytes of one layer, one microbatch, on one rank."""
    e = BYTES[lay.precision][0]
    saved = torch_saved_bytes_per_element(e, device)
    mult = 2 if spec.mlp == "swiglu" else 1           # SwiGLU keeps gate, up and their product
    if moe:
        width = (spec.n_activated_experts + spec.n_shared_experts) * (spec.moe_ffn or spec.ffn_hidden)
    else:
        width = spec.ffn_hidden
    ffn = mult * width
    ffn += (-ffn) % lay.t                              # layer_activation_bytes divides by t
    n = layer_activation_bytes(spec.seq_len, lay.b, spec.hidden, spec.n_head, t=lay.t,
                               sequence_parallel=lay.sequence_parallel, recompute=lay.recompute,
                               bytes_per_element=e, ffn=ffn, kv_heads=spec.kv_heads,
                               dropout=spec.dropout > 0,
                               mask_bytes=saved["mask"], ln_stat_bytes=saved["ln_stat"],
                               fused_attention=lay.fused_attention)
    if moe and lay.recompute != "full":
        N = spec.seq_len * lay.b // (lay.t if lay.sequence_parallel else 1)
        n += N * spec.n_routed_experts * e                            # router probabilities
        n += N * spec.n_activated_experts * spec.hidden * e           # dispatched tokens
    return n


def _embedding_act(spec: ModelSpec, lay: Layout) -> int:
    """Input embedding, one microbatch: token ids (int64), positions, the vocab-parallel mask."""
    sb = spec.seq_len * lay.b
    return sb * 8 + (spec.seq_len * 8 if spec.position == "learned" else 0) + (sb if lay.t > 1 else 0)


def _head_act(spec: ModelSpec, lay: Layout, device: str) -> int:
    """Final norm, output layer and cross-entropy, one microbatch (logits' softmax in fp32)."""
    e = BYTES[lay.precision][0]
    st = torch_saved_bytes_per_element(e, device)["ln_stat"]
    sb = spec.seq_len * lay.b
    ts = lay.t if lay.sequence_parallel else 1
    vocab = math.ceil(spec.vocab_size / lay.t)
    norm_and_linear = 2 * sb * spec.hidden * e // ts + 2 * sb * st // ts
    if lay.t == 1:   # F.cross_entropy: log-softmax output and the int64 targets
        return norm_and_linear + sb * spec.vocab_size * e + 8 * sb
    # vocab_parallel_cross_entropy: fp32 softmax of the local vocabulary, int64 local targets, 2 masks
    return norm_and_linear + sb * vocab * 4 + 10 * sb


def memory_per_rank(spec: ModelSpec, lay: Layout, device: str = "cuda") -> list[RankMemory]:
    """:class:`RankMemory` of every pipeline rank (index = pp_rank; TP and DP ranks of one
    pipeline rank hold the same bytes). ``device``: "cuda" or "cpu" (what torch keeps for
    dropout masks and LayerNorm statistics, see :mod:`.activations`).
    Raises ValueError (from :func:`check_layout`) for an impossible layout."""
    check_layout(spec, lay)
    M = n_microbatches(spec, lay)
    pb, gb, ob = BYTES[lay.precision]
    z, d = lay.zero, lay.d
    d_exp = max(1, d // lay.ep)
    out = []
    for r in range(lay.p):
        cnt = rank_param_counts(spec, lay, r)
        dense, expert = cnt["dense"], cnt["expert"]
        shard = lambda n, dd, stage: _zero_shard(n, dd) if z >= stage else n  # noqa: E731
        params = pb * (shard(dense, d, 3) + shard(expert, d_exp, 3))
        grads = gb * (shard(dense, d, 2) + shard(expert, d_exp, 2))
        opt = ob * (shard(dense, d, 1) + shard(expert, d_exp, 1))
        units = in_flight_units(lay, M, r)
        # the rank's layers may differ (dense / MoE, uneven chunks): average over its chunks
        ids = [i for ch in rank_chunks(spec.n_layer, lay.p, lay.v, r) for i in ch]
        moe = [spec.is_moe and i >= spec.first_dense_layers for i in ids]
        chunk_act = sum(_layer_act(spec, lay, m, device) for m in moe) / lay.v
        act = units * chunk_act
        if lay.recompute == "full":   # the layer being recomputed in backward is alive too
            act += max(_layer_act(spec, Layout(**{**lay.__dict__, "recompute": "none"}),
                                  spec.is_moe and i >= spec.first_dense_layers, device) for i in ids)
        if r == 0:
            act += stage_in_flight(lay, M, "first") * _embedding_act(spec, lay)
        if r == lay.p - 1:
            act += stage_in_flight(lay, M, "last") * _head_act(spec, lay, device)
        out.append(RankMemory(r, params, grads, opt, int(act), dense + expert, units, cnt["layers"]))
    return out


def most_loaded_rank(spec: ModelSpec, lay: Layout, device: str = "cuda") -> RankMemory:
    """The pipeline rank with the largest total (usually the first: most microbatches in flight)."""
    return max(memory_per_rank(spec, lay, device), key=lambda m: m.total)
