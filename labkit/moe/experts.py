"""Experts and the single-device MoE layer.

An expert is an FFN (the only part of a transformer block MoE replicates; Shazeer et al.
2017, GShard 2020). DeepSeekMoE (Dai et al. 2024, sec. 3) adds two ideas:

* fine-grained experts: split each of the E experts of FFN width F into m experts of width
  F/m and route each token to m*k of the m*E: same parameters and FLOPs, far more
  combinations (:func:`fine_grained`);
* shared experts: ``n_shared_experts`` FFNs that every token goes through, added to the
  routed output (held here as one FFN of width ``n_shared_experts * moe_ffn_dim``, which is
  the same function).

``MoELayer.forward(x) -> (y, MoEStats)``: ``y = shared(x) + sum_j w_j E_{i_j}(x)`` for x
[..., H]; the stats carry the weighted balance losses (add ``stats.aux_loss`` to the training
loss) and the per-expert loads.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .dispatch import dense_moe, sorted_moe
from .losses import comm_balance_loss, device_balance_loss, sequence_balance_loss, switch_aux_loss, z_loss
from .router import RouterOutput, TopKRouter, update_expert_bias

__all__ = ["Expert", "MoEConfig", "MoEStats", "MoELayer", "MoE", "fine_grained"]


class Expert(nn.Module):
    """One FFN expert, [N, H] -> [N, H]. ``activation="gelu"``: ``fc2(GeLU(fc1 x))`` (as the
    reference GPT's MLP); ``"swiglu"``: ``w2(SiLU(w1 x) * w3 x)`` without biases (Mixtral,
    DeepSeek; Shazeer 2020)."""

    def __init__(self, n_embd: int, ffn_dim: int, activation: str = "gelu", bias: bool = True):
        super().__init__()
        if activation not in ("gelu", "swiglu"):
            raise ValueError(f"activation must be 'gelu' or 'swiglu', got {activation!r}")
        self.activation = activation
        if activation == "gelu":
            self.fc1 = nn.Linear(n_embd, ffn_dim, bias=bias)
            self.fc2 = nn.Linear(ffn_dim, n_embd, bias=bias)
        else:
            self.w1 = nn.Linear(n_embd, ffn_dim, bias=False)
            self.w3 = nn.Linear(n_embd, ffn_dim, bias=False)
            self.w2 = nn.Linear(ffn_dim, n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return self.fc2(F.gelu(self.fc1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


@dataclass
class MoEConfig:
    """MoE layer settings (DeepSeek-V3 / Megatron-Core names).

    Sizes: ``n_embd`` H, ``n_routed_experts`` E, ``n_activated_experts`` k, ``moe_ffn_dim``
    (width of one expert), ``n_shared_experts``, ``activation``, ``bias``.
    Routing: ``score_func``, ``renormalize``, ``route_scale``, ``n_expert_groups``,
    ``n_limited_groups``, ``capacity_factor`` (None: no dropping), ``drop_policy``,
    ``token_groups`` G (GShard groups: the T tokens are routed in G equal consecutive groups,
    capacity and balance losses computed per group and averaged; under EP each rank is a group).
    Balancing: ``aux_loss_coeff`` (Switch aux), ``z_loss_coeff``, ``seq_aux_loss_coeff``
    (DeepSeek-V3 sequence-wise), ``device_loss_coeff`` with ``n_devices`` and ``comm_loss_coeff``
    with ``max_devices`` M (DeepSeek-V2 device-level and communication balance),
    ``expert_bias`` (aux-loss-free bias buffer) with ``bias_update_rate`` gamma.
    ``dispatch``: "sort" (default) or "dense" (GShard one-hot reference).
    """

    n_embd: int = 64
    n_routed_experts: int = 8
    n_activated_experts: int = 2
    moe_ffn_dim: int = 128
    n_shared_experts: int = 0
    activation: str = "gelu"
    bias: bool = True
    score_func: str = "softmax"
    renormalize: bool | None = None
    route_scale: float = 1.0
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    min_capacity: int = 1
    token_groups: int = 1
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    seq_aux_loss_coeff: float = 0.0
    device_loss_coeff: float = 0.0
    comm_loss_coeff: float = 0.0
    n_devices: int = 1
    max_devices: int = 1
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    dispatch: str = "sort"

    def __post_init__(self):
        if self.dispatch not in ("sort", "dense"):
            raise ValueError(f"dispatch must be 'sort' or 'dense', got {self.dispatch!r}")
        if self.token_groups < 1:
            raise ValueError(f"token_groups must be >= 1, got {self.token_groups}")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}")


def fine_grained(cfg: MoEConfig, m: int) -> MoEConfig:
    """DeepSeekMoE fine-grained segmentation (Dai et al. 2024, sec. 3.1): m*E experts of width
    F/m, m*k activated per token (same parameter count and FLOPs). Raises ValueError when m
    does not divide ``moe_ffn_dim``."""
    if m < 1 or cfg.moe_ffn_dim % m:
        raise ValueError(f"m={m} must divide moe_ffn_dim={cfg.moe_ffn_dim}")
    return replace(cfg, n_routed_experts=cfg.n_routed_experts * m,
                   n_activated_experts=cfg.n_activated_experts * m, moe_ffn_dim=cfg.moe_ffn_dim // m)


@dataclass
class MoEStats:
    """Per-layer, per-forward results: ``aux_loss`` (0-d tensor, the coefficient-weighted sum
    of the enabled balance losses; 0 when none), ``losses`` (name -> 0-d tensor, weighted),
    ``tokens_per_expert`` [E] long (slots chosen per expert, before dropping, summed over the
    groups of this call), ``dropped_fraction`` (dropped slots / (T*k)), ``router`` (the
    concatenated :class:`RouterOutput` of this call)."""

    aux_loss: torch.Tensor
    losses: dict = field(default_factory=dict)
    tokens_per_expert: torch.Tensor | None = None
    dropped_fraction: float = 0.0
    router: RouterOutput | None = None


class MoELayer(nn.Module):
    """Single-device MoE layer (``MoE`` in DeepSeek-V3's code): router + E experts + shared.

    ``forward(x [..., H], mask=None) -> (y [..., H], MoEStats)``; ``mask`` (shape
    ``x.shape[:-1]``, 1 = real token, 0 = padding) keeps padded tokens out of the balance
    losses and the loads. With x [B, S, H] the sequence-wise loss uses S as the sequence
    length. Raises ValueError when T is not divisible by ``token_groups``.

    ``compute_balance_losses`` (True): False leaves the balance losses to the caller
    (``stats.losses`` empty, ``stats.aux_loss`` 0; :meth:`balance_losses` computes them from
    router outputs): under sequence parallelism a rank routes only its S/t tokens, and the
    losses are computed on the whole group's router logits
    (:class:`labkit.parallel.moe_pipeline.ParallelMoEBlock`).
    """

    compute_balance_losses = True

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(cfg.n_embd, cfg.n_routed_experts, cfg.n_activated_experts, cfg.score_func,
                                 cfg.renormalize, cfg.n_expert_groups, cfg.n_limited_groups, cfg.route_scale,
                                 cfg.expert_bias, cfg.capacity_factor, cfg.drop_policy, cfg.min_capacity)
        self.experts = nn.ModuleList(
            [Expert(cfg.n_embd, cfg.moe_ffn_dim, cfg.activation, cfg.bias) for _ in range(cfg.n_routed_experts)])
        self.shared_experts = (Expert(cfg.n_embd, cfg.n_shared_experts * cfg.moe_ffn_dim, cfg.activation, cfg.bias)
                               if cfg.n_shared_experts else None)

    # -- routing of the G token groups (shared with the expert-parallel layer) ----------------
    def route_tokens(self, x2: torch.Tensor, seq_len: int | None, mask: torch.Tensor | None = None):
        """Route x2 [T, H] in ``token_groups`` groups. ``mask`` [T] (1 = real token, 0 = padding)
        or None: padded tokens count in neither f nor P of any balance loss, nor in the loads
        ``tokens_per_expert``; they are still routed, take capacity slots and pass through their
        experts (their outputs are the caller's to ignore). A group with no real token adds 0
        to the mean over groups. Returns (RouterOutput of all T tokens concatenated, MoEStats
        without the router field)."""
        cfg, G = self.cfg, self.cfg.token_groups
        T = x2.shape[0]
        if T % G:
            raise ValueError(f"T={T} tokens are not divisible by token_groups={G}")
        if mask is not None:
            mask = mask.reshape(-1).to(device=x2.device)
            if mask.numel() != T:
                raise ValueError(f"padding mask has {mask.numel()} entries for T={T} tokens (it must have "
                                 f"the shape of x without its last dimension)")
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("padding mask must hold 0 (padding) or 1 (real token) only")
            mask = mask.bool()
        outs = [self.router(chunk) for chunk in x2.chunk(G, dim=0)] if T else [self.router(x2)]
        masks = list(mask.chunk(G)) if mask is not None and T else [None] * len(outs)
        losses = self.balance_losses(outs, masks, seq_len) if self.compute_balance_losses else {}
        if mask is not None:   # loads over real tokens only (what the aux-loss-free bias update uses)
            for o, m in zip(outs, masks):
                o.tokens_per_expert = torch.bincount(o.indices[m].reshape(-1), minlength=cfg.n_routed_experts)
        cat = RouterOutput(
            weights=torch.cat([o.weights for o in outs]), indices=torch.cat([o.indices for o in outs]),
            keep=torch.cat([o.keep for o in outs]), logits=torch.cat([o.logits for o in outs]),
            scores=torch.cat([o.scores for o in outs]),
            tokens_per_expert=torch.stack([o.tokens_per_expert for o in outs]).sum(0),
            capacity=outs[0].capacity, dropped_fraction=0.0)
        cat.dropped_fraction = float((~cat.keep).sum()) / max(1, cat.keep.numel())
        aux = sum(losses.values()) if losses else x2.new_zeros(())
        stats = MoEStats(aux, losses, cat.tokens_per_expert.detach(), cat.dropped_fraction, cat)
        return cat, stats

    def balance_losses(self, outs, masks, seq_len: int | None) -> dict:
        """The enabled balance losses of the config, each weighted by its coefficient and averaged
        over the groups: ``outs`` one routing per group (objects with ``logits`` [T_g, E] and
        ``indices`` [T_g, k], e.g. :class:`RouterOutput`), ``masks`` one [T_g] bool mask or None
        per group, ``seq_len`` the S of the sequence-wise loss (None: x was not [B, S, H]).
        Returns ``{name: 0-d tensor}`` (names aux, z, seq_aux, device, comm; empty when none is
        on). Raises ValueError for the sequence-wise loss without ``seq_len``."""
        cfg, losses = self.cfg, {}

        def add(name, loss_of_group):
            # a group without a real token adds 0 (so EP, one group per rank, sums the same)
            values = [loss_of_group(o, m) if m is None or bool(m.any()) else o.logits.new_zeros(())
                      for o, m in zip(outs, masks)]
            losses[name] = torch.stack(values).mean()

        if cfg.aux_loss_coeff:
            add("aux", lambda o, m: switch_aux_loss(o.logits, o.indices, cfg.aux_loss_coeff, m, from_logits=True))
        if cfg.z_loss_coeff:
            add("z", lambda o, m: z_loss(o.logits, cfg.z_loss_coeff, m))
        if cfg.seq_aux_loss_coeff:
            if seq_len is None:
                raise ValueError("the sequence-wise balance loss needs x of shape [B, S, H]")
            add("seq_aux", lambda o, m: sequence_balance_loss(o.logits, o.indices, seq_len, cfg.seq_aux_loss_coeff,
                                                              cfg.score_func, m, from_logits=True))
        if cfg.device_loss_coeff:
            add("device", lambda o, m: device_balance_loss(o.logits, o.indices, cfg.n_devices, cfg.device_loss_coeff,
                                                           cfg.score_func, m, from_logits=True))
        if cfg.comm_loss_coeff:
            add("comm", lambda o, m: comm_balance_loss(o.logits, o.indices, cfg.n_devices, cfg.max_devices,
                                                       cfg.comm_loss_coeff, cfg.score_func, m, from_logits=True))
        return losses

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r, stats = self.route_tokens(x2, shape[1] if x.dim() == 3 else None, mask)
        if self.cfg.dispatch == "sort":
            y = sorted_moe(x2, r.weights, r.indices, r.keep, self.experts)
        else:
            y = dense_moe(x2, r.weights, r.indices, r.keep, self.experts)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.view(shape), stats

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free bias step with loads SUMMED over the global batch (all microbatches,
        all ranks): see :func:`labkit.moe.router.update_expert_bias`. No-op without a bias."""
        if self.router.expert_bias is not None:
            update_expert_bias(self.router.expert_bias, tokens_per_expert, self.cfg.bias_update_rate)


MoE = MoELayer
