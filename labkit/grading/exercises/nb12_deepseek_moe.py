"""Exercises of notebook 12_deepseek_moe: DeepSeekMoE and DeepSeek-V3's gate.

* 12.1 fine-grained experts: how many expert combinations a token can use (DeepSeekMoE,
  Dai et al. 2024, sec. 3.1: 16 experts top-2 -> 120; split each in 4 -> C(64, 8) = 4,426,165,368).
* 12.2 group-limited top-k (DeepSeek-V3 report sec. 2.1.2 / 3.2 node-limited routing; the
  reference ``Gate.forward``): group score = sum of the top-2 scores in a group, keep the best
  ``topk_groups`` groups, then top-k inside them.
* 12.3 reading labkit's own gate: point at the line that implements each concept. Checked
  against the code itself with :mod:`inspect`, so it stays true when the code moves.
* 12.4 DeepSeek-V3's gate as described (256 routed, 1 shared, top 8, sigmoid, aux-loss-free bias,
  8 groups keeping 4, route scale 2.5; report sec. 2.1.2 and 4.2) written as a labkit MoEConfig.

Ground truth: :func:`labkit.moe.router.route` and :class:`labkit.moe.experts.MoELayer`.
"""
from __future__ import annotations

import inspect
import math
import re

import torch

from ...moe.experts import MoELayer
from ...moe.router import route
from ..kernelside.nb12_deepseek_moe import _gate_lines, _v3_fields  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, _shown, as_int, exercise, expect_equal, expect_named
from . import kernel_side

# ----------------------------------------------------------------------------- 12.1
ex121 = exercise(
    "12.1", title="fine-grained expert combinations", notebook="12_deepseek_moe", points=2,
    hint=("Section 1: after fine-grained segmentation, how many experts are there in all, and how many does a token "
          "use? Does the order in which a token picks them matter?"))
ex121.hint2 = ("The answer must be exact for the paper's example (4,426,165,368), so floating point will not do: "
               "which exact integer count is this?")
ex121.hint_review = ("leads: asks for the two sizes and whether order matters; names neither the function nor its "
                     "module; reviewed 2026-12-06")


def _comb_case(E, k, m):
    def case(n_combinations):
        got = n_combinations(E, k, m)
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        got = as_int(got) if as_int(got) is not None else got
        expect_named(got, math.comb(m * E, m * k), f"n_combinations(E={E}, k={k}, m={m})", [
            (math.perm(m * E, m * k), "ordered choices: a set of experts has no order"),
            (math.comb(E, k) ** m, "each of the m pieces chosen on its own, as if from its own coarse expert"),
            (math.comb(E, k) * m, "m times the coarse count"),
            (math.comb(m * E, k), "only k small experts chosen: how many does a token activate after the cut?")])
    return case


ex121.case("E=16, k=2, m=1 (a plain top-2 MoE)")(_comb_case(16, 2, 1))
ex121.case("E=16, k=2, m=4 (DeepSeekMoE sec. 3.1)")(_comb_case(16, 2, 4))
ex121.case("E=8, k=2, m=8 (Mixtral's experts cut in 8)", hidden=True)(_comb_case(8, 2, 8))
ex121.case("E=4, k=1, m=2", hidden=True)(_comb_case(4, 1, 2))


# ----------------------------------------------------------------------------- 12.2
ex122 = exercise(
    "12.2", title="group-limited top-k", notebook="12_deepseek_moe", points=3,
    hint=("Section 3 (the DeepSeek-V3 gate): the group score is defined in the docstring. Once you know which groups "
          "stay allowed, how do you make sure no expert of another group can be chosen?"))
ex122.hint2 = ("Check the example above the exercise: experts 7 and 15 have the second-highest score yet must not be "
               "chosen. Does your selection exclude them, for every token separately?")
ex122.hint_review = ("leads: asks how to exclude the other groups' experts and checks the notebook's example; no "
                     "reshape, mask or fill value given; reviewed 2026-12-06")


