"""The planner's context-parallel terms and the Llama 3 405B layouts (no process is started).

Activation memory divided by cp, K/V traffic per algorithm and its link, the three published
405B layouts of Dubey et al. 2024 (Table 4) fitting 80 GB with predicted MFU near the published
one. The planner's CP bytes against labkit's measured run: tests/context_parallel/test_context_parallel.py."""
import dataclasses

import pytest

from labkit.plan.comm import axis_links, comm_per_rank
from labkit.plan.memory import check_layout, memory_per_rank
from labkit.plan.spec import CLUSTERS, LLAMA3_405B_ASSUMED, PUBLISHED, Layout, llama3_405b_layouts, preset
from labkit.plan.timing import step_time

H100 = CLUSTERS["h100-80gb"]


def test_llama3_405b_preset_matches_the_paper():
    spec = preset("llama3-405b")
    assert (spec.n_layer, spec.hidden, spec.ffn_hidden, spec.n_head, spec.kv_heads, spec.vocab_size) == \
        (126, 16384, 53248, 128, 8, 128000)
    assert spec.total_params() == pytest.approx(405e9, rel=0.005)


@pytest.mark.parametrize("i", range(3))
def test_llama3_layouts_fit_and_predict_the_published_mfu(i):
    """Each published layout has its GPU count, fits 80 GB in the planner, and the time model's
    MFU is within 6 points of the published (43 / 41 / 38 %, i.e. 430 / 400 / 380 TFLOP/s of 989)."""
    spec, lay, row = llama3_405b_layouts()[i]
    assert lay.n_gpus == row["gpus"] and lay.t * lay.cp * lay.p * lay.d == row["gpus"]
    assert abs(100 * row["tflops_per_gpu"] / 989 - row["mfu"]) < 1     # the paper rounds both (400 -> 40.4 vs 41)
    assert max(r.total for r in memory_per_rank(spec, lay)) < 80e9
    T = step_time(spec, lay, H100)
    assert abs(100 * T.mfu - row["mfu"]) < 6, (i, 100 * T.mfu, row["mfu"])


def test_llama3_needs_recompute_in_the_planner():
    """Without activation recompute the first pipeline rank would need more than 80 GB
    (the assumption LLAMA3_405B_ASSUMED states)."""
    for spec, lay, _ in llama3_405b_layouts():
        assert max(r.total for r in memory_per_rank(spec, dataclasses.replace(lay, recompute="none"))) > 80e9


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("cp", [2, 4, 16])
def test_activation_memory_divided_by_cp(cp, fused):
    """With a fused attention kernel every activation term is linear in the rank's tokens s/cp:
    cp x the CP rank's activations = the cp = 1 activations, whatever the CP algorithm. Without
    one the planner counts what labkit's CP core keeps (the gathered K/V, s x s Ulysses scores:
    not linear in s/cp), proved against the measured bytes in tests/parallel/test_parallel_cp.py."""
    spec = dataclasses.replace(preset("llama3-70b"), seq_len=16384, global_batch=64)
    base = Layout(t=8, p=4, d=2, b=1, sequence_parallel=True, fused_attention=fused)
    one = memory_per_rank(spec, base)
    for method in ("allgather", "ring"):      # Ulysses cannot split a_kv/t = 1 head over cp
        many = memory_per_rank(spec, dataclasses.replace(base, cp=cp, cp_attention=method))
        for a, b in zip(one, many):
            if fused:
                assert cp * b.activations == pytest.approx(a.activations, rel=1e-6), method
            assert b.params == a.params and b.optimizer == a.optimizer   # weights replicated over CP
    z1 = dataclasses.replace(base, zero=1)                  # ZeRO shards over the d cp ranks
    for a, b in zip(memory_per_rank(spec, z1), memory_per_rank(spec, dataclasses.replace(z1, cp=cp))):
        assert b.optimizer * cp == pytest.approx(a.optimizer, rel=1e-6)


def test_cp_traffic_per_algorithm_and_link():
    """Per microbatch and layer, kv = b (s/cp) (a_kv/t) d e: all-gather 2 x kv forward and
    reduce-scatter 2 x cp kv backward; ring (cp-1) + (2cp-1) messages of 2 kv; Ulysses 8 all-to-alls."""
    spec = dataclasses.replace(preset("llama3-405b"), seq_len=131072, global_batch=128)
    lay = Layout(t=8, cp=16, p=16, d=8, b=1, sequence_parallel=True, fused_attention=True)
    M, L_r, cp = 16, 8, 16                                  # 128 / (b d) microbatches; 126 layers on 16 stages
    kv = 131072 // cp * (8 // 8) * 128 * 2
    ag = comm_per_rank(spec, lay, H100)["cp"]
    assert ag.link == "inter-node" and ag.group == 16
    assert ag.ops == {"all_gather": (2 * M * L_r, 2 * M * L_r * kv),
                      "reduce_scatter": (2 * M * L_r, 2 * M * L_r * cp * kv)}
    assert ag.wire == 2 * M * L_r * (cp - 1) * kv * 2      # gather (cp-1) kv, reduce-scatter (cp-1)/cp of cp kv
    ring = comm_per_rank(spec, dataclasses.replace(lay, cp_attention="ring"), H100)["cp"]
    n = M * L_r * ((cp - 1) + (2 * cp - 1))
    assert ring.ops == {"send": (n, n * 2 * kv), "recv": (n, n * 2 * kv)}
    assert axis_links(dataclasses.replace(lay, cp=1), H100)["cp"] == "-"
    assert axis_links(Layout(t=2, cp=4), H100)["cp"] == "intra-node"
    assert axis_links(Layout(t=2, cp=4, d=2), H100)["dp"] == "inter-node"   # d cp = 8 ranks of stride t


