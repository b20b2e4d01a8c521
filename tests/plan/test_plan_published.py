"""The planner against the published record (no process is started): Korthikanti et al. 2022
Tables 3, 4 and 5 and its memory claims, MFU / HFU by the papers' formulas, BLOOM-176B and
DeepSeek-V3's training layouts, the memory conventions (embedding-dropout mask, fp32 gradients)."""
import dataclasses

import pytest

from labkit.plan.flops import (
    hfu,
    iteration_flops,
    korthikanti_model_flops,
    korthikanti_selective_flops,
    mfu,
    narayanan_full_recompute_flops,
)
from labkit.plan.memory import grad_convention, memory_per_rank, stage_in_flight
from labkit.plan.spec import CLUSTERS, PUBLISHED, Layout, preset
from labkit.plan.timing import layer_forward_backward, step_time

T5 = PUBLISHED["korthikanti-table5"]
SELENE = CLUSTERS["selene-a100-80gb"]          # one GEMM efficiency for every row: 0.68


def _layout(P, mode):
    """Korthikanti Table 3's layout (d = 1) with "full" recompute (no SP) or SP + selective."""
    return Layout(t=P["t"], p=P["p"], d=1, v=P["v"], b=P["b"], schedule="interleaved" if P["v"] > 1 else "1f1b",
                  recompute="full" if mode == "full" else "selective", sequence_parallel=mode != "full",
                  fp32_grads=True)


@pytest.mark.parametrize("name", list(T5))
def test_table5_mfu_hfu_from_published_times(name):
    """Korthikanti 2022 Table 5: eq. 7 (model FLOPs) and eq. 8 (hardware FLOPs, selective
    recompute) over the published SP + selective time give the published MFU and HFU, within
    the rounding of the time (2 decimals) and of the percentage (1 decimal)."""
    P, spec = T5[name], preset(name)
    B, L, s, h, V = spec.global_batch, spec.n_layer, spec.seq_len, spec.hidden, spec.vocab_size
    fl = iteration_flops(spec, B, "selective")
    assert fl["model"] == pytest.approx(korthikanti_model_flops(B, L, s, h, V), rel=1e-12)
    assert fl["hardware"] == pytest.approx(korthikanti_selective_flops(B, L, s, h, V), rel=1e-12)
    assert iteration_flops(spec, B, "full")["hardware"] == pytest.approx(
        narayanan_full_recompute_flops(B, L, s, h, V), rel=1e-12)
    T = P["selective_sp"]
    for published, f in ((P["mfu"], mfu), (P["hfu"], hfu)):
        key = "model" if f is mfu else "hardware"
        lo, hi = (100 * f(fl[key], T + dt, P["gpus"], SELENE.peak_flops) for dt in (0.005, -0.005))
        assert lo - 0.05 <= published <= hi + 0.05, (name, key, lo, hi, published)


@pytest.mark.parametrize("mode", ["full", "selective_sp"])
@pytest.mark.parametrize("name", list(T5))
def test_table5_iteration_times_within_10_percent(name, mode):
    """The time model on Table 3's layouts, GEMM efficiency 0.68 for all eight: within 10 %."""
    P = T5[name]
    T = step_time(preset(name), _layout(P, mode), SELENE)
    assert abs(T.total / P[mode] - 1) < 0.10, (name, mode, T.total, P[mode])


def test_table4_one_layer_and_recompute_overhead_per_mode():
    """Korthikanti Table 4, one 22B layer (t = 8, b = 4): forward and backward within 12 %,
    and the overhead of each mode over "none" within 3 points of the published one
    (full +39 %, selective +7 %, selective + SP +4 %, SP -3 %)."""
    spec, pub = preset("korthikanti-22b"), PUBLISHED["korthikanti-table4"]
    modes = {"none": ("none", False), "sp": ("none", True), "full": ("full", False),
             "selective": ("selective", False), "selective_sp": ("selective", True)}
    got = {k: layer_forward_backward(spec, Layout(t=8, b=4, M=1, recompute=rc, sequence_parallel=sp), SELENE)
           for k, (rc, sp) in modes.items()}
    for k, (f, b) in pub.items():
        assert got[k][0] * 1e3 == pytest.approx(f, rel=0.12) and got[k][1] * 1e3 == pytest.approx(b, rel=0.12), k
        over, pub_over = sum(got[k]) / sum(got["none"]) - 1, sum(pub[k]) / sum(pub["none"]) - 1
        assert abs(over - pub_over) < 0.03, (k, over, pub_over)
    assert sum(got["full"]) > sum(got["selective"]) > sum(got["selective_sp"]) > sum(got["sp"])


@pytest.mark.parametrize("name", list(T5))
def test_activation_memory_claims(name):
    """Korthikanti 2022 sec. 5 / Fig. 7, first pipeline stage: SP + selective recompute keeps
    below 20 % of the TP-only activations, full recompute about 10 % (here 8-13 %)."""
    P, spec = T5[name], preset(name)
    kw = dict(t=8, p=P["p"], d=1, v=P["v"], b=P["b"], schedule="interleaved" if P["v"] > 1 else "1f1b")
    tp = memory_per_rank(spec, Layout(**kw))[0].activations
    sel = memory_per_rank(spec, Layout(**kw, sequence_parallel=True, recompute="selective"))[0].activations
    full = memory_per_rank(spec, Layout(**kw, recompute="full"))[0].activations
    assert sel / tp < 0.20 and 0.08 < full / tp < 0.13, (name, sel / tp, full / tp)


