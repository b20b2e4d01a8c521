"""Gantt plot, the pipeline lab command and the benchmark command (small, fast settings)."""
import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.pipeline import Action, TimedAction, interleaved_schedule, one_f_one_b_schedule, simulate  # noqa: E402
from labkit.pipeline.plot import plot_timeline  # noqa: E402


def test_plot_from_simulator_and_from_measured_timeline():
    sim = simulate(one_f_one_b_schedule(4, 8), forward=1, backward=2)
    ax = plot_timeline(sim, title="1F1B")
    n_compute = sum(1 for r in sim.timeline for t in sim.timeline[r] if t.action.kind in ("F", "B"))
    assert len(ax.patches) == n_compute + 4  # one box per F/B plus the shaded row per rank
    assert ax.get_title(loc="left") == "1F1B: bubble 27.3%"
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts.count("0") == 8 and texts.count("7") == 8  # microbatch numbers, F and B on 4 ranks
    plt.close(ax.figure)
    # a measured timeline has float times and send/receive entries, which are not drawn
    measured = {0: [TimedAction(Action("F", 0, 0), 0.0, 0.5), TimedAction(Action("SEND_F", 0, 0), 0.5, 0.5),
                    TimedAction(Action("B", 0, 0), 2.0, 3.0)],
                1: [TimedAction(Action("RECV_F", 1, 0), 0.0, 0.6), TimedAction(Action("F", 1, 0), 0.6, 1.0),
                    TimedAction(Action("B", 1, 0), 1.0, 2.0)]}
    ax = plot_timeline(measured, unit="s")
    assert len(ax.patches) == 4 + 2
    assert ax.get_title(loc="left") == "bubble 51.7%"  # 1 - 3.1 / (2 * 3)
    plt.close(ax.figure)
    # a rank holding several stages: the chunk is the shade, one legend entry per shade; m/s on request
    ax = plot_timeline(simulate(interleaved_schedule(2, 4, 2)), note="last step")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "forward, chunk 0", "forward, chunk 1", "backward, chunk 0", "backward, chunk 1", "idle (bubble)"]
    assert {t.get_text() for t in ax.texts} == {"0", "1", "2", "3"}
    assert ax.get_title(loc="left").endswith(" (last step)")
    plt.close(ax.figure)
    assert "0/2" in {t.get_text() for t in plot_timeline(simulate(interleaved_schedule(2, 4, 2)),
                                                          show_stage=True).texts}
    plt.close("all")
    # dense timelines: a label is left out where its box is too narrow, so no two labels overlap
    # (4, 8, 2): its "m/s" labels are wider than a box at the notebook's width, so none is drawn (issue 21:
    # a label only where it fits); (2, 4, 2) has room for every one
    for sched, min_labels in ((interleaved_schedule(4, 8, 2), 0), (interleaved_schedule(4, 16, 4), 0),
                              (interleaved_schedule(2, 4, 2), 16)):
        ax = plot_timeline(simulate(sched), show_stage=True)
        ax.figure.canvas.draw()
        renderer = ax.figure.canvas.get_renderer()
        rows: dict = {}
        for t in ax.texts:
            rows.setdefault(t.get_position()[1], []).append(t.get_window_extent(renderer))
        for boxes in rows.values():
            boxes.sort(key=lambda b: b.x0)
            assert all(a.x1 <= b.x0 for a, b in zip(boxes, boxes[1:])), "overlapping labels"
        assert min_labels <= len(ax.texts) <= sum(len(v) for v in simulate(sched).timeline.values())
        assert all(t.get_fontsize() >= 7 for t in ax.texts)  # every digit drawn is readable
        plt.close(ax.figure)
    from fractions import Fraction  # exact simulator times are Fractions; the plot takes them too
    ax = plot_timeline(simulate(one_f_one_b_schedule(2, 2), forward=Fraction(1, 2)))
    assert ax.get_title(loc="left").startswith("bubble ")
    plt.close(ax.figure)


