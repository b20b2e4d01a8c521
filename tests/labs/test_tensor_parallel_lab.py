"""The tensor lab runs end to end, equals single-device training, and fails loudly."""
import pytest

from labkit.labs import tensor as lab


def test_tensor_lab_runs_and_matches_single_device(tmp_path, capsys):
    rc = lab.main(["--tp", "2", "--steps", "3", "--seq-len", "16", "--n-embd", "32", "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TP=2" in out and "OK: every run (TP=2) equals single-device training at every step" in out
    runs = list(tmp_path.glob("tensor-*/loss_curves.png"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0
    # a tolerance below fp32 roundoff must fail, with the FAIL line on stderr
    rc = lab.main(["--tp", "2", "--steps", "2", "--seq-len", "16", "--n-embd", "32", "--runs-dir", str(tmp_path),
                   "--tolerance", "1e-12", "--no-plots"])
    out, err = capsys.readouterr()
    assert rc == 1 and "FAIL TP=2  step 0" in out and err.startswith("FAIL: TP=2 differ"), (out, err)
    assert len(list(tmp_path.glob("tensor-*"))) == 2  # two runs in the same second: two folders
    assert len(list(tmp_path.glob("tensor-*/losses.csv"))) == 2 and len(list(tmp_path.glob("tensor-*/*.png"))) == 1


@pytest.mark.parametrize("argv,message,exact", [
    (["--tp", "3", "--steps", "2"], "t=3 must divide", False),
    (["--tp", "0"], "error: TP degree t=0 must be >= 1 (--tp 0)\n", True),
    (["--tp", "2", "--steps", "2", "--data", "MISSING"], "missing.txt", False),
], ids=["degree-3", "degree-0", "missing-data"])
def test_tensor_lab_rejects_bad_input(argv, message, exact, tmp_path, capsys):
    argv = [str(tmp_path / "missing.txt") if x == "MISSING" else x for x in argv]
    assert lab.main(argv) == 2
    err = capsys.readouterr().err
    assert err == message if exact else message in err, err


def test_tensor_lab_one_step_names_its_files(tmp_path, capsys):
    """--steps 1 works; --tp 1 is handled (a group of one: no collectives, formula 0)."""
    rc = lab.main(["--tp", "1", "2", "--steps", "1", "--seq-len", "16", "--n-embd", "32", "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "loss_curves.png" in out and "losses.csv" in out and "OK: every run (TP=1, TP=2)" in out


def test_tensor_bench_runs_and_losses_agree(capsys):
    from labkit.bench import tensor as bench

    rc = bench.main(["--iters", "1", "--warmup", "0", "--n-embd", "32", "--seq-len", "16", "--batch-size", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "one transformer block" in out and "ratio" in out


def test_loss_plot_steps_agree_with_the_csv(tmp_path):
    """loss_curves.png's x-axis is the step as losses.csv writes it: 0, 1, ..."""
    from labkit.labs.tensor import _plot
    fig = _plot({"single device": [5.0, 4.0, 3.0], "TP=2": [5.0, 4.0, 3.0]}, tmp_path / "loss_curves.png")
    assert [list(line.get_xdata()) for line in fig.axes[0].get_lines()] == [[0, 1, 2], [0, 1, 2]]
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
