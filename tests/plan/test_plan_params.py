"""labkit.plan.params: total and active parameters of the one ModelSpec against the published
figures and against modules built with those sizes; the decode cost on hand-checked numbers."""
import pytest
import torch.nn as nn

from labkit.moe import Expert
from labkit.plan.params import count_parameters, decode_cost, expected_experts_touched
from labkit.plan.spec import ModelSpec, preset

MIXTRAL_8X7B, DEEPSEEK_V3, LLAMA2_70B = preset("mixtral-8x7b"), preset("deepseek-v3"), preset("llama2-70b")


def test_published_parameter_counts():
    mix = count_parameters(MIXTRAL_8X7B)
    assert 46.5e9 < mix.total < 47.0e9              # ~47B, not 8 x 7B = 56B
    assert 12.7e9 < mix.active < 13.1e9             # ~13B active per token
    v3 = count_parameters(DEEPSEEK_V3)
    assert 670.5e9 < v3.total < 671.5e9             # 671B (main model, MTP excluded)
    assert 36.5e9 < v3.active < 38.0e9              # ~37B active
    mtp = count_parameters(DEEPSEEK_V3, include_mtp=True).breakdown["mtp"]
    assert 13e9 < mtp < 14.5e9                      # published: 14B MTP module weights


# The counts of the former labkit.moe.params counter (its own ModelSpec, merged into plan.spec's),
# to the parameter: Mixtral's is the released checkpoint's 46,702,792,704.
EXACT = {  # preset: (total with MTP, active, breakdown)
    "mixtral-8x7b": (46702792704, 12879925248, {"attention": 1342177280, "routed experts": 45097156608,
                                                "embedding + head": 262144000}),
    "deepseek-v3": (684489845504, 37552297472, {"attention": 11413547008, "routed experts": 653908770816,
                                               "embedding + head": 1853358080, "mtp": 13463426304}),
    "llama2-70b": (68976648192, 68976648192, {"attention": 12079595520, "routed experts": 0,
                                              "embedding + head": 524288000}),
    "llama3.1-405b": (405853388800, 405853388800, {"attention": 71873593344, "routed experts": 0,
                                                   "embedding + head": 4202692608}),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_counts_are_exact(name):
    c = count_parameters(preset(name), include_mtp=True)
    assert (c.total, c.active, c.breakdown) == EXACT[name]
    # the planner's own totals are the same count
    assert preset(name).active_params() == c.active
    assert preset(name).total_params() == c.total - c.breakdown.get("mtp", 0)


class _TinyAttn(nn.Module):
    def __init__(self, s):
        super().__init__()
        self.q = nn.Linear(s.hidden, s.n_head * s.head_dim, bias=False)
        self.k = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v = nn.Linear(s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.n_head * s.head_dim, s.hidden, bias=False)


def test_parameter_count_matches_modules():
    s = ModelSpec(name="tiny", vocab_size=50, hidden=12, n_layer=3, n_head=4, n_kv_head=2, seq_len=8,
                  first_dense_layers=1, ffn=20, moe_ffn=8, n_routed_experts=6, n_activated_experts=2,
                  n_shared_experts=1, norm="rmsnorm", mlp="swiglu", position="rope", bias=False)
    layers = []
    for i in range(3):
        ffn = ([Expert(12, 20, "swiglu")] if i < 1 else
               [nn.Linear(12, 6, bias=False)] + [Expert(12, 8, "swiglu") for _ in range(7)])
        layers.append(nn.ModuleList([_TinyAttn(s), nn.RMSNorm(12), nn.RMSNorm(12)] + ffn))
    model = nn.ModuleList(layers + [nn.Embedding(50, 12), nn.RMSNorm(12), nn.Linear(12, 50, bias=False)])
    count = count_parameters(s)
    assert count.total == sum(p.numel() for p in model.parameters())
    per_expert = 3 * 12 * 8
    assert count.total - count.active == 2 * (6 - 2) * per_expert


def test_decode_cost_hand_checked():
    mix = decode_cost(MIXTRAL_8X7B, 3.35e12, 2)
    assert mix.params_read == pytest.approx(12.88e9, rel=1e-3)          # active parameters of Mixtral
    assert mix.latency_s == pytest.approx(12.88e9 * 2 / 3.35e12, rel=1e-3)
    dense = decode_cost(LLAMA2_70B, 3.35e12, 2)
    assert dense.params_read == pytest.approx(68.98e9, rel=1e-3)
    assert dense.latency_s / mix.latency_s == pytest.approx(5.36, rel=1e-2)
    v3 = decode_cost(DEEPSEEK_V3, 3.35e12, 1)
    assert v3.bytes_read == pytest.approx(37.55e9, rel=1e-3)             # fp8: one byte per parameter
    # a dense model's bytes per token fall as 1/batch; the MoE's fall slower (more experts touched)
    assert decode_cost(LLAMA2_70B, 3.35e12, 2, batch=8).bytes_read == pytest.approx(dense.bytes_read / 8)
    assert decode_cost(MIXTRAL_8X7B, 3.35e12, 2, batch=8).bytes_read > mix.bytes_read / 8
    assert expected_experts_touched(8, 2, 1) == pytest.approx(2)
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        decode_cost(MIXTRAL_8X7B, 0)
