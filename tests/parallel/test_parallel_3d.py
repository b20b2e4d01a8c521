"""3D parallelism (labkit.parallel) against one device: loss curve, every parameter gradient
(gathered to full shape) at every step and the parameters after 3 plain-SGD steps; ZeRO-1
with Adam over 5 steps; exact communication per axis; the error table."""
import contextlib

import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import launch, make_grid
from labkit.model import GPT, GPTConfig
from labkit.parallel import ParallelGPT, check_layout
from labkit.parallel.gpt import planner_spec
from labkit.pipeline.registry import lookup
from labkit.plan.memory import memory_per_rank, zero3_split_gathered_peak
from labkit.plan.spec import Layout

B, S = 8, 8


def cfg_for(tied=False, n_layer=4):
    # bias=False: see tests/data_parallel/test_data_parallel.py (a key bias has a pure-rounding-noise gradient)
    return GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=S, bias=False,
                     share_embeddings_and_output_weights=tied)


def batches(cfg, n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, cfg.vocab_size, (B, S), generator=g),
             torch.randint(0, cfg.vocab_size, (B, S), generator=g)) for _ in range(n)]


# Adam: g / sqrt(v) amplifies the ~1e-7 relative rounding difference of another summation order
# on elements with tiny gradients; with lr=1e-2 and the default eps a few elements of this tiny
# model drift 2e-6..1e-5 apart within 5 steps. lr=1e-3 and eps=1e-6 keep that below the fp32
# tolerance while the moments still decide every update (the test below fails without ZeRO's 1/d).
ADAM = {"eps": 1e-6}


def reference(cfg, steps, opt="sgd", lr=0.1):
    model = GPT(cfg, seed=0)
    o = torch.optim.SGD(model.parameters(), lr=lr) if opt == "sgd" else torch.optim.Adam(model.parameters(), lr=lr,
                                                                                        **ADAM)
    losses, grads = [], []
    for x, y in batches(cfg, steps):
        o.zero_grad()
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)})
        o.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _worker(ctx, cfg, t, p, d, schedule, v, M, steps, opt, lr, zero, bug, hsdp=1, sp=False, recompute="none"):
    grid = make_grid(ctx, tp=t, pp=p, dp=d)
    pg = ParallelGPT(GPT(cfg, seed=0), grid, schedule, M, v=v, zero=zero, bucket_cap_mb=0.002, hsdp=hsdp,
                     sequence_parallel=sp, recompute=recompute)
    if bug == "no_dp_average":                        # injected: ZeRO-2/3 shards summed over DP, not averaged
        for w in pg.sharded:
            w.d, w.replicas = 1, 1
    if bug == "reshard_every_w":                      # injected: FSDP reshards after every W, not the last
        for w in pg.sharded:
            def every(i, w=w, post=w._post_backward):
                split, w._split = w._split, "last" if w._split else None
                try:
                    post(i)
                finally:
                    w._split = split
            w._post_backward = every
    if bug == "reduce_scatter_every_w":               # injected: FSDP reduce-scatters before the last W
        for w in pg.sharded:
            w.no_sync = contextlib.nullcontext
    pg.make_optimizer(opt, lr, **(ADAM if opt == "adam" else {}))
    if bug == "no_embedding_allreduce":               # injected: tied copies not summed
        pg.emb_group = None
    keep = grid.dp_rank == 0 and grid.tp_rank == 0     # one copy of each stage goes back
    out = {"losses": [], "grads": [], "comm": [], "expected": pg.expected_comm(B, S), "peers": set(),
           "tp_rank": grid.tp_rank, "pp_rank": grid.pp_rank, "last": pg.has_last_stage, "keep": keep}
    for x, y in batches(cfg, steps):
        pg.zero_grad()
        with CommLog() as log:
            out["losses"].append(pg.train_step(x, y))
            if bug == "double_scale":                  # injected: gradients scaled by 1/d twice
                for q in pg.parameters():
                    q.grad.div_(d)
            pg.optimizer.step()
        out["comm"].append(pg.comm_by_axis(log.records))
        # every send/recv goes to the rank with the same (dp_rank, tp_rank) on another pipeline rank
        out["peers"].update((r.peer % (d * t), r.peer // (d * t) != grid.pp_rank)
                            for r in log.records if r.peer is not None)
        out["me"] = ctx.rank % (d * t)
        grads = pg.gather_full("grad") if zero != 1 else None  # after the step: not counted (ZeRO-1 keeps none)
        if keep:
            out["grads"].append(grads)
    params = pg.gather_full("param")
    out["params"] = params if keep else None
    out["memory"] = pg.memory()
    return out


def run(cfg, t, p, d, schedule="1f1b", v=1, M=2, steps=3, opt="sgd", lr=0.1, zero=False, bug=None, hsdp=1,
        sp=False, recompute="none"):
    return launch(_worker, t * p * d, cfg, t, p, d, schedule, v, M, steps, opt, lr, zero, bug, hsdp, sp, recompute,
                  backend="gloo")


def merged(out, key, step=None):
    full = {}
    for r in out:
        if not r["keep"]:
            continue
        part = r[key] if step is None else r[key][step]
        full.update(part)
    return full


def close(a, b):
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    bad = [k for k in a if not torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6)]
    return not bad, bad


