"""Schedules as data: builders, simulator formulas, validator messages, build-time errors.

No process is started here."""
import functools
from fractions import Fraction

import pytest

from labkit.pipeline import (
    Action,
    ScheduleError,
    add_communication,
    bubble_formula,
    format_schedule,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    parse_actions,
    peak_in_flight,
    simulate,
    validate_schedule,
)


def _grid():
    for K in range(1, 9):
        for M in range(1, 33):
            yield "gpipe", K, M, 1, gpipe_schedule(K, M)
            yield "1f1b", K, M, 1, one_f_one_b_schedule(K, M)
            for v in range(2, 5):
                if M % K and M > 16:
                    continue  # M % K != 0: up to 16 (keeps the grid's time down)
                try:      # torch's rule: max(1, M // K) equal rounds (M % K != 0 included)
                    s = interleaved_schedule(K, M, v)
                except ScheduleError:
                    assert M > K and M % max(1, M // K), (K, M)
                    continue
                yield "interleaved", K, M, v, s


@functools.lru_cache(maxsize=None)
def grid():
    """Every (name, K, M, v, schedule) with K in 1..8, M in 1..32, v in 1..4 where defined."""
    return list(_grid())


def test_action_repr_and_parse_round_trip():
    a = Action("F", 1, 0)
    assert repr(a) == "F0@s1" and str(Action("SEND_B", 3, 12)) == "SEND_B12@s3"
    acts = parse_actions("F0@s1, SEND_F0@s1\nRECV_B0@s1 B0@s1")
    assert acts == [Action("F", 1, 0), Action("SEND_F", 1, 0), Action("RECV_B", 1, 0), Action("B", 1, 0)]
    assert parse_actions(" ".join(map(repr, acts))) == acts
    with pytest.raises(ScheduleError, match="cannot parse action 'X0@s1'"):
        parse_actions("X0@s1")


def test_builders_print_readably_and_place_stages_looped():
    s = gpipe_schedule(2, 2)
    assert format_schedule(s, compute_only=True) == "rank 0: F0@s0 F1@s0 B0@s0 B1@s0\nrank 1: F0@s1 F1@s1 B0@s1 B1@s1"
    # 16 layers on K=4 ranks with v=2 -> 8 stages; rank 0 holds stages 0 and 4 (layers 0-1 and 8-9)
    s = interleaved_schedule(4, 8, 2)
    assert {a.stage for a in s[0]} == {0, 4} and {a.stage for a in s[3]} == {3, 7}
    one = one_f_one_b_schedule(3, 4)
    assert [repr(a) for a in one[0] if a.kind in "FB"] == \
        ["F0@s0", "F1@s0", "F2@s0", "B0@s0", "F3@s0", "B1@s0", "B2@s0", "B3@s0"]


def test_bubble_formula_and_peak_in_flight_over_the_grid_b_equals_f():
    """Every built schedule is valid. Uniform costs, b = f, free communication:
    bubble == (K-1)/(vM+K-1) exactly (M < K: (v(K-M)+M-1)/(vK+M-1)); peak in
    flight M on every stage for GPipe, min(M, K-s) on stage s for 1F1B."""
    for name, K, M, v, s in grid():
        validate_schedule(s, n_microbatches=M, n_stages=K * v)
        r = simulate(s, forward=1, backward=1, comm=0, validate=False)
        assert isinstance(r.bubble_fraction, Fraction)
        assert r.bubble_fraction == bubble_formula(K, M, v), (name, K, M, v)
        assert r.makespan == 2 * (v * max(M, K) + min(M, K) - 1)
        assert r.peak_in_flight == peak_in_flight(s)
        if name == "gpipe":
            assert r.peak_in_flight == [M] * K
        elif name == "1f1b":
            assert r.peak_in_flight == [min(M, K - st) for st in range(K)]
        else:
            assert max(r.peak_in_flight) <= v * M


def test_bubble_formula_with_b_equals_2f():
    """With b = 2f the formula stays exact for GPipe and 1F1B (critical path (M+K-1)(f+b));
    it also holds for our interleaved schedule (checked on a part of the grid here; enumerated
    once for b/f in {1/2, 1, 2, 3} over K = 1..8, M = 1..32, v = 1..4)."""
    for name, K, M, v, s in grid():
        if name == "interleaved" and (M > 16 or v > 3):
            continue
        r = simulate(s, forward=1, backward=2, validate=False)
        assert r.bubble_fraction == bubble_formula(K, M, v), (name, K, M, v)


def test_float_costs_match_formula_to_1e12():
    for _name, K, M, v, s in grid()[::7]:
        r = simulate(s, forward=0.3, backward=0.3, validate=False)
        assert abs(r.bubble_fraction - float(bubble_formula(K, M, v))) < 1e-12


def test_per_stage_costs_and_comm_cost():
    # a slow last stage dominates: GPipe K=2, M=2, f=(1, 3), b=(1, 3), comm 0.5
    r = simulate(gpipe_schedule(2, 2), forward=[1, 3], backward=[1, 3], comm=Fraction(1, 2))
    tl = {repr(t.action): (t.start, t.end) for t in r.timeline[1]}
    assert tl["F0@s1"] == (Fraction(3, 2), Fraction(9, 2))
    assert tl["B1@s1"] == (Fraction(21, 2), Fraction(27, 2))
    assert r.makespan == Fraction(27, 2) + Fraction(1, 2) + 1  # grad message, then B1@s0


def test_add_communication_posts_receives_in_sender_order():
    compute = {0: parse_actions("F0@s0 F1@s0 B0@s0 B1@s0"), 1: parse_actions("F0@s1 F1@s1 B0@s1 B1@s1")}
    s = add_communication(compute, lookahead=0)
    assert " ".join(map(repr, s[1])) == ("RECV_F0@s1 F0@s1 RECV_F1@s1 F1@s1 B0@s1 SEND_B0@s1 B1@s1 SEND_B1@s1")
    validate_schedule(s)


# ----------------------------------------------------------------------------- validator

def _two_rank(rank0: str, rank1: str):
    return {0: parse_actions(rank0), 1: parse_actions(rank1)}


GOOD0 = "F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0"
GOOD1 = "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1"


def test_validator_accepts_a_hand_written_1f1b():
    validate_schedule(_two_rank(GOOD0, GOOD1))


def test_validator_backward_before_forward():
    s = _two_rank(GOOD0, "RECV_F0@s1 B0@s1 F0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1")
    with pytest.raises(ScheduleError, match=r"rank 1, action 1 \(B0@s1\): backward before forward"):
        validate_schedule(s)


def test_simulate_validates_first_with_the_validators_message():
    """simulate() runs the validity pass before timing: a schedule that never runs B1@s0 (a
    gradient lost, no deadlock) is refused with validate_schedule's message; validate=False times it."""
    s = _two_rank("F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0", GOOD1)
    with pytest.raises(ScheduleError) as want:
        validate_schedule(s)
    assert "B1@s0 is missing" in str(want.value)
    with pytest.raises(ScheduleError) as got:
        simulate(s)
    assert str(got.value) == str(want.value)
    assert simulate(s, validate=False).makespan > 0


def test_validator_missing_receive():
    s = _two_rank(GOOD0, "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 F1@s1 B1@s1 SEND_B1@s1")
    with pytest.raises(ScheduleError, match=r"rank 1, action 4 \(F1@s1\): no RECV_F1@s1 before it; its input "
                                            r"comes from rank 0"):
        validate_schedule(s)


def test_validator_send_without_receive_and_receive_without_send():
    s = _two_rank(GOOD0 + " ", GOOD1)
    s[0].insert(2, Action("SEND_F", 0, 0))  # duplicate
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(SEND_F0@s0\): SEND_F0@s0 appears twice"):
        validate_schedule(s)
    s = _two_rank(GOOD0, GOOD1)
    s[1] = [a for a in s[1] if repr(a) != "SEND_B1@s1"]
    with pytest.raises(ScheduleError, match=r"rank 1, action 6 \(B1@s1\): its result is never sent"):
        validate_schedule(s)


def test_validator_send_order_mismatch():
    s = _two_rank("F0@s0 F1@s0 SEND_F1@s0 SEND_F0@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0", GOOD1)
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RECV_F0@s1\): receive number 0 from rank 0, but "
                                            r"rank 0's send number 0 to rank 1 is SEND_F1@s0 \(action 2\)"):
        validate_schedule(s)


