"""labkit.data_parallel against one device: DDP (bucketed, overlapped, no_sync) and ZeRO-1."""
import math

import pytest
import torch

from labkit.comm import CommLog
from labkit.data_parallel import DistributedDataParallel, ZeroRedundancyOptimizer, assign_buckets, optimizer_state_bytes
from labkit.dist import launch
from labkit.model import GPT, GPTConfig
from labkit.plan.comm import comm_per_rank
from labkit.plan.spec import Layout, ModelSpec

# bias=False: the key bias has a gradient that is exactly zero in exact arithmetic (softmax is
# invariant to it); in fp32 it is ~1e-10 of rounding noise, which Adam's g/sqrt(v) blows up to
# +-lr, so any change of summation order would show there and nowhere else.
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=False)
B, S, LR = 4, 8, 0.1


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG.vocab_size, (B, S), generator=g),
             torch.randint(0, CFG.vocab_size, (B, S), generator=g)) for _ in range(n)]


def reference(steps, opt="sgd"):
    """Single device: per-step gradients and the final parameters."""
    model = GPT(CFG, seed=0)
    o = torch.optim.SGD(model.parameters(), lr=LR) if opt == "sgd" else torch.optim.Adam(model.parameters(), lr=1e-2)
    grads = []
    for x, y in batches(steps):
        o.zero_grad()
        model(x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        o.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer_state_bytes(o)


def close(a, b):
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a) and a.keys() == b.keys()


def _ddp_worker(ctx, steps, bucket_cap_mb, bug):
    d, r = ctx.world_size, ctx.rank
    model = GPT(CFG, seed=r)                # rank 1 starts from other weights: DDP must broadcast rank 0's
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    if bug == "no_average":
        ddp.d = 1                            # injected bug: sum instead of mean
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    grads, counts, overlaps = [], [], []
    for x, y in batches(steps):
        sl = slice(r * B // d, (r + 1) * B // d)
        opt.zero_grad()
        with CommLog() as log:
            if bug == "no_sync":             # gradient accumulation: 2 microbatches, sync on the last
                half = B // d // 2
                xs, ys = x[sl], y[sl]
                with ddp.no_sync():
                    (ddp(xs[:half], ys[:half]) / 2).backward()
                (ddp(xs[half:], ys[half:]) / 2).backward()
            else:
                ddp(x[sl], y[sl]).backward()
        counts.append((log.count("all_reduce"), log.bytes("all_reduce"), log.count()))
        overlaps.append(ddp.last_overlap)
        grads.append({n.removeprefix("module."): p.grad.clone() for n, p in ddp.named_parameters()})
        opt.step()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "counts": counts, "overlap": overlaps, "buckets": len(ddp.buckets),
            "numels": [p.numel() for p in reversed(list(model.parameters()))]}


@pytest.mark.parametrize("mode", ["plain", "no_sync"])
def test_ddp_equals_single_device_sgd(mode):
    ref_grads, ref_params, _ = reference(3)
    cap = 0.01  # ~10 KB buckets: several buckets, so that some all-reduces run during backward
    out = launch(_ddp_worker, 2, 3, cap, None if mode == "plain" else "no_sync", backend="gloo")
    for rank in out:
        for step in range(3):
            assert close(rank["grads"][step], ref_grads[step]), f"gradients differ at step {step}"
        assert close(rank["params"], ref_params)
    # exact communication per step: one all-reduce per bucket, payload = every gradient's bytes
    buckets = len(assign_buckets([4 * n for n in out[0]["numels"]], cap))
    assert buckets == out[0]["buckets"] > 3
    spec = ModelSpec.from_gpt_config(CFG, seq_len=S, global_batch=B)
    dp = comm_per_rank(spec, Layout(d=2, b=B // 2, M=1, precision="fp32"), act_bytes=4, dp_buckets=buckets)["dp"]
    assert dp.ops == {"all_reduce": (buckets, 4 * sum(out[0]["numels"]))}   # the planner's bytes
    for c in out[0]["counts"]:
        assert c == (*dp.ops["all_reduce"], buckets)  # nothing else communicated
    assert dp.wire == dp.ops["all_reduce"][1]  # d = 2: 2(d-1)/d = 1
    if mode == "plain":
        assert max(out[0]["overlap"]) > 0, "no all-reduce overlapped backward"


def test_ddp_check_catches_missing_average():
    ref_grads, _, _ = reference(1)
    out = launch(_ddp_worker, 2, 1, 0.01, "no_average", backend="gloo")
    assert not close(out[0]["grads"][0], ref_grads[0])


def test_ddp_bad_bucket_cap():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(GPT(CFG), bucket_cap_mb=0)


def _zero_worker(ctx, steps, opt_name, bug):
    d, r = ctx.world_size, ctx.rank
    model = GPT(CFG, seed=0)
    if opt_name == "adam":
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2)
    else:
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=LR)
    counts = []
    for x, y in batches(steps):
        sl = slice(r * B // d, (r + 1) * B // d)
        zero.zero_grad()
        model(x[sl], y[sl]).backward()
        if bug:
            zero.d = 1
        with CommLog() as log:
            zero.step()
        counts.append(log.summary())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "counts": counts,
            "state": zero.state_bytes(), "numel": zero.numel, "padded": zero.padded}


