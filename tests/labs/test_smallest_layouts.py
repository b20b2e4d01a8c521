"""Every lab once at its smallest legal layout (each parallel axis 1), through the command line,
few steps, tiny models, no plots: a degenerate axis (EP = 1 sends no all-to-all, PP = 1 sends
nothing) must still reach the verdict (issue 37: ``lab moe --ep 1`` crashed in its report)."""
import pytest

from labkit.__main__ import main as cli

TINY = ["--steps", "2", "--seq", "8", "--batch", "2", "--embd", "8", "--heads", "1", "--seed", "1"]
SMALLEST = {
    "pipeline": ["lab", "pipeline", "--world-size", "1", "--schedule", "all", "--microbatches", "1",
                 "--chunks", "1", "--layers", "1", "--no-plots", *TINY],
    "pipeline-zb": ["lab", "pipeline", "--world-size", "1", "--schedule", "zero-bubble", "--microbatches", "2",
                    "--layers", "2", "--no-plots", *TINY],
    "tensor": ["lab", "tensor", "--tp", "1", "--layers", "1", "--no-plots", *TINY],
    "moe": ["lab", "moe", "--ep", "1", "--experts", "1", "--top-k", "1", "--balance-steps", "1", "--layers", "1",
            "--moe-every", "1", "--no-plots", *TINY],
    "moe-eplb": ["lab", "moe", "--eplb", "--ep", "1", "--experts", "1", "--top-k", "1", "--balance-steps", "1",
                 "--layers", "1", "--moe-every", "1", "--no-plots", *TINY],
    "3d": ["lab", "3d", "--tp", "1", "--pp", "1", "--dp", "1", "--microbatches", "1", "--layers", "1",
           "--no-plots", *TINY],
    "3d-moe": ["lab", "3d", "--tp", "1", "--pp", "1", "--dp", "1", "--microbatches", "1", "--layers", "2",
               "--moe", "--experts", "1", "--topk", "1", "--no-plots", *TINY],
}


@pytest.mark.parametrize("name", SMALLEST)
def test_every_lab_at_its_smallest_layout_reaches_the_verdict(name, tmp_path, capsys):
    rc = cli([*SMALLEST[name], "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    assert rc == 0, out + err
    assert "OK" in out + err, out + err
