"""The planner's activation peak counted along a split-backward schedule's actions (ZB-H1)."""
import dataclasses

import pytest

from labkit.model import GPTConfig
from labkit.pipeline.registry import lookup
from labkit.plan.memory import memory_per_rank, schedule_activation_peak
from labkit.plan.spec import Layout, ModelSpec

SPEC = ModelSpec.from_gpt_config(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16),
                                 seq_len=16, global_batch=8)
LAY = Layout(t=2, p=2, d=2, b=2, M=2, precision="fp32")


def test_zb_h1_last_stage_keeps_a_w_pending_microbatch_without_its_cross_entropy():
    actions = lookup("zb-h1").build(2, 2, 1)      # rank 1: F0 I0 F1 I1 W0 W1
    one = memory_per_rank(SPEC, LAY, device="cpu")  # 1F1B: one microbatch in flight on the last stage
    sb, h, e = 32, 16, 4
    ce = sb * 128 * 4 + 10 * sb                     # vocab-parallel softmax (V/t fp32) + targets and masks
    assert schedule_activation_peak(SPEC, LAY, actions[1], 1, "cpu") == 2 * one[1].activations - ce
    assert schedule_activation_peak(SPEC, LAY, actions[0], 0, "cpu") == one[0].activations   # F0 F1 first
    assert ce < one[1].activations - 2 * sb * h * e


def test_one_f_one_b_actions_give_the_in_flight_formula():
    actions = lookup("1f1b").build(2, 2, 1)
    mem = memory_per_rank(SPEC, LAY, device="cpu")
    assert [schedule_activation_peak(SPEC, LAY, actions[r], r, "cpu") for r in (0, 1)] == \
        [m.activations for m in mem]


def test_full_recompute_with_split_backward_is_refused():
    with pytest.raises(ValueError, match="recompute='full' is modelled for schedules without split backward"):
        schedule_activation_peak(SPEC, dataclasses.replace(LAY, recompute="full"), lookup("zb-h1").build(2, 2, 1)[0], 0)


def test_full_recompute_along_one_f_one_b_actions_gives_the_formula():
    """One layer per stage: the recomputed layer's stash next to the kept inputs is the formula's
    peak (memory_per_rank: in-flight inputs + the largest recomputed stash, less the freed head)."""
    lay = dataclasses.replace(LAY, recompute="full")
    actions = lookup("1f1b").build(2, 2, 1)
    mem = memory_per_rank(SPEC, lay, device="cpu")
    assert [schedule_activation_peak(SPEC, lay, actions[r], r, "cpu") for r in (0, 1)] == \
        [m.activations for m in mem]
