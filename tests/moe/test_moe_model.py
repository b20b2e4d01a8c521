"""MoE GPT (single device and expert parallel), the lab and bench commands."""
from dataclasses import replace

import pytest
import torch

from labkit.dist import launch
from labkit.model import Block, GPTConfig
from labkit.moe import (
    MoEBlock,
    MoEGPT,
    moe_config_for,
    sync_replicated_grads,
    to_expert_parallel,
    total_aux_loss,
)
from labkit.moe.expert_parallel import all_reduce_loads

CFG = GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, ffn_mult=2)
MOE = moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, capacity_factor=1.0, aux_loss_coeff=0.1,
                     z_loss_coeff=1e-3, n_shared_experts=1, expert_bias=True, bias_update_rate=0.05)


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 256, (4, 16), generator=g), torch.randint(0, 256, (4, 16), generator=g)


def test_moe_gpt_every_other_layer_and_aux():
    model = MoEGPT(replace(CFG, n_layer=4), MOE, moe_layer_freq=2, seed=0)
    kinds = [type(b) for b in model.blocks]
    assert kinds == [Block, MoEBlock, Block, MoEBlock]
    assert all(not hasattr(b, "mlp") for b in model.blocks if isinstance(b, MoEBlock))
    loss, stats = model(*_batch(0))
    assert len(stats) == 2 and loss.dim() == 0
    assert torch.equal(total_aux_loss(stats), stats[0].aux_loss + stats[1].aux_loss)
    assert all(int(s.tokens_per_expert.sum()) == 64 * 2 for s in stats)
    logits, _ = model(_batch(0)[0])
    assert logits.shape == (4, 16, 256)
    # deterministic from the seed
    again = MoEGPT(replace(CFG, n_layer=4), MOE, moe_layer_freq=2, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def _sgd_steps(model, P, rank, group, steps=3, lr=0.1):
    out = []
    rows = 4 // P
    for step in range(steps):
        x, y = _batch(step)
        x, y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        model.zero_grad(set_to_none=True)
        loss, stats = model(x, y)
        ((loss + total_aux_loss(stats)) / P).backward()
        loads = torch.stack([s.tokens_per_expert for s in stats])
        if group is not None:
            sync_replicated_grads(model, group)
            loads = all_reduce_loads(loads, group)
        out.append({"loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        for layer, load in zip(model.moe_layers(), loads):
            layer.update_bias(load)
    out.append({n: t.clone() for n, t in model.state_dict().items()})
    return out


def _ep_gpt_worker(ctx):
    model = MoEGPT(CFG, MOE, moe_layer_freq=1, seed=3)
    to_expert_parallel(model, ctx.group, ctx.rank, ctx.world_size)
    return _sgd_steps(model, ctx.world_size, ctx.rank, ctx.group)


@pytest.mark.parametrize("P", [2, 4])
def test_ep_moe_gpt_matches_single_device(P):
    ep = launch(_ep_gpt_worker, P)
    ref = _sgd_steps(MoEGPT(CFG, replace(MOE, token_groups=P), moe_layer_freq=1, seed=3), 1, 0, None)
    El = MOE.n_routed_experts // P

    def gname(name, r):
        if ".experts." not in name:
            return name
        head, tail = name.split(".experts.")
        i, rest = tail.split(".", 1)
        return f"{head}.experts.{r * El + int(i)}.{rest}"

    for step in range(3):
        assert sum(ep[r][step]["loss"] for r in range(P)) / P == pytest.approx(ref[step]["loss"], rel=1e-6)
        for r in range(P):
            for name, g in ep[r][step]["grads"].items():
                torch.testing.assert_close(g, ref[step]["grads"][gname(name, r)], rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"step {step} rank {r} {name}: {m}")
    for r in range(P):
        for name, v in ep[r][3].items():
            torch.testing.assert_close(v, ref[3][gname(name, r)], rtol=1e-5, atol=1e-6)


def test_lab_runs_and_matches():
    from labkit.labs.moe import main
    threads = torch.get_num_threads()
    try:
        assert main(["--ep", "2", "--steps", "3", "--balance-steps", "3", "--batch", "4", "--seq", "16",
                     "--n-embd", "16", "--n-layer", "2", "--experts", "4", "--no-plots",
                     "--out", "/tmp/labkit-moe-test"]) == 0
    finally:
        torch.set_num_threads(threads)


def test_lab_rejects_bad_sizes(capsys):
    from labkit.labs.moe import main
    assert main(["--ep", "4", "--batch", "6"]) == 2
    assert capsys.readouterr().err.startswith("error: --batch 6 must be divisible by --ep 4")
    assert main(["--ep", "0"]) == 2
    assert capsys.readouterr().err == "error: --ep must be >= 1, got 0\n"
    assert main(["--top-k", "9"]) == 2
    assert capsys.readouterr().err == "error: --top-k 9 must be in [1, --experts 8]\n"


def test_moe_gpt_errors():
    with pytest.raises(ValueError, match="moe_layer_freq must be >= 1, got 0"):
        MoEGPT(CFG, MOE, moe_layer_freq=0)
    with pytest.raises(ValueError, match="MoEConfig.n_embd=32 must equal GPTConfig.n_embd=16"):
        MoEGPT(CFG, replace(MOE, n_embd=32))


def test_bench_runs_and_methods_agree(capsys):
    from labkit.bench.moe import bench_one, main
    r = bench_one(64, 4, 8, 2, 1.0, repeat=1)          # asserts the two dispatches agree
    assert r["bytes_dense"] == 2 * 64 * 4 * r["C"] * 4 + 4 * r["C"] * 8 * 4 + 64 * 8 * 4
    threads = torch.get_num_threads()
    try:
        assert main(["--tokens", "32", "--experts", "4", "--repeat", "1", "--hidden", "8"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert "sort ms" in capsys.readouterr().out


def test_moe_gpt_padding_mask_reaches_every_moe_layer(one_thread):
    """MoEGPT(idx, targets, mask): with right padding (causal attention: real tokens never see
    it) the balance losses, loads and LM loss (targets -100 at padding) do not depend on what
    the padded positions hold; without the mask the balance losses do."""
    model = MoEGPT(replace(CFG, n_layer=2), replace(MOE, capacity_factor=None), moe_layer_freq=1, seed=0)
    idx, y = _batch(0)
    mask = torch.ones(4, 16, dtype=torch.bool)
    mask[1, 10:] = mask[3, 4:] = False
    y = y.masked_fill(~mask, -100)
    other = idx.masked_fill(~mask, 7)
    results = []
    for ids in (idx, other):
        loss, stats = model(ids, y, mask=mask)
        results.append((loss, [s.losses for s in stats], [s.tokens_per_expert for s in stats]))
    (l0, losses0, loads0), (l1, losses1, loads1) = results
    torch.testing.assert_close(l0, l1, rtol=1e-6, atol=1e-7)
    for a, b in zip(losses0, losses1):
        assert set(a) == {"aux", "z"}
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-8)
    assert all(torch.equal(a, b) for a, b in zip(loads0, loads1))
    assert all(int(load.sum()) == int(mask.sum()) * 2 for load in loads0)    # k = 2 slots per real token
    _, s0 = model(idx, y)
    _, s1 = model(other, y)
    assert not torch.allclose(s0[0].losses["aux"], s1[0].losses["aux"])
