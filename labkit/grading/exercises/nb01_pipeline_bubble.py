"""Exercises of notebook 01_pipeline_bubble: the GPipe bubble (Huang et al. 2019, sec. 2.2).

With K pipeline stages and M microbatches, each stage is idle for K-1 of the M+K-1 time slots
of a forward (and of a backward) pass: bubble fraction (K-1)/(M+K-1).
"""
from __future__ import annotations

import math
import numbers

from ..registry import (
    CheckFailure,
    as_int,
    exercise,
    expect_close,
    expect_equal,
    expect_named,
    expect_raises,
    type_name,
)


def _bubble(K: int, M: int) -> float:
    return (K - 1) / (M + K - 1)


# ----------------------------------------------------------------------------- 1.1
ex11 = exercise(
    "1.1", title="bubble fraction", notebook="01_pipeline_bubble", points=2,
    hint=("Section 2: draw the GPipe timeline for K=2, M=2 and count time slots: how many slots does the whole step "
          "take, and in how many of them does one stage do nothing?"))
ex11.hint2 = ("Count for stage 0 alone the slots it works and the slots it waits; does the count change if you pick "
              "another stage? Which share of the step is the bubble?")
ex11.hint_review = ("leads: asks the learner to count slots on the timeline; the ratio is theirs to write; reviewed "
                    "2026-12-06")


def _bubble_mistakes(K: int, M: int) -> list:
    """1.1's named mistakes for K, M: what each returns."""
    return [((K - 1) / M, "this is the idle time over the busy time only: the fraction is over every slot of "
                          "the step"),
            (K / (M + K), "K waiting slots counted where a stage waits K - 1"),
            (100 * (K - 1) / (M + K - 1), "a percentage: the fraction is between 0 and 1"),
            ((K - 1) / (M + K), "one slot too many in the step")]


@ex11.case("K=4, M=8")
def _(bubble_fraction):
    expect_named(bubble_fraction(4, 8), 3 / 11, "bubble_fraction(K=4, M=8)", _bubble_mistakes(4, 8), rtol=1e-5)


@ex11.case("K=1 (one stage has no bubble)")
def _(bubble_fraction):
    expect_close(bubble_fraction(1, 5), 0.0, "bubble_fraction(K=1, M=5)")


@ex11.case("M=1 (naive model parallelism)")
def _(bubble_fraction):
    expect_close(bubble_fraction(4, 1), 3 / 4, "bubble_fraction(K=4, M=1)")


@ex11.case("rejects M=0 with ValueError",
           hint=("What is a bubble fraction for zero microbatches or zero stages? The docstring says which error to "
                 "raise and when: are the inputs checked before anything is computed?"))
def _(bubble_fraction):
    expect_raises(ValueError, bubble_fraction, 4, 0, what="bubble_fraction(K=4, M=0)")
    expect_raises(ValueError, bubble_fraction, 0, 4, what="bubble_fraction(K=0, M=4)")


@ex11.case("K=8, M=3", hidden=True)
def _(bubble_fraction):
    expect_close(bubble_fraction(8, 3), 7 / 10, "bubble_fraction(K=8, M=3)")


@ex11.case("grid of K and M", hidden=True)
def _(bubble_fraction):
    for K in (2, 3, 5, 16):
        for M in (2, 7, 64):
            expect_close(bubble_fraction(K, M), _bubble(K, M), f"bubble_fraction(K={K}, M={M})")


# ----------------------------------------------------------------------------- 1.2
ex12 = exercise(
    "1.2", title="smallest M for a target bubble", notebook="01_pipeline_bubble", points=2,
    hint=("Section 3: the bubble shrinks as M grows, so you need the FIRST M at which it meets the target. Is your M "
          "a whole number, at least 1, and is the bubble one microbatch earlier still above the target?"))
ex12.hint2 = ("Check your answer against the definition: at your M the bubble is within the target and one microbatch "
              "fewer it is not. If you solved an inequality, is the bound a whole number, and which side of it is "
              "safe?")
ex12.hint_review = ("leads: states the invariant (first M meeting the target) and asks about integrality; leaves the "
                    "search or the solved bound to the learner; reviewed 2026-12-06")


def _smallest(K: int, target: float) -> int:
    M = 1
    while _bubble(K, M) > target:
        M += 1
    return M


def _smallest_mistakes(K: int, target: float) -> list:
    """1.2's named mistakes for K and target: the idle-over-busy bound, and one microbatch too many or too few
    (each with the bubble it gives, so the line names the mistake and not only the value; issue 36)."""
    want = _smallest(K, target)
    # M=0 first: with K=1 every bound is 0 (the idle-over-busy one too), and the mistake is that 0 microbatches
    # is no schedule, not the formula
    out = [(0, "M=0 microbatches is no schedule: a step trains on at least one microbatch. What does your bound "
               "give when K=1, where there is no bubble to shrink?")]
    idle_busy = math.ceil(round((K - 1) / target, 9))
    if idle_busy >= 1:
        out.append((idle_busy, "that M makes the idle time over the busy time, (K-1)/M, reach the target; the "
                               "bubble fraction of 1.1 is over every slot of the step"))
    out.append((want + 1, f"one microbatch more than needed: with M={want} the bubble is already "
                          f"{_bubble(K, want):.4g} <= {target}; when your bound is a whole number, does your "
                          "rounding (or the float it rounds) step past it?"))
    if want > 1:
        out.append((want - 1, f"one microbatch too few: with M={want - 1} the bubble is {_bubble(K, want - 1):.4g} "
                              f"> {target}"))
    return out


