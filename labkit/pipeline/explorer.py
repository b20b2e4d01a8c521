"""A schedule explorer: pick a schedule, K, M and v; see its Gantt chart, bubble and memory.

Two plain functions, so that tests (and a script) can use them without a browser:

* :func:`render` draws one configuration with the simulator (:func:`~.simulate.simulate`)
  and the plotter (:func:`~.plot.plot_timeline`) and returns the numbers it shows;
* :func:`explorer` wires :func:`render` to an ``ipywidgets.interactive`` with a schedule
  dropdown and K, M, v sliders (children in that order, then the output area).

What the numbers mean (uniform stage costs, backward time ``b`` times the forward time):

* bubble: idle fraction of the K ranks over the step, simulated; the formula
  (K-1)/(vM+K-1) (Narayanan et al. 2021, sec. 2.2.2; v = 1 for GPipe and 1F1B) is exact
  for b = 1;
* peak in flight per rank: the most (microbatch, stage) pairs whose forward ran and whose
  backward has not, summed over the rank's stages. With v chunks a pair holds the
  activations of 1/v of the rank's layers, so ``peak / v`` is in units of "one microbatch
  through all the rank's layers" (GPipe: M; 1F1B rank r: min(M, K - r));
* point-to-point sends per step: every activation and every gradient that crosses a stage
  boundary between two ranks, 2M(Kv-1) for K > 1 (v times 1F1B's 2M(K-1), roughly).
"""
from __future__ import annotations

from fractions import Fraction

import matplotlib.pyplot as plt

from .plot import plot_timeline
from .registry import REGISTRY, lookup, names
from .schedules import ScheduleError
from .simulate import simulate

__all__ = ["SCHEDULES", "ZERO_BUBBLE", "NOTEBOOK_WIDTH", "build_schedule", "peak_in_flight_per_rank", "count_sends",
           "figure_width", "effective_v", "render", "describe", "figure_png", "explorer"]

SCHEDULES = tuple(REGISTRY[n].label for n in names())  # the registry's labels: GPipe, 1F1B, ..., DualPipeV
ZERO_BUBBLE = tuple(REGISTRY[n].label for n in names(zero_bubble=True))  # backward split into I and W