@pytest.mark.parametrize("opt_name,steps", [("adam", 5), ("sgd", 3)])
def test_zero1_equals_single_device(opt_name, steps):
    _, ref_params, full_state = reference(steps, opt_name)
    d = 2
    out = launch(_zero_worker, d, steps, opt_name, False, backend="gloo")
    for rank in out:
        assert close(rank["params"], ref_params)
    n, padded = out[0]["numel"], out[0]["padded"]
    assert padded == math.ceil(n / d) * d
    for c in out[0]["counts"]:  # one reduce-scatter of the n (padded) gradient elements, one all-gather of n/d
        assert c == {("reduce_scatter", d): (1, padded * 4), ("all_gather", d): (1, padded // d * 4)}
    # in a ring, reduce-scatter + all-gather send what DP's all-reduce of the same n sends: 2(d-1)/d * n
    from labkit.comm import CommRecord, ring_wire_bytes
    for dd in (2, 4, 8):
        n_bytes = 4 * dd * 1000
        rs, ag, ar = (CommRecord(k, dd, b, (), "float32") for k, b in
                      (("reduce_scatter", n_bytes), ("all_gather", n_bytes // dd), ("all_reduce", n_bytes)))
        assert ring_wire_bytes(rs) + ring_wire_bytes(ag) == ring_wire_bytes(ar) == 2 * (dd - 1) * n_bytes // dd
    if opt_name == "adam":      # exp_avg and exp_avg_sq of n/d elements instead of n
        assert full_state == 2 * n * 4
        assert out[0]["state"] == 2 * (padded // d) * 4
        assert out[0]["state"] * d == 2 * padded * 4


def test_zero1_check_catches_missing_average():
    _, ref_params, _ = reference(2, "sgd")
    out = launch(_zero_worker, 2, 2, "sgd", True, backend="gloo")
    assert not close(out[0]["params"], ref_params)


def _unused_worker(ctx):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 4), "unused": torch.nn.Linear(4, 4)})
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-5)   # one bucket per parameter
    x = torch.full((2, 4), float(ctx.rank + 1))
    model["used"](x).sum().backward()
    try:
        ddp(x)                          # the sync is still open: unused parameters got no gradient
        raised = None
    except RuntimeError as e:
        raised = str(e)
    ddp.finish_grad_sync()
    return raised, model["used"].weight.grad.clone(), model["unused"].weight.grad.clone()


def test_ddp_unused_parameters_need_finish_grad_sync():
    out = launch(_unused_worker, 2, backend="gloo")
    for raised, g_used, g_unused in out:
        assert raised is not None and "finish_grad_sync" in raised and "unused.weight" in raised
        # mean over the ranks of x.sum(0) broadcast: rows (1+1, 2+2)/2 -> every entry (2 + 4) / 2 = 3
        assert torch.equal(g_used, torch.full((4, 4), 3.0)) and torch.equal(g_unused, torch.zeros(4, 4))
