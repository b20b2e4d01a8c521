"""Expert parallelism (EP): the E experts are sharded over P ranks, everything else replicated.

GShard (Lepikhin et al. 2020, sec. 2.2-3) and Switch (Fedus et al. 2021, sec. 2.2): each of the
P = ``ep_size`` ranks holds E/P consecutive experts (rank p: experts p*E/P .. (p+1)*E/P - 1) and
its OWN tokens (data parallel over tokens). One MoE layer on one rank:

1. route its T_p tokens (capacity C per rank: C = ceil(k * T_p / E * capacity_factor), i.e.
   each rank is one GShard "group"; the single-device reference uses ``token_groups = P``);
2. permute the kept slots by expert id (so they are also grouped by destination rank);
3. all-to-all #0, the counts: every rank sends its per-expert counts [E] (E/P to each rank),
   so each rank learns how many rows it will receive from every rank for every local expert;
4. all-to-all #1, dispatch: rows go to the rank that holds their expert, uneven splits
   (zero-size splits included);
5. the local experts run on their rows (regrouped by local expert);
6. all-to-all #2, combine: results go back by the reverse splits;
7. unpermute and weight by the gates on the token's own rank (so the router gradient is
   computed where the token lives, once per slot; dropped slots contribute nothing).

Autograd: :class:`_AllToAll` is a Function whose backward is the reverse all-to-all, so the
backward pass sends gradients along the same routes in the opposite direction.

Gradients, the convention: each rank backpropagates ITS loss divided by P (the data-parallel
mean). An expert's gradient is then complete on its rank (the backward all-to-all brought
every rank's contribution); the replicated parameters (router, shared experts, the rest of the
model) each hold 1/P-scaled partial gradients and :func:`sync_replicated_grads` all-reduces
them with SUM. The aux-loss-free bias update uses loads all-reduced over the EP group.

Bytes per layer and forward (counted with :class:`labkit.comm.CommLog`, what this rank sends):
counts ``E * 8``; dispatch and combine each ``N_p * H * 4`` (fp32), N_p = kept slots of rank p.
Backward repeats dispatch and combine in reverse (no counts). P = 1: no all-to-all at all (the
one rank holds every expert; Megatron-Core's dispatcher skips it too), so nothing is counted.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from ..grid import even_part
from .dispatch import permute, run_experts, unpermute
from .experts import Expert, MoEConfig, MoELayer
from .router import TopKRouter

__all__ = ["ExpertParallelMoE", "all_to_all", "all_to_all_uneven", "exchange_splits",
           "sync_replicated_grads", "to_expert_parallel", "all_reduce_loads", "expert_param_names"]


class _AllToAll(torch.autograd.Function):
    """y = all_to_all(x) with the given splits; backward: the reverse all-to-all of dy."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (list(output_splits), list(input_splits)), group
        out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_s, in_s = ctx.splits
        gx = grad.new_empty((sum(in_s),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(gx, grad.contiguous(), in_s, out_s, ctx.group)
        return gx, None, None, None


def all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int], group) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0: rows ``x[sum(input_splits[:q]) : ...]`` go to
    rank q; the result holds ``output_splits[s]`` rows from each rank s, in rank order.
    No validation (see :func:`all_to_all_uneven`)."""
    return _AllToAll.apply(x, [int(s) for s in output_splits], [int(s) for s in input_splits], group)


def exchange_splits(input_splits: Sequence[int], group, device=None) -> list[int]:
    """All-to-all of the split sizes: returns what every rank will send to this one
    (``[n_{0->me}, n_{1->me}, ...]``). One int64 per rank pair (8 bytes). ``device``: where the
    small tensors live (the rank's CUDA device under NCCL; CPU by default)."""
    P = dist.get_world_size(group)
    send = torch.tensor([int(s) for s in input_splits], dtype=torch.long, device=device)
    recv = torch.empty(P, dtype=torch.long, device=device)
    comm.all_to_all_single(recv, send, [1] * P, [1] * P, group)
    return recv.tolist()


def _split_problem(x: torch.Tensor, input_splits, output_splits, P: int) -> str | None:
    """What is wrong with this rank's split lists on their own (None: nothing)."""
    def ints(splits):
        return all(isinstance(s, numbers.Integral) and not isinstance(s, bool) and s >= 0 for s in splits)

    if len(input_splits) != P:
        return f"input_split_sizes has {len(input_splits)} entries for {P} ranks"
    if not ints(input_splits):
        return f"split sizes must be non-negative integers, got input_split_sizes {list(input_splits)}"
    if sum(input_splits) != x.shape[0]:
        return (f"input_split_sizes {list(input_splits)} sum to {sum(input_splits)} but the input has "
                f"{x.shape[0]} rows")
    if output_splits is not None and len(output_splits) != P:
        return f"output_split_sizes has {len(output_splits)} entries for {P} ranks"
    if output_splits is not None and not ints(output_splits):
        return f"split sizes must be non-negative integers, got output_split_sizes {list(output_splits)}"
    return None


def all_to_all_uneven(x: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int] | None = None,
                      group=None) -> torch.Tensor:
    """Validated, differentiable uneven all-to-all of x [N, ...] along dim 0.

    The checks: one split per rank, non-negative integers, ``sum(input_splits) == x.shape[0]``,
    and, when ``output_splits`` is given, that it equals what the other ranks will send (learnt
    from an all-to-all of the split sizes, one int64 per rank pair). A rank that finds a problem
    does NOT raise on its own (its peers would then wait in the next collective until the group
    timeout, e.g. under torchrun): every rank first takes part in the counts exchange (a rank
    whose own lists are unusable sends zeros) and in one flag all-reduce, so every rank learns
    which ranks failed; those ranks' messages are then gathered (error path only), and EVERY rank
    raises the same ValueError naming each failing rank and its rule. ``output_splits=None``:
    use what the exchange says. Returns [sum(output_splits), ...].
    Collectives on the success path: the counts all-to-all and the flag all-reduce.
    """
    P, me = dist.get_world_size(group), dist.get_rank(group)
    problem = _split_problem(x, input_splits, output_splits, P)
    # a rank with a malformed list still joins the exchange, sending zeros, so nobody hangs
    incoming = exchange_splits([0] * P if problem else input_splits, group, x.device)
    if problem is None and output_splits is not None and list(map(int, output_splits)) != incoming:
        problem = (f"output_split_sizes {list(map(int, output_splits))} do not match the input_split_sizes "
                   f"the other ranks send ({incoming})")
    # always one flag all-reduce (also when this rank passed no output sizes), so every rank
    # issues the same collectives whichever ranks gave output_split_sizes
    bad = torch.zeros(P, dtype=torch.long, device=x.device)
    bad[me] = int(problem is not None)
    comm.all_reduce(bad, group)
    if bad.any():
        ranks = bad.nonzero().flatten().tolist()
        problems = [None] * P
        comm.all_gather_object(problems, problem, group)   # every rank reaches this: no hang
        detail = "; ".join(f"rank {r}: {problems[r]}" for r in ranks)
        raise ValueError(f"all_to_all split sizes are invalid on rank(s) {ranks} (checked on every rank): "
                         f"{detail}")
    return all_to_all(x, incoming, input_splits, group)


