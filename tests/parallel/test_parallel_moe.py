"""MoE on a grid: attention TP over t, experts over EP = the DP group, equal to one device."""
import pytest
import torch

from labkit.dist import launch, make_grid
from labkit.model import GPTConfig
from labkit.moe import MoEGPT
from labkit.moe.model import moe_config_for, total_aux_loss
from labkit.parallel import ParallelMoEGPT

B, S, LR, M = 8, 8, 0.1, 2
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=S, bias=False)


def moe_cfg(d):
    return moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=32,
                          aux_loss_coeff=1e-2, token_groups=d * M)


def batches(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, CFG.vocab_size, (B, S), generator=g),
             torch.randint(0, CFG.vocab_size, (B, S), generator=g)) for _ in range(n)]


def reference(d, steps):
    model = MoEGPT(CFG, moe_cfg(d), moe_layer_freq=2, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for x, y in batches(steps):
        opt.zero_grad()
        loss, stats = model(x, y)
        loss = loss + total_aux_loss(stats)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(ctx, t, d, steps, bug):
    grid = make_grid(ctx, tp=t, pp=1, dp=d)
    if bug == "average_experts":          # injected: experts treated as replicated (broadcast, all-reduced)
        import labkit.parallel.moe as pmoe
        pmoe.expert_param_names = lambda model: set()
    pm = ParallelMoEGPT(MoEGPT(CFG, moe_cfg(d), moe_layer_freq=2, seed=0), grid, M, bucket_cap_mb=0.01)
    pm.make_optimizer("sgd", LR)
    out = {"losses": [], "grads": [], "tp_rank": grid.tp_rank}
    for x, y in batches(steps):
        pm.zero_grad()
        out["losses"].append(pm.train_step(x, y))
        out["grads"].append(pm.gather_full("grad"))
        pm.optimizer.step()
    out["params"] = pm.gather_full("param")
    return out


def compare(out, steps, d):
    ref_losses, ref_grads, ref_params = reference(d, steps)
    mine = [r for r in out if r["tp_rank"] == 0]
    for step in range(steps):
        loss = sum(r["losses"][step] for r in mine) / len(mine)
        assert abs(loss - ref_losses[step]) < 1e-5
        full = {}
        for r in mine:
            full.update(r["grads"][step])
        assert full.keys() == ref_grads[step].keys()
        bad = [k for k in full if not torch.allclose(full[k], ref_grads[step][k], rtol=1e-5, atol=1e-6)]
        assert not bad, f"step {step}: gradients differ for {bad}"
    full = {}
    for r in mine:
        full.update(r["params"])
    bad = [k for k in full if not torch.allclose(full[k], ref_params[k], rtol=1e-5, atol=1e-6)]
    assert not bad, f"parameters differ: {bad}"


def test_moe_tp2_ep2_equals_single_device():
    out = launch(_worker, 4, 2, 2, 3, None, backend="gloo")
    compare(out, 3, 2)


def test_moe_check_catches_averaged_experts():
    out = launch(_worker, 2, 1, 2, 1, "average_experts", backend="gloo")
    with pytest.raises(AssertionError):
        compare(out, 1, 2)


def test_moe_errors_before_communication():
    from labkit.parallel import check_layout
    with pytest.raises(ValueError, match="n_routed_experts E=4 must be divisible by the EP size 3"):
        check_layout(CFG, 3, 1, 1, 3, n_experts=4)


def test_ep_smaller_than_dp_is_refused():
    """ParallelMoEGPT shards the experts over the whole DP group; a grid folding EP onto part of it
    (ep < d: expert data parallelism, which it does not average over) is refused before any rank
    communicates."""
    from labkit.grid import ProcessGrid
    with pytest.raises(ValueError, match=r"build the grid with ep = dp = 4, got ep=2"):
        ParallelMoEGPT(MoEGPT(CFG, moe_cfg(4), moe_layer_freq=2, seed=0), ProcessGrid(dp=4, ep=2, rank=0), M)


# ParallelGPT's MoE x PP x TP at (t, p, d) = (2, 2, 2), EP = d = 2, with sequence parallelism and full
# recompute: every balance loss the layer has (Switch aux, z, sequence-wise, device-level) and the
# aux-loss-free bias, against one device routing the global batch in d*M groups
MOE_ALL = dict(n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=32, aux_loss_coeff=1e-2, z_loss_coeff=1e-3,
               seq_aux_loss_coeff=1e-2, device_loss_coeff=1e-2, n_devices=2, expert_bias=True, bias_update_rate=0.05)


def moe_all(d):
    return moe_config_for(CFG, token_groups=d * M, **MOE_ALL)


def reference_3d(d, steps, opt="sgd", lr=LR):
    model = MoEGPT(CFG, moe_all(d), moe_layer_freq=2, seed=0)
    o = torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd" else torch.optim.Adam(model.parameters(), lr=lr,
                                                                                        eps=1e-6)
    hist = []
    for x, y in batches(steps):
        o.zero_grad()
        loss, stats = model(x, y)
        loss = loss + total_aux_loss(stats)
        loss.backward()
        for layer, s in zip(model.moe_layers(), stats):
            layer.update_bias(s.tokens_per_expert)
        hist.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                     "bias": {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}})
        o.step()
    return hist, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker_3d(ctx, t, p, d, sp, recompute, steps, opt, lr, zero, bug, cp=1):
    from labkit.comm import all_reduce
    from labkit.parallel import ParallelGPT
    if bug == "no_tp_router_sum":     # injected: the router's gradient not summed over TP under SP
        import labkit.parallel.moe_pipeline as mpp
        mark = mpp.mark_sequence_parallel
        mpp.mark_sequence_parallel = lambda *ps: mark(*[q for q in ps if q.dim() != 2 or q.shape[0] != 4])
    if bug == "whole_loss_per_rank":  # injected: every TP rank attaches the whole balance loss, not 1/t of it
        import labkit.parallel.moe_pipeline as mpp
        init = mpp.ParallelMoEBlock.__init__

        def whole(self, *a, **k):
            init(self, *a, **k)
            self.aux_loss_share = 1.0
        mpp.ParallelMoEBlock.__init__ = whole
    if bug == "loads_dp_only":        # injected: the bias loads summed over DP only (each TP rank's S/t tokens)
        import labkit.parallel.gpt as pgpt
        finish = pgpt.finish_step
        pgpt.finish_step = lambda stages, dp_group=None, tp_group=None, **kw: finish(stages, dp_group, **kw)
    if bug == "no_cp_expert_sum":     # injected: the local experts' gradients not summed over CP
        import labkit.parallel.gpt as pgpt
        pgpt._allreduce_grads = lambda params, group: None
    if bug == "no_cp_router_sum":     # injected: the router's gradient (replicated over CP) not averaged over CP
        import labkit.data_parallel.ddp as ddp
        init = ddp.DistributedDataParallel.__init__

        def local_router(self, module, group, *a, expert_params=(), **k):
            routers = [n for n, q in module.named_parameters() if n.endswith("router.weight")]
            init(self, module, group, *a, expert_params=[*expert_params, *routers], **k)
        ddp.DistributedDataParallel.__init__ = local_router
    if bug == "share_1_over_t_cp":    # injected: every rank attaches 1/(t cp) of the balance loss
        import labkit.parallel.moe_pipeline as mpp
        init = mpp.ParallelMoEBlock.__init__

        def shared(self, *a, **k):
            init(self, *a, **k)
            self.aux_loss_share = self.aux_loss_share / cp
        mpp.ParallelMoEBlock.__init__ = shared
    if bug == "loads_no_cp":          # injected: the bias loads summed over DP only, not CP
        import labkit.parallel.gpt as pgpt
        finish = pgpt.finish_step
        pgpt.finish_step = lambda stages, dp_group=None, tp_group=None, **kw: finish(
            stages, grid.dp_group if grid.dp > 1 else None, tp_group, **kw)
    grid = make_grid(ctx, tp=t, pp=p, dp=d, cp=cp)
    pg = ParallelGPT(MoEGPT(CFG, moe_all(d), moe_layer_freq=2, seed=0), grid, "1f1b", M, zero=zero,
                     bucket_cap_mb=0.002, sequence_parallel=sp, recompute=recompute)
    pg.make_optimizer(opt, lr, **({"eps": 1e-6} if opt == "adam" else {}))
    keep = grid.tp_rank == 0
    out = {"hist": [], "keep": keep, "last": pg.has_last_stage, "dp_rank": grid.dp_rank}
    for x, y in batches(steps):
        pg.zero_grad()
        loss = pg.train_step(x, y)
        aux = torch.tensor([pg.take_aux_loss()], dtype=torch.float64)
        all_reduce(aux, grid.pp_group)
        grads = pg.gather_full("grad")
        bias = {pg.reference_name(m, n): b.clone() for m in pg.modules for n, b in m.named_buffers()
                if n.endswith("expert_bias")}
        out["hist"].append({"loss": None if loss is None else loss + float(aux), "grads": grads, "bias": bias})
        if zero == 1:
            pg.optimizer.reduce_gradients()
        pg.optimizer.step()
    out["params"] = pg.gather_full("param")
    return out


