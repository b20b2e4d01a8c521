"""Context parallelism: ring, all-gather K/V and Ulysses attention equal full attention.

Each rank builds the reference from one seed, runs it on the full sequence and its
context-parallel version on its share (load-balanced 2 x cp chunks unless said), and returns
output, input gradient, every parameter gradient (step 1) and every parameter after 3 plain-SGD
steps, full sequences rebuilt; the parent compares (fp32 rtol 1e-5, atol 1e-6). Cases: an
attention layer (GQA, causal and not) and a tiny GPT (loss, logits, every gradient) at cp = 2
and 4. Counted bytes equal each algorithm's formula; per-rank causal work equals the formula
and is balanced by the chunk placement. Injected bugs (probabilities averaged instead of the
log-sum-exp merge, the ring backward without delta, positions of the wrong placement, no
gradient all-reduce) must be caught by the same comparison. One launch per cp.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from labkit.comm import CommLog
from labkit.context_parallel import (
    ContextParallelAttention,
    ContextParallelGPT,
    attention_work,
    causal_work,
    check_cp_config,
    finish_grad_sync,
    gather_sequence,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from labkit.context_parallel import layers as layers_mod
from labkit.context_parallel import ring as ring_mod
from labkit.dist import launch
from labkit.model import GPT, CausalSelfAttention, GPTConfig
from labkit.plan.comm import comm_per_rank
from labkit.plan.spec import Layout, ModelSpec

RTOL, ATOL = 1e-5, 1e-6
B, S, H, NH, NKV = 2, 16, 32, 8, 4
METHODS = ("ring", "allgather", "ulysses")
LR, STEPS = 0.01, 3


def _cfg(**kw):
    return GPTConfig(n_embd=H, n_head=NH, n_kv_head=NKV, block_size=S, vocab_size=64, n_layer=2, **kw)


def _ref_attention(attn, x, causal):
    """The full-sequence layer: the reference module itself when causal, else the same
    projections with plain softmax attention (torch's SDPA, no mask)."""
    if causal:
        return attn(x)
    q = attn.q_proj(x).view(B, S, NH, -1).transpose(1, 2)
    k = attn.k_proj(x).view(B, S, NKV, -1).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    v = attn.v_proj(x).view(B, S, NKV, -1).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=False)
    return attn.out_proj(y.transpose(1, 2).reshape(B, S, H))


def _sgd(*modules):
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p -= LR * p.grad
                p.grad = None


def _layer_run(group, rank, cp, method, causal, lb=True, sync=True):
    torch.manual_seed(0)
    ref = CausalSelfAttention(_cfg())
    par = ContextParallelAttention(copy.deepcopy(ref), group, method, load_balance=lb, causal=causal)
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, dy = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
        xr = x.clone().requires_grad_()
        yr = _ref_attention(ref, xr, causal)
        yr.backward(dy)
        xp = shard_sequence(x, 1, rank, cp, lb).requires_grad_()
        yp = par(xp)
        yp.backward(shard_sequence(dy, 1, rank, cp, lb))
        if sync:
            finish_grad_sync(par, group, average=False)
        if step == 0:
            out += [("output", gather_sequence(yp, 1, group, lb), yr.detach()),
                    ("input grad", gather_sequence(xp.grad, 1, group, lb), xr.grad)]
            out += [(f"grad {n}", p.grad.clone(), q.grad.clone())
                    for (n, q), p in zip(ref.named_parameters(), par.attn.parameters())]
        _sgd(ref, par)
    out += [(f"param {n} after {STEPS} SGD steps", p.detach().clone(), q.detach().clone())
            for (n, q), p in zip(ref.named_parameters(), par.attn.parameters())]
    return out


def _gpt_run(group, rank, cp, method):
    ref = GPT(_cfg(), seed=1)
    par = ContextParallelGPT(copy.deepcopy(ref), group, method)
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(200 + step)
        idx = torch.randint(0, 64, (B, S), generator=g)
        tgt = torch.randint(0, 64, (B, S), generator=g)
        loss_r = ref(idx, tgt)
        loss_r.backward()
        with CommLog() as log:
            loss_p = par(shard_sequence(idx, 1, rank, cp), shard_sequence(tgt, 1, rank, cp))
            loss_p.backward()
        with CommLog() as sync_log:
            finish_grad_sync(par, group)
        if step == 0:
            comm = {"cp": log.summary(), "sync": sync_log.bytes("all_reduce")}
        if step == 0:
            with torch.no_grad():
                logits = gather_sequence(par(shard_sequence(idx, 1, rank, cp)), 1, group)
                full_loss = gather_sequence(loss_p.detach().reshape(1, 1), 0, group, False).mean()
            out += [("loss", full_loss, loss_r.detach()), ("logits", logits, ref(idx).detach())]
            out += [(f"grad {n}", p.grad.clone(), q.grad.clone())
                    for (n, q), p in zip(ref.named_parameters(), par.gpt.parameters())]
        _sgd(ref, par)
    out += [(f"param {n} after {STEPS} SGD steps", p.detach().clone(), q.detach().clone())
            for (n, q), p in zip(ref.named_parameters(), par.gpt.parameters())]
    return out, comm


