"""Exercises of notebook 13_zero_bubble: the backward split into I (input gradient) and W
(weight gradient) (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ICLR, sec. 2).

13.1 splits a linear layer's backward with autograd (judged on the three returned gradients, with
``.grad`` holding earlier gradients so that one written shows in them); 13.2 is ZB-H1's action list (validated,
timed, run on 4 ranks against the single device); 13.3 the bubble times of 1F1B, ZB-H1 and
ZB-V, where using the full backward T_B = T_I + T_W for the paper's B (the confusion of
DeepSeek-V3 issue #724) is caught and named.
"""
from __future__ import annotations

from fractions import Fraction

import torch

from ...pipeline import peak_in_flight, simulate, zb_h1_schedule, zbv_schedule
from ..kernelside.nb13_zero_bubble import _split_run  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, _shown, exercise, expect_close
from . import kernel_side
from .nb02_gpipe import expect_same_grads, run_pipeline, validated

# ----------------------------------------------------------------------------- 13.1
ex131 = exercise(
    "13.1", title="input and weight gradients of a linear layer, separately", notebook="13_zero_bubble", points=2,
    hint=("Section 1: the input gradient and the weight gradients come from two passes over the same graph. What does "
          "the first pass free by default that the second still needs?"))
ex131.hint2 = ("Two passes over one graph, from the same output gradient: which tensor does the input-gradient pass "
               "differentiate with respect to, which tensors the weight-gradient pass, and does anything you return "
               "come from .grad?")
ex131.hint_review = ("leads: asks what the first pass frees and what each pass differentiates; the option and calls "
                     "are the learner's; reviewed 2026-12-06")


def _linear_case(n_in: int, n_out: int, batch: int, seed: int):
    def case(split_linear_backward):
        g = torch.Generator().manual_seed(seed)
        layer = torch.nn.Linear(n_in, n_out)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n_out, n_in, generator=g))
            layer.bias.copy_(torch.randn(n_out, generator=g))
        x = torch.randn(batch, n_in, generator=g, requires_grad=True)
        grad_out = torch.randn(batch, n_out, generator=g)
        # .grad already holds earlier microbatches' gradients (as in a pipeline): an answer that
        # writes .grad shows it in the values it returns, judged here
        held = tuple(torch.randn(t.shape, generator=g) for t in (x, layer.weight, layer.bias))
        ran = kernel_side(split_linear_backward, _split_run, layer.weight.detach(), layer.bias.detach(),
                          x.detach(), grad_out, held)
        if not (isinstance(ran, tuple) and len(ran) == 2):
            raise CheckFailure(f"the check's kernel-side code returned {type(ran).__name__}, not (result, .grad)")
        got, after = ran
        what = f"split_linear_backward(Linear({n_in}, {n_out}), x [{batch}, {n_in}], grad_out)"
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailure(f"{what}: expected a tuple (grad_input, grad_weight, grad_bias), got "
                               f"{type(got).__name__}")
        # the unsplit backward, on copies
        ref = torch.nn.Linear(n_in, n_out)
        ref.load_state_dict(layer.state_dict())
        xr = x.detach().clone().requires_grad_(True)
        ref(xr).backward(grad_out)
        for name, a, b, h in (("grad_input", got[0], xr.grad, held[0]), ("grad_weight", got[1], ref.weight.grad,
                                                                           held[1]),
                              ("grad_bias", got[2], ref.bias.grad, held[2])):
            if not isinstance(a, torch.Tensor):
                raise CheckFailure(f"{what}: {name} is {type(a).__name__}, expected a tensor")
            if a.shape == b.shape and torch.allclose(a.double(), (b + h).double(), rtol=1e-4, atol=1e-5):
                raise CheckFailure(f"{what}: {name} is this call's gradient plus what .grad held before it: "
                                   f".grad was written (it accumulates); return the gradients themselves")
            expect_close(a.detach(), b, f"{what}: {name} vs the full backward")
        for name, a, h in zip(("x.grad", "weight.grad", "bias.grad"), after if isinstance(after, tuple) else (), held):
            if not (isinstance(a, torch.Tensor) and a.shape == h.shape and torch.equal(a, h)):
                raise CheckFailure(f"{what}: {name} changed during the call: a split backward computes the gradients "
                                   f"with torch.autograd.grad and leaves .grad as it was (earlier microbatches' "
                                   f"gradients live there); do not write, clear or accumulate into .grad")
        if not (isinstance(after, tuple) and len(after) == 3):
            raise CheckFailure(f"the check's kernel-side code returned {type(after).__name__}, not three .grad values")
    return case


ex131.case("Linear(4, 3), batch 2")(_linear_case(4, 3, 2, 0))
ex131.case("Linear(16, 8), batch 5")(_linear_case(16, 8, 5, 1))
ex131.case("Linear(1, 1), batch 1", hidden=True)(_linear_case(1, 1, 1, 2))
ex131.case("Linear(32, 64), batch 7", hidden=True)(_linear_case(32, 64, 7, 3))

# ----------------------------------------------------------------------------- 13.2
# Other routes to the same value (issue 40): labkit's zb_h1_schedule and its helpers, and every kit function
# that reaches them, are withheld from the graded kernel until 13.2 is graded. torch.distributed.pipelining's
# own zero-bubble schedules (their private action lists) are ACCEPTED as knowledge, like numpy: a learner
# who turns torch's internal actions into this kit's F/I/W list per rank has worked out the order.
ex132 = exercise(
    "13.2", title="the ZB-H1 action list", notebook="13_zero_bubble", points=3,
    hint=("Section 2: ZB-H1 keeps 1F1B's sequence of forwards and input-gradient passes; only the W passes move. "
          "Which ranks may hold W passes back to fill the end of their step, and how many without exceeding 1F1B's "
          "memory?"))
