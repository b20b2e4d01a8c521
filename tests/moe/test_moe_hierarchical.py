"""The two-level (hierarchical) all-to-all equals the flat one and the single-device MoE (output,
input grad, every parameter grad, parameters after 2 SGD steps) on 2 nodes x 2 GPUs; its bytes
per level match what CommLog saw; with node-limited routing the inter-node rows per token are at
most M; an injected bug is caught."""
from dataclasses import replace

import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import launch
from labkit.moe import MoEConfig, MoELayer
from labkit.moe.expert_parallel import all_reduce_loads, sync_replicated_grads
from labkit.moe.hierarchical import HierarchicalExpertParallelMoE, inter_node_rows, make_node_groups

RTOL, ATOL = 1e-5, 1e-6
H, T_R, P, G = 8, 8, 4, 2            # 4 ranks = 2 nodes x 2 GPUs
CFG = MoEConfig(n_embd=H, n_routed_experts=8, n_activated_experts=3, moe_ffn_dim=8, capacity_factor=None,
                aux_loss_coeff=1e-2, expert_bias=True, bias_update_rate=0.05)
LIMITED = replace(CFG, n_expert_groups=2, n_limited_groups=1)   # node-limited: M = 1 node per token
STEPS, LR = 2, 0.1


def _dense(cfg):
    torch.manual_seed(1)
    return MoELayer(replace(cfg, token_groups=P))


def _data(step):
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(P * T_R, H, generator=g), torch.randn(P * T_R, H, generator=g)


def _train(layer, x, g, step_fn=None, group=None):
    out = []
    for step in range(STEPS):
        xs, gs = x(step), g(step)
        xs.requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        with CommLog() as log:
            y, stats = layer(xs)
        # the loss is the mean over the P token groups; a rank holds one group: (its sum + its aux) / P
        loss = ((y * gs).sum() + stats.aux_loss) / P if group is not None else (y * gs).sum() / P + stats.aux_loss
        loss.backward()
        loads = stats.tokens_per_expert
        if group is not None:
            sync_replicated_grads(layer, group)
            loads = all_reduce_loads(loads, group)
        rec = {"y": y.detach(), "x_grad": xs.grad, "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
               "indices": stats.router.indices, "keep": stats.router.keep}
        if group is not None:
            rec["bytes"] = layer.last_bytes
            rec["a2a_rows"] = sum(r.nbytes for r in log.of("all_to_all")
                                  if r.dtype == "float32" and r.shape[1:] == (H,))
        out.append(rec)
        with torch.no_grad():
            for p in layer.parameters():
                p -= LR * p.grad
        layer.update_bias(loads)
    out.append({n: t.detach().clone() for n, t in layer.state_dict().items()})
    return out


def _worker(ctx):
    nodes = make_node_groups(ctx, G)
    r = ctx.rank
    x = lambda s: _data(s)[0][r * T_R:(r + 1) * T_R].clone()  # noqa: E731
    g = lambda s: _data(s)[1][r * T_R:(r + 1) * T_R]          # noqa: E731
    res = {}
    for name, cfg in (("free", CFG), ("limited", LIMITED)):
        for hier in (True, False):
            layer = HierarchicalExpertParallelMoE.from_dense(_dense(cfg), nodes, hierarchical=hier)
            res[(name, hier)] = _train(layer, x, g, group=ctx.group)
    return res


@pytest.fixture(scope="module")
def runs():
    ranks = launch(_worker, P, timeout=30)
    refs = {name: _train(_dense(cfg), lambda s: _data(s)[0], lambda s: _data(s)[1]) for name, cfg in
            (("free", CFG), ("limited", LIMITED))}
    return ranks, refs


