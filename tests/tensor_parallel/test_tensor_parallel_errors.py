"""Bad sizes and bad targets raise a clear ValueError naming the sizes, before any
communication (checked with CommLog: nothing was issued)."""
import pytest
import torch

from labkit.comm import CommLog
from labkit.dist import RankError, launch
from labkit.model import GPT, GPTConfig
from labkit.tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    RowParallelLinear,
    TensorParallelGPT,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


def _errors(ctx):
    g = ctx.group
    cases = {
        "column": lambda: ColumnParallelLinear(8, 6, group=g),
        "row": lambda: RowParallelLinear(6, 8, group=g),
        "heads": lambda: ParallelAttention(32, n_head=4, n_kv_head=4, group=g),
        "kv_heads": lambda: ParallelAttention(32, n_head=8, n_kv_head=2, group=g),
        "vocab": lambda: VocabParallelEmbedding(10, 4, group=g),
        "gpt_vocab": lambda: TensorParallelGPT.from_reference(
            GPT(GPTConfig(vocab_size=250, n_layer=1, n_head=4, n_embd=16, block_size=8)), g),
        "target": lambda: vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.tensor([0, 16, -100]), group=g),
        "negative_target": lambda: vocab_parallel_cross_entropy(torch.zeros(3, 4), torch.tensor([0, -1, 2]), group=g),
        "gpt_target": lambda: TensorParallelGPT.from_reference(
            GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8)), g)(
                torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1, 2, 256, 3]])),
        "embedding_ids": lambda: VocabParallelEmbedding(8, 4, group=g)(torch.tensor([1, 8])),
        # logits already gathered over TP ([*, V] instead of [*, V/t]) would add log t to the loss
        "gathered_logits": lambda: vocab_parallel_cross_entropy(torch.zeros(3, 16), torch.tensor([0, 5, -100]),
                                                                group=g, vocab_size=16),
        "gpt_gathered_logits": lambda: TensorParallelGPT.from_reference(
            GPT(GPTConfig(n_layer=1, n_head=4, n_embd=16, block_size=8)), g).head.loss(
                torch.zeros(1, 4, 256), torch.tensor([[1, 2, 255, 3]])),
    }
    out = {}
    for name, make in cases.items():
        with CommLog() as log:
            try:
                make()
                out[name] = ("no error", "", 0)
            except Exception as e:  # noqa: BLE001
                out[name] = (type(e).__name__, str(e), log.count())
    return out


def test_errors_name_the_sizes_before_any_communication():
    res = launch(_errors, 4)[0]
    expect = {
        "column": ["t=4", "out_features", "=6"],
        "row": ["t=4", "in_features", "=6"],
        "heads": ["t=4", "attention heads", "n_head=4"],   # 4 heads / 4 fine; see kv below
        "kv_heads": ["t=4", "key/value heads", "n_kv_head=2"],
        "vocab": ["t=4", "vocabulary", "=10"],
        "gpt_vocab": ["t=4", "vocabulary", "=250"],
        "target": ["[0, V=16)", "16", "ignore_index=-100"],
        "negative_target": ["[0, V=16)", "-1"],
        "gpt_target": ["[0, 256)", "256"],
        "embedding_ids": ["[0, 8)", "8"],
        "gathered_logits": ["logits (3, 16)", "target (3,)", "V/t = 16/4 = 4", "got 16", "t=4"],
        "gpt_gathered_logits": ["logits (1, 4, 256)", "target (1, 4)", "V/t = 256/4 = 64", "got 256", "t=4"],
    }
    # 4 heads over t=4 is valid: that case must NOT raise
    assert res.pop("heads")[0] == "no error"
    expect.pop("heads")
    for name, words in expect.items():
        etype, msg, n_comm = res[name]
        assert etype == "ValueError", (name, etype, msg)
        for w in words:
            assert w in msg, (name, w, msg)
        assert n_comm == 0, f"{name}: {n_comm} collectives issued before the error"


def test_heads_not_divisible_and_error_names_the_rank():
    def fn(ctx):
        return ParallelAttention(32, n_head=2, n_kv_head=2, group=ctx.group)  # t=4 > 2 heads

    with pytest.raises(RankError) as err:
        launch(fn, 4)
    assert err.value.exc_type == "ValueError"
    assert "t=4" in err.value.original_message and "n_head=2" in err.value.original_message
    assert "attention heads" in err.value.original_message