def build_schedule(schedule: str, K: int, M: int, v: int = 1) -> dict:
    """The ``{rank: [Action]}`` data of ``schedule`` (one of :data:`SCHEDULES`).

    ``v`` is used by "Interleaved 1F1B" only (v = 1 there is plain 1F1B). Raises
    ValueError for an unknown name and :class:`~.schedules.ScheduleError` for sizes the
    schedule does not allow (e.g. interleaving with K = 2, M = 5: unequal rounds)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    info = lookup(schedule)
    return info.schedule(K, M, v if info.chunks is None else None)


def peak_in_flight_per_rank(actions: dict, split_until_w: bool = True) -> list:
    """Per rank: the most (microbatch, stage) pairs held at once, i.e. forwards that ran
    whose backward has not, over all the stages on that rank (action order only). With a
    split backward a pair is held until its W."""
    out = []
    for r in sorted(actions):
        live = peak = 0
        for a in actions[r]:
            if a.kind == "F":
                live += 1
                peak = max(peak, live)
            elif a.kind == "B" or (a.kind == "W" and split_until_w):
                live -= 1
        out.append(peak)
    return out


def count_sends(actions: dict) -> int:
    """Point-to-point sends in one step, all ranks, both directions (SEND_F + SEND_B)."""
    return sum(a.kind in ("SEND_F", "SEND_B") for r in actions for a in actions[r])


NOTEBOOK_WIDTH = 8.0  # inches: 800 px at the notebook's 100 dpi, so a figure is shown unshrunk


def figure_width(schedule: str, M: int, v: int) -> float:
    """Width in inches of a new figure for :func:`render`: :data:`NOTEBOOK_WIDTH` whatever the
    schedule. A wider figure is shrunk by the notebook until its digits cannot be read; boxes too
    narrow for their label keep their colour without one (:func:`~.plot.plot_timeline`)."""
    return NOTEBOOK_WIDTH


def render(schedule: str = "1F1B", K: int = 4, M: int = 8, v: int = 2, backward: float | None = None,
           ax=None, weight_share: float = 0.5, show_stage: bool = False) -> dict:
    """Simulate ``schedule`` with K ranks, M microbatches (and v chunks for interleaving) and
    draw its Gantt chart on ``ax`` (a new figure, :func:`figure_width` wide, when None).
    ``show_stage``: label the boxes ``m/s`` (microbatch/stage) instead of ``m``, where they fit.

    Time unit: the forward of one microbatch through all the layers of a rank; with v
    chunks a stage's forward takes 1/v of it. ``backward``: time of a backward relative to
    a forward (e.g. 2.0). Returns a dict: ``schedule``, ``K``, ``M``, ``v`` (1 unless interleaved),
    ``bubble`` (simulated, Fraction for rational costs), ``bubble_formula``
    ((K-1)/(vM+K-1)), ``peak_in_flight`` (per rank, see :func:`peak_in_flight_per_rank`),
    ``sends`` (per step), ``makespan`` (time units, a Fraction), ``error`` (None, or the message of
    the rule that forbids this configuration; then nothing is simulated and the axes show
    the message), ``ax``.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(figure_width(schedule, M, v), 0.6 * K + 1.4))
    if schedule in ZERO_BUBBLE:  # default b = 2: T_F = T_I = T_W, the zero-bubble paper's case
        return _render_zero_bubble(schedule, K, M, 2.0 if backward is None else backward, weight_share, ax,
                                   show_stage)
    backward = 1.0 if backward is None else backward
    entry = lookup(schedule)
    v_used = v if entry.chunks is None else 1
    info = {"schedule": schedule, "K": K, "M": M, "v": v_used, "bubble": None, "bubble_formula": None,
            "peak_in_flight": None, "sends": None, "makespan": None, "error": None, "ax": ax}
    try:
        actions = build_schedule(schedule, K, M, v_used)
    except ScheduleError as e:
        info["error"] = str(e)
        ax.text(0.5, 0.5, "not a valid configuration:\n" + str(e), ha="center", va="center", wrap=True,
                fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
        return info
    # a stage holds 1/v of the rank's layers: forward 1/v, backward b/v time units
    b = Fraction(backward).limit_denominator(1000) if isinstance(backward, float) else Fraction(backward)
    sim = simulate(actions, forward=Fraction(1, v_used), backward=b / v_used)
    info.update(bubble=sim.bubble_fraction, bubble_formula=entry.bubble_fraction(K, M, v_used),
                peak_in_flight=peak_in_flight_per_rank(actions), sends=count_sends(actions),
                makespan=sim.makespan)
    name = schedule + (f", v={v_used}" if entry.chunks is None else "")
    plot_timeline(sim, ax=ax, title=f"{name}, K={K}, M={M} (formula {float(info['bubble_formula']):.1%})",
                  unit="forward time of a rank's layers", show_stage=show_stage)  # labels only where they fit
    return info


def _render_zero_bubble(schedule, K, M, backward, weight_share, ax, show_stage=False) -> dict:
    """:func:`render` for ZB-H1, ZB-V and DualPipeV: the backward ``b`` splits into
    T_I = (1 - weight_share) b and T_W = weight_share b; ZB-V and DualPipeV hold two chunks
    per rank (each chunk's costs are half the rank's). ``bubble_formula`` is the formula's
    idle fraction where it is exact (:func:`~.zero_bubble.bubble_time_formula`), else None."""
    entry = lookup(schedule)
    v_used = entry.v()
    info = {"schedule": schedule, "K": K, "M": M, "v": v_used, "bubble": None, "bubble_formula": None,
            "peak_in_flight": None, "sends": None, "makespan": None, "error": None, "ax": ax,
            "formula_text": None}
    try:
        actions = build_schedule(schedule, K, M)
    except ScheduleError as e:
        info["error"] = str(e)
        ax.text(0.5, 0.5, "not a valid configuration:\n" + str(e), ha="center", va="center", wrap=True,
                fontsize=9, transform=ax.transAxes)
        ax.set_axis_off()
        return info
    b = Fraction(backward).limit_denominator(1000)
    ws = Fraction(weight_share).limit_denominator(1000)
    f, i, w = Fraction(1, v_used), b * (1 - ws) / v_used, b * ws / v_used
    # DualPipeV's F&B pairs run as one unit (here without overlap gain: F&B = F + B)
    sim = simulate(actions, forward=f, backward_input=i, backward_weight=w, overlapped=entry.overlapped(K, M))
    name, text = entry.name, entry.formula
    exact = {"zb-h1": w <= min(f, i) and M >= K, "zbv": f == i == w, "dualpipev": f == i and w <= i}[name]
    work = v_used * M * (f + i + w)
    formula = None
    if exact:
        t = entry.bubble_time(K, f, i, w)
        formula = t / (work + t)
    info.update(bubble=sim.bubble_fraction, bubble_formula=formula, formula_text=text,
                peak_in_flight=peak_in_flight_per_rank(actions), sends=count_sends(actions),
                makespan=sim.makespan)
    note = f"formula {float(formula):.1%}" if formula is not None else "formula not exact for these costs"
    plot_timeline(sim, ax=ax, title=f"{schedule}, K={K}, M={M} ({note})", unit="forward time of a rank's layers",
                  show_stage=show_stage)
    return info


def describe(info: dict) -> str:
    """Two lines of text for a :func:`render` result (deterministic)."""
    if info.get("formula_text") and not info["error"]:
        formula = (f"formula {info['formula_text']} = {float(info['bubble_formula']):.3f}"
                   if info["bubble_formula"] is not None else f"formula {info['formula_text']} not exact here")
        return (f"{info['schedule']} K={info['K']} M={info['M']} v={info['v']}: bubble {float(info['bubble']):.3f} "
                f"({formula}), {info['sends']} point-to-point sends per step\n"
                f"peak (microbatch, stage) pairs in flight per rank (until W): {info['peak_in_flight']}")
    if info["error"]:
        return f"{info['schedule']} K={info['K']} M={info['M']} v={info['v']}: {info['error']}"
    rule = "(v(K-M)+M-1)/(vK+M-1)" if info["M"] < info["K"] else "(K-1)/(vM+K-1)"   # M < K: one round
    return (f"{info['schedule']} K={info['K']} M={info['M']} v={info['v']}: bubble {float(info['bubble']):.3f} "
            f"(formula {rule} = {float(info['bubble_formula']):.3f}), "
            f"{info['sends']} point-to-point sends per step\n"
            f"peak (microbatch, stage) pairs in flight per rank: {info['peak_in_flight']}")


def effective_v(schedule: str, v: int) -> int:
    """The v a schedule runs with: the slider's for Interleaved 1F1B, 2 for ZB-V and DualPipeV (two
    chunks per rank in V placement), else 1."""
    entry = lookup(schedule)
    return v if entry.chunks is None else entry.chunks


def figure_png(fig, dpi: int = 100) -> bytes:
    """``fig`` laid out (tight) and rendered as PNG at ``dpi`` (the notebook's)."""
    import io
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def explorer(schedule: str = "Interleaved 1F1B", K: int = 4, M: int = 8, v: int = 2, max_K: int = 8,
             max_M: int = 16, max_v: int = 4):
    """The widget: a dropdown (schedule) and sliders K, M, v, then the output area (``children``
    0-4 of an ``ipywidgets.VBox``; the output area is a VBox of an ``HTML`` text and an ``Image``).
    Moving a control re-runs :func:`render` and shows :func:`describe` and the figure; the last
    result dict is ``widget.result``.

    Redrawn in place: the text and the image's PNG are replaced, never emptied first, so the
    area keeps its size while a new figure is drawn (no collapse and reflow on a slider move).
    The v slider shows the v in effect (:func:`effective_v`) and is disabled unless the schedule
    is Interleaved 1F1B; it gets the interleaved v back when that schedule is chosen again. A
    configuration the schedule's rules forbid (e.g. M not a multiple of K) shows its rule once,
    as text, and no figure."""
    import html

    import ipywidgets as w

    controls = [
        w.Dropdown(options=list(SCHEDULES), value=schedule, description="schedule"),
        w.IntSlider(value=K, min=1, max=max_K, description="K (ranks)"),
        w.IntSlider(value=M, min=1, max=max_M, description="M (microb.)"),
        w.IntSlider(value=effective_v(schedule, v), min=1, max=max_v, description="v (chunks)"),
    ]
    text = w.HTML()
    image = w.Image(format="png", layout=w.Layout(max_width="100%"))
    out = w.VBox([text, image])
    box = w.VBox(controls + [out], layout=w.Layout(width="100%"))
    box.add_class("widget-interact")
    state = {"v": v, "busy": False}  # the interleaved v the learner chose; re-entry guard

    def update(*_):
        if state["busy"]:
            return
        state["busy"] = True
        try:
            name, v_slider = controls[0].value, controls[3]
            if name == "Interleaved 1F1B":
                if v_slider.disabled:      # back to interleaving: the learner's v again
                    v_slider.value = state["v"]
                state["v"] = v_slider.value
            v_slider.disabled = name != "Interleaved 1F1B"
            v_slider.value = effective_v(name, state["v"])  # the v in effect, greyed where fixed
            info = dict(render(name, controls[1].value, controls[2].value, v_slider.value))
            fig = info.pop("ax").figure
            text.value = "<pre style='margin:0'>" + html.escape(describe(info)) + "</pre>"
            if info["error"] is None:
                image.value = figure_png(fig)
                image.layout.display = None
            else:  # the rule is the text above; no figure repeats it
                image.layout.display = "none"
            plt.close(fig)
            box.result = info
        finally:
            state["busy"] = False

    for c in controls:
        c.observe(update, names="value")
    update()
    return box
