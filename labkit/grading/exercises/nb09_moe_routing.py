"""Exercises of notebook 09_moe_routing: the top-k gate, capacity, and counting Mixtral.

* 9.1 the gate: softmax over ALL E experts, then the top k (GShard, Lepikhin et al. 2020,
  sec. 2.2; Switch, Fedus et al. 2021, sec. 2.1, k = 1), optionally renormalised over the k.
* 9.2 capacity C = ceil(k T / E * capacity_factor) (GShard sec. 2.2, Switch eq. 3) and which
  slots fit (first C of each expert, token-major order).
* 9.3 total vs active parameters of a GQA MoE transformer (Mixtral, Jiang et al. 2024).

The ground truth is labkit's own code: :func:`labkit.moe.router.route`,
:func:`~labkit.moe.router.compute_capacity`, :func:`~labkit.moe.router.capacity_mask` and
:func:`labkit.plan.params.count_parameters`.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from ...moe.router import capacity_mask, compute_capacity, route
from ...plan.params import count_parameters
from ...plan.spec import ModelSpec, preset
from ..kernelside.nb09_moe_routing import _gate_with_grad  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, as_int, exercise, expect_close, expect_equal, expect_named, type_name


def _tensor(x, what: str, shape: tuple, dtype_kind: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise CheckFailure(f"{what}: expected a tensor of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise CheckFailure(f"{what}: expected shape {shape}, got shape {tuple(x.shape)}")
    if dtype_kind == "int" and (x.dtype.is_floating_point or x.dtype == torch.bool):
        raise CheckFailure(f"{what}: expected integer expert ids (torch.long), got dtype {x.dtype}")
    if dtype_kind == "bool" and x.dtype != torch.bool:
        raise CheckFailure(f"{what}: expected a bool tensor, got dtype {x.dtype}")
    return x


# ----------------------------------------------------------------------------- 9.1
ex91 = exercise(
    "9.1", title="top-k gate", notebook="09_moe_routing", points=3,
    hint=("Section 2: over which experts are the gate's probabilities taken, and which of them become the weights? Is "
          "renormalising the default?"))
ex91.hint2 = ("Check two invariants: without renormalising, your weights equal the probabilities the gate computes "
              "over all experts for the chosen ones, and they carry a gradient back to the logits.")
ex91.hint_review = ("leads: asks over which experts the probabilities are taken and states the invariants; no API, no "
                    "sequence; reviewed 2026-12-06")


def _gate_case(logits: torch.Tensor, k: int, renormalize: bool, what: str, check_grad: bool = False):
    def case(top_k_gate):
        T, E = logits.shape
        g = torch.linspace(1.0, 2.0, T * k).view(T, k)
        if check_grad:
            got, grad = top_k_gate.run(_gate_with_grad, logits, k, renormalize, g)
        else:
            got, grad = top_k_gate(logits.clone(), k, renormalize=renormalize), None
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (weights, indices), got {type(got).__name__}")
        w, i = got
        _tensor(w, f"{what}: weights", (T, k), "float")
        _tensor(i, f"{what}: indices", (T, k), "int")
        ref_x = logits.clone().requires_grad_(check_grad)
        rw, ri, _ = route(ref_x, k, "softmax", renormalize=renormalize)
        # compare as sets of (expert, weight) per token: order inside a row does not matter
        order, rorder = i.long().argsort(-1), ri.argsort(-1)
        if not torch.equal(i.long().sort(-1).values, ri.sort(-1).values) and T > 1 and torch.equal(
                i.long().sort(-1).values, logits.softmax(0).topk(k, dim=-1).indices.sort(-1).values):
            raise CheckFailure(f"{what}: chosen experts differ (the softmax ran over the tokens, dim 0: a token's "
                               f"probabilities are over the experts)")
        expect_equal(i.long().gather(1, order), ri.gather(1, rorder), f"{what}: chosen experts (sorted per token)")
        gw, want_w = w.detach().float().gather(1, order), rw.detach().gather(1, rorder)
        if not torch.allclose(gw, want_w, rtol=1e-5, atol=1e-6):
            probs = logits.softmax(-1).gather(1, ri.gather(1, rorder))
            why = ""
            if torch.allclose(gw, logits.gather(1, ri.gather(1, rorder)), rtol=1e-5, atol=1e-6):
                why = "these are the raw logits: the gate's weights are probabilities"
            elif not renormalize and k < E and torch.allclose(gw.sum(-1), torch.ones(T), atol=1e-5):
                why = "each token's k weights sum to 1: that is the renormalised gate, asked for only when renormalize"
            elif renormalize and k < E and torch.allclose(gw, probs, rtol=1e-5, atol=1e-6):
                why = "not renormalised: with renormalize=True a token's k weights add up to 1"
            if why:
                raise CheckFailure(f"{what}: weights (matched to their experts) differ ({why})")
        expect_close(w.gather(1, order), rw.gather(1, rorder), f"{what}: weights (matched to their experts)")
        if check_grad:
            if not w.requires_grad or grad is None:
                raise CheckFailure(f"{what}: the weights carry no gradient back to the logits (detached?); "
                                   "the router learns only through them")
            (rw.gather(1, rorder) * g).sum().backward()
            expect_close(grad, ref_x.grad, f"{what}: gradient of the weights w.r.t. the logits")
    return case


_EXAMPLE = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, -2.0, 1.0]])
ex91.case("k=2 of E=4, not renormalised (2 tokens)")(
    _gate_case(_EXAMPLE, 2, False, "top_k_gate(logits [2, 4], k=2)"))
ex91.case("k=2 of E=4, renormalize=True (2 tokens)")(
    _gate_case(_EXAMPLE, 2, True, "top_k_gate(logits [2, 4], k=2, renormalize=True)"))
ex91.case("Switch top-1 (k=1)")(
    _gate_case(_EXAMPLE, 1, False, "top_k_gate(logits [2, 4], k=1)"))
ex91.case("gradient reaches the logits through the weights")(
    _gate_case(torch.randn(6, 5, generator=torch.Generator().manual_seed(3)), 2, False,
               "top_k_gate(random logits [6, 5], k=2)", check_grad=True))
ex91.case("random logits [32, 8], k=3", hidden=True)(
    _gate_case(torch.randn(32, 8, generator=torch.Generator().manual_seed(91)), 3, False, "top_k_gate [32, 8] k=3"))
ex91.case("random logits [32, 8], k=3, renormalised, gradient", hidden=True)(
    _gate_case(torch.randn(32, 8, generator=torch.Generator().manual_seed(92)), 3, True, "top_k_gate [32, 8] k=3",
               check_grad=True))
ex91.case("k = E (every expert)", hidden=True)(
    _gate_case(torch.randn(5, 4, generator=torch.Generator().manual_seed(93)), 4, False, "top_k_gate [5, 4] k=4"))


# ----------------------------------------------------------------------------- 9.2
ex92 = exercise(
    "9.2", title="capacity and dropped tokens", notebook="09_moe_routing", points=3,
    hint=("Section 3: capacity is counted in slots (a token routed to k experts fills k slots). How many slots would "
          "each expert get under perfectly even routing, and what does the capacity factor do to that? C is a whole "
          "number of slots: which way must a fraction go?"))
ex92.hint2 = ("Which slots come first in labkit's position order (section 3), and when is a slot dropped? Check that "
              "a token's second choice can be kept while its first is dropped.")
ex92.hint_review = ("leads: asks for the even share, the factor and the direction of rounding; the keep rule is asked "
                    "about, not written out; reviewed 2026-12-06")


def _cap_case(indices: torch.Tensor, E: int, cf: float, what: str):
    def case(capacity_keep):
        T, k = indices.shape
        got = capacity_keep(indices.clone(), E, cf)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (C, keep), got {type(got).__name__}")
        C, keep = got
        want_C = compute_capacity(T, E, k, cf)
        if isinstance(C, torch.Tensor) and C.numel() == 1:
            C = C.reshape(())
        if as_int(C) is None:
            raise CheckFailure(f"{what}: C must be an int (a number of slots), got {type_name(C)}")
        C = as_int(C)
        mistakes = [(math.floor(k * T / E * cf), "rounded down: a fraction of a slot still needs a whole slot"),
                    (round(k * T / E * cf), "rounded down: a fraction of a slot still needs a whole slot"),
                    (math.ceil(T / E * cf), "k left out: each token takes k slots"),
                    (math.ceil(k * T / E), "the capacity factor left out")]
        hits = list(dict.fromkeys(text for value, text in mistakes if value != want_C and C == value))
        if len(hits) > 2:  # expect_named names two; here every mistake that gives this C is said (issue 36)
            raise CheckFailure(f"{what}: capacity C: expected {want_C}, got {C} ({'; or '.join(hits)})")
        expect_named(C, want_C, f"{what}: capacity C", mistakes)
        _tensor(keep, f"{what}: keep", (T, k), "bool")
        want = capacity_mask(indices, torch.zeros(T, k), E, want_C, policy="position")
        if not torch.equal(keep, want):
            bad = (keep != want).nonzero()[0].tolist()
            t, j = bad
            raise CheckFailure(f"{what}: slot (token {t}, choice {j}) -> expert {int(indices[t, j])}: expected "
                               f"keep={bool(want[t, j])}, got {bool(keep[t, j])} (C={want_C}; expected keep "
                               f"{want.int().tolist()}, got {keep.int().tolist()})")
    return case


ex92.case("T=6, E=4, k=1, capacity_factor=1.0")(
    _cap_case(torch.tensor([[0], [0], [0], [1], [2], [0]]), 4, 1.0, "capacity_keep(T=6, E=4, k=1, cf=1.0)"))
ex92.case("T=4, E=4, k=2, capacity_factor=1.25")(
    _cap_case(torch.tensor([[0, 1], [1, 0], [1, 2], [1, 3]]), 4, 1.25, "capacity_keep(T=4, E=4, k=2, cf=1.25)"))
ex92.case("a large capacity factor drops nothing")(
    _cap_case(torch.tensor([[2], [2], [2], [2], [1]]), 4, 4.0, "capacity_keep(T=5, E=4, k=1, cf=4.0)"))
ex92.case("random routing T=40, E=8, k=2, several factors", hidden=True)(
    lambda f: [
        _cap_case(torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(s * 100 + t))[:2]
                               for t in range(40)]), 8, cf, f"capacity_keep(T=40, E=8, k=2, cf={cf})")(f)
        for s, cf in enumerate((0.5, 1.0, 1.3, 2.0))])
ex92.case("C rounds up (T=7, E=3, k=1, cf=1.0 -> C=3)", hidden=True)(
    _cap_case(torch.tensor([[0], [0], [0], [0], [1], [2], [0]]), 3, 1.0, "capacity_keep(T=7, E=3, k=1, cf=1.0)"))


# ----------------------------------------------------------------------------- 9.3
# Other routes to the same value (issue 40): labkit's count_parameters (and every kit function that reaches
# it) is withheld from the graded kernel until 9.3 is graded. ModelSpec's own total_params()/active_params()
# also return the pair; they are ACCEPTED as knowledge, like a library that computes it: ModelSpec is the
# input the answer is handed, the kit uses it everywhere, and a learner who reads it has read the count
# part by part. An instructor sees such a call in the integrity report, never in the score.
ex93 = exercise(
    "9.3", title="Mixtral's parameters: total and active", notebook="09_moe_routing", points=3,
    hint=("Section 4: list every weight matrix and vector of one layer and of the model beyond the layers (the "
          "section names them all). Which of them does a token use only some of?"))
ex93.hint2 = ("Parameter counts are integers: would your total change if you forgot the router or the final norm? It "
              "must. Which sizes does grouped-query attention shrink?")
ex93.hint_review = ("leads: asks for the list of parts and which a token uses partly; the sizes are the section's; "
                    "reviewed 2026-12-06")

# Mixtral 8x22B (Mistral AI, 2024 HF config): published as 141B total, 39B active.
_MOE = {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope", "bias": False, "dropout": 0.0}
MIXTRAL_8X7B = preset("mixtral-8x7b")
MIXTRAL_8X22B = ModelSpec(name="Mixtral 8x22B", vocab_size=32768, hidden=6144, n_layer=56, n_head=48, n_kv_head=8,
                          seq_len=65536, moe_ffn=16384, n_routed_experts=8, n_activated_experts=2, **_MOE)
_TOY = ModelSpec(name="a toy MoE", vocab_size=32000, hidden=1024, n_layer=8, n_head=16, n_kv_head=4, seq_len=1024,
                 moe_ffn=4096, n_routed_experts=4, n_activated_experts=1, **_MOE)


def _count(g):
    """A parameter count as an exact int: ints of any kind, and floats that hold a whole number."""
    if isinstance(g, torch.Tensor) and g.dim() == 0 and g.is_floating_point():
        g = g.item()
    if isinstance(g, float) and g.is_integer():
        return int(g)
    return as_int(g)


def _param_mistakes(spec: ModelSpec) -> dict:
    """What a count is short by (or over by) for each named mistake: part -> (parameters, which counts)."""
    H, L, E = spec.hidden, spec.n_layer, spec.n_routed_experts
    return {
        "the router (an H x E gate in every layer)": L * E * H,
        "the final norm (one RMSNorm of H after the last layer)": spec.norm_params(),
        "the two norms of every layer": 2 * L * spec.norm_params(),
        "one norm per layer (each layer has two, before attention and before the FFN)": L * spec.norm_params(),
        "the input embedding or the output head (V x H each; this model does not tie them)": spec.vocab_size * H,
        "the input embedding and the output head": 2 * spec.vocab_size * H,
    }


def _params_case(spec: ModelSpec):
    def case(moe_param_count):
        got = moe_param_count(spec)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"moe_param_count({spec.name}): expected a pair (total, active), "
                               f"got {type_name(got)}")
        want = count_parameters(spec)
        for name, g, w in (("total", got[0], want.total), ("active", got[1], want.active)):
            n = _count(g)
            if n is None:
                raise CheckFailure(f"moe_param_count({spec.name}): {name} must be a whole number of parameters, "
                                   f"got {type_name(g)}")
            if n == w:
                continue
            why = ""
            for part, size in _param_mistakes(spec).items():
                if n == w - size:
                    why = f" (short by exactly {size:,}, what this leaves out: {part})"
                    break
                if n == w + size and "embedding" not in part:
                    why = f" (over by exactly {size:,}, what this counts twice: {part})"
                    break
            if not why and abs(n - w) <= 1e-3 * w:
                why = (f" (off by {n - w:+,}: parameter counts are exact integers; which small part is "
                       f"{'missing' if n < w else 'extra'}?)")
            raise CheckFailure(f"{spec.name}: {name} parameters: expected {w:,} ({w / 1e9:.3f}B), "
                               f"got {n:,} ({n / 1e9:.3f}B){why}")
    return case


ex93.case("Mixtral 8x7B (about 46.7B total, 12.9B active)")(_params_case(MIXTRAL_8X7B))
ex93.case("a toy MoE, E=4, k=1")(_params_case(_TOY))
ex93.case("Mixtral 8x22B (about 141B total, 39B active)", hidden=True)(_params_case(MIXTRAL_8X22B))
ex93.case("E=1, k=1 is a dense model (total == active)", hidden=True)(
    _params_case(replace(_TOY, name="a dense model", n_routed_experts=1, n_activated_experts=1)))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402


def _draw_gate(r):
    T, E = r.randint(1, 16), r.randint(1, 10)
    k = r.randint(1, E)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(seed(r))) * r.uniform(0.5, 4.0)
    return logits, k, r.random() < 0.5, f"top_k_gate(random logits [{T}, {E}], k={k})", r.random() < 0.5


def _draw_capacity(r):
    E = r.choice((1, 2, 4, 8))      # E and cf powers of two (or dyadic): k T / E * cf is exact in floating point
    T, k = r.randint(1, 40), r.randint(1, E)
    g = torch.Generator().manual_seed(seed(r))
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    cf = r.choice((0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0))
    return idx, E, cf, f"capacity_keep(T={T}, E={E}, k={k}, cf={cf})"


def _draw_moe_spec(r):
    kv = r.choice((1, 2, 4))
    n_head = kv * r.randint(1, 4)
    E = r.randint(1, 16)
    return (replace(_TOY, name="a random MoE", vocab_size=r.randint(100, 60000), hidden=n_head * 32 * r.randint(1, 4),
                    n_layer=r.randint(1, 48), n_head=n_head, n_kv_head=kv, moe_ffn=64 * r.randint(1, 64),
                    n_routed_experts=E, n_activated_experts=r.randint(1, E), seq_len=r.choice((512, 4096, 32768))),)


fresh_case(ex91, "random logits and k", _draw_gate, _gate_case)
fresh_case(ex92, "random routing, E, k and capacity factor", _draw_capacity, _cap_case)
fresh_case(ex93, "random MoE shapes", _draw_moe_spec, _params_case)
