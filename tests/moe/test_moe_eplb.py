"""EPLB (rebalance_experts) on hand-checked loads, its invariants and errors; the EP layer with
replicas equals the single-device MoE (output, input grad, every parameter grad, parameters
after 3 SGD steps) on uneven loads; injected bugs are caught."""
from dataclasses import replace

import pytest
import torch

import labkit.moe.eplb as eplb
from labkit.dist import launch
from labkit.moe import MoEConfig, MoELayer
from labkit.moe.eplb import contiguous_gpu_loads, gpu_loads, imbalance, rebalance_experts
from labkit.moe.expert_parallel import sync_replicated_grads
from labkit.moe.replicas import ReplicatedExpertParallelMoE, choose_replicas, sync_replica_grads

RTOL, ATOL = 1e-5, 1e-6

# EPLB's README example (2 layers, 12 experts, 4 groups, 2 nodes, 8 GPUs, 16 replicas) and its output
README_W = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                         [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_P2L = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])


def test_readme_example():
    p2l, l2p, cnt = rebalance_experts(README_W, 16, 4, 2, 8)
    assert torch.equal(p2l, README_P2L)
    assert cnt.tolist() == [torch.bincount(row, minlength=12).tolist() for row in README_P2L]
    assert cnt[0].tolist() == [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1]


def test_hierarchical_hand_checked():
    # groups {0,1} load 9 and {2,3} load 3: one group per node; node 0 copies expert 0 (6 > 3),
    # node 1 copies expert 3 (2 > 1); one GPU per node holds the node's 3 physical experts
    p2l, l2p, cnt = rebalance_experts(torch.tensor([[6, 3, 1, 2]]), 6, 2, 2, 2)
    assert p2l.tolist() == [[0, 1, 0, 2, 3, 3]]
    assert cnt.tolist() == [[2, 1, 1, 2]]
    assert l2p.tolist() == [[[0, 2], [1, -1], [3, -1], [4, 5]]]
    assert gpu_loads(torch.tensor([[6, 3, 1, 2]]), p2l, cnt, 2).tolist() == [[9.0, 3.0]]


def test_global_hand_checked():
    # num_groups=1 does not divide over 2 nodes -> global: copies of expert 0 (6, then 3 vs 3 -> lower id),
    # per-copy loads [2, 3, 1, 2, 2, 2] packed largest-first into the lighter GPU: 6 and 6
    w = torch.tensor([[6, 3, 1, 2]])
    p2l, l2p, cnt = rebalance_experts(w, 6, 1, 2, 2)
    assert p2l.tolist() == [[1, 0, 2, 0, 3, 0]]
    assert cnt.tolist() == [[3, 1, 1, 1]]
    assert l2p.tolist() == [[[3, 1, 5], [0, -1, -1], [2, -1, -1], [4, -1, -1]]]
    assert gpu_loads(w, p2l, cnt, 2).tolist() == [[6.0, 6.0]]
    assert contiguous_gpu_loads(w, 2).tolist() == [[9.0, 3.0]]


def test_helpers_hand_checked():
    pack, rank = eplb.balanced_packing(torch.tensor([[5.0, 1, 4, 2]]), 2)
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]
    p2l, r, cnt = eplb.replicate_experts(torch.tensor([[6.0, 3, 1]]), 5)
    assert p2l.tolist() == [[0, 1, 2, 0, 0]] and r.tolist() == [[0, 0, 0, 1, 2]] and cnt.tolist() == [[3, 1, 1]]


@pytest.mark.parametrize("E,groups,nodes,gpus,R", [(12, 4, 2, 8, 16), (12, 3, 2, 4, 16), (16, 8, 4, 8, 24),
                                                   (12, 1, 1, 4, 12), (12, 1, 1, 4, 16)])
