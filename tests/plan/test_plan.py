"""labkit.plan: predictions checked against labkit's own measured runs on CPU ranks, against the
published configurations, and its command line."""
import json

import pytest
import torch

from labkit.__main__ import main as labkit_main
from labkit.checkpoint import SavedTensorMeter
from labkit.comm import CommLog
from labkit.data import VOCAB_SIZE
from labkit.dist import launch
from labkit.model import GPT, GPTConfig, lm_loss
from labkit.pipeline.runtime import PipelineStage
from labkit.pipeline.schedule_classes import Schedule1F1B, ScheduleGPipe
from labkit.pipeline.stages import split_gpt
from labkit.plan import memory as plan_memory
from labkit.plan.comm import comm_per_rank
from labkit.plan.memory import memory_per_rank
from labkit.plan.planner import PlanError, plan, step_time
from labkit.plan.spec import PUBLISHED, Cluster, Layout, ModelSpec, preset
from labkit.tensor_parallel import TensorParallelGPT

CFG = GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=4, n_head=4, n_embd=32)
B, S = 4, 32


def _data():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, CFG.vocab_size, (B, S + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _state_bytes(model, opt):
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    optim = sum(v.numel() * v.element_size() for p, st in opt.state.items() for v in st.values()
                if torch.is_tensor(v) and v.shape == p.shape)          # Adam's exp_avg, exp_avg_sq
    return params, grads, optim


def _tp_rank(ctx, cfg=CFG):
    model = TensorParallelGPT(GPT(cfg, seed=0), ctx.group)
    idx, tgt = _data()
    with CommLog() as log:
        with SavedTensorMeter(exclude=list(model.parameters())) as meter:
            loss = model(idx, tgt)
            act = meter.live
            loss.backward()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.step()
    return {"state": _state_bytes(model, opt), "act": act, "comm": log.summary()}


def _pp_rank(ctx, M, schedule, cfg=CFG):
    K = ctx.world_size
    (sub,) = split_gpt(GPT(cfg, seed=0), K, [ctx.rank])
    stage = PipelineStage(sub, ctx.rank, K, group=ctx.group)
    sched = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stage, M, loss_fn=lm_loss)
    idx, tgt = _data()
    sched.step(idx, target=tgt)                       # warm-up (shapes), not measured
    for p in sub.parameters():
        p.grad = None
    with CommLog() as log:
        sched.step(idx, target=tgt)
    opt = torch.optim.Adam(sub.parameters(), lr=1e-3)
    opt.step()
    return {"state": _state_bytes(sub, opt), "act": sched.stash_peak_bytes[ctx.rank], "comm": log.summary()}


CFG_DROP = GPTConfig(vocab_size=VOCAB_SIZE, block_size=32, n_layer=4, n_head=4, n_embd=32, dropout=0.1)


def _all_rank(ctx):
    return {"tp2": _tp_rank(ctx), "pp2 1f1b M=4": _pp_rank(ctx, 4, "1f1b"), "pp2 gpipe M=2": _pp_rank(ctx, 2, "gpipe"),
            "tp2 dropout": _tp_rank(ctx, CFG_DROP), "pp2 1f1b M=4 dropout": _pp_rank(ctx, 4, "1f1b", CFG_DROP)}


@pytest.fixture(scope="module")
def runs():
    res = launch(_all_rank, 2, timeout=20)           # one launch of 2 ranks runs the three layouts
    return {k: [r[k] for r in res] for k in res[0]}


