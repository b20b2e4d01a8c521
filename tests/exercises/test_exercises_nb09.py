"""Exercises of notebook 09_moe_routing: the solutions pass, plausible wrong answers fail with a
message that says what was expected and what came back."""
import math

import pytest
import torch

from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


def top_k_gate(logits, k, renormalize=False):
    weights, indices = logits.softmax(dim=-1).topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, indices


def gate_softmax_over_top_k(logits, k, renormalize=False):
    """Wrong: softmax over the k chosen logits only (Mixtral's form) is the RENORMALISED gate."""
    top, idx = logits.topk(k, dim=-1)
    return top.softmax(dim=-1), idx


def gate_detached(logits, k, renormalize=False):
    """Wrong: weights cut off from the graph, the gate would never learn."""
    return top_k_gate(logits.detach(), k, renormalize)


def capacity_keep(indices, num_experts, capacity_factor):
    T, k = indices.shape
    C = math.ceil(k * T / num_experts * capacity_factor)
    used, keep = [0] * num_experts, torch.zeros(T, k, dtype=torch.bool)
    for t in range(T):
        for j in range(k):
            e = int(indices[t, j])
            if used[e] < C:
                keep[t, j], used[e] = True, used[e] + 1
    return C, keep


def capacity_floor(indices, num_experts, capacity_factor):
    """Wrong: rounds the capacity down."""
    T, k = indices.shape
    return int(k * T / num_experts * capacity_factor), capacity_keep(indices, num_experts, capacity_factor)[1]


def capacity_choice_major(indices, num_experts, capacity_factor):
    """Wrong (here): all first choices before second choices; the notebook asks for token order."""
    T, k = indices.shape
    C = math.ceil(k * T / num_experts * capacity_factor)
    used, keep = [0] * num_experts, torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in range(T):
            e = int(indices[t, j])
            if used[e] < C:
                keep[t, j], used[e] = True, used[e] + 1
    return C, keep


def moe_param_count(spec):
    H = spec.hidden
    attention = 2 * H * spec.n_head * spec.head_dim + 2 * H * spec.kv_heads * spec.head_dim
    expert = 3 * H * spec.moe_ffn
    shared = attention + spec.n_routed_experts * H + 2 * H
    outside = 2 * spec.vocab_size * H + H
    return (spec.n_layer * (shared + spec.n_routed_experts * expert) + outside,
            spec.n_layer * (shared + spec.n_activated_experts * expert) + outside)


def params_eight_models(spec):
    """Wrong: "8x7B" read as eight whole models (attention and embeddings counted E times)."""
    H = spec.hidden
    attention = 2 * H * spec.n_head * spec.head_dim + 2 * H * spec.kv_heads * spec.head_dim
    one = spec.n_layer * (attention + 3 * H * spec.moe_ffn) + 2 * spec.vocab_size * H
    return spec.n_routed_experts * one, spec.n_activated_experts * one


def params_no_router(spec):
    """Wrong: the router forgotten (issue 36: passed every case within 0.1 %)."""
    total, active = moe_param_count(spec)
    lost = spec.n_layer * spec.n_routed_experts * spec.hidden
    return total - lost, active - lost


def params_no_final_norm(spec):
    """Wrong: the final norm forgotten (issue 36)."""
    total, active = moe_param_count(spec)
    return total - spec.hidden, active - spec.hidden


def params_one_norm_per_layer(spec):
    total, active = moe_param_count(spec)
    return total - spec.n_layer * spec.hidden, active - spec.n_layer * spec.hidden


def params_no_embeddings(spec):
    """Wrong: forgets the embedding and the output head."""
    total, active = moe_param_count(spec)
    return total - 2 * spec.vocab_size * spec.hidden, active - 2 * spec.vocab_size * spec.hidden


def test_solutions_pass():
    for ex, answer in (("9.1", top_k_gate), ("9.2", capacity_keep), ("9.3", moe_param_count)):
        assert_check_passes(ex, answer)


