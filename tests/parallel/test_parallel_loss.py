"""Ignored targets (-100) spread unevenly over the shards of a step (one shard with none valid):
the parallel loss is the mean over every valid target of the step, equal to one device's
(labkit.parallel.loss). For (cp, dp, pp, M) in (2,1,1,1), (1,2,1,1), (1,1,2,2), (2,2,2,2) and a
MoE layout with EP = d = 2 (plus TP + SP with CP under ZeRO-1, HSDP, ParallelMoEGPT and the
torch-native path): every parameter gradient at every step, the parameters after 3 plain-SGD
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


def _worker(ctx, moe, cp, d, p, M, schedule, zero, attention, steps, bug, empty_step, empty_shard, t=1, sp=False,
            hsdp=1):
    grid = make_grid(ctx, tp=t, pp=p, dp=d, cp=cp)
    pg = ParallelGPT(model(moe, d, M), grid, schedule, M, bucket_cap_mb=0.002, zero=zero, cp_attention=attention,
                     sequence_parallel=sp, hsdp=hsdp)
    if bug == "per_shard_mean":      # injected: the old loss, each microbatch's own token mean (then 1/M, DP mean)
        head = [m.head for m in pg.modules if m.head is not None]
        if head:
            pg.schedule.loss_fn = head[0].loss
    pg.make_optimizer("sgd", 0.1)
    keep = grid.cp_rank == 0 and grid.tp_rank == 0   # EP: every DP rank's local experts; dense ones equal over DP
    out = {"losses": [], "grads": [], "comm": [], "expected": pg.expected_comm(B, S), "last": pg.has_last_stage,
           "keep": keep}
    for x, y in batches(d, M, cp, steps, empty_shard):
        pg.zero_grad()
        with CommLog() as log:
            loss = pg.train_step(x, y)
        if zero == 1 and pg.dp_cp > 1:                # ZeRO-1: reduce-scatter, then whole gradients to compare
            pg.optimizer.reduce_gradients()
            pg.optimizer.gather_gradients()
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


LAYOUTS = {   # name: (moe, cp, d, p, M, schedule, zero, CP attention[, t, sp, hsdp])
    "cp2": (False, 2, 1, 1, 1, "1f1b", 0, "ring"),
    "dp2 zero2": (False, 1, 2, 1, 1, "1f1b", 2, "ring"),
    "pp2 M2 zb-h1": (False, 1, 1, 2, 2, "zb-h1", 0, "ring"),
    "cp2 dp2 pp2 M2 zero3 allgather": (False, 2, 2, 2, 2, "1f1b", 3, "allgather"),
    "moe ep2 dp2 M2": (True, 1, 2, 1, 2, "1f1b", 0, "ring"),
    "tp2 sp cp2 ring M2": (False, 2, 1, 1, 2, "gpipe", 1, "ring", 2, True),   # ZeRO-1 over the cp ranks
    "dp4 hsdp2": (False, 1, 4, 1, 1, "1f1b", 3, "ring", 1, False, 2),
}


def run(name, steps=STEPS, bug=None, empty_step=False, empty_shard=True):
    moe, cp, d, p, M, schedule, zero, attention, *rest = LAYOUTS[name]
    t = rest[0] if rest else 1
    return launch(_worker, t * cp * d * p, moe, cp, d, p, M, schedule, zero, attention, steps, bug, empty_step,
                  empty_shard, *rest, timeout=90)


def errors(name, ranks, steps=STEPS, empty_shard=True, layout=None):
    """The largest |gradient - one device's| per step, of the parameters after the steps, and of the
    reported loss (NaN where either side is not finite)."""
    moe, cp, d, p, M = (layout or LAYOUTS[name])[:5]
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


# ----------------------------------------------------------------------------- the torch-native path
def _torch_worker(ctx, t, p, d, zero, bug):
    """labkit.parallel.torch_native on uneven -100 masks: per step the largest |gradient - one
    device's| and, after each SGD step, |parameter - one device's|; the reported losses."""
    import torch.nn.functional as F

    from labkit.parallel.torch_native import TorchNativeGPT, build_mesh
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=S, bias=False, vocab_size=32)
    ref = GPT(cfg, seed=0)
    model = TorchNativeGPT(ref, build_mesh(t, p, d, zero), "1f1b", 2, 1, zero=zero)
    if bug == "per_shard_mean":
        model.schedule._loss_fn = lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    opt = model.make_optimizer("sgd", 0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    named = dict(ref.named_parameters())
    out = []
    for x, y in batches(d, 2, 1):
        x, y = x % cfg.vocab_size, y.where(y < 0, y % cfg.vocab_size)
        model.zero_grad()
        loss = model.train_step(x, y)
        ref_opt.zero_grad()
        ref_loss = ref(x, y)
        ref_loss.backward()
        ge = max(float((gr - named[n].grad).abs().max()) for n, gr in model.full_tensors("grad"))
        opt.step()
        ref_opt.step()
        pe = max(float((q - named[n]).abs().max()) for n, q in model.full_tensors("param"))
        out.append((ge, pe, None if loss is None else abs(loss - ref_loss.item())))
    return out


@pytest.mark.parametrize("t,p,d,zero", [(1, 2, 2, 3), (2, 1, 2, 0)], ids=["pp2 dp2 FSDP2", "tp2 dp2 DDP mesh"])
def test_torch_native_uneven_ignored_targets_equal_one_device(t, p, d, zero):
    res = launch(_torch_worker, t * p * d, t, p, d, zero, None, timeout=120)
    ge = max(e[0] for r in res for e in r)
    pe = max(e[1] for r in res for e in r)
    le = max(e[2] for r in res for e in r if e[2] is not None)
    print(f"torch-native t{t} p{p} d{d}: largest gradient error {ge:.2e}, parameters {pe:.2e}, loss {le:.2e}")
    assert ge <= 1e-5 and pe <= 1e-5 and le <= 1e-5, (ge, pe, le)
    bad = launch(_torch_worker, t * p * d, t, p, d, zero, "per_shard_mean", timeout=120)
    ge_bad = max(e[0] for r in bad for e in r)
    print(f"torch-native t{t} p{p} d{d}, injected per-shard mean: largest gradient error {ge_bad}")
    assert not ge_bad <= 1e-5


# ----------------------------------------------------------------------------- ParallelMoEGPT (p = 1, EP = DP)
def _moe_dp_worker(ctx, bug):
    from labkit.parallel import ParallelMoEGPT
    d, M = 2, 2
    grid = make_grid(ctx, tp=1, pp=1, dp=d)
    pm = ParallelMoEGPT(model(True, d, M), grid, M, bucket_cap_mb=0.01)
    if bug == "per_shard_mean":       # injected: each microbatch's own token mean, then 1/M and the DP mean
        head = pm.model.head
        pm.loss_fn = lambda out, y, reduction="mean": head.loss(out, y)
        pm.tokens.piece_loss = lambda s: s
    pm.make_optimizer("sgd", 0.1)
    out = {"losses": [], "grads": [], "keep": True, "last": True}
    for x, y in batches(d, M, 1):
        pm.zero_grad()
        out["losses"].append(pm.train_step(x, y))
        out["grads"].append(pm.gather_full("grad"))
        pm.optimizer.step()
    out["params"] = pm.gather_full("param")
    return out


def test_parallel_moe_gpt_uneven_ignored_targets_equal_one_device():
    layout = (True, 1, 2, 1, 2)      # moe, cp, d, p, M
    grad_err, param_err, loss_err = errors("ParallelMoEGPT", launch(_moe_dp_worker, 2, None), layout=layout)
    print(f"ParallelMoEGPT: gradient errors {grad_err}, parameters {param_err:.2e}, loss {max(loss_err):.2e}")
    assert all(_ok(e) for e in grad_err) and _ok(param_err) and all(_ok(e) for e in loss_err)
    grad_err, _, _ = errors("ParallelMoEGPT", launch(_moe_dp_worker, 2, "per_shard_mean"), layout=layout)
    assert not _ok(max(grad_err)), grad_err


def test_the_planner_lists_the_count_on_the_last_stage_only():
    from labkit.plan.comm import comm_per_rank
    from labkit.plan.spec import Layout, ModelSpec
    spec = ModelSpec.from_gpt_config(GPTConfig(n_layer=4, n_head=4, n_kv_head=2, n_embd=16, block_size=S,
                                               vocab_size=64), seq_len=S, global_batch=B)
    for lay, last in ((Layout(p=2, d=2, b=2, M=2, precision="fp32"), 1),
                      (Layout(p=2, d=1, cp=2, b=4, M=2, precision="fp32"), 1),
                      (Layout(p=2, d=2, v=2, b=1, M=4, schedule="interleaved", placement="v", precision="fp32"), 0)):
        for r in range(2):
            loss = comm_per_rank(spec, lay, pp_rank=r, act_bytes=4)["loss"]
            assert loss.ops == ({"all_reduce": (2, 16)} if r == last else {}), (lay, r, loss.ops)
            assert loss.group == lay.d * lay.cp
    assert not comm_per_rank(spec, Layout(p=2, b=4, M=2, precision="fp32"), pp_rank=1)["loss"].ops   # d cp = 1