def check_equal(out, cfg, steps, opt="sgd", lr=0.1, grads=True):
    ref_losses, ref_grads, ref_params = reference(cfg, steps, opt, lr)
    for step in range(steps):
        # loss of the global batch = mean over the DP ranks of their last-stage losses
        ls = [r["losses"][step] for r in out if r["last"] and r["tp_rank"] == 0]
        assert abs(sum(ls) / len(ls) - ref_losses[step]) < 1e-5, (step, ls, ref_losses[step])
        if grads:
            ok, bad = close(merged(out, "grads", step), ref_grads[step])
            assert ok, f"step {step}: gradients differ for {bad}"
    ok, bad = close(merged(out, "params"), ref_params)
    assert ok, f"parameters differ after {steps} steps: {bad}"


def check_comm(out):
    for r in out:
        assert r["peers"] <= {(r["me"], True)}, r["peers"]
        for step_counts in r["comm"][1:]:       # after the first step (shape messages)
            assert step_counts == r["expected"], (step_counts, r["expected"])


GRIDS = [  # (t, p, d, schedule, v)
    (2, 2, 1, "1f1b", 1),
    (1, 2, 2, "interleaved", 2),
    (2, 1, 2, "1f1b", 1),
    (1, 1, 4, "1f1b", 1),
    (2, 2, 1, "zbh1", 1),          # zero-bubble: backward split into I and W, DDP/TP inside
    (1, 2, 2, "zbv", 2),           # V placement: rank r holds stages r and 2p-1-r
]


@pytest.mark.parametrize("t,p,d,schedule,v", GRIDS)
def test_3d_equals_single_device_sgd(t, p, d, schedule, v):
    cfg = cfg_for()
    out = run(cfg, t, p, d, schedule, v, M=2 if schedule != "zbv" else 4)
    check_equal(out, cfg, 3)
    check_comm(out)


def test_3d_2x2x2_interleaved_sgd_and_counts():
    cfg = cfg_for()
    out = run(cfg, 2, 2, 2, "interleaved", 2, M=2)
    check_equal(out, cfg, 3)
    check_comm(out)
    # the last stage also counts the step's valid targets and reports its loss (labkit.parallel.loss)
    assert all(set(r["comm"][-1]) == {"tp", "pp", "dp"} | ({"loss"} if r["last"] else set()) for r in out)


