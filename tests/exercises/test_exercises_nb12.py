"""Exercises of notebook 12_deepseek_moe: the solutions pass, plausible wrong answers fail with a
message that says what was expected and what came back."""
import inspect
import math
import re

import pytest
import torch

from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails
from labkit.moe import MoELayer
from labkit.moe.router import route


def n_combinations(E, k, m):
    return math.comb(m * E, m * k)


def combinations_times_m(E, k, m):
    """Wrong: m times as many combinations, not C(mE, mk)."""
    return m * math.comb(E, k)


def _select(scores, k, n_groups, topk_groups, group_score):
    T, E = scores.shape
    grouped = scores.view(T, n_groups, E // n_groups)
    best = group_score(grouped).topk(topk_groups, dim=-1).indices
    out = torch.ones(T, n_groups, dtype=torch.bool).scatter(1, best, False)
    return grouped.masked_fill(out[:, :, None], float("-inf")).view(T, E).topk(k, dim=-1).indices


def group_limited_topk(scores, k, n_groups, topk_groups):
    return _select(scores, k, n_groups, topk_groups, lambda g: g.topk(2, dim=-1).values.sum(-1))


def group_by_max(scores, k, n_groups, topk_groups):
    """Wrong: scores a group by its single best expert (V3 uses the sum of the top 2)."""
    return _select(scores, k, n_groups, topk_groups, lambda g: g.amax(-1))


def no_group_limit(scores, k, n_groups, topk_groups):
    """Wrong: plain top-k, ignoring the groups."""
    return scores.topk(k, dim=-1).indices


def _line(fn, fragment):
    (hit,) = [l.strip() for l in inspect.getsource(fn).splitlines() if fragment in l]
    return hit


def gate_lines():
    return {
        "score_function": (route, _line(route, "scores = logits")),
        "bias_for_selection": (route, _line(route, "select = scores.detach()")),
        "group_score": (route, _line(route, "group_scores = grouped.topk")),
        "group_mask": (route, _line(route, "masked_fill")),
        "top_k": (route, _line(route, "indices = select.topk")),
        "gating_weights": (route, _line(route, "weights = scores.gather")),
        "shared_expert": (MoELayer.forward, _line(MoELayer.forward, "self.shared_experts(x2)")),
    }


def gate_lines_renormalisation_as_weights():
    """Wrong: points at the renormalisation, not at where the (unbiased) weights are taken."""
    return dict(gate_lines(), gating_weights=(route, _line(route, "weights = weights / weights.sum")))


def gate_lines_wrong_function():
    """Wrong: the shared expert is added in MoELayer.forward, not in route."""
    return dict(gate_lines(), shared_expert=(route, _line(MoELayer.forward, "self.shared_experts(x2)")))


def gate_lines_invented_line():
    """Wrong: a line that is not in labkit's code."""
    return dict(gate_lines(), top_k=(route, "indices = torch.topk(scores, k).indices"))


def test_solutions_pass():
    for ex, answer in (("12.1", n_combinations), ("12.2", group_limited_topk), ("12.3", gate_lines)):
        assert_check_passes(ex, answer)


# ----------------------------------------------------------------------------- 12.4
from dataclasses import replace  # noqa: E402

from labkit.moe import MoEConfig  # noqa: E402


def deepseek_v3_gate():
    return MoEConfig(n_embd=7168, moe_ffn_dim=2048, activation="swiglu", n_routed_experts=256, n_shared_experts=1,
                     n_activated_experts=8, score_func="sigmoid", expert_bias=True, n_expert_groups=8,
                     n_limited_groups=4, route_scale=2.5)


def test_v3_gate_solution_passes():
    assert_check_passes("12.4", deepseek_v3_gate)


@pytest.mark.parametrize("change, case, contains", [
    ({"n_limited_groups": 8}, "group-limited routing", "MoEConfig.n_limited_groups is not DeepSeek-V3's (yours is 8)"),
    ({"score_func": "softmax"}, "scores and weights", "MoEConfig.score_func is not DeepSeek-V3's (yours is 'softmax')"),
    ({"route_scale": 1.0}, "scores and weights", "MoEConfig.route_scale is not DeepSeek-V3's (yours is 1)"),
    ({"n_shared_experts": 0}, "experts:", "MoEConfig.n_shared_experts is not DeepSeek-V3's (yours is 0)"),
    ({"n_activated_experts": 2}, "experts:", "MoEConfig.n_activated_experts is not DeepSeek-V3's (yours is 2)"),
    ({"n_routed_experts": 64}, "experts:", "MoEConfig.n_routed_experts is not DeepSeek-V3's (yours is 64): it "
                                           "holds the number of routed experts per MoE layer; look it up in the "
                                           "report, sec. 4.2"),
    ({"moe_ffn_dim": 18432}, "expert sizes", "MoEConfig.moe_ffn_dim is not DeepSeek-V3's (yours is 18432)"),
    ({"activation": "gelu"}, "expert sizes", "MoEConfig.activation is not DeepSeek-V3's (yours is 'gelu')"),
    ({"n_embd": 4096}, "expert sizes", "MoEConfig.n_embd is not DeepSeek-V3's (yours is 4096)"),
    ({"renormalize": False}, "experts:", "MoEConfig.renormalize is not DeepSeek-V3's (yours is False)"),
])
def test_v3_gate_misread_fails_naming_the_field(change, case, contains):
    res = assert_public_case_fails("12.4", lambda: replace(deepseek_v3_gate(), **change), case, contains=contains)
    # the message names the field and where to look, never DeepSeek-V3's value
    field = next(iter(change))
    want = {"renormalize": True}.get(field, getattr(deepseek_v3_gate(), field))
    rest = res.message.split(f"MoEConfig.{field} ", 1)[1].split(" Hint:")[0]
    rest = rest.replace(f"(yours is {change[field]!r})", "")
    assert "expected" not in rest and not re.search(rf"(?<![\d.]){re.escape(repr(want))}(?![\d.])", rest), rest


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "combinations_times_m": ("12.1", combinations_times_m,
                             {"contains": "expected 4426165368, got 480"}),
    "group_score_by_max": ("12.2", group_by_max,
                           {"contains": "token 0 should use experts [2, 3], got [0, 1]"}),
    "no_group_limit": ("12.2", no_group_limit,
                       {"contains": "token 0 should use experts [2, 3]"}),
    "renormalisation_is_not_the_gating_weights_line":
        ("12.3", gate_lines_renormalisation_as_weights,
         {"contains": "does not take the UNBIASED scores of the chosen experts"}),
    "shared_expert_in_the_wrong_function": ("12.3", gate_lines_wrong_function,
                                            {"contains": "is in MoELayer.forward, not in route"}),
    "invented_line": ("12.3", gate_lines_invented_line,
                      {"contains": "is not a line of route"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


def test_integers_of_any_kind_are_accepted():
    """Issue 36: a count of subsets as a NumPy int is an int."""
    import numpy as np
    assert_check_passes("12.1", lambda E, k, m: (lambda v: np.int64(v) if v < 2 ** 62 else v)(n_combinations(E, k, m)))


@pytest.mark.parametrize("wrong, contains", [
    (lambda s, k, n, tk: _select(s, k, n, tk, lambda g: g.sum(-1)), "groups ranked by the sum (or the mean)"),
    (lambda s, k, n, tk: _select(s, k, n, tk, lambda g: g.mean(-1)), "groups ranked by the sum (or the mean)"),
    (lambda s, k, n, tk: _select(s, k, n, min(n, tk + 1), lambda g: g.topk(2, dim=-1).values.sum(-1)),
     "3 groups kept where topk_groups = 2"),
])
def test_group_learner_round_mistakes_are_named(wrong, contains):
    assert_public_case_fails("12.2", wrong, "8 tokens, E=16", contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda E, k, m: math.comb(E, k) ** m, "E=16, k=2, m=4", "each of the m pieces chosen on its own"),
    (lambda E, k, m: math.perm(m * E, m * k), "E=16, k=2, m=1", "ordered choices: a set of experts has no order"),
    (lambda E, k, m: math.comb(m * E, k), "E=16, k=2, m=4", "only k small experts chosen"),
])
def test_combination_learner_round_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("12.1", wrong, case, contains=contains)


@pytest.mark.parametrize("ex, wrong, contains", [
    ("12.1", combinations_times_m, "m times the coarse count"),
    ("12.2", group_by_max, "groups ranked by their single best expert"),
])
def test_every_named_mistake_is_triggered(ex, wrong, contains):
    """Issue 36's audit: each named mistake of 12.1 and 12.2 has a wrong answer whose line names it."""
    assert_check_fails(ex, wrong, contains=contains)


def test_the_best_single_expert_fails_the_case_named_after_it():
    """Issue 36's audit: 12.2's case named after the mistake (the best PAIR wins) is the one a group scored by
    its single best expert fails first."""
    assert_public_case_fails("12.2", group_by_max, "one token, 4 groups of 2, keep 1 group: the best PAIR wins",
                             contains="groups ranked by their single best expert")
