"""Activation checkpointing: same gradients as without it (dropout included), the RNG
pitfall, parameters with no input requiring grad, and the memory growth of Chen et al. 2016."""
import math

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_ckpt

from labkit.checkpoint import SavedTensorMeter, checkpoint, checkpoint_sequential, format_memory_table, memory_table


def _linear_dropout_grads(mode, seed=123):
    torch.manual_seed(0)
    lin, drop = nn.Linear(16, 16), nn.Dropout(0.5)
    x = torch.randn(8, 16, requires_grad=True)

    def f(inp):
        return drop(lin(inp))

    torch.manual_seed(seed)
    if mode == "plain":
        y = f(x)
    elif mode == "labkit":
        y = checkpoint(f, x)
    elif mode == "labkit-no-rng":
        y = checkpoint(f, x, preserve_rng_state=False)
    else:
        y = torch_ckpt.checkpoint(f, x, use_reentrant=False)
    after = torch.rand(1)   # the RNG stream after the call
    y.square().sum().backward()
    return lin.weight.grad, lin.bias.grad, x.grad, y.detach(), after


def test_checkpoint_gradients_equal_without_checkpointing_with_dropout():
    plain = _linear_dropout_grads("plain")
    ours = _linear_dropout_grads("labkit")
    theirs = _linear_dropout_grads("torch")
    for a, b, c in zip(plain, ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


def test_checkpoint_without_rng_restore_gets_wrong_gradients():
    """The pitfall: recomputing dropout with a fresh RNG state draws other masks."""
    plain = _linear_dropout_grads("plain")
    bad = _linear_dropout_grads("labkit-no-rng")
    assert torch.equal(plain[3], bad[3])            # the forward itself is the same ...
    assert not torch.allclose(plain[0], bad[0])     # ... but the weight gradient is wrong


def test_parameters_get_gradients_when_no_input_requires_grad():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(3, 4)                           # requires_grad=False
    checkpoint(lin, x).sum().backward()
    ref(x).sum().backward()
    assert lin.weight.grad is not None
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


def test_checkpoint_multiple_outputs_and_non_tensor_args():
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)

    def f(a, scale):
        h = a @ w
        return h * scale, h.tanh()

    y1, y2 = checkpoint(f, x, 3.0)
    (y1.sum() + y2.square().sum()).backward()
    gw, gx = w.grad.clone(), x.grad.clone()
    w.grad = x.grad = None
    y1, y2 = f(x, 3.0)
    (y1.sum() + y2.square().sum()).backward()
    assert torch.allclose(gw, w.grad) and torch.allclose(gx, x.grad)


@pytest.mark.parametrize("segments", [None, 1, 3, 8])
def test_checkpoint_sequential_equals_plain(segments):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()) for _ in range(8)])
    x = torch.randn(5, 8, requires_grad=True)
    torch.manual_seed(1)
    y = x
    for layer in layers:
        y = layer(y)
    y.sum().backward()
    ref = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    layers.zero_grad()
    x.grad = None
    torch.manual_seed(1)
    checkpoint_sequential(layers, segments, x).sum().backward()
    got = [p.grad for p in layers.parameters()] + [x.grad]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_checkpoint_sequential_rejects_bad_segments():
    layers = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(ValueError, match="between 1 and the number of layers n=3, got 4"):
        checkpoint_sequential(layers, 4, torch.zeros(1, 2))


def test_memory_table_follows_chen_et_al():
    rows = memory_table(ns=(4, 16, 64), width=64, batch=16, device="cpu")
    table = {(r["n"], r["strategy"]): r for r in rows}
    unit = 16 * 64 * 4                                   # one activation [batch, width] fp32, bytes
    text = format_memory_table(rows)
    assert "sqrt(n) segments" in text
    for n in (4, 16, 64):
        k = round(math.sqrt(n))
        # exact accounting: each Linear+GeLU layer saves its input and the GeLU input
        assert table[(n, "none")]["saved_peak_bytes"] == 2 * n * unit
        assert table[(n, "every layer")]["saved_peak_bytes"] == (n + 1) * unit
        assert table[(n, "sqrt(n) segments")]["saved_peak_bytes"] == (k + 2 * (n // k) - 1) * unit
        assert table[(n, "one segment")]["saved_peak_bytes"] == 2 * n * unit
        # at the end of forward: all activations, one input per layer, k inputs, 1 input
        assert table[(n, "none")]["saved_after_forward_bytes"] == 2 * n * unit
        assert table[(n, "every layer")]["saved_after_forward_bytes"] == n * unit
        assert table[(n, "sqrt(n) segments")]["saved_after_forward_bytes"] == k * unit
        assert table[(n, "one segment")]["saved_after_forward_bytes"] == unit
        assert table[(n, "none")]["extra_forward_layers"] == 0
        for s in ("every layer", "sqrt(n) segments", "one segment"):
            assert table[(n, s)]["extra_forward_layers"] == n   # one extra forward pass
    ratio = {s: table[(64, s)]["saved_peak_bytes"] / table[(16, s)]["saved_peak_bytes"]
             for s in ("none", "every layer", "sqrt(n) segments", "one segment")}
    assert ratio["none"] == 4.0                           # O(n)
    assert 3.5 < ratio["every layer"] < 4.0               # O(n), smaller constant
    assert 1.8 < ratio["sqrt(n) segments"] < 2.2          # O(sqrt n): 4x layers, 2x memory
    assert ratio["one segment"] == 4.0                    # everything recomputed at once


def test_saved_tensor_meter_counts_and_releases():
    x = torch.randn(10, 10, requires_grad=True)
    with SavedTensorMeter() as m:
        y = (x * 2).exp()                                 # exp saves its output: 400 bytes
        assert m.live >= 400
        y.sum().backward()
        del y
    assert m.live == 0 and m.peak >= 400


def test_saved_tensor_meter_releases_a_graph_kept_by_retain_graph():
    """A graph kept with retain_graph=True (the split backward's I) and then dropped frees all its
    saved tensors. Holding the tensor itself in the pack hook would not: a saved output (softmax's)
    then points at its own node (node -> packed tensor -> grad_fn -> node), a cycle through C++
    that gc never collects, and the meter would show those bytes alive for ever."""
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter() as m:
        y = (x @ x.t()).softmax(dim=-1)                   # mm saves x and x.t(); softmax its output
        torch.autograd.grad(y.sum(), x, retain_graph=True)
        assert m.live == 4 * 8 * 4 + 4 * 4 * 4            # x (one storage with x.t()) + softmax output
        del y
    assert m.live == 0 and m.peak == 4 * 8 * 4 + 4 * 4 * 4


def test_cpu_runs_make_no_cuda_calls(monkeypatch):
    """The RNG save/restore touches CUDA only when an input lives on a GPU."""
    def forbidden(*a, **k):
        raise AssertionError("torch.cuda called on a CPU run")

    for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "manual_seed",
                 "synchronize", "reset_peak_memory_stats", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    plain = _linear_dropout_grads("plain")
    ours = _linear_dropout_grads("labkit")
    assert torch.equal(plain[0], ours[0])
    memory_table(ns=(4,), width=8, batch=2, device="cpu")