def check_3d(out, d, steps, opt="sgd", lr=LR):
    hist, ref_params = reference_3d(d, steps, opt, lr)
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
    for step in range(steps):
        ls = [r["hist"][step]["loss"] for r in out if r["last"] and r["keep"]]
        assert abs(sum(ls) / len(ls) - hist[step]["loss"]) < 1e-5, (step, ls, hist[step]["loss"])
        for what in ("grads", "bias"):
            got = {}
            for r in out:                  # every rank's (TP ranks' SP-summed copies must agree too)
                for n, g in r["hist"][step][what].items():
                    assert n not in got or close(got[n], g), f"step {step}: ranks disagree on {what} {n}"
                    got[n] = g
            want = hist[step][what]
            assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
            bad = [n for n in want if not close(got[n], want[n])]
            assert not bad, f"step {step}: {what} differ for {bad}"
    got = {}
    for r in out:
        got.update(r["params"])
    bad = [n for n in ref_params if not close(got[n], ref_params[n])]
    assert got.keys() == ref_params.keys() and not bad, f"parameters differ after {steps} steps: {bad}"


def run_3d(sp, recompute, steps=3, opt="sgd", lr=LR, zero=0, bug=None, grid=(2, 2, 2, 1)):
    t, p, d, cp = grid
    return launch(_worker_3d, t * p * d * cp, t, p, d, sp, recompute, steps, opt, lr, zero, bug, cp,
                  backend="gloo")


