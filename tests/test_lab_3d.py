"""python -m labkit lab 3d: verdict right in both directions, counts, files, errors."""
import pytest

from labkit.__main__ import main

SMALL = ["--steps", "3", "--batch", "8", "--seq", "16", "--layers", "2", "--embd", "16", "--heads", "2",
         "--microbatches", "2"]


def test_lab_3d_ok(tmp_path, capsys):
    rc = main(["lab", "3d", "--tp", "2", "--pp", "2", "--dp", "1", "--tied", "--out", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK   t2 p2 d1 1f1b" in out and "TP (t=2)" in out and "embedding" in out
    folder = next(tmp_path.iterdir())
    assert {p.name for p in folder.iterdir()} == {"loss_curves.png", "rank_grid.png", "losses.csv"}


def test_lab_3d_fails_on_wrong_dp_average(tmp_path, capsys, monkeypatch):
    from labkit.data_parallel import ddp
    orig = ddp.DistributedDataParallel.__init__

    def no_average(self, *a, **k):        # injected bug: DP gradients summed, not averaged
        orig(self, *a, **k)
        self.d = 1
    monkeypatch.setattr(ddp.DistributedDataParallel, "__init__", no_average)
    rc = main(["lab", "3d", "--tp", "1", "--pp", "1", "--dp", "2", "--no-plots", "--out", str(tmp_path), *SMALL])
    cap = capsys.readouterr()
    assert rc == 1
    assert "FAIL t1 p1 d2 1f1b  step 0" in cap.out and "FAIL:" in cap.err


@pytest.mark.parametrize("argv,msg", [
    (["--tp", "3"], "n_head (attention heads)=2 must be divisible by t=3"),
    (["--layers", "3"], "n_layer=3 layers must be divisible by p*v"),
    (["--batch", "6"], "global batch B=6 must be divisible by d*M"),
    (["--lr", "0"], "--lr must be a finite number in (0, 10]"),
    (["--schedule", "interleaved", "--chunks", "2", "--layers", "2"],
     "n_layer=2 layers must be divisible by p*v = 2*2"),
])
def test_lab_3d_errors(argv, msg, capsys, tmp_path):
    base = ["--heads", "2", "--embd", "16", "--microbatches", "2"]
    rc = main(["lab", "3d", *base, *argv, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and "Traceback" not in err


def test_lab_3d_bad_data_and_help(tmp_path, capsys):
    assert main(["lab", "3d", "--data", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    for cmd in (["lab", "3d"], ["bench", "dp"]):
        with pytest.raises(SystemExit):
            main([*cmd, "--help"])
        assert capsys.readouterr().out.count("(default: ") >= 5


def test_bench_dp_runs_and_sides_agree(capsys):
    rc = main(["bench", "dp", "--iters", "1", "--iters3d", "1", "--layers", "2", "--embd", "16", "--heads", "2",
               "--seq", "8", "--batch", "4", "--microbatches", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [ln for ln in out.splitlines() if ln.startswith(("DDP,", "ZeRO-1,", "3D t"))]
    assert len(rows) == 3
    for row in rows:                      # same model, same data: the two sides train alike
        assert float(row.split()[-1] if not row.startswith("3D") else row.split("(|dloss|")[0].split()[-1]) < 1e-5


def test_schedule_spellings_are_aliases(tmp_path, capsys):
    """zb-h1 is the canonical name in both labs; zbh1 (and ZB-H1, zb-v) are accepted and shown in --help."""
    from labkit.labs import pipeline, threed
    for spelling in ("zbh1", "zb-h1", "ZB-H1"):
        assert threed._parser().parse_args(["--schedule", spelling]).schedule == "zb-h1"
        assert pipeline._parser().parse_args(["--schedule", spelling, "zb-v"]).schedule == ["zb-h1", "zbv"]
    assert "zbh1 = zb-h1" in threed._parser().format_help() and "zbh1 = zb-h1" in pipeline._parser().format_help()
    small = [a if a != "3" else "1" for a in SMALL]  # one step
    rc = main(["lab", "3d", "--tp", "1", "--pp", "2", "--dp", "1", "--schedule", "zbh1", "--no-plots",
               "--out", str(tmp_path), *small])
    out = capsys.readouterr().out
    assert rc == 0 and "OK   t1 p2 d1 zb-h1" in out, out
