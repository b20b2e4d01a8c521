"""Sequence parallelism and selective recompute equal the single-device layer; their bytes are exact.

Each rank builds the reference :class:`labkit.model.Block` from one seed, shards it into a
:class:`ParallelBlock` (TP, TP+SP, with and without recompute), runs two plain-SGD
steps on both, and returns output, input gradient, every parameter gradient (step 1) and every
parameter after the two steps, full shapes rebuilt. The parent compares them (fp32 rtol 1e-5,
atol 1e-6). Injected bugs (no LayerNorm gradient all-reduce, split instead of reduce-scatter in
g's backward) must be caught by the same comparison. One launch per t.
"""
import copy

import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import RankError, launch
from labkit.model import Block, GPTConfig
from labkit.tensor_parallel import ParallelBlock, allreduce_layernorm_grads, gather_full_tensors
from labkit.tensor_parallel import layers as sp_mod
from labkit.tensor_parallel.mappings import all_gather_along_dim, split_along_dim

RTOL, ATOL = 1e-5, 1e-6
B, S, H, NH = 2, 8, 32, 8
CONFIGS = {  # name: (sequence_parallel, recompute_granularity, regather_in_backward)
    "tp": (False, None, True),
    "tp+selective": (False, "selective", True),
    "tp+full": (False, "full", True),
    "tp+sp": (True, None, True),
    "tp+sp (no regather)": (True, None, False),
    "tp+sp+selective": (True, "selective", True),
    "tp+sp+full": (True, "full", True),
}


def _ref_block(seed=0, n_kv_head=None):
    torch.manual_seed(seed)
    return Block(GPTConfig(n_embd=H, n_head=NH, n_kv_head=n_kv_head, block_size=S, dropout=0.0))


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)


def _compare_run(group, sp, rec, regather, steps=2, skip_ln_allreduce=False, n_kv_head=None):
    """Two SGD steps of the parallel layer and the reference; returns [(name, got, expected)]."""
    ref = _ref_block(n_kv_head=n_kv_head)
    par = ParallelBlock(copy.deepcopy(ref), group, sequence_parallel=sp,
                                   recompute_granularity=rec, regather_in_backward=regather)
    out, lr = [], 0.1
    for step in range(steps):
        x, dy = _data(step)
        xr = x.clone().requires_grad_()
        yr = ref(xr)
        yr.backward(dy)
        xp = (split_along_dim(x, 1, group) if sp else x.clone()).requires_grad_()
        yp = par(xp)
        yp.backward(split_along_dim(dy, 1, group) if sp else dy)
        if sp and not skip_ln_allreduce:
            allreduce_layernorm_grads(par, group)
        if step == 0:
            y_full = all_gather_along_dim(yp.detach(), 1, group) if sp else yp.detach()
            dx_full = all_gather_along_dim(xp.grad, 1, group) if sp else xp.grad
            out += [("output", y_full, yr.detach()), ("input grad", dx_full, xr.grad)]
            full = gather_full_tensors(par, group)
            out += [(f"grad {n}", full[n], p.grad) for n, p in ref.named_parameters()]
        with torch.no_grad():
            for p in (*ref.parameters(), *par.parameters()):
                p -= lr * p.grad
                p.grad = None
    full = gather_full_tensors(par, group, what="param")
    out += [(f"param {n} after {steps} SGD steps", full[n], p.detach()) for n, p in ref.named_parameters()]
    return [(n, g.clone(), e.clone()) for n, g, e in out]


def _comm_of(group, sp, regather):
    """Collectives of one forward + backward of one layer (LayerNorm all-reduce separately)."""
    ref = _ref_block()
    par = ParallelBlock(ref, group, sequence_parallel=sp, regather_in_backward=regather)
    x, dy = _data(0)
    xp = (split_along_dim(x, 1, group) if sp else x).requires_grad_()
    with CommLog() as log:
        par(xp).backward(split_along_dim(dy, 1, group) if sp else dy)
    with CommLog() as ln_log:
        n = allreduce_layernorm_grads(par, group)
    return {"summary": log.summary(), "wire": log.wire_bytes(), "ln": (ln_log.summary(), n)}


