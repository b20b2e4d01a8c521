"""The planner's expert tensor parallelism (Layout.etp, Megatron-Core's expert_tensor_parallel_size)."""
import dataclasses

import pytest

from labkit.model import GPTConfig
from labkit.plan.comm import comm_per_rank
from labkit.plan.memory import memory_per_rank, rank_param_counts
from labkit.plan.spec import Layout, ModelSpec

# h = 16, E = 4 experts of width 64 (GeLU, biases), every 2nd layer MoE, top-2
SPEC = dataclasses.replace(
    ModelSpec.from_gpt_config(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True),
                              seq_len=16, global_batch=8),
    n_routed_experts=4, n_activated_experts=2, n_shared_experts=0, moe_ffn=64, moe_layer_freq=2)
LAY = Layout(t=2, p=2, d=2, b=2, M=2, ep=2, precision="fp32")


def test_etp_defaults_to_t_and_splits_each_expert_over_etp_ranks():
    e_split, e_rep = SPEC.mlp_params(64)            # fc1 and fc2 weights + fc1 bias; the fc2 bias
    default, etp2, etp1 = (rank_param_counts(SPEC, dataclasses.replace(LAY, etp=etp), 1)["expert"]
                           for etp in (None, 2, 1))
    assert default == etp2 == 2 * (e_split + e_rep) // 2     # E/ep = 2 experts, everything / t (as before)
    assert etp1 == 2 * (e_split + e_rep)                     # whole experts on every TP rank
    mem = memory_per_rank(SPEC, dataclasses.replace(LAY, etp=1), device="cpu")
    assert mem[1].params == 4 * (rank_param_counts(SPEC, LAY, 1)["dense"] + etp1)
    assert mem[0].params == memory_per_rank(SPEC, LAY, device="cpu")[0].params   # no MoE layer there


def test_etp1_moe_layer_has_no_tp_all_reduce_around_its_mlp():
    M, act = 2, 16 * 2 * 16 * 4                      # microbatches; N h e bytes per all-reduce
    tp_t = comm_per_rank(SPEC, LAY, pp_rank=1, act_bytes=4)["tp"].ops["all_reduce"]
    tp_1 = comm_per_rank(SPEC, dataclasses.replace(LAY, etp=1), pp_rank=1, act_bytes=4)["tp"].ops["all_reduce"]
    assert tp_t[0] - tp_1[0] == 2 * M and tp_t[1] - tp_1[1] == 2 * M * act
    ep = comm_per_rank(SPEC, dataclasses.replace(LAY, etp=1), pp_rank=1, act_bytes=4)["ep"].ops
    assert ep == {"all_to_all": (4 * M, 4 * M * 32 * 2 * 16 * 4)}    # unchanged by etp: k N h e each


def test_etp1_expert_activations_are_not_split_by_t():
    m_t = memory_per_rank(SPEC, LAY, device="cpu")[1].activations
    m_1 = memory_per_rank(SPEC, dataclasses.replace(LAY, etp=1), device="cpu")[1].activations
    assert m_1 - m_t == 2 * (32 * 2) * 64 * 4 // 2   # GeLU and fc2 inputs of k N slots x 64, no longer / t


@pytest.mark.parametrize("etp", [0, 3])
def test_bad_etp_is_refused(etp):
    with pytest.raises(ValueError, match=f"expert TP size etp={etp} must be >= 1 and divide t=2"):
        memory_per_rank(SPEC, dataclasses.replace(LAY, etp=etp))


def test_zero3_units_follow_moe_layer_freq():
    """The FSDP units of a rank sum to its dense parameters (zero3_units' rule), with every 2nd layer
    MoE: a dense layer (layer 0 here, on pipeline rank 0) is a whole dense layer, not an MoE layer's
    dense part (the planner once read only first_dense_layers)."""
    from labkit.plan.memory import zero3_units
    lay = dataclasses.replace(LAY, zero=3)
    for r in range(2):
        assert sum(zero3_units(SPEC, lay, r)) == rank_param_counts(SPEC, lay, r)["dense"], r
