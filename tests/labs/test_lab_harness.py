"""labs/harness.py: run(lab, argv) returns the exit code, the verdicts and the printed text; the
single-device reference is plain training; the dispatch table finds every lab (moe --eplb too)."""
import pytest
import torch

from labkit.labs import harness

TP = ["--tp", "2", "--steps", "2", "--batch", "2", "--seq", "8", "--layers", "1", "--embd", "16", "--heads", "2"]


def test_run_returns_verdicts_and_text(tmp_path, capsys):
    from labkit.labs import tensor
    res = harness.run(tensor.LAB, TP + ["--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert res.rc == 0 and list(res.verdicts) == ["TP=2"] and res.verdicts["TP=2"].ok, res.text
    assert len(res.verdicts["TP=2"].records) == 2 and len(res.reference_losses) == 2
    assert "OK: every run (TP=2) equals single-device training at every step" in res.text
    assert sorted(res.text.splitlines()) == sorted((out + err).splitlines())  # what was printed, both streams


def test_run_fails_with_an_injected_bug(tmp_path, capsys, monkeypatch):
    from labkit.labs import tensor
    from labkit.tensor_parallel import mappings
    # the bug: f's backward (copy_to_tensor_model_parallel_region) forgets its all-reduce
    monkeypatch.setattr(mappings._CopyToModelParallelRegion, "backward", staticmethod(lambda ctx, g: (g, None)))
    res = harness.run(tensor.LAB, TP + ["--out", str(tmp_path)])
    capsys.readouterr()
    assert res.rc == 1 and not res.verdicts["TP=2"].ok
    assert res.verdicts["TP=2"].first_failure().step == 0
    assert "FAIL: TP=2 differ from single-device training" in res.text


def test_bad_input_is_exit_2_and_no_verdict(capsys):
    from labkit.labs import tensor
    res = harness.run(tensor.LAB, ["--tp", "3"])
    assert res.rc == 2 and res.verdicts == {} and res.reference_losses is None
    assert res.text.startswith("error: ") and res.text.count("\n") == 1 and "t=3 must divide" in res.text
    assert capsys.readouterr().err == res.text


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_reference_is_plain_training(optimizer):
    """train_reference: the same steps as a hand-written loop, exactly (losses and parameters)."""
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 2, generator=g)
    a, b = torch.nn.Linear(5, 2), torch.nn.Linear(5, 2)
    b.load_state_dict(a.state_dict())

    def step_loss(m, step):
        return ((m(xs[step]) - ys[step]) ** 2).mean()
    ref = harness.train_reference(a, 4, step_loss, lr=0.1, optimizer=optimizer)
    opt = (torch.optim.Adam(b.parameters(), lr=0.1) if optimizer == "adam"
           else torch.optim.AdamW(b.parameters(), lr=0.1, weight_decay=0.0))
    losses = []
    for step in range(4):
        opt.zero_grad()
        loss = step_loss(b, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert ref.losses == losses and ref.model is a and len(ref.extra) == 4
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert ref.seconds > 0 and ref.tokens_per_s(10) > 0


def test_dispatch_table_names_every_lab():
    from labkit import commands
    from labkit.labs import moe, moe_eplb, pipeline, tensor, threed
    assert [commands.lab(n, []) for n in commands.LABS] == [pipeline.LAB, tensor.LAB, moe.LAB, threed.LAB]
    assert commands.lab("moe", ["--eplb"]) is moe_eplb.LAB and commands.lab("moe", ["--epl"]) is moe_eplb.LAB
    assert all(isinstance(commands.lab(n, []), harness.Lab) for n in commands.LABS)


def test_moe_labs_do_not_import_each_other():
    import ast
    import inspect

    from labkit.labs import moe, moe_eplb
    for mod, other in ((moe, "moe_eplb"), (moe_eplb, "moe")):
        tree = ast.parse(inspect.getsource(mod))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert other not in imported and f"labs.{other}" not in imported, (mod.__name__, imported)


SHARED = ("--seed", "--data", "--backend", "--tolerance")


def _options(parser) -> dict:
    return {s: (a.dest, a.default, a.help, a.choices, a.type) for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("name", ["pipeline", "tensor", "threed", "moe", "moe_eplb"])
def test_every_lab_takes_the_shared_options_from_the_harness(name):
    """Each lab's parser gets --seed, --data, --backend, --tolerance, its run folder option and
    --no-plots from harness.add_shared_options, and declares none of them itself."""
    import argparse
    import ast
    import importlib
    import inspect
    module = importlib.import_module(f"labkit.labs.{'moe_common' if name.startswith('moe') else name}")
    lab = importlib.import_module(f"labkit.labs.{name}").LAB
    ref = argparse.ArgumentParser()
    harness.add_shared_options(ref, plots=True)
    got, want = _options(lab.parser()), _options(ref)
    assert {s: got[s] for s in SHARED} == {s: want[s] for s in SHARED}
    out = {"pipeline": ("out", "runs"), "tensor": ("runs_dir", "runs"), "threed": ("out", "runs"),
           "moe": ("out", None), "moe_eplb": ("out", None)}[name]
    assert got["--out"][:2] == out and ("--runs-dir" in got) == (name == "tensor")
    assert "--no-plots" in got  # every lab draws
    tree = ast.parse(inspect.getsource(module))
    declared = {c.args[0].value for c in ast.walk(tree) if isinstance(c, ast.Call) and c.args
                and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"
                and isinstance(c.args[0], ast.Constant)}
    assert not declared & {*SHARED, "--out", "--runs-dir", "--no-plots"}, declared
    assert "add_shared_options" in {c.func.id for c in ast.walk(tree) if isinstance(c, ast.Call)
                                    and isinstance(c.func, ast.Name)}
