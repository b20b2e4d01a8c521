"""Expert parallelism with redundant experts (DeepSeek-V3 report sec. 3.4; EPLB).

:func:`labkit.moe.eplb.rebalance_experts` says, for one MoE layer, which logical expert each of
the R physical experts copies (``phy2log`` [R]); rank p of the P EP ranks holds physical
experts ``p*R/P .. (p+1)*R/P - 1``. :class:`ReplicatedExpertParallelMoE` runs that placement:

1. route this rank's tokens as usual: the router knows only the E LOGICAL experts;
2. choose a copy for every kept slot: the j-th slot (token order) of this rank that goes to
   logical expert e uses copy ``(j + rank) % c_e`` of its ``c_e`` copies, so each copy gets
   an equal share (within one slot) of every rank's tokens for e, and the leftover slots of
   different ranks go to different copies;
3. dispatch, run and combine exactly as :class:`~labkit.moe.expert_parallel.ExpertParallelMoE`
   but over the R physical experts (counts all-to-all, dispatch, local experts, combine;
   weights applied on the token's own rank).

Gradients: copy i of expert e sees only its share of e's tokens, so its gradient is a part of
e's. The single-device gradient of e is the SUM over its copies (the loss is a sum over
tokens); :func:`sync_replica_grads` adds the copies' gradients into one [E, ...] buffer per
parameter, all-reduces it over the EP group and gives every copy the sum, so the copies stay
identical after every optimizer step. (Production code reduces only among the ranks that hold
copies of e; one all-reduce of E experts is the readable version: the same numbers.)
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch
import torch.nn as nn

from .. import comm
from ..grid import even_part
from .dispatch import permute, run_experts, unpermute
from .expert_parallel import ExpertParallelMoE, all_to_all
from .experts import MoEConfig, MoELayer

__all__ = ["ReplicatedExpertParallelMoE", "choose_replicas", "expert_parallel_ffn", "sync_replica_grads",
           "to_replicated_expert_parallel"]


def choose_replicas(indices: torch.Tensor, keep: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor,
                    rank: int = 0) -> torch.Tensor:
    """Physical expert of every slot: indices/keep [T, k] (logical ids), log2phy [E, X] (padded
    with -1), logcnt [E] -> [T, k] int64 physical ids (dropped slots: copy 0, never used).

    The j-th kept slot (token-major order) of logical expert e takes copy ``(j + rank) % c_e``.
    Example: 5 kept slots all for e with c_e = 2 on rank 0 -> copies 0, 1, 0, 1, 0.
    """
    flat, kept = indices.reshape(-1), keep.reshape(-1)
    E = logcnt.numel()
    onehot = torch.nn.functional.one_hot(flat, E) * kept[:, None]
    j = (onehot.cumsum(0) - 1).gather(1, flat[:, None]).squeeze(1).clamp(min=0)     # rank among e's slots
    copy = torch.where(kept, (j + rank) % logcnt[flat], torch.zeros_like(j))
    return log2phy[flat, copy].view_as(indices)


def expert_parallel_ffn(x2: torch.Tensor, slot_expert: torch.Tensor, keep: torch.Tensor, weights: torch.Tensor,
                        experts: Sequence[nn.Module], n_experts: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 3-7 of :mod:`labkit.moe.expert_parallel` for experts 0..n_experts-1 sharded
    contiguously over the ranks of ``group`` (``experts`` = this rank's n_experts/P).

    x2 [T, H], slot_expert/keep/weights [T, k] -> (y [T, H] weighted sum of the expert outputs,
    recv_counts [P, n_local]: rows this rank's experts received from every rank)."""
    P, El = torch.distributed.get_world_size(group), len(experts)
    rows, perm = permute(x2, slot_expert, keep, n_experts)                      # sorted by expert id
    recv_counts = torch.empty_like(perm.tokens_per_expert)
    comm.all_to_all_single(recv_counts, perm.tokens_per_expert, [El] * P, [El] * P, group)
    recv_counts = recv_counts.view(P, El)
    input_splits = perm.tokens_per_expert.view(P, El).sum(1).tolist()
    output_splits = recv_counts.sum(1).tolist()
    received = all_to_all(rows, output_splits, input_splits, group)              # by source rank, then expert
    local = torch.repeat_interleave(torch.arange(El, device=x2.device).repeat(P), recv_counts.flatten())
    order = torch.argsort(local, stable=True)
    out = run_experts(received[order], recv_counts.sum(0).tolist(), experts)
    out = out[torch.argsort(order)]
    returned = all_to_all(out, input_splits, output_splits, group)
    return unpermute(returned, perm, weights), recv_counts


