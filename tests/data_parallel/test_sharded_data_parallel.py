"""ZeRO-2, ZeRO-3 / FSDP and HSDP against one device: every gradient, parameters after 3 SGD and
5 Adam steps, with gradient accumulation; per-rank memory = 1/d; bytes communicated = formula."""
import pytest
import torch

from labkit.comm import CommLog
from labkit.data_parallel import (
    FullyShardedDataParallel,
    ZeroStage2,
    expected_fsdp,
    expected_zero2,
    optimizer_state_bytes,
)
from labkit.data_parallel.flat import padded_numel, shard_flat, unshard_flat
from labkit.dist import launch
from labkit.grid import Mesh
from labkit.model import GPT, GPTConfig
from labkit.plan.comm import comm_per_rank
from labkit.plan.memory import memory_per_rank, zero3_units
from labkit.plan.spec import Layout, ModelSpec

# bias=False: see tests/data_parallel/test_data_parallel.py (the key bias's gradient is pure rounding noise)
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=False)
B, S, LR = 24, 8, 0.1   # B divisible by d = 2, 3, 4 and by 2 microbatches per rank


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CFG.vocab_size, (B, S), generator=g),
             torch.randint(0, CFG.vocab_size, (B, S), generator=g)) for _ in range(n)]


def make_opt(params, opt):
    return torch.optim.SGD(params, lr=LR) if opt == "sgd" else torch.optim.Adam(params, lr=1e-2)


