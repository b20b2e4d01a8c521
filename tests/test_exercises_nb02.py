"""Exercises of notebook 02_gpipe: the solutions pass, plausible wrong answers fail with a message
that says what was wrong (the validator's words, or expected/got)."""
from labkit.grading.testing import assert_check_fails, assert_check_passes
from labkit.pipeline import Action


def gpipe_actions(K, M):
    actions = {}
    for r in range(K):
        acts = []
        for m in range(M):
            acts += ([Action("RECV_F", r, m)] if r > 0 else []) + [Action("F", r, m)] \
                + ([Action("SEND_F", r, m)] if r < K - 1 else [])
        for m in range(M):
            acts += ([Action("RECV_B", r, m)] if r < K - 1 else []) + [Action("B", r, m)] \
                + ([Action("SEND_B", r, m)] if r > 0 else [])
        actions[r] = acts
    return actions


def gpipe_without_receives(K, M):
    """Wrong: sends but never posts the matching receives."""
    return {r: [a for a in acts if not a.kind.startswith("RECV")] for r, acts in gpipe_actions(K, M).items()}


def gpipe_receive_on_rank0(K, M):
    """Wrong: rank 0 also 'receives' its input (stage 0 has no stage before it)."""
    out = gpipe_actions(K, M)
    out[0] = [Action("RECV_F", 0, 0)] + out[0]
    return out


def naive_one_at_a_time(K, M):
    """Valid but not GPipe: each microbatch goes forward and backward before the next starts."""
    actions = {}
    for r in range(K):
        acts = []
        for m in range(M):
            acts += ([Action("RECV_F", r, m)] if r > 0 else []) + [Action("F", r, m)] \
                + ([Action("SEND_F", r, m)] if r < K - 1 else [])
            acts += ([Action("RECV_B", r, m)] if r < K - 1 else []) + [Action("B", r, m)] \
                + ([Action("SEND_B", r, m)] if r > 0 else [])
        actions[r] = acts
    return actions


def count_in_flight(schedule):
    n = 1 + max(a.stage for acts in schedule.values() for a in acts)
    live, peak = [0] * n, [0] * n
    for acts in schedule.values():
        for a in acts:
            if a.kind in ("F", "B"):
                live[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
    return peak


def count_forwards(schedule):
    """Wrong: counts every forward and never subtracts the backwards (right for GPipe only)."""
    n = 1 + max(a.stage for acts in schedule.values() for a in acts)
    out = [0] * n
    for acts in schedule.values():
        for a in acts:
            out[a.stage] += a.kind == "F"
    return out


def count_per_rank(schedule):
    """Wrong: one number per rank (sums a rank's stages), not per stage."""
    out = []
    for acts in schedule.values():
        live = peak = 0
        for a in acts:
            if a.kind in ("F", "B"):
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
        out.append(peak)
    return out


def test_gpipe_solution_passes():
    assert_check_passes("2.1", gpipe_actions)


def test_gpipe_missing_receives_fails_with_validator_message():
    assert_check_fails("2.1", gpipe_without_receives,
                       contains="the validator says: rank 0, action 6 (B0@s0): no RECV_B0@s0 before it")


def test_gpipe_receive_on_first_stage_fails():
    assert_check_fails("2.1", gpipe_receive_on_rank0, contains="stage 0 has no stage -1 to receive from")


def test_one_microbatch_at_a_time_is_not_gpipe():
    assert_check_fails("2.1", naive_one_at_a_time,
                       contains="rank 0 runs B0@s0 before F1@s0; GPipe runs all M forwards before the first backward")


def test_count_in_flight_solution_passes():
    assert_check_passes("2.2", count_in_flight)


def test_counting_forwards_only_fails_on_1f1b():
    assert_check_fails("2.2", count_forwards,
                       contains="count_in_flight(hand-written 1F1B, K=2, M=3)[0]: expected 2, got 3")


def test_counting_per_rank_fails_with_several_stages_per_rank():
    res = assert_check_fails("2.2", count_per_rank)
    assert res.passed >= 3  # the one-stage-per-rank cases pass; the interleaved one (hidden) fails
