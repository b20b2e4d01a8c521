"""The schedule explorer (labkit.pipeline.explorer): the plotting function's numbers match the
simulator and the formulas, invalid sizes are shown instead of raised, and the widget's controls
re-render with the chosen values."""
from fractions import Fraction

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.pipeline import gpipe_schedule, interleaved_schedule, one_f_one_b_schedule, simulate  # noqa: E402
from labkit.pipeline.explorer import (SCHEDULES, build_schedule, count_sends, describe, explorer,  # noqa: E402
                                      peak_in_flight_per_rank, render)


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
    assert (dropdown.value, k_slider.value, m_slider.value, v_slider.value) == ("1F1B", 4, 8, 2)
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


def test_render_widens_crowded_charts_and_can_label_stages():
    from labkit.pipeline.explorer import figure_width

    assert figure_width("1F1B", 8, 4) == 10 and figure_width("Interleaved 1F1B", 8, 2) == 10
    assert figure_width("Interleaved 1F1B", 8, 4) == 14.8 and figure_width("Interleaved 1F1B", 16, 4) == 16
    info = render("Interleaved 1F1B", K=4, M=8, v=4)
    assert info["ax"].figure.get_figwidth() == 14.8
    info = render("Interleaved 1F1B", K=2, M=4, v=2, show_stage=True)
    labels = {t.get_text() for t in info["ax"].texts}
    assert {"0/0", "0/1", "0/2", "0/3", "3/3"} <= labels  # microbatch/stage
    assert all("/" not in t.get_text() for t in render("1F1B", K=2, M=4)["ax"].texts)
