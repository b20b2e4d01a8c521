"""Routing, capacity, dispatch and the single-device MoE layer against plain loops over tokens."""
import itertools
import math

import pytest
import torch

from labkit.moe import (
    MoEConfig,
    MoELayer,
    TopKRouter,
    capacity_mask,
    comm_balance_loss,
    compute_capacity,
    dense_dispatch_tensors,
    dense_moe,
    device_balance_loss,
    fine_grained,
    route,
    sequence_balance_loss,
    sorted_moe,
    switch_aux_loss,
    update_expert_bias,
    z_loss,
)


def test_topk_weights_unrenormalised_and_renormalised():
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    w, i, s = route(z, 2)
    assert i.tolist() == [[0, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.6095, 0.2242]]), atol=1e-4, rtol=0)
    w, _, _ = route(z, 2, renormalize=True)
    torch.testing.assert_close(w, torch.tensor([[0.7311, 0.2689]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(s.sum(-1), torch.ones(1))         # softmax over ALL experts


def test_router_shapes_top1_switch():
    torch.manual_seed(0)
    r = TopKRouter(16, 8, 1)
    out = r(torch.randn(10, 16))
    assert out.weights.shape == (10, 1) and out.indices.shape == (10, 1)
    assert out.logits.shape == out.scores.shape == (10, 8)
    assert out.indices.dtype == torch.long and out.capacity is None and out.dropped_fraction == 0.0
    assert int(out.tokens_per_expert.sum()) == 10


def _loop_route(logits, k, score_func, renormalize, G, M, scale, bias):
    """Plain per-token reference of labkit.moe.route."""
    T, E = logits.shape
    W, I = [], []
    for t in range(T):
        z = logits[t].tolist()
        if score_func == "softmax":
            m = max(z)
            e = [math.exp(v - m) for v in z]
            s = [v / sum(e) for v in e]
        else:
            s = [1 / (1 + math.exp(-v)) for v in z]
        sel = [s[i] + (bias[i] if bias is not None else 0.0) for i in range(E)]
        if G > 1 and M < G:
            n = E // G
            gscore = []
            for g in range(G):
                members = sorted(sel[g * n:(g + 1) * n], reverse=True)
                gscore.append(members[0] if bias is None else sum(members[:2]))
            keep_groups = sorted(range(G), key=lambda g: -gscore[g])[:M]
            sel = [sel[i] if i // n in keep_groups else -math.inf for i in range(E)]
        idx = sorted(range(E), key=lambda i: -sel[i])[:k]
        w = [s[i] for i in idx]
        if renormalize:
            w = [v / sum(w) for v in w]
        W.append([v * scale for v in w])
        I.append(idx)
    return torch.tensor(W, dtype=torch.float64), torch.tensor(I)


@pytest.mark.parametrize("score_func,renormalize,G,M,scale,use_bias", [
    ("softmax", False, 1, 1, 1.0, False), ("softmax", True, 1, 1, 1.0, False),
    ("sigmoid", True, 1, 1, 2.5, False), ("sigmoid", True, 4, 2, 2.5, True),
    ("softmax", False, 4, 1, 1.0, False), ("sigmoid", False, 2, 1, 1.0, True),
])
def test_routing_options_match_loop(score_func, renormalize, G, M, scale, use_bias):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.3 if use_bias else None
    w, i, _ = route(logits, 2, score_func, renormalize, G, M, scale, bias)
    w_ref, i_ref = _loop_route(logits, 2, score_func, renormalize, G, M, scale,
                               None if bias is None else bias.tolist())
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(w, w_ref.double(), rtol=1e-12, atol=1e-12)


def test_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, i, s = route(logits, 2, "softmax", False, expert_bias=bias)
    assert i.tolist() == [[3, 0]]
    torch.testing.assert_close(w, s[0, [3, 0]][None])            # unbiased affinities


def test_group_score_top2_sum_with_bias_max_without():
    # group 0 = experts {0,1} scores {0.9, 0.0}; group 1 = {2,3} scores {0.5, 0.5} (sigmoid domain)
    s = torch.tensor([[0.9, 1e-6, 0.5, 0.5]])
    logits = torch.log(s / (1 - s))
    _, i_nobias, _ = route(logits, 1, "sigmoid", True, 2, 1)
    _, i_bias, _ = route(logits, 1, "sigmoid", True, 2, 1, expert_bias=torch.zeros(4))
    assert i_nobias.tolist() == [[0]]        # max: group 0 (0.9 > 0.5)
    assert i_bias.item() in (2, 3)           # top-2 sum: group 1 (1.0 > 0.9)


def test_capacity_formula():
    assert compute_capacity(5, 4, 1, 3.0) == 4                    # ceil(1 * 5 / 4 * 3) = ceil(3.75)
    assert compute_capacity(64, 8, 2, 1.25) == 20
    assert compute_capacity(1, 64, 1, 1.0) == 1                   # min_capacity
    assert compute_capacity(1, 64, 1, 1.0, min_capacity=4) == 4
    assert compute_capacity(100, 4, 2, None) is None


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_five_tokens_one_expert_capacity_four(policy):
    logits = torch.tensor([[1.0, 0, 0, 0], [3.0, 0, 0, 0], [2.0, 0, 0, 0], [5.0, 0, 0, 0], [4.0, 0, 0, 0]])
    router = TopKRouter(4, 4, 1, capacity_factor=3.0, drop_policy=policy)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    out = router(logits)
    assert out.capacity == 4 and out.indices.flatten().tolist() == [0] * 5
    assert int(out.keep.sum()) == 4 and out.dropped_fraction == pytest.approx(0.2)
    dropped = (~out.keep.flatten()).nonzero().item()
    assert dropped == (0 if policy == "probs" else 4)             # lowest weight / latest position
    assert out.weights[dropped].item() == 0.0
    # in the layer the dropped token gets nothing from the experts (only the residual, outside)
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(n_embd=4, n_routed_experts=4, n_activated_experts=1, moe_ffn_dim=8,
                               capacity_factor=3.0, drop_policy=policy))
    layer.router.load_state_dict(router.state_dict())
    y, stats = layer(logits)
    assert y[dropped].abs().sum() == 0 and (y.abs().sum(1) > 0).sum() == 4
    assert stats.dropped_fraction == pytest.approx(0.2)


def _loop_capacity(indices, weights, E, C, policy):
    T, k = indices.shape
    slots = [(t, j) for t in range(T) for j in range(k)]
    if policy == "probs":
        slots.sort(key=lambda s: -weights[s].item())              # stable: ties keep slot order
    used, keep = [0] * E, torch.zeros(T, k, dtype=torch.bool)
    for t, j in slots:
        e = indices[t, j].item()
        if used[e] < C:
            used[e] += 1
            keep[t, j] = True
    return keep


@pytest.mark.parametrize("policy,C", list(itertools.product(["probs", "position"], [1, 3, 5])))
def test_capacity_mask_matches_loop(policy, C):
    g = torch.Generator().manual_seed(C)
    w, i, _ = route(torch.randn(16, 4, generator=g), 2)
    assert torch.equal(capacity_mask(i, w, 4, C, policy), _loop_capacity(i, w, 4, C, policy))


def test_bias_update_numbers_and_no_gradient():
    b = torch.zeros(4)
    update_expert_bias(b, torch.tensor([10, 2, 4, 8]), 1e-3)
    torch.testing.assert_close(b, torch.tensor([-0.001, 0.001, 0.001, -0.001]))
    layer = MoELayer(MoEConfig(n_embd=8, n_routed_experts=4, expert_bias=True))
    assert "router.expert_bias" in dict(layer.named_buffers())
    assert "router.expert_bias" not in dict(layer.named_parameters())
    assert not layer.router.expert_bias.requires_grad


def _layer_and_input(**kw):
    torch.manual_seed(1)
    cfg = MoEConfig(n_embd=8, n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=16, **kw)
    return MoELayer(cfg), torch.randn(2, 6, 8)


@pytest.mark.parametrize("kw", [{}, {"capacity_factor": 0.5}, {"n_shared_experts": 2, "score_func": "sigmoid"},
                                {"capacity_factor": 1.0, "drop_policy": "position", "token_groups": 3}])
def test_layer_matches_loop_over_tokens(kw):
    layer, x = _layer_and_input(**kw)
    y, stats = layer(x)
    r = stats.router
    x2 = x.reshape(-1, 8)
    for t in range(x2.shape[0]):
        want = torch.zeros(8)
        for j in range(2):
            if r.keep[t, j]:
                want = want + r.weights[t, j] * layer.experts[int(r.indices[t, j])](x2[t:t + 1])[0]
        if layer.shared_experts is not None:
            want = want + layer.shared_experts(x2[t:t + 1])[0]
        torch.testing.assert_close(y.reshape(-1, 8)[t], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_sort_and_dense_dispatch_agree(capacity_factor):
    layer, x = _layer_and_input(capacity_factor=capacity_factor)
    x2 = x.reshape(-1, 8).requires_grad_(True)
    r = layer.router(x2)
    y1 = sorted_moe(x2, r.weights, r.indices, r.keep, layer.experts)
    y2 = dense_moe(x2, r.weights, r.indices, r.keep, layer.experts, r.capacity)
    torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-6)
    g1 = torch.autograd.grad(y1.square().sum(), [x2, layer.router.weight], retain_graph=True)
    g2 = torch.autograd.grad(y2.square().sum(), [x2, layer.router.weight])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    dispatch, combine, C = dense_dispatch_tensors(r.weights, r.indices, r.keep, 4, r.capacity)
    assert dispatch.shape == combine.shape == (12, 4, C)
    assert int(dispatch.sum()) == int(r.keep.sum())
    assert dispatch.sum(0).max() <= 1                              # one token per slot


def test_fine_grained_same_parameters_more_experts():
    cfg = MoEConfig(n_embd=8, n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=16)
    fg = fine_grained(cfg, 4)
    assert (fg.n_routed_experts, fg.n_activated_experts, fg.moe_ffn_dim) == (16, 8, 4)
    n = lambda c: sum(p.numel() for p in MoELayer(c).experts.parameters())
    weights_only = lambda c: sum(p.numel() for name, p in MoELayer(c).experts.named_parameters() if "weight" in name)
    assert weights_only(fg) == weights_only(cfg)                    # biases of fc2 differ: E*H each
    assert n(fg) > 0
    with pytest.raises(ValueError, match="m=3 must divide moe_ffn_dim=16"):
        fine_grained(cfg, 3)


@pytest.mark.parametrize("kwargs,message", [
    ({"score_func": "relu"}, "score_func must be one of"),
    ({"n_activated_experts": 9}, r"top_k must be in \[1, n_routed_experts=8\], got 9"),
    ({"n_expert_groups": 3}, "n_routed_experts=8 must be divisible by n_expert_groups=3"),
    ({"n_expert_groups": 4, "n_limited_groups": 5}, r"n_limited_groups=5 must be in \[1, n_expert_groups=4\]"),
    ({"n_expert_groups": 4, "n_limited_groups": 1, "n_activated_experts": 3}, "hold fewer than top_k=3"),
    ({"drop_policy": "random"}, "drop_policy must be one of"),
    ({"capacity_factor": 0.0}, "capacity_factor must be a finite number > 0, or None for no dropping; got 0.0"),
])
def test_router_errors(kwargs, message):
    args = dict(n_embd=8, n_routed_experts=8, n_activated_experts=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        TopKRouter(**args)


def test_layer_errors():
    with pytest.raises(ValueError, match="dispatch must be 'sort' or 'dense'"):
        MoEConfig(dispatch="scatter")
    layer = MoELayer(MoEConfig(n_embd=8, n_routed_experts=4, token_groups=4))
    with pytest.raises(ValueError, match="T=6 tokens are not divisible by token_groups=4"):
        layer(torch.randn(6, 8))
    with pytest.raises(ValueError, match="an expert has"):
        dense_dispatch_tensors(torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long),
                               torch.ones(3, 1, dtype=torch.bool), 2, capacity=2)


def test_layer_losses_are_means_over_token_groups():
    layer, x = _layer_and_input(aux_loss_coeff=0.1, z_loss_coeff=1e-3, seq_aux_loss_coeff=1e-2, device_loss_coeff=0.05,
                                comm_loss_coeff=0.02, n_devices=2, max_devices=1, n_expert_groups=2,
                                n_limited_groups=1, token_groups=2)
    _, stats = layer(x)
    want = {k: [] for k in ("aux", "z", "seq_aux", "device", "comm")}
    for chunk in x.reshape(-1, 8).chunk(2):
        r = layer.router(chunk)
        want["aux"].append(switch_aux_loss(r.logits, r.indices, 0.1, from_logits=True))
        want["z"].append(z_loss(r.logits, 1e-3))
        want["seq_aux"].append(sequence_balance_loss(r.logits, r.indices, 6, 1e-2, "softmax", from_logits=True))
        want["device"].append(device_balance_loss(r.logits, r.indices, 2, 0.05, from_logits=True))
        want["comm"].append(comm_balance_loss(r.logits, r.indices, 2, 1, 0.02, from_logits=True))
    assert set(stats.losses) == set(want)
    for name, values in want.items():
        torch.testing.assert_close(stats.losses[name], torch.stack(values).mean())
    torch.testing.assert_close(stats.aux_loss, sum(stats.losses.values()))
    # group-limited routing with 1 of 2 groups: both experts of every token on one device (M = 1)
    devices = stats.router.indices // 2
    assert torch.equal(devices[:, 0], devices[:, 1])


def test_layer_padding_mask_keeps_padded_tokens_out_of_balance_losses_and_loads(one_thread):
    """MoELayer(x, mask): every balance loss (value and router gradient) and the loads equal
    those of the real tokens alone, and do not change when the padded tokens change."""
    cfg = dict(aux_loss_coeff=0.1, z_loss_coeff=1e-2, seq_aux_loss_coeff=1e-2, device_loss_coeff=0.05,
               comm_loss_coeff=0.02, n_devices=2, max_devices=2)
    layer, x = _layer_and_input(**cfg)                           # x [2, 6, 8]
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)   # right padding
    _, stats = layer(x, mask)
    stats.aux_loss.backward()
    got_grad = layer.router.weight.grad.clone()
    layer.zero_grad()
    # reference: the losses of the 8 real tokens, routed alone (the router is per token)
    r = layer.router(x[mask])
    want = {"aux": switch_aux_loss(r.logits, r.indices, 0.1, from_logits=True), "z": z_loss(r.logits, 1e-2),
            "device": device_balance_loss(r.logits, r.indices, 2, 0.05, from_logits=True),
            "comm": comm_balance_loss(r.logits, r.indices, 2, 2, 0.02, from_logits=True),
            "seq_aux": torch.stack([sequence_balance_loss(r.logits[:6], r.indices[:6], 6, 1e-2, "softmax",
                                                          from_logits=True),
                                    sequence_balance_loss(r.logits[6:], r.indices[6:], 2, 1e-2, "softmax",
                                                          from_logits=True)]).mean()}
    assert set(stats.losses) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(stats.losses[name], value, rtol=1e-5, atol=1e-7, msg=name)
    sum(want.values()).backward()
    torch.testing.assert_close(got_grad, layer.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(stats.tokens_per_expert, torch.bincount(r.indices.reshape(-1), minlength=4))
    # other padding content: the same numbers; without the mask they differ (the bug it prevents)
    x2 = x.clone()
    x2[~mask] = torch.randn(int((~mask).sum()), 8) * 5
    _, stats2 = layer(x2, mask)
    for name in want:
        torch.testing.assert_close(stats2.losses[name], stats.losses[name], rtol=1e-6, atol=1e-8)
    assert torch.equal(stats2.tokens_per_expert, stats.tokens_per_expert)
    _, unmasked = layer(x2)
    assert not torch.allclose(unmasked.losses["aux"], stats.losses["aux"])
    with pytest.raises(ValueError, match="padding mask has 6 entries for T=12 tokens"):
        layer(x, mask[0])
