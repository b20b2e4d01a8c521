"""Exercises of notebook 14_moe_at_scale: EPLB, the hierarchical all-to-all, decoding cost.

* 14.1 balanced packing of expert groups onto nodes (EPLB step 1): every node the same number
  of groups, the heaviest node as light as the greedy "heaviest first, into the lightest node
  with room" makes it. Any packing at least that good passes.
* 14.2 replicas per expert for a measured load (EPLB step 2): R copies in all, at least one each,
  the largest load per copy as small as possible (the greedy "next copy to the expert with the
  highest load per copy" reaches the optimum; any counts with the same maximum pass).
* 14.3 the bytes one rank sends to OTHER nodes in the dispatch: flat (one row per slot) and
  hierarchical (one row per token and remote node), checked against
  :func:`labkit.moe.hierarchical.inter_node_rows`, which the tests tie to what real ranks send.
* 14.4 per-token bytes read and the latency bound of decoding (DeepSpeed-MoE sec. 5.1), for a
  :class:`labkit.moe.params.ModelSpec`: active parameters * bytes per parameter / bandwidth.

Ground truth: :mod:`labkit.moe.eplb`, :mod:`labkit.moe.hierarchical`, :mod:`labkit.moe.inference`.
"""
from __future__ import annotations

import torch

from ...moe.eplb import balanced_packing, replicate_experts
from ...moe.hierarchical import inter_node_rows
from ...moe.inference import LLAMA2_70B, LLAMA31_405B
from ...moe.params import DEEPSEEK_V3, MIXTRAL_8X7B, count_parameters
from ..registry import CheckFailure, exercise, expect_close

# ----------------------------------------------------------------------------- 14.1
ex141 = exercise(
    "14.1", title="balanced packing of expert groups onto nodes", notebook="14_moe_at_scale", points=3,
    hint="Go through the groups heaviest first; put each on the node with the smallest load so far among "
         "the nodes that still hold fewer than n_groups / n_nodes groups.")


def _as_ints(x, n, what):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if not isinstance(x, (list, tuple)) or len(x) != n or any(not isinstance(v, int) or isinstance(v, bool)
                                                               for v in x):
        raise CheckFailure(f"{what}: expected a list of {n} ints, got {x!r}")
    return list(x)


def _packing_case(loads, n_nodes, what):
    def case(pack_groups):
        got = _as_ints(pack_groups(list(loads), n_nodes), len(loads), f"{what}: node of each group")
        per = len(loads) // n_nodes
        if any(not 0 <= v < n_nodes for v in got):
            raise CheckFailure(f"{what}: node ids must be in 0..{n_nodes - 1}, got {got}")
        counts = [got.count(n) for n in range(n_nodes)]
        if counts != [per] * n_nodes:
            raise CheckFailure(f"{what}: every node must hold {per} groups, got {counts} groups per node "
                               f"(nodes {got})")
        node_load = [sum(l for l, n in zip(loads, got) if n == node) for node in range(n_nodes)]
        pack, _ = balanced_packing(torch.tensor([loads], dtype=torch.float64), n_nodes)
        best = max(sum(l for l, n in zip(loads, pack[0].tolist()) if n == node) for node in range(n_nodes))
        if max(node_load) > best + 1e-9:
            raise CheckFailure(f"{what}: the heaviest node carries {max(node_load):g} (node loads {node_load}); "
                               f"the greedy packing gets it down to {best:g}")
    return case


ex141.case("6 groups onto 2 nodes")(_packing_case([5, 1, 4, 2, 3, 3], 2, "pack_groups([5, 1, 4, 2, 3, 3], 2)"))
ex141.case("8 groups onto 4 nodes, one heavy group")(
    _packing_case([40, 5, 6, 7, 8, 9, 10, 11], 4, "pack_groups([40, 5, 6, 7, 8, 9, 10, 11], 4)"))
ex141.case("EPLB README layer 0: 12 experts in 4 groups onto 2 nodes", hidden=True)(
    _packing_case([262, 330, 116, 325], 2, "pack_groups(README groups, 2)"))
ex141.case("12 random groups onto 3 nodes", hidden=True)(
    _packing_case(torch.randint(1, 100, (12,), generator=torch.Generator().manual_seed(141)).tolist(), 3,
                  "pack_groups(12 random loads, 3)"))


# ----------------------------------------------------------------------------- 14.2
ex142 = exercise(
    "14.2", title="replicas per expert", notebook="14_moe_at_scale", points=3,
    hint="Start with one copy each; give each of the num_replicas - E extra copies, one at a time, to "
         "the expert whose load / copies is the largest right now.")


