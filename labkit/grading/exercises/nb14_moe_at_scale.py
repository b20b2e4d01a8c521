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
  :class:`labkit.plan.spec.ModelSpec`: active parameters * bytes per parameter / bandwidth.

Ground truth: :mod:`labkit.moe.eplb`, :mod:`labkit.moe.hierarchical`, :mod:`labkit.plan.params`.
"""
from __future__ import annotations

import torch

from ...moe.eplb import balanced_packing, replicate_experts
from ...moe.hierarchical import inter_node_rows
from ...plan.params import count_parameters
from ...plan.spec import preset
from ..registry import CheckFailure, _shown, as_int, exercise, expect_named, type_name

# ----------------------------------------------------------------------------- 14.1
ex141 = exercise(
    "14.1", title="balanced packing of expert groups onto nodes", notebook="14_moe_at_scale", points=3,
    hint=("Section 1 (EPLB step 1): the docstring fixes the greedy's order and its choice. Which nodes are candidates "
          "for the next group, and does your code respect that every node ends with the same number of groups?"))
ex141.hint2 = ("Check a case by hand: groups of loads 4, 3, 2 and 1 on 2 nodes. Which node does each group go to, and "
               "is a node still a candidate once it is full?")
ex141.hint_review = ("leads: asks which nodes are candidates and gives a hand example; the greedy is the docstring's; "
                     "reviewed 2026-12-06")


def _as_ints(x, n, what):
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if not isinstance(x, (list, tuple)) or len(x) != n:
        raise CheckFailure(f"{what}: expected a list of {n} ints, got {_shown(x)}")
    bad = [v for v in x if as_int(v) is None]
    if bad:
        raise CheckFailure(f"{what}: expected a list of {n} ints, got {type_name(bad[0])} among them")
    return [as_int(v) for v in x]


def _packing_case(loads, n_nodes, what):
    def case(pack_groups):
        got = _as_ints(pack_groups(list(loads), n_nodes), len(loads), f"{what}: node of each group")
        per = len(loads) // n_nodes
        if any(not 0 <= v < n_nodes for v in got):
            raise CheckFailure(f"{what}: node ids must be in 0..{n_nodes - 1}, got {got}")
        counts = [got.count(n) for n in range(n_nodes)]
        if counts != [per] * n_nodes:
            twice = ""
            if len(set(loads)) < len(loads) and got == _placed_by_value(loads, n_nodes):
                twice = (" (groups with equal loads: each group was found by its load, so the first of them was "
                         "placed again and the others never)")
            raise CheckFailure(f"{what}: every node must hold {per} groups, got {counts} groups per node "
                               f"(nodes {got}){twice}")
        node_load = [sum(l for l, n in zip(loads, got) if n == node) for node in range(n_nodes)]
        pack, _ = balanced_packing(torch.tensor([loads], dtype=torch.float64), n_nodes)
        best = max(sum(l for l, n in zip(loads, pack[0].tolist()) if n == node) for node in range(n_nodes))
        if max(node_load) > best + 1e-9:
            # every named mistake that makes this packing (two can coincide on a small case: say both)
            whys = [text[2:-1] for order, rule, text in _PACKING_MISTAKES
                    if got == _greedy_packing(loads, n_nodes, order, rule)] + _sorting_mistakes(loads, n_nodes, got)
            why = f" ({'; or '.join(whys)})" if whys else ""
            if not why and got == [g // per for g in range(len(loads))]:
                why = " (the groups placed in order, per consecutive groups on a node: the loads were not looked at)"
            raise CheckFailure(f"{what}: the heaviest node carries {max(node_load):g} (node loads {node_load}); "
                               f"the greedy packing gets it down to {best:g}{why}")
    return case


# Plausible wrong packings, to name the mistake: (order of the groups, how the node is picked, message)
_PACKING_MISTAKES = [
    ("given", "lightest", " (the groups were placed in the order they are given: the order matters, which group "
                          "should be placed while every node is still empty?)"),
    ("lightest", "lightest", " (the groups were placed lightest first: the big groups came last, when nothing "
                             "was left to even them out)"),
    ("heaviest", "in_turn", " (each group went to the next node in turn: the loads already on the nodes were "
                            "not looked at)"),
    ("heaviest", "fill", " (the nodes were filled one after the other, which is also what choosing the most loaded "
                         "node with room does: the node was not chosen by how it evens out the loads)"),
]


def _greedy_over(loads, n_nodes, groups):
    """The docstring's node choice (lightest node with room) over the groups in the order ``groups``."""
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for g in groups:
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


