"""Ignored targets (-100) spread unevenly over the shards of a step (one shard with none valid):
the parallel loss is the mean over every valid target of the step, equal to one device's
(labkit.parallel.loss). For (cp, dp, pp, M) in (2,1,1,1), (1,2,1,1), (1,1,2,2), (2,2,2,2) and a
MoE layout with EP = d = 2: every parameter gradient at every step, the parameters after 3 plain-SGD
steps and the reported loss equal one device's; the old per-shard mean (each microbatch's own
token mean, injected) fails each. A step with no valid target gives zero gradients, loss 0 and a
warning, never NaN. The count is one all-reduce of 8 bytes, as the planner's "loss" axis says."""
import warnings

import pytest
import torch

from labkit.comm import CommLog
from labkit.context_parallel import sequence_positions
from labkit.dist import launch, make_grid
from labkit.model import GPT, GPTConfig
from labkit.moe import MoEGPT
from labkit.moe.model import moe_config_for, total_aux_loss
from labkit.parallel import ParallelGPT

B, S, STEPS = 8, 8, 3
CFG = GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=16, block_size=S, bias=False, vocab_size=64)


def _moe_cfg(d, M):
    return moe_config_for(CFG, n_routed_experts=4, n_activated_experts=2, moe_ffn_dim=16, aux_loss_coeff=1e-2,
                          token_groups=d * M)


def model(moe, d, M):
    return MoEGPT(CFG, _moe_cfg(d, M), moe_layer_freq=2, seed=0) if moe else GPT(CFG, seed=0)


def batches(d, M, cp, steps=STEPS, empty_shard=True):
    """Targets with -100 spread unevenly: each row keeps a different share, and (``empty_shard``) the
    first shard (DP rank 0's microbatch 0, on CP rank 0 its chunk of positions) has no valid target."""
    g = torch.Generator().manual_seed(3)
    b = B // (d * M)
    empty = sequence_positions(S, 0, cp, True) if cp > 1 else torch.arange(S)
    out = []
    for _ in range(steps):
        x = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
        y = torch.randint(0, CFG.vocab_size, (B, S), generator=g)
        keep = torch.rand(B, S, generator=g) < torch.linspace(0.2, 0.95, B).unsqueeze(1)
        if empty_shard:
            keep[:b, empty] = False
        out.append((x, y.masked_fill(~keep, -100)))
    return out


def reference(moe, d, M, cp, empty_shard=True, lr=0.1):
    ref = model(moe, d, M)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses, grads = [], []
    for x, y in batches(d, M, cp, empty_shard=empty_shard):
        opt.zero_grad()
        loss = ref(x, y)
        if moe:
            loss = loss[0] + total_aux_loss(loss[1])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: q.grad.clone() for n, q in ref.named_parameters()})
        opt.step()
    return losses, grads, {n: q.detach().clone() for n, q in ref.named_parameters()}


def _worker(ctx, moe, cp, d, p, M, schedule, zero, attention, steps, bug, empty_step, empty_shard):
    grid = make_grid(ctx, tp=1, pp=p, dp=d, cp=cp)
    pg = ParallelGPT(model(moe, d, M), grid, schedule, M, bucket_cap_mb=0.002, zero=zero, cp_attention=attention)
    if bug == "per_shard_mean":      # injected: the old loss, each microbatch's own token mean (then 1/M, DP mean)
        head = [m.head for m in pg.modules if m.head is not None]
        if head:
            pg.schedule.loss_fn = head[0].loss
    pg.make_optimizer("sgd", 0.1)
    keep = grid.cp_rank == 0          # EP: the local experts of every DP rank; dense gradients equal over DP
    out = {"losses": [], "grads": [], "comm": [], "expected": pg.expected_comm(B, S), "last": pg.has_last_stage,
           "keep": keep}
    for x, y in batches(d, M, cp, steps, empty_shard):
        pg.zero_grad()
        with CommLog() as log:
            loss = pg.train_step(x, y)
        aux = pg.take_aux_loss() if moe else 0.0      # p = 1 in the MoE layout: every balance loss is here
        out["losses"].append(None if loss is None else loss + aux)
        out["comm"].append(pg.comm_by_axis(log.records))
        grads = pg.gather_full("grad")
        out["grads"].append(grads if keep else None)
        pg.optimizer.step()
    params = pg.gather_full("param")
    out["params"] = params if keep else None
    if empty_step:                   # every target ignored: zero gradients, loss 0, a warning; no NaN
        pg.zero_grad()
        x, y = batches(d, M, cp, 1)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = pg.train_step(x, torch.full_like(y, -100))
        grads = pg.gather_full("grad")
        out["empty"] = (loss, max(float(g.abs().max()) for g in grads.values() if g is not None),
                        [str(w.message) for w in caught])
    return out


