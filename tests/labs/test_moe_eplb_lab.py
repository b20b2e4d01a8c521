"""``lab moe --eplb``: bad options are one error line before any rank starts; a tiny run says OK
with the load table, the bytes per level and the plot; a run whose replica gradients are not
summed says FAIL (exit 1)."""
import os

import pytest

import labkit.labs.moe_eplb as moe_eplb
from labkit.__main__ import main as cli

TINY = ["lab", "moe", "--eplb", "--ep", "2", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--seq", "8",
        "--batch", "4", "--balance-steps", "4", "--steps", "2", "--experts", "4"]


@pytest.mark.parametrize("extra,message", [
    (["--gpus-per-node", "3"], "--gpus-per-node 3 must divide --ep 4 into whole nodes"),
    (["--redundant-experts", "1"], "--redundant-experts 1: E + redundant = 9 physical experts must be a multiple"),
    (["--gpus-per-node", "2", "--expert-groups", "3"], "--expert-groups 3 must divide --experts 8"),
])
def test_bad_eplb_options(extra, message, capsys):
    assert cli(["lab", "moe", "--eplb"] + extra) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def test_tiny_run_ok(tmp_path, capsys):
    assert cli(TINY + ["--gpus-per-node", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("max/mean tokens per GPU", "no balancing + EPLB, R=6 copies", "device-level loss",
                 "aux-loss-free bias", "EPLB measured on 2 ranks", "hier. inter-node", "at most 1 node(s)",
                 "hierarchical output equals flat: yes", "OK   EP=2 with EPLB replicas", "OK: the replicated experts"):
        assert text in out, text
    assert os.path.exists(tmp_path / "gpu_load.png")


def test_missing_replica_grad_sum_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(moe_eplb, "sync_replica_grads", lambda model, group: None)
    assert cli(TINY + ["--no-plots", "--out", str(tmp_path)]) == 1
    assert "FAIL: the replicas differ from single-device training" in capsys.readouterr().err