def _compare(ranks, ref, key):
    close = lambda a, b: torch.allclose(a, b, rtol=RTOL, atol=ATOL)  # noqa: E731
    El = CFG.n_routed_experts // P
    for step in range(STEPS):
        assert close(torch.cat([rk[key][step]["y"] for rk in ranks]), ref[step]["y"]), f"{key} step {step}: output"
        assert close(torch.cat([rk[key][step]["x_grad"] for rk in ranks]), ref[step]["x_grad"]), \
            f"{key} step {step}: input grad"
        for r, rk in enumerate(ranks):
            for name, grad in rk[key][step]["grads"].items():
                if name.startswith("experts."):
                    _, i, rest = name.split(".", 2)
                    name = f"experts.{r * El + int(i)}.{rest}"
                assert close(grad, ref[step]["grads"][name]), f"{key} step {step}, rank {r}: grad of {name}"
    for r, rk in enumerate(ranks):
        for name, value in rk[key][STEPS].items():
            if name.startswith("experts."):
                _, i, rest = name.split(".", 2)
                name = f"experts.{r * El + int(i)}.{rest}"
            assert close(value, ref[STEPS][name]), f"{key} rank {r}: {name} after {STEPS} SGD steps"


@pytest.mark.parametrize("routing", ["free", "limited"])
@pytest.mark.parametrize("hier", [True, False])
def test_equal_to_single_device(runs, routing, hier):
    ranks, refs = runs
    _compare(ranks, refs[routing], (routing, hier))


def test_bytes_per_level(runs):
    ranks, _ = runs
    El_node = CFG.n_routed_experts // (P // G)
    for routing in ("free", "limited"):
        hier_inter = flat_inter = 0
        for r, rk in enumerate(ranks):
            for hier in (True, False):
                rec = rk[(routing, hier)][0]
                b = rec["bytes"]
                # the per-level accounting covers exactly the token rows CommLog saw (forward)
                assert b.total("inter_node") + b.total("intra_node") + b.total("local") == rec["a2a_rows"]
                # and the inter-node rows follow from the routing alone
                want = inter_node_rows(rec["indices"], rec["keep"], El_node, r // G, hier)
                assert b.rows["dispatch"]["inter_node"] == want
            hier_inter += rk[(routing, True)][0]["bytes"].rows["dispatch"]["inter_node"]
            flat_inter += rk[(routing, False)][0]["bytes"].rows["dispatch"]["inter_node"]
        for hier in (True, False):                               # combine returns one row per row received
            assert sum(rk[(routing, hier)][0]["bytes"].rows["combine"]["inter_node"] for rk in ranks) == \
                sum(rk[(routing, hier)][0]["bytes"].rows["dispatch"]["inter_node"] for rk in ranks)
        assert hier_inter < flat_inter, routing                  # tokens are sent once per node, not per slot
        if routing == "limited":                                 # node-limited routing, M = 1
            assert hier_inter <= 1 * P * T_R
            assert flat_inter > 1 * P * T_R                      # the flat one is not bounded by M


def test_wrong_combine_is_caught(monkeypatch, runs):
    """Overwrite instead of sum when slots are combined (one slot of each token wins): caught."""
    import labkit.moe.hierarchical as hmod

    def last_wins(self, dim, index, source):
        return self.index_copy(dim, index, source)

    _, refs = runs
    monkeypatch.setattr(torch.Tensor, "index_add", last_wins)

    def one(ctx):
        nodes = make_node_groups(ctx, G)
        r = ctx.rank
        layer = hmod.HierarchicalExpertParallelMoE.from_dense(_dense(CFG), nodes)
        y, _ = layer(_data(0)[0][r * T_R:(r + 1) * T_R])
        return y.detach()
    y = torch.cat(launch(one, P, timeout=30))
    assert not torch.allclose(y, refs["free"][0]["y"], rtol=RTOL, atol=ATOL)


def test_gpus_per_node_must_divide():
    def one(ctx):
        make_node_groups(ctx, 3)
    with pytest.raises(Exception, match="gpus_per_node=3 must divide the 2 ranks"):
        launch(one, 2, timeout=10)
