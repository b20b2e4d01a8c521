"""Exercise 1.2: rounding the bound on M down (floor/int) fails a PUBLIC case with the bubble it
leaves, and a hint to round up; hidden cases keep other K and targets."""
import math

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
                             contains="expected an int, got float 57")
