"""Chrome trace-event rules Perfetto applies, on the traces the kit writes: pids from 1, and on
each track complete events nest (Perfetto drops a slice that overlaps another without nesting).
Receives go to their own tracks (several per rank when they overlap), so compute slices are never
children of a receive; several schedules share one file as separate processes. The measured
traces of the lab are checked in tests/labs/test_zero_bubble_lab.py, notebook 13's in the notebook."""
import pytest

from labkit.pipeline import (
    TimedAction,
    dualpipev_overlapped,
    dualpipev_schedule,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    simulate,
    zb_h1_schedule,
    zbv_schedule,
)
from labkit.pipeline.schedules import parse_actions
from labkit.pipeline.trace import chrome_trace, trace_problems

K, M = 4, 8


def _sims():
    return {
        "gpipe": simulate(gpipe_schedule(K, M), forward=1, backward=2, comm=0.5),
        "1f1b": simulate(one_f_one_b_schedule(K, M), forward=1, backward=2, comm=0.5),
        "interleaved": simulate(interleaved_schedule(K, M, 2), forward=1, backward=2, comm=0.5),
        "zb-h1": simulate(zb_h1_schedule(K, M), forward=1, backward_input=1, backward_weight=1, comm=0.5),
        "zbv": simulate(zbv_schedule(K, M), forward=1, backward_input=1, backward_weight=1, comm=0.5,
                        placement="v"),
        "dualpipev": simulate(dualpipev_schedule(K, M), forward=1, backward_input=1, backward_weight=1, comm=0.5,
                              placement="v", overlapped=dualpipev_overlapped(K, M)),
    }


def test_every_schedule_side_by_side_follows_perfettos_rules():
    sims = _sims()
    trace = chrome_trace(sims, time_unit=1e-3)
    assert trace_problems(trace) == []
    events = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {i: name for i, name in enumerate(sims, 1)}  # one process per schedule, pids from 1
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for e in events:
        if e["ph"] in ("X", "i"):
            track = threads[(e["pid"], e["tid"])]
            assert track.startswith("rank ")
            assert ("comm" in track) == (e["cat"] == "comm"), (track, e)  # receives never share compute's track
    # every action is in the trace once
    n = sum(len(tl) for sim in sims.values() for tl in sim.timeline.values())
    assert sum(e["ph"] in ("X", "i") for e in events) == n


def test_overlapping_receives_get_their_own_tracks():
    # as measured: a rank posts two receives before the first completes, and computes meanwhile
    r = [TimedAction(parse_actions("RECV_F0@s1")[0], 0.0, 5.0), TimedAction(parse_actions("RECV_F1@s1")[0], 1.0, 8.0),
         TimedAction(parse_actions("F0@s1")[0], 5.0, 7.0), TimedAction(parse_actions("SEND_F0@s1")[0], 7.0, 7.0),
         TimedAction(parse_actions("F1@s1")[0], 8.0, 10.0)]
    trace = chrome_trace({1: r}, time_unit=1e-6)
    assert trace_problems(trace) == []
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    track = {e["name"]: threads[e["tid"]] for e in trace["traceEvents"] if e["ph"] in ("X", "i")}
    assert track == {"RECV_F0@s1": "rank 1 comm", "RECV_F1@s1": "rank 1 comm 2", "SEND_F0@s1": "rank 1 comm",
                     "F0@s1": "rank 1", "F1@s1": "rank 1"}
    # the same events on one track (the old layout) break the rules
    one = [dict(e, tid=1) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert any("overlaps" in p for p in trace_problems({"traceEvents": one}))


@pytest.mark.parametrize("events, problem", [
    ([{"ph": "X", "name": "RECV", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
      {"ph": "X", "name": "RECV2", "ts": 5, "dur": 10, "pid": 1, "tid": 1}], "RECV2 [5.0, 15.0] overlaps RECV"),
    ([{"ph": "X", "name": "F0", "ts": 0, "dur": 1, "pid": 0, "tid": 1}], "pid 0"),
    ([{"ph": "X", "name": "F0", "ts": 0, "dur": -1, "pid": 1, "tid": 1}], "dur >= 0"),
])
def test_the_rules_catch_what_perfetto_drops(events, problem):
    problems = trace_problems({"traceEvents": events})
    assert problems and problem in problems[0], problems
    # nesting is fine, and so are touching slices
    ok = [{"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
          {"ph": "X", "name": "b", "ts": 2, "dur": 3, "pid": 1, "tid": 1},
          {"ph": "X", "name": "c", "ts": 10, "dur": 3, "pid": 1, "tid": 1}]
    assert trace_problems({"traceEvents": ok}) == []
