"""The planner's count of an MoE layer's saved activations (labkit.plan.activations.moe_layer_activation_bytes)
against ExpertParallelMoE measured with saved_tensors_hooks on 2 ranks, uneven routing."""
import torch
import torch.distributed as dist

from labkit.checkpoint import SavedTensorMeter
from labkit.dist import launch
from labkit.model import GPTConfig
from labkit.moe.expert_parallel import ExpertParallelMoE
from labkit.moe.experts import MoELayer
from labkit.moe.model import moe_config_for
from labkit.plan.activations import moe_layer_activation_bytes, moe_row_bytes

H, F, E, K, N = 16, 64, 4, 2, 16          # the lab's MoE: experts of the dense MLP's width, top-2 of 4
CFG = moe_config_for(GPTConfig(n_layer=2, n_embd=H, n_head=2, block_size=16), n_routed_experts=E,
                     n_activated_experts=K, aux_loss_coeff=1e-2)


def _rank(ctx):
    torch.set_num_threads(1)
    layer = ExpertParallelMoE.from_dense(MoELayer(CFG), dist.new_group([0, 1]), ctx.rank, 2)
    out = []
    for seed in range(3):                  # three routings; the input's scale makes them uneven
        torch.manual_seed(10 * seed + ctx.rank)
        x = (torch.randn(1, N, H) * (1 + 2 * seed)).requires_grad_()
        with SavedTensorMeter(list(layer.parameters()) + [x]) as meter:   # the layer input is the block's
            _, stats = layer(x)
            out.append((meter.live, stats.tokens_per_expert.tolist(), layer.expert_offset, layer.n_local_experts))
    return out


def test_moe_layer_bytes_follow_the_rows_each_rank_received():
    res = launch(_rank, 2, timeout=30)
    uneven = False
    for call in range(3):
        for me in range(2):
            live, _, first, n = res[me][call]
            rows = sum(sum(res[q][call][1][first:first + n]) for q in range(2))   # the peers' slots on my experts
            assert live == moe_layer_activation_bytes(N, H, E, K, F, 4, received_rows=rows), (call, me, rows)
            uneven |= rows != N * K
            if rows != N * K:              # the balanced count (rows = N k) misses the routing's part
                assert moe_layer_activation_bytes(N, H, E, K, F, 4) != live
    assert uneven
    assert moe_row_bytes(H, F, 4) == H * 4 + 2 * F * 4 + 16 and moe_row_bytes(H, F, 4, glu=True, expert_tp=2) == \
        H * 4 + 2 * F * 4 + 16