def reference(steps, opt, cfg=CFG, make=make_opt):
    """Single-device training of ``cfg``'s GPT: per-step gradients, final parameters (a tied
    matrix under both its names), optimizer state bytes."""
    model = GPT(cfg, seed=0)
    o = make(model.parameters(), opt)
    grads = []
    for x, y in batches(steps):
        o.zero_grad()
        model(x, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        o.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return grads, params, optimizer_state_bytes(o)


def assert_close(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-6), f"{what}: {k} differs"


# ------------------------------------------------------------------ ZeRO-3 / FSDP

def _fsdp_worker(ctx, steps, opt_name, reshard, accum, bug, hsdp):
    rep_group = shard_group = None
    if hsdp:                                   # 2-D DP mesh (replicate R=2, shard S=d/2), shard innermost
        mesh = Mesh(replicate=2, shard=ctx.world_size // 2)
        shard_group, rep_group = mesh.new_groups(ctx, "shard"), mesh.new_groups(ctx, "replicate")
    model = GPT(CFG, seed=0)
    fsdp = FullyShardedDataParallel(model, process_group=shard_group, reshard_after_forward=reshard,
                                    replicate_group=rep_group)
    if bug == "no_average":
        fsdp.d = 1
    opt = make_opt(fsdp.parameters(), opt_name)
    grads, logs, peaks = [], [], []
    for x, y in batches(steps):
        d, r = ctx.world_size, ctx.rank
        sl = slice(r * B // d, (r + 1) * B // d)
        xs, ys = x[sl], y[sl]
        m = xs.shape[0] // accum
        opt.zero_grad(set_to_none=True)
        fsdp.reset_peak()
        with CommLog() as log:
            for j in range(accum):
                loss = fsdp(xs[j * m:(j + 1) * m], ys[j * m:(j + 1) * m]) / accum
                if j < accum - 1:
                    with fsdp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        logs.append(log.summary())
        peaks.append(fsdp.peak_gathered_bytes)
        grads.append(fsdp.full_tensors("grad"))
        grad_bytes = fsdp.grad_bytes()
    return {"grads": grads, "params": fsdp.full_tensors("param"), "logs": logs, "peaks": peaks,
            "shard_bytes": fsdp.shard_bytes(), "grad_bytes": grad_bytes, "state": optimizer_state_bytes(opt),
            "units": [u.numel for u in fsdp.units], "live_after": fsdp._live,
            "module_params": sum(1 for _ in model.parameters())}


FSDP_CASES = [  # d, optimizer, steps, reshard_after_forward, microbatches
    (2, "sgd", 3, True, 1),
    (4, "sgd", 3, True, 2),
    (2, "sgd", 3, False, 2),
    (2, "adam", 5, True, 1),
    (4, "adam", 5, False, 1),
    (3, "sgd", 2, True, 1),     # d = 3: the blocks' 3136 elements are padded to 3138
]


@pytest.mark.parametrize("d,opt_name,steps,reshard,accum", FSDP_CASES)
def test_fsdp_equals_single_device(d, opt_name, steps, reshard, accum):
    ref_grads, ref_params, full_state = reference(steps, opt_name)
    out = launch(_fsdp_worker, d, steps, opt_name, reshard, accum, None, False, backend="gloo")
    for rank in out:
        if opt_name == "sgd":
            for step in range(steps):
                assert_close(rank["grads"][step], ref_grads[step], f"gradient at step {step}")
        assert_close(rank["params"], ref_params, "parameters after the steps")
        assert rank["module_params"] == 0 and rank["live_after"] == 0   # nothing gathered between steps
    units = out[0]["units"]
    # embedding (wte 256x16 + wpe 8x16), two blocks (2*16 + 4*256 + 2*16 + 2*1024), head (ln_f 32 + 16x256)
    assert units == [4224, 3136, 3136, 4128]
    exp = expected_fsdp(units, d, reshard)
    pads = [padded_numel(n, d) for n in units]
    # exact counts, padding included: 4 units gathered twice per microbatch (forward, backward)
    # when resharded, once when not; one reduce-scatter per unit after the last microbatch
    assert exp["all_gather"] == ((8 if reshard else 4), sum(p // d for p in pads) * 4 * (2 if reshard else 1))
    assert exp["reduce_scatter"] == (4, sum(pads) * 4)
    assert sum(pads) == (14624 if d in (2, 4) else 14628)     # d = 3: each block padded by 2
    for rank in out:
        for log in rank["logs"]:
            assert log == {("all_gather", d): (exp["all_gather"][0] * accum, exp["all_gather"][1] * accum),
                           ("reduce_scatter", d): exp["reduce_scatter"]}
    # ring bytes: 3 (d-1)/d n_pad (resharded) = 1.5x DP's all-reduce 2 (d-1)/d of the same n_pad,
    # or 2 (d-1)/d n_pad = 1x; against the unpadded all-reduce the padding adds n_pad/n
    n, ring = sum(units), exp["ring_bytes"]
    assert ring == (3 if reshard else 2) * (d - 1) * sum(pads) * 4 // d
    assert 2 * ring == (3 if reshard else 2) * (2 * (d - 1) * sum(pads) * 4 // d)
    assert exp["dp_all_reduce_ring_bytes"] == 2 * (d - 1) * n * 4 // d
    # memory per rank: 1/d of the unsharded, padding included
    for rank in out:
        assert rank["shard_bytes"] == exp["shard_bytes"] == sum(pads) // d * 4
        assert rank["grad_bytes"] == exp["shard_bytes"]
        if opt_name == "adam":
            assert rank["state"] == 2 * exp["shard_bytes"] and full_state == 2 * n * 4
        assert max(rank["peaks"]) == exp["peak_gathered_bytes"]
    # the planner = measured: model states exact, gathered peak exact, DP traffic exact
    spec = ModelSpec.from_gpt_config(CFG, seq_len=S, global_batch=B)
    lay = Layout(t=1, p=1, d=d, b=B // d // accum, M=accum, zero=3, precision="fp32", reshard_after_forward=reshard)
    assert zero3_units(spec, lay, 0) == units
    mem = memory_per_rank(spec, lay, device="cpu")[0]
    assert (mem.params, mem.grads, mem.gathered) == (out[0]["shard_bytes"], out[0]["grad_bytes"], max(out[0]["peaks"]))
    if opt_name == "adam":
        assert mem.optimizer == out[0]["state"]
    assert comm_per_rank(spec, lay)["dp"].ops == {"all_gather": out[0]["logs"][0][("all_gather", d)],
                                                  "reduce_scatter": out[0]["logs"][0][("reduce_scatter", d)]}
    if reshard:
        # two neighbouring units at once (prefetch): here the embedding and the first block
        assert exp["peak_gathered_bytes"] == (pads[0] + pads[1]) * 4
    else:
        assert exp["peak_gathered_bytes"] == sum(pads) * 4


def test_fsdp_check_catches_missing_average():
    ref_grads, _, _ = reference(1, "sgd")
    out = launch(_fsdp_worker, 2, 1, "sgd", True, 1, "no_average", False, backend="gloo")
    with pytest.raises(AssertionError):
        assert_close(out[0]["grads"][0], ref_grads[0], "gradient")


@pytest.mark.parametrize("reshard", [True, False])
def test_hsdp_equals_single_device(reshard):
    """4 ranks = 2 replicas x 2 shards: reduce-scatter in the shard group, all-reduce across."""
    ref_grads, ref_params, _ = reference(3, "sgd")
    out = launch(_fsdp_worker, 4, 3, "sgd", reshard, 1, None, True, backend="gloo")
    units = out[0]["units"]
    exp = expected_fsdp(units, 2, reshard, replicas=2)
    for rank in out:
        for step in range(3):
            assert_close(rank["grads"][step], ref_grads[step], f"gradient at step {step}")
        assert_close(rank["params"], ref_params, "parameters")
        for log in rank["logs"]:
            assert log[("all_gather", 2)] == exp["all_gather"]
            assert log[("reduce_scatter", 2)] == exp["reduce_scatter"]
            assert log[("all_reduce", 2)] == exp["all_reduce"] == (4, exp["shard_bytes"])
        assert rank["shard_bytes"] == sum(padded_numel(n, 2) for n in units) // 2 * 4


TIED = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, bias=False, share_embeddings_and_output_weights=True)


def _tied_worker(ctx, steps, opt_name, reshard, bug):
    model = GPT(TIED, seed=0)
    fsdp = FullyShardedDataParallel(model, reshard_after_forward=reshard)
    if bug == "reshard_after_embedding":          # injected: the shared unit freed after its first call
        post = fsdp._post_forward

        def early(c, out):
            out = post(c, out)
            fsdp._reshard(fsdp.units[fsdp.calls[c][0]])
            return out
        fsdp._post_forward = early
    opt = tied_opt(fsdp.parameters(), opt_name)
    d, r = ctx.world_size, ctx.rank
    grads, logs, peaks = [], [], []
    for x, y in batches(steps):
        sl = slice(r * B // d, (r + 1) * B // d)
        opt.zero_grad(set_to_none=True)
        fsdp.reset_peak()
        with CommLog() as log:
            fsdp(x[sl], y[sl]).backward()
            opt.step()
        logs.append(log.summary())
        peaks.append(fsdp.peak_gathered_bytes)
        grads.append(fsdp.full_tensors("grad"))
    return {"grads": grads, "params": fsdp.full_tensors("param"), "logs": logs, "peaks": peaks,
            "units": [u.numel for u in fsdp.units], "names": [u.name for u in fsdp.units], "live_after": fsdp._live}


def tied_opt(params, opt):
    # Adam: the tied matrix's two gradient contributions are summed in another order than on one
    # device (~1e-7 relative); lr=1e-3 and eps=1e-6 keep Adam's amplification of that within fp32
    # tolerance (as tests/parallel/test_parallel_3d.py's ADAM)
    return torch.optim.SGD(params, lr=LR) if opt == "sgd" else torch.optim.Adam(params, lr=1e-3, eps=1e-6)


@pytest.mark.parametrize("opt_name,steps,reshard", [("sgd", 3, True), ("adam", 3, False)])
def test_fsdp_tied_embedding_one_unit(opt_name, steps, reshard):
    """A tied embedding and output layer: the modules sharing the matrix are one unit (gathered
    before the embedding's forward, kept for the head's, its gradient the sum of both uses before
    the one reduce-scatter). Equal to one device; gathers, peak and traffic = the planner."""
    ref_grads, ref_params, _ = reference(steps, opt_name, TIED, tied_opt)
    out = launch(_tied_worker, 2, steps, opt_name, reshard, None, backend="gloo")
    for rank in out:
        if opt_name == "sgd":
            for step in range(steps):
                assert_close(rank["grads"][step], ref_grads[step], f"gradient at step {step}")
        assert_close(rank["params"], ref_params, "parameters after the steps")
        assert rank["live_after"] == 0
    assert out[0]["names"] == ["embedding+head", "blocks.0", "blocks.1"]
    spec = ModelSpec.from_gpt_config(TIED, seq_len=S, global_batch=B)
    lay = Layout(t=1, p=1, d=2, b=B // 2, M=1, zero=3, precision="fp32", reshard_after_forward=reshard)
    assert zero3_units(spec, lay, 0) == out[0]["units"] == [4224 + 32, 3136, 3136]
    assert memory_per_rank(spec, lay, device="cpu")[0].gathered == max(out[0]["peaks"])
    for log in out[0]["logs"]:
        assert comm_per_rank(spec, lay)["dp"].ops == {"all_gather": log[("all_gather", 2)],
                                                      "reduce_scatter": log[("reduce_scatter", 2)]}


def test_fsdp_tied_check_catches_early_reshard():
    """Resharding the shared unit after the embedding's forward gathers it again for the head: the
    planner's count of all-gathers tells."""
    out = launch(_tied_worker, 2, 1, "sgd", True, "reshard_after_embedding", backend="gloo")
    spec = ModelSpec.from_gpt_config(TIED, seq_len=S, global_batch=B)
    lay = Layout(t=1, p=1, d=2, b=B // 2, M=1, zero=3, precision="fp32")
    assert comm_per_rank(spec, lay)["dp"].ops["all_gather"] != out[0]["logs"][0][("all_gather", 2)]


def _timeline_worker(ctx, prefetch):
    fsdp = FullyShardedDataParallel(GPT(CFG, seed=0), prefetch=prefetch)
    x, y = batches(1)[0]
    fsdp(x[:2], y[:2]).backward()
    return [(e["unit"], e["kind"], e["phase"]) for e in fsdp.timeline]


def test_fsdp_timeline_shows_prefetch():
    with_pf, without = launch(_timeline_worker, 2, True, backend="gloo")[0], \
        launch(_timeline_worker, 2, False, backend="gloo")[0]
    ag = lambda tl: [(u, ph) for u, k, ph in tl if k == "all_gather"]   # noqa: E731
    order = ["embedding", "blocks.0", "blocks.1", "head"]
    assert ag(with_pf) == ag(without) == [(u, "forward") for u in order] + [(u, "backward") for u in order[::-1]]
    # with prefetch, unit i+1's gather starts before unit i's forward; without, after
    fwd = lambda tl, u: tl.index((u, "forward", "forward"))              # noqa: E731
    gat = lambda tl, u, ph: tl.index((u, "all_gather", ph))              # noqa: E731
    assert gat(with_pf, "blocks.0", "forward") < fwd(with_pf, "embedding")
    assert gat(without, "blocks.0", "forward") > fwd(without, "embedding")
    assert [u for u, k, _ in with_pf if k == "reduce_scatter"] == order[::-1]


# ------------------------------------------------------------------ ZeRO-2

def _zero2_worker(ctx, steps, opt_name, accum, cap, bug):
    model = GPT(CFG, seed=0)
    kw = {"lr": LR} if opt_name == "sgd" else {"lr": 1e-2}
    z = ZeroStage2(model, torch.optim.SGD if opt_name == "sgd" else torch.optim.Adam, bucket_cap_mb=cap, **kw)
    if bug == "no_average":
        z.d = 1
    d, r = ctx.world_size, ctx.rank
    logs, grad_bytes = [], []
    for x, y in batches(steps):
        sl = slice(r * B // d, (r + 1) * B // d)
        xs, ys = x[sl], y[sl]
        m = xs.shape[0] // accum
        z.zero_grad()
        with CommLog() as log:
            for j in range(accum):
                loss = z(xs[j * m:(j + 1) * m], ys[j * m:(j + 1) * m]) / accum
                if j < accum - 1:
                    with z.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            grad_bytes.append(z.grad_bytes())
            z.step()
        logs.append(log.summary())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "logs": logs,
            "grad_bytes": grad_bytes, "state": optimizer_state_bytes(z.optim),
            "numels": [p.numel() for p in reversed(list(model.parameters()))], "buckets": len(z.buckets)}


def _zero2_grad_worker(ctx, cap):
    model = GPT(CFG, seed=0)
    z = ZeroStage2(model, torch.optim.SGD, bucket_cap_mb=cap, lr=LR)
    d, r = ctx.world_size, ctx.rank
    x, y = batches(1)[0]
    sl = slice(r * B // d, (r + 1) * B // d)
    z(x[sl], y[sl]).backward()
    full = z.full_grads()
    return {n: full[id(p)] for n, p in model.named_parameters()}


@pytest.mark.parametrize("d,opt_name,steps,accum", [(2, "sgd", 3, 2), (4, "adam", 5, 1), (4, "sgd", 3, 1),
                                                         (3, "sgd", 2, 1)])
def test_zero2_equals_single_device(d, opt_name, steps, accum):
    _, ref_params, full_state = reference(steps, opt_name)
    cap = 0.01   # ~10 KB buckets: several reduce-scatters, started while backward runs
    out = launch(_zero2_worker, d, steps, opt_name, accum, cap, None, backend="gloo")
    exp = expected_zero2(out[0]["numels"], cap, d)
    assert exp["buckets"] == out[0]["buckets"] > 2
    assert sum(out[0]["numels"]) == 14624
    if d == 3:   # padding is traffic: 5 buckets padded to multiples of 3 add 7 elements in all
        assert exp["reduce_scatter"] == (5, (14624 + 7) * 4) and exp["all_gather"] == (5, (14624 + 7) // 3 * 4)
    for rank in out:
        assert_close(rank["params"], ref_params, "parameters after the steps")
        for log in rank["logs"]:
            assert log == {("reduce_scatter", d): exp["reduce_scatter"], ("all_gather", d): exp["all_gather"]}
        assert rank["grad_bytes"] == [exp["shard_bytes"]] * steps           # no full gradient left
        if opt_name == "adam":
            assert rank["state"] == 2 * exp["shard_bytes"] and full_state == 2 * sum(rank["numels"]) * 4
    if d != 3:   # the planner = measured (its one flat buffer needs no padding here, nor do the buckets)
        mem = memory_per_rank(ModelSpec.from_gpt_config(CFG, seq_len=S, global_batch=B),
                              Layout(d=d, b=B // d, zero=2, precision="fp32"), device="cpu")[0]
        assert mem.grads == exp["shard_bytes"] and mem.params == sum(out[0]["numels"]) * 4
        if opt_name == "adam":
            assert mem.optimizer == out[0]["state"]


def test_zero2_gradients_equal_single_device():
    ref_grads, _, _ = reference(1, "sgd")
    for g in launch(_zero2_grad_worker, 2, 0.01, backend="gloo"):
        assert_close(g, ref_grads[0], "gradient")


def test_zero2_check_catches_missing_average():
    _, ref_params, _ = reference(2, "sgd")
    out = launch(_zero2_worker, 2, 2, "sgd", 1, 0.01, "no_average", backend="gloo")
    with pytest.raises(AssertionError):
        assert_close(out[0]["params"], ref_params, "parameters")


# ------------------------------------------------------------------ flat shards

def test_shard_and_unshard_with_padding():
    flat = torch.arange(10.0)
    shards = [shard_flat(flat, 4, r) for r in range(4)]
    assert [s.tolist() for s in shards] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 0]]
    assert torch.equal(unshard_flat(shards, 10), flat)
    assert padded_numel(10, 4) == 12 and padded_numel(12, 4) == 12
    with pytest.raises(ValueError, match="rank"):
        shard_flat(flat, 4, 4)