def test_integers_of_any_kind_are_accepted():
    """Issue 36: a count or a capacity returned as a NumPy int or a 0-d tensor is an int."""
    import numpy as np
    assert_check_passes("9.3", lambda spec: tuple(np.int64(x) for x in moe_param_count(spec)))
    assert_check_passes("9.3", lambda spec: tuple(torch.tensor(x) for x in moe_param_count(spec)))
    for make in (np.int64, torch.tensor):
        assert_check_passes("9.2", lambda idx, E, cf, make=make: (lambda C, keep: (make(C), keep))(
            *capacity_keep(idx, E, cf)))


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "gate_softmax_over_top_k": ("9.1", gate_softmax_over_top_k,
                                {"contains": "each token's k weights sum to 1: that is the renormalised gate"}),
    "gate_detached": ("9.1", gate_detached,
                      {"contains": "no gradient back to the logits"}),
    "capacity_rounded_down": ("9.2", capacity_floor,
                              {"contains": "capacity C: expected 2, got 1 (rounded down: a fraction of a slot still "
                                           "needs a whole slot)"}),
    "capacity_choice_major_order": ("9.2", capacity_choice_major,
                                    {"contains": "expected keep="}),
    "params_eight_whole_models": ("9.3", params_eight_models,
                                  {"contains": "total parameters: expected 46,702,792,704 (46.703B)"}),
    "params_without_embeddings": ("9.3", params_no_embeddings,
                                  {"contains": "(46.703B), got 46,440,648,704 (46.441B) (short by exactly 262,144,000, "
                                               "what this leaves out: the input embedding and the output head)"}),
    "params_without_router": ("9.3", params_no_router,
                              {"contains": "the router (an H x E gate in every layer)"}),
    "params_without_final_norm": ("9.3", params_no_final_norm,
                                  {"contains": "the final norm (one RMSNorm of H after the last layer)"}),
    "params_one_norm_per_layer": ("9.3", params_one_norm_per_layer, {"contains": "one norm per layer"}),
    "params_as_float_approximation": ("9.3", lambda spec: tuple(round(x, -6) for x in moe_param_count(spec)),
                                      {"contains": "parameter counts are exact integers"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


@pytest.mark.parametrize("wrong, contains", [
    (lambda l, k, renormalize=False: l.topk(k, dim=-1), "these are the raw logits"),
    (lambda l, k, renormalize=False: top_k_gate(l, k, not renormalize), "that is the renormalised gate"),
    (lambda l, k, renormalize=False: l.softmax(dim=0).topk(k, dim=-1), "the softmax ran over the tokens, dim 0"),
])
def test_gate_learner_round_mistakes_are_named(wrong, contains):
    assert_public_case_fails("9.1", wrong, "k=2 of E=4, not renormalised", contains=contains)


def test_not_renormalised_when_asked_is_named():
    assert_public_case_fails("9.1", lambda l, k, renormalize=False: top_k_gate(l, k), "k=2 of E=4, renormalize=True",
                             contains="not renormalised: with renormalize=True")


def test_capacity_without_k_is_named():
    def no_k(idx, E, cf):
        C, keep = capacity_keep(idx, E, cf)
        return math.ceil(idx.shape[0] / E * cf), keep
    assert_check_fails("9.2", no_k, contains="or k left out: each token takes k slots;")


def test_no_case_name_of_9_1_gives_its_expected_weights():
    """Issue 36: 9.1's public case names printed the expected weights of row 0; no case name (public or hidden)
    may hold a weight that a right gate returns on the cases' example logits."""
    from labkit.grading.exercises.nb09_moe_routing import _EXAMPLE
    from labkit.grading.registry import get_exercise

    shown = set()
    for k in (1, 2):
        for renormalize in (False, True):
            for w in top_k_gate(_EXAMPLE, k, renormalize)[0].flatten().tolist():
                shown |= {f"{w:.{n}f}" for n in (2, 3, 4)} | {f"{w:.{n}g}" for n in (2, 3, 4)}
    names = [c.name for c in get_exercise("9.1").cases]
    leaks = [(n, s) for n in names for s in shown if "." in s and len(s) >= 4 and s in n]
    assert not leaks, leaks


def capacity_without_factor(indices, num_experts, capacity_factor):
    """Wrong: C = ceil(k T / E), the capacity factor left out."""
    return capacity_keep(indices, num_experts, 1.0)


def params_router_twice(spec):
    """Wrong: the router counted twice (once with the attention, once with the experts)."""
    total, active = moe_param_count(spec)
    extra = spec.n_layer * spec.n_routed_experts * spec.hidden
    return total + extra, active + extra


@pytest.mark.parametrize("ex, wrong, contains", [
    ("9.2", capacity_without_factor, "the capacity factor left out"),
    ("9.3", params_router_twice, "over by exactly"),
])
def test_every_named_mistake_is_triggered(ex, wrong, contains):
    """Issue 36's audit: each named mistake of 9.2 and 9.3 has a wrong answer whose line names it."""
    res = assert_check_fails(ex, wrong, contains=contains)
    if ex == "9.3":
        assert "what this counts twice: the router" in " ".join(res.message.split()), res.message
