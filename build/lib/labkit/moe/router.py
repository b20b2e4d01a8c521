"""Routing: which k of the E experts each token goes to, and with what weight.

Symbols (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021; DeepSeek-V3 report 2024):
T tokens, H hidden size, E routed experts (``n_routed_experts``), k experts per token
(``n_activated_experts`` = ``top_k``), C capacity (slots per expert).

The pipeline of :func:`route` for router logits ``z = x W_g`` ([T, E]):

1. scores ``s = softmax(z)`` over ALL experts (GShard/Switch, DeepSeek-V2) or
   ``s = sigmoid(z)`` (DeepSeek-V3, sec. 2.1.2 eq. 15). Softmax is applied exactly once.
2. selection scores ``s + b`` where ``b`` is the expert bias of the aux-loss-free balancing
   (DeepSeek-V3 sec. 2.1.2, eq. 16). The bias changes WHICH experts are chosen, never the
   gating weights.
3. group-limited routing (DeepSeek-V2 sec. 2.2.2 "device-limited routing", DeepSeek-V3 sec.
   2.1.2 "node-limited routing"): experts are split into ``n_expert_groups`` groups of E/G;
   each token keeps only its best ``n_limited_groups`` groups. Group score: without a bias,
   the group's highest affinity (V2: devices chosen by their highest-affinity expert); with
   the bias, the sum of the group's top-2 selection scores (V3: "the sum of the highest
   K_r/M affinity scores" of each node, K_r/M = 8/4 = 2). DeepSeek-V3's published inference
   code (``model.py``, ``Gate.forward``) does exactly this: ``amax`` without a bias, top-2
   sum with it, both on the biased selection scores.
4. top-k over the (masked, biased) selection scores -> ``indices`` [T, k].
5. gating weights = the UNBIASED scores at ``indices``; optionally renormalised to sum to 1
   over the k chosen (``renormalize``; DeepSeek-V3 eq. 13 does this for sigmoid scores),
   then multiplied by ``route_scale``.

Example (softmax, k=2, logits [2, 1, 0.5, -1]): weights [0.6095, 0.2242] unrenormalised,
[0.7311, 0.2689] renormalised.

Capacity (GShard sec. 2.2, Switch sec. 2.2): ``C = max(min_capacity, ceil(k * T / E *
capacity_factor))``; slot ``(t, j)`` over capacity is dropped: it contributes nothing from
that expert (the token still passes through the residual connection).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["RouterOutput", "TopKRouter", "Gate", "route", "compute_capacity", "capacity_mask",
           "update_expert_bias"]

SCORE_FUNCS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")


@dataclass
class RouterOutput:
    """What a router returns for T tokens.

    ``weights`` [T, k] gating weights (0 where the slot was dropped), ``indices`` [T, k] long
    expert ids, ``keep`` [T, k] bool (False: dropped for capacity), ``logits`` [T, E],
    ``scores`` [T, E] (softmax or sigmoid of logits), ``tokens_per_expert`` [E] long (slots
    each expert was CHOSEN for, before dropping: the load f uses), ``capacity`` (C or None),
    ``dropped_fraction`` (float: dropped slots / (T * k)).
    """

    weights: torch.Tensor
    indices: torch.Tensor
    keep: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor
    tokens_per_expert: torch.Tensor
    capacity: int | None
    dropped_fraction: float


def compute_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None,
                     min_capacity: int = 1) -> int | None:
    """``C = max(min_capacity, ceil(k * T / E * capacity_factor))`` slots per expert (GShard
    sec. 2.2: "expert capacity"; Switch eq. 3-4). ``capacity_factor=None`` -> None (no dropping).

    Example: T=5, E=4, k=1, capacity_factor=3.0 -> ceil(3.75) = 4.
    Raises ValueError, naming the value, for E < 1, k < 1, T < 0, min_capacity < 0, or a
    capacity_factor that is not a finite number > 0 (inf and NaN included: "no dropping"
    is ``None``).
    """
    for name, value, low in (("num_tokens T", num_tokens, 0), ("num_experts E", num_experts, 1),
                             ("top_k k", top_k, 1), ("min_capacity", min_capacity, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"compute_capacity: {name} must be an integer >= {low}, got {value!r}")
    if capacity_factor is None:
        return None
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
            or not math.isfinite(capacity_factor) or capacity_factor <= 0):
        raise ValueError(f"capacity_factor must be a finite number > 0, or None for no dropping; "
                         f"got {capacity_factor!r}")
    return max(int(min_capacity), math.ceil(top_k * num_tokens / num_experts * capacity_factor))


def capacity_mask(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None,
                  policy: str = "probs") -> torch.Tensor:
    """Which slots fit into their expert's C slots. indices, weights: [T, k] -> keep [T, k] bool.

    Slots are ranked per expert, and the first C of each expert are kept:
    ``policy="probs"``: by gating weight, highest first (ties: earlier slot first);
    ``policy="position"``: by position, earliest first, slots ordered token-major
    (token 0's k choices, then token 1's, ...; GShard's "position in expert").
    ``capacity=None`` keeps everything. Raises ValueError for an unknown policy.
    """
    if policy not in DROP_POLICIES:
        raise ValueError(f"drop policy must be one of {DROP_POLICIES}, got {policy!r}")
    flat = indices.reshape(-1)
    if capacity is None:
        return torch.ones_like(indices, dtype=torch.bool)
    if policy == "probs":
        order = torch.argsort(-weights.reshape(-1).detach(), stable=True)
    else:
        order = torch.arange(flat.numel(), device=flat.device)
    onehot = F.one_hot(flat[order], num_experts)                      # [T*k, E] in priority order
    rank_in_expert = (onehot.cumsum(0) - 1).gather(1, flat[order, None]).squeeze(1)
    keep_sorted = rank_in_expert < capacity
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep.view_as(indices)


def route(logits: torch.Tensor, top_k: int, score_func: str = "softmax", renormalize: bool | None = None,
          n_expert_groups: int = 1, n_limited_groups: int = 1, route_scale: float = 1.0,
          expert_bias: torch.Tensor | None = None):
    """Top-k routing of logits [T, E] -> (weights [T, k], indices [T, k], scores [T, E]).

    See the module docstring for the steps. ``renormalize=None`` follows DeepSeek-V3's code:
    renormalise for sigmoid, not for softmax. Raises ValueError for bad sizes.
    """
    T, E = logits.shape
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, n_routed_experts={E}], got {top_k}")
    if n_expert_groups < 1 or E % n_expert_groups:
        raise ValueError(f"n_routed_experts={E} must be divisible by n_expert_groups={n_expert_groups}")
    if not 1 <= n_limited_groups <= n_expert_groups:
        raise ValueError(f"n_limited_groups={n_limited_groups} must be in [1, n_expert_groups={n_expert_groups}]")
    if n_limited_groups * (E // n_expert_groups) < top_k:
        raise ValueError(f"n_limited_groups={n_limited_groups} groups of {E // n_expert_groups} experts "
                         f"hold fewer than top_k={top_k} experts")
    if renormalize is None:
        renormalize = score_func == "sigmoid"
    scores = logits.softmax(dim=-1) if score_func == "softmax" else logits.sigmoid()
    select = scores.detach() if expert_bias is None else scores.detach() + expert_bias
    if n_expert_groups > 1 and n_limited_groups < n_expert_groups:
        grouped = select.view(T, n_expert_groups, E // n_expert_groups)
        if expert_bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(n_limited_groups, dim=-1).indices     # [T, n_limited]
        allowed = torch.zeros(T, n_expert_groups, dtype=torch.bool, device=logits.device)
        allowed.scatter_(1, best_groups, True)
        select = grouped.masked_fill(~allowed[:, :, None], float("-inf")).view(T, E)
    indices = select.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)                                      # unbiased (V3 eq. 13)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, indices, scores


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, tokens_per_expert: torch.Tensor, gamma: float) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): ``b_i += gamma * sign(mean(load) - load_i)``.

    ``tokens_per_expert`` [E] must already be SUMMED over all microbatches of the global batch
    and all ranks (all-reduce under EP/DP), so every replica applies the same update.
    Updates ``bias`` in place and returns it. Example: loads [10, 2, 4, 8], bias 0, gamma 1e-3
    -> [-0.001, +0.001, +0.001, -0.001].
    """
    load = tokens_per_expert.to(bias.dtype)
    bias += gamma * torch.sign(load.mean() - load)
    return bias


class TopKRouter(nn.Module):
    """The gate: ``logits = x W_g`` (W_g: [E, H], no bias) and :func:`route` + capacity.

    Args (DeepSeek-V3 ``Gate`` names): ``n_embd`` H, ``n_routed_experts`` E,
    ``n_activated_experts`` k, ``score_func``, ``renormalize`` (None: sigmoid only),
    ``n_expert_groups``, ``n_limited_groups``, ``route_scale``, ``use_expert_bias`` (a buffer
    ``expert_bias`` [E] for aux-loss-free balancing; no gradient), ``capacity_factor``
    (None: no dropping), ``drop_policy`` ("probs" | "position"), ``min_capacity``.

    ``forward(x [T, H]) -> RouterOutput``. Capacity uses the T of the call: under expert
    parallelism each rank routes its own tokens, so C is per rank (per GShard "group").
    """

    def __init__(self, n_embd: int, n_routed_experts: int, n_activated_experts: int = 2,
                 score_func: str = "softmax", renormalize: bool | None = None, n_expert_groups: int = 1,
                 n_limited_groups: int = 1, route_scale: float = 1.0, use_expert_bias: bool = False,
                 capacity_factor: float | None = None, drop_policy: str = "probs", min_capacity: int = 1):
        super().__init__()
        if drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
        # validate the routing options once, on a dummy row
        route(torch.zeros(1, n_routed_experts), n_activated_experts, score_func, renormalize,
              n_expert_groups, n_limited_groups)
        compute_capacity(1, n_routed_experts, n_activated_experts, capacity_factor, min_capacity)
        self.n_routed_experts, self.top_k = n_routed_experts, n_activated_experts
        self.score_func, self.renormalize, self.route_scale = score_func, renormalize, route_scale
        self.n_expert_groups, self.n_limited_groups = n_expert_groups, n_limited_groups
        self.capacity_factor, self.drop_policy, self.min_capacity = capacity_factor, drop_policy, min_capacity
        self.weight = nn.Parameter(torch.empty(n_routed_experts, n_embd))
        nn.init.normal_(self.weight, std=0.02)
        if use_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(n_routed_experts))
        else:
            self.expert_bias = None

    @property
    def n_activated_experts(self) -> int:
        """k (DeepSeek-V3's name for ``top_k``)."""
        return self.top_k

    def forward(self, x: torch.Tensor) -> RouterOutput:
        logits = x @ self.weight.t()
        weights, indices, scores = route(logits, self.top_k, self.score_func, self.renormalize,
                                         self.n_expert_groups, self.n_limited_groups, self.route_scale,
                                         self.expert_bias)
        T = x.shape[0]
        C = compute_capacity(T, self.n_routed_experts, self.top_k, self.capacity_factor, self.min_capacity)
        keep = capacity_mask(indices, weights, self.n_routed_experts, C, self.drop_policy)
        weights = weights * keep
        counts = torch.bincount(indices.reshape(-1), minlength=self.n_routed_experts)
        dropped = float((~keep).sum()) / max(1, keep.numel())
        return RouterOutput(weights, indices, keep, logits, scores, counts, C, dropped)


Gate = TopKRouter
