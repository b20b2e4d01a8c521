"""Export timelines (simulated or measured) to the Chrome trace-event JSON format, which
Perfetto (https://ui.perfetto.dev) and chrome://tracing open.

Format (the "Trace Event Format" of the Chrome tracing project, JSON object form): a list
``traceEvents`` of events; a "complete" event ``{"ph": "X", "name", "ts", "dur", "pid",
"tid", "args"}`` is one slice, with ``ts``/``dur`` in microseconds; metadata events
(``"ph": "M"``, ``process_name`` / ``thread_name``) name the tracks. Here each timeline
(one schedule) is a process and each rank one track (thread) in it; every F, B, I, W is a
slice named like the action (``F3@s1``) with its kind, stage and microbatch in ``args``; a
receive is a slice in category ``comm`` from posting to completion, a send an instant event.
"""
from __future__ import annotations

import json
from pathlib import Path

from .schedules import COMPUTE
from .simulate import SimResult

__all__ = ["chrome_trace", "write_chrome_trace"]


def _events(timeline: dict, pid: int, name: str, time_unit: float) -> list:
    scale = 1e6 * time_unit  # -> microseconds
    ev = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
          {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}}]
    for r in sorted(timeline):
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r, "args": {"name": f"rank {r}"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": r, "args": {"sort_index": r}})
        for t in timeline[r]:
            kind, stage, mb = t.action
            args = {"kind": kind, "stage": stage, "microbatch": mb}
            ts, dur = float(t.start) * scale, float(t.end - t.start) * scale
            if kind in COMPUTE:
                ev.append({"ph": "X", "cat": "compute", "name": repr(t.action), "ts": ts, "dur": dur,
                           "pid": pid, "tid": r, "args": args})
            elif kind.startswith("RECV"):
                ev.append({"ph": "X", "cat": "comm", "name": repr(t.action), "ts": ts, "dur": dur,
                           "pid": pid, "tid": r, "args": args})
            else:
                ev.append({"ph": "i", "s": "t", "cat": "comm", "name": repr(t.action), "ts": ts,
                           "pid": pid, "tid": r, "args": args})
    return ev


def chrome_trace(timelines, time_unit: float = 1.0) -> dict:
    """The trace-event JSON object (a dict) for one or several timelines.

    ``timelines``: a :class:`~.simulate.SimResult`, a ``{rank: [TimedAction]}`` dict, or a
    dict ``{name: timeline}`` of several (one Perfetto process each, e.g. one per schedule).
    ``time_unit``: seconds per time unit of the timelines (1.0 for measured ones in seconds;
    e.g. 1e-3 to read simulated unit costs as milliseconds)."""
    if isinstance(timelines, SimResult) or (isinstance(timelines, dict) and timelines
                                            and all(isinstance(k, int) for k in timelines)):
        timelines = {"timeline": timelines}
    events = []
    for pid, (name, tl) in enumerate(timelines.items()):
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
