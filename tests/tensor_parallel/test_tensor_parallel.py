"""Tensor-parallel layers equal the single-device reference at t = 2 and t = 4.

Every rank builds the reference module from the same seed, shards it, runs both, and
returns (got, expected, exact) triples: outputs, input gradients and every parameter
gradient, the full shapes rebuilt with ``gather_full_tensors``. The parent compares them
(``torch.equal`` where the arithmetic is identical, else fp32 rtol 1e-5 / atol 1e-6).
One launch per t runs all checks, to keep the suite fast.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.dist import launch
from labkit.model import GPT, MLP, CausalSelfAttention, GPTConfig
from labkit.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    TensorParallelGPT,
    VocabParallelEmbedding,
    all_gather_along_dim,
    gather_full_tensors,
    split_along_dim,
    vocab_parallel_cross_entropy,
)

RTOL, ATOL = 1e-5, 1e-6


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class _Checks:
    """Collects (got, expected, exact) triples on a rank."""

    def __init__(self):
        self.items = {}

    def add(self, name, got, expected, exact=False):
        assert got is not None, f"{name}: no value (gradient missing?)"
        self.items[name] = (got.detach().clone(), expected.detach().clone(), exact)

    def module_grads(self, prefix, tp_module, ref_module, group, exact=False):
        full = gather_full_tensors(tp_module, group)
        for name, p in ref_module.named_parameters():
            self.add(f"{prefix} grad {name}", full[name], p.grad, exact)


def _pair(checks, prefix, tp, ref, x, dy, group, parallel_in=False, parallel_out=False, exact=False):
    """Forward/backward ``tp`` and ``ref`` on the same x, dy; record output, dx, dW."""
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(dy)
    xt = (split_along_dim(x, -1, group) if parallel_in else x.clone()).requires_grad_()
    yt = tp(xt)
    yt.backward(split_along_dim(dy, -1, group) if parallel_out else dy)
    y_full = all_gather_along_dim(yt.detach(), -1, group) if parallel_out else yt
    dx_full = all_gather_along_dim(xt.grad, -1, group) if parallel_in else xt.grad
    checks.add(f"{prefix} output", y_full, yr, exact)
    checks.add(f"{prefix} input grad", dx_full, xr.grad, exact)
    checks.module_grads(prefix, tp, ref, group, exact)


def _layer_checks(ctx, t):
    g, c = ctx.group, _Checks()
    torch.manual_seed(0)

    # column- and row-parallel linear, each with both settings of its flag
    for gather in (True, False):
        ref = nn.Linear(8, 12)
        _pair(c, f"column(gather_output={gather})", ColumnParallelLinear.from_full(ref, g, gather_output=gather),
              copy.deepcopy(ref), _rand(2, 3, 8, seed=1), _rand(2, 3, 12, seed=2), g, parallel_out=not gather)
    for parallel in (False, True):
        ref = nn.Linear(12, 8)
        _pair(c, f"row(input_is_parallel={parallel})",
              RowParallelLinear.from_full(ref, g, input_is_parallel=parallel),
              copy.deepcopy(ref), _rand(2, 3, 12, seed=3), _rand(2, 3, 8, seed=4), g, parallel_in=parallel)

    # MLP and attention from the reference modules (GQA: n_kv_head < n_head)
    cfg = GPTConfig(n_embd=32, n_head=2 * t, n_kv_head=t, block_size=8)
    ref = MLP(cfg)
    _pair(c, "mlp", ParallelMLP.from_reference(ref, g), copy.deepcopy(ref),
          _rand(2, 8, 32, seed=5), _rand(2, 8, 32, seed=6), g)
    for n_kv in (2 * t, t):
        cfg = GPTConfig(n_embd=32, n_head=2 * t, n_kv_head=n_kv, block_size=8)
        ref = CausalSelfAttention(cfg)
        _pair(c, f"attention(h={2 * t}, h_kv={n_kv})", ParallelAttention.from_reference(ref, g),
              copy.deepcopy(ref), _rand(2, 8, 32, seed=7), _rand(2, 8, 32, seed=8), g)

    # vocab-parallel embedding: V=8, D=3, ids [0, 3, 4, 7, 5]; exact
    ref = nn.Embedding(8, 3)
    emb = VocabParallelEmbedding.from_full(ref, g)
    ids = torch.tensor([0, 3, 4, 7, 5])
    dy = _rand(5, 3, seed=9)
    yr = ref(ids)
    yr.backward(dy)
    yt = emb(ids)
    yt.backward(dy)
    c.add("embedding output", yt, yr, exact=True)
    c.module_grads("embedding", emb, ref, g, exact=True)

    # vocab-parallel cross-entropy: with ignored targets, with and without label smoothing
    V, N = 16, 10
    logits = _rand(N, V, seed=10) * 4
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(11))
    target[[2, 7]] = -100
    for eps in (0.0, 0.1):
        for reduction in ("mean", "sum"):
            lr = logits.clone().requires_grad_()
            loss_r = F.cross_entropy(lr, target, label_smoothing=eps, reduction=reduction)
            loss_r.backward()
            lt = split_along_dim(logits, -1, g).requires_grad_()
            loss_t = vocab_parallel_cross_entropy(lt, target, label_smoothing=eps, group=g, reduction=reduction)
            loss_t.backward()
            c.add(f"cross-entropy(eps={eps}, {reduction}) loss", loss_t, loss_r)
            c.add(f"cross-entropy(eps={eps}, {reduction}) logits grad", all_gather_along_dim(lt.grad, -1, g), lr.grad)
    # 3-D logits [B, S, V/t] and reduction="none"
    lt = split_along_dim(logits.view(2, 5, V), -1, g)
    c.add("cross-entropy(none) per token", vocab_parallel_cross_entropy(lt, target.view(2, 5), group=g,
                                                                        reduction="none"),
          F.cross_entropy(logits, target, reduction="none").view(2, 5))
    return c.items


def _gpt_checks(ctx, t, steps=3, lr=0.5):
    """Full GPT, t ranks vs one device: loss every step, all gradients of step 1,
    all parameters after ``steps`` plain-SGD steps."""
    g, c = ctx.group, _Checks()
    cfg = GPTConfig(n_layer=2, n_head=4, n_kv_head=4 if t == 4 else 2, n_embd=32, block_size=16)
    ref = GPT(cfg, seed=0)
    tp = TensorParallelGPT.from_reference(GPT(cfg, seed=0), g)
    opt_r = torch.optim.SGD(ref.parameters(), lr=lr)
    opt_t = torch.optim.SGD(tp.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
        y = torch.randint(0, cfg.vocab_size, (4, 16), generator=gen)
        if step == 1:
            y[0, :5] = -100                 # ignored targets, as F.cross_entropy's default
        loss_r, loss_t = ref(x, y), tp(x, y)
        c.add(f"gpt step {step} loss", loss_t, loss_r)
        opt_r.zero_grad()
        opt_t.zero_grad()
        loss_r.backward()
        loss_t.backward()
        if step == 0:
            c.module_grads("gpt step 0", tp, ref, g)
        opt_r.step()
        opt_t.step()
    full = gather_full_tensors(tp, g, what="param")
    for name, p in ref.named_parameters():
        c.add(f"gpt after {steps} SGD steps param {name}", full[name], p)
    return c.items


def _pytorch_tp_checks(ctx):
    """labkit's ParallelMLP against torch.distributed.tensor.parallel on the same MLP."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    g, c = ctx.group, _Checks()
    cfg = GPTConfig(n_embd=32, block_size=8)
    ref = MLP(cfg)
    mesh = DeviceMesh("cpu", list(range(ctx.world_size)))
    theirs = parallelize_module(copy.deepcopy(ref), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    ours = ParallelMLP.from_reference(ref, g)
    x, dy = _rand(2, 8, 32, seed=12), _rand(2, 8, 32, seed=13)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    ya.backward(dy)
    yb.backward(dy)
    c.add("vs PyTorch TP: mlp output", ya, yb)
    c.add("vs PyTorch TP: mlp input grad", xa.grad, xb.grad)
    full = gather_full_tensors(ours, g)
    for name, p in theirs.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        c.add(f"vs PyTorch TP: grad {name}", full[name], grad)
    return c.items


def _all_checks(ctx, t):
    items = {}
    items.update(_layer_checks(ctx, t))
    items.update(_gpt_checks(ctx, t))
    items.update(_pytorch_tp_checks(ctx))
    if t == 2:
        items.update(_row_bias_check(ctx))
    return items


def _row_bias_check(ctx):
    """x [2, 4] @ W [4, 3] + b with W split by rows over t=2: the bias is added once."""
    c = _Checks()
    x = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, -3.0, 2.0, 1.0]])
    W = torch.tensor([[1.0, 0.0, 2.0], [-1.0, 1.0, 0.0], [0.5, 2.0, 1.0], [2.0, -1.0, 1.0]])
    b = torch.tensor([10.0, 20.0, 30.0])
    layer = RowParallelLinear(4, 3, bias=True, input_is_parallel=False, group=ctx.group)
    layer.load_full_weight(W.t(), b)   # nn.Linear stores W transposed: [out, in]
    c.add("row bias: x @ W + b", layer(x), x @ W + b, exact=True)
    return c.items


