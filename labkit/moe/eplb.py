"""EPLB: the expert-parallel load balancer (redundant experts and their placement).

Under expert parallelism the unit that waits is the GPU: a step takes as long as the GPU
with the most tokens, so what must be balanced is the load per GPU, not per expert
(DeepSeek-V2 sec. 2.2.3, device-level balance loss). DeepSeek-V3 (report sec. 3.4,
"redundant experts") adds a second tool at deployment time: measure the load of every
expert, duplicate the heaviest ones, and place the copies so that every GPU gets about the
same number of tokens. DeepSeek released the placement algorithm as EPLB
(github.com/deepseek-ai/EPLB); :func:`rebalance_experts` has its interface and meaning and is
written here from the algorithm's description.

Words: a *logical* expert is one of the model's E experts (one set of weights in the
checkpoint); a *physical* expert (a replica) is a copy of one logical expert's weights on one
GPU. There are R = ``num_replicas`` >= E physical experts, R/G on each of the G GPUs; GPU g
holds physical experts ``g*R/G .. (g+1)*R/G - 1``. A logical expert with c copies has its
tokens split among them, so each copy serves about load/c.

Two policies (EPLB README, "Hierarchical" / "Global load balancing"):

* hierarchical, when the expert groups divide evenly over the nodes (``num_groups % num_nodes
  == 0``; the groups of DeepSeek-V3's node-limited routing): (1) pack the expert GROUPS onto
  the nodes, every node the same number of groups, node loads balanced; (2) inside each node,
  replicate its experts to R/N physical experts, each extra copy going to the expert with the
  highest load per copy; (3) pack each node's physical experts onto its GPUs, R/G per GPU,
  GPU loads balanced. A group's experts stay on one node, so the routing's node limit still
  bounds the inter-node traffic.
* global otherwise: the same with one group and one node (replicate over all experts, pack
  the copies onto all GPUs).

Both packings are the greedy "largest first, into the lightest bin that still has room"
(LPT scheduling with equal bin sizes). Ties break towards the lower index.
"""
from __future__ import annotations

import torch

