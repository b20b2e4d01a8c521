"""Parameters of a :class:`~.spec.ModelSpec`: total against active per token, and what decoding
one token costs.

The lecture's point (notebooks 9, 12, 14): only the FFNs are experts. "Mixtral 8x7B" is not
56B parameters but about 47B (attention, embeddings and norms are shared by the 8 experts), and
a token passes through 2 of the 8 FFNs, so about 13B parameters are active per token.
DeepSeek-V3: 671B total, about 37B active (256 fine-grained routed experts, 8 active, plus 1
shared). The per-layer counts are :meth:`~.spec.ModelSpec.layer_params`'s, so the planner's
memory and these totals are one count.

Decode cost (DeepSpeed-MoE, Rajbhandari et al. 2022, sec. 5.1): generating one token at batch
size 1 reads every parameter the token uses once from GPU memory, and small-batch decoding is
memory-bandwidth bound, so ``latency >= bytes read / bandwidth``. A dense model reads all of its
parameters; an MoE only its activated ones. With a batch of B tokens an MoE layer touches on
average ``E (1 - (1 - k/E)^B)`` distinct experts, so its advantage shrinks as the batch grows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .spec import ModelSpec

__all__ = ["ParamCount", "count_parameters", "DecodeCost", "decode_cost", "expected_experts_touched"]


@dataclass
class ParamCount:
    """``total`` and ``active`` (per token) parameter counts, and a ``breakdown`` dict of totals
    ("attention", "routed experts", "embedding + head"; "mtp" with ``include_mtp``)."""

    total: int
    active: int
    breakdown: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"total {self.total / 1e9:.1f}B, active per token {self.active / 1e9:.1f}B"


def _layer_total(spec: ModelSpec, moe: bool) -> int:
    lp = spec.layer_params(moe)
    return lp["split"] + lp["replicated"] + lp["expert"] * lp["experts"]


def count_parameters(spec: ModelSpec, include_mtp: bool = False) -> ParamCount:
    """Total and per-token active parameters of ``spec`` (:meth:`~.spec.ModelSpec.total_params`
    and :meth:`~.spec.ModelSpec.active_params`), with a breakdown.

    Active = every shared weight (the embedding counted whole, as the published figures do)
    plus k of the E routed experts in each MoE layer. ``include_mtp=True`` adds DeepSeek-V3's
    multi-token-prediction module(s) (DeepSeek-V3 report sec. 2.2) as stored in the released
    checkpoint: a projection ``[h, 2h]``, two RMSNorms, one MoE layer, and its own copy of the
    embedding, the final norm and the output layer."""
    total, active = spec.total_params(), spec.active_params()
    emb, head = sum(spec.embedding_params()), spec.head_params()[0]
    attention = sum(spec.attention_params())
    breakdown = {"attention": spec.n_layer * attention,
                 "routed experts": spec.n_moe_layers * spec.n_routed_experts * spec.layer_params(True)["expert"],
                 "embedding + head": emb + head}
    if include_mtp and spec.n_mtp_modules:
        one = (2 * spec.hidden * spec.hidden + 2 * spec.norm_params() + _layer_total(spec, spec.is_moe)
               + emb + sum(spec.head_params()))
        breakdown["mtp"] = spec.n_mtp_modules * one
        total += breakdown["mtp"]
    return ParamCount(total, active, breakdown)


@dataclass
class DecodeCost:
    """Per generated token: ``params_read`` (parameters read), ``bytes_read`` (= params *
    bytes_per_param), ``latency_s`` (lower bound, bytes / bandwidth) and ``tokens_per_s``
    (its inverse), for ``name``."""

    name: str
    params_read: float
    bytes_read: float
    latency_s: float

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.latency_s


def expected_experts_touched(E: int, k: int, batch: int) -> float:
    """Distinct experts one MoE layer reads for ``batch`` tokens, each choosing k of E
    uniformly: ``E * (1 - (1 - k/E)^batch)`` (k at batch 1, E as the batch grows)."""
    return E * (1 - (1 - k / E) ** batch)


def decode_cost(spec: ModelSpec, bandwidth: float, bytes_per_param: float = 2.0, batch: int = 1) -> DecodeCost:
    """Memory-bound lower bound of one decoding step per token (module docstring;
    DeepSpeed-MoE sec. 5.1).

    ``bandwidth`` in bytes/s (e.g. 3.35e12 for an H100 SXM's HBM3), ``bytes_per_param`` 2 for
    bf16, 1 for fp8. At ``batch`` 1 the bytes are the active parameters
    (:func:`count_parameters`); for larger batches the routed experts count as
    :func:`expected_experts_touched` per layer, and the step's bytes are shared by the batch.
    Ignores the KV cache and activations (small for short contexts). Raises ValueError for
    bandwidth <= 0 or batch < 1.
    Example: Mixtral 8x7B, bf16, 3.35 TB/s: 12.9e9 params * 2 B / 3.35e12 B/s = 7.7 ms.
    """
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    params = float(spec.active_params())
    if batch > 1 and spec.n_routed_experts > 1:
        touched = expected_experts_touched(spec.n_routed_experts, spec.n_activated_experts, batch)
        params += spec.n_moe_layers * (touched - spec.n_activated_experts) * spec.layer_params(True)["expert"]
    per_token = params / batch
    nbytes = per_token * bytes_per_param
    return DecodeCost(spec.name, per_token, nbytes, nbytes / bandwidth)