LAYOUTS = {"tp2": Layout(t=2, b=B, M=1, precision="fp32"),
           "pp2 1f1b M=4": Layout(p=2, b=B // 4, M=4, precision="fp32"),
           "pp2 gpipe M=2": Layout(p=2, b=B // 2, M=2, schedule="gpipe", precision="fp32")}
LAYOUTS["tp2 dropout"], LAYOUTS["pp2 1f1b M=4 dropout"] = LAYOUTS["tp2"], LAYOUTS["pp2 1f1b M=4"]
SPEC = ModelSpec.from_gpt_config(CFG, seq_len=S, global_batch=B)
SPEC_DROP = ModelSpec.from_gpt_config(CFG_DROP, seq_len=S, global_batch=B)   # dropout 0.1: masks are kept


def _check_run(measured, lay, spec=SPEC):
    """Mismatches between a measured run and the planner (empty: all good). Activations within
    5 % (the embedding-dropout mask alone is s b h mask bytes: 12 % of rank 0's here)."""
    bad = []
    pred = memory_per_rank(spec, lay, device="cpu")
    for rank, res in enumerate(measured):
        r = rank // lay.t                                   # pipeline rank (TP innermost)
        got = dict(zip(("params", "grads", "optimizer"), res["state"]))
        for k in got:
            if got[k] != getattr(pred[r], k):
                bad.append(f"rank {rank} {k}: measured {got[k]} predicted {getattr(pred[r], k)}")
        ratio = pred[r].activations / res["act"]
        if not 0.95 <= ratio <= 1.05:
            bad.append(f"rank {rank} activations: measured {res['act']} predicted {pred[r].activations}")
        ops = {}
        for ax in comm_per_rank(spec, lay, pp_rank=r, act_bytes=4).values():
            for kind, cb in ax.ops.items():
                ops[(kind, ax.group if kind not in ("send", "recv") else lay.p)] = cb
        if ops != res["comm"]:
            bad.append(f"rank {rank} communication: measured {res['comm']} predicted {ops}")
    return bad


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_equals_measured_run(runs, name):
    assert _check_run(runs[name], LAYOUTS[name], SPEC_DROP if "dropout" in name else SPEC) == []


def _act_pred(spec, lay, rank):
    return memory_per_rank(spec, lay, device="cpu")[rank // lay.t].activations


@pytest.mark.parametrize("name", ["tp2", "pp2 1f1b M=4"])
def test_dropout_masks_counted_to_the_byte(runs, name):
    """dropout 0.1 against 0 (labkit's own GPT): the masks it keeps, embedding-dropout mask
    (s b h) included, are exactly what the planner adds; the 5 % band above cannot see them."""
    lay = LAYOUTS[name]
    for rank, (off, on) in enumerate(zip(runs[name], runs[name + " dropout"])):
        assert on["act"] - off["act"] == _act_pred(SPEC_DROP, lay, rank) - _act_pred(SPEC, lay, rank), (name, rank)


def test_injected_planner_bugs_are_caught(runs, monkeypatch):
    # a 1F1B first stage that holds 1 microbatch instead of p: activations off by far more than 5 %
    monkeypatch.setattr(plan_memory, "in_flight_units", lambda lay, M, r: 1)
    assert any("activations" in b for b in _check_run(runs["pp2 1f1b M=4"], LAYOUTS["pp2 1f1b M=4"]))
    monkeypatch.undo()
    # Adam's two moments counted as one
    monkeypatch.setitem(plan_memory.BYTES, "fp32", (4, 4, 4))
    assert any("optimizer" in b for b in _check_run(runs["tp2"], LAYOUTS["tp2"]))


def test_presets_match_published_parameter_counts():
    for name, (total, active) in PUBLISHED["parameters"].items():
        spec = preset(name)
        assert spec.total_params() == pytest.approx(total, rel=0.01), name
        assert spec.active_params() == pytest.approx(active, rel=0.02), name


def test_published_figures():
    f = PUBLISHED
    meg = f["megatron-8.3b"]         # 512 GPUs x 39 TFLOP/s x 76 % scaling = 15.1 PFLOP/s
    assert meg["pflops"] * 1e3 / (meg["gpus"] * meg["tflops_one_gpu"]) == pytest.approx(meg["scaling"], abs=0.005)
    mt = f["mt-nlg-530b"]            # 8 x 35 x 16 = 4480 GPUs; 126 of 312 TFLOP/s; 1.4 EFLOP/s peak
    assert mt["t"] * mt["p"] * mt["d"] == mt["gpus"] == 4480
    assert mt["tflops_per_gpu"] / mt["peak_tflops"] == pytest.approx(0.404, abs=0.001)
    assert mt["gpus"] * mt["peak_tflops"] / 1e6 == pytest.approx(mt["peak_eflops"], abs=0.01)
    # the planner: MT-NLG's layout fits an 80 GB A100 with activation checkpointing, not without
    spec = preset("mt-nlg-530b")
    fit = Layout(t=8, p=35, d=16, recompute="full", zero=1)
    assert max(r.total for r in memory_per_rank(spec, fit)) < 80e9
    assert max(r.total for r in memory_per_rank(spec, Layout(t=8, p=35, d=16, zero=1))) > 80e9
    # its predicted per-GPU throughput (hardware FLOPs, with recompute) is near the published 126 TFLOP/s
    T = step_time(spec, fit, Cluster())
    hw_tflops = T.flops * 8 / 6 / T.total / 4480 / 1e12
    assert 90 < hw_tflops < 160


def test_search_ranks_feasible_layouts_and_explains():
    c = Cluster(gpus_per_node=8, gpu_memory=80e9)
    entries = plan(preset("gpt3-175b"), 1024, c)
    assert all(e.fits and e.layout.t <= 8 and e.layout.n_gpus == 1024 for e in entries)
    assert [e.time.total for e in entries] == sorted(e.time.total for e in entries)
    assert any((e.layout.t, e.layout.p) == (8, 16) for e in entries)     # Narayanan et al. 2021's choice fits
    with pytest.raises(PlanError, match=r"smallest need is [0-9.]+ GB per GPU") as info:
        plan(preset("gpt3-175b"), 8, c)
    assert info.value.smallest_memory > 80e9


def test_cli(capsys, tmp_path):
    assert labkit_main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpus-per-node", "8",
                        "--gpu-memory", "80", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "feasible layouts" in out and "Why t=" in out and "rule 1" in out and "intra-node" in out
    assert labkit_main(["plan", "--model", "mt-nlg-530b", "--gpus", "4480", "--layout", "t=8,p=35,d=16",
                        "--recompute", "full", "--no-sp"]) == 0
    assert "rank  34" in capsys.readouterr().out
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"name": "tiny", "n_layer": 4, "hidden": 256, "n_head": 4, "vocab_size": 1000,
                                "seq_len": 128, "global_batch": 8}))
    assert labkit_main(["plan", "--model", str(path), "--gpus", "8"]) == 0
    assert "tiny" in capsys.readouterr().out
    partial, no_batch = tmp_path / "partial.json", tmp_path / "no_batch.json"
    partial.write_text(json.dumps({"name": "p", "n_layer": 4}))
    no_batch.write_text(json.dumps({"name": "nb", "n_layer": 4, "hidden": 256, "n_head": 4, "vocab_size": 1000,
                                    "seq_len": 128}))
    for argv, msg in [(["--model", "gpt3-175b", "--gpus", "8"], "smallest need is"),
                      (["--model", "nope", "--gpus", "8"], "unknown model 'nope'"),
                      (["--layers", "2", "--gpus", "8"], "missing --hidden"),
                      (["--model", "gpt3-175b", "--gpus", "64", "--layout", "t=8,p=4,d=4"], "must equal --gpus 64"),
                      (["--model", "gpt3-175b", "--gpus", "0"], "--gpus must be >= 1"),
                      (["--model", str(tmp_path / "missing.json"), "--gpus", "8"], "cannot read model JSON"),
                      *[(["--model", "gpt3-175b", "--gpus", "8", "--gpu-memory", v],
                         f"--gpu-memory must be a finite number > 0, got {float(v)}")
                        for v in ("nan", "inf", "0", "-1")],
                      (["--model", str(partial), "--gpus", "8"], "missing fields hidden, n_head, vocab_size, seq_len, "
                                                                   "global_batch (required: n_layer, hidden,"),
                      (["--model", str(no_batch), "--gpus", "8"], "missing field global_batch (required:"),
                      (["--layers", "2", "--hidden", "64", "--heads", "2", "--vocab", "100", "--seq", "16",
                        "--gpus", "8"], "missing --global-batch")]:
        assert labkit_main(["plan", *argv]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and msg in err and "Traceback" not in err, (out, err)
        assert err.count("\n") == 1, err
    # --global-batch completes a JSON model without one
    assert labkit_main(["plan", "--model", str(no_batch), "--gpus", "8", "--global-batch", "8", "--top", "1"]) == 0
    assert "global batch 8" in capsys.readouterr().out


def test_in_flight_units_equal_labkit_schedules():
    """plan.memory's in_flight_units, stage_in_flight and interleaved_group, and check_layout's
    rounds rule, equal what labkit's GPipe, 1F1B and interleaved schedules do, counted from their
    actions, for K = 2..5, M from 1 to 3K (and 8), v = 1..3."""
    from labkit.pipeline import schedules as sch

    def peak(actions):
        live = top = 0
        for a in actions:
            live += (a.kind == "F") - (a.kind == "B")
            top = max(top, live)
        return top
    spec = ModelSpec(name="x", n_layer=24, hidden=8, n_head=2, vocab_size=16, seq_len=4, global_batch=64)
    for K in (2, 3, 4, 5):
        for M in sorted({1, 2, K - 1, K, K + 1, 2 * K - 1, 2 * K, 2 * K + 1, 3 * K, 8} - {0}):
            for v, name in ((1, "1f1b"), (1, "gpipe"), (2, "interleaved"), (3, "interleaved")):
                lay = Layout(p=K, v=v, M=M, schedule=name)
                try:      # the planner refuses exactly the interleaved M that the schedule refuses
                    s = (sch.gpipe_schedule(K, M) if name == "gpipe" else sch.one_f_one_b_schedule(K, M) if v == 1
                         else sch.interleaved_schedule(K, M, v))
                except sch.ScheduleError:
                    with pytest.raises(ValueError, match="rounds"):
                        plan_memory.check_layout(spec, lay)
                    continue
                if K * v <= spec.n_layer:
                    plan_memory.check_layout(spec, lay)
                    if v > 1:
                        assert plan_memory.interleaved_group(K, M) == sch.interleaved_group(K, M)
                assert [peak(s[r]) for r in range(K)] == [plan_memory.in_flight_units(lay, M, r) for r in range(K)], \
                    (K, M, v, name)
                first = peak([a for a in s[0] if a.stage == 0])
                last = peak([a for a in s[K - 1] if a.stage == K * v - 1])
                assert (first, last) == (plan_memory.stage_in_flight(lay, M, "first"),
                                         plan_memory.stage_in_flight(lay, M, "last")), (K, M, v, name)


@pytest.mark.parametrize("layout", ["t=8,p=8,d=16,v=4", "t=16,p=4,d=16"])
def test_the_printed_step_breakdown_adds_up(layout, capsys):
    """A learner adds the parts: TP lies inside compute (said so), the optimizer step is a part."""
    import re
    assert labkit_main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--layout", layout]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("predicted step"))
    total = float(re.search(r"predicted step ([\d.]+) s =", line).group(1))
    head = line.split(";")[0].replace(re.search(r"\(of it [^)]*\)", line).group(0), "")
    parts = [float(x) for x in re.findall(r"[a-zA-Z]+ ([\d.]+)", head.split("=", 1)[1])]
    assert len(parts) == 6 and abs(sum(parts) - total) <= 0.011, line


def test_no_higher_zero_stage_advice_at_zero_3(capsys):
    assert labkit_main(["plan", "--model", "gpt3-175b", "--gpus", "8", "--zero", "3"]) == 2
    err = capsys.readouterr().err
    assert "fits no layout" in err and "ZeRO stage" not in err.split(";")[-1], err
