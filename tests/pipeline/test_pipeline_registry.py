"""The schedule registry, the Schedule object and the one symbolic executor. No process starts."""
from fractions import Fraction

import pytest

from labkit.pipeline import (
    Action,
    Schedule,
    ScheduleError,
    bubble_formula,
    bubble_time_formula,
    parse_actions,
    simulate,
    validate_schedule,
)
from labkit.pipeline.registry import REGISTRY, canonical, lookup, names
from labkit.pipeline.symbolic import advance_async, advance_blocking, diagnose_hang

# every spelling in use before the registry (labs, lab 3d, parallel/, explorer, bench) -> canonical name
OLD_SPELLINGS = {
    "gpipe": "gpipe", "GPipe": "gpipe", "1f1b": "1f1b", "1F1B": "1f1b", "interleaved": "interleaved",
    "Interleaved 1F1B": "interleaved", "zb-h1": "zb-h1", "zbh1": "zb-h1", "zb_h1": "zb-h1", "ZB-H1": "zb-h1",
    "zbv": "zbv", "zb-v": "zbv", "ZB-V": "zbv", "dualpipev": "dualpipev", "dualpipe-v": "dualpipev",
    "DualPipeV": "dualpipev", " ZBH1 ": "zb-h1", "dualpipe": "dualpipe",
}


@pytest.mark.parametrize("spelling,name", sorted(OLD_SPELLINGS.items()))
def test_every_old_spelling_is_accepted(spelling, name):
    assert canonical(spelling) == name and lookup(spelling).name == name


def test_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream-2bw'; choose one of gpipe, 1f1b"):
        lookup("pipedream-2bw")
    assert canonical("Nope") == "nope"   # argparse's choices then say what is valid


def test_tables_read_from_the_registry():
    from labkit.labs import pipeline as lab
    from labkit.pipeline import explorer
    from labkit.plan.spec import SCHEDULES as PLANNED
    assert names() == ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
    assert lab.SCHEDULES == ("gpipe", "1f1b", "interleaved") and lab.ZERO_BUBBLE == ("zb-h1", "zbv", "dualpipev")
    assert explorer.SCHEDULES == ("GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1", "ZB-V", "DualPipeV")
    assert PLANNED == ("gpipe", "1f1b", "interleaved", "dualpipe")
    with pytest.raises(ValueError, match="planner only"):
        lookup("dualpipe").schedule(2, 4)


@pytest.mark.parametrize("name", names())
def test_each_entry_builds_what_it_says(name):
    """Builder, placement, v and runtime class agree with the schedule they build."""
    info = lookup(name)
    K, M = 3, 6
    s = validate_schedule(info.schedule(K, M, 3))
    assert isinstance(s, Schedule) and (s.K, s.M) == (K, M)
    assert s.placement == info.placement and s.n_stages == info.n_stages(K, 3) == K * info.v(3)
    assert info.v(3) == (3 if name == "interleaved" else 2 if name in ("zbv", "dualpipev") else 1)
    assert info.runtime_class.__name__ == info.runtime
    assert info.runtime_class.__module__ == "labkit.pipeline.schedule_classes"
    assert any(a.kind in ("I", "W") for r in s for a in s[r]) == info.zero_bubble
    if info.zero_bubble:
        assert info.bubble_fraction(K, M) is None
        assert info.bubble_time(K, 1, 1, 1) == bubble_time_formula(name, K, 1, 1, 1)
    else:
        assert info.bubble_fraction(K, M, 3) == bubble_formula(K, M, info.v(3))
        sim = simulate(s, forward=Fraction(1), backward=Fraction(1))
        assert sim.bubble_fraction == info.bubble_fraction(K, M, 3)


def test_dualpipev_minimum_microbatches_and_overlap_pairs():
    info = lookup("dualpipev")
    assert info.min_microbatches(3) == 6 and lookup("1f1b").min_microbatches(3) == 1
    with pytest.raises(ScheduleError, match="M >= 2K = 6"):
        info.schedule(3, 5)
    assert info.overlapped(2, 4) and lookup("zbv").overlapped(2, 4) is None