@pytest.mark.parametrize("sp,recompute,zero", [(True, "none", 0), (False, "full", 0), (True, "full", 0),
                                               (True, "none", 2), (True, "full", 3)],
                         ids=["sp", "full", "sp-full", "sp-zero2", "sp-full-zero3"])
def test_moe_3d_sp_and_full_recompute_equal_single_device(sp, recompute, zero):
    """(t, p, d) = (2, 2, 2), EP = 2: with SP each TP rank routes and dispatches its S/t tokens (router,
    experts, LayerNorms summed over TP; balance losses on the logits all-gathered over TP, 1/t per
    rank; bias loads summed over TP and DP); full recompute checkpoints the MoE block (loads and
    losses counted once). Loss, every gradient and the bias at each of 3 SGD steps, and the
    parameters after them, equal one device (ZeRO-2/3: the local experts' TP sum outside the hooks)."""
    check_3d(run_3d(sp, recompute, zero=zero), 2, 3)


def test_moe_3d_sp_full_recompute_adam():
    """SP + full recompute with 4 Adam steps (lr 1e-3, eps 1e-6): the parameters equal one device's."""
    check_3d(run_3d(True, "full", steps=4, opt="adam", lr=1e-3), 2, 4, "adam", 1e-3)


@pytest.mark.parametrize("bug", ["no_tp_router_sum", "whole_loss_per_rank", "loads_dp_only"])
def test_moe_3d_sp_checks_catch_bugs(bug):
    with pytest.raises(AssertionError):
        check_3d(run_3d(True, "none", steps=2, bug=bug), 2, 2)