def _rank(ctx, with_comm):
    g = ctx.group
    res = {name: _compare_run(g, *cfg) for name, cfg in CONFIGS.items()}
    res["gqa tp+sp+selective"] = _compare_run(g, True, "selective", True, n_kv_head=4)
    # injected bugs: the same comparison must catch them
    res["BUG no layernorm grad all-reduce"] = _compare_run(g, True, None, True, skip_ln_allreduce=True)
    orig = sp_mod.gather_from_sequence_parallel_region
    sp_mod.gather_from_sequence_parallel_region = lambda x, grp: orig(x, grp, tensor_parallel_output_grad=False)
    try:
        res["BUG split instead of reduce-scatter"] = _compare_run(g, True, None, False, steps=1)
    finally:
        sp_mod.gather_from_sequence_parallel_region = orig
    if with_comm:
        res["comm"] = {k: _comm_of(g, sp, rg) for k, (sp, rg) in
                       {"tp": (False, True), "sp": (True, False), "sp_regather": (True, True)}.items()}
    return res


def _mismatches(triples):
    bad = []
    for name, got, exp in triples:
        if got.shape != exp.shape or not torch.allclose(got, exp, rtol=RTOL, atol=ATOL):
            bad.append(name)
    return bad


@pytest.fixture(scope="module")
def results():
    return {2: launch(_rank, 2, True, timeout=20), 4: launch(_rank, 4, False, timeout=20)}


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", [*CONFIGS, "gqa tp+sp+selective"])
def test_layer_equals_single_device(results, t, name):
    for r, res in enumerate(results[t]):
        bad = _mismatches(res[name])
        assert not bad, f"t={t} rank {r} {name}: mismatches {bad}"
        assert len(res[name]) == 2 + 2 * 16  # output, dx, 16 parameter grads, 16 parameters


@pytest.mark.parametrize("t", [2, 4])
def test_injected_bugs_are_caught(results, t):
    bad = _mismatches(results[t][0]["BUG no layernorm grad all-reduce"])
    assert "grad ln1.weight" in bad and "grad ln2.bias" in bad and "grad attn.out_proj.bias" in bad
    bad = _mismatches(results[t][0]["BUG split instead of reduce-scatter"])
    assert "input grad" in bad


def test_sp_bytes_equal_the_all_reduces_exactly(results):
    t, e, N = 2, 4, B * S
    act = N * H * e                                      # one [B, S, H] fp32 tensor
    for _r, res in enumerate(results[t]):
        c = res["comm"]
        # TP: 2 all-reduces forward (g) + 2 backward (f) of the full activation
        assert c["tp"]["summary"] == {("all_reduce", t): (4, 4 * act)}
        # SP: every all-reduce became an all-gather (shard in) + a reduce-scatter (full in)
        assert c["sp"]["summary"] == {("all_gather", t): (4, 4 * act // t), ("reduce_scatter", t): (4, 4 * act)}
        # the same bytes on the wire: a ring all-reduce = reduce-scatter + all-gather
        assert c["sp"]["wire"] == c["tp"]["wire"] == 4 * 2 * (t - 1) * act // t
        # re-gathering the column-parallel inputs in backward costs 2 more all-gathers per layer
        assert c["sp_regather"]["summary"] == {("all_gather", t): (6, 6 * act // t),
                                               ("reduce_scatter", t): (4, 4 * act)}
        assert c["sp_regather"]["wire"] == c["tp"]["wire"] + 2 * (t - 1) * act // t
        # LayerNorm (2 x weight, bias) and the 2 row-parallel biases: 6H elements, one all-reduce
        assert c["sp"]["ln"] == ({("all_reduce", t): (1, 6 * H * e)}, 6 * H)
        assert c["tp"]["ln"] == ({}, 0)


def test_bad_arguments():
    with pytest.raises(RankError, match="ValueError: recompute_granularity"):
        launch(lambda ctx: ParallelBlock(_ref_block(), ctx.group, recompute_granularity="attn"), 1)
