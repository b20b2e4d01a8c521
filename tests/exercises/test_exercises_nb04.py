"""Exercises of notebook 04_interleaved: the solutions pass; 1-based layers, the contiguous split,
a bubble without v, no ValueError for a bad M and forward-only send counts fail with useful messages."""
import pytest

from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


def layers_of_rank(rank, n_layers, K, v):
    per = n_layers // (K * v)
    return [layer for c in range(v) for layer in range((c * K + rank) * per, (c * K + rank + 1) * per)]


def interleaved_bubble(K, M, v):
    if v > 1 and M % max(1, M // K):
        raise ValueError("the rounds max(1, M // K) must divide M")
    return (K - 1) / (v * M + K - 1)


def test_layers_solution_passes():
    assert_check_passes("4.1", layers_of_rank)


def test_bubble_solution_passes():
    assert_check_passes("4.2", interleaved_bubble)


def test_sends_solution_passes():
    assert_check_passes("4.3", lambda K, M, v: 0 if K == 1 else 2 * M * (K * v - 1))


def test_sends_forgetting_k1_fails_a_public_case():
    assert_public_case_fails("4.3", lambda K, M, v: 2 * M * (K * v - 1), "K=1, M=4, v=3",
                             contains="p2p_sends(K=1, M=4, v=3) vs the SEND actions in the schedule: expected 0, got 16",  # noqa: E501
                             hint="With one rank, does any message ever leave it?")
    assert any(c.hidden and c.name.startswith("K=1") for c in get_exercise("4.3").cases)


def test_megatron_multiple_of_k_rule_fails_on_what_torch_runs():
    def old_rule(K, M, v):
        if v > 1 and M % K:
            raise ValueError("M must be a multiple of K")
        return (K - 1) / (v * M + K - 1)
    assert_check_fails("4.2", old_rule, contains="torch's ScheduleInterleaved1F1B runs K=4, M=6")


def test_rounds_rule_applied_to_v1_is_named():
    """Issue 36: the rounds check applied for v = 1 too passed every case (the v = 1 case used M = 6)."""
    def rounds_always(K, M, v):
        if M % max(1, M // K):
            raise ValueError("the rounds max(1, M // K) must divide M")
        return (K - 1) / (v * M + K - 1)
    assert_public_case_fails("4.2", rounds_always, "K=4, M=9, v=1", contains="with v = 1 there is one chunk per rank")


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "layers_counted_from_one_fails_naming_the_convention":
        ("4.1", lambda r, L, K, v: [i + 1 for i in layers_of_rank(r, L, K, v)],
         {"contains": "expected [0, 1, 8, 9], got [1, 2, 9, 10]: this notebook counts layers from 0"}),
    "contiguous_split_fails_naming_looped_placement":
        ("4.1", lambda r, L, K, v: list(range(r * L // K, (r + 1) * L // K)),
         {"contains": "that is the contiguous split of plain 1F1B"}),
    "bubble_without_v": ("4.2", lambda K, M, v: (K - 1) / (M + K - 1),
                         {"contains": "interleaved_bubble(K=4, M=8, v=2) vs the simulated bubble: expected 0.157895, "
                                      "got 0.272727"}),
    "bubble_without_the_microbatch_rule": ("4.2", lambda K, M, v: (K - 1) / (v * M + K - 1),
                                           {"contains": "interleaved_bubble(K=4, M=9, v=2): expected ValueError to "
                                                        "be raised"}),
    "sends_forward_only": ("4.3", lambda K, M, v: M * (K * v - 1),
                           {"contains": "p2p_sends(K=4, M=8, v=1) vs the SEND actions in the schedule: expected 48, "
                                        "got 24"}),
    "sends_ignoring_chunks": ("4.3", lambda K, M, v: 2 * M * (K - 1),
                              {"contains": "p2p_sends(K=4, M=8, v=2) vs the SEND actions in the schedule: expected "
                                           "112, got 48"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


def test_new_learner_mistakes_are_named():
    """Issue 36's learner round: layers dealt round robin, sends counted per rank or past the last stage."""
    assert_public_case_fails("4.1", lambda r, L, K, v: list(range(r, L, K)), "16 layers, K=4, v=2, rank 0",
                             contains="layers dealt out one at a time, round robin")
    assert_public_case_fails("4.3", lambda K, M, v: 0 if K == 1 else 2 * M * (K * v - 1) * K, "K=4, M=8",
                             contains="counted once per rank")
    assert_public_case_fails("4.3", lambda K, M, v: 0 if K == 1 else 2 * M * K * v, "K=4, M=8",
                             contains="is there a boundary after the last stage?")
    assert_public_case_fails("4.3", lambda K, M, v: 0 if K == 1 else 2 * (K * v - 1), "K=4, M=8",
                             contains="one microbatch: all M cross every boundary")


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda K, M, v: 0 if K == 1 else M * (K * v - 1), "K=4, M=8",
     "forward only: the gradients cross every boundary back"),
    (lambda K, M, v: 2 * M * (K * v - 1), "K=1, M=4, v=3", "stages on the same rank do not send to each other"),
])
def test_every_named_sends_mistake_is_triggered(wrong, case, contains):
    """Issue 36's audit: each named mistake of 4.3 has a wrong answer whose line names it."""
    assert_public_case_fails("4.3", wrong, case, contains=contains)
