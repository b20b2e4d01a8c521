"""Exercises of notebook 04_interleaved: interleaved 1F1B (Narayanan et al. 2021, sec. 2.2.2).

Each of the K ranks holds v model chunks (looped placement: stage s on rank s % K, layers
counted from 0), the bubble shrinks to (K-1)/(vM+K-1), the microbatches go through the chunks in
equal rounds (torch's ScheduleInterleaved1F1B: max(1, M // K) rounds; Megatron-LM: M a multiple of K),
and every microbatch crosses Kv-1 rank boundaries instead of K-1: v times the sends.
"""
from __future__ import annotations

from ...pipeline import interleaved_schedule, simulate, stage_rank
from ...pipeline.stages import stage_layers
from ..registry import CheckFailure, exercise, expect_close, expect_equal, expect_named, expect_raises
from .nb02_gpipe import run_pipeline

# ----------------------------------------------------------------------------- 4.1
ex41 = exercise(
    "4.1", title="which layers a rank holds", notebook="04_interleaved", points=2,
    hint=("Section 1 (the looped placement): which stages live on rank r? Write them out for K=2, v=2 before you "
          "write any layer numbers."))
ex41.hint2 = ("Once you know rank r's stages: if every stage has the same number of layers, which layers does stage s "
              "hold? Check your list against the picture of section 1.")
ex41.hint_review = ("leads: splits the task into two questions (which stages, which layers per stage) without the "
                    "arithmetic of either; reviewed 2026-12-06")


def _code_layers(rank: int, n_layers: int, K: int, v: int) -> list:
    """What labkit's own split gives (``gpt_stages_for_rank`` uses the same two functions)."""
    return [i for s in range(K * v) if stage_rank(s, K) == rank for i in stage_layers(n_layers, K * v, s)]


def _layers_case(n_layers: int, K: int, v: int, ranks=None):
    def case(layers_of_rank):
        for r in (range(K) if ranks is None else ranks):
            what = f"layers_of_rank(rank={r}, n_layers={n_layers}, K={K}, v={v})"
            got = layers_of_rank(r, n_layers, K, v)
            want = _code_layers(r, n_layers, K, v)
            got = list(got) if isinstance(got, (tuple, range)) else got
            if isinstance(got, list) and sorted(got) == want:
                continue
            if isinstance(got, list) and sorted(got) == [x + 1 for x in want]:
                raise CheckFailure(f"{what}: expected {want}, got {got}: this notebook counts layers from 0 "
                                   f"(as the code does), not from 1 (as the lecture does)")
            if isinstance(got, list) and sorted(got) == list(range(r * len(want), (r + 1) * len(want))):
                raise CheckFailure(f"{what}: expected {want}, got {got}: that is the contiguous split of "
                                   f"plain 1F1B; with v chunks rank r holds stages r, r+K, ... (stage s on "
                                   f"rank s % K)")
            if isinstance(got, list) and sorted(got) == list(range(r, n_layers, K)):
                raise CheckFailure(f"{what}: expected {want}, got {got}: layers dealt out one at a time, round robin; "
                                   f"a stage is a block of consecutive layers")
            expect_equal(sorted(got) if isinstance(got, list) else got, want, what)
    return case


ex41.case("16 layers, K=4, v=2, rank 0")(_layers_case(16, 4, 2, ranks=[0]))
ex41.case("16 layers, K=4, v=2, every rank")(_layers_case(16, 4, 2))
ex41.case("24 layers, K=3, v=4", hidden=True)(_layers_case(24, 3, 4))
ex41.case("8 layers, K=4, v=1 (plain 1F1B)", hidden=True)(_layers_case(8, 4, 1))
ex41.case("6 layers, K=1, v=3", hidden=True)(_layers_case(6, 1, 3))


# ----------------------------------------------------------------------------- 4.2
ex42 = exercise(
    "4.2", title="the interleaved bubble", notebook="04_interleaved", points=2,
    hint=("Section 2: interleaving shrinks every stage by the factor v while the useful work stays the same. Start "
          "from 1F1B's bubble fraction: which part of it does interleaving shrink?"))
ex42.hint2 = ("Express the idle time and the busy time in units of one full stage's forward and backward. For the "
              "ValueError: how does torch group M microbatches into rounds on K ranks (section 2), and when are the "
              "rounds not all alike?")
ex42.hint_review = ("leads: asks which term of 1F1B's bubble shrinks and how torch forms rounds; neither the fraction "
                    "nor the divisibility test is stated; reviewed 2026-12-06")


def _bubble_case(K: int, M: int, v: int):
    def case(interleaved_bubble):
        sim = simulate(interleaved_schedule(K, M, v)).bubble_fraction
        expect_close(float(interleaved_bubble(K, M, v)), float(sim),
                     f"interleaved_bubble(K={K}, M={M}, v={v}) vs the simulated bubble")
    return case


ex42.case("K=4, M=8, v=2 (simulated)")(_bubble_case(4, 8, 2))
ex42.case("v=1 is plain 1F1B: K=4, M=8")(_bubble_case(4, 8, 1))