def test_validator_swapped_send_deadlocks_async():
    """Rank 0 sends its activation only after the backward that needs the answer."""
    s = _two_rank("F0@s0 RECV_B0@s0 B0@s0 SEND_F0@s0", "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1")
    with pytest.raises(ScheduleError, match=r"deadlock with async sends: rank 0, action 2 \(B0@s0\) waits for the "
                                            r"input from rank 1; rank 1, action 1 \(F0@s1\) waits for the input "
                                            r"from rank 0"):
        validate_schedule(s)


def test_validator_swapped_send_order_deadlocks_with_blocking_sends():
    """Both neighbours send first: fine with the runtime's async sends, a deadlock with
    blocking (rendezvous) sends; swapping rank 1's send and receive fixes it."""
    bad1 = "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1"
    validate_schedule(_two_rank(GOOD0, bad1))
    with pytest.raises(ScheduleError, match=r"deadlock with blocking \(rendezvous\) sends: rank 0, action 3 "
                                            r"\(SEND_F1@s0\) waits for rank 1; rank 1, action 3 \(SEND_B0@s1\) "
                                            r"waits for rank 0"):
        validate_schedule(_two_rank(GOOD0, bad1), sends="blocking")
    fixed1 = "RECV_F0@s1 F0@s1 B0@s1 RECV_F1@s1 SEND_B0@s1 F1@s1 B1@s1 SEND_B1@s1"
    validate_schedule(_two_rank(GOOD0, fixed1), sends="blocking")


