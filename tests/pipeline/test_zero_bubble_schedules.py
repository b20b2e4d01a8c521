"""Zero-bubble schedules as data: the I/W kinds, the validator's rules for them, the builders
(ZB-H1, ZB-V, DualPipeV) and each bubble formula on a grid of K, M and costs (simulator)."""
import itertools
from fractions import Fraction as Fr

import pytest

from labkit.pipeline import (
    Action,
    ScheduleError,
    add_communication,
    bubble_time_formula,
    dualpipev_overlapped,
    dualpipev_schedule,
    infer_placement,
    one_f_one_b_schedule,
    parse_actions,
    peak_in_flight,
    peak_waiting_for_w,
    simulate,
    stage_rank,
    validate_schedule,
    zb_h1_schedule,
    zbv_schedule,
    zero_bubble,
)

COSTS = list(itertools.product([1, 2, 3], repeat=3)) + [(Fr(3, 2), 1, Fr(1, 2)), (1, Fr(5, 2), Fr(1, 3))]


def _split(sched):
    """1F1B with each B replaced by I then W at the same place (no W delayed)."""
    return {r: [x for a in acts for x in ((Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch))
                                          if a.kind == "B" else (a,))] for r, acts in sched.items()}


def _bubble(sched, f, i, w, **kw):
    return simulate(sched, forward=f, backward_input=i, backward_weight=w, **kw).bubble_time


def test_1f1b_bubble_with_split_costs():
    for K, M in [(1, 3), (2, 2), (3, 5), (4, 8), (5, 7)]:
        s = one_f_one_b_schedule(K, M)
        for f, i, w in COSTS:
            assert _bubble(s, f, i, w) == bubble_time_formula("1f1b", K, f, i, w) == (K - 1) * (f + i + w)


def test_zb_h1_bubble_formula_on_grid():
    """(K-1)(T_F + T_I - T_W) exactly, for every K <= 6, M in K..2K+1 and costs with T_W <= min(T_F, T_I)."""
    n = 0
    for K in range(1, 7):
        for M in range(K, 2 * K + 2):
            s = zb_h1_schedule(K, M)
            for f, i, w in COSTS:
                if w <= min(f, i):
                    assert _bubble(s, f, i, w) == (K - 1) * (f + i - w), (K, M, f, i, w)
                    n += 1
    assert n > 500


def test_zb_h1_formula_check_catches_an_undelayed_w():
    """The same check fails for I and W run back to back (no W kept for the drain)."""
    for K, M in [(3, 6), (4, 8)]:
        assert _bubble(_split(one_f_one_b_schedule(K, M)), 1, 1, 1) != (K - 1) * (1 + 1 - 1)


def test_zb_h1_memory_is_1f1bs_peak_on_every_stage():
    for K, M in [(2, 4), (4, 4), (4, 9), (5, 3)]:
        s = zb_h1_schedule(K, M)
        assert peak_in_flight(s) == [min(M, K)] * K
        assert max(peak_in_flight(one_f_one_b_schedule(K, M))) == min(M, K)
        assert peak_waiting_for_w(s)[K - 1] == min(M, K)  # the last rank keeps K-1 W's back, then one more


def _gapless(sim):
    for _r, tl in sim.timeline.items():
        comp = [t for t in tl if t.action.kind in "FBIW"]
        if any(b.start != a.end for a, b in zip(comp, comp[1:])):
            return False
    return True


def test_zbv_bubble_with_equal_chunk_costs_and_no_gap_on_any_rank():
    """Paper's case T_F = T_I = T_W = t: each rank busy from its first action to its last; the
    step's bubble is the fill (K-1)t."""
    for K in range(1, 6):
        for M in range(2 * K - 1, 3 * K + 1):
            s = zbv_schedule(K, M)
            for t in (1, 2, Fr(1, 3)):
                sim = simulate(s, forward=t, backward_input=t, backward_weight=t)
                assert sim.bubble_time == bubble_time_formula("zbv", K, t, t, t) == (K - 1) * t
                assert _gapless(sim), (K, M)
    # the check catches a ZB-V order with every W postponed to the end
    s = zbv_schedule(4, 8)
    lazy = {r: [a for a in acts if a.kind in "FI"] + [a for a in acts if a.kind == "W"] for r, acts in s.items()}
    sim = simulate(add_communication(lazy, 8), forward=1, backward_input=1, backward_weight=1)
    assert sim.bubble_time != 3 and not _gapless(sim)


ZBV_COSTS = [c for c in itertools.product([0, Fr(1, 2), 1, 2, 3], repeat=3) if any(c)]


