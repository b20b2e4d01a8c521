"""Exercises of notebook 14_moe_at_scale: the solutions pass, plausible wrong answers fail with a
message that says what was expected and what came back."""
import pytest

from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails
from labkit.plan.params import count_parameters


def pack_groups(loads, n_nodes):
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for g in sorted(range(len(loads)), key=lambda i: -loads[i]):
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


def round_robin(loads, n_nodes):
    """Wrong: ignores the loads."""
    return [g % n_nodes for g in range(len(loads))]


def greedy_without_room_limit(loads, n_nodes):
    """Wrong: lightest node, but nodes may end up with different numbers of groups."""
    node_load, node = [0.0] * n_nodes, [0] * len(loads)
    for g in sorted(range(len(loads)), key=lambda i: -loads[i]):
        n = min(range(n_nodes), key=lambda m: node_load[m])
        node[g], node_load[n] = n, node_load[n] + loads[g]
    return node


def replica_counts(load, num_replicas):
    cnt = [1] * len(load)
    for _ in range(num_replicas - len(load)):
        e = max(range(len(load)), key=lambda i: load[i] / cnt[i])
        cnt[e] += 1
    return cnt


def all_extras_to_the_heaviest(load, num_replicas):
    """Wrong: every extra copy goes to the expert with the highest total load."""
    cnt = [1] * len(load)
    cnt[max(range(len(load)), key=lambda i: load[i])] += num_replicas - len(load)
    return cnt


def proportional_rounding(load, num_replicas):
    """Wrong: copies proportional to the load, rounded (can be 0 and need not sum to R)."""
    return [round(num_replicas * l / sum(load)) for l in load]


def inter_node_bytes(indices, experts_per_node, my_node, hidden, bytes_per_element):
    node = indices // experts_per_node
    flat = int((node != my_node).sum())
    hier = sum(len(set(row.tolist()) - {my_node}) for row in node)
    return flat * hidden * bytes_per_element, hier * hidden * bytes_per_element


def hierarchical_per_slot(indices, experts_per_node, my_node, hidden, bytes_per_element):
    """Wrong: the hierarchical count is the flat one (tokens not de-duplicated per node)."""
    flat, _ = inter_node_bytes(indices, experts_per_node, my_node, hidden, bytes_per_element)
    return flat, flat


def counting_my_own_node(indices, experts_per_node, my_node, hidden, bytes_per_element):
    """Wrong: the token's own node counts as inter-node."""
    node = indices // experts_per_node
    return (indices.numel() * hidden * bytes_per_element,
            sum(len(set(r.tolist())) for r in node) * hidden * bytes_per_element)


def decode_bound(spec, bytes_per_param, bandwidth):
    nbytes = count_parameters(spec).active * bytes_per_param
    return nbytes, nbytes / bandwidth


def decode_bound_total(spec, bytes_per_param, bandwidth):
    """Wrong: reads ALL parameters of the MoE per token."""
    nbytes = count_parameters(spec).total * bytes_per_param
    return nbytes, nbytes / bandwidth


def decode_bound_gigabytes(spec, bytes_per_param, bandwidth):
    """Wrong units: GB instead of bytes."""
    nbytes = count_parameters(spec).active * bytes_per_param
    return nbytes / 1e9, nbytes / bandwidth


def test_solutions_pass():
    for ex, answer in (("14.1", pack_groups), ("14.2", replica_counts), ("14.3", inter_node_bytes),
                       ("14.4", decode_bound)):
        assert_check_passes(ex, answer)


def test_packing_wrong_answers_fail():
    assert_check_fails("14.1", round_robin, contains="the heaviest node carries 12 (node loads [12, 6])")
    assert_check_fails("14.1", greedy_without_room_limit, contains="every node must hold 2 groups, got [1, 3, 2, 2]")


def test_replica_wrong_answers_fail():
    assert_check_fails("14.2", all_extras_to_the_heaviest, contains="the busiest copy serves")
    assert_check_fails("14.2", proportional_rounding, contains="every expert needs at least one copy")


def packing_in_given_order(loads, n_nodes):
    """Wrong: the groups in the order given, each to the lightest node with room."""
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for g in range(len(loads)):
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