def test_moe_sp_refuses_capacity():
    from labkit.grid import ProcessGrid
    from labkit.parallel import ParallelGPT
    cfg = moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, capacity_factor=1.0, token_groups=2 * M)
    with pytest.raises(ValueError, match=r"capacity_factor=1.0\) decides over the whole group"):
        ParallelGPT(MoEGPT(CFG, cfg, moe_layer_freq=2, seed=0), ProcessGrid(tp=2, pp=2, dp=2, rank=0), "1f1b", M,
                    sequence_parallel=True)


# context parallelism with MoE: (t, cp, p, d) = (1, 2, 2, 2) and, with SP, (2, 2, 1, 2); EP = d per CP rank
CP_GRIDS = {"t1-cp2-p2-d2": ((1, 2, 2, 2), False), "t2-cp2-p1-d2-sp": ((2, 1, 2, 2), True)}


@pytest.mark.parametrize("name,zero", [("t1-cp2-p2-d2", 0), ("t2-cp2-p1-d2-sp", 0), ("t2-cp2-p1-d2-sp", 2)],
                         ids=["t1-cp2-p2-d2", "t2-cp2-p1-d2-sp", "t2-cp2-p1-d2-sp-zero2"])
def test_moe_cp_equals_single_device(name, zero):
    """CP x MoE: each CP rank routes its S/cp tokens (S/(cp t) with SP) and dispatches them over its
    EP (= DP) group; the balance losses on the logits gathered over TP and CP, the whole loss (1/t
    with SP) on every rank; the router averaged over the d cp ranks, the local experts' gradients
    summed over CP; the bias loads summed over TP, CP and DP. Loss, every gradient and the bias at
    each of 2 SGD steps, and the parameters after them, equal one device."""
    grid, sp = CP_GRIDS[name]
    check_3d(run_3d(sp, "none", steps=2, zero=zero, grid=grid), 2, 2)


def test_moe_cp_full_recompute_adam():
    """(t, cp, p, d) = (1, 2, 2, 2) with full recompute (the CP gathers of the balance losses run again in
    backward) and 3 Adam steps (lr 1e-3, eps 1e-6): the parameters equal one device's."""
    check_3d(run_3d(False, "full", steps=3, opt="adam", lr=1e-3, grid=(1, 2, 2, 2)), 2, 3, "adam", 1e-3)


@pytest.mark.parametrize("bug", ["no_cp_expert_sum", "no_cp_router_sum", "share_1_over_t_cp", "loads_no_cp"])
def test_moe_cp_checks_catch_bugs(bug):
    with pytest.raises(AssertionError):
        check_3d(run_3d(True, "none", steps=2, bug=bug, grid=(2, 1, 2, 2)), 2, 2)


def test_moe_cp_refuses_capacity():
    from labkit.grid import ProcessGrid
    from labkit.parallel import ParallelGPT
    cfg = moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, capacity_factor=1.0, token_groups=2 * M)
    with pytest.raises(ValueError, match=r"context parallelism \(cp=2\).*capacity_factor=1.0\) decides over the whole"):
        ParallelGPT(MoEGPT(CFG, cfg, moe_layer_freq=2, seed=0), ProcessGrid(tp=1, pp=2, dp=2, cp=2, rank=0), "1f1b", M)