def test_zbv_bubble_formula_for_any_costs_on_grid():
    """The maximum of zbv_bubble_terms equals the simulated bubble of the ZB-V order for any
    T_F, T_I, T_W (0 included) and M >= 2K-1; every one of the eight terms is needed (each is
    the only maximum somewhere on the grid); and the special cases of zbv_schedule's docstring.
    Here K = 1..6, M in {2K-1, 2K, 3K+1}, part of the cost grid {0, 1/2, 1, 2, 3}^3 (the whole grid
    and every M up to 3K+1 were enumerated once when the terms were derived)."""
    n = 0
    for K in range(1, 7):
        for M in sorted({2 * K - 1, 2 * K, 3 * K + 1}):
            s = zbv_schedule(K, M)
            costs = ZBV_COSTS[M % 2::2] if K <= 3 else ZBV_COSTS[M % 3::6]
            for f, i, w in costs:
                assert _bubble(s, f, i, w) == bubble_time_formula("zbv", K, f, i, w), (K, M, f, i, w)
                n += 1
    assert n > 500
    # each term is the only maximum at one of these costs (K >= 3; at K = 2 some terms coincide)
    witnesses = [(0, 1, 2), (0, 3, 2), (0, 1, 0), (1, 0, 3), (2, 0, 3), (6, 5, 2), (2, 0, 1), (2, 1, 0)]
    for K in (3, 5):
        s = zbv_schedule(K, 2 * K + 1)
        for j, (f, i, w) in enumerate(witnesses):
            terms = zero_bubble.zbv_bubble_terms(K, f, i, w)
            assert terms.index(max(terms)) == j and terms.count(max(terms)) == 1, (K, j)
            assert _bubble(s, f, i, w) == max(terms), (K, f, i, w)
    K = 5
    for t, w in [(2, 1), (2, 2), (2, Fr(3, 2)), (2, Fr(1, 2)), (2, 0), (2, 3), (1, 4)]:
        if w < t / 2:
            want = 2 * (K - 1) * (t - w)
        else:
            want = (K - 1) * t + (K - 2) * max(0, w - t)
        assert bubble_time_formula("zbv", K, t, t, w) == want, (t, w)


def test_zbv_formula_check_catches_wrong_formulas_and_orders():
    """The grid check fails for the equal-cost formula (K-1)T_F used with other costs, for the
    maximum without any one of its terms, and for a ZB-V order with one W moved to the end."""
    K, M = 4, 8
    s = zbv_schedule(K, M)
    assert any(_bubble(s, f, i, w) != (K - 1) * f for f, i, w in ZBV_COSTS[::7])
    witnesses = [(0, 1, 2), (0, 3, 2), (0, 1, 0), (1, 0, 3), (2, 0, 3), (6, 5, 2), (2, 0, 1), (2, 1, 0)]
    for drop in range(8):
        partial = lambda f, i, w: max(t for j, t in enumerate(zero_bubble.zbv_bubble_terms(K, f, i, w)) if j != drop)
        assert any(_bubble(s, f, i, w) != partial(f, i, w) for f, i, w in witnesses), drop
    compute = {r: [a for a in s[r] if a.kind in "FIW"] for r in range(K)}
    first_w = next(a for a in compute[1] if a.kind == "W")
    compute[1] = [a for a in compute[1] if a != first_w] + [first_w]  # rank 1 keeps one W for the end
    moved = add_communication(compute, 2 * K)
    assert any(_bubble(moved, f, i, w) != bubble_time_formula("zbv", K, f, i, w) for f, i, w in ZBV_COSTS[::5])


