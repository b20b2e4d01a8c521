"""Exercises of notebook 03_1f1b: 1F1B / PipeDream-Flush (Narayanan et al. 2021, sec. 2.2.1).

Rank r runs ``min(K - r - 1, M)`` warm-up forwards, then one forward and one backward in turn,
then the remaining backwards. The bubble is GPipe's, (K-1)/(M+K-1); what changes is memory:
stage s holds at most ``min(M, K - s)`` microbatches in flight instead of M.
"""
from __future__ import annotations

from ...pipeline import bubble_formula, one_f_one_b_schedule, peak_in_flight, simulate
from ..registry import CheckFailure, exercise, expect_named
from .nb02_gpipe import expect_same_grads, run_pipeline, validated

# ----------------------------------------------------------------------------- 3.1
ex31 = exercise(
    "3.1", title="the 1F1B action list", notebook="03_1f1b", points=3,
    hint=("Section 1: rank r can start its first backward once its first microbatch has gone through all later stages "
          "and come back. How many forwards can rank r run before that, and what if there are fewer microbatches than "
          "that?"))
ex31.hint2 = ("Draw the K=4, M=2 timeline of section 1 and read rank 0's and rank 3's order off it: how many forwards "
              "come before the first backward on each, and what follows the last forward?")
ex31.hint_review = ("leads: asks for the warm-up length and points at the timeline to read the steady state from; "
                    "reviewed 2026-12-06")


def _order(one_f_one_b_order, K: int, M: int):
    what = f"one_f_one_b_order(K={K}, M={M})"
    return what, validated(one_f_one_b_order(K, M), what, M, K, fill_communication=True)


def _warmup(sched: dict, r: int) -> int:
    n = 0
    for a in sched[r]:
        if a.kind == "B":
            break
        n += a.kind == "F"
    return n


def _memory_and_bubble(K: int, M: int):
    def case(one_f_one_b_order):
        what, sched = _order(one_f_one_b_order, K, M)
        peaks = peak_in_flight(sched, K)
        for s in range(K):
            want = min(M, K - s)
            if peaks[s] != want:
                r = s  # one stage per rank
                w = _warmup(sched, r)
                if peaks[s] > want:
                    why = "it holds more than 1F1B needs: the warm-up is too long"
                else:
                    why = "the pipeline never fills: the warm-up is too short"
                raise CheckFailure(
                    f"{what}: stage {s} holds {peaks[s]} microbatch(es) in flight at its peak, 1F1B holds "
                    f"{want}; {why} (rank {r} runs {w} forward(s) before its first backward, 1F1B runs "
                    f"{min(K - r, M)}: its warm-up forwards and the first forward of the one-forward-one-backward "
                    f"phase)")
        sim = simulate(sched, forward=1, backward=1)
        want = bubble_formula(K, M)
        if sim.bubble_fraction != want:
            raise CheckFailure(f"{what}: simulated bubble {sim.bubble_fraction} ({float(sim.bubble_fraction):.3f}), "
                               f"1F1B's is (K-1)/(M+K-1) = {want} ({float(want):.3f}); some rank waits "
                               f"longer than it must")
    return case


ex31.case("K=2, M=4: valid, peak in flight and bubble simulated")(_memory_and_bubble(2, 4))
ex31.case("K=4, M=8: valid, peak in flight and bubble simulated")(_memory_and_bubble(4, 8))
ex31.case("fewer microbatches than stages (K=4, M=2)",
          hint=("With M < K, does every rank's plan use only microbatches 0..M-1? Count the forwards of rank 0 in "
                "your list."))(_memory_and_bubble(4, 2))


@ex31.case("K=4, M=8 on 4 real ranks: gradients equal single device", timeout=40)
def _(one_f_one_b_order):
    what, sched = _order(one_f_one_b_order, 4, 8)
    expect_same_grads(run_pipeline(sched, 8, timeout=15)["grads"], what + " run on 4 ranks")


ex31.case("K=1, M=3", hidden=True)(_memory_and_bubble(1, 3))
ex31.case("K=3, M=7", hidden=True)(_memory_and_bubble(3, 7))
ex31.case("K=8, M=16", hidden=True)(_memory_and_bubble(8, 16))
ex31.case("M < K (K=6, M=3)", hidden=True)(_memory_and_bubble(6, 3))


@ex31.case("K=2, M=4 on 2 real ranks", hidden=True, timeout=30)
def _(one_f_one_b_order):
    what, sched = _order(one_f_one_b_order, 2, 4)
    expect_same_grads(run_pipeline(sched, 4, timeout=15)["grads"], what + " run on 2 ranks")


# ----------------------------------------------------------------------------- 3.2
ex32 = exercise(
    "3.2", title="1F1B microbatches in flight per stage", notebook="03_1f1b", points=2,
    hint=("Section 2: a stage holds a microbatch from its forward until its backward. How many forwards has stage s "
          "run when its first backward arrives, and can that exceed the number of microbatches?"))
ex32.hint2 = ("Put your list next to the counts measured in section 2 for K=4, M=8, then try M=2: which stages are "
              "limited by the microbatches there are?")
ex32.hint_review = ("leads: asks how many forwards precede stage s's first backward and checks against the "
                    "measurement; the expression is the learner's; reviewed 2026-12-06")


def _in_flight_mistakes(K: int, M: int) -> list:
    """3.2's named mistakes: what each returns for K, M."""
    return [([K - s for s in range(K)], "more than M on some stages: a stage cannot hold more microbatches than "
                                        "the step has"),
            ([min(M, K - s - 1) for s in range(K)], "one fewer on every stage: the last stage still holds one"),
            ([min(M, s + 1) for s in range(K)], "the stages in reverse order: which stage starts the most "
                                                "forwards before its first backward?"),
            ([min(M, K)] * K, "the same count on every stage: the warm-up is not the same length on every stage"),
            ([M] * K, "every microbatch in flight at once: that is GPipe's memory, not 1F1B's")]


def _formula_case(K: int, M: int):
    def case(in_flight_1f1b):
        got = in_flight_1f1b(K, M)
        want = peak_in_flight(one_f_one_b_schedule(K, M), K)
        got = list(got) if isinstance(got, (tuple, range)) else got
        expect_named(got, want, f"in_flight_1f1b(K={K}, M={M})", _in_flight_mistakes(K, M))
    return case


@ex32.case("K=4, M=8: measured on 4 real ranks", timeout=40)
def _(in_flight_1f1b):
    measured = run_pipeline(one_f_one_b_schedule(4, 8), 8, timeout=15)["peak"]
    got = in_flight_1f1b(4, 8)
    expect_named(list(got) if isinstance(got, (tuple, range)) else got, [measured[s] for s in range(4)],
                 "in_flight_1f1b(K=4, M=8) vs the peak measured by the runtime", _in_flight_mistakes(4, 8))


ex32.case("K=4, M=2 (fewer microbatches than stages)")(_formula_case(4, 2))
ex32.case("K=1, M=5", hidden=True)(_formula_case(1, 5))
ex32.case("K=6, M=4", hidden=True)(_formula_case(6, 4))
ex32.case("K=8, M=64", hidden=True)(_formula_case(8, 64))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402

fresh_case(ex31, "random K, M", lambda r: (r.randint(1, 8), r.randint(1, 20)), _memory_and_bubble)
fresh_case(ex32, "random K, M", lambda r: (r.randint(1, 8), r.randint(1, 40)), _formula_case)