LAB_RUNS = [  # (options beyond the common ones, texts the output must hold)
    (["--steps", "3", "--layers", "4"],
     ("single device", "gpipe", "1f1b", "interleaved v=2",
      "OK: every run (gpipe, 1f1b, interleaved v=2) equals single-device training at every step",
      "AT THE SAME PARAMETERS", "[2, 1]")),  # [2, 1]: 1F1B peak in flight per stage, K=2, M=2
    # --steps 1: the timeline comes from step 0 (no timed step, tokens/s nan), no crash; --no-plots: no PNG
    (["--steps", "1", "--layers", "2", "--schedule", "1f1b", "--no-plots"], ("1f1b", "OK: every run (1f1b)")),
]


@pytest.mark.parametrize("extra,texts", LAB_RUNS, ids=["all-schedules", "one-step"])
def test_lab_runs_and_matches_single_device(extra, texts, tmp_path, capsys):
    from labkit.labs.pipeline import main
    rc = main(["--world-size", "2", "--microbatches", "2", "--batch", "4", "--seq", "16", "--embd", "32",
               "--heads", "2", "--out", str(tmp_path), *extra])
    out = capsys.readouterr().out
    assert rc == 0, out
    for text in texts:
        assert text in out, text
    folder = next(tmp_path.iterdir())
    assert folder.name.startswith("pipeline-")
    if "--no-plots" in extra:
        assert not list(folder.glob("*.png")) and "timelines.png" not in out
    else:
        assert "timelines.png" in out
        assert (folder / "timelines.png").stat().st_size > 0 and (folder / "loss_curves.png").stat().st_size > 0


def test_lab_rejects_bad_sizes_before_starting(capsys):
    from labkit.labs.pipeline import main
    assert main(["--world-size", "3", "--schedule", "gpipe"]) == 2
    assert "n_layer=8 layers cannot be split evenly into K*v=3 stages" in capsys.readouterr().err
    assert main(["--world-size", "4", "--schedule", "interleaved", "--microbatches", "9", "--batch", "18"]) == 2
    assert "needs M split into equal rounds" in capsys.readouterr().err
    # a huge K breaks the layer split first: that rule, not the memory estimate (which grows with K)
    assert main(["--world-size", "100000"]) == 2
    err = capsys.readouterr().err
    assert "cannot be split evenly into K*v=100000 stages" in err and "memory" not in err, err


def test_memory_estimate_is_the_planners():
    from labkit.labs import bad_memory, count_parameters_meta
    from labkit.model import GPT, GPTConfig
    from labkit.plan.memory import memory_per_rank
    from labkit.plan.spec import Layout, ModelSpec
    cfg = GPTConfig(n_layer=4, n_embd=32, n_head=4, block_size=16)
    spec = ModelSpec.from_gpt_config(cfg, global_batch=8)
    lay = Layout(p=4, b=2, M=4, schedule="gpipe", precision="fp32")
    P = spec.total_params()
    assert P == count_parameters_meta(lambda: GPT(cfg))
    # the 4 ranks as the planner counts them, the full model each builds, the reference and the verdict's copies
    need = (sum(r.total for r in memory_per_rank(spec, lay, device="cpu")) + 4 * P * 4
            + memory_per_rank(spec, Layout(b=8, M=1, precision="fp32"), device="cpu")[0].total + 8 * P)
    assert bad_memory(spec, lay, "sizes", limit=need) is None
    msg = bad_memory(spec, lay, "sizes", limit=need - 1)
    assert msg.startswith("sizes: the run needs about") and f"the planner's count for {P:,} parameters" in msg, msg
    assert "the 4 ranks' parameters, gradients, Adam state and activations" in msg, msg


def test_lab_rejects_bad_options_with_one_error_line(tmp_path, capsys):
    from labkit.labs.pipeline import main
    for argv, message in ((["--steps", "0"], "--steps must be >= 1, got 0"),
                          (["--world-size", "0"], "--world-size must be >= 1, got 0"),
                          (["--heads", "3"], "n_embd=64 must be divisible by n_head=3"),
                          (["--data", str(tmp_path / "missing")], "no such file or folder"),
                          (["--data", str(tmp_path)], "folder holds no text files")):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.filterwarnings("ignore")
def test_bench_smoke(capsys):
    from labkit.bench.pipeline import main
    assert main(["--world-size", "2", "--steps", "1", "--warmup", "0", "--schedule", "1f1b", "--layers", "2",
                 "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "8", "--microbatches", "4"]) == 0
    assert "labkit/torch" in capsys.readouterr().out
