"""python -m labkit lab 3d --impl torch|both: PyTorch's own composition under the labs' verdict, side by side
with labkit's; its verdict fails on injected bugs; its refusals are one line."""
import pytest

from labkit.__main__ import main

SMALL = ["--steps", "3", "--batch", "8", "--seq", "16", "--layers", "2", "--embd", "16", "--heads", "2",
         "--microbatches", "2", "--no-plots"]


def test_lab_3d_impl_both_ok(tmp_path, capsys):
    rc = main(["lab", "3d", "--impl", "both", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "3", "--sp",
               "--out", str(tmp_path), *SMALL])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "OK   t2 p2 d2 1f1b" in out and "OK   torch t2 p2 d2 1f1b" in out
    assert "labkit count" in out and "torch count" in out and "ratio labkit / torch = " in out
    # every line of the torch run's counts and memory equals the planner's or is explained (FSDP2's M + 1
    # gathers, SP's per-norm all-reduces and kept gathers, labkit's target-count all-reduce)
    table = out.split("The torch-native run next to the planner")[1]
    assert "explained [" in table and " =" in table and "not modeled" not in table, table


def test_lab_3d_impl_torch_ddp_interleaved_agrees_with_the_planner(tmp_path, capsys):
    rc = main(["lab", "3d", "--impl", "torch", "--tp", "2", "--pp", "2", "--dp", "2", "--zero", "0", "--schedule",
               "interleaved", "--out", str(tmp_path), *SMALL[:7], "4", *SMALL[8:]])
    out = capsys.readouterr().out
    assert rc == 0 and "OK   torch t2 p2 d2 interleaved" in out, out
    table = out.split("The torch-native run next to the planner")[1]
    assert "not modeled" not in table and "pp   send" in table, table


@pytest.mark.parametrize("bug", ["missing_unit", "no_microbatch_scaling"])
def test_lab_3d_impl_torch_fails_on_injected_bug(bug, tmp_path, capsys, monkeypatch):
    from labkit.parallel import torch_native
    orig = torch_native.TorchNativeGPT.__init__

    def buggy(self, *a, **k):
        if bug == "missing_unit":      # the root forgotten: the embedding and the head in no FSDP unit
            k["fsdp_units"] = lambda stage: [f"blocks.{i}" for i in range(len(stage.blocks))]
        orig(self, *a, **k)
        if bug == "no_microbatch_scaling":     # the M microbatches' gradients summed, not averaged
            self.schedule.scale_grads = False
    monkeypatch.setattr(torch_native.TorchNativeGPT, "__init__", buggy)
    rc = main(["lab", "3d", "--impl", "torch", "--tp", "1", "--pp", "1", "--dp", "2", "--zero", "3",
               "--out", str(tmp_path), *SMALL])
    cap = capsys.readouterr()
    assert rc == 1, cap.out
    assert "FAIL torch t1 p1 d2 1f1b  step 0" in cap.out and "FAIL:" in cap.err


@pytest.mark.parametrize("argv,msg", [
    (["--cp", "2", "--dp", "1"], "context parallelism is not available with --impl torch"),
    (["--zero", "1"], "ZeRO-1 has no torch counterpart"),
    (["--schedule", "zbv"], "--impl torch runs the schedules gpipe, 1f1b, interleaved"),
    (["--tied"], "does not tie embeddings"),
])
def test_lab_3d_impl_torch_refusals(argv, msg, capsys, tmp_path):
    rc = main(["lab", "3d", "--impl", "torch", "--heads", "2", "--embd", "16", "--microbatches", "2", *argv,
               "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and "Traceback" not in err and err.count("\n") == 1