def packing_lightest_first(loads, n_nodes):
    """Wrong: lightest group first."""
    order = sorted(range(len(loads)), key=lambda i: loads[i])
    node = packing_in_given_order([loads[i] for i in order], n_nodes)
    out = [0] * len(loads)
    for j, g in enumerate(order):
        out[g] = node[j]
    return out


def packing_fill_nodes_in_turn(loads, n_nodes):
    """Wrong: heaviest first, but node 0 is filled, then node 1, ..."""
    per = len(loads) // n_nodes
    out = [0] * len(loads)
    for j, g in enumerate(sorted(range(len(loads)), key=lambda i: -loads[i])):
        out[g] = j // per
    return out


def packing_next_node_in_turn(loads, n_nodes):
    """Wrong: heaviest first, each to the next node in turn."""
    out = [0] * len(loads)
    for j, g in enumerate(sorted(range(len(loads)), key=lambda i: -loads[i])):
        out[g] = j % n_nodes
    return out


def replicas_after_the_copy(load, num_replicas):
    """Wrong: the next copy to the largest load / (copies + 1)."""
    cnt = [1] * len(load)
    for _ in range(num_replicas - len(load)):
        cnt[max(range(len(load)), key=lambda i: load[i] / (cnt[i] + 1))] += 1
    return cnt


@pytest.mark.parametrize("wrong, case, contains", [
    (packing_in_given_order, "6 groups", "placed in the order they are given"),
    (packing_lightest_first, "6 groups", "placed lightest first"),
    (packing_fill_nodes_in_turn, "6 groups", "filled one after the other"),
    (packing_next_node_in_turn, "6 groups", "went to the next node in turn"),
])
def test_packing_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("14.1", wrong, case, contains=contains)


def test_replicas_by_load_after_the_copy_fail_a_public_case():
    assert_public_case_fails("14.2", replicas_after_the_copy, "loads [30, 14, 3]",
                             contains="with copies [4, 1, 1] the busiest copy serves 14 tokens; copies [3, 2, 1] "
                                      "get it down to 10 (these are the counts of a greedy that judges each expert "
                                      "by the load its copies would carry AFTER one more copy")


def test_bytes_wrong_answers_fail():
    assert_check_fails("14.3", hierarchical_per_slot,
                       contains="hierarchical inter-node bytes: expected 192, got 256 (counted per routed slot")
    assert_check_fails("14.3", counting_my_own_node,
                       contains="flat inter-node bytes: expected 256, got 512 (every routed slot, the ones to")


def test_decode_wrong_answers_fail():
    assert_check_fails("14.4", decode_bound_total, contains="bytes read per token")
    assert_check_fails("14.4", decode_bound_gigabytes, contains="bytes read per token")


def test_integers_of_any_kind_are_accepted():
    """Issue 36: node numbers and replica counts as NumPy ints or 0-d int tensors are ints."""
    from labkit.grading.testing import with_ints_as
    for kind in ("numpy", "tensor"):
        assert_check_passes("14.1", with_ints_as(kind, pack_groups))
        assert_check_passes("14.2", with_ints_as(kind, replica_counts))


