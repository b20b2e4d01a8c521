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