def test_invariants(E, groups, nodes, gpus, R):
    w = torch.randint(0, 100, (3, E), generator=torch.Generator().manual_seed(R)).float()
    w[:, 0] += 500                                                        # one hot expert
    p2l, l2p, cnt = rebalance_experts(w, R, groups, nodes, gpus)
    assert p2l.shape == (3, R) and cnt.shape == (3, E) and l2p.shape[:2] == (3, E)
    for layer in range(3):
        assert torch.equal(torch.bincount(p2l[layer], minlength=E), cnt[layer])   # counts agree
        assert int(cnt[layer].min()) >= 1 and int(cnt[layer].sum()) == R
        for e in range(E):                                                 # log2phy is the inverse, -1 padded
            phys = l2p[layer, e]
            assert sorted(phys[: cnt[layer, e]].tolist()) == (p2l[layer] == e).nonzero().flatten().tolist()
            assert (phys[cnt[layer, e]:] == -1).all()
        if groups % nodes == 0:                                            # a group's experts stay on one node
            node_of_phys = torch.arange(R) // (R // nodes)
            for g in range(groups):
                members = torch.isin(p2l[layer], torch.arange(g * E // groups, (g + 1) * E // groups))
                assert node_of_phys[members].unique().numel() == 1
    # every GPU holds R/G physical experts: GPU g's are columns g*R/G .. (g+1)*R/G - 1, each a real expert
    per_gpu = p2l.view(3, gpus, R // gpus)
    assert ((per_gpu >= 0) & (per_gpu < E)).all()
    # the hot expert is copied and the
    # busiest GPU is lighter than with one copy per expert placed contiguously
    if groups % nodes != 0 or nodes == 1:
        assert (imbalance(gpu_loads(w, p2l, cnt, gpus)) < imbalance(contiguous_gpu_loads(w, gpus))).all()
    if R > E:
        assert (cnt[:, 0] > 1).all()


@pytest.mark.parametrize("args,msg", [
    ((torch.ones(12), 16, 4, 2, 8), "weight must be [layers, experts]"),
    ((torch.ones(1, 12), 10, 4, 2, 2), "num_replicas=10 must be >= the 12 logical experts"),
    ((torch.ones(1, 12), 16, 4, 3, 8), "num_gpus=8 must be a multiple of num_nodes=3"),
    ((torch.ones(1, 12), 18, 4, 2, 8), "num_replicas=18 must be a multiple of num_gpus=8"),
    ((torch.ones(1, 12), 16, 5, 1, 8), "cannot be split into num_groups=5"),
    ((-torch.ones(1, 12), 16, 4, 2, 8), "non-negative"),
])
def test_errors(args, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        rebalance_experts(*args)


def test_hand_checked_case_catches_a_wrong_packing(monkeypatch):
    """A packing that ignores the weights (round robin) must fail the hand-checked case."""
    def round_robin(weight, num_packs):
        n = weight.shape[1]
        return (torch.arange(n) % num_packs).expand(weight.shape[0], n), (torch.arange(n) // num_packs).expand(
            weight.shape[0], n)
    monkeypatch.setattr(eplb, "balanced_packing", round_robin)
    with pytest.raises(AssertionError):
        test_global_hand_checked()


# ----------------------------------------------------------------------------- replicas on ranks
H, T_R, P = 8, 12, 2
CFG = MoEConfig(n_embd=H, n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=16, n_shared_experts=1,
                capacity_factor=None, aux_loss_coeff=1e-2)


def _dense():
    torch.manual_seed(0)
    layer = MoELayer(replace(CFG, token_groups=P))
    with torch.no_grad():                         # skewed gate: expert 0 gets most tokens (uneven loads)
        layer.router.weight[0] += 0.8
    return layer


def _data(step):
    g = torch.Generator().manual_seed(10 + step)
    x = torch.randn(P * T_R, H, generator=g)
    x[:, :] += 0.5
    return x, torch.randn(P * T_R, H, generator=g)


def _placement():
    ref = _dense()
    x, _ = _data(0)
    with torch.no_grad():
        _, stats = ref(x)
    p2l, _, _ = rebalance_experts(stats.tokens_per_expert[None].float(), 6, 1, 1, P)
    return p2l[0], stats.tokens_per_expert


def _rep_worker(ctx, p2l, steps, lr, skip_sync):
    layer = ReplicatedExpertParallelMoE.from_dense(_dense(), p2l, ctx.group, ctx.rank, ctx.world_size)
    r, out = ctx.rank, []
    for step in range(steps):
        x, g = _data(step)
        x = x[r * T_R:(r + 1) * T_R].clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y, stats = layer(x)
        ((y * g[r * T_R:(r + 1) * T_R]).sum() + stats.aux_loss).div(P).backward()
        sync_replicated_grads(layer, ctx.group)
        if not skip_sync:
            sync_replica_grads(layer, ctx.group)
        out.append({"y": y.detach(), "x_grad": x.grad, "recv": layer.last_recv_counts.sum(0),
                    "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
    out.append({n: t.detach().clone() for n, t in layer.state_dict().items()})
    out.append(layer.local_logical())
    return out


def _reference(steps, lr):
    layer, out = _dense(), []
    for step in range(steps):
        x, g = _data(step)
        x.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y, stats = layer(x)
        ((y * g).sum() / P + stats.aux_loss).backward()       # the mean over the P token groups
        out.append({"y": y.detach(), "x_grad": x.grad,
                    "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
        with torch.no_grad():
            for p in layer.parameters():
                p -= lr * p.grad
    out.append({n: t.detach().clone() for n, t in layer.state_dict().items()})
    return out


def _compare(ranks, ref, steps):
    close = lambda a, b: torch.allclose(a, b, rtol=RTOL, atol=ATOL)  # noqa: E731
    for step in range(steps):
        y = torch.cat([rk[step]["y"] for rk in ranks])
        assert close(y, ref[step]["y"]), f"step {step}: output"
        x_grad = torch.cat([rk[step]["x_grad"] for rk in ranks])
        assert close(x_grad, ref[step]["x_grad"]), f"step {step}: input grad"
        for r, rk in enumerate(ranks):
            logical = rk[-1]
            for name, grad in rk[step]["grads"].items():
                if name.startswith("experts."):
                    _, i, rest = name.split(".", 2)
                    name = f"experts.{logical[int(i)]}.{rest}"
                assert close(grad, ref[step]["grads"][name]), f"step {step}, rank {r}: grad of {name}"
    for r, rk in enumerate(ranks):
        for name, value in rk[steps].items():
            if name.startswith("experts."):
                _, i, rest = name.split(".", 2)
                name = f"experts.{rk[-1][int(i)]}.{rest}"
            assert close(value, ref[steps][name]), f"rank {r}: parameter {name} after {steps} SGD steps"


def test_replicas_equal_single_device_on_uneven_loads():
    p2l, load = _placement()
    assert int(load.max()) > 2 * int(load.min())                          # uneven loads
    cnt = torch.bincount(p2l, minlength=4)
    assert int(cnt.max()) >= 2                                            # some expert has several copies
    steps, lr = 3, 0.1
    ranks = launch(_rep_worker, P, p2l, steps, lr, False, timeout=20)
    _compare(ranks, _reference(steps, lr), steps)
    # the tokens of a copied expert are split among its copies (step 0: the load EPLB measured)
    per_phys = torch.cat([rk[0]["recv"] for rk in ranks])                # [R] rows per physical expert
    for e in range(4):
        share = per_phys[p2l == e]
        assert int(share.sum()) == int(load[e])
        assert int(share.max() - share.min()) <= P                        # within one slot per rank
    # measured tokens per GPU = EPLB's predicted load per GPU within the rounding of the split
    predicted = gpu_loads(load[None].float(), p2l[None], cnt[None], P)[0]
    measured = per_phys.view(P, -1).sum(1).double()
    assert (measured - predicted).abs().max() <= 3


def test_missing_replica_grad_sum_is_caught():
    p2l, _ = _placement()
    ranks = launch(_rep_worker, P, p2l, 1, 0.1, True, timeout=20)
    with pytest.raises(AssertionError, match="grad of experts"):
        _compare(ranks, _reference(1, 0.1), 1)


def test_choose_replicas_round_robin():
    idx = torch.zeros(5, 1, dtype=torch.long)
    keep = torch.ones(5, 1, dtype=torch.bool)
    log2phy, cnt = torch.tensor([[0, 3]]), torch.tensor([2])
    assert choose_replicas(idx, keep, log2phy, cnt, rank=0).flatten().tolist() == [0, 3, 0, 3, 0]
    assert choose_replicas(idx, keep, log2phy, cnt, rank=1).flatten().tolist() == [3, 0, 3, 0, 3]


def test_replica_layer_errors():
    with pytest.raises(ValueError, match="have no physical copy"):
        ReplicatedExpertParallelMoE(CFG, [0, 1, 2, 2], None, 0, 2)
    with pytest.raises(ValueError, match="cannot be split evenly over EP size 2"):
        ReplicatedExpertParallelMoE(CFG, [0, 1, 2, 3, 0], None, 0, 2)