def test_validator_wrong_rank_missing_action_and_bad_kind():
    s = _two_rank("F0@s1", "F0@s0")
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(F0@s1\): stage 1 lives on rank 1"):
        validate_schedule(s)
    s = _two_rank(GOOD0.replace(" RECV_B1@s0 B1@s0", ""), GOOD1)
    with pytest.raises(ScheduleError, match=r"rank 0, action 6 \(end of list\): B1@s0 is missing; every stage "
                                            r"runs F and B of every microbatch \(M=2\) exactly once"):
        validate_schedule(s)
    s = _two_rank(GOOD0, GOOD1)
    s[0][0] = Action("X", 0, 0)
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(X0@s0\): unknown kind 'X'"):
        validate_schedule(s)


def test_validator_local_stage_order_for_one_rank():
    s = {0: parse_actions("F0@s1 F0@s0 B0@s1 B0@s0")}
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(F0@s1\): forward of stage 1 before the forward "
                                            r"of stage 0"):
        validate_schedule(s)


# ----------------------------------------------------------------------------- build-time errors

@pytest.mark.parametrize("call, message", [
    (lambda: gpipe_schedule(4, 0), r"M \(microbatches\) must be an integer >= 1, got 0"),
    (lambda: one_f_one_b_schedule(0, 4), r"K \(pipeline ranks\) must be an integer >= 1, got 0"),
    (lambda: interleaved_schedule(4, 8, 0), r"v \(chunks per rank\) must be an integer >= 1, got 0"),
    (lambda: interleaved_schedule(4, 9, 2), r"K=4 ranks needs M split into equal rounds .* = 2 must divide M\); got M=9"),  # noqa: E501
])
def test_build_time_errors(call, message):
    with pytest.raises(ScheduleError, match=message):
        call()


def test_1f1b_with_fewer_microbatches_than_stages_caps_warmup():
    s = one_f_one_b_schedule(4, 2)
    validate_schedule(s)
    assert simulate(s).peak_in_flight == [2, 2, 2, 1]


def test_validator_max_in_flight():
    K, M = 4, 8
    validate_schedule(one_f_one_b_schedule(K, M), max_in_flight=[min(M, K - s) for s in range(K)])
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(F4@s0\): stage 0 would hold 5 microbatches in "
                                            r"flight \(forward done, backward not yet\), more than max_in_flight=4"):
        validate_schedule(gpipe_schedule(K, M), max_in_flight=[min(M, K - s) for s in range(K)])


def test_validator_and_simulator_import_only_lower_modules():
    """validate.py and simulate.py both stand on schedules/symbolic/rules; neither imports the other."""
    import ast
    import importlib
    import inspect
    for name, other in (("simulate", "validate"), ("validate", "simulate")):
        mod = importlib.import_module(f"labkit.pipeline.{name}")  # the module, not the function
        imported = {n.module for n in ast.walk(ast.parse(inspect.getsource(mod))) if isinstance(n, ast.ImportFrom)}
        assert imported <= {"__future__", "dataclasses", "fractions", "numbers", "typing", "rules", "schedules",
                            "symbolic"}, (mod.__name__, imported)
        assert other not in imported