def _comm_of(group, rank, cp, method):
    torch.manual_seed(0)
    par = ContextParallelAttention(CausalSelfAttention(_cfg()), group, method)
    x = torch.randn(B, S // cp, H, requires_grad=True)
    with CommLog() as fwd:
        y = par(x)
    with CommLog() as bwd:
        y.sum().backward()
    return {"fwd": fwd.summary(), "bwd": bwd.summary()}


def _work_of(group, rank, cp, lb, method="ring"):
    torch.manual_seed(0)
    par = ContextParallelAttention(CausalSelfAttention(_cfg()), group, method, load_balance=lb)
    par.stats = []
    par(torch.randn(B, S // cp, H))
    if method != "ring":      # one record per forward: pairs per batch row summed over the heads computed
        return sum(s["work"] * s["heads"] for s in par.stats)
    return [(s["block"], s["work"]) for s in par.stats]


def _rank(ctx):
    g, r, cp = ctx.group, ctx.rank, ctx.world_size
    res = {}
    for method in METHODS:
        for causal in (True, False):
            res[("layer", method, causal)] = _layer_run(g, r, cp, method, causal)
        res[("gpt", method)], res[("gpt comm", method)] = _gpt_run(g, r, cp, method)
        res[("comm", method)] = _comm_of(g, r, cp, method)
    res[("layer", "ring", "contiguous")] = _layer_run(g, r, cp, "ring", True, lb=False)
    res["work"] = {lb: _work_of(g, r, cp, lb) for lb in (True, False)}
    res["work by heads"] = {(m, lb): _work_of(g, r, cp, lb, m)
                            for m in ("allgather", "ulysses") for lb in (True, False)}
    # injected bugs: the same comparison must catch each
    res["BUG no gradient all-reduce"] = _layer_run(g, r, cp, "allgather", True, sync=False)
    orig_merge, orig_bwd = ring_mod.merge_partials, ring_mod.block_attention_backward
    ring_mod.merge_partials = lambda oa, la, ob, lb_: ((oa + ob) / 2, torch.logaddexp(la, lb_))
    try:
        res["BUG probabilities averaged"] = _layer_run(g, r, cp, "ring", False)
    finally:
        ring_mod.merge_partials = orig_merge
    ring_mod.block_attention_backward = lambda q, k, v, do, lse, delta, *a: orig_bwd(q, k, v, do, lse, 0 * delta, *a)
    try:
        res["BUG backward without delta"] = _layer_run(g, r, cp, "ring", True)
    finally:
        ring_mod.block_attention_backward = orig_bwd
    orig_pos = layers_mod.sequence_positions
    layers_mod.sequence_positions = lambda S_, r_, cp_, lb_=True: orig_pos(S_, r_, cp_, False)
    try:
        res["BUG positions of the contiguous split"] = _layer_run(g, r, cp, "allgather", True)
    finally:
        layers_mod.sequence_positions = orig_pos
    return res


@pytest.fixture(scope="module")
def results():
    return {cp: launch(_rank, cp, timeout=30) for cp in (2, 4)}


def _mismatches(triples):
    return [n for n, got, exp in triples
            if got.shape != exp.shape or not torch.allclose(got, exp, rtol=RTOL, atol=ATOL)]


N_LAYER_PARAMS = 8   # q, k, v, out projections: weight and bias
N_GPT_PARAMS = len(list(GPT(_cfg()).parameters()))


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False])
def test_attention_layer_equals_full_attention(results, cp, method, causal):
    for r, res in enumerate(results[cp]):
        triples = res[("layer", method, causal)]
        assert len(triples) == 2 + 2 * N_LAYER_PARAMS
        bad = _mismatches(triples)
        assert not bad, f"cp={cp} rank {r} {method} causal={causal}: mismatches {bad}"


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_with_contiguous_split_equals_full_attention(results, cp):
    for r, res in enumerate(results[cp]):
        bad = _mismatches(res[("layer", "ring", "contiguous")])
        assert not bad, f"cp={cp} rank {r}: mismatches {bad}"


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_gpt_equals_single_device(results, cp, method):
    for r, res in enumerate(results[cp]):
        triples = res[("gpt", method)]
        assert len(triples) == 2 + 2 * N_GPT_PARAMS
        bad = _mismatches(triples)
        assert not bad, f"cp={cp} rank {r} {method}: mismatches {bad}"


@pytest.mark.parametrize("cp", [2, 4])
def test_injected_bugs_are_caught(results, cp):
    res = results[cp][0]
    assert "grad q_proj.weight" in _mismatches(res["BUG no gradient all-reduce"])
    assert "output" in _mismatches(res["BUG probabilities averaged"])
    bad = _mismatches(res["BUG backward without delta"])
    assert "input grad" in bad and "grad k_proj.weight" in bad
    assert "output" in _mismatches(res["BUG positions of the contiguous split"])


@pytest.mark.parametrize("cp", [2, 4])
def test_bytes_equal_the_formulas(results, cp):
    e, s, d = 4, S // cp, H // NH
    b = B * NKV * s * d * e                        # one K (or V) block of one rank
    for res in results[cp]:
        ring, ag, ul = res[("comm", "ring")], res[("comm", "allgather")], res[("comm", "ulysses")]
        if cp > 1:
            assert ring["fwd"] == {("send", cp): (cp - 1, 2 * (cp - 1) * b), ("recv", cp): (cp - 1, 2 * (cp - 1) * b)}
            n_bwd = (cp - 1) + cp                  # (k, v) moves once less than (dk, dv)
            assert ring["bwd"] == {("send", cp): (n_bwd, 2 * n_bwd * b), ("recv", cp): (n_bwd, 2 * n_bwd * b)}
        assert ag["fwd"] == {("all_gather", cp): (2, 2 * b)}
        assert ag["bwd"] == {("reduce_scatter", cp): (2, 2 * cp * b)}
        ulysses_bytes = B * (2 * NH + 2 * NKV) * s * d * e   # q, k, v and the output, once each
        assert ul["fwd"] == {("all_to_all", cp): (4, ulysses_bytes)}
        assert ul["bwd"] == {("all_to_all", cp): (4, ulysses_bytes)}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("method", METHODS)
def test_planner_cp_bytes_equal_the_measured_gpt_run(results, cp, method):
    """labkit.plan.comm's "cp" axis for the tiny GPT (one microbatch of B sequences, fp32) equals
    what CommLog counted on every rank, kind by kind; its DP-axis gradient all-reduce over the
    d cp = cp ranks equals the bytes finish_grad_sync all-reduced."""
    spec = ModelSpec.from_gpt_config(_cfg(), global_batch=B)
    lay = Layout(cp=cp, b=B, M=1, precision="fp32", cp_attention=method)
    plan = comm_per_rank(spec, lay)
    expected = {(k, cp): v for k, v in plan["cp"].ops.items()}
    for r, res in enumerate(results[cp]):
        measured = res[("gpt comm", method)]
        assert measured["cp"] == expected, (r, measured["cp"], expected)
        assert measured["sync"] == plan["dp"].ops["all_reduce"][1]


@pytest.mark.parametrize("cp", [2, 4])
def test_causal_work_per_rank(results, cp):
    c, m = S // cp, S // (2 * cp)
    contiguous = [i * c * c + c * (c + 1) // 2 for i in range(cp)]
    balanced = [(2 * cp - 1) * m * m + m * (m + 1)] * cp
    assert causal_work(S, cp, load_balance=False) == contiguous
    assert causal_work(S, cp, load_balance=True) == balanced
    for lb, expected in ((True, balanced), (False, contiguous)):
        measured = [sum(w for _, w in res["work"][lb]) for res in results[cp]]
        assert measured == expected, (lb, measured)
    # contiguous: rank i computes only the blocks of ranks <= i (the others are skipped)
    for i, res in enumerate(results[cp]):
        assert sorted(j for j, w in res["work"][False] if w) == list(range(i + 1))
    # all-gather and Ulysses, per rank, pairs summed over the heads computed: = attention_work (Ulysses:
    # h/cp heads of the whole triangle, the same on every rank for either placement)
    for method in ("allgather", "ulysses"):
        for lb in (True, False):
            measured = [res["work by heads"][(method, lb)] for res in results[cp]]
            assert measured == attention_work(S, cp, method, NH, lb), (method, lb, measured)
    assert attention_work(S, cp, "allgather", NH, False) == [NH * w for w in contiguous]
    assert attention_work(S, cp, "ulysses", NH, False) == [NH // cp * S * (S + 1) // 2] * cp


def test_placement_and_positions():
    assert sequence_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 1, 2, load_balance=False).tolist() == [4, 5, 6, 7]
    x = torch.arange(2 * 16 * 3.0).view(2, 16, 3)
    for lb in (True, False):
        parts = [shard_sequence(x, 1, r, 4, lb) for r in range(4)]
        assert torch.equal(unshard_sequence(parts, 1, lb), x)


@pytest.mark.parametrize("args, message", [
    ((8, 4, 24, 3, "ulysses"), "n_head=8 and n_kv_head=4 must both be divisible by cp=3"),
    ((8, 2, 16, 4, "ulysses"), "n_kv_head=2 must both be divisible by cp=4"),
    ((8, 4, 12, 4, "ring"), "S=12 must be divisible by 2 * cp"),
    ((8, 4, 16, 2, "flash"), "attention must be one of ring | allgather | ulysses"),
])
def test_bad_layouts_raise_one_clear_line(args, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")) as e:
        check_cp_config(*args)
    assert "\n" not in str(e.value)