class ExpertParallelMoE(MoELayer):
    """The MoE layer with its E experts sharded over the ``ep_size`` ranks of ``ep_group``.

    Holds the router and shared experts (replicated) and ``experts`` = the E/P local experts
    (global ids ``expert_offset .. expert_offset + E/P - 1``). ``forward(x [..., H], mask=None)
    -> (y, MoEStats)`` on this rank's tokens (``mask``: padding, as in :class:`MoELayer`);
    every rank must call it (collective). Raises ValueError at construction, before any
    communication, when ``ep_size`` P < 1, ``ep_rank`` is outside 0..P-1, P does not divide E
    or ``token_groups != 1`` (each rank is one group under EP).
    """

    def __init__(self, cfg: MoEConfig, ep_group, ep_rank: int, ep_size: int):
        nn.Module.__init__(self)
        E = cfg.n_routed_experts
        if isinstance(ep_size, bool) or not isinstance(ep_size, numbers.Integral) or ep_size < 1:
            raise ValueError(f"ep_size must be an integer >= 1, got {ep_size!r}")
        if isinstance(ep_rank, bool) or not isinstance(ep_rank, numbers.Integral) or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank!r} must be an integer in 0..ep_size-1 = 0..{ep_size - 1}")
        if E % ep_size:
            raise ValueError(f"n_routed_experts={E} must be divisible by the EP size {ep_size}")
        if cfg.token_groups != 1:
            raise ValueError(f"under EP each rank routes its own tokens as one group; got token_groups="
                             f"{cfg.token_groups} (use token_groups=P only in the single-device reference)")
        self.cfg, self.ep_group, self.ep_rank, self.ep_size = cfg, ep_group, ep_rank, ep_size
        self.n_local_experts = E // ep_size
        self.expert_offset = even_part(E, ep_size, int(ep_rank)).start
        self._build_modules(cfg)

    def _build_modules(self, cfg: MoEConfig):
        """The router and shared experts (replicated on every rank) and ``n_local_experts``
        local experts (subclasses set ``n_local_experts`` first)."""
        self.router = TopKRouter(cfg.n_embd, cfg.n_routed_experts, cfg.n_activated_experts, cfg.score_func,
                                 cfg.renormalize, cfg.n_expert_groups, cfg.n_limited_groups, cfg.route_scale,
                                 cfg.expert_bias, cfg.capacity_factor, cfg.drop_policy, cfg.min_capacity)
        self.experts = nn.ModuleList([Expert(cfg.n_embd, cfg.moe_ffn_dim, cfg.activation, cfg.bias)
                                      for _ in range(self.n_local_experts)])
        self.shared_experts = (Expert(cfg.n_embd, cfg.n_shared_experts * cfg.moe_ffn_dim, cfg.activation, cfg.bias)
                               if cfg.n_shared_experts else None)

    def _copy_from(self, layer: MoELayer, logical=None):
        """Load a single-device layer's weights: router and shared experts, and for local expert
        i the weights of logical expert ``logical[i]`` (default: this rank's shard
        ``expert_offset + i``). Returns self."""
        if logical is None:
            logical = range(self.expert_offset, self.expert_offset + self.n_local_experts)
        self.router.load_state_dict(layer.router.state_dict())
        for expert, e in zip(self.experts, logical):
            expert.load_state_dict(layer.experts[e].state_dict())
        if layer.shared_experts is not None:
            self.shared_experts.load_state_dict(layer.shared_experts.state_dict())
        return self

    @classmethod
    def from_dense(cls, layer: MoELayer, ep_group, ep_rank: int, ep_size: int) -> "ExpertParallelMoE":
        """This rank's shard of a single-device layer (same weights; config with token_groups=1)."""
        from dataclasses import replace
        return cls(replace(layer.cfg, token_groups=1), ep_group, ep_rank, ep_size)._copy_from(layer)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        shape, P, El = x.shape, self.ep_size, self.n_local_experts
        x2 = x.reshape(-1, shape[-1])
        r, stats = self.route_tokens(x2, shape[1] if x.dim() == 3 else None, mask)
        rows, perm = permute(x2, r.indices, r.keep, self.cfg.n_routed_experts)     # sorted by global expert
        if P == 1:      # one EP rank holds every expert: no exchange at all (as Megatron-Core's dispatcher)
            y = unpermute(run_experts(rows, perm.tokens_per_expert.tolist(), self.experts), perm, r.weights)
            return self._add_shared(y, x2).view(shape), stats
        # all-to-all #0: per-expert counts; recv_counts[s, e] = rows rank s sends to my local expert e
        recv_counts = torch.empty_like(perm.tokens_per_expert)
        comm.all_to_all_single(recv_counts, perm.tokens_per_expert, [El] * P, [El] * P, self.ep_group)
        recv_counts = recv_counts.view(P, El)
        input_splits = perm.tokens_per_expert.view(P, El).sum(1).tolist()
        output_splits = recv_counts.sum(1).tolist()
        # all-to-all #1: dispatch. Received rows are ordered by source rank, then local expert.
        received = all_to_all(rows, output_splits, input_splits, self.ep_group)
        local_expert = torch.repeat_interleave(torch.arange(El, device=x.device).repeat(P), recv_counts.flatten())
        order = torch.argsort(local_expert, stable=True)                            # group by local expert
        out = run_experts(received[order], recv_counts.sum(0).tolist(), self.experts)
        out = out[torch.argsort(order)]                                             # back to arrival order
        # all-to-all #2: combine (reverse splits), then weight on the token's own rank
        returned = all_to_all(out, input_splits, output_splits, self.ep_group)
        y = unpermute(returned, perm, r.weights)
        return self._add_shared(y, x2).view(shape), stats

    def _add_shared(self, y: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return y + self.shared_experts(x2) if self.shared_experts is not None else y


def expert_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters of the local experts of every :class:`ExpertParallelMoE` in model."""
    names = set()
    for mname, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for pname, _ in m.experts.named_parameters():
                names.add(f"{mname}.experts.{pname}" if mname else f"experts.{pname}")
    return names


def sync_replicated_grads(model: nn.Module, group) -> None:
    """All-reduce (SUM) the gradients of every replicated parameter (all but the local experts)
    over the EP group. Convention: each rank backpropagated its loss / P. Parameters without a
    gradient count as zero, so every rank issues the same all-reduces."""
    skip = expert_param_names(model)
    for name, p in model.named_parameters():
        if name in skip or not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        comm.all_reduce(p.grad, group)


def all_reduce_loads(tokens_per_expert: torch.Tensor, group) -> torch.Tensor:
    """Loads [E] summed over the EP/DP ranks (for the aux-loss-free bias update). Returns a copy."""
    t = tokens_per_expert.detach().clone()
    return comm.all_reduce(t, group)


def to_expert_parallel(model: nn.Module, ep_group, ep_rank: int, ep_size: int) -> nn.Module:
    """Replace every :class:`MoELayer` inside ``model`` by this rank's :class:`ExpertParallelMoE`
    shard (same weights), in place; returns ``model``."""
    for name, child in list(model.named_children()):
        if isinstance(child, MoELayer) and not isinstance(child, ExpertParallelMoE):
            setattr(model, name, ExpertParallelMoE.from_dense(child, ep_group, ep_rank, ep_size))
        else:
            to_expert_parallel(child, ep_group, ep_rank, ep_size)
    return model
