"""Library bad input: one ValueError naming the value and the rule, before anything runs."""
import math

import pytest

from labkit.model import GPTConfig
from labkit.moe import MoEConfig, MoELayer, TopKRouter, compute_capacity
from labkit.moe.expert_parallel import ExpertParallelMoE
from labkit.pipeline import ScheduleError
from labkit.pipeline.stages import stage_layers


@pytest.mark.parametrize("kwargs,message", [
    ({"n_head": 0}, "n_head must be an integer >= 1, got 0"),
    ({"n_kv_head": 0}, "n_kv_head must be an integer >= 1, got 0"),
    ({"n_layer": 2.5}, "n_layer must be an integer >= 1, got 2.5"),
    ({"n_layer": True}, "n_layer must be an integer >= 1, got True"),
    ({"n_embd": "64"}, "n_embd must be an integer >= 1, got '64'"),
    ({"block_size": -1}, "block_size must be an integer >= 1, got -1"),
    ({"dropout": 1.0}, r"dropout must be a probability in \[0, 1\), got 1.0"),
    ({"dropout": math.nan}, r"dropout must be a probability in \[0, 1\), got nan"),
    ({"n_embd": 30, "n_head": 4}, "n_embd=30 must be divisible by n_head=4"),
])
def test_gpt_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("factor", [math.inf, -math.inf, math.nan, 0.0, -1.0, "2"])
def test_router_capacity_factor_must_be_finite_and_positive(factor):
    rule = "capacity_factor must be a finite number > 0, or None for no dropping; got"
    with pytest.raises(ValueError, match=rule):
        TopKRouter(8, 4, 1, capacity_factor=factor)
    with pytest.raises(ValueError, match=rule):
        MoELayer(MoEConfig(n_embd=8, n_routed_experts=4, capacity_factor=factor))
    with pytest.raises(ValueError, match=rule):
        compute_capacity(16, 4, 1, factor)


@pytest.mark.parametrize("args,message", [
    ((16, 0, 1, 1.0), "num_experts E must be an integer >= 1, got 0"),
    ((16, 4, 0, 1.0), "top_k k must be an integer >= 1, got 0"),
    ((-1, 4, 1, 1.0), "num_tokens T must be an integer >= 0, got -1"),
    ((16, 4, 1, 1.0, -2), "min_capacity must be an integer >= 0, got -2"),
])
def test_compute_capacity_sizes(args, message):
    with pytest.raises(ValueError, match=message):
        compute_capacity(*args)
    assert compute_capacity(5, 4, 1, 3.0) == 4 and compute_capacity(0, 4, 1, 1.0) == 1


@pytest.mark.parametrize("rank,size,message", [
    (4, 4, r"ep_rank=4 must be an integer in 0..ep_size-1 = 0..3"),
    (-1, 4, r"ep_rank=-1 must be an integer in 0..ep_size-1 = 0..3"),
    (0, 0, "ep_size must be an integer >= 1, got 0"),
])
def test_expert_parallel_rank_in_range(rank, size, message):
    with pytest.raises(ValueError, match=message):
        ExpertParallelMoE(MoEConfig(n_embd=8, n_routed_experts=8), None, rank, size)


@pytest.mark.parametrize("args,message", [
    ((8, 4, 4), r"stage=4 is outside 0..n_stages-1 = 0..3"),
    ((8, 4, -1), r"stage=-1 is outside 0..n_stages-1 = 0..3"),
    ((8, 3, 0), "n_layer=8 layers cannot be split evenly into K\\*v=3 stages"),
    ((8, 0, 0), "n_layer=8 and n_stages=0 must both be >= 1"),
    ((8, 4, 1.0), "stage must be an integer, got 1.0"),
])
def test_stage_layers(args, message):
    with pytest.raises(ScheduleError, match=message):
        stage_layers(*args)
    assert list(stage_layers(8, 4, 3)) == [6, 7]
