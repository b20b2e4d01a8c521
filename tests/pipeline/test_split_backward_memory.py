"""Activations needed only for W (issue 12): split_backward.w_only_saved_bytes measures the
saved tensors W reads and whose values I does not need, exactly, on layers whose derivative
we know: Linear (its input: W only), GELU (its input: I), LayerNorm (its input: both)."""
import torch

from labkit.pipeline import split_backward
from labkit.pipeline.split_backward import w_only_saved_bytes

B, H = 5, 8


def _nbytes(*shape):
    n = 4
    for d in shape:
        n *= d
    return n


def test_linear_input_is_needed_only_by_w():
    lin = torch.nn.Linear(H, 4)
    got = w_only_saved_bytes(lin, [torch.randn(B, H)], [torch.randn(B, 4)])
    assert got == {"saved": _nbytes(B, H), "read_by_w": _nbytes(B, H), "w_only": _nbytes(B, H)}


def test_mlp_and_layernorm_split_what_i_needs_from_what_only_w_needs():
    torch.manual_seed(0)
    # Linear(8->16), GELU, Linear(16->4): saved x [B,8] (W only), h [B,16] (GELU's input: I),
    # GELU's output [B,16] (second Linear's input: W only)
    mlp = torch.nn.Sequential(torch.nn.Linear(H, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    got = w_only_saved_bytes(mlp, [torch.randn(B, H)], [torch.randn(B, 4)])
    assert got == {"saved": _nbytes(B, H) + 2 * _nbytes(B, 16), "read_by_w": _nbytes(B, H) + _nbytes(B, 16),
                   "w_only": _nbytes(B, H) + _nbytes(B, 16)}
    # LayerNorm then Linear: LayerNorm's input, mean and rstd are read by W and needed by I;
    # its output (the Linear's input) only by W
    ln = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 4))
    got = w_only_saved_bytes(ln, [torch.randn(B, H)], [torch.randn(B, 4)])
    assert got["w_only"] == _nbytes(B, H)
    assert got["read_by_w"] == got["saved"] == 2 * _nbytes(B, H) + 2 * _nbytes(B, 1)


def test_first_stage_without_differentiable_input_everything_w_reads_is_w_only():
    emb = torch.nn.Sequential(torch.nn.Embedding(16, H), torch.nn.LayerNorm(H))
    got = w_only_saved_bytes(emb, [torch.randint(0, 16, (B,))], [torch.randn(B, H)])
    assert got["w_only"] == got["read_by_w"] > 0


def test_the_check_catches_a_probe_that_never_sees_the_poison(monkeypatch):
    """Injected bug: I's results taken from the unpoisoned run (no probe) -> LayerNorm's
    input would count as W-only, and the exact check above fails."""
    ln = torch.nn.Sequential(torch.nn.LayerNorm(H), torch.nn.Linear(H, 4))
    x, g = torch.randn(B, H), torch.randn(B, 4)
    real = split_backward.backward_input
    cache = {}

    def no_probe(*a, **k):
        if "r" not in cache:
            cache["r"] = real(*a, **k)
        return cache["r"]

    monkeypatch.setattr(split_backward, "backward_input", no_probe)
    assert w_only_saved_bytes(ln, [x], [g])["w_only"] != _nbytes(B, H)


def test_measuring_leaves_parameter_gradients_alone():
    lin = torch.nn.Linear(H, 4)
    lin.weight.grad = torch.ones_like(lin.weight)
    w_only_saved_bytes(lin, [torch.randn(B, H)], [torch.randn(B, 4)])
    assert torch.equal(lin.weight.grad, torch.ones_like(lin.weight)) and lin.bias.grad is None


def _w_only_rank(ctx, measure):
    from labkit.model import GPT, GPTConfig, lm_loss
    from labkit.pipeline import PipelineStage, ScheduleZBH1
    from labkit.pipeline.stages import split_gpt
    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)
    mod = split_gpt(GPT(cfg, seed=0), ctx.world_size, [ctx.rank])[0]
    sched = ScheduleZBH1(PipelineStage(mod, ctx.rank, ctx.world_size, group=ctx.group), 4, lm_loss,
                         measure_w_memory=measure)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (4, 8), generator=g), torch.randint(0, 256, (4, 8), generator=g)
    sched.step(x, target=y)
    return {"grads": {n: p.grad.clone() for n, p in mod.named_parameters()}, "w_only": dict(sched.w_only_bytes),
            "w_peak": dict(sched.w_only_peak_bytes), "waiting": dict(sched.peak_waiting_for_w),
            "stash": {s: b[0] for s, b in sched.stash_bytes.items()}}


def test_runtime_counts_w_only_activations_separately():
    """ZB-H1 on 2 ranks with measure_w_memory: per stage, the bytes equal the function's on
    the same stage and microbatch (single process), the peak is (most microbatches between I
    and W) x those bytes, they are part of the stash, and the gradients are unchanged."""
    from labkit.dist import launch
    from labkit.model import GPT, GPTConfig, lm_loss
    from labkit.pipeline.stages import split_gpt
    on, off = launch(_w_only_rank, 2, True, timeout=30), launch(_w_only_rank, 2, False, timeout=30)
    cfg = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8)
    s0, s1 = split_gpt(GPT(cfg, seed=0), 2, [0, 1])
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 256, (4, 8), generator=g), torch.randint(0, 256, (4, 8), generator=g)
    x0, y0 = x[:1], y[:1]
    h = s0(x0).detach()
    want = {0: w_only_saved_bytes(s0, [x0], [torch.randn_like(h)])["w_only"],
            1: w_only_saved_bytes(lambda t: lm_loss(s1(t), y0) / 4, [h], None, s1.parameters())["w_only"]}
    for r, res in enumerate(on):
        assert res["w_only"] == {r: want[r]} and 0 < want[r] <= res["stash"][r]
        assert res["w_peak"] == {r: res["waiting"][r] * want[r]}
        assert all(torch.equal(res["grads"][n], off[r]["grads"][n]) for n in res["grads"])
        assert off[r]["w_only"] == {} and off[r]["w_peak"] == {}
