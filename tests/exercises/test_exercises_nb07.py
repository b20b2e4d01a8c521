"""Exercises of notebook 07_attention_embedding_loss: the solutions pass, plausible wrong answers
fail with a message that says what was expected and what came back."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import comm
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


def heads_of_rank(n_head, t, rank):
    if t < 1 or n_head % t:
        raise ValueError("t must divide n_head")
    if not 0 <= rank < t:
        raise ValueError("rank outside 0..t-1")
    w = n_head // t
    return list(range(rank * w, (rank + 1) * w))


def heads_strided(n_head, t, rank):
    """Wrong: round-robin heads (rank r takes r, r+t, ...); the layers' shards are contiguous."""
    if n_head % t:
        raise ValueError("t must divide n_head")
    return list(range(rank, n_head, t))


def heads_no_rank_check(n_head, t, rank):
    """Wrong only in a hidden case: accepts a rank outside 0..t-1."""
    if n_head % t:
        raise ValueError("t must divide n_head")
    w = n_head // t
    return list(range(rank * w, (rank + 1) * w))


def partial_embedding(ids, weight_shard, vocab_start):
    n = weight_shard.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + n)
    out = F.embedding((ids - vocab_start).masked_fill(outside, 0), weight_shard)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def embedding_clamped(ids, weight_shard, vocab_start):
    """Wrong: clamps foreign ids into the block instead of zeroing their rows."""
    n = weight_shard.shape[0]
    return F.embedding((ids - vocab_start).clamp(0, n - 1), weight_shard)


def embedding_mask_ids_only(ids, weight_shard, vocab_start):
    """Wrong: replaces foreign ids by row 0 but forgets to zero the output rows."""
    n = weight_shard.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + n)
    return F.embedding((ids - vocab_start).masked_fill(outside, 0), weight_shard)


def _target_logit(z, target, group):
    n = z.shape[-1]
    start = dist.get_rank(group) * n
    mine = (target >= start) & (target < start + n)
    return z.gather(-1, (target - start).masked_fill(~mine, 0).unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)


def vocab_parallel_ce(local_logits, target, group):
    m = local_logits.max(dim=-1).values
    comm.all_reduce(m, group=group, op=dist.ReduceOp.MAX)
    z = local_logits - m.unsqueeze(-1)
    z_y = comm.all_reduce(_target_logit(z, target, group), group=group)
    s = comm.all_reduce(z.exp().sum(-1), group=group)
    return s.log() - z_y


def ce_local_max(local_logits, target, group):
    """Wrong: subtracts each rank's own max (the shifted pieces no longer add up)."""
    z = local_logits - local_logits.max(dim=-1, keepdim=True).values
    z_y = comm.all_reduce(_target_logit(z, target, group), group=group)
    s = comm.all_reduce(z.exp().sum(-1), group=group)
    return s.log() - z_y


def ce_no_max(local_logits, target, group):
    """Wrong: no max subtraction (right for small logits, overflows for large ones)."""
    z_y = comm.all_reduce(_target_logit(local_logits, target, group), group=group)
    s = comm.all_reduce(local_logits.exp().sum(-1), group=group)
    return s.log() - z_y


