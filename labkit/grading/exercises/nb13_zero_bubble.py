"""Exercises of notebook 13_zero_bubble: the backward split into I (input gradient) and W
(weight gradient) (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, sec. 2).

13.1 splits a linear layer's backward with autograd; 13.2 is ZB-H1's action list (validated,
timed, run on 4 ranks against the single device); 13.3 the bubble times of 1F1B, ZB-H1 and
ZB-V, where using the full backward T_B = T_I + T_W for the paper's B (the confusion of
DeepSeek-V3 issue #724) is caught and named.
"""
from __future__ import annotations

from fractions import Fraction

import torch

from ...pipeline import peak_in_flight, simulate, zb_h1_schedule, zbv_schedule
from ..registry import CheckFailure, exercise, expect_close
from . import kernel_side
from .nb02_gpipe import expect_same_grads, run_pipeline, validated

# ----------------------------------------------------------------------------- 13.1
ex131 = exercise(
    "13.1", title="input and weight gradients of a linear layer, separately", notebook="13_zero_bubble", points=2,
    hint="out = layer(x); torch.autograd.grad(out, x, grad_out, retain_graph=True) gives dL/dx; a second "
         "torch.autograd.grad(out, [layer.weight, layer.bias], grad_out) gives the rest. Return tensors; "
         "do not call .backward() (it would write .grad).")