def _limited(scores, k, G, keep, group_score):
    T, E = scores.shape
    grouped = scores.view(T, G, E // G)
    best = group_score(grouped).topk(keep, dim=-1).indices
    out = torch.ones(T, G, dtype=torch.bool).scatter(1, best, False)
    return grouped.masked_fill(out[:, :, None], float("-inf")).view(T, E).topk(k, dim=-1).indices.sort(-1).values


def _group_mistake(scores, got_s, k, G, keep) -> str:
    """The group score or group count a wrong selection used, when it is one of the known mistakes."""
    per = scores.shape[1] // G
    variants = [(lambda g: g.max(-1).values, "groups ranked by their single best expert"),
                (lambda g: g.sum(-1), f"groups ranked by the sum (or the mean) of all {per} of their experts")]
    for score, text in variants:
        if per > 1 and torch.equal(got_s, _limited(scores, k, G, keep, score)):
            return text
    top2 = lambda g: g.topk(min(2, per), dim=-1).values.sum(-1)  # noqa: E731
    for other in (keep + 1, keep - 1):
        if 1 <= other <= G and other != keep and torch.equal(got_s, _limited(scores, k, G, other, top2)):
            return f"{other} groups kept where topk_groups = {keep}"
    if torch.equal(got_s, scores.topk(k, dim=-1).indices.sort(-1).values):
        return "the plain top-k over all experts: no group is excluded"
    return ""


def _group_case(logits, k, G, topk_groups, what):
    def case(group_limited_topk):
        T, E = logits.shape
        scores = logits.sigmoid()
        got = group_limited_topk(scores.clone(), k, G, topk_groups)
        if not isinstance(got, torch.Tensor):
            raise CheckFailure(f"{what}: expected a tensor of expert ids [T, k], got {type(got).__name__}")
        if tuple(got.shape) != (T, k):
            raise CheckFailure(f"{what}: expected shape {(T, k)}, got {tuple(got.shape)}")
        _, want, _ = route(logits, k, "sigmoid", n_expert_groups=G, n_limited_groups=topk_groups,
                           expert_bias=torch.zeros(E))
        got_s, want_s = got.long().sort(-1).values, want.sort(-1).values
        for t in range(T):
            if not torch.equal(got_s[t], want_s[t]):
                why = _group_mistake(scores, got_s, k, G, topk_groups)
                raise CheckFailure(f"{what}: token {t} should use experts {want_s[t].tolist()}, got "
                                   f"{got_s[t].tolist()} (groups of {E // G}; scores "
                                   f"{[round(v, 2) for v in scores[t].tolist()]})" + (f"; {why}" if why else ""))
    return case


# group 0 has the single best expert, group 1 the best pair: max and top-2 sum disagree
_PAIR = torch.logit(torch.tensor([[0.90, 0.10, 0.60, 0.60, 0.50, 0.50, 0.20, 0.30]]))
ex122.case("one token, 4 groups of 2, keep 1 group: the best PAIR wins")(
    _group_case(_PAIR, 2, 4, 1, "group_limited_topk(1 token, E=8, k=2, G=4, topk_groups=1)"))
ex122.case("8 tokens, E=16, G=4 groups, keep 2, k=4")(
    _group_case(torch.randn(8, 16, generator=torch.Generator().manual_seed(121)) * 2, 4, 4, 2,
                "group_limited_topk(T=8, E=16, k=4, G=4, topk_groups=2)"))
ex122.case("keeping every group is plain top-k", hidden=True)(
    _group_case(torch.randn(6, 12, generator=torch.Generator().manual_seed(122)), 3, 3, 3,
                "group_limited_topk(T=6, E=12, k=3, G=3, topk_groups=3)"))
ex122.case("V3's shape scaled down: E=32, G=8, keep 4, k=8", hidden=True)(
    _group_case(torch.randn(16, 32, generator=torch.Generator().manual_seed(123)) * 2, 8, 8, 4,
                "group_limited_topk(T=16, E=32, k=8, G=8, topk_groups=4)"))


# ----------------------------------------------------------------------------- 12.3
ex123 = exercise(
    "12.3", title="find each concept in labkit's gate", notebook="12_deepseek_moe", points=3,
    hint=("Section 4: read the source of route and of MoELayer.forward (line_of finds a line by a fragment). For each "
          "concept of the table, which line does that job and nothing else?"))
ex123.hint2 = ("The bias changes which experts are chosen, not their weights: which line uses the biased scores, and "
               "which the unbiased ones? Where does the shared expert's output join?")
ex123.hint_review = ("leads: a reading exercise; asks which line does each job and distinguishes biased from unbiased "
                     "scores; no line quoted; reviewed 2026-12-06")

# concept -> (function that holds it, test of the line, what the line must do)
CONCEPTS = {
    "score_function": (route, lambda s: s.startswith("scores =") and ("softmax" in s or "sigmoid" in s),
                       "turn the logits into affinities s (softmax or sigmoid), once"),
    "bias_for_selection": (route, lambda s: s.startswith("select =") and "expert_bias" in s and "+" in s,
                           "add the aux-loss-free bias b to the scores used for CHOOSING experts"),
    "group_score": (route, lambda s: s.startswith("group_scores =") and "topk" in s and "sum" in s,
                    "score each group by the sum of its 2 best (biased) scores, as V3 does"),
    "group_mask": (route, lambda s: "masked_fill" in s and "-inf" in s,
                   "forbid the experts of the groups that were not kept"),
    "top_k": (route, lambda s: s.startswith("indices =") and "topk" in s,
              "choose the k experts"),
    "gating_weights": (route, lambda s: s.startswith("weights =") and "gather" in s and "scores" in s,
                       "take the UNBIASED scores of the chosen experts as gating weights"),
    "shared_expert": (MoELayer.forward, lambda s: "shared_experts(" in s and "+" in s,
                      "add the shared expert's output, which every token gets"),
}


def _norm(line: str) -> str:
    return re.sub(r"\s+", " ", line.split("#")[0]).strip()


def _source_lines(fn) -> set[str]:
    return {_norm(l) for l in inspect.getsource(fn).splitlines() if _norm(l)}


def _concept_case(names):
    def case(answer):
        answer = answer.run(_gate_lines)
        if not isinstance(answer, dict):
            raise CheckFailure(f"gate_lines() must return a dict concept -> (function, line), got "
                               f"{type(answer).__name__}")
        missing = [n for n in CONCEPTS if n not in answer]
        if missing:
            raise CheckFailure(f"the dict lacks the concept(s) {missing}; expected keys {list(CONCEPTS)}")
        for name in names:
            fn, test, job = CONCEPTS[name]
            entry = answer[name]
            if not isinstance(entry, (tuple, list)) or len(entry) != 2 or not isinstance(entry[1], str):
                raise CheckFailure(f"{name!r}: expected a pair (function, line of its source), got {_shown(entry)}")
            where, line = entry
            is_fn = isinstance(where, tuple) and len(where) == 3 and where[0] == "function"
            if not is_fn or (where[1], where[2]) != (fn.__module__, fn.__qualname__):
                raise CheckFailure(f"{name!r}: the line that must {job} is in {fn.__qualname__}, "
                                   f"not in {where[2] if is_fn else repr(where)}")
            line_n = _norm(line)
            if line_n not in _source_lines(fn):
                raise CheckFailure(f"{name!r}: {line.strip()!r} is not a line of {fn.__qualname__} "
                                   "(copy one whole line of inspect.getsource)")
            if not test(line_n):
                raise CheckFailure(f"{name!r}: {line.strip()!r} does not {job}")
    return case


ex123.case("score function, bias, top-k, gating weights")(
    _concept_case(["score_function", "bias_for_selection", "top_k", "gating_weights"]))
ex123.case("group score and group mask")(_concept_case(["group_score", "group_mask"]))
ex123.case("shared expert")(_concept_case(["shared_expert"]))
ex123.case("every concept", hidden=True)(_concept_case(list(CONCEPTS)))


# ----------------------------------------------------------------------------- 12.4
ex124 = exercise(
    "12.4", title="DeepSeek-V3's gate in labkit's names", notebook="12_deepseek_moe", points=2,
    hint=("Section 5: take each number from the description of DeepSeek-V3's MoE layer (report sec. 2.1.2 and 4.2) "
          "and put it in the MoEConfig field of the same meaning; the sizes (hidden size, width of one expert, "
          "activation) count too."))
ex124.hint2 = ("Read the MoEConfig docstring for what each field means; the route scale is routed_scaling_factor in "
               "the released config, and the groups are the nodes a token may be sent to.")
ex124.hint_review = ("leads: a reading exercise; points at the docstring and the report's names; no value given; "
                     "reviewed 2026-12-06")

# field -> (DeepSeek-V3's value, what the field holds, where the report says it). A failure message names the
# field and where to look, never the value (that would hand out the answer).
V3_GATE = {
    "n_routed_experts": (256, "the number of routed experts per MoE layer", "sec. 4.2 (model hyper-parameters)"),
    "n_shared_experts": (1, "the number of shared experts per MoE layer", "sec. 4.2 (model hyper-parameters)"),
    "n_activated_experts": (8, "the number of routed experts a token activates", "sec. 4.2 (model hyper-parameters)"),
    "score_func": ("sigmoid", "the function that turns a token's logits into affinity scores",
                   "sec. 2.1.2, eq. 15"),
    "expert_bias": (True, "whether the aux-loss-free bias b_i is added for selection",
                    "sec. 2.1.2, eq. 16 (and notebook 10)"),
    "n_expert_groups": (8, "the number of groups the routed experts form (one per node)",
                        "sec. 2.1.2 (node-limited routing) and sec. 4.2"),
    "n_limited_groups": (4, "the number of groups (nodes) one token may be sent to",
                         "sec. 2.1.2 (node-limited routing) and sec. 4.2"),
    "route_scale": (2.5, "the factor that scales the gating weights",
                    "routed_scaling_factor in the released config"),
    "n_embd": (7168, "the hidden size", "sec. 4.2 (model hyper-parameters)"),
    "moe_ffn_dim": (2048, "the intermediate hidden size of one expert", "sec. 4.2 (model hyper-parameters)"),
    "activation": ("swiglu", "the kind of FFN each expert is", "sec. 2.1 and 4.2 (like the dense layers)"),
}


def _v3_config(answer):
    """The learner's configuration, rebuilt in this process from its fields."""
    from ...moe import MoEConfig

    return MoEConfig(**kernel_side(answer, _v3_fields))


def _v3_fields_case(names):
    def case(answer):
        cfg = _v3_config(answer)
        for name in names:
            want, what, where = V3_GATE[name]
            got = getattr(cfg, name)
            same = (type(got) is bool) == (type(want) is bool) and got == want
            if not same:
                raise CheckFailure(f"MoEConfig.{name} is not DeepSeek-V3's (yours is {_shown(got)}): it holds {what}; "
                                   f"look it up in the report, {where}")
        if cfg.renormalize is False:
            raise CheckFailure("MoEConfig.renormalize is not DeepSeek-V3's (yours is False): see how the report "
                               "turns the chosen experts' sigmoid scores into gating weights (sec. 2.1.2, eq. 13)")
    return case


ex124.case("experts: routed, shared, activated per token")(
    _v3_fields_case(["n_routed_experts", "n_shared_experts", "n_activated_experts"]))
ex124.case("scores and weights: sigmoid, aux-loss-free bias, route scale")(
    _v3_fields_case(["score_func", "expert_bias", "route_scale"]))
ex124.case("group-limited routing: the groups, and how many one token may use")(
    _v3_fields_case(["n_expert_groups", "n_limited_groups"]))
ex124.case("expert sizes: hidden size, width of one expert, activation")(
    _v3_fields_case(["n_embd", "moe_ffn_dim", "activation"]))


@ex124.case("routing 32 tokens with this gate: k experts from the allowed groups, weights summing to the route scale",
            hidden=True)
def _(answer):
    cfg = _v3_config(answer)
    E, G = cfg.n_routed_experts, cfg.n_expert_groups
    logits = torch.randn(32, E, generator=torch.Generator().manual_seed(124))
    weights, idx, _ = route(logits, cfg.n_activated_experts, cfg.score_func, renormalize=cfg.renormalize,
                            n_expert_groups=G, n_limited_groups=cfg.n_limited_groups,
                            route_scale=cfg.route_scale, expert_bias=torch.zeros(E) if cfg.expert_bias else None)
    groups = max(len(set((row // (E // G)).tolist())) for row in idx)
    expect_equal(tuple(idx.shape), (32, 8), "experts chosen per token [T, k]")
    if groups > 4:
        raise CheckFailure(f"a token's experts lie in {groups} groups; DeepSeek-V3 allows at most 4")
    if not torch.allclose(weights.sum(-1), torch.full((32,), 2.5), rtol=1e-5, atol=1e-5):
        raise CheckFailure(f"the gating weights of a token sum to {float(weights.sum(-1)[0]):.4g}, expected 2.5 "
                           f"(renormalised over the 8, times route_scale)")


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402

fresh_case(ex121, "random E, k, m", lambda r: (lambda E: (E, r.randint(1, E), r.randint(1, 8)))(r.randint(1, 64)),
           _comb_case)


def _draw_groups(r):
    G, per = r.randint(1, 4), r.randint(2, 4)
    keep = r.randint(1, G)
    k, T = r.randint(1, keep * per), r.randint(1, 8)
    logits = torch.randn(T, G * per, generator=torch.Generator().manual_seed(seed(r))) * 2
    return logits, k, G, keep, f"group_limited_topk(T={T}, E={G * per}, k={k}, G={G}, topk_groups={keep})"


fresh_case(ex122, "random scores, groups and k", _draw_groups, _group_case)
