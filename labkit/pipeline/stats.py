"""What a pipeline step measured, derived from the runtime's events.

The runtime (:mod:`.runtime`) only executes actions; for each one it emits an
:class:`Event`: the action, its ``start`` and ``end`` (seconds from the step's common start)
and ``nbytes``:

======================  ===========================================================
kind                    ``nbytes``
======================  ===========================================================
``F``                   bytes its forward saved for backward (the microbatch's stash,
                        measured with ``torch.autograd.graph.saved_tensors_hooks``;
                        one input per microbatch under recompute)
``I``                   bytes of the gradients I keeps for W (:mod:`.split_backward`)
``SEND_*``/``RECV_*``   bytes of the tensors sent or received
``B``, ``W``            0 (they free what the F, and the I, of their microbatch hold)
======================  ===========================================================

From the events, in their order on the rank, this module counts per stage: microbatches in
flight (F done, B or W not yet; a split backward holds the activations until W, Qi et al.
2024, sec. 3), stashed bytes, microbatches waiting for their W and the bytes I keeps for W.
The bubble of measured timelines is :func:`~.simulate.bubble_fraction` of :func:`timeline`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .schedules import Action
from .simulate import TimedAction, bubble_fraction

__all__ = ["Event", "StepStats", "step_stats", "timeline", "measured_bubble", "mean_times"]


class Event(NamedTuple):
    """One executed action on one rank: ``start``/``end`` in seconds from the step's common
    start, ``nbytes`` as in the module docstring."""

    action: Action
    start: float
    end: float
    nbytes: int = 0


def timeline(events) -> list[TimedAction]:
    """The events as :class:`~.simulate.TimedAction` (what the simulator and the plots take)."""
    return [TimedAction(e.action, e.start, e.end) for e in events]


def measured_bubble(timelines: dict, K: int | None = None):
    """Bubble fraction of measured timelines ``{rank: [Event or TimedAction]}``:
    ``1 - busy / (K * makespan)`` (:func:`~.simulate.bubble_fraction`)."""
    return bubble_fraction({r: timeline(evs) for r, evs in timelines.items()}, K)


def mean_times(timelines, n_stages: int) -> dict:
    """The cost model a run measured: mean duration (seconds) of each compute kind per stage,
    ``{kind: [T for stage 0..n_stages-1]}``, over ``timelines`` (an iterable of
    ``{rank: [Event or TimedAction]}``, e.g. the timed steps). A kind appears only when every
    stage ran it (F and B, or F, I and W). What :func:`~.simulate.simulate` and the bubble
    formulas take, so measured and predicted bubbles use the same costs."""
    sums: dict = {}
    for tl in timelines:
        for r in tl:
            for t in tl[r]:
                if t.action.kind in ("F", "B", "I", "W"):
                    acc = sums.setdefault((t.action.kind, t.action.stage), [0.0, 0])
                    acc[0] += t.end - t.start
                    acc[1] += 1
    return {kind: [sums[(kind, s)][0] / sums[(kind, s)][1] for s in range(n_stages)]
            for kind in ("F", "B", "I", "W") if all((kind, s) in sums for s in range(n_stages))}


@dataclass
class StepStats:
    """Per stage (dicts stage -> value) for one training step on one rank:
    ``peak_in_flight`` (most microbatches whose F ran and whose B or W has not),
    ``stash_bytes`` (bytes each microbatch's F saved, a list indexed by microbatch),
    ``stash_peak_bytes`` (most of those bytes held at once), ``peak_waiting_for_w`` (most
    microbatches between their I and their W), ``w_grads_peak_bytes`` (most bytes of the
    gradients I keeps for W at once), ``w_only_peak_bytes`` (most bytes, at once, of the
    activations only W needs: waiting microbatches times ``w_only_bytes[s]``; only for the
    stages in ``w_only_bytes``, empty when it is None)."""

    peak_in_flight: dict = field(default_factory=dict)
    stash_bytes: dict = field(default_factory=dict)
    stash_peak_bytes: dict = field(default_factory=dict)
    peak_waiting_for_w: dict = field(default_factory=dict)
    w_grads_peak_bytes: dict = field(default_factory=dict)
    w_only_peak_bytes: dict = field(default_factory=dict)


def step_stats(events, stages, M: int, w_only_bytes: dict | None = None) -> StepStats:
    """:class:`StepStats` of one rank's ``events`` (in execution order) for its ``stages``
    and ``M`` microbatches. ``w_only_bytes``: stage -> bytes per microbatch that only W needs
    (None: not measured)."""
    zero = {s: 0 for s in stages}
    out = StepStats(dict(zero), {s: [0] * M for s in stages}, dict(zero), dict(zero), dict(zero),
                    dict(zero) if w_only_bytes is not None else {})
    live, stash_live, waiting, w_live = dict(zero), dict(zero), dict(zero), dict(zero)
    stash_of, w_of = {}, {}
    for e in events:
        kind, s, m = e.action
        if kind == "F":
            live[s] += 1
            stash_of[(s, m)] = e.nbytes
            out.stash_bytes[s][m] = e.nbytes
            stash_live[s] += e.nbytes
            out.peak_in_flight[s] = max(out.peak_in_flight[s], live[s])
            out.stash_peak_bytes[s] = max(out.stash_peak_bytes[s], stash_live[s])
        elif kind == "I":
            waiting[s] += 1
            w_of[(s, m)] = e.nbytes
            w_live[s] += e.nbytes
            out.peak_waiting_for_w[s] = max(out.peak_waiting_for_w[s], waiting[s])
            out.w_grads_peak_bytes[s] = max(out.w_grads_peak_bytes[s], w_live[s])
            if w_only_bytes is not None and s in w_only_bytes:
                out.w_only_peak_bytes[s] = max(out.w_only_peak_bytes[s], waiting[s] * w_only_bytes[s])
        elif kind in ("B", "W"):
            live[s] -= 1
            stash_live[s] -= stash_of.pop((s, m))
            if kind == "W":
                waiting[s] -= 1
                w_live[s] -= w_of.pop((s, m))
    return out