def _replica_case(load, R, what):
    def case(replica_counts):
        got = _as_ints(replica_counts(list(load), R), len(load), f"{what}: copies per expert")
        if min(got) < 1:
            raise CheckFailure(f"{what}: every expert needs at least one copy, got {got}")
        if sum(got) != R:
            raise CheckFailure(f"{what}: the copies must add up to num_replicas={R}, got {got} (sum {sum(got)})")
        _, _, cnt = replicate_experts(torch.tensor([load], dtype=torch.float64), R)
        best = max(l / c for l, c in zip(load, cnt[0].tolist()))
        mine = max(l / c for l, c in zip(load, got))
        if mine > best + 1e-9:
            raise CheckFailure(f"{what}: with copies {got} the busiest copy serves {mine:g} tokens; "
                               f"copies {cnt[0].tolist()} get it down to {best:g}")
    return case


ex142.case("loads [6, 3, 1] into 5 copies")(_replica_case([6, 3, 1], 5, "replica_counts([6, 3, 1], 5)"))
ex142.case("8 experts, 12 copies, a hot expert")(
    _replica_case([400, 20, 30, 50, 60, 10, 200, 30], 12, "replica_counts(8 loads, 12)"))
ex142.case("EPLB README layer 0 into 16 copies", hidden=True)(
    _replica_case([90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], 16, "replica_counts(README layer 0, 16)"))
ex142.case("no extra copies", hidden=True)(_replica_case([3, 1, 2, 5], 4, "replica_counts([3, 1, 2, 5], 4)"))


# ----------------------------------------------------------------------------- 14.3
ex143 = exercise(
    "14.3", title="inter-node bytes, flat vs hierarchical", notebook="14_moe_at_scale", points=3,
    hint="Node of a slot = expert // experts_per_node. Flat: count the slots whose node is not my_node. "
         "Hierarchical: count, per token, the DISTINCT nodes other than my_node. Multiply by hidden * "
         "bytes_per_element.")


def _routing(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def _bytes_case(indices, experts_per_node, my_node, H, nbytes, what):
    def case(inter_node_bytes):
        got = inter_node_bytes(indices.clone(), experts_per_node, my_node, H, nbytes)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (flat, hierarchical), got {got!r}")
        keep = torch.ones_like(indices, dtype=torch.bool)
        want = tuple(inter_node_rows(indices, keep, experts_per_node, my_node, h) * H * nbytes
                     for h in (False, True))
        for name, g_, w in zip(("flat", "hierarchical"), got, want):
            if isinstance(g_, torch.Tensor):
                g_ = g_.item()
            if g_ != w:
                raise CheckFailure(f"{what}: {name} inter-node bytes expected {w}, got {g_}")
    return case


_HAND = torch.tensor([[0, 5], [4, 5], [6, 1], [2, 3]])   # 2 nodes of experts 0-3 / 4-7; my node 0
ex143.case("4 tokens, k=2, 2 nodes, my node 0")(
    _bytes_case(_HAND, 4, 0, 16, 4, "inter_node_bytes(4 tokens, experts_per_node=4, my_node=0, H=16, fp32)"))
ex143.case("16 tokens, k=4, 4 nodes, my node 2")(
    _bytes_case(_routing(16, 4, 16, 143), 4, 2, 8, 2, "inter_node_bytes(16 tokens, k=4, 4 nodes, my_node=2, bf16)"))
ex143.case("32 tokens, k=8, 8 nodes, my node 5", hidden=True)(
    _bytes_case(_routing(32, 8, 64, 144), 8, 5, 32, 2, "inter_node_bytes(32 tokens, k=8, 8 nodes)"))


# ----------------------------------------------------------------------------- 14.4
ex144 = exercise(
    "14.4", title="bytes read per token and the latency bound", notebook="14_moe_at_scale", points=3,
    hint="At batch 1 a decoding step reads every parameter the token uses once: "
         "count_parameters(spec).active (for a dense model that is all of them) * bytes_per_param; "
         "the latency bound is that number of bytes / bandwidth (bytes per second).")


def _decode_case(spec, bpp, bw, what):
    def case(decode_bound):
        got = decode_bound(spec, bpp, bw)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (bytes_read, latency_s), got {got!r}")
        nbytes = count_parameters(spec).active * bpp
        expect_close(float(got[0]), float(nbytes), f"{what}: bytes read per token", rtol=1e-6, atol=0)
        expect_close(float(got[1]), nbytes / bw, f"{what}: latency bound in seconds", rtol=1e-6, atol=0)
    return case


ex144.case("Mixtral 8x7B, bf16, 3.35 TB/s")(_decode_case(MIXTRAL_8X7B, 2, 3.35e12, "decode_bound(Mixtral 8x7B)"))
ex144.case("Llama 2 70B (dense), bf16, 3.35 TB/s")(_decode_case(LLAMA2_70B, 2, 3.35e12, "decode_bound(Llama 2 70B)"))
ex144.case("DeepSeek-V3, fp8, 3.35 TB/s", hidden=True)(_decode_case(DEEPSEEK_V3, 1, 3.35e12, "decode_bound(DeepSeek-V3)"))
ex144.case("Llama 3.1 405B, fp8, 4.8 TB/s", hidden=True)(
    _decode_case(LLAMA31_405B, 1, 4.8e12, "decode_bound(Llama 3.1 405B)"))