def _named_smallest(smallest_microbatches, K: int, target: float) -> None:
    got = smallest_microbatches(K, target)
    expect_named(as_int(got) if as_int(got) is not None else got, _smallest(K, target),
                 f"smallest_microbatches(K={K}, target={target})", _smallest_mistakes(K, target))


# Every target below is either a binary fraction (0.125 is exactly 1/8: the bound on M is a whole number and
# the float says so exactly) or far from putting the bubble on the target at a whole M (0.3 with K=3: the bound
# is 14/3): an exact answer (Fraction of the float, or of the decimal) and a float one agree on each, so no case
# depends on how 0.1 or 0.3 round to binary. tests/exercises/test_exercises_nb01.py checks each with Fraction.
@ex12.case("K=4, target 0.125 (the bound on M is a whole number)")
def _(smallest_microbatches):
    _named_smallest(smallest_microbatches, 4, 0.125)


@ex12.case("K=8, target 0.25")
def _(smallest_microbatches):
    _named_smallest(smallest_microbatches, 8, 0.25)


@ex12.case("K=1 needs one microbatch")
def _(smallest_microbatches):
    _named_smallest(smallest_microbatches, 1, 0.01)


@ex12.case("K=3, target 0.3 (the bound M >= 14/3 is not a whole number)",
           hint=("The bound you solved for is not a whole number here; rounding it one way leaves the bubble above "
                 "the target. Which way is safe?"))
def _(smallest_microbatches):
    K, target = 3, 0.3
    got = smallest_microbatches(K, target)
    want = _smallest(K, target)
    if isinstance(got, numbers.Real) and not isinstance(got, bool) and got == want - 1:
        raise CheckFailure(f"smallest_microbatches(K={K}, target={target}): expected {want}, got {got}; with "
                           f"M={got} the bubble is {_bubble(K, int(got)):.4g} > {target} (rounded down?)")
    expect_named(got, want, f"smallest_microbatches(K={K}, target={target})", _smallest_mistakes(K, target))


@ex12.case("K=5, target 0.3")
def _(smallest_microbatches):
    K, target = 5, 0.3
    got = smallest_microbatches(K, target)
    want = _smallest(K, target)
    got = as_int(got) if as_int(got) is not None else got
    expect_named(got, want, f"smallest_microbatches(K={K}, target={target})",
                 [(want - 1, f"rounded to the nearest whole number: with M={want - 1} the bubble is "
                             f"{_bubble(K, want - 1):.4g} > {target}")])


@ex12.case("returns an int",
           hint="A number of microbatches is a whole number: what type does your function return?")
def _(smallest_microbatches):
    got = smallest_microbatches(4, 0.0625)
    if as_int(got) is None:
        raise CheckFailure(f"smallest_microbatches(K=4, target=0.0625): expected an int, got {type_name(got)}")
    expect_named(as_int(got), _smallest(4, 0.0625), "smallest_microbatches(K=4, target=0.0625)",
                 _smallest_mistakes(4, 0.0625))


@ex12.case("K=5, target 0.15", hidden=True)
def _(smallest_microbatches):
    expect_equal(smallest_microbatches(5, 0.15), _smallest(5, 0.15), "smallest_microbatches(K=5, target=0.15)")


@ex12.case("grid of K and targets", hidden=True, timeout=30)  # 16 round trips to the kernel: room under load
def _(smallest_microbatches):
    # K=16 with 0.3 put the bubble exactly on 3/10 at M=35, which the float 0.3 is just below: K=17 instead
    for K in (2, 3, 6, 17):
        for target in (0.5, 0.3, 0.07, 0.013):
            expect_equal(smallest_microbatches(K, target), _smallest(K, target),
                         f"smallest_microbatches(K={K}, target={target})")


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402


def _bubble_case(K: int, M: int):
    def case(bubble_fraction):
        expect_close(bubble_fraction(K, M), _bubble(K, M), f"bubble_fraction(K={K}, M={M})")
    return case


def _target_case(K: int, target: float):
    def case(smallest_microbatches):
        expect_equal(smallest_microbatches(K, target), _smallest(K, target),
                     f"smallest_microbatches(K={K}, target={target})")
    return case


def _draw_target(r):
    """K and a target that float rounding cannot put on the boundary (the bubble at M and M-1 is not ~target)."""
    while True:
        K, target = r.randint(1, 40), round(r.uniform(0.004, 0.95), 4)
        M = _smallest(K, target)
        if abs(_bubble(K, M) - target) > 1e-6 and (M == 1 or abs(_bubble(K, M - 1) - target) > 1e-6):
            return K, target


fresh_case(ex11, "random K, M", lambda r: (r.randint(1, 64), r.randint(1, 256)), _bubble_case)
fresh_case(ex12, "random K and targets", _draw_target, _target_case)