class ReplicatedExpertParallelMoE(ExpertParallelMoE):
    """The EP MoE layer over R physical experts that copy the E logical ones.

    Args: ``cfg`` (token_groups must be 1: each rank is one group), ``phy2log`` [R] int (the
    logical expert of each physical one, a row of :func:`~labkit.moe.eplb.rebalance_experts`'s
    first output; every logical expert must appear), ``ep_group``, ``ep_rank``, ``ep_size`` P
    (R % P == 0). ``experts`` holds this rank's R/P physical experts. ``forward(x [..., H]) ->
    (y, MoEStats)``; ``stats.tokens_per_expert`` stays the LOGICAL load [E] (what EPLB
    measures); ``last_recv_counts`` [P, R/P] the rows this rank's copies received.
    Raises ValueError before any communication for bad sizes or a logical expert without a copy.
    """

    def __init__(self, cfg: MoEConfig, phy2log, ep_group, ep_rank: int, ep_size: int):
        nn.Module.__init__(self)
        E = cfg.n_routed_experts
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).reshape(-1).cpu()
        R = phy2log.numel()
        if ep_size < 1 or R % ep_size:
            raise ValueError(f"{R} physical experts cannot be split evenly over EP size {ep_size}")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} must be in [0, ep_size={ep_size})")
        if bool(((phy2log < 0) | (phy2log >= E)).any()):
            raise ValueError(f"phy2log entries must be logical expert ids in [0, {E}), got {phy2log.tolist()}")
        logcnt = torch.bincount(phy2log, minlength=E)
        if bool((logcnt == 0).any()):
            raise ValueError(f"logical experts {(logcnt == 0).nonzero().flatten().tolist()} have no physical copy "
                             f"in phy2log {phy2log.tolist()}")
        if cfg.token_groups != 1:
            raise ValueError(f"under EP each rank routes its own tokens as one group; got token_groups="
                             f"{cfg.token_groups}")
        self.cfg, self.ep_group, self.ep_rank, self.ep_size = cfg, ep_group, ep_rank, ep_size
        self.n_physical = R
        self.n_local_experts = R // ep_size
        self.expert_offset = even_part(R, ep_size, int(ep_rank)).start
        log2phy = torch.full((E, int(logcnt.max())), -1, dtype=torch.int64)
        seen = [0] * E
        for p, e in enumerate(phy2log.tolist()):
            log2phy[e, seen[e]] = p
            seen[e] += 1
        self.register_buffer("phy2log", phy2log, persistent=False)
        self.register_buffer("log2phy", log2phy, persistent=False)
        self.register_buffer("logcnt", logcnt, persistent=False)
        self._build_modules(cfg)
        self.last_recv_counts = None

    def local_logical(self) -> list[int]:
        """Logical expert id of each local physical expert."""
        return self.phy2log[self.expert_offset:self.expert_offset + self.n_local_experts].tolist()

    @classmethod
    def from_dense(cls, layer: MoELayer, phy2log, ep_group, ep_rank: int, ep_size: int):
        """This rank's part of a single-device layer: router and shared experts copied, and each
        local physical expert a copy of its logical expert's weights."""
        ep = cls(replace(layer.cfg, token_groups=1), phy2log, ep_group, ep_rank, ep_size)
        return ep._copy_from(layer, ep.local_logical())

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r, stats = self.route_tokens(x2, shape[1] if x.dim() == 3 else None, mask)
        physical = choose_replicas(r.indices, r.keep, self.log2phy, self.logcnt, self.ep_rank)
        y, self.last_recv_counts = expert_parallel_ffn(x2, physical, r.keep, r.weights, self.experts,
                                                       self.n_physical, self.ep_group)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.view(shape), stats


def sync_replica_grads(model: nn.Module, group) -> None:
    """Make every copy's gradient the gradient of its logical expert: for each
    :class:`ReplicatedExpertParallelMoE` in ``model`` and each expert parameter, sum the local
    copies' gradients into a zero [E, ...] buffer at their logical ids, all-reduce (SUM) over
    ``group``, and write the logical sum back into every copy. Copies without a gradient count
    as zero. Call it after backward, with :func:`~labkit.moe.expert_parallel.sync_replicated_grads`
    for the replicated parameters (which skips the experts)."""
    for m in model.modules():
        if not isinstance(m, ReplicatedExpertParallelMoE):
            continue
        logical = m.local_logical()
        for name, _ in m.experts[0].named_parameters():
            params = [dict(ex.named_parameters())[name] for ex in m.experts]
            buf = params[0].new_zeros((m.cfg.n_routed_experts, *params[0].shape))
            for p, e in zip(params, logical):
                if p.grad is not None:
                    buf[e] += p.grad
            comm.all_reduce(buf, group)
            for p, e in zip(params, logical):
                p.grad = buf[e].clone()


def to_replicated_expert_parallel(model: nn.Module, phy2log: torch.Tensor, ep_group, ep_rank: int,
                                  ep_size: int) -> nn.Module:
    """Replace the i-th :class:`MoELayer` of ``model`` (in ``model.modules()`` order) by this
    rank's :class:`ReplicatedExpertParallelMoE` with placement ``phy2log[i]`` ([layers, R]),
    in place; returns ``model``. Raises ValueError when the number of rows differs from the
    number of MoE layers."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, MoELayer) and not isinstance(child, ExpertParallelMoE)]
    if len(targets) != len(phy2log):
        raise ValueError(f"phy2log has {len(phy2log)} rows for {len(targets)} MoE layers")
    for (parent, name, child), row in zip(targets, phy2log):
        setattr(parent, name, ReplicatedExpertParallelMoE.from_dense(child, row, ep_group, ep_rank, ep_size))
    return model