def _sorting_mistakes(loads, n_nodes, got):
    """Why ``got`` is a right greedy misled by its sort of the (negated) loads: a list of 0 or 1 texts (issue 36)."""
    order = sorted(range(len(loads)), key=lambda i: -loads[i])  # heaviest first, the groups' numbers
    rank = [0] * len(loads)
    for j, g in enumerate(order):
        rank[g] = j
    if rank != order and got == _greedy_over(loads, n_nodes, rank):
        return ["the groups were visited in the order of each group's place in the heaviest-first sort: the "
                "inverse of the sort, e.g. an argsort of the argsort of the negated loads; a sort's result lists "
                "the group that comes first, second, ..."]
    right = _greedy_over(loads, n_nodes, order)
    if got != right and got == [right[g] for g in order]:
        return ["the nodes come back in the heaviest-first order of the sorted loads: entry g of the result is "
                "the node of group g, in the order the groups are given"]
    return []


def _placed_by_value(loads, n_nodes):
    """The packing of a greedy that sorts the load values and finds each group by ``loads.index(value)``."""
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for value in sorted(loads, key=lambda v: -v):
        g = loads.index(value)
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + value, count[n] + 1
    return node


def _greedy_packing(loads, n_nodes, order, rule):
    """The packing a plausible wrong greedy makes (see :data:`_PACKING_MISTAKES`)."""
    per = len(loads) // n_nodes
    groups = list(range(len(loads)))
    if order != "given":
        groups.sort(key=lambda i: loads[i] if order == "lightest" else -loads[i])
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for j, g in enumerate(groups):
        room = [m for m in range(n_nodes) if count[m] < per]
        if rule == "in_turn":
            n = room[0] if j % n_nodes not in room else j % n_nodes
        elif rule == "fill":
            n = room[0]
        else:
            n = min(room, key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


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
    hint=("Section 2 (EPLB step 2): another copy of an expert lightens each of its copies. Which expert should the "
          "next copy go to, so that the copy carrying the most becomes lighter?"))
ex142.hint2 = ("Compare experts by what each of their copies carries now: not by total load, and not by the load "
               "after the new copy. Does the order in which you place copies matter?")
ex142.hint_review = ("leads: asks which expert the next copy helps and by what to compare; no loop or arg-max written "
                     "out; reviewed 2026-12-06")


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
            why = ""
            if got == _greedy_counts(load, R, after_copy=True):
                why = (" (these are the counts of a greedy that judges each expert by the load its copies would "
                       "carry AFTER one more copy: the copy must go where the busiest copy is now)")
            elif got == _greedy_counts(load, R, by_total=True):
                why = " (each copy went by the expert's total load, which ignores the copies it already has)"
            elif max(got) - min(got) <= 1 and len(set(got)) <= 2 and sorted(got, reverse=True) == got:
                why = " (the copies spread evenly over the experts, whatever their load)"
            raise CheckFailure(f"{what}: with copies {got} the busiest copy serves {mine:g} tokens; "
                               f"copies {cnt[0].tolist()} get it down to {best:g}{why}")
    return case


def _greedy_counts(load, R, after_copy=False, by_total=False):
    """Two plausible wrong greedies, to name the mistake: extra copies by load/(copies+1), or by load."""
    cnt = [1] * len(load)
    for _ in range(R - len(load)):
        e = max(range(len(load)), key=lambda i: load[i] if by_total else load[i] / (cnt[i] + after_copy))
        cnt[e] += 1
    return cnt