def test_bloom_176b_layout_fits():
    """BigScience 2022: TP 4 x PP 12 x DP 8 on 384 A100 80GB, bf16, ZeRO-1, checkpointing."""
    P, spec = PUBLISHED["bloom-176b"], preset("bloom-176b")
    assert spec.total_params() == pytest.approx(176.2e9, rel=0.005)
    lay = Layout(t=P["t"], p=P["p"], d=P["d"], b=P["b"], zero=1, recompute="full")
    assert lay.n_gpus == P["gpus"]
    assert max(r.total for r in memory_per_rank(spec, lay)) < P["gpu_memory_gb"] * 1e9
    assert max(r.total for r in memory_per_rank(spec, dataclasses.replace(lay, recompute="none"))) > 80e9
    step_time(spec, lay, SELENE)          # the time model runs on it


def test_deepseek_v3_dualpipe_layout_fits():
    """DeepSeek-V3 report sec. 3.2: PP 16 x EP 64 x ZeRO-1 DP (d = 128), no TP, 2048 H800 80GB,
    DualPipe: each rank holds 2 stages (2x the 1F1B parameters) and PP + 1 activations."""
    P, spec = PUBLISHED["deepseek-v3"], preset("deepseek-v3")
    lay = Layout(t=1, p=P["p"], d=P["gpus"] // P["p"], ep=P["ep"], schedule="dualpipe", zero=1, recompute="full",
                 fused_attention=True)
    ranks = memory_per_rank(spec, lay)
    assert max(r.total for r in ranks) < P["gpu_memory_gb"] * 1e9
    one = memory_per_rank(spec, dataclasses.replace(lay, schedule="1f1b"))
    r = 5                                  # a middle rank: stages 5 and 10, 2x the layers of 1F1B's stage 5
    assert ranks[r].param_count == one[5].param_count + one[10].param_count
    assert ranks[r].in_flight == P["p"] + 1
    step_time(spec, lay, CLUSTERS["h800-80gb"])


def test_embedding_dropout_mask_on_gpt3_rank0():
    """The embedding-dropout mask (s b h bool on CUDA) on GPT-3 175B's rank 0 at t = p = 8:
    8 microbatches in flight x 2048 x 12288 bytes = 0.2 GB, present only with dropout > 0."""
    gpt3 = preset("gpt3-175b")
    lay = Layout(t=8, p=8, d=1, b=1, M=64)
    on = memory_per_rank(gpt3, lay)[0].activations
    without_emb = memory_per_rank(dataclasses.replace(gpt3, dropout=0.0), lay)[0].activations
    layer_masks = on - without_emb - stage_in_flight(lay, 64, "first") * 2048 * 12288
    assert stage_in_flight(lay, 64, "first") * 2048 * 12288 / 1e9 == pytest.approx(0.2, abs=0.01)
    assert layer_masks > 0                  # the layers' masks come on top


def test_fp32_gradient_convention_18_bytes_per_parameter():
    """Megatron-LM's theoretical memory: 18 bytes per parameter (fp32 gradients), 6 + 12/d with
    the distributed optimizer; labkit's default 16 (bf16 gradients), 4 + 12/d; the output says which."""
    spec = preset("gpt3-175b")
    for d in (1, 8):
        for fp32, z0, z1 in ((True, 18, 6 + 12 / d), (False, 16, 4 + 12 / d)):
            for zero, want in ((0, z0), (1, z1)):
                r = memory_per_rank(spec, Layout(t=8, p=16, d=d, zero=zero, fp32_grads=fp32))[3]
                assert (r.params + r.grads + r.optimizer) / r.param_count == pytest.approx(want, rel=1e-4)
    assert "18 bytes per parameter" in grad_convention(Layout(fp32_grads=True))
    assert "Megatron" in grad_convention(Layout(fp32_grads=True))
    assert "16 bytes per parameter" in grad_convention(Layout()) and "labkit" in grad_convention(Layout())
    assert "fp32-grads" in Layout(fp32_grads=True).describe()


def test_interleaving_bubble_and_messages_in_the_time_model():
    """v chunks: bubble (1/v)(p-1)/M of the work; v times the pipeline messages; Megatron's
    scatter/gather sends b s h / t per message instead of b s h."""
    spec = preset("korthikanti-175b")
    base = dict(t=8, p=8, d=1, b=1, recompute="selective", sequence_parallel=True)
    one = step_time(spec, Layout(**base), SELENE)
    three = step_time(spec, Layout(**base, v=3, schedule="interleaved"), SELENE)
    M = 64
    assert one.bubble / one.compute == pytest.approx(7 / M, rel=1e-9)
    assert three.bubble / three.compute == pytest.approx(7 / (3 * M), rel=1e-9)
    assert three.pp == pytest.approx(3 * one.pp, rel=0.02)
    no_sp = dict(base, sequence_parallel=False)
    sg = step_time(spec, Layout(**no_sp), SELENE).pp
    full = step_time(spec, Layout(**no_sp, pp_scatter_gather=False), SELENE).pp
    assert full > 4 * sg


def test_cli_names_the_convention_and_reports_hfu(capsys):
    from labkit.__main__ import main as labkit_main
    assert labkit_main(["plan", "--model", "bloom-176b", "--gpus", "384", "--layout", "t=4,p=12,d=8",
                        "--recompute", "full", "--micro-batch", "2", "--fp32-grads"]) == 0
    out = capsys.readouterr().out
    assert "Megatron-LM's convention, fp32 gradients: 2+4+12 = 18 bytes per parameter" in out
    assert "HFU" in out and "GEMM efficiency 0.68" in out and "fp32-grads" in out
    assert labkit_main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "labkit's convention, bf16 gradients: 2+2+12 = 16 bytes per parameter" in out and "HFU%" in out
