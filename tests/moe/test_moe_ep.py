"""Expert parallelism equals the single-device MoE layer (forward, input grads, router and
expert grads, parameters after 3 SGD steps), the uneven all-to-all, and its errors."""
import re
from dataclasses import replace

import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import RankError, launch
from labkit.moe import MoEConfig, MoELayer
from labkit.moe.expert_parallel import ExpertParallelMoE, all_reduce_loads, all_to_all_uneven, sync_replicated_grads

RTOL, ATOL = 1e-5, 1e-6
H = 8


def _data(P, T_r, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(P * T_r, H, generator=g), torch.randn(P * T_r, H, generator=g)


def _dense(cfg, seed=0):
    torch.manual_seed(seed)
    return MoELayer(cfg)


def _ep_worker(ctx, cfg, T_r, steps, lr, mask=None):
    P, r = ctx.world_size, ctx.rank
    layer = ExpertParallelMoE.from_dense(_dense(replace(cfg, token_groups=P)), ctx.group, r, P)
    out = []
    for step in range(steps):
        x, g = _data(P, T_r, step)
        x = x[r * T_r:(r + 1) * T_r].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        with CommLog() as log:
            y, stats = layer(x, None if mask is None else mask[r * T_r:(r + 1) * T_r])
            loss = ((y * g[r * T_r:(r + 1) * T_r]).sum() + stats.aux_loss) / P
            loss.backward()
        sync_replicated_grads(layer, ctx.group)
        loads = all_reduce_loads(stats.tokens_per_expert, ctx.group)
        out.append({
            "y": y.detach(), "x_grad": x.grad, "dropped": stats.dropped_fraction,
            "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
            "a2a": [rec.nbytes for rec in log.of("all_to_all")],
        })
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
        layer.update_bias(loads)
    out.append({n: t.detach().clone() for n, t in layer.state_dict().items()})
    return out


def _reference(cfg, P, T_r, steps, lr, mask=None):
    layer = _dense(replace(cfg, token_groups=P))
    out = []
    for step in range(steps):
        x, g = _data(P, T_r, step)
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y, stats = layer(x, mask)
        ((y * g).sum() / P + stats.aux_loss).backward()
        out.append({"y": y.detach(), "x_grad": x.grad, "dropped": stats.dropped_fraction,
                    "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
        layer.update_bias(stats.tokens_per_expert)
    out.append({n: t.detach().clone() for n, t in layer.state_dict().items()})
    return out


def _global_name(name, r, El):
    """experts.{i}.x on rank r -> experts.{r*El+i}.x in the dense layer."""
    if name.startswith("experts."):
        _, i, rest = name.split(".", 2)
        return f"experts.{r * El + int(i)}.{rest}"
    return name


CASES = {
    # E=8, k=2, no capacity, aux + z loss, one shared expert
    "aux_shared": MoEConfig(n_embd=H, n_routed_experts=8, n_activated_experts=2, moe_ffn_dim=12, n_shared_experts=1,
                            aux_loss_coeff=0.1, z_loss_coeff=1e-2),
    # tokens dropped (capacity_factor 0.5), position policy, aux-loss-free bias, sigmoid + groups
    "drop_bias": MoEConfig(n_embd=H, n_routed_experts=8, n_activated_experts=2, moe_ffn_dim=12,
                           capacity_factor=0.5, drop_policy="position", expert_bias=True, bias_update_rate=0.05,
                           score_func="sigmoid", n_expert_groups=4, n_limited_groups=2, route_scale=2.0),
    # 2 tokens per rank, top-1 over 8 experts: most (rank, expert) pairs receive nothing
    "sparse_top1": MoEConfig(n_embd=H, n_routed_experts=8, n_activated_experts=1, moe_ffn_dim=12,
                             capacity_factor=1.0, aux_loss_coeff=0.1),
}


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_ep_matches_single_device(P, case):
    cfg = CASES[case]
    T_r = 2 if case == "sparse_top1" else 6
    steps, lr = 3, 0.1
    ep = launch(_ep_worker, P, cfg, T_r, steps, lr)
    ref = _reference(cfg, P, T_r, steps, lr)
    El = cfg.n_routed_experts // P
    saw_zero_split = False
    for step in range(steps):
        for r in range(P):
            got, want = ep[r][step], ref[step]
            sl = slice(r * T_r, (r + 1) * T_r)
            torch.testing.assert_close(got["y"], want["y"][sl], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(got["x_grad"], want["x_grad"][sl], rtol=RTOL, atol=ATOL)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, want["grads"][_global_name(name, r, El)], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"step {step} rank {r} grad {name}: {m}")
            saw_zero_split |= 0 in got["a2a"]
        assert sum(ep[r][step]["dropped"] for r in range(P)) / P == pytest.approx(ref[step]["dropped"])
    for r in range(P):
        for name, value in ep[r][steps].items():
            torch.testing.assert_close(value, ref[steps][_global_name(name, r, El)], rtol=RTOL, atol=ATOL)
    if case == "drop_bias":
        assert ref[0]["dropped"] > 0
        assert ref[steps]["router.expert_bias"].abs().sum() > 0
    if case == "sparse_top1":
        assert saw_zero_split


def test_ep_with_padding_mask_matches_single_device():
    """A padding mask under EP (one rank's tokens all padding): balance losses, loads and hence
    every gradient and the parameters after 3 SGD steps equal the single-device layer's."""
    cfg = replace(CASES["aux_shared"], device_loss_coeff=0.05, n_devices=2, expert_bias=True, bias_update_rate=0.05)
    P, T_r, steps, lr = 2, 6, 3, 0.1
    mask = torch.tensor([1, 1, 0, 1, 0, 1] + [0] * 6, dtype=torch.bool)
    ep = launch(_ep_worker, P, cfg, T_r, steps, lr, mask)
    ref = _reference(cfg, P, T_r, steps, lr, mask)
    for step in range(steps):
        for r in range(P):
            got, want = ep[r][step], ref[step]
            torch.testing.assert_close(got["x_grad"], want["x_grad"][r * T_r:(r + 1) * T_r], rtol=RTOL, atol=ATOL)
            for name, grad in got["grads"].items():
                torch.testing.assert_close(grad, want["grads"][_global_name(name, r, 4)], rtol=RTOL, atol=ATOL)
    for r in range(P):
        for name, value in ep[r][steps].items():
            torch.testing.assert_close(value, ref[steps][_global_name(name, r, 4)], rtol=RTOL, atol=ATOL)
    # the mask mattered: the unmasked reference ends elsewhere
    unmasked = _reference(cfg, P, T_r, steps, lr)
    assert not torch.allclose(unmasked[steps]["router.weight"], ref[steps]["router.weight"])


def test_ep_comm_bytes_match_formula():
    cfg = CASES["aux_shared"]
    P, T_r = 4, 6
    ep = launch(_ep_worker, P, cfg, T_r, 1, 0.0)
    combine_total = 0
    for r in range(P):
        a2a = ep[r][0]["a2a"]
        # forward: counts, dispatch, combine; backward: reverse of combine, reverse of dispatch
        assert len(a2a) == 5
        assert a2a[0] == cfg.n_routed_experts * 8                          # E int64 counts
        assert a2a[1] == T_r * cfg.n_activated_experts * H * 4             # no dropping: every slot is sent
        assert a2a[3] == a2a[1] and a2a[4] == a2a[2]                       # backward sends the grads back
        combine_total += a2a[2]                                            # rows this rank's experts ran
    assert combine_total == P * T_r * cfg.n_activated_experts * H * 4


def test_ep_size_must_divide_experts():
    with pytest.raises(ValueError, match="n_routed_experts=6 must be divisible by the EP size 4"):
        ExpertParallelMoE(MoEConfig(n_embd=H, n_routed_experts=6), None, 0, 4)
    with pytest.raises(ValueError, match="got token_groups=2"):
        ExpertParallelMoE(MoEConfig(n_embd=H, n_routed_experts=8, token_groups=2), None, 0, 4)


def _partial_router_grad_worker(ctx, cfg, T_r):
    P, r = ctx.world_size, ctx.rank
    layer = ExpertParallelMoE.from_dense(_dense(cfg), ctx.group, r, P)
    x, g = _data(P, T_r, 0)
    y, stats = layer(x[r * T_r:(r + 1) * T_r])
    (((y * g[r * T_r:(r + 1) * T_r]).sum() + stats.aux_loss) / P).backward()
    return layer.router.weight.grad.clone()        # BEFORE sync_replicated_grads


def test_router_grad_before_sync_is_this_ranks_tokens_only():
    """The gates multiply on the token's own rank: rows a rank computes for other ranks' tokens
    add nothing to its router gradient; the partial gradient is exactly that of its own tokens."""
    cfg, P, T_r = CASES["drop_bias"], 4, 6
    partial = launch(_partial_router_grad_worker, P, cfg, T_r)
    x, g = _data(P, T_r, 0)
    for r in range(P):
        layer = _dense(cfg)
        y, stats = layer(x[r * T_r:(r + 1) * T_r])
        (((y * g[r * T_r:(r + 1) * T_r]).sum() + stats.aux_loss) / P).backward()
        torch.testing.assert_close(partial[r], layer.router.weight.grad, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(partial[0], partial[1])


def _uneven_worker(ctx):
    sizes = [6, 9, 5, 7]
    splits = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
    r = ctx.rank
    x = torch.arange(sizes[r], dtype=torch.float32) + 100 * r
    return all_to_all_uneven(x, splits[r], group=ctx.group)


def test_uneven_all_to_all_single():
    out = launch(_uneven_worker, 4)
    sizes = [6, 9, 5, 7]
    splits = [[2, 2, 1, 1], [3, 2, 2, 2], [2, 1, 1, 1], [2, 2, 2, 1]]
    for q in range(4):
        expected = []
        for s in range(4):
            start = sum(splits[s][:q])
            expected.append(torch.arange(sizes[s], dtype=torch.float32)[start:start + splits[s][q]] + 100 * s)
        assert torch.equal(out[q], torch.cat(expected))


def _mismatch_worker(ctx):
    x = torch.zeros(4)
    out_splits = [2, 2] if ctx.rank == 0 else [1, 3]    # rank 1 expects the wrong sizes
    return all_to_all_uneven(x, [2, 2], out_splits, group=ctx.group)


def test_mismatched_splits_raise_naming_rank():
    with pytest.raises(RankError, match=r"invalid on rank\(s\) \[1\] .*rank 1: output_split_sizes \[1, 3\] do not "
                                        r"match the input_split_sizes the other ranks send \(\[2, 2\]\)"):
        launch(_mismatch_worker, 2, timeout=10)


def _bad_sum_worker(ctx):
    return all_to_all_uneven(torch.zeros(3), [2, 2], group=ctx.group)


def test_split_sum_checked_before_communication():
    with pytest.raises(RankError, match=r"input_split_sizes \[2, 2\] sum to 4 but the input has 3 rows"):
        launch(_bad_sum_worker, 2, timeout=10)


BAD_SPLITS = {   # rank 1's bad input -> the rule every rank must name
    "length": ([2, 1, 1], "rank 1: input_split_sizes has 3 entries for 2 ranks"),
    "negative": ([5, -1], r"rank 1: split sizes must be non-negative integers, got input_split_sizes \[5, -1\]"),
    "sum": ([2, 1], r"rank 1: input_split_sizes \[2, 1\] sum to 3 but the input has 4 rows"),
}


def _one_bad_rank_worker(ctx, bad_splits, early_raise):
    """Rank 1 passes bad splits; every rank reports (exception type, message, seconds)."""
    import time

    from labkit.moe import expert_parallel as ep
    if early_raise:   # the bug on purpose: the bad rank raises on its own, before any collective
        check = ep._split_problem

        def _split_problem(*a):
            problem = check(*a)
            if problem:
                raise ValueError(problem)
            return problem
        ep._split_problem = _split_problem
    t0 = time.monotonic()
    try:
        all_to_all_uneven(torch.zeros(4), bad_splits if ctx.rank == 1 else [2, 2], group=ctx.group)
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _every_rank_raised_at_once(results, rule, limit=1.5):
    for r, (kind, msg, seconds) in enumerate(results):
        assert kind == "ValueError", f"rank {r}: {kind}: {msg}"
        assert seconds < limit, f"rank {r} waited {seconds:.1f} s"
        assert re.search(r"invalid on rank\(s\) \[1\] \(checked on every rank\): " + rule, msg), msg


@pytest.mark.parametrize("case", list(BAD_SPLITS))
def test_bad_splits_on_one_rank_raise_on_every_rank_at_once(case):
    """Under torchrun a rank that raised alone would leave its peers in the next collective
    until the group timeout: every rank must raise the same ValueError, at once."""
    splits, rule = BAD_SPLITS[case]
    _every_rank_raised_at_once(launch(_one_bad_rank_worker, 2, splits, False, timeout=20), rule)


def test_the_every_rank_check_catches_a_rank_that_raises_alone():
    """The bug on purpose (the bad rank raises before any collective): its peer waits in the
    counts exchange until the group timeout, so the test above cannot pass."""
    with pytest.raises(RankError, match=r"(?i)timed? ?out"):   # gloo: "Timed out ..." or "... timeout ..."
        _every_rank_raised_at_once(launch(_one_bad_rank_worker, 2, BAD_SPLITS["sum"][0], True, timeout=1),
                                   BAD_SPLITS["sum"][1])
