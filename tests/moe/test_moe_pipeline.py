"""The MoE GPT under pipeline parallelism (GPipe, 1F1B, 1F1B with recomputation, interleaved) on
pp=2 x dp=2 ranks equals single-device training: microbatch LM losses, aux losses, every
parameter gradient, the aux-loss-free bias and the parameters after 3 SGD steps. An aux loss
scaled by 1 instead of 1/M, and one not attached at all, are caught."""
import pytest
import torch

import labkit.moe.pipeline as mp
import labkit.parallel.moe_pipeline as mpp
from labkit.comm import all_reduce
from labkit.dist import launch, make_grid
from labkit.model import GPTConfig, lm_loss
from labkit.moe.model import MoEGPT, moe_config_for, total_aux_loss
from labkit.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

RTOL, ATOL = 1e-5, 1e-6
CFG = GPTConfig(n_layer=4, n_embd=16, n_head=2, block_size=8, ffn_mult=2)
MOE = moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, capacity_factor=1.0, aux_loss_coeff=0.1,
                     z_loss_coeff=1e-3, expert_bias=True, bias_update_rate=0.05)
PP, DP, M, B, S, STEPS, LR = 2, 2, 2, 4, 8, 3, 0.5      # B sequences per DP rank, M microbatches
RUNS = [("gpipe", False), ("1f1b", False), ("1f1b", True), ("interleaved", False)]


def _model():
    return MoEGPT(CFG, MOE, moe_layer_freq=2, seed=7)          # blocks 1 and 3 are MoE


def _batch(step, d):
    g = torch.Generator().manual_seed(1000 * step + d)
    return torch.randint(0, 256, (B, S), generator=g), torch.randint(0, 256, (B, S), generator=g)


def _reference():
    model, out = _model(), []
    for step in range(STEPS):
        model.zero_grad(set_to_none=True)
        lms, auxes, loads = [], [], None
        for d in range(DP):
            x, y = _batch(step, d)
            for xm, ym in zip(x.chunk(M), y.chunk(M)):
                lm, stats = model(xm, ym)
                aux = total_aux_loss(stats)
                ((lm + aux) / (M * DP)).backward()
                lms.append(lm.item())
                auxes.append([s.aux_loss.item() for s in stats])
                l = torch.stack([s.tokens_per_expert for s in stats])
                loads = l if loads is None else loads + l
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for layer, load in zip(model.moe_layers(), loads):
            layer.update_bias(load)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        out.append({"lm": lms, "aux": auxes, "grads": grads,
                    "bias": [l.router.expert_bias.clone() for l in model.moe_layers()]})
    out.append({n: t.detach().clone() for n, t in model.state_dict().items()})
    return out


def _worker(ctx, aux_scale_bug, runs):
    grid = make_grid(ctx, pp=PP, dp=DP)
    K, k, d = PP, grid.pp_rank, grid.dp_rank
    res = {}
    for name, recompute in runs:
        v = 2 if name == "interleaved" else 1
        stages = mpp.moe_stages_for_rank(_model(), K, v, k, M)
        if aux_scale_bug is not None:
            for st in stages:
                st.aux_loss_scale = aux_scale_bug
        ids = [s for s in range(K * v) if s % K == k]
        wrapped = [PipelineStage(st, sid, K * v, group=grid.pp_group) for st, sid in zip(stages, ids)]
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]
        sched = cls(wrapped if v > 1 else wrapped[0], M, lm_loss, recompute=recompute)
        hist = []
        for step in range(STEPS):
            for st in stages:
                st.zero_grad(set_to_none=True)
            x, y = _batch(step, d)
            losses = []
            sched.step(x if k == 0 else None, target=y if k == K - 1 else None, losses=losses)
            aux = {st.layer_ids[0]: list(st.aux_values) for st in stages}
            params = [(mpp.moe_param_name(st, n), p) for st in stages for n, p in st.named_parameters()]
            for _, p in params:                                    # data parallel: mean of the DP grads
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                all_reduce(p.grad, grid.dp_group)
                p.grad /= DP
            grads = {n: p.grad.clone() for n, p in params}
            mp.finish_step(stages, grid.dp_group)
            with torch.no_grad():
                for _, p in params:
                    p -= LR * p.grad
            hist.append({"lm": [float(l) for l in losses], "aux": aux, "grads": grads,
                         "bias": {lid: l.router.expert_bias.clone() for st in stages
                                  for lid, l in st.moe_layers().items()}})
        hist.append({mpp.moe_param_name(st, n): t.detach().clone() for st in stages
                     for n, t in st.state_dict().items()})
        res[(name, recompute)] = hist
    return {"pp_rank": k, "dp_rank": d, "runs": res}


def _check(ranks, ref, run):
    close = lambda a, b: torch.allclose(a, b, rtol=RTOL, atol=ATOL)  # noqa: E731
    moe_ids = [1, 3]
    for step in range(STEPS):
        for rk in ranks:
            h, d = rk["runs"][run][step], rk["dp_rank"]
            if rk["pp_rank"] == PP - 1:                          # LM losses of this DP rank's microbatches
                assert torch.allclose(torch.tensor(h["lm"]), torch.tensor(ref[step]["lm"][d * M:(d + 1) * M]),
                                      rtol=RTOL, atol=ATOL), f"{run} step {step}: microbatch LM losses"
            for name, g in h["grads"].items():
                assert close(g, ref[step]["grads"][name]), f"{run} step {step} rank {rk}: grad of {name}"
            for lid, b in h["bias"].items():
                assert torch.equal(b, ref[step]["bias"][moe_ids.index(lid)]), f"{run} step {step}: bias of block {lid}"
        # every MoE layer's aux loss counted exactly once per microbatch (M per step on each DP rank)
        counted = {}
        for rk in ranks:
            for vals in rk["runs"][run][step]["aux"].values():
                counted[rk["dp_rank"]] = counted.get(rk["dp_rank"], 0) + len(vals)
        assert counted == {d: M * len(moe_ids) for d in range(DP)}, f"{run} step {step}: aux losses counted {counted}"
    for rk in ranks:
        for name, t in rk["runs"][run][STEPS].items():
            assert close(t.float(), ref[STEPS][name].float()), f"{run}: {name} after {STEPS} SGD steps"


@pytest.fixture(scope="module")
def results():
    return launch(_worker, PP * DP, None, RUNS, timeout=60), _reference()


@pytest.mark.parametrize("run", RUNS, ids=[f"{n}{'-recompute' if r else ''}" for n, r in RUNS])
def test_moe_pipeline_equals_single_device(results, run):
    ranks, ref = results
    _check(ranks, ref, run)


def test_aux_loss_scaled_by_one_is_caught(results):
    _, ref = results
    ranks = launch(_worker, PP * DP, 1.0, [("1f1b", False)], timeout=60)
    with pytest.raises(AssertionError, match="grad of"):
        _check(ranks, ref, ("1f1b", False))


def test_aux_loss_not_attached_is_caught(results, monkeypatch):
    _, ref = results
    # where the stages look it up
    monkeypatch.setattr(mpp, "attach_aux_loss", lambda x, aux, scale, on_backward=None: x)
    ranks = launch(_worker, PP * DP, None, [("gpipe", False)], timeout=60)
    with pytest.raises(AssertionError, match="grad of"):
        _check(ranks, ref, ("gpipe", False))
