"""Gantt chart of a pipeline timeline, simulated or measured (same function).

One row per rank (rank 0 on top), forward boxes in blue, backward boxes in orange (a split
backward: input gradient I in purple, weight gradient W in green), the
microbatch number in each box that is wide enough for it, and the idle time (the bubble)
shaded grey. When a rank holds several stages (interleaved 1F1B, v model chunks per rank;
Narayanan et al. 2021, sec. 2.2), stage s = c*K + rank is model chunk c of its rank, and the
chunk is shown by the shade (lighter = earlier chunk), with one legend entry per shade.
Send/receive entries are not drawn.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from .schedules import Schedule
from .simulate import SimResult, bubble_fraction

__all__ = ["plot_timeline"]

# light to dark; text on the two darkest shades is written in white
_F = ("#9ecae1", "#4292c6", "#2171b5", "#08519c")
_B = ("#fdae6b", "#f16913", "#d94801", "#a63603")
# zero-bubble split backward (Qi et al. 2024): input gradient I in purples, weight gradient W in greens
_I = ("#bcbddc", "#807dba", "#6a51a3", "#4a1486")
_W = ("#a1d99b", "#41ab5d", "#238b45", "#005a32")
_PALETTES = {"F": _F, "B": _B, "I": _I, "W": _W}
_NAMES = {"F": "forward", "B": "backward", "I": "input grad (I)", "W": "weight grad (W)"}
_IDLE = "#e0e0e0"
_FONT_SIZES = (8, 7)        # points; a label that fits neither is left out (the colour stays): 7 pt is
                            # 9.7 px at the notebook's 100 dpi, readable when the figure is not shrunk
_CHAR_EM = 0.62             # width of a digit or "/" in ems (DejaVu Sans), slightly generous
_RESERVE_IN = 2.3           # inches the layout may give to the tick labels and the legend column


def _shade(chunk: int, v: int) -> int:
    """Palette index of model chunk ``chunk`` out of ``v``: the middle shade when v = 1,
    else spread from lightest to darkest (chunks beyond four share the darkest shades)."""
    if v <= 1:
        return 1
    return min(3, round(chunk * 3 / (v - 1)))


def _label_fits(text: str, width: float, data_per_px: float, dpi: float):
    """The font size (points) at which ``text`` fits in a box ``width`` data units wide, or None."""
    for size in _FONT_SIZES:
        text_px = len(text) * _CHAR_EM * size * dpi / 72 + 3  # + a little padding
        if text_px * data_per_px <= width:
            return size
    return None


def plot_timeline(timeline, ax=None, title: str | None = None, K: int | None = None,
                  unit: str = "s", show_stage: bool = False, note: str | None = None):
    """Draw ``timeline`` and return the matplotlib Axes.

    ``timeline``: a :class:`~.simulate.SimResult` or ``{rank: [TimedAction, ...]}`` (from
    :func:`~.simulate.simulate` or gathered from the runtime's ``schedule.timeline`` on each
    rank); times in ``unit`` (ints, floats or Fractions). ``K``: number of ranks (default: the
    number of rows), which gives the model chunk c = stage // K of each box; ``unit``: label
    of the time axis; ``show_stage``: write ``m/s`` (microbatch/stage) instead of the
    microbatch number ``m``. A label is written only where its box is wide enough for it
    (measured against the axes' width in the figure), so dense timelines keep their colours
    without overlapping text. The title is ``"<title>: bubble X%"`` and, with ``note``,
    ``"<title>: bubble X% (<note>)"`` (e.g. to say which step a measured bubble is from).
    """
    if isinstance(timeline, SimResult):
        timeline = timeline.timeline
    ranks = sorted(timeline)
    K = K or len(ranks)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 * len(ranks) + 1.2))
    makespan = float(max((t.end for r in ranks for t in timeline[r]), default=0)) or 1.0
    computed = [t for r in ranks for t in timeline[r] if t.action.kind in _PALETTES]
    kinds = [k for k in _PALETTES if any(t.action.kind == k for t in computed)] or ["F", "B"]
    v = max((t.action.stage // K for t in computed), default=0) + 1
    # data units per pixel of the axes: as laid out now, or as narrow as tight_layout may make it to
    # fit the tick labels and the legend inside the figure, whichever is less (a label never overflows)
    fig = ax.figure
    width_in = min(ax.get_position().width * fig.get_figwidth(), fig.get_figwidth() - _RESERVE_IN)
    data_per_px = makespan / max(width_in * fig.dpi, 1.0)
    for row, r in enumerate(ranks):
        y = len(ranks) - 1 - row
        ax.barh(y, makespan, left=0, height=0.8, color=_IDLE, edgecolor="none", zorder=0)
        for t in timeline[r]:
            kind, stage, mb = t.action
            if kind not in _PALETTES:
                continue
            shade = _shade(stage // K, v)
            start, end = float(t.start), float(t.end)  # the simulator may give Fractions
            ax.barh(y, end - start, left=start, height=0.8, color=_PALETTES[kind][shade],
                    edgecolor="white", linewidth=0.5, zorder=1)
            label = f"{mb}/{stage}" if show_stage else f"{mb}"
            size = _label_fits(label, end - start, data_per_px, fig.dpi)
            if size is not None:
                ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=size, zorder=2,
                        color="white" if shade >= 2 else "black")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" for r in reversed(ranks)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time ({unit})")
    bub = float(bubble_fraction(timeline, len(ranks)))
    ax.set_title(f"{title + ': ' if title else ''}bubble {bub:.1%}{f' ({note})' if note else ''}",
                 loc="left", fontsize=10)
    # the legend is a column right of the axes, so a long title never runs into it
    # the kinds that occur, in the order F, B, I, W (I and W: a split backward, zero bubble)
    if v == 1:
        handles, legend_title = [Patch(color=_PALETTES[k][1], label=_NAMES[k]) for k in kinds], None
    else:  # one entry per shade
        handles = [Patch(color=_PALETTES[k][_shade(c, v)], label=f"{_NAMES[k]}, chunk {c}")
                   for k in kinds for c in range(v)]
        v_shape = Schedule.of({r: [t.action for t in timeline[r]] for r in ranks}).placement == "v"
        legend_title = "V: chunk 0 = stage r, chunk 1 = stage 2K-1-r" if v_shape else f"stage = chunk*{K} + rank"
    handles.append(Patch(color=_IDLE, label="idle (bubble)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
              title=legend_title, title_fontsize=7, alignment="left")
    return ax
