"""Exercises of notebook 03_1f1b: the solutions pass; a warm-up one forward too long or too short,
a backward before its forward and a wrong in-flight formula fail with useful messages."""
import pytest

from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails
from labkit.pipeline import Action


def order_with_warmup(extra):
    def one_f_one_b_order(K, M):
        order = {}
        for r in range(K):
            warmup = max(0, min(K - r - 1 + extra, M))
            acts = [Action("F", r, m) for m in range(warmup)]
            for i in range(M - warmup):
                acts += [Action("F", r, warmup + i), Action("B", r, i)]
            acts += [Action("B", r, m) for m in range(M - warmup, M)]
            order[r] = acts
        return order
    return one_f_one_b_order


def backward_first(K, M):
    """Wrong: B before F in the steady state (so the last stage runs B0 before F0)."""
    order = {}
    for r in range(K):
        warmup = min(K - r - 1, M)
        acts = [Action("F", r, m) for m in range(warmup)]
        for i in range(M - warmup):
            acts += [Action("B", r, i), Action("F", r, warmup + i)]
        acts += [Action("B", r, m) for m in range(M - warmup, M)]
        order[r] = acts
    return order


def test_1f1b_solution_passes():
    assert_check_passes("3.1", order_with_warmup(0))


def test_in_flight_solution_passes():
    assert_check_passes("3.2", lambda K, M: [min(M, K - s) for s in range(K)])


def unclamped_warmup(K, M):
    """Wrong: a warm-up of K-r-1 forwards even when there are fewer microbatches (M < K)."""
    order = {}
    for r in range(K):
        warmup = K - r - 1
        acts = [Action("F", r, m) for m in range(warmup)]
        for i in range(M - warmup):
            acts += [Action("F", r, warmup + i), Action("B", r, i)]
        acts += [Action("B", r, m) for m in range(M - warmup, M)]
        order[r] = acts
    return order


def test_unclamped_warmup_fails_a_public_case_with_m_below_k():
    assert_public_case_fails("3.1", unclamped_warmup, "fewer microbatches than stages (K=4, M=2)",
                             contains="the validator says: rank 0, action 4 (RECV_B-1@s0): microbatch -1 outside 0..1",
                             hint="does every rank's plan use only microbatches 0..M-1?")
    assert any(c.hidden and c.name.startswith("M < K") for c in get_exercise("3.1").cases)


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "warmup_one_too_long_fails_naming_the_stage":
        ("3.1", order_with_warmup(+1),
         {"contains": "stage 0 holds 3 microbatch(es) in flight at its peak, 1F1B holds 2; it holds more than 1F1B "
                      "needs: the warm-up is too long"}),
    "warmup_one_too_short_fails_naming_the_stage":
        ("3.1", order_with_warmup(-1),
         {"contains": "stage 0 holds 1 microbatch(es) in flight at its peak, 1F1B holds 2; the pipeline never fills: "
                      "the warm-up is too short"}),
    "backward_before_forward_fails_with_validator_message":
        ("3.1", backward_first,
         {"contains": "backward before forward: F0@s1 has not run on this rank"}),
    "in_flight_without_min_fails_for_few_microbatches":
        ("3.2", lambda K, M: [K - s for s in range(K)],
         {"contains": "in_flight_1f1b(K=4, M=2): expected [2, 2, 2, 1], got [4, 3, 2, 1] (more than M on some stages"}),
    "in_flight_gpipe_answer_fails_against_measurement":
        ("3.2", lambda K, M: [M] * K,
         {"contains": "vs the peak measured by the runtime: expected [4, 3, 2, 1], got [8, 8, 8, 8] (every "
                      "microbatch in flight at once"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda K, M: [K - s for s in range(K)], "K=4, M=8: measured", None),
    (lambda K, M: [min(M, K - s - 1) for s in range(K)], "K=4, M=8: measured", "one fewer on every stage"),
    (lambda K, M: [min(M, s + 1) for s in range(K)], "K=4, M=8: measured", "the stages in reverse order"),
    (lambda K, M: [min(M, K)] * K, "K=4, M=8: measured", "the same count on every stage"),
    (lambda K, M: [M] * K, "K=4, M=8: measured", "every microbatch in flight at once: that is GPipe's memory"),
])
def test_in_flight_mistakes_are_named(wrong, case, contains):
    """Issue 36's learner round: each wrong count says what it did (the first passes K=4, M=8 and is named on
    the case with M < K)."""
    if contains is None:
        assert_public_case_fails("3.2", wrong, "K=4, M=2", contains="more than M on some stages")
    else:
        assert_public_case_fails("3.2", wrong, case, contains=contains)
