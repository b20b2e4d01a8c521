"""The pipeline lab with the zero-bubble schedules: verdict OK against one device, Perfetto
traces written, cost model said; their size rules as one error line before any rank starts."""
import json

import pytest

from labkit.labs.pipeline import main
from labkit.pipeline.trace import trace_problems

SMALL = ["--world-size", "2", "--steps", "2", "--batch", "4", "--seq", "8", "--layers", "4", "--embd", "16",
         "--heads", "2"]


def test_lab_zero_bubble_schedules_with_cost_model_and_trace(tmp_path, capsys):
    rc = main(SMALL + ["--schedule", "zb-h1", "zbv", "dualpipev", "--microbatches", "4", "--cost-model", "2,2,2",
                       "--trace", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in ("zb-h1", "zbv", "dualpipev"):
        assert f"OK   {name}" in out
        trace = json.loads(next(tmp_path.iterdir()).joinpath(f"trace-{name}.json").read_text())
        kinds = {e["args"]["kind"] for e in trace["traceEvents"] if e["ph"] == "X" and e.get("cat") == "compute"}
        assert {"F", "I", "W"} <= kinds
        assert trace_problems(trace) == []  # Perfetto's rules: measured receives overlap, on their own tracks
    both = json.loads(next(tmp_path.iterdir()).joinpath("trace-all.json").read_text())
    assert trace_problems(both) == []
    assert {e["args"]["name"] for e in both["traceEvents"] if e["name"] == "process_name"} == {
        f"{name} (measured, last step)" for name in ("zb-h1", "zbv", "dualpipev")}
    assert "cost model: every F, I, W lasts at least 2,2,2 ms" in out
    assert "zero-bubble formulas: zb-h1 (K-1)(T_F+T_I-T_W)" in out
    # ZB-V's formula holds for any measured T_F, T_I, T_W (M >= 2K-1): never "nan"
    assert "nan" not in next(line for line in out.splitlines() if line.startswith("zbv "))


@pytest.mark.parametrize("args, message", [
    (["--schedule", "dualpipev", "--microbatches", "3"], "error: DualPipeV needs at least as many microbatches as "
                                                          "stages: M >= 2K = 4"),
    (["--schedule", "zbv", "--layers", "6", "--microbatches", "4"], "error: n_layer=6 layers cannot be split evenly "
                                                                     "into K*v=4 stages"),
    (["--schedule", "zb-h1", "--cost-model", "1,2"], "error: --cost-model takes three numbers >= 0 in milliseconds"),
])
def test_lab_zero_bubble_bad_options(args, message, capsys):
    a = list(SMALL)
    if "--layers" in args:
        i = a.index("--layers")
        del a[i:i + 2]
    assert main(a + args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
