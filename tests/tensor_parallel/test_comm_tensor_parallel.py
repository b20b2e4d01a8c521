"""Counted communication of tensor parallelism equals the formulas (Megatron-LM sec. 3):
per transformer block 2 all-reduces of B*S*H elements forward and 2 backward; the
vocab-parallel embedding 1; the vocab-parallel cross-entropy 3 of B*S elements."""
import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import launch
from labkit.model import GPT, Block, GPTConfig
from labkit.plan.comm import tp_comm
from labkit.plan.spec import Layout, ModelSpec
from labkit.tensor_parallel import (
    ParallelBlock,
    TensorParallelGPT,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
    split_along_dim,
    vocab_parallel_cross_entropy,
)

B, S, H, V = 4, 16, 32, 256


def _records(log):
    return [(r.kind, r.group_size, r.nbytes) for r in log.records]


def _count(ctx, t):
    g, out = ctx.group, {}
    torch.manual_seed(0)
    x = torch.randn(B, S, H, requires_grad=True)

    # the four operators: what each does forward and backward
    for name, op in (("f", copy_to_tensor_model_parallel_region), ("g", reduce_from_tensor_model_parallel_region),
                     ("scatter", scatter_to_tensor_model_parallel_region),
                     ("gather", gather_from_tensor_model_parallel_region)):
        with CommLog() as fwd:
            y = op(x, g)
        with CommLog() as bwd:
            y.sum().backward()
        out[name] = (_records(fwd), _records(bwd))

    # one transformer block (attention + MLP)
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=H, block_size=S)
    block = ParallelBlock(Block(cfg), g)
    with CommLog() as fwd:
        y = block(x)
    with CommLog() as bwd:
        y.sum().backward()
    out["block"] = (_records(fwd), _records(bwd))

    # vocab-parallel embedding
    emb = VocabParallelEmbedding(V, H, group=g)
    ids = torch.randint(0, V, (B, S))
    with CommLog() as fwd:
        e = emb(ids)
    with CommLog() as bwd:
        e.sum().backward()
    out["embedding"] = (_records(fwd), _records(bwd))

    # vocab-parallel cross-entropy, without and with label smoothing
    for eps in (0.0, 0.1):
        logits = split_along_dim(torch.randn(B, S, V), -1, g).requires_grad_()
        with CommLog() as fwd:
            loss = vocab_parallel_cross_entropy(logits, ids, label_smoothing=eps, group=g)
        with CommLog() as bwd:
            loss.backward()
        out[f"ce{eps}"] = (_records(fwd), _records(bwd))

    # a whole GPT training step
    cfg = GPTConfig(n_layer=2, n_head=4, n_embd=H, block_size=S)
    model = TensorParallelGPT.from_reference(GPT(cfg), g)
    with CommLog() as fwd:
        loss = model(ids, ids)
    with CommLog() as bwd:
        loss.backward()
    out["gpt"] = (fwd.summary(), bwd.summary())
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_communication_counts_and_bytes_are_exact(t):
    res = launch(_count, t, t)
    act = B * S * H * 4                      # one fp32 activation [B, S, H] in bytes
    ar = lambda n: ("all_reduce", t, n)      # noqa: E731
    ag = lambda n: ("all_gather", t, n)      # noqa: E731
    for rank_res in res:
        assert rank_res["f"] == ([], [ar(act)])
        assert rank_res["g"] == ([ar(act)], [])
        assert rank_res["scatter"] == ([], [ag(act // t)])
        assert rank_res["gather"] == ([ag(act)], [])
        # forward: g after attention, g after MLP; backward: f of MLP, f of attention
        assert rank_res["block"] == ([ar(act), ar(act)], [ar(act), ar(act)])
        assert rank_res["embedding"] == ([ar(act)], [])
        n = B * S * 4                        # one fp32 value per token
        assert rank_res["ce0.0"] == ([ar(n), ar(n), ar(n)], [])
        # label smoothing: the sum of logits rides in the third all-reduce (2N elements)
        assert rank_res["ce0.1"] == ([ar(n), ar(n), ar(2 * n)], [])
        spec = ModelSpec.from_gpt_config(GPTConfig(n_layer=2, n_head=4, n_embd=H, block_size=S), global_batch=B)
        exp = {k: c.ops["all_reduce"]                  # the planner's TP collectives, forward and backward
               for k, c in tp_comm(spec, Layout(t=t, b=B, M=1, precision="fp32"), act_bytes=4).items()}
        fwd, bwd = rank_res["gpt"]
        assert fwd == {("all_reduce", t): exp["forward"]}
        assert bwd == {("all_reduce", t): exp["backward"]}
        assert exp["forward"] == (2 * 2 + 1 + 3, 5 * act + 3 * n)
        assert exp["backward"] == (2 * 2 + 1, 5 * act)