LAYOUTS = {   # name: (moe, cp, d, p, M, schedule, zero, CP attention)
    "cp2": (False, 2, 1, 1, 1, "1f1b", 0, "ring"),
    "dp2 zero2": (False, 1, 2, 1, 1, "1f1b", 2, "ring"),
    "pp2 M2 zb-h1": (False, 1, 1, 2, 2, "zb-h1", 0, "ring"),
    "cp2 dp2 pp2 M2 zero3 allgather": (False, 2, 2, 2, 2, "1f1b", 3, "allgather"),
    "moe ep2 dp2 M2": (True, 1, 2, 1, 2, "1f1b", 0, "ring"),
}


def run(name, steps=STEPS, bug=None, empty_step=False, empty_shard=True):
    moe, cp, d, p, M, schedule, zero, attention = LAYOUTS[name]
    return launch(_worker, cp * d * p, moe, cp, d, p, M, schedule, zero, attention, steps, bug, empty_step,
                  empty_shard, timeout=90)


def errors(name, ranks, steps=STEPS, empty_shard=True):
    """The largest |gradient - one device's| per step, of the parameters after the steps, and of the
    reported loss (NaN where either side is not finite)."""
    moe, cp, d, p, M = LAYOUTS[name][:5]
    ref_losses, ref_grads, ref_params = reference(moe, d, M, cp, empty_shard)

    def err(a, b):
        return float((a - b).abs().max()) if torch.isfinite(a).all() else float("nan")
    grad_err, loss_err = [], []
    for step in range(steps):
        full = {}
        for r in ranks:
            if r["keep"]:
                full.update(r["grads"][step])
        assert full.keys() == ref_grads[step].keys(), sorted(set(full) ^ set(ref_grads[step]))
        grad_err.append(max(err(full[n], ref_grads[step][n]) for n in full))
        losses = [r["losses"][step] for r in ranks if r["last"]]
        if moe:    # the balance losses of this DP rank's d*M groups: the mean over the ranks is the step's
            losses = [sum(losses) / len(losses)]
        loss_err.append(max(abs(v - ref_losses[step]) for v in losses))   # the token loss: every rank's
    full = {}
    for r in ranks:
        if r["keep"]:
            full.update(r["params"])
    param_err = max(err(full[n], ref_params[n]) for n in full) if steps == STEPS else float("nan")
    return grad_err, param_err, loss_err


def _ok(e):
    return e == e and e <= 1e-5


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_uneven_ignored_targets_equal_one_device(name):
    ranks = run(name, empty_step=name == "dp2 zero2")
    grad_err, param_err, loss_err = errors(name, ranks)
    print(f"{name}: largest gradient error per step {grad_err}, parameters after {STEPS} SGD steps {param_err:.2e}, "
          f"reported loss {max(loss_err):.2e}")
    assert all(_ok(e) for e in grad_err), grad_err
    assert _ok(param_err) and all(_ok(e) for e in loss_err), (param_err, loss_err)
    moe, cp, d = LAYOUTS[name][:3]
    for r in ranks:     # the count and the reported loss: 2 all-reduces of 8 B on the last stage, as planned
        assert r["comm"][-1].get("loss") == r["expected"].get("loss"), (r["comm"][-1].get("loss"), r["expected"])
        assert (r["comm"][-1].get("loss") == {"all_reduce": (2, 16)}) == (r["last"] and cp * d > 1)
    if name == "dp2 zero2":
        for r in ranks:
            loss, largest, caught = r["empty"]
            assert loss == 0.0 and largest == 0.0, (loss, largest)
            assert any("no valid target" in m for m in caught), caught


@pytest.mark.parametrize("empty_shard", [True, False], ids=["a shard without valid target", "every shard some"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_per_shard_mean_is_caught(name, empty_shard):
    """The old loss gives NaN with an empty shard, and a finite wrong gradient without one."""
    ranks = run(name, steps=1, bug="per_shard_mean", empty_shard=empty_shard)
    grad_err, _, _ = errors(name, ranks, steps=1, empty_shard=empty_shard)
    print(f"{name}, injected per-shard mean ({'with' if empty_shard else 'without'} an empty shard): largest "
          f"gradient error {grad_err[0]:.3g}")
    assert not _ok(grad_err[0]), grad_err
    assert (grad_err[0] != grad_err[0]) == empty_shard
