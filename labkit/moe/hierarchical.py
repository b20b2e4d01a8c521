"""Hierarchical (two-level) all-to-all for expert parallelism across nodes.

P ranks form N = P / g nodes of g GPUs (rank = node * g + local). Inside a node the link is
fast (NVLink, ~160 GB/s per GPU on H800), between nodes slow (InfiniBand, ~50 GB/s): DeepSeek-V3
report sec. 3.2.2. The flat all-to-all of :mod:`labkit.moe.expert_parallel` sends one row per
token-slot, so a token whose k experts sit on two GPUs of the same remote node crosses the slow
link twice. The two-level dispatch sends it once per node:

1. inter-node step (over the "rail" group: the N ranks with this rank's local index): every
   token goes ONCE to each node that holds at least one of its kept experts, to the GPU with the
   same local index there; with it travel its k expert ids (-1: not on that node) and k gating
   weights;
2. intra-node step (over the node's g ranks): the receiving GPU forwards one row per slot to the
   GPU of that node that holds the slot's expert; the experts run;
3. combine, in reverse: outputs come back inside the node to the forwarding GPU, which weights
   and SUMS the slots of each token (one partial row per token and node), then the partial rows
   cross back over the rail and the token's own rank adds them up.

Node-limited routing (DeepSeek-V3 sec. 2.1.2 / 3.2.2: "each token will be sent to at most
M = 4 nodes") makes the inter-node rows per token at most M, however large k is: route with
``n_expert_groups = N`` (the E/N experts of a node form a group) and ``n_limited_groups = M``.
DeepSpeed-MoE (Rajbhandari et al. 2022, sec. 5.3) uses a two-step all-to-all for a related
reason, latency: a flat all-to-all over p GPUs has O(p) steps, the hierarchical one O(g + p/g).

Bytes are counted per level for every data all-to-all (token rows, H * element size each),
by destination: ``inter_node`` (another node), ``intra_node`` (another GPU of this node) and
``local`` (to itself: no link). The flat layer (``hierarchical=False``) is counted the same
way, so the two are compared on the same routing. The small metadata (split sizes, expert ids,
gating weights) is counted separately as ``meta``. Forward only; the backward sends the same
rows in reverse.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .. import comm
from ..grid import Mesh
from .dispatch import run_experts
from .expert_parallel import ExpertParallelMoE, all_to_all, exchange_splits
from .experts import MoEConfig, MoELayer

__all__ = ["NodeGroups", "make_node_groups", "HierarchicalExpertParallelMoE", "LevelBytes", "inter_node_rows"]

LEVELS = ("inter_node", "intra_node", "local", "meta")


@dataclass
class NodeGroups:
    """This rank's place in the N x g layout and its two groups: ``intra`` (the g ranks of its
    node) and ``rail`` (the N ranks with its local index, one per node). ``world`` is the EP group."""

    world: object
    intra: object
    rail: object
    rank: int
    node: int
    local: int
    num_nodes: int
    gpus_per_node: int
    mesh: Mesh | None = None  # the N x g layout, ``Mesh(node=N, local=g)``

    def __post_init__(self):
        if self.mesh is None:
            self.mesh = Mesh(node=self.num_nodes, local=self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return self.mesh.coords(rank)["node"]


def make_node_groups(ctx, gpus_per_node: int) -> NodeGroups:
    """Build the node and rail groups on ``ctx`` (a :class:`labkit.dist.DistContext`); every rank
    must call it. Raises ValueError when ``gpus_per_node`` does not divide the world size."""
    P = ctx.world_size
    if gpus_per_node < 1 or P % gpus_per_node:
        raise ValueError(f"gpus_per_node={gpus_per_node} must divide the {P} ranks into whole nodes")
    mesh = Mesh(node=P // gpus_per_node, local=gpus_per_node)
    intra = mesh.new_groups(ctx, "local")                 # the g ranks of a node
    rail = mesh.new_groups(ctx, "node")                   # one rank per node, same local index
    c = mesh.coords(ctx.rank)
    return NodeGroups(ctx.group, intra, rail, ctx.rank, c["node"], c["local"], mesh.sizes["node"], gpus_per_node, mesh)


@dataclass
class LevelBytes:
    """Bytes this rank sent, per level (``inter_node``, ``intra_node``, ``local``, ``meta``)
    and per phase (``dispatch``, ``combine``): ``bytes[phase][level]``; ``rows`` the same in rows."""

    bytes: dict = field(default_factory=lambda: {ph: dict.fromkeys(LEVELS, 0) for ph in ("dispatch", "combine")})
    rows: dict = field(default_factory=lambda: {ph: dict.fromkeys(LEVELS, 0) for ph in ("dispatch", "combine")})

    def add(self, phase: str, splits, dest_ranks, me: int, node_of, row_bytes: int) -> None:
        """Account one all-to-all: ``splits[j]`` rows to global rank ``dest_ranks[j]``."""
        for n, dest in zip(splits, dest_ranks):
            level = "local" if dest == me else "intra_node" if node_of(dest) == node_of(me) else "inter_node"
            self.rows[phase][level] += int(n)
            self.bytes[phase][level] += int(n) * row_bytes

    def total(self, level: str) -> int:
        return sum(self.bytes[ph][level] for ph in self.bytes)


def inter_node_rows(indices: torch.Tensor, keep: torch.Tensor, experts_per_node: int, my_node: int,
                    hierarchical: bool) -> int:
    """Rows a rank sends to other nodes in the dispatch, from its routing alone: flat = kept slots
    whose expert is on another node; hierarchical = distinct other nodes per token, summed.
    indices/keep [T, k]. With node-limited routing to M nodes, hierarchical <= M * T."""
    node = indices // experts_per_node
    remote = keep & (node != my_node)
    if not hierarchical:
        return int(remote.sum())
    n_nodes = int(node.max()) + 1 if node.numel() else 1
    hit = torch.zeros(indices.shape[0], max(n_nodes, my_node + 1), dtype=torch.bool, device=indices.device)
    hit.scatter_(1, torch.where(remote, node, torch.full_like(node, my_node)), True)
    hit[:, my_node] = False
    return int(hit.sum())


def _a2a_plain(x: torch.Tensor, input_splits, output_splits, group) -> torch.Tensor:
    """Non-differentiable uneven all-to-all (metadata: expert ids)."""
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    comm.all_to_all_single(out, x, output_splits, input_splits, group)
    return out


class HierarchicalExpertParallelMoE(ExpertParallelMoE):
    """:class:`~labkit.moe.expert_parallel.ExpertParallelMoE` (E/P experts per rank) whose
    dispatch and combine are two-level (``hierarchical=True``, module docstring) or the flat
    all-to-all (``hierarchical=False``), both counted per level in ``last_bytes``
    (:class:`LevelBytes`, this rank, forward). ``nodes``: :func:`make_node_groups`.
    ``forward(x [..., H]) -> (y, MoEStats)``; every rank must call it."""

    def __init__(self, cfg: MoEConfig, nodes: NodeGroups, hierarchical: bool = True):
        P = nodes.num_nodes * nodes.gpus_per_node
        super().__init__(cfg, nodes.world, nodes.rank, P)
        self.nodes, self.hierarchical = nodes, hierarchical
        self.last_bytes: LevelBytes | None = None

    @classmethod
    def from_dense(cls, layer: MoELayer, nodes: NodeGroups, hierarchical: bool = True):
        """This rank's shard of a single-device layer (same weights)."""
        return cls(replace(layer.cfg, token_groups=1), nodes, hierarchical)._copy_from(layer)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        r, stats = self.route_tokens(x2, shape[1] if x.dim() == 3 else None, mask)
        self.last_bytes = LevelBytes()
        if self.hierarchical:
            y = self._two_level(x2, r.indices, r.keep, r.weights)
        else:
            y = self._flat(x2, r.indices, r.keep, r.weights)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        return y.view(shape), stats

    # -- the local experts on rows tagged with their global expert id -----------------------
    def _run_local(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        local = expert - self.expert_offset
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.n_local_experts).tolist()
        out = run_experts(rows[order], counts, self.experts)
        return out[torch.argsort(order)]

    def _flat(self, x2, indices, keep, weights):
        """One row per kept slot straight to the expert's rank (the counted reference)."""
        nd, P, El = self.nodes, self.ep_size, self.n_local_experts
        row_bytes = x2.shape[1] * x2.element_size()
        slot = keep.reshape(-1).nonzero().squeeze(1)
        expert = indices.reshape(-1)[slot]
        order = torch.argsort(expert // El, stable=True)                     # by destination rank
        slot, expert = slot[order], expert[order]
        splits = torch.bincount(expert // El, minlength=P).tolist()
        tokens = slot // indices.shape[1]
        incoming = exchange_splits(splits, nd.world, x2.device)
        recv_expert = _a2a_plain(expert, splits, incoming, nd.world)
        self.last_bytes.bytes["dispatch"]["meta"] += expert.numel() * 8 + P * 8
        self.last_bytes.add("dispatch", splits, range(P), nd.rank, nd.node_of, row_bytes)
        received = all_to_all(x2[tokens], incoming, splits, nd.world)
        out = self._run_local(received, recv_expert)
        self.last_bytes.add("combine", incoming, range(P), nd.rank, nd.node_of, row_bytes)
        back = all_to_all(out, splits, incoming, nd.world)
        w = weights.reshape(-1)[slot].unsqueeze(1)
        return x2.new_zeros(x2.shape).index_add(0, tokens, back * w)

    def _two_level(self, x2, indices, keep, weights):
        nd = self.nodes
        T, k = indices.shape
        N, g, El = nd.num_nodes, nd.gpus_per_node, self.n_local_experts
        row_bytes = x2.shape[1] * x2.element_size()
        node = indices // (El * g)                                           # node of every slot's expert
        rail_ranks = nd.mesh.ranks("node", nd.rank)
        # 1. inter-node: token t once to every node n that holds one of its kept experts
        goes = torch.zeros(T, N, dtype=torch.bool, device=x2.device)         # goes[t, n]: t needs node n
        t_kept, j_kept = keep.nonzero(as_tuple=True)
        goes[t_kept, node[t_kept, j_kept]] = True
        pair = goes.t().nonzero()                                            # (node, token), node-major
        dest_node, token = pair[:, 0], pair[:, 1]
        splits = torch.bincount(dest_node, minlength=N).tolist()
        meta_e = torch.where((node[token] == dest_node[:, None]) & keep[token], indices[token],
                             torch.full_like(indices[token], -1))           # [n_pairs, k] ids on that node
        incoming = exchange_splits(splits, nd.rail, x2.device)
        recv_e = _a2a_plain(meta_e, splits, incoming, nd.rail)               # [n_arrived, k]
        self.last_bytes.add("dispatch", splits, rail_ranks, nd.rank, nd.node_of, row_bytes)
        self.last_bytes.bytes["dispatch"]["meta"] += meta_e.numel() * (8 + weights.element_size()) + N * 8
        arrived = all_to_all(x2[token], incoming, splits, nd.rail)           # [n_arrived, H]
        arrived_w = all_to_all(weights[token] * (meta_e >= 0), incoming, splits, nd.rail)   # [n_arrived, k]
        # 2. intra-node: one row per valid slot to the GPU of this node holding its expert
        a_slot = (recv_e.reshape(-1) >= 0).nonzero().squeeze(1)
        a_expert = recv_e.reshape(-1)[a_slot]
        dest_local = (a_expert // El) % g
        order = torch.argsort(dest_local, stable=True)
        a_slot, a_expert = a_slot[order], a_expert[order]
        isplits = torch.bincount(dest_local[order], minlength=g).tolist()
        node_ranks = nd.mesh.ranks("local", nd.rank)
        iincoming = exchange_splits(isplits, nd.intra, x2.device)
        recv_expert = _a2a_plain(a_expert, isplits, iincoming, nd.intra)
        self.last_bytes.add("dispatch", isplits, node_ranks, nd.rank, nd.node_of, row_bytes)
        self.last_bytes.bytes["dispatch"]["meta"] += a_expert.numel() * 8 + g * 8
        rows = all_to_all(arrived[a_slot // k], iincoming, isplits, nd.intra)
        out = self._run_local(rows, recv_expert)
        # 3. combine: back inside the node, weight and sum per arrived token, back over the rail
        self.last_bytes.add("combine", iincoming, node_ranks, nd.rank, nd.node_of, row_bytes)
        back = all_to_all(out, isplits, iincoming, nd.intra)                 # per forwarded slot
        w = arrived_w.reshape(-1)[a_slot].unsqueeze(1)
        partial = arrived.new_zeros(arrived.shape).index_add(0, a_slot // k, back * w)
        self.last_bytes.add("combine", incoming, rail_ranks, nd.rank, nd.node_of, row_bytes)
        home = all_to_all(partial, splits, incoming, nd.rail)                # [n_pairs, H]
        return x2.new_zeros(x2.shape).index_add(0, token, home)
