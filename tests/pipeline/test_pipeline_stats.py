"""What the runtime measured, derived from its events (labkit.pipeline.stats). No process starts:
the events here are written by hand or taken from a schedule's action order."""
from labkit.pipeline import Action, parse_actions, peak_in_flight, peak_waiting_for_w, simulate
from labkit.pipeline.registry import lookup
from labkit.pipeline.stats import Event, mean_times, measured_bubble, step_stats, timeline


def _events(actions, nbytes):
    """One event per action, one time unit each, bytes from ``nbytes(action)``."""
    return [Event(a, t, t + 1, nbytes(a)) for t, a in enumerate(actions)]


def test_split_backward_counts_by_hand():
    """One stage running F0 F1 I0 I1 W0 W1: stash 10 and 30 bytes,
    I keeps 4 and 6 bytes for W, W-only activations 5 bytes per microbatch."""
    acts = parse_actions("F0@s0 F1@s0 I0@s0 I1@s0 W0@s0 W1@s0")
    size = {("F", 0): 10, ("F", 1): 30, ("I", 0): 4, ("I", 1): 6}
    st = step_stats(_events(acts, lambda a: size.get((a.kind, a.microbatch), 0)), [0], 2, {0: 5})
    assert st.peak_in_flight == {0: 2} and st.stash_bytes == {0: [10, 30]} and st.stash_peak_bytes == {0: 40}
    assert st.peak_waiting_for_w == {0: 2} and st.w_grads_peak_bytes == {0: 10} and st.w_only_peak_bytes == {0: 10}


def test_full_backward_frees_the_stash_of_its_own_microbatch():
    acts = parse_actions("F0@s1 F1@s1 B0@s1 F2@s1 B1@s1 B2@s1")
    st = step_stats(_events(acts, lambda a: 100 * (a.microbatch + 1) if a.kind == "F" else 0), [1], 3)
    # live after each F: 100, 300, (B0 frees 100) 500, then down
    assert st.stash_peak_bytes == {1: 500} and st.peak_in_flight == {1: 2} and st.stash_bytes == {1: [100, 200, 300]}
    assert st.w_only_peak_bytes == {} and st.peak_waiting_for_w == {1: 0}


def test_in_flight_from_events_equals_the_action_order_count():
    """Over the registered schedules: the events' peaks are the schedule's (the runtime tests then
    compare those with real runs)."""
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"):
        s = lookup(name).schedule(3, 6, 2)
        stages = sorted({a.stage for r in s for a in s[r]})
        merged_peak, merged_w = {}, {}
        for r in s:
            st = step_stats(_events(s[r], lambda a: 1), sorted({a.stage for a in s[r]}), 6)
            merged_peak.update(st.peak_in_flight)
            merged_w.update(st.peak_waiting_for_w)
        n = len(stages)
        assert [merged_peak[x] for x in range(n)] == peak_in_flight(s), name
        assert [merged_w[x] for x in range(n)] == peak_waiting_for_w(s), name


def test_bubble_of_events_is_the_timeline_bubble():
    sim = simulate(lookup("1f1b").schedule(2, 2))
    events = {r: [Event(t.action, t.start, t.end, 0) for t in sim.timeline[r]] for r in sim.timeline}
    assert measured_bubble(events) == sim.bubble_fraction
    assert timeline(events[0]) == sim.timeline[0] and isinstance(events[0][0].action, Action)


def test_mean_times_are_the_measured_cost_model():
    """Two timed steps of one rank, stage 0: F takes 1 then 3 s, I 2 s, W 4 s -> means 2, 2, 4;
    B never ran, so it is absent (a kind appears only where every stage ran it)."""
    steps = [{0: [Event(Action("F", 0, 0), 0, 1), Event(Action("I", 0, 0), 1, 3), Event(Action("W", 0, 0), 3, 7)]},
             {0: [Event(Action("F", 0, 0), 0, 3), Event(Action("I", 0, 0), 3, 5), Event(Action("W", 0, 0), 5, 9)]}]
    assert mean_times(steps, 1) == {"F": [2.0], "I": [2.0], "W": [4.0]}
    assert mean_times(steps, 2) == {}   # stage 1 never ran
