"""Export timelines (simulated or measured) to the Chrome trace-event JSON format, which
Perfetto (https://ui.perfetto.dev) and chrome://tracing open.

Format (the "Trace Event Format" of the Chrome tracing project, JSON object form): a list
``traceEvents`` of events; a "complete" event ``{"ph": "X", "name", "ts", "dur", "pid",
"tid", "args"}`` is one slice, with ``ts``/``dur`` in microseconds; an instant event
(``"ph": "i"``) is a point; metadata events (``"ph": "M"``, ``process_name`` /
``thread_name`` and their sort indices) name and order the tracks.

Layout here: each timeline (one schedule) is a process, pids from 1 (Perfetto treats pid 0
as the kernel's idle task); each rank has a compute track ``rank r`` with one slice per F, B,
I, W (named like the action, ``F3@s1``, kind/stage/microbatch in ``args``) and a
communication track ``rank r comm`` with each receive as a slice from posting to completion
and each send as an instant. Perfetto requires the complete events of one track to nest
(a slice that starts inside another must end inside it) and drops the others on import;
receives of one rank overlap each other (several are posted before the first completes), so
a receive that overlaps one already on a track goes to the next track (``rank r comm 2``,
...): greedy interval partitioning, the fewest tracks with no overlap. Compute slices are
therefore never children of a receive. :func:`trace_problems` checks a trace against these
rules (tests run it on every trace the labs and notebooks write).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .schedules import COMPUTE
from .simulate import SimResult

__all__ = ["chrome_trace", "write_chrome_trace", "trace_problems"]

_TRACKS_PER_RANK = 64  # tid = rank * 64 + track + 1: tids from 1, tracks of a rank together


def _lanes(intervals):
    """Greedy interval partitioning: ``[(ts, end, item)]`` -> ``[(lane, item)]``; intervals on
    one lane do not overlap (touching is fine)."""
    ends: list[float] = []
    out = []
    for ts, end, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        lane = next((i for i, e in enumerate(ends) if e <= ts), None)
        if lane is None:
            ends.append(end)
            lane = len(ends) - 1
        else:
            ends[lane] = end
        out.append((lane, item))
    return out


def _events(timeline: dict, pid: int, name: str, time_unit: float) -> list:
    scale = 1e6 * time_unit  # -> microseconds
    ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
          {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for r in sorted(timeline):
        compute, comm, sends = [], [], []
        for t in timeline[r]:
            kind, stage, mb = t.action
            ts, dur = float(t.start) * scale, max(0.0, float(t.end - t.start) * scale)
            e = {"name": repr(t.action), "ts": ts, "pid": pid,
                 "args": {"kind": kind, "stage": stage, "microbatch": mb}}
            if kind in COMPUTE:
                compute.append((ts, ts + dur, dict(e, ph="X", cat="compute", dur=dur)))
            elif kind.startswith("RECV"):
                comm.append((ts, ts + dur, dict(e, ph="X", cat="comm", dur=dur)))
            else:
                sends.append(dict(e, ph="i", s="t", cat="comm"))
        tracks = {}  # (what, lane) -> tid
        placed = [(("compute", lane), e) for lane, e in _lanes(compute)]
        placed += [(("comm", lane), e) for lane, e in _lanes(comm)]
        placed += [(("comm", 0), e) for e in sends]
        order = sorted({key for key, _ in placed}, key=lambda k: (k[0] != "compute", k[1]))
        for i, key in enumerate(order):
            tid = r * _TRACKS_PER_RANK + i + 1
            tracks[key] = tid
            label = f"rank {r}" if key[0] == "compute" else f"rank {r} comm"
            if key[0] == "compute" and key[1]:
                label += " compute"
            label += f" {key[1] + 1}" if key[1] else ""
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": label}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        ev += [dict(e, tid=tracks[key]) for key, e in placed]
    return ev


def chrome_trace(timelines, time_unit: float = 1.0) -> dict:
    """The trace-event JSON object (a dict) for one or several timelines.

    ``timelines``: a :class:`~.simulate.SimResult`, a ``{rank: [TimedAction]}`` dict, or a
    dict ``{name: timeline}`` of several, drawn side by side (one Perfetto process each, pid
    1, 2, ... in order, e.g. one per schedule). ``time_unit``: seconds per time unit of the
    timelines (1.0 for measured ones in seconds; e.g. 1e-3 to read simulated unit costs as
    milliseconds). The result satisfies :func:`trace_problems`."""
    if isinstance(timelines, SimResult) or (isinstance(timelines, dict) and timelines
                                            and all(isinstance(k, int) for k in timelines)):
        timelines = {"timeline": timelines}
    events = []
    for pid, (name, tl) in enumerate(timelines.items(), 1):
        if isinstance(tl, SimResult):
            tl = tl.timeline
        events += _events(tl, pid, str(name), time_unit)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path, timelines, time_unit: float = 1.0) -> Path:
    """Write :func:`chrome_trace` to ``path`` (JSON); returns the path. Open it in
    https://ui.perfetto.dev or chrome://tracing."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(timelines, time_unit)))
    return path


def trace_problems(trace: dict, eps: float = 1e-3) -> list[str]:
    """What in ``trace`` (a trace-event JSON object) breaks the rules Perfetto's JSON importer
    applies; an empty list when nothing does.

    Checked: ``traceEvents`` is a list; every event has ``ph``, ``pid`` and ``tid``; no pid is 0
    (Perfetto's idle process); a complete event (``X``) has ``ts`` and ``dur >= 0``; on each
    track (pid, tid) complete events nest: sorted by start, one that starts inside another ends
    inside it too (within ``eps`` microseconds). Each problem names the track and both slices."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        return ["traceEvents is missing or not a list"]
    problems = []
    tracks = defaultdict(list)
    for i, e in enumerate(events):
        if not isinstance(e, dict) or not {"ph", "pid", "tid"} <= set(e):
            problems.append(f"event {i} lacks ph, pid or tid: {e!r}")
            continue
        if e["pid"] == 0:
            problems.append(f"event {i} ({e.get('name')}) uses pid 0, which Perfetto treats as the idle process")
        if e["ph"] == "X":
            if not isinstance(e.get("ts"), (int, float)) or not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
                problems.append(f"complete event {i} ({e.get('name')}) needs a ts and a dur >= 0")
                continue
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e.get("name")))
    for (pid, tid), slices in sorted(tracks.items()):
        stack: list[tuple] = []
        for ts, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= ts + eps:
                stack.pop()
            if stack and end > stack[-1][1] + eps:
                problems.append(f"pid {pid} tid {tid}: {name} [{ts:.1f}, {end:.1f}] overlaps {stack[-1][2]} "
                                f"[{stack[-1][0]:.1f}, {stack[-1][1]:.1f}] without nesting in it")
                continue
            stack.append((ts, end, name))
    return problems