def ce_gather(local_logits, target, group):
    """Wrong: gathers the N x V logits."""
    parts = [torch.empty_like(local_logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local_logits.contiguous(), group=group)
    return F.cross_entropy(torch.cat(parts, dim=-1), target, reduction="none")


def ce_mean(local_logits, target, group):
    """Wrong: returns the mean instead of one loss per token."""
    return vocab_parallel_ce(local_logits, target, group).mean()


@pytest.mark.parametrize("ex, answer", [("7.1", heads_of_rank), ("7.2", partial_embedding),
                                        ("7.3", vocab_parallel_ce)])
def test_solution_passes(ex, answer):
    assert_check_passes(ex, answer)


@pytest.mark.parametrize("ex, answer, contains", [
    ("7.1", heads_strided, "heads_of_rank(n_head=4, t=2, rank=0)[1]: expected 1, got 2"),
    ("7.1", heads_no_rank_check, "a hidden case failed"),
    ("7.2", embedding_clamped, "rows of ids it does not own must be 0"),
    ("7.2", embedding_mask_ids_only, "largest difference"),
    ("7.3", ce_local_max, "per-token loss on rank 0 (vs F.cross_entropy on the full logits)"),
    ("7.3", ce_no_max, "no global max was subtracted before exp"),
    ("7.3", ce_gather, "it called all_gather"),
    ("7.3", ce_mean, "one loss per token"),
])
def test_wrong_answer_fails_with_a_useful_message(ex, answer, contains):
    res = assert_check_fails(ex, answer, contains=contains)
    assert "Hint:" in res.message
    told = res.message.split(" Hint: ")[0]  # the message names the mistake, never the fix
    assert not any(fix in told for fix in ("subtract the", "subtract vocab_start", "are enough", "enable_grad")), told


def embedding_no_offset(ids, weight_shard, vocab_start):
    """Wrong: indexes the shard with the global ids (forgets to subtract vocab_start)."""
    n = weight_shard.shape[0]
    outside = (ids < vocab_start) | (ids >= vocab_start + n)
    return weight_shard[ids.masked_fill(outside, 0)].masked_fill(outside[..., None], 0.0)


def ce_no_offset(local_logits, target, group):
    """Wrong: gathers the target's logit at the global id (no - r*V/t)."""
    r, n = dist.get_rank(group), local_logits.shape[1]
    m = comm.all_reduce(local_logits.max(1).values.clone(), group=group, op=dist.ReduceOp.MAX)
    own = (target >= r * n) & (target < (r + 1) * n)
    zy = torch.where(own, local_logits.gather(1, target[:, None]).squeeze(1) - m, torch.zeros_like(m))
    zy = comm.all_reduce(zy, group=group)
    s = comm.all_reduce((local_logits - m[:, None]).exp().sum(1), group=group)
    return s.log() - zy


def test_index_error_from_a_missing_offset_gets_a_hint():
    assert_public_case_fails("7.2", embedding_no_offset, "V=16, t=2",
                             contains="vocab_start=8) raised IndexError: index 12 is out of bounds for dimension 0 "
                                      "with size 8; the shard holds rows vocab_start .. vocab_start + V/t - 1")
    res = assert_public_case_fails("7.3", ce_no_offset, "t=2 ranks, N=6, V=16",
                                   contains="raised RuntimeError: index 14 is out of bounds for dimension 1 with size "
                                            "8; local_logits holds the columns of ids r*V/t")
    assert "subtract the" not in res.message.split(" Hint: ")[0], res.message


def ce_four_all_reduces(local_logits, target, group):
    """Wrong (the right loss): an extra all-reduce of the sum of exponentials' pieces."""
    comm.all_reduce(local_logits.sum(-1).clone(), group=group)
    return vocab_parallel_ce(local_logits, target, group)


_real_all_reduce = dist.all_reduce  # bound before the case: a real collective, no process group there


def ce_through_an_alias(local_logits, target, group):
    m = local_logits.max(dim=-1).values
    _real_all_reduce(m, op=dist.ReduceOp.MAX)
    return vocab_parallel_ce(local_logits, target, group)


def test_the_grader_counts_the_all_reduces_at_its_relay():
    # the count comes from the relay in the case's process, not from code next to the answer
    res = assert_check_fails("7.3", ce_four_all_reduces)
    failed = [c for c in res.cases if c.status == "failed"]
    assert [c.name for c in failed] == ["t=4: at most 3 all-reduces of N values, no gather"], res.cases
    assert "rank 0 issued 4 all-reduces (counted by the grader), more than the loss needs" in failed[0].message


def test_a_real_collective_through_an_alias_finds_no_process_group():
    res = assert_check_fails("7.3", ce_through_an_alias, contains="process group")
    assert res.passed == 0, res.cases  # t=1 too: these ranks never have a process group


def embedding_negative_unmasked(ids, weight_shard, vocab_start):
    """Wrong: subtracts vocab_start but masks only the ids past the block (F.embedding: IndexError)."""
    n = weight_shard.shape[0]
    local = ids - vocab_start
    outside = local >= n
    return F.embedding(local.masked_fill(outside, 0), weight_shard).masked_fill(outside[..., None], 0.0)


def embedding_negative_wraps(ids, weight_shard, vocab_start):
    """Wrong: the same with indexing, where row -k silently counts from the end."""
    n = weight_shard.shape[0]
    local = ids - vocab_start
    outside = local >= n
    return weight_shard[local.masked_fill(outside, 0)].masked_fill(outside[..., None], 0.0)


def embedding_above_unmasked(ids, weight_shard, vocab_start):
    """Wrong: masks only the ids below the block."""
    local = ids - vocab_start
    outside = local < 0
    return weight_shard[local.masked_fill(outside, 0)].masked_fill(outside[..., None], 0.0)


def test_unmasked_ids_below_or_above_the_block_are_named():
    """Issue 36: negative local ids left unmasked were told to subtract vocab_start (they did)."""
    res = assert_public_case_fails("7.2", embedding_negative_unmasked, "V=16, t=2",
                                   contains="ids below vocab_start belong to an earlier rank's block")
    assert "global id is not a row number" not in res.message
    assert_public_case_fails("7.2", embedding_negative_wraps, "V=16, t=2",
                             contains="the rows of ids below vocab_start=8 are not zero: they hold rows counted from "
                                      "the end of the shard")
    assert_public_case_fails("7.2", embedding_above_unmasked, "V=16, t=2",
                             contains="ids at or past vocab_start + V/t belong to a later rank's block")


def ce_sum_of_maxima(local_logits, target, group):
    """Wrong: the rank maxima all-reduced with SUM (right for small logits: any common shift works)."""
    m = local_logits.max(dim=-1).values
    comm.all_reduce(m, group=group)
    z = local_logits - m.unsqueeze(-1)
    z_y = comm.all_reduce(_target_logit(z, target, group), group=group)
    s = comm.all_reduce(z.exp().sum(-1), group=group)
    return s.log() - z_y


def test_max_reduced_with_sum_is_named():
    """Issue 36: a SUM all-reduce of the maxima was told no max was subtracted."""
    res = assert_public_case_fails("7.3", ce_sum_of_maxima, "t=2, large logits",
                                   contains="each rank's max was all-reduced with SUM")
    assert "no global max was subtracted" not in res.message


def test_head_ids_of_any_integer_kind_pass_and_floats_are_named():
    """Issue 36: ints of any kind accepted; int() truncated 0.5 to a right-looking 0 (a wrong answer passed)."""
    import numpy as np
    assert_check_passes("7.1", lambda n, t, r: [np.int64(h) for h in heads_of_rank(n, t, r)])
    assert_public_case_fails("7.1", lambda n, t, r: [h + 0.5 for h in heads_of_rank(n, t, r)], "h=4 heads, t=2",
                             contains="head ids are ints, got float 0.5")