def test_schedule_object_answers_the_messages():
    s = validate_schedule(lookup("zbv").schedule(2, 2))   # V placement: rank 0 holds 0, 3; rank 1 holds 1, 2
    assert (s.K, s.M, s.n_stages, s.placement, s.v) == (2, 2, 4, "v", 2)
    assert [s.rank_of(st) for st in range(4)] == [0, 1, 1, 0]
    assert s.produces(Action("F", 0, 1)) == Action("SEND_F", 0, 1)
    assert s.produces(Action("F", 1, 1)) is None          # stage 2 is on the same rank: passed locally
    assert s.needs(Action("F", 3, 0)) == Action("RECV_F", 3, 0)
    assert s.needs(Action("I", 3, 0)) is None and s.needs(Action("W", 0, 0)) is None
    assert s.needs(Action("I", 2, 0)) == Action("RECV_B", 2, 0)
    assert tuple(s.message(Action("RECV_F", 3, 0))) == (1, 0, ("F", 2, 0))
    assert tuple(s.message(Action("SEND_B", 1, 1))) == (1, 0, ("B", 1, 1))
    assert s.peer(Action("SEND_B", 1, 1)) == 0 and s.message(Action("F", 0, 0)) is None
    assert Schedule.of(s) is s and dict(s) == s.actions and len(s) == 2 and sorted(s) == [0, 1]
    assert isinstance(s, dict) and repr(s) == repr(dict(s))   # prints and travels as the dict it was


def _two_rank_swap():
    """1F1B, K = 2, M = 2 with rank 1 sending its gradient before receiving the second input:
    fine with asynchronous sends, a deadlock with rendezvous sends (the validator's example)."""
    return Schedule.of({0: parse_actions("F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0"),
                        1: parse_actions("RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1")})


def test_one_executor_two_semantics():
    s = _two_rank_swap()
    assert advance_async(s) == [len(s[0]), len(s[1])]
    stuck = advance_blocking(s)
    assert stuck[0] < len(s[0]) and stuck[1] < len(s[1])
    ok = Schedule.of({0: parse_actions("F0@s0 SEND_F0@s0 RECV_B0@s0 B0@s0"),
                      1: parse_actions("RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1")})
    assert advance_blocking(ok) == [4, 4] == advance_async(ok)
    validate_schedule(s)
    validate_schedule(ok, sends="blocking")
    with pytest.raises(ScheduleError, match="deadlock with blocking"):
        validate_schedule(s, sends="blocking")


def test_hang_diagnosis_names_the_missing_send():
    s = {r: list(a) for r, a in lookup("gpipe").schedule(2, 2).items()}
    s[0].remove(Action("SEND_F", 0, 1))
    found = diagnose_hang(Schedule.of(s))
    assert found is not None
    r, i, a, reason = found
    assert (r, a) == (1, Action("F", 1, 1)) and "never sends (SEND_F1@s0" in reason
    assert diagnose_hang(Schedule.of(lookup("gpipe").schedule(2, 2))) is None


def test_registry_is_the_only_name_table():
    """The old tables and helpers are gone from the modules that had them."""
    import labkit.labs.pipeline as lab
    import labkit.labs.threed as threed
    import labkit.parallel.gpt as gpt
    import labkit.pipeline.zero_bubble as zb
    for mod, name in ((lab, "V_SHAPED"), (gpt, "V_SHAPED"), (gpt, "placement_of"), (threed, "_library_schedule"),
                      (zb, "ZB_SCHEDULES")):
        assert not hasattr(mod, name), (mod.__name__, name)
    assert set(REGISTRY) == set(names(runs=None))


def test_a_schedule_keeps_its_sizes_through_the_validator():
    """The runtime sizes the schedule with its M; the validator judges it with that M."""
    short = Schedule.of(lookup("gpipe").schedule(2, 2), n_microbatches=3)   # M = 3, but no microbatch 2
    with pytest.raises(ScheduleError, match="F2@s0 is missing"):
        validate_schedule(short)
    assert validate_schedule(short, n_microbatches=2).M == 2