__all__ = ["balanced_packing", "replicate_experts", "rebalance_experts", "gpu_loads", "contiguous_gpu_loads",
           "imbalance"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack n weighted items into ``num_packs`` packs of exactly n/num_packs items each, with
    the pack weights as equal as the greedy gets them.

    weight [L, n] (one row per layer, packed independently) -> (pack_index [L, n] int64: the
    pack of each item, rank_in_pack [L, n] int64: its position inside the pack, 0, 1, ...).

    Steps, per row: take the items heaviest first; put each into the lightest pack that still
    has a free place (ties: the lowest pack index); its rank is the number of items the pack
    held before. With one item per pack, item i goes to pack i.
    Example: weights [5, 1, 4, 2] into 2 packs -> 5 to pack 0, 4 to pack 1, 2 to pack 1
    (4 < 5), 1 to pack 0: pack_index [0, 0, 1, 1], rank_in_pack [0, 1, 0, 1], loads 6 and 6.
    Raises ValueError when num_packs does not divide n.
    """
    L, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items cannot be split evenly into {num_packs} packs")
    per_pack = n // num_packs
    pack_index = torch.empty(L, n, dtype=torch.int64)
    rank_in_pack = torch.empty(L, n, dtype=torch.int64)
    if per_pack == 1:
        pack_index[:] = torch.arange(n)
        rank_in_pack[:] = 0
        return pack_index, rank_in_pack
    for layer in range(L):
        w = weight[layer].double()
        loads, sizes = [0.0] * num_packs, [0] * num_packs
        for item in torch.argsort(-w, stable=True).tolist():          # heaviest first
            open_packs = [p for p in range(num_packs) if sizes[p] < per_pack]
            p = min(open_packs, key=lambda q: loads[q])                 # lightest; first on ties
            pack_index[layer, item], rank_in_pack[layer, item] = p, sizes[p]
            loads[p] += float(w[item])
            sizes[p] += 1
    return pack_index, rank_in_pack


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn E logical experts into ``num_phy`` physical ones so that the largest load per copy
    is as small as the greedy gets it.

    weight [L, E] -> (phy2log [L, num_phy]: logical expert of each physical one, rank
    [L, num_phy]: which copy of its expert it is (0 = the original), logcnt [L, E]: copies per
    logical expert, at least 1, summing to num_phy).

    Steps, per row: physical experts 0..E-1 are the E experts themselves; each further one is
    a copy of the expert whose load per copy, ``weight[e] / logcnt[e]``, is the highest now
    (ties: the lowest expert id). Example: loads [6, 3, 1], 5 physical -> copies of expert 0
    (6/1), then expert 0 again (3 vs 3: ties go to the lower id) : logcnt [3, 1, 1].
    Raises ValueError when num_phy < E.
    """
    L, E = weight.shape
    if num_phy < E:
        raise ValueError(f"num_replicas={num_phy} must be >= the number of logical experts {E}")
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(L, 1)
    rank = torch.zeros(L, num_phy, dtype=torch.int64)
    logcnt = torch.ones(L, E, dtype=torch.int64)
    for layer in range(L):
        for p in range(E, num_phy):
            e = int(torch.argmax(weight[layer].double() / logcnt[layer]))   # first maximum on ties
            phy2log[layer, p], rank[layer, p] = e, logcnt[layer, e]
            logcnt[layer, e] += 1
    return phy2log, rank, logcnt


def _hierarchical(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """The three steps of the hierarchical policy (module docstring). Returns (phy2log,
    phyrank, logcnt) as :func:`rebalance_experts` before the log2phy table is built."""
    L, E = weight.shape
    group_size = E // num_groups
    experts_per_node, phy_per_node = E // num_nodes, num_replicas // num_nodes
    gpus_per_node, phy_per_gpu = num_gpus // num_nodes, num_replicas // num_gpus

    # Step 1: pack the expert groups onto the nodes by their summed load.
    group_load = weight.view(L, num_groups, group_size).sum(-1)                    # [L, groups]
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    # node_experts[l, n] = the logical experts node n holds, in order (group rank, then id)
    node_experts = torch.empty(L, num_nodes, experts_per_node, dtype=torch.int64)
    for layer in range(L):
        for g in range(num_groups):
            n, slot = int(group_node[layer, g]), int(group_rank[layer, g])
            node_experts[layer, n, slot * group_size:(slot + 1) * group_size] = \
                torch.arange(g * group_size, (g + 1) * group_size)

    phy2log = torch.empty(L, num_replicas, dtype=torch.int64)
    phyrank = torch.empty(L, num_replicas, dtype=torch.int64)
    logcnt = torch.empty(L, E, dtype=torch.int64)
    for layer in range(L):
        for n in range(num_nodes):
            experts = node_experts[layer, n]                                        # [E/N] logical ids
            w = weight[layer, experts][None]                                        # [1, E/N]
            # Step 2: replicate the node's experts to R/N physical experts.
            local_p2l, local_rank, local_cnt = replicate_experts(w, phy_per_node)
            logcnt[layer, experts] = local_cnt[0]
            # Step 3: pack those physical experts onto the node's GPUs by their load per copy.
            per_copy = (w / local_cnt)[0, local_p2l[0]][None]                       # [1, R/N]
            gpu, pos = balanced_packing(per_copy, gpus_per_node)
            where = n * phy_per_node + gpu[0] * phy_per_gpu + pos[0]                # global physical slot
            phy2log[layer, where] = experts[local_p2l[0]]
            phyrank[layer, where] = local_rank[0]
    return phy2log, phyrank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB's entry point: replicate and place the experts of every MoE layer from their load.

    Args:
        weight: [layers, E] measured load of every logical expert (tokens routed to it, e.g.
            summed over recent steps); non-negative.
        num_replicas: R, physical experts per layer, a multiple of ``num_gpus`` and >= E.
        num_groups: expert groups (consecutive blocks of E/num_groups experts; the groups of
            group-/node-limited routing). Must divide E.
        num_nodes: N, server nodes (the fast link, e.g. NVLink, is inside a node).
        num_gpus: G, GPUs in all, a multiple of N.

    Returns (all int64):
        phy2log: [layers, R], the logical expert of each physical expert; GPU g holds physical
            experts g*R/G .. (g+1)*R/G - 1.
        log2phy: [layers, E, X] with X = the largest replica count, the physical experts of
            each logical expert (copy 0, 1, ...), padded with -1.
        logcnt: [layers, E], copies of each logical expert (>= 1, summing to R per layer).

    Policy: hierarchical when ``num_groups % num_nodes == 0`` (groups packed onto nodes,
    replication within each node, copies packed onto that node's GPUs), else global (one group,
    one node). See the module docstring for the steps; ties break towards lower indices.
    Raises ValueError naming the values for any size that does not fit these rules.
    """
    if weight.dim() != 2:
        raise ValueError(f"weight must be [layers, experts], got shape {tuple(weight.shape)}")
    L, E = weight.shape
    for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                    ("num_gpus", num_gpus)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if num_replicas < E:
        raise ValueError(f"num_replicas={num_replicas} must be >= the {E} logical experts")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus} "
                         f"(every GPU holds the same number of physical experts)")
    if E % num_groups:
        raise ValueError(f"the {E} experts cannot be split into num_groups={num_groups} equal groups")
    weight = weight.detach().double().cpu()
    if bool((weight < 0).any()):
        raise ValueError("weight (the measured expert loads) must be non-negative")
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    X = int(logcnt.max())
    log2phy = torch.full((L, E, X), -1, dtype=torch.int64)
    for layer in range(L):
        for p in range(num_replicas):
            log2phy[layer, phy2log[layer, p], phyrank[layer, p]] = p
    return phy2log, log2phy, logcnt


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load of every GPU under a placement, each logical expert's load split evenly over its
    copies: weight [L, E], phy2log [L, R], logcnt [L, E] -> [L, num_gpus] (float64)."""
    w = weight.detach().double().cpu()
    per_copy = (w / logcnt).gather(1, phy2log)                                       # [L, R]
    return per_copy.view(w.shape[0], num_gpus, -1).sum(-1)


def contiguous_gpu_loads(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Load of every GPU without EPLB: expert e on GPU e // (E/G), one copy each.
    weight [L, E] -> [L, num_gpus] (float64). Raises ValueError when G does not divide E."""
    L, E = weight.shape
    if E % num_gpus:
        raise ValueError(f"{E} experts cannot be split evenly over {num_gpus} GPUs")
    return weight.detach().double().cpu().view(L, num_gpus, E // num_gpus).sum(-1)


def imbalance(loads: torch.Tensor) -> torch.Tensor:
    """max / mean of the loads along the last dim (1.0 = perfectly balanced): [..., G] -> [...]."""
    loads = loads.double()
    return loads.max(-1).values / loads.mean(-1)
