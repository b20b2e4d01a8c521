"""Gantt chart of a pipeline timeline, simulated or measured (same function).

One row per rank (rank 0 on top), forward boxes in blue, backward boxes in orange (darker
for later model chunks when v > 1), the microbatch number in each box, and the idle time
(the bubble) shaded grey. Send/receive entries are not drawn.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .simulate import SimResult, bubble_fraction

__all__ = ["plot_timeline"]

_F = ("#9ecae1", "#4292c6", "#2171b5", "#08519c")
_B = ("#fdae6b", "#f16913", "#d94801", "#a63603")


def plot_timeline(timeline, ax=None, title: str | None = None, K: int | None = None,
                  unit: str = "s", show_stage: bool | None = None):
    """Draw ``timeline`` and return the matplotlib Axes.

    ``timeline``: a :class:`~.simulate.SimResult` or ``{rank: [TimedAction, ...]}`` (from
    :func:`~.simulate.simulate` or gathered from the runtime's ``schedule.timeline`` on each
    rank). ``K``: number of ranks (default: the number of rows), used for the chunk shading;
    ``unit``: label of the time axis; ``show_stage``: write ``m/s`` (microbatch/stage) in
    the boxes (default: when some rank holds more than one stage). The title gets the
    bubble fraction appended.
    """
    if isinstance(timeline, SimResult):
        timeline = timeline.timeline
    ranks = sorted(timeline)
    K = K or len(ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    makespan = float(max((t.end for r in ranks for t in timeline[r]), default=0)) or 1.0
    if show_stage is None:
        show_stage = any(len({t.action.stage for t in timeline[r]}) > 1 for r in ranks)
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.barh(y, makespan, left=0, height=0.8, color="#e0e0e0", edgecolor="none", zorder=0)
        for t in timeline[r]:
            kind, stage, mb = t.action
            if kind not in ("F", "B"):
                continue
            chunk = min(stage // K, 3)
            color = (_F if kind == "F" else _B)[chunk if show_stage else 1]
            start, end = float(t.start), float(t.end)  # the simulator may give Fractions
            ax.barh(y, end - start, left=start, height=0.8, color=color, edgecolor="white",
                    linewidth=0.5, zorder=1)
            label = f"{mb}/{stage}" if show_stage else f"{mb}"
            ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=7, zorder=2)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time ({unit})")
    bub = float(bubble_fraction(timeline, len(ranks)))
    ax.set_title(f"{title + ': ' if title else ''}bubble {bub:.1%}", loc="left", fontsize=10)
    ax.legend(handles=[Patch(color=_F[1], label="forward"), Patch(color=_B[1], label="backward"),
                       Patch(color="#e0e0e0", label="idle (bubble)")],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=3, frameon=False)
    return ax