@ex42.case("M=9 with K=4, v=2 raises ValueError (2 rounds of 4.5)")
def _(interleaved_bubble):
    expect_raises(ValueError, interleaved_bubble, 4, 9, 2, what="interleaved_bubble(K=4, M=9, v=2)")


ex42.case("K=4, M=6, v=2: one round of 6, as torch runs it",
          hint=("torch's ScheduleInterleaved1F1B runs K=4, M=6 and so does labkit: M need not be a multiple of K "
                "(that is Megatron-LM's special case). How does torch group these 6 microbatches, and is that "
                "grouping uneven?"))(_bubble_case(4, 6, 2))


ex42.case("K=4, M=4, v=4", hidden=True)(_bubble_case(4, 4, 4))
ex42.case("K=2, M=6, v=3", hidden=True)(_bubble_case(2, 6, 3))
ex42.case("K=1, M=3, v=2", hidden=True)(_bubble_case(1, 3, 2))


@ex42.case("K=4, M=9, v=1")
def _(interleaved_bubble):
    what = "interleaved_bubble(K=4, M=9, v=1)"
    try:
        got = interleaved_bubble(4, 9, 1)
    except ValueError as e:
        raise CheckFailure(f"{what} raised ValueError ({e}): with v = 1 there is one chunk per rank, plain 1F1B, "
                           f"which runs any M; the rounds rule is about v >= 2 chunks") from None
    expect_close(float(got), 3 / 12, what)


@ex42.case("v=1 allows any M", hidden=True)
def _(interleaved_bubble):
    expect_close(float(interleaved_bubble(4, 6, 1)), 3 / 9, "interleaved_bubble(K=4, M=6, v=1)")
    expect_close(float(interleaved_bubble(3, 7, 1)), 2 / 9, "interleaved_bubble(K=3, M=7, v=1)")


# ----------------------------------------------------------------------------- 4.3
ex43 = exercise(
    "4.3", title="point-to-point sends per step", notebook="04_interleaved", points=2,
    hint=("Section 3: a send is one crossing of a microbatch from a stage to the next stage on another rank, in one "
          "direction. How many stage boundaries does a microbatch cross, and how many of them lie between ranks?"))
ex43.hint2 = ("Test your count on the placement the notebook treats as special: what happens to the boundaries when "
              "all stages sit on one rank?")
ex43.hint_review = ("leads: defines a send as a crossing and asks how many boundaries and which lie between ranks; "
                    "the special case is asked about, not answered; reviewed 2026-12-06")


def _sends_case(K: int, M: int, v: int):
    def case(p2p_sends):
        from ...pipeline.explorer import count_sends  # here: explorer imports pyplot (seconds per grader process)

        want = count_sends(interleaved_schedule(K, M, v))
        expect_named(p2p_sends(K, M, v), want, f"p2p_sends(K={K}, M={M}, v={v}) vs the SEND actions in the schedule",
                     [(want * K, "counted once per rank: each send is made by one rank"),
                      (2 * M * K * v, "K v crossings per microbatch and direction: is there a boundary after the "
                                      "last stage?"),
                      (M * (K * v - 1), "forward only: the gradients cross every boundary back"),
                      (2 * (K * v - 1), "one microbatch: all M cross every boundary")] if K > 1 else
                     [(2 * M * (K * v - 1), "stages on the same rank do not send to each other")])
    return case


ex43.case("K=4, M=8, v=1 and v=2 (from the schedule data)")(
    lambda f: (_sends_case(4, 8, 1)(f), _sends_case(4, 8, 2)(f)))
ex43.case("K=1, M=4, v=3: all stages on one rank",
          hint="With one rank, does any message ever leave it?")(_sends_case(1, 4, 3))


@ex43.case("K=4, M=4, v=2: counted with CommLog on 4 real ranks", timeout=40)
def _(p2p_sends):
    measured = run_pipeline(interleaved_schedule(4, 4, 2), 4, v=2, count_sends=True, timeout=15)["sends"]
    expect_equal(p2p_sends(4, 4, 2), measured, "p2p_sends(K=4, M=4, v=2) vs sends counted with CommLog in one step")


ex43.case("K=1, M=2, v=2: all stages on one rank", hidden=True)(_sends_case(1, 2, 2))
ex43.case("K=2, M=6, v=3", hidden=True)(_sends_case(2, 6, 3))
ex43.case("K=8, M=16, v=4", hidden=True)(_sends_case(8, 16, 4))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402


def _draw_kmv(r):
    K, v = r.randint(1, 4), r.randint(1, 4)
    return K, K * r.randint(1, 4), v  # M a multiple of K, as interleaving needs


fresh_case(ex41, "random layers, K, v",
           lambda r: (lambda K, v: (K * v * r.randint(1, 3), K, v))(r.randint(1, 4), r.randint(1, 4)), _layers_case)
fresh_case(ex42, "random K, M, v", _draw_kmv, _bubble_case)
fresh_case(ex43, "random K, M, v", _draw_kmv, _sends_case)