ex132.hint2 = ("Check each rank's peak in flight (from its F to its W) against K, and check that the last rank holds "
               "nothing back. Any pending W may run (labkit takes the oldest).")
ex132.hint_review = ("leads: asks how many W passes a rank may hold back and gives the memory invariant; no loop or "
                     "condition written out; reviewed 2026-12-06")

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
        for r in range(K):  # the warm-up first, as for 1F1B (3.1): a wrong one shows up in everything after it
            comp = [a for a in sched[r] if a.kind in ("F", "I", "W", "B")]
            first_i = next((i for i, a in enumerate(comp) if a.kind in ("I", "B")), len(comp))
            n_f, want_f = sum(a.kind == "F" for a in comp[:first_i]), min(K - r, M)
            if n_f != want_f:
                why = "too long: it holds more microbatches than 1F1B" if n_f > want_f else \
                    "too short: the pipeline never fills"
                raise CheckFailure(f"{what}: rank {r} runs {n_f} forward(s) before its first I, 1F1B's warm-up "
                                   f"plus one forward (notebook 03) is {want_f}; the warm-up is {why}")
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
                hint = (" (more than ZB-H1's: are some W passes held back to fill the drain, and the others run early?)"
                        if got > want else "")
                raise CheckFailure(f"{what}: simulated bubble time {got} per rank with T_F={f}, T_I={i}, T_W={w}; "
                                   f"ZB-H1's is {want}{hint}")
    return case


ex132.case("K=2, M=4: valid, peak memory and bubble simulated")(_zb_case(2, 4))
ex132.case("K=4, M=8: valid, peak memory and bubble simulated")(_zb_case(4, 8))


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
    hint=("Section 3: what is a rank's idle time made of on each schedule: which passes of the later stages does the "
          "first stage wait for, and which of them does a zero-bubble schedule move out of the way? Mind which 'B' a "
          "formula means: the zero-bubble paper's B is the input-gradient pass only."))
ex133.hint2 = ("Read the idle time off the K=2 timelines of section 2 with the cost model: which passes fill the gap "
               "on the first rank in each schedule, and how many such gaps does a rank have with K stages?")
ex133.hint_review = ("leads: asks which passes the first stage waits for in each schedule; the three formulas are the "
                     "learner's; reviewed 2026-12-06")

_WANT = {"1f1b": lambda K, f, i, w: (K - 1) * (f + i + w),
         "zb-h1": lambda K, f, i, w: (K - 1) * (f + i - w),
         "zbv": lambda K, f, i, w: (K - 1) * f}


def _confusion(name, K, f, i, w, got):
    """A message naming the full-backward / input-gradient confusion, or None."""
    b = i + w
    if name == "zb-h1" and got == (K - 1) * (f + b - w):
        return ("you put the full backward T_B = T_I + T_W where the zero-bubble paper's B means the input-gradient "
                "pass T_I only; the DeepSeek-V3 report writes its formula with B = the full backward, the "
                "zero-bubble paper with B = T_I (DeepSeek-V3 issue #724)")
    if name == "zb-h1" and got == (K - 1) * (f + i - 2 * w):
        return ("you subtracted 2 T_W, as the DeepSeek-V3 report's formula does; but its B = the full backward "
                "T_I + T_W, while this function gets T_I, the input-gradient pass alone (DeepSeek-V3 issue #724)")
    if name == "1f1b" and got == (K - 1) * (f + i):
        return "1F1B's backward is the full backward T_B = T_I + T_W; the W pass is on the critical path there"
    if K > 1 and got == Fraction(_WANT[name](K, f, i, w)) * K / (K - 1):
        return "K idle stretches counted where a rank waits K - 1 (the first rank starts at once)"
    if name == "zbv" and got == Fraction(_WANT["zb-h1"](K, f, i, w)) / 2:
        return "half of ZB-H1's: ZB-V's bubble is not a fraction of ZB-H1's, it has its own (section 4)"
    return None


def _bubble_case(cases):
    def case(bubble_time):
        for name, K, f, i, w in cases:
            what = f"bubble_time({name!r}, K={K}, T_F={f}, T_I={i}, T_W={w})"
            got = bubble_time(name, K, f, i, w)
            if isinstance(got, torch.Tensor) and got.dim() == 0:  # a 0-d tensor is a number too (issue 36)
                got = got.item()
            want = _WANT[name](K, f, i, w)
            try:
                ok = abs(Fraction(got) - Fraction(want)) <= Fraction(1, 10 ** 9) * max(1, abs(Fraction(want)))
            except (TypeError, ValueError):
                raise CheckFailure(f"{what}: expected a number, got {_shown(got)}") from None
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
from ..fresh import fresh_case, seed  # noqa: E402

fresh_case(ex132, "random K, M >= K", lambda r: (lambda K: (K, r.randint(K, 3 * K)))(r.randint(1, 6)), _zb_case)

fresh_case(ex131, "random sizes and values", lambda r: (r.randint(1, 32), r.randint(1, 32), r.randint(1, 8), seed(r)),
           _linear_case)


def _draw_bubbles(r):
    """A random (name, K, T_F, T_I, T_W) of each schedule, in the range where each formula holds: ZB-H1 with
    T_W <= min(T_F, T_I), ZB-V with equal chunk costs."""
    K = r.randint(1, 8)
    f, i = r.randint(1, 6), r.randint(1, 6)
    c = r.choice((Fraction(1, 2), Fraction(1), Fraction(2), Fraction(3)))
    return ([("1f1b", K, f, i, r.randint(1, 6)), ("zb-h1", K, f, i, r.randint(1, min(f, i))), ("zbv", K, c, c, c)],)


fresh_case(ex133, "random K and costs", _draw_bubbles, _bubble_case)