def _split_run(split_linear_backward, weight, bias, x, grad_out):
    """Kernel side: the learner's split backward on a Linear with these parameters; its result
    (detached) and whether it wrote a .grad (x's or the layer's)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        layer.weight.copy_(weight)
        layer.bias.copy_(bias)
    x = x.clone().requires_grad_(True)
    got = split_linear_backward(layer, x, grad_out)
    wrote = layer.weight.grad is not None or x.grad is not None
    if isinstance(got, (tuple, list)):
        got = type(got)(t.detach() if isinstance(t, torch.Tensor) else t for t in got)
    return got, wrote


def _linear_case(n_in: int, n_out: int, batch: int, seed: int):
    def case(split_linear_backward):
        g = torch.Generator().manual_seed(seed)
        layer = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=g))
            layer.bias.copy_(torch.randn(n_out, generator=g))
        x = torch.randn(batch, n_in, generator=g, requires_grad=True)
        grad_out = torch.randn(batch, n_out, generator=g)
        got, wrote = kernel_side(split_linear_backward, _split_run, layer.weight.detach(), layer.bias.detach(),
                                 x.detach(), grad_out)
        what = f"split_linear_backward(Linear({n_in}, {n_out}), x [{batch}, {n_in}], grad_out)"
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailure(f"{what}: expected a tuple (grad_input, grad_weight, grad_bias), got "
                               f"{type(got).__name__}")
        if wrote:
            raise CheckFailure(f"{what}: .grad was written (x.grad or layer.weight.grad is set); compute the two "
                               f"parts with torch.autograd.grad and return them")
        # the unsplit backward, on copies
        ref = torch.nn.Linear(n_in, n_out)
        ref.load_state_dict(layer.state_dict())
        xr = x.detach().clone().requires_grad_(True)
        ref(xr).backward(grad_out)
        for name, a, b in (("grad_input", got[0], xr.grad), ("grad_weight", got[1], ref.weight.grad),
                           ("grad_bias", got[2], ref.bias.grad)):
            if not isinstance(a, torch.Tensor):
                raise CheckFailure(f"{what}: {name} is {type(a).__name__}, expected a tensor")
            expect_close(a.detach(), b, f"{what}: {name} vs the full backward")
    return case


ex131.case("Linear(4, 3), batch 2")(_linear_case(4, 3, 2, 0))
ex131.case("Linear(16, 8), batch 5")(_linear_case(16, 8, 5, 1))
ex131.case("Linear(1, 1), batch 1", hidden=True)(_linear_case(1, 1, 1, 2))
ex131.case("Linear(32, 64), batch 7", hidden=True)(_linear_case(32, 64, 7, 3))

# ----------------------------------------------------------------------------- 13.2
ex132 = exercise(
    "13.2", title="the ZB-H1 action list", notebook="13_zero_bubble", points=3,
    hint="Rank r: min(K-1-r, M) warm-up forwards; then for m = 0..M-1: one F (while forwards are left), I(m), "
         "and a W of the oldest microbatch whose I ran, but only while more than r W passes wait; the "
         "remaining W passes at the end.")

COSTS = ((1, 1, 1), (2, 2, 1), (3, 2, 2))  # (T_F, T_I, T_W) with T_W <= min(T_F, T_I)


def _zb_order(zb_h1_order, K: int, M: int):
    what = f"zb_h1_order(K={K}, M={M})"
    return what, validated(zb_h1_order(K, M), what, M, K, fill_communication=True)


def _zb_case(K: int, M: int):
    def case(zb_h1_order):
        what, sched = _zb_order(zb_h1_order, K, M)
        kinds = {a.kind for r in sched for a in sched[r]}
        if K > 1 and "B" in kinds:
            raise CheckFailure(f"{what}: uses full backward B actions; ZB-H1 splits every backward into I then W")
        peaks = peak_in_flight(sched, K)
        for s in range(K):
            if peaks[s] > min(M, K):
                raise CheckFailure(f"{what}: stage {s} holds {peaks[s]} microbatches in flight (F done, W not yet) "
                                   f"at its peak; ZB-H1 keeps 1F1B's peak memory, at most min(M, K) = {min(M, K)}: "
                                   f"rank {s} delays too many W passes")
        for f, i, w in COSTS:
            got = simulate(sched, forward=f, backward_input=i, backward_weight=w).bubble_time
            want = (K - 1) * (f + i - w)
            if got != want:
                hint = (" (more than 1F1B's bubble minus the W: are the W passes delayed, r of them on rank r?)"
                        if got > want else "")
                raise CheckFailure(f"{what}: simulated bubble time {got} per rank with T_F={f}, T_I={i}, T_W={w}; "
                                   f"ZB-H1's is (K-1)(T_F+T_I-T_W) = {want}{hint}")
    return case


ex132.case("K=2, M=4: valid, 1F1B's memory, bubble (K-1)(T_F+T_I-T_W)")(_zb_case(2, 4))
ex132.case("K=4, M=8: valid, 1F1B's memory, bubble (K-1)(T_F+T_I-T_W)")(_zb_case(4, 8))


@ex132.case("K=4, M=8 on 4 real ranks: gradients equal single device", timeout=60)
def _(zb_h1_order):
    what, sched = _zb_order(zb_h1_order, 4, 8)
    expect_same_grads(run_pipeline(sched, 8, timeout=20)["grads"], what + " run on 4 ranks")


ex132.case("K=1, M=3", hidden=True)(_zb_case(1, 3))
ex132.case("K=3, M=5", hidden=True)(_zb_case(3, 5))
ex132.case("K=6, M=12", hidden=True)(_zb_case(6, 12))
ex132.case("K=5, M=5", hidden=True)(_zb_case(5, 5))

# ----------------------------------------------------------------------------- 13.3
ex133 = exercise(
    "13.3", title="bubble times of 1F1B, ZB-H1 and ZB-V", notebook="13_zero_bubble", points=2,
    hint="Per rank: 1F1B (K-1)(T_F + T_I + T_W); ZB-H1 (K-1)(T_F + T_I - T_W); ZB-V with chunk costs "
         "T_F = T_I = T_W: (K-1) T_F. T_I is the input-gradient pass only (the paper's B); the full backward "
         "is T_I + T_W.")

_WANT = {"1f1b": lambda K, f, i, w: (K - 1) * (f + i + w),
         "zb-h1": lambda K, f, i, w: (K - 1) * (f + i - w),
         "zbv": lambda K, f, i, w: (K - 1) * f}


def _confusion(name, K, f, i, w, got):
    """A message naming the full-backward / input-gradient confusion, or None."""
    b = i + w
    if name == "zb-h1" and got == (K - 1) * (f + b - w):
        return ("you put the full backward T_B = T_I + T_W where the zero-bubble paper's B means the input-gradient "
                "pass T_I only; (K-1)(T_F+B-T_W) with B = T_I is right, and in the DeepSeek-V3 report's notation "
                "(B = full backward) the same bubble reads (K-1)(F+B-2W) (DeepSeek-V3 issue #724)")
    if name == "zb-h1" and got == (K - 1) * (f + i - 2 * w):
        return ("you subtracted 2 T_W from T_F + T_I: the DeepSeek-V3 report's (PP-1)(F+B-2W) has B = the full "
                "backward T_I + T_W, so with T_I it is (K-1)(T_F+T_I-T_W) (DeepSeek-V3 issue #724)")
    if name == "1f1b" and got == (K - 1) * (f + i):
        return "1F1B's backward is the full backward T_B = T_I + T_W; the W pass is on the critical path there"
    return None


def _bubble_case(cases):
    def case(bubble_time):
        for name, K, f, i, w in cases:
            what = f"bubble_time({name!r}, K={K}, T_F={f}, T_I={i}, T_W={w})"
            got = bubble_time(name, K, f, i, w)
            want = _WANT[name](K, f, i, w)
            try:
                ok = abs(Fraction(got) - Fraction(want)) <= Fraction(1, 10 ** 9) * max(1, abs(Fraction(want)))
            except (TypeError, ValueError):
                raise CheckFailure(f"{what}: expected a number, got {got!r}") from None
            if not ok:
                why = _confusion(name, K, f, i, w, Fraction(got))
                raise CheckFailure(f"{what}: expected {want}, got {got}" + (f"; {why}" if why else ""))
            # the formula must also be what the simulator shows for the built schedule
            M = 2 * K
            sched = {"1f1b": None, "zb-h1": zb_h1_schedule(K, M), "zbv": zbv_schedule(K, M)}[name]
            if sched is not None:
                sim = simulate(sched, forward=f, backward_input=i, backward_weight=w)
                assert sim.bubble_time == want, (name, K, f, i, w)  # grader self-check
    return case


ex133.case("1F1B and ZB-H1, K=4, T_F=1, T_I=1, T_W=1")(_bubble_case([("1f1b", 4, 1, 1, 1), ("zb-h1", 4, 1, 1, 1)]))
ex133.case("ZB-H1, K=8, T_F=2, T_I=2, T_W=1 (the paper's B)")(_bubble_case([("zb-h1", 8, 2, 2, 1)]))
ex133.case("ZB-V, K=4, chunk costs 1")(_bubble_case([("zbv", 4, 1, 1, 1)]))
ex133.case("1F1B, K=3, T_F=1, T_I=2, T_W=3", hidden=True)(_bubble_case([("1f1b", 3, 1, 2, 3)]))
ex133.case("ZB-H1, K=6, T_F=3, T_I=5, T_W=2", hidden=True)(_bubble_case([("zb-h1", 6, 3, 5, 2)]))
ex133.case("ZB-V, K=8, chunk costs 1/2", hidden=True)(_bubble_case([("zbv", 8, Fraction(1, 2), Fraction(1, 2),
                                                                     Fraction(1, 2))]))
ex133.case("K=1: no bubble", hidden=True)(_bubble_case([("1f1b", 1, 1, 1, 1), ("zb-h1", 1, 2, 1, 1)]))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402

fresh_case(ex132, "random K, M >= K", lambda r: (lambda K: (K, r.randint(K, 3 * K)))(r.randint(1, 6)), _zb_case)