ex142.case("loads [6, 3, 1] into 5 copies")(_replica_case([6, 3, 1], 5, "replica_counts([6, 3, 1], 5)"))
ex142.case("8 experts, 12 copies, a hot expert")(
    _replica_case([400, 20, 30, 50, 60, 10, 200, 30], 12, "replica_counts(8 loads, 12)"))
ex142.case("loads [30, 14, 3] into 6 copies: the busiest copy now, not after the next copy")(
    _replica_case([30, 14, 3], 6, "replica_counts([30, 14, 3], 6)"))
ex142.case("EPLB README layer 0 into 16 copies", hidden=True)(
    _replica_case([90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], 16, "replica_counts(README layer 0, 16)"))
ex142.case("no extra copies", hidden=True)(_replica_case([3, 1, 2, 5], 4, "replica_counts([3, 1, 2, 5], 4)"))


# ----------------------------------------------------------------------------- 14.3
ex143 = exercise(
    "14.3", title="inter-node bytes, flat vs hierarchical", notebook="14_moe_at_scale", points=3,
    hint=("Section 3: the flat dispatch crosses InfiniBand once per token-slot, the hierarchical one once per token "
          "and remote node. For one token, how do you find the nodes its experts live on?"))
ex143.hint2 = ("Check one token whose two experts sit on the same remote node, and one whose expert is on my_node: "
               "how many rows does each send across in each scheme?")
ex143.hint_review = ("leads: restates the two schemes of section 3 and asks how to find a token's nodes; no operation "
                     "named; reviewed 2026-12-06")


def _routing(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])


def _bytes_case(indices, experts_per_node, my_node, H, nbytes, what):
    def case(inter_node_bytes):
        got = inter_node_bytes(indices.clone(), experts_per_node, my_node, H, nbytes)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (flat, hierarchical), got {_shown(got)}")
        keep = torch.ones_like(indices, dtype=torch.bool)
        want = tuple(inter_node_rows(indices, keep, experts_per_node, my_node, h) * H * nbytes
                     for h in (False, True))
        for j, (name, g_, w) in enumerate(zip(("flat", "hierarchical"), got, want)):
            if isinstance(g_, torch.Tensor):
                g_ = g_.item()
            if g_ != w:
                rows = w // (H * nbytes)
                slots = int(indices.numel())
                other = got[1 - j].item() if isinstance(got[1 - j], torch.Tensor) else got[1 - j]
                swapped = [(want[1 - j], "the two numbers swapped: the pair is (flat, hierarchical)")] \
                    if other == w else []
                per_slot = [(want[0], "counted per routed slot, as the flat dispatch is: a token whose experts share "
                                      "a remote node crosses to it once")] if j == 1 else []
                expect_named(g_, w, f"{what}: {name} inter-node bytes", swapped + per_slot + [

                    (rows * H, "elements, not bytes: each is bytes_per_element bytes"),
                    (rows, "rows, not bytes: a row is hidden values"),
                    (slots * H * nbytes, "every routed slot, the ones to this node's own experts too: those stay on "
                                         "the node")])
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
    hint=("Section 4 (DeepSpeed-MoE sec. 5.1): at batch size 1 decoding is memory-bound: each generated token reads "
          "every weight it uses once. Which parameters does one token use in an MoE model, and how long does reading "
          "those bytes take at the given bandwidth?"))
ex144.hint2 = ("For a dense model, which count do you expect, and does your function give it? Check the units: bytes "
               "per second in, seconds out.")
ex144.hint_review = ("leads: asks which parameters a token reads and checks units; the docstring already names the "
                     "counter; reviewed 2026-12-06")


