"""Expert slicing (DeepSpeed-MoE): the s slices of an expert sum to the unsliced expert (output and
gradients); the expert-sliced MoE layer and the whole inference GPT (non-expert layers
tensor-parallel) equal the single-device model on 4 ranks with fewer experts than GPUs; injected
bugs are caught."""
import pytest
import torch

from labkit.dist import launch
from labkit.model import GPTConfig
from labkit.moe import MoEConfig, MoELayer
from labkit.moe.experts import Expert
from labkit.moe.inference import SlicedExpert
from labkit.moe.model import MoEGPT, moe_config_for
from labkit.parallel.expert_slicing import ExpertSlicedMoE, ExpertSlicedMoEGPT, make_slicing_groups

RTOL, ATOL = 1e-5, 1e-6
H = 8


def _close(a, b):
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_slices_sum_to_the_expert(activation):
    torch.manual_seed(0)
    expert = Expert(H, 16, activation)
    x = torch.randn(5, H, requires_grad=True)
    y = expert(x)
    y.square().sum().backward()
    ref_x, ref_g = x.grad.clone(), {n: p.grad.clone() for n, p in expert.named_parameters()}
    x.grad = None
    slices = [SlicedExpert(expert, j, 4) for j in range(4)]
    ys = sum(s(x) for s in slices)
    assert _close(ys, y)
    ys.square().sum().backward()
    assert _close(x.grad, ref_x)
    for name, grad in ref_g.items():            # slice grads are the matching rows / columns of the full grad
        if name == "fc2.bias":                  # added once, by slice 0
            part = slices[0].fc2.bias.grad
        else:
            part = torch.cat([dict(s.named_parameters())[name].grad for s in slices],
                             dim=1 if name in ("fc2.weight", "w2.weight") else 0)
        assert _close(part, grad), name


def test_bias_on_every_slice_is_caught(monkeypatch):
    torch.manual_seed(0)
    expert = Expert(H, 16, "gelu")
    x = torch.randn(5, H)
    slices = [SlicedExpert(expert, j, 2) for j in range(2)]
    for s in slices:
        s.first = True                           # the bug: fc2's bias added by both slices
    assert not _close(sum(s(x) for s in slices), expert(x))


def test_slicing_degree_must_divide_width():
    with pytest.raises(ValueError, match="expert width 16 is not divisible by the expert-slicing degree s=3"):
        SlicedExpert(Expert(H, 16), 0, 3)


CFG = MoEConfig(n_embd=H, n_routed_experts=2, n_activated_experts=1, moe_ffn_dim=16, n_shared_experts=1)
GCFG = GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=H, ffn_mult=2)


def _layer():
    torch.manual_seed(3)
    return MoELayer(CFG)


def _gpt():
    return MoEGPT(GCFG, moe_config_for(GCFG, n_routed_experts=2, n_activated_experts=1, capacity_factor=None,
                                       n_shared_experts=1), moe_layer_freq=2, seed=4)


def _x(batch_id, T=8):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(batch_id))


def _idx(batch_id):
    return torch.randint(0, GCFG.vocab_size, (2, 8), generator=torch.Generator().manual_seed(50 + batch_id))


def _worker(ctx):
    out = {}
    # t = 1: every rank its own tokens; s = 2 slices per expert, P/s = 2 EP groups of 1 expert each
    g1 = make_slicing_groups(ctx, s=2, t=1)
    layer = ExpertSlicedMoE.from_dense(_layer(), g1)
    x = _x(ctx.rank).requires_grad_(True)
    y, _ = layer(x)
    y.square().sum().backward()
    out["t1"] = (y.detach(), x.grad)
    # t = 2: the TP group (ranks 2b, 2b+1) holds the same batch b; the layer and the whole GPT
    g2 = make_slicing_groups(ctx, s=2, t=2)
    with torch.no_grad():
        out["t2"] = ExpertSlicedMoE.from_dense(_layer(), g2)(_x(100 + ctx.rank // 2))[0]
        out["gpt"] = ExpertSlicedMoEGPT(_gpt(), g2)(_idx(ctx.rank // 2))
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_worker, 4, timeout=30)


def test_expert_sliced_layer_equals_single_device(ranks):
    ref = _layer()
    for r, res in enumerate(ranks):
        x = _x(r).requires_grad_(True)
        y, _ = ref(x)
        y.square().sum().backward()
        assert _close(res["t1"][0], y), f"rank {r}: output (t=1)"
        assert _close(res["t1"][1], x.grad), f"rank {r}: input grad (t=1)"
        with torch.no_grad():
            assert _close(res["t2"], ref(_x(100 + r // 2))[0]), f"rank {r}: output (t=2, tokens split over TP)"


def test_inference_gpt_equals_single_device(ranks):
    gpt = _gpt().eval()
    with torch.no_grad():
        for r, res in enumerate(ranks):
            assert _close(res["gpt"], gpt(_idx(r // 2))[0]), f"rank {r}: logits"


def test_sizes_are_checked():
    def one(ctx):
        make_slicing_groups(ctx, s=3, t=1)
    with pytest.raises(Exception, match="expert-slicing degree s=3 must divide the 2 ranks"):
        launch(one, 2, timeout=10)
