"""The schedule explorer (labkit.pipeline.explorer): the plotting function's numbers match the
simulator and the formulas, invalid sizes are shown instead of raised, and the widget's controls
re-render with the chosen values."""
from fractions import Fraction

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.pipeline import gpipe_schedule, interleaved_schedule, one_f_one_b_schedule, simulate  # noqa: E402
from labkit.pipeline.explorer import (  # noqa: E402
    SCHEDULES,
    build_schedule,
    count_sends,
    describe,
    explorer,
    peak_in_flight_per_rank,
    render,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_render_matches_simulator_and_formulas():
    info = render("1F1B", K=4, M=8, v=3)  # v is ignored by 1F1B
    assert info["v"] == 1 and info["error"] is None
    assert info["bubble"] == Fraction(3, 11) == info["bubble_formula"]
    assert info["peak_in_flight"] == [4, 3, 2, 1]
    assert info["sends"] == 2 * 8 * (4 - 1)
    assert info["makespan"] == (8 + 4 - 1) * 2  # (M+K-1)(f+b), f = b = 1
    assert len(info["ax"].patches) > 0 and "bubble 27.3%" in info["ax"].get_title(loc="left")

    info = render("GPipe", K=4, M=8)
    assert info["bubble"] == Fraction(3, 11) and info["peak_in_flight"] == [8, 8, 8, 8]

    info = render("Interleaved 1F1B", K=4, M=8, v=2)
    assert info["bubble"] == Fraction(3, 19) == info["bubble_formula"]
    assert info["sends"] == 2 * 8 * (4 * 2 - 1)
    # a chunk is 1/v of a rank's layers: the step is shorter than 1F1B's 22 units
    assert info["makespan"] == simulate(interleaved_schedule(4, 8, 2), Fraction(1, 2),
                                        Fraction(1, 2)).makespan
    assert info["makespan"] < 22


def test_render_with_backward_twice_forward_keeps_the_gpipe_bubble():
    info = render("GPipe", K=3, M=5, backward=2.0)
    assert info["bubble"] == Fraction(2, 7)
    assert info["makespan"] == (5 + 3 - 1) * 3


def test_render_shows_the_rule_instead_of_raising():
    info = render("Interleaved 1F1B", K=4, M=9, v=2)
    assert info["bubble"] is None
    assert "needs M split into equal rounds" in info["error"] and "got M=9" in info["error"]
    assert any("not a valid configuration" in t.get_text() for t in info["ax"].texts)
    assert "needs M split into equal rounds" in describe(info)
    # M not a multiple of K, as torch's ScheduleInterleaved1F1B runs it (one round of 6)
    info = render("Interleaved 1F1B", K=4, M=6, v=2)
    assert info["error"] is None and info["bubble"] == info["bubble_formula"] == Fraction(3, 2 * 6 + 3)
    info = render("Interleaved 1F1B", K=4, M=2, v=2)     # M < K: one round of 2; each loop costs K steps
    assert info["bubble"] == info["bubble_formula"] == Fraction(2 * 2 + 1, 2 * 4 + 1)
    assert "formula (v(K-M)+M-1)/(vK+M-1) = 0.556" in describe(info)


def test_helpers_count_from_the_schedule_data():
    assert peak_in_flight_per_rank(gpipe_schedule(3, 5)) == [5, 5, 5]
    assert peak_in_flight_per_rank(one_f_one_b_schedule(4, 2)) == [2, 2, 2, 1]
    assert count_sends(one_f_one_b_schedule(1, 4)) == 0
    assert count_sends(interleaved_schedule(2, 4, 3)) == 2 * 4 * (2 * 3 - 1)
    assert set(SCHEDULES) == {"GPipe", "1F1B", "Interleaved 1F1B", "ZB-H1", "ZB-V", "DualPipeV"}
    with pytest.raises(ValueError, match="unknown schedule 'ZB-H2'"):
        build_schedule("ZB-H2", 4, 8)


def test_widget_controls_rerender_with_the_chosen_values():
    w = explorer(schedule="1F1B", K=4, M=8, v=2)
    dropdown, k_slider, m_slider, v_slider, output = w.children
    assert (dropdown.value, k_slider.value, m_slider.value, v_slider.value) == ("1F1B", 4, 8, 1)  # v in effect
    assert w.result["bubble"] == Fraction(3, 11)
    k_slider.value = 2
    assert w.result["K"] == 2 and w.result["peak_in_flight"] == [2, 1]
    dropdown.value = "Interleaved 1F1B"
    assert w.result["schedule"] == "Interleaved 1F1B" and w.result["v"] == 2
    assert w.result["bubble"] == Fraction(1, 2 * 8 + 1)
    v_slider.value = 4
    assert w.result["bubble_formula"] == Fraction(1, 4 * 8 + 1) and w.result["sends"] == 2 * 8 * 7
    m_slider.value = 5  # K=2: 2 rounds of 2.5 microbatches: the rule is shown, nothing raises
    assert w.result["error"] is not None and "got M=5" in w.result["error"]
    dropdown.value = "GPipe"
    assert w.result["error"] is None and w.result["v"] == 1 and w.result["peak_in_flight"] == [5, 5]


def test_explorer_offers_the_zero_bubble_schedules():
    from labkit.pipeline.explorer import describe, render
    from labkit.pipeline.zero_bubble import bubble_time_formula
    for name, v in (("ZB-H1", 1), ("ZB-V", 2), ("DualPipeV", 2)):
        info = render(name, 4, 8)
        assert info["error"] is None and info["v"] == v
        # default backward 2 = T_F + T_F split in halves: T_F = T_I = T_W, every formula exact
        assert info["bubble"] == info["bubble_formula"], name
        assert "formula" in describe(info)
        labels = [t.get_text() for t in info["ax"].get_legend().get_texts()]
        assert "input grad (I)" in " ".join(labels) and "weight grad (W)" in " ".join(labels)
        plt.close(info["ax"].figure)
    t = bubble_time_formula("zb-h1", 4, 1, 1, 1)
    assert render("ZB-H1", 4, 8)["bubble_formula"] == Fraction(t, 8 * 3 + t)
    info = render("DualPipeV", 4, 6)
    assert "M >= 2K = 8" in info["error"]
    plt.close(info["ax"].figure)
    w = explorer()
    w.children[0].value = "ZB-V"
    assert w.result["schedule"] == "ZB-V" and w.result["bubble"] == w.result["bubble_formula"]


def test_v_slider_is_disabled_where_v_is_ignored():
    w = explorer(schedule="1F1B", K=4, M=8, v=2)
    dropdown, v_slider = w.children[0], w.children[3]
    assert v_slider.disabled
    dropdown.value = "Interleaved 1F1B"
    assert not v_slider.disabled
    dropdown.value = "GPipe"
    assert v_slider.disabled
    assert not explorer(schedule="Interleaved 1F1B").children[3].disabled


def test_render_fits_the_notebook_width_and_can_label_stages():
    from labkit.pipeline.explorer import NOTEBOOK_WIDTH, figure_width

    assert figure_width("1F1B", 8, 4) == figure_width("Interleaved 1F1B", 16, 4) == NOTEBOOK_WIDTH == 8.0
    info = render("Interleaved 1F1B", K=4, M=8, v=4)
    assert info["ax"].figure.get_figwidth() == 8.0
    plt.close(info["ax"].figure)
    info = render("Interleaved 1F1B", K=2, M=4, v=2, show_stage=True)
    labels = {t.get_text() for t in info["ax"].texts}
    assert {"0/0", "0/1", "0/2", "0/3", "3/3"} <= labels  # microbatch/stage
    assert all("/" not in t.get_text() for t in render("1F1B", K=2, M=4)["ax"].texts)
    plt.close("all")


def _drawn_labels(fig):
    """(font size pt, label width px, its bar's width px) of every label, as the PNG is drawn."""
    from labkit.pipeline.explorer import figure_png
    png = figure_png(fig)                                    # tight layout, 100 dpi, as the widget shows it
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        bars = [p for p in ax.patches if p.get_zorder() == 1]
        for t in ax.texts:
            box = t.get_window_extent(renderer)
            x = ax.transData.inverted().transform(((box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2))
            bar = next(b for b in bars if b.get_x() <= x[0] <= b.get_x() + b.get_width()
                       and b.get_y() <= x[1] <= b.get_y() + b.get_height())
            px = ax.transData.transform([(bar.get_x(), 0), (bar.get_x() + bar.get_width(), 0)])
            out.append((t.get_fontsize(), box.width, px[1][0] - px[0][0]))
    return png, out


@pytest.mark.parametrize("schedule,K,M,v,labelled", [
    ("Interleaved 1F1B", 4, 8, 4, False), ("Interleaved 1F1B", 4, 16, 4, False), ("Interleaved 1F1B", 4, 8, 2, True),
    ("ZB-V", 4, 8, 2, True), ("DualPipeV", 4, 10, 2, True), ("1F1B", 4, 8, 1, True)])
def test_every_digit_drawn_is_readable_at_the_notebook_width(schedule, K, M, v, labelled):
    """The PNG is no wider than the notebook shows unshrunk (800 px + a margin), every label is at
    least 7 pt (9.7 px at 100 dpi) and lies inside its bar; bars too narrow carry no label (v=4:
    a chunk's box is 1/4 of a forward, under 8 px at this width: colours and legend only)."""
    import struct
    info = render(schedule, K, M, v)
    fig = info["ax"].figure
    png, labels = _drawn_labels(fig)
    width = struct.unpack(">I", png[16:20])[0]
    assert width <= 820, width
    assert bool(labels) == labelled, len(labels)
    assert all(size >= 7 and text_px <= bar_px for size, text_px, bar_px in labels), \
        [x for x in labels if x[0] < 7 or x[1] > x[2]][:5]
    plt.close(fig)


def test_widget_redraws_in_place_and_shows_the_v_in_effect():
    """A redraw replaces the text and the PNG (never empties the area first); the greyed v slider
    shows the v the schedule runs with and gives the learner's v back; an invalid M is one text
    line and no figure."""
    import ipywidgets as widgets
    w = explorer(schedule="Interleaved 1F1B", K=4, M=8, v=3)
    dropdown, k_slider, m_slider, v_slider, area = w.children
    text, image = area.children
    assert isinstance(text, widgets.HTML) and isinstance(image, widgets.Image)
    seen = []
    image.observe(lambda change: seen.append(len(change["new"])), names="value")
    text.observe(lambda change: seen.append(change["new"]), names="value")
    k_slider.value = 2
    assert all(seen) and len(seen) == 2                      # each replaced once, never emptied
    assert w.result["v"] == 3 and "v=3" in text.value
    for name, v_in_effect in (("GPipe", 1), ("1F1B", 1), ("ZB-H1", 1), ("ZB-V", 2), ("DualPipeV", 2)):
        dropdown.value = name
        assert v_slider.disabled and v_slider.value == v_in_effect == w.result["v"], name
        assert f"v={v_in_effect}" in text.value
    dropdown.value = "Interleaved 1F1B"
    assert not v_slider.disabled and v_slider.value == 3 == w.result["v"]   # the learner's v is back
    m_slider.value = 5                                        # K=2: 2 rounds cannot share 5 microbatches
    assert w.result["error"] and text.value.count("got M=5") == 1 and image.layout.display == "none"
    m_slider.value = 4
    assert w.result["error"] is None and image.layout.display is None and image.value[:4] == b"\x89PNG"