@pytest.mark.parametrize("ex, wrong, case, contains", [
    ("14.1", lambda loads, n: [g // (len(loads) // n) for g in range(len(loads))], "6 groups onto 2 nodes",
     "the loads were not looked at"),
    ("14.2", lambda load, R: [1 + (R - len(load)) // len(load) + (1 if i < (R - len(load)) % len(load) else 0)
                              for i in range(len(load))], "8 experts, 12 copies",
     "the copies spread evenly over the experts"),
    ("14.3", lambda *a: inter_node_bytes(*a)[::-1], "4 tokens, k=2", "the two numbers swapped"),
    ("14.3", lambda i, e, m, h, b: tuple(v // b for v in inter_node_bytes(i, e, m, h, b)), "4 tokens, k=2",
     "elements, not bytes"),
    ("14.4", lambda spec, b, bw: (lambda n: (n / 1e9, n / bw))(count_parameters(spec).active * b), "Mixtral 8x7B",
     "in GB: the number of bytes is asked"),
    ("14.4", lambda spec, b, bw: (lambda n: (n, n / bw * 1e3))(count_parameters(spec).active * b), "Mixtral 8x7B",
     "in milliseconds: seconds are asked"),
])
def test_learner_round_mistakes_are_named(ex, wrong, case, contains):
    """Issue 36's learner round: each new wrong answer of notebook 14 is named."""
    assert_public_case_fails(ex, wrong, case, contains=contains)


def _greedy_in(loads, n_nodes, groups):
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for g in groups:
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


def packing_by_ranks_of_negated_loads(loads, n_nodes):
    """Wrong: sorts the negated loads, but visits the groups in the order of their ranks (argsort of argsort)."""
    import torch
    return _greedy_in(loads, n_nodes, torch.argsort(torch.argsort(-torch.tensor(loads))).tolist())


def packing_in_sorted_positions(loads, n_nodes):
    """Wrong: sorts the negated loads and returns the nodes in that sorted order, not per group."""
    order = sorted(range(len(loads)), key=lambda i: -loads[i])
    node = _greedy_in(loads, n_nodes, order)
    return [node[g] for g in order]


def packing_found_by_value(loads, n_nodes):
    """Wrong: sorts the negated load values and finds each group by loads.index (equal loads collide)."""
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for value in sorted(loads, key=lambda v: -v):
        g = loads.index(value)
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + value, count[n] + 1
    return node


def packing_into_the_heaviest_node(loads, n_nodes):
    """Wrong: heaviest group first, but into the MOST loaded node with room (the node loads negated)."""
    per = len(loads) // n_nodes
    node_load, count, node = [0.0] * n_nodes, [0] * n_nodes, [0] * len(loads)
    for g in sorted(range(len(loads)), key=lambda i: -loads[i]):
        n = min((m for m in range(n_nodes) if count[m] < per), key=lambda m: -node_load[m])
        node[g], node_load[n], count[n] = n, node_load[n] + loads[g], count[n] + 1
    return node


@pytest.mark.parametrize("wrong, contains", [
    (packing_by_ranks_of_negated_loads, "visited in the order of each group's place in the heaviest-first sort"),
    (packing_in_sorted_positions, "the nodes come back in the heaviest-first order of the sorted loads"),
    (packing_found_by_value, "each group was found by its load, so the first of them was placed again"),
    (packing_into_the_heaviest_node, "also what choosing the most loaded node with room does"),
])
def test_sorting_by_negated_loads_mistakes_are_named(wrong, contains):
    """Issue 36: a greedy misled by its sort of the negated loads got a value and no mistake (or a wrong one)."""
    assert_public_case_fails("14.1", wrong, "6 groups onto 2 nodes", contains=contains)


def _decode_with(read, latency):
    def f(spec, bytes_per_param, bandwidth):
        nbytes = count_parameters(spec).active * bytes_per_param
        return read(spec, nbytes, bytes_per_param), latency(nbytes, bandwidth)
    return f


_RIGHT_READ, _RIGHT_LATENCY = (lambda spec, n, b: n), (lambda n, bw: n / bw)


@pytest.mark.parametrize("ex, wrong, contains", [
    ("14.2", all_extras_to_the_heaviest, "each copy went by the expert's total load, which ignores the copies"),
    ("14.3", lambda i, e, m, h, b: tuple(v // (h * b) for v in inter_node_bytes(i, e, m, h, b)),
     "rows, not bytes: a row is hidden values"),
    ("14.4", _decode_with(lambda spec, n, b: n * 8, _RIGHT_LATENCY), "in bits: the number of bytes is asked"),
    ("14.4", decode_bound_total, "every expert's weights: a token reads only the k experts it is routed to"),
    ("14.4", _decode_with(lambda spec, n, b: n / b, _RIGHT_LATENCY), "parameters, not bytes: each weighs"),
    ("14.4", _decode_with(_RIGHT_READ, lambda n, bw: n / bw * 1e6), "in microseconds: seconds are asked"),
    ("14.4", _decode_with(_RIGHT_READ, lambda n, bw: bw / n), "the inverse: that is tokens per second"),
])
def test_every_named_mistake_is_triggered(ex, wrong, contains):
    """Issue 36's audit: each named mistake of 14.2, 14.3 and 14.4 has a wrong answer whose line names it."""
    assert_check_fails(ex, wrong, contains=contains)