def _compare(results, world):
    failures = []
    for rank, items in enumerate(results):
        for name, (got, exp, exact) in items.items():
            if got.shape != exp.shape:
                failures.append(f"rank {rank} {name}: shape {tuple(got.shape)} != {tuple(exp.shape)}")
            elif exact and not torch.equal(got, exp):
                failures.append(f"rank {rank} {name}: not exactly equal, max diff {(got - exp).abs().max():.3g}")
            elif not exact and not torch.allclose(got, exp, rtol=RTOL, atol=ATOL):
                failures.append(f"rank {rank} {name}: max diff {(got - exp).abs().max():.3g}")
    assert not failures, f"t={world}: " + "\n".join(failures)
    return results[0]


@pytest.mark.parametrize("t", [2, 4])
def test_tensor_parallel_equals_single_device(t):
    results = launch(_all_checks, t, t, timeout=60)
    items = _compare(results, t)
    # the test must have covered every layer, every parameter of the GPT, both flags
    names = " ".join(items)
    for what in ("column(gather_output=True)", "column(gather_output=False)", "row(input_is_parallel=True)",
                 "row(input_is_parallel=False)", "mlp grad fc2.bias", "attention(h=", "h_kv=" + str(t),
                 "embedding grad weight", "cross-entropy(eps=0.1, mean) logits grad",
                 "gpt step 0 grad blocks.1.attn.k_proj.weight", "gpt after 3 SGD steps param head.lm_head.weight",
                 "gpt after 3 SGD steps param embedding.wte.weight", "vs PyTorch TP: grad fc1.weight"):
        assert what in names, what
    if t == 2:
        assert "row bias: x @ W + b" in items


def test_tensor_parallel_single_rank_group_is_identity():
    """t = 1: the layers reduce to the plain ones and communicate nothing."""
    from labkit.comm import CommLog

    def fn(ctx):
        ref = nn.Linear(4, 6)
        with CommLog() as log:
            col = ColumnParallelLinear.from_full(ref, ctx.group)
            x = _rand(3, 4, seed=0).requires_grad_()
            col(x).sum().backward()
        return log.count(), torch.equal(col(x), ref(x))

    assert launch(fn, 1) == [(0, True)]