def test_zbv_layout_and_memory():
    s = zbv_schedule(4, 8)
    assert infer_placement(s) == "v"
    for r in range(4):
        assert {a.stage for a in s[r]} == {r, 7 - r}
    assert [stage_rank(x, 4, "v") for x in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert max(peak_in_flight(s)) <= 2 * 4  # both chunks of a rank together hold at most 2K half-stages


def test_dualpipev_bubble_formula_on_grid():
    """README: (PP/2-1)(F&B + B - 3W) with PP = 2K stages, B the full backward; exact for
    T_F = T_I >= T_W and F&B = F + B, e.g. the README figure's F=1, B=2, W=1, F&B=3
    (K = 2..5, M = 2K..3K+1)."""
    n = 0
    for K in range(2, 6):
        for M in range(2 * K, 3 * K + 2):
            s, ov = dualpipev_schedule(K, M), dualpipev_overlapped(K, M)
            for f, i, w in COSTS:
                if f == i and w <= i:
                    fb = f + i + w
                    got = _bubble(s, f, i, w, overlapped=ov, overlap=fb)
                    assert got == bubble_time_formula("dualpipev", K, f, i, w, fb) == (K - 1) * (fb + i + w - 3 * w)
                    n += 1
    assert n > 50
    # README figure costs
    assert bubble_time_formula("dualpipev", 4, 1, 1, 1, 3) == 3 * 2


def test_dualpipev_rules_and_structure():
    with pytest.raises(ScheduleError, match=r"DualPipeV needs .*M >= 2K = 8 .*got M=7"):
        dualpipev_schedule(4, 7)
    for K, M in [(1, 2), (2, 4), (3, 7), (4, 8)]:
        s = dualpipev_schedule(K, M)
        validate_schedule(s)
        kinds = {a.kind for r in s for a in s[r]}
        assert {"F", "B"} <= kinds and (K == 1 or {"I", "W"} <= kinds)
        for _r, pairs in dualpipev_overlapped(K, M).items():
            for fa, ba in pairs:
                assert fa.kind == "F" and ba.kind == "B" and fa.stage != ba.stage
    assert sum(len(p) for p in dualpipev_overlapped(4, 10).values()) > 0


def test_builders_reject_bad_sizes():
    for fn in (zb_h1_schedule, zbv_schedule, dualpipev_schedule):
        with pytest.raises(ScheduleError, match="M \\(microbatches\\) must be an integer >= 1"):
            fn(2, 0)
        with pytest.raises(ScheduleError, match="K \\(pipeline ranks\\)"):
            fn(0, 4)
    with pytest.raises(ValueError, match="unknown schedule"):
        bubble_time_formula("zb-h2", 4)


# ----------------------------------------------------------------------------- validator

ZB0 = "F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 I0@s0 RECV_B1@s0 I1@s0 W0@s0 W1@s0"
ZB1 = "RECV_F0@s1 F0@s1 I0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 I1@s1 SEND_B1@s1 W0@s1 W1@s1"


def _two(a, b):
    return {0: parse_actions(a), 1: parse_actions(b)}


def test_validator_accepts_split_backward_and_every_builder():
    validate_schedule(_two(ZB0, ZB1))
    for s in (zb_h1_schedule(4, 8), zbv_schedule(3, 6), dualpipev_schedule(3, 6), zb_h1_schedule(3, 2)):
        validate_schedule(s)


@pytest.mark.parametrize("rank0, rank1, message", [
    (ZB0.replace("I0@s0 RECV_B1@s0 I1@s0 W0@s0", "W0@s0 I0@s0 RECV_B1@s0 I1@s0"), ZB1,
     r"rank 0, action 5 \(W0@s0\): W before its I: I0@s0 has not run"),
    (ZB0.replace(" W1@s0", ""), ZB1, r"rank 0, action 9 \(end of list\): W1@s0 is missing after I1@s0"),
    (ZB0, ZB1.replace("I0@s1 SEND_B0@s1", "SEND_B0@s1 I0@s1"),
     r"rank 1, action 2 \(SEND_B0@s1\): sends the result of B0@s1 or I0@s1 before it is computed"),
    (ZB0, ZB1.replace("I1@s1 SEND_B1@s1", "I1@s1 SEND_B1@s1 B1@s1"),
     r"rank 1, action 8 \(B1@s1\): I1@s1 already ran .*either B or I then W"),
    (ZB0.replace("W1@s0", "B1@s0 W1@s0").replace("I1@s0 ", ""), ZB1,
     r"rank 0, action 9 \(W1@s0\): B1@s0 already computed the weight gradient"),
    (ZB0.replace("RECV_B0@s0 I0@s0", "I0@s0 RECV_B0@s0"), ZB1,
     r"rank 0, action 4 \(I0@s0\): no RECV_B0@s0 before it"),
])
def test_validator_wrong_answers(rank0, rank1, message):
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(_two(rank0, rank1))


def test_validator_v_placement_and_in_flight_until_w():
    s = zbv_schedule(2, 3)
    bad = {r: list(a) for r, a in s.items()}
    i = next(j for j, a in enumerate(bad[0]) if a.kind == "F")
    bad[0][i] = Action("F", 1, 0)
    with pytest.raises(ScheduleError, match=r"stage 1 lives on rank 1 \(V placement: rank r holds stages r and "
                                            r"2K-1-r, K=2\), not on rank 0"):
        validate_schedule(bad, placement="v")
    with pytest.raises(ScheduleError, match=r"stage 1 lives on rank 1 \(stage s is on rank s % K"):
        validate_schedule(bad)  # inferred: not every stage on its V rank, so the looped rule
    # in flight lasts until W: ZB-H1 on 2 ranks holds 2 on stage 0, over a cap of 1 it fails
    validate_schedule(zb_h1_schedule(2, 4), max_in_flight=2)
    with pytest.raises(ScheduleError, match="more than max_in_flight=1"):
        validate_schedule(zb_h1_schedule(2, 4), max_in_flight=1)
    with pytest.raises(ScheduleError, match="V placement needs n_stages = 2K"):
        validate_schedule(zb_h1_schedule(2, 2), placement="v")


def test_zero_bubble_module_documents_which_b():
    doc = zero_bubble.__doc__
    assert "#724" in doc and "full backward" in doc