@pytest.mark.parametrize("kw, message", [
    (dict(t=8, cp=16, cp_attention="ulysses"), "Ulysses needs cp=16 to divide the heads per TP rank a/t=16 and a_kv/t=1"),  # noqa: E501
    (dict(t=1, cp=3), "2 cp = 6 to divide the sequence length s=8192"),
    (dict(t=8, cp=2048, sequence_parallel=True), "needs t=8 to divide each CP rank's s/cp = 8192/2048 = 4 tokens"),
    (dict(cp=2, cp_attention="flash"), "cp_attention must be one of"),
])
def test_bad_cp_layouts(kw, message):
    with pytest.raises(ValueError, match=message):
        check_layout(preset("llama3-405b"), Layout(**kw))


def test_cp_with_sp_needs_t_to_divide_s_over_cp_only():
    """SP splits each CP rank's s/cp tokens over t: s = 20, cp = 2, t = 2 is valid (10 tokens per CP
    rank), though 2 cp t = 8 does not divide s."""
    spec = dataclasses.replace(preset("llama3-405b"), seq_len=20)
    check_layout(spec, Layout(t=2, cp=2, sequence_parallel=True))
    with pytest.raises(ValueError, match="s/cp = 20/2 = 10 tokens"):
        check_layout(spec, Layout(t=4, cp=2, sequence_parallel=True))


def test_assumptions_are_stated():
    assert LLAMA3_405B_ASSUMED["recompute"] == "full" and len(PUBLISHED["llama3-405b"]) == 3


@pytest.mark.parametrize("zero", [2, 3])
def test_zero23_shards_over_dp_times_cp(zero):
    """ZeRO-2/3 with CP shard over the d cp ranks that reduce the gradients together (Megatron's
    distributed optimizer over dp x cp): gradients (and under ZeRO-3 parameters) cp times smaller,
    the DP reduce-scatter's group d cp."""
    spec = dataclasses.replace(preset("llama3-70b"), seq_len=16384, global_batch=64)
    base = Layout(t=8, p=4, d=2, b=1, sequence_parallel=True, fused_attention=True, zero=zero)
    cp = 4
    for a, b in zip(memory_per_rank(spec, base), memory_per_rank(spec, dataclasses.replace(base, cp=cp))):
        assert b.grads * cp == pytest.approx(a.grads, rel=1e-6)
        assert b.optimizer * cp == pytest.approx(a.optimizer, rel=1e-6)
        assert (b.params * cp == pytest.approx(a.params, rel=1e-6)) if zero == 3 else b.params == a.params
    dp = comm_per_rank(spec, dataclasses.replace(base, cp=cp), H100)["dp"]
    assert dp.group == 2 * cp


def test_hsdp_shards_the_dense_model_states_over_a_shard_group():
    """Layout.hsdp = R (HSDP, ZeRO-3 only): the dense model states of d ranks sharded as by d/R ranks,
    the local experts unchanged (EP = d); the rule when R does not divide d or ZeRO is not 3."""
    from labkit.model import GPTConfig
    from labkit.plan.spec import ModelSpec

    spec = ModelSpec.from_gpt_config(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16),
                                     seq_len=16, global_batch=8)
    lay = Layout(t=1, p=1, d=4, b=1, M=2, zero=3, precision="fp32", hsdp=2)
    got = memory_per_rank(spec, lay, device="cpu")[0]
    by_two = memory_per_rank(spec, dataclasses.replace(lay, d=2, hsdp=1, M=4), device="cpu")[0]
    assert (got.params, got.grads, got.optimizer) == (by_two.params, by_two.grads, by_two.optimizer)
    assert got.params == 2 * memory_per_rank(spec, dataclasses.replace(lay, hsdp=1), device="cpu")[0].params
    for bad, msg in [(dict(hsdp=3), "R=3 must divide d=4"), (dict(zero=2), "with ZeRO-3")]:
        with pytest.raises(ValueError, match=msg):
            memory_per_rank(spec, dataclasses.replace(lay, **bad), device="cpu")