def test_3d_2x2x2_1f1b_zero1_adam():
    cfg = cfg_for()
    out = run(cfg, 2, 2, 2, "1f1b", 1, M=2, steps=5, opt="adam", lr=1e-3, zero=True)
    check_equal(out, cfg, 5, "adam", 1e-3, grads=False)
    check_comm(out)
    # optimizer state: 1/d of the unsharded Adam's two moments for this rank's parameters
    for r in out:
        n = r["memory"]["params"] // 4
        assert r["memory"]["optimizer"] == 2 * (-(-n // 2)) * 4


@pytest.mark.parametrize("t,p,d,zero,hsdp,schedule", [(1, 2, 2, 2, 1, "1f1b"), (2, 1, 2, 3, 1, "1f1b"),
                                                      (1, 1, 4, 3, 2, "1f1b"), (1, 1, 4, 3, 2, "zbh1")])
def test_3d_zero2_zero3_hsdp_sgd(t, p, d, zero, hsdp, schedule):
    """ZeRO-2 under PP, ZeRO-3 under TP, HSDP (2 replicas x 2 shards; also under ZB-H1's split
    backward): every parameter gradient at every step and the parameters after 3 SGD steps equal
    one device; M = 2 microbatches reduce once per step; counts = formula; model states 1/d (HSDP:
    1/(d/R)) of the TP-local ones."""
    cfg = cfg_for()
    out = run(cfg, t, p, d, schedule, 1, M=2, zero=zero, hsdp=hsdp)
    check_equal(out, cfg, 3)
    check_comm(out)
    shards = d // hsdp
    for r in out:
        dp = r["comm"][-1]["dp"]
        assert dp["reduce_scatter"][0] == r["expected"]["dp"]["reduce_scatter"][0] >= 1
        mem = r["memory"]
        assert mem["grads"] * shards == dp["reduce_scatter"][1]      # the shard of the padded gradient
        if zero == 3:
            assert mem["params"] == mem["grads"] and 0 < mem["gathered"]
            assert ("all_reduce" in dp) == (hsdp > 1)


@pytest.mark.parametrize("t,p,d,zero,sp,recompute", [
    (1, 2, 2, 2, False, "full"),      # (a) the recompute's nested backwards keep ZeRO-2's sync open
    (2, 1, 2, 2, True, "full"),       # (b) SP: LayerNorm gradients summed over TP in the hooks; and (a)
    (2, 1, 2, 3, True, "none"),       # (b) under FSDP: per unit, before its reduce-scatter
])
def test_3d_zero23_with_sp_and_full_recompute(t, p, d, zero, sp, recompute):
    """ZeRO-2/3 composed with sequence parallelism and full recompute (issue 19): every parameter
    gradient at every step and the parameters after 3 SGD steps equal one device; each bucket/unit
    reduce-scattered once per step and the SP all-reduces as the planner counts them (check_comm)."""
    cfg = cfg_for()
    out = run(cfg, t, p, d, "1f1b", 1, M=2, zero=zero, sp=sp, recompute=recompute)
    check_equal(out, cfg, 3)
    check_comm(out)
    if sp:
        assert all(r["comm"][-1]["tp"]["all_reduce"][0] == r["expected"]["tp"]["all_reduce"][0] >= 1 for r in out)


def planner_layout(t, p, d, schedule, v, M, zero):
    """The planner's Layout of a run (fp32, b = B/(d M); the schedule's placement)."""
    return Layout(t=t, p=p, d=d, v=v, b=B // (d * M), M=M, schedule="interleaved" if v > 1 else "1f1b",
                  placement=lookup(schedule).placement, zero=zero, precision="fp32")


@pytest.mark.parametrize("t,p,d,zero,schedule", [(1, 2, 2, 2, "1f1b"), (1, 2, 2, 3, "1f1b"), (1, 1, 2, 2, "1f1b"),
                                                 (1, 1, 2, 3, "1f1b"), (2, 1, 2, 3, "zbh1")])
def test_3d_zero23_with_tied_embeddings(t, p, d, zero, schedule):
    """ZeRO-2/3 with tied embeddings (issue 19 c): with p > 1 the copy's bucket (ZeRO-2) or unit
    (FSDP) is reduce-scattered after the embedding-group all-reduce of its full gradient; with p = 1
    the one matrix is one parameter (ZeRO-2) or one FSDP unit with the embedding and the head (ZeRO-3,
    its gradient summed over both uses before the reduce-scatter). Equal to one device; counts and
    ZeRO-3's gathered peak = planner."""
    cfg = cfg_for(tied=True)
    out = run(cfg, t, p, d, schedule, 1, M=2, zero=zero)
    check_equal(out, cfg, 3)
    check_comm(out)
    assert all(("embedding" in r["comm"][-1]) == (p > 1) for r in out)
    if zero == 3 and schedule == "1f1b":
        mem = memory_per_rank(planner_spec(cfg, S, B), planner_layout(t, p, d, schedule, 1, 2, zero), device="cpu")
        assert all(r["memory"]["gathered"] == mem[r["pp_rank"]].gathered > 0 for r in out)


@pytest.mark.parametrize("t,p,d,schedule,v,M,sp", [(2, 2, 2, "zbh1", 1, 2, True), (1, 2, 2, "zbv", 2, 4, False),
                                                    (1, 2, 2, "dualpipev", 2, 4, False)])
def test_3d_zero2_with_zero_bubble(t, p, d, schedule, v, M, sp):
    """ZeRO-2 under the zero-bubble schedules (issue 19 e): the W passes accumulate the weight
    gradients in many autograd runs; the sync stays open until the last W's buckets (or the step's
    finish_grad_sync) start, each bucket reduce-scattered once. Equal to one device; counts = planner."""
    cfg = cfg_for()
    out = run(cfg, t, p, d, schedule, v, M=M, zero=2, sp=sp)
    check_equal(out, cfg, 3)
    check_comm(out)


ZB3 = [(1, 2, 2, "zbh1", 1, 2), (1, 1, 2, "zbh1", 1, 2), (1, 2, 2, "zbv", 2, 4), (1, 2, 2, "dualpipev", 2, 4)]


@pytest.mark.parametrize("t,p,d,schedule,v,M", ZB3)
def test_3d_zero3_with_zero_bubble(t, p, d, schedule, v, M):
    """ZeRO-3 under the zero-bubble schedules: each I and W runs with the stage's units gathered,
    kept until the stage's last W of the step, whose completion reshards each unit and
    reduce-scatters its gradient (all M microbatches' W accumulated). Every gradient and the
    parameters after 3 SGD steps equal one device; all-gathers counted along the schedule's actions,
    one reduce-scatter per unit (check_comm); the gathered peak = the planner's (a whole stage)."""
    cfg = cfg_for()
    out = run(cfg, t, p, d, schedule, v, M=M, zero=3)
    check_equal(out, cfg, 3)
    check_comm(out)
    spec, lay = planner_spec(cfg, S, B), planner_layout(t, p, d, schedule, v, M, 3)
    for r in out:
        assert r["memory"]["gathered"] == 4 * zero3_split_gathered_peak(spec, lay, r["pp_rank"])


@pytest.mark.parametrize("bug", ["reshard_every_w", "reduce_scatter_every_w"])
def test_3d_zero3_zero_bubble_check_catches_early_reshard(bug):
    """Resharding after every W (the other microbatches' W gather again) or reduce-scattering before
    the stage's last W: the counts differ from the planner's."""
    cfg = cfg_for()
    out = run(cfg, 1, 2, 2, "zbh1", 1, M=2, steps=2, zero=3, bug=bug)
    with pytest.raises(AssertionError):
        check_comm(out)


@pytest.mark.parametrize("zero,schedule", [(2, "1f1b"), (3, "1f1b"), (3, "zbh1")])
def test_3d_zero2_zero3_adam(zero, schedule):
    """5 Adam steps (the moments held for the 1/d shards only) end at the one-device parameters."""
    cfg = cfg_for()
    out = run(cfg, 1, 1, 2, schedule, 1, M=2, steps=5, opt="adam", lr=1e-3, zero=zero)
    check_equal(out, cfg, 5, "adam", 1e-3)
    check_comm(out)
    for r in out:
        assert r["memory"]["optimizer"] == 2 * r["memory"]["grads"]     # two moments of the gradient shard


def test_3d_zero_check_catches_missing_average():
    cfg = cfg_for()
    out = run(cfg, 1, 1, 2, "1f1b", 1, M=2, steps=1, zero=3, bug="no_dp_average")
    with pytest.raises(AssertionError, match="gradients differ"):
        check_equal(out, cfg, 1)


def test_3d_check_catches_double_scaling():
    cfg = cfg_for()
    out = run(cfg, 1, 1, 2, "1f1b", 1, M=2, steps=1, bug="double_scale")
    with pytest.raises(AssertionError):
        check_equal(out, cfg, 1)


@pytest.mark.parametrize("t,p,d,schedule,v", [(1, 2, 1, "1f1b", 1), (2, 1, 1, "1f1b", 1), (1, 2, 2, "gpipe", 1)])
def test_tied_embeddings(t, p, d, schedule, v):
    cfg = cfg_for(tied=True, n_layer=2)
    out = run(cfg, t, p, d, schedule, v, M=2)
    check_equal(out, cfg, 3)
    check_comm(out)
    if p > 1:
        assert all(r["comm"][-1]["embedding"] == r["expected"]["embedding"] for r in out)


def test_tied_check_catches_missing_embedding_allreduce():
    cfg = cfg_for(tied=True, n_layer=2)
    out = run(cfg, 1, 2, 1, "1f1b", 1, M=2, steps=1, bug="no_embedding_allreduce")
    with pytest.raises(AssertionError, match="gradients differ"):
        check_equal(out, cfg, 1)


ERRORS = [
    (dict(world_size=8, tp=2, pp=2, dp=1), "must equal the world size 8"),
    (dict(world_size=4, tp=1, pp=4, dp=1, n_layer=6), "divisible by p\\*v"),
    (dict(world_size=4, tp=1, pp=2, dp=2, v=2, schedule="interleaved", n_layer=6), "divisible by p\\*v"),
    (dict(world_size=4, tp=4, pp=1, dp=1, n_head=2), "n_head"),
    (dict(world_size=4, tp=4, pp=1, dp=1, n_head=4, n_kv_head=2), "n_kv_head"),
    (dict(world_size=3, tp=3, pp=1, dp=1, n_head=3, n_embd=12), "vocab_size"),
    (dict(world_size=2, tp=2, pp=1, dp=1, global_batch=6, M=4), "global batch B=6"),
    (dict(world_size=4, tp=1, pp=1, dp=4, global_batch=8, M=4), "d\\*M"),
    (dict(world_size=4, tp=2, pp=1, dp=2, n_experts=3), "n_routed_experts E=3"),
    (dict(world_size=2, tp=1, pp=2, dp=1, v=2, schedule="1f1b"), "v=1"),
    (dict(world_size=4, tp=1, pp=1, dp=4, zero=3, hsdp=3), "R=3 must be an integer >= 1 that divides d=4"),
    (dict(world_size=4, tp=1, pp=1, dp=4, zero=2, hsdp=2), "HSDP .* needs ZeRO-3, got ZeRO-2"),
    (dict(world_size=2, tp=1, pp=2, dp=1, recompute="full", schedule="zb-h1", M=2),              # issue 19:
     "full recompute with ZB-H1"),                                                               # refused
    (dict(world_size=2, tp=1, pp=1, dp=2, zero=4), "ZeRO stage must be 0, 1, 2 or 3"),
]


@pytest.mark.parametrize("kw,match", ERRORS)
def test_layout_errors(kw, match):
    kw = dict(kw)
    cfg_kw = {k: kw.pop(k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd") if k in kw}
    cfg = GPTConfig(**{"n_layer": 4, "n_head": 4, "n_embd": 16, **cfg_kw},
                    share_embeddings_and_output_weights=kw.pop("tied", False))
    M = kw.pop("M", 1)
    with pytest.raises(ValueError, match=match):
        check_layout(cfg, n_microbatches=M, **kw)


def test_tied_outside_the_composition():
    """TensorParallelGPT and a one-stage split keep the tie; a multi-stage split refuses it."""
    from labkit.pipeline.schedules import ScheduleError
    from labkit.pipeline.stages import split_gpt
    gpt = GPT(cfg_for(tied=True, n_layer=2))
    assert gpt.head.lm_head.weight is gpt.embedding.wte.weight
    one = split_gpt(gpt, 1)[0]
    assert one.head.lm_head.weight is one.embedding.wte.weight
    with pytest.raises(ScheduleError, match="tied embeddings"):
        split_gpt(gpt, 2)


def _tp_tied(ctx):
    from labkit.tensor_parallel import TensorParallelGPT
    cfg = cfg_for(tied=True, n_layer=1)
    m = TensorParallelGPT.from_reference(GPT(cfg), make_grid(ctx, tp=2).tp_group)
    return m.head.lm_head.weight is m.embedding.wte.weight


def test_tensor_parallel_gpt_keeps_the_tie():
    assert launch(_tp_tied, 2, backend="gloo") == [True, True]