def _decode_case(spec, bpp, bw, what):
    def case(decode_bound):
        got = decode_bound(spec, bpp, bw)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (bytes_read, latency_s), got {_shown(got)}")
        nbytes = count_parameters(spec).active * bpp
        total = count_parameters(spec).total * bpp
        expect_named(float(got[0]), float(nbytes), f"{what}: bytes read per token", [
            (nbytes / 1e9, "in GB: the number of bytes is asked"),
            (nbytes * 8, "in bits: the number of bytes is asked"),
            (float(total), "every expert's weights: a token reads only the k experts it is routed to"),
            (float(count_parameters(spec).active), "parameters, not bytes: each weighs bytes_per_param")], rtol=1e-6)
        expect_named(float(got[1]), nbytes / bw, f"{what}: latency bound in seconds", [
            (nbytes / bw * 1e3, "in milliseconds: seconds are asked"),
            (nbytes / bw * 1e6, "in microseconds: seconds are asked"),
            (bw / nbytes, "the inverse: that is tokens per second")], rtol=1e-6)
    return case


MIXTRAL_8X7B, DEEPSEEK_V3 = preset("mixtral-8x7b"), preset("deepseek-v3")
LLAMA2_70B, LLAMA31_405B = preset("llama2-70b"), preset("llama3.1-405b")
ex144.case("Mixtral 8x7B, bf16, 3.35 TB/s")(_decode_case(MIXTRAL_8X7B, 2, 3.35e12, "decode_bound(Mixtral 8x7B)"))
ex144.case("Llama 2 70B (dense), bf16, 3.35 TB/s")(_decode_case(LLAMA2_70B, 2, 3.35e12, "decode_bound(Llama 2 70B)"))
ex144.case("DeepSeek-V3, fp8, 3.35 TB/s", hidden=True)(
    _decode_case(DEEPSEEK_V3, 1, 3.35e12, "decode_bound(DeepSeek-V3)"))
ex144.case("Llama 3.1 405B, fp8, 4.8 TB/s", hidden=True)(
    _decode_case(LLAMA31_405B, 1, 4.8e12, "decode_bound(Llama 3.1 405B)"))



# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from dataclasses import replace as _replace  # noqa: E402

from ..fresh import fresh_case, seed  # noqa: E402


def _draw_packing(r):
    n_nodes, per = r.randint(1, 4), r.randint(1, 4)
    loads = r.sample(range(1, 1000), n_nodes * per)   # distinct loads: one greedy order
    return loads, n_nodes, f"pack_groups({len(loads)} random loads, {n_nodes})"


def _draw_replicas(r):
    E = r.randint(1, 10)
    load = [r.randint(1, 500) for _ in range(E)]
    return load, E + r.randint(0, 2 * E), f"replica_counts({E} random loads)"


def _draw_inter_node(r):
    nodes, per = r.randint(1, 8), r.randint(1, 8)
    E = nodes * per
    T, k = r.randint(1, 32), r.randint(1, min(E, 8))
    g = torch.Generator().manual_seed(seed(r))
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return (idx, per, r.randrange(nodes), r.choice((8, 16, 32, 7168)), r.choice((1, 2, 4)),
            f"inter_node_bytes({T} tokens, k={k}, {nodes} nodes)")


_DECODE_MODELS = ("mixtral-8x7b", "deepseek-v3", "llama2-70b", "llama3.1-405b", "gpt3-175b", "megatron-8.3b")


def _draw_decode(r):
    """A preset with random layers, vocabulary and (for an MoE) experts: no table of the presets fits it."""
    spec = preset(r.choice(_DECODE_MODELS))
    kw = dict(name="a random model", n_layer=spec.first_dense_layers + r.randint(1, spec.n_layer),
              vocab_size=r.randint(1000, 200000))
    if spec.n_routed_experts:
        E = r.randint(2, spec.n_routed_experts)
        kw.update(n_routed_experts=E, n_activated_experts=r.randint(1, min(E, spec.n_activated_experts)))
    return (_replace(spec, **kw), r.choice((0.5, 1, 2, 4)), r.choice((0.9e12, 2.0e12, 3.35e12, 4.8e12, 8e12)),
            "decode_bound(a random model)")


fresh_case(ex141, "random loads and nodes", _draw_packing, _packing_case)
fresh_case(ex142, "random loads and copies", _draw_replicas, _replica_case)
fresh_case(ex143, "random routing, nodes, H and bytes", _draw_inter_node, _bytes_case)
fresh_case(ex144, "random model, bytes per parameter and bandwidth", _draw_decode, _decode_case)
