"""Exercise 1.2: rounding the bound on M down (floor/int) fails a PUBLIC case with the bubble it
leaves, and a hint to round up; hidden cases keep other K and targets."""
import math

import pytest

from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_passes, assert_public_case_fails


def smallest_ceil(K, target):
    return max(1, math.ceil(round((K - 1) * (1 - target) / target, 9)))


def smallest_floor(K, target):
    """Wrong: rounds (K-1)(1-target)/target down."""
    return max(1, math.floor(round((K - 1) * (1 - target) / target, 9)))


def test_ceil_passes():
    assert_check_passes("1.2", smallest_ceil)


def test_floor_fails_a_public_case_with_the_bubble_it_leaves():
    assert_public_case_fails("1.2", smallest_floor, "K=3, target 0.3",
                             contains="expected 5, got 4; with M=4 the bubble is 0.3333 > 0.3",
                             hint="rounding it one way leaves the bubble above the target")
    assert len([c for c in get_exercise("1.2").cases if c.hidden]) >= 2


def test_integers_of_any_kind_are_accepted():
    """Issue 36: a NumPy int or a 0-d int tensor is an int; a float is named as a float."""
    from labkit.grading.testing import with_ints_as
    for kind in ("numpy", "tensor"):
        assert_check_passes("1.2", with_ints_as(kind, smallest_ceil))
    assert_public_case_fails("1.2", lambda K, t: float(smallest_ceil(K, t)), "returns an int",
                             contains="expected an int, got float 45")


def _checked(f):
    def g(K, M):
        if K < 1 or M < 1:
            raise ValueError("K, M >= 1")
        return f(K, M)
    return g


@pytest.mark.parametrize("wrong, case, contains", [
    (_checked(lambda K, M: (K - 1) / M), "K=4, M=8", "the idle time over the busy time only"),
    (_checked(lambda K, M: K / (M + K)), "K=4, M=8", "K waiting slots counted where a stage waits K - 1"),
    (_checked(lambda K, M: 100 * (K - 1) / (M + K - 1)), "K=4, M=8", "a percentage"),
])
def test_bubble_mistakes_are_named(wrong, case, contains):
    """Issue 36's learner round: each new wrong answer is named, not just a value."""
    assert_public_case_fails("1.1", wrong, case, contains=contains)


def test_rounding_to_the_nearest_is_named_by_a_public_case():
    """Issue 36's learner round: round() instead of ceil passed every public case (a hidden one caught it)."""
    assert_public_case_fails("1.2", lambda K, t: max(1, round((K - 1) * (1 - t) / t)), "K=5, target 0.3",
                             contains="rounded to the nearest whole number: with M=9 the bubble is 0.3077 > 0.3")


def test_the_idle_over_busy_bound_is_named():
    assert_public_case_fails("1.2", lambda K, t: max(1, math.ceil(round((K - 1) / t, 9))), "K=4, target 0.125",
                             contains="that M makes the idle time over the busy time")


def smallest_int_plus_one(K, target):
    """Wrong: int(bound) + 1, one microbatch too many whenever the bound is a whole number."""
    return int(round((K - 1) * (1 - target) / target, 9)) + 1 if K > 1 else 1


def smallest_strictly_below(K, target):
    """Wrong: searches for the first M whose bubble is strictly below the target (one too many when it is equal)."""
    M = 1
    while (K - 1) / (M + K - 1) >= target - 1e-12:
        M += 1
    return M


@pytest.mark.parametrize("wrong", [smallest_int_plus_one, smallest_strictly_below])
def test_a_bound_one_too_many_is_named(wrong):
    """Issue 36: a bound one microbatch too many got "expected 27, got 28" and no mistake."""
    assert_public_case_fails("1.2", wrong, "K=4, target 0.125",
                             contains="expected 21, got 22 (one microbatch more than needed: with M=21 the bubble "
                                      "is already 0.125 <= 0.125")


def test_one_too_few_is_named_in_every_public_value_case():
    """Issue 36: every public case of 1.2 with a value names a bound one too low, not just the values."""
    def one_short(K, t):
        return max(1, smallest_ceil(K, t) - (1 if (K, t) == (8, 0.25) else 0))
    assert_public_case_fails("1.2", one_short, "K=8, target 0.25",
                             contains="expected 21, got 20 (one microbatch too few: with M=20 the bubble is")


def test_one_slot_too_many_is_named():
    """Issue 36's audit: every named mistake of 1.1 has a wrong answer that triggers it."""
    assert_public_case_fails("1.1", _checked(lambda K, M: (K - 1) / (M + K)), "K=4, M=8",
                             contains="one slot too many in the step")


def test_no_check_of_the_inputs_fails_the_case_named_after_it():
    """Issue 36's audit: 1.1's case named after the mistake (rejects M=0) has a wrong answer that triggers it."""
    assert_public_case_fails("1.1", lambda K, M: (K - 1) / (M + K - 1), "rejects M=0 with ValueError",
                             contains="expected ValueError")


def _first_m(K, target):
    """The smallest M with (K-1)/(M+K-1) <= target, in exact arithmetic (target a Fraction)."""
    from fractions import Fraction
    M = 1
    while Fraction(K - 1, M + K - 1) > target:
        M += 1
    return M


def test_no_case_of_1_2_depends_on_how_its_target_rounds_to_binary():
    """A hidden case (K=16, 0.3) expected 35: 15/50 is exactly 3/10, which the float 0.3 is just below, so an
    exact answer (Fraction(target)) got 36. Every (K, target) any case of 1.2 asks (public, hidden, fresh
    draws) must give the same M in exact arithmetic on the float, on the decimal it was written as, and in
    floats: a binary fraction, or a target whose bound on M is not a whole number."""
    from fractions import Fraction

    from labkit.grading.exercises.nb01_pipeline_bubble import _draw_target, _smallest
    from labkit.grading.testing import evaluate

    asked = []

    def recording(K, target):
        asked.append((K, target))
        return _smallest(K, target)

    assert evaluate("1.2", recording).status == "passed"
    import random
    r = random.Random(0)
    asked += [_draw_target(r) for _ in range(200)]
    assert len({a for a in asked}) >= 15, asked
    for K, t in sorted(set(asked)):
        exact, decimal = Fraction(t), Fraction(repr(t))
        bound = (K - 1) * (1 - decimal) / decimal
        assert exact == decimal or bound.denominator != 1 or K == 1, (K, t, "on the boundary and not binary")
        assert _first_m(K, exact) == _first_m(K, decimal) == _smallest(K, t), (K, t)


def test_exact_answers_pass_1_2():
    from fractions import Fraction

    def from_float(K, t):
        return _first_m(K, Fraction(t))

    def from_decimal(K, t):
        return _first_m(K, Fraction(repr(t)))

    def closed_form_exact(K, t):
        t = Fraction(t)
        return max(1, math.ceil((K - 1) * (1 - t) / t))

    for answer in (from_float, from_decimal, closed_form_exact):
        assert_check_passes("1.2", answer)


def test_a_bound_with_no_floor_at_one_is_named_at_k_1():
    """A ceil of the bound with nothing keeping M >= 1 returns 0 for K=1; the line blamed the idle-over-busy
    formula. It names M=0 (no schedule) and asks about K=1, without the fix, and not the formula."""
    res = assert_public_case_fails("1.2", lambda K, t: math.ceil(round((K - 1) * (1 - t) / t, 9)),
                                   "K=1 needs one microbatch",
                                   contains="expected 1, got 0 (M=0 microbatches is no schedule")
    assert "idle time over the busy time" not in res.message and "max(" not in res.message, res.message
