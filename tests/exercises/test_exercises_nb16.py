"""Exercises of notebook 16_context_parallel: the solutions pass, plausible wrong answers fail a public
case with a message that names the mistake."""
import pytest
import torch

from labkit.grading.testing import assert_check_passes, assert_public_case_fails


def merge_attention_partials(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    return torch.exp(lse_a - safe)[..., None] * out_a + torch.exp(lse_b - safe)[..., None] * out_b, lse


def merge_averaged(out_a, lse_a, out_b, lse_b):
    """Wrong: probabilities (outputs) averaged."""
    return (out_a + out_b) / 2, torch.logaddexp(lse_a, lse_b)


def merge_added(out_a, lse_a, out_b, lse_b):
    return out_a + out_b, torch.logaddexp(lse_a, lse_b)


def merge_lse_ratio(out_a, lse_a, out_b, lse_b):
    s = (lse_a + lse_b)[..., None]
    return lse_a[..., None] / s * out_a + lse_b[..., None] / s * out_b, torch.logaddexp(lse_a, lse_b)


def merge_unshifted(out_a, lse_a, out_b, lse_b):
    """Wrong: exp of the raw log-sum-exps (overflows for large scores)."""
    ea, eb = torch.exp(lse_a)[..., None], torch.exp(lse_b)[..., None]
    return (ea * out_a + eb * out_b) / (ea + eb), torch.log(torch.exp(lse_a) + torch.exp(lse_b))


def merge_inf_as_zero(out_a, lse_a, out_b, lse_b):
    """Wrong: -inf log-sum-exps replaced by 0 "to avoid NaNs" before the (otherwise right) merge."""
    return merge_attention_partials(out_a, lse_a.nan_to_num(neginf=0.0), out_b, lse_b.nan_to_num(neginf=0.0))


def merge_lse_max(out_a, lse_a, out_b, lse_b):
    out, _ = merge_attention_partials(out_a, lse_a, out_b, lse_b)
    return out, torch.maximum(lse_a, lse_b)


def merge_no_guard(out_a, lse_a, out_b, lse_b):
    """Wrong: no guard for rows with no key in either block (-inf - -inf = NaN there); right elsewhere
    (a second red team found it passing every case)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b, lse


def causal_chunk_placement(cp):
    return [(i, 2 * cp - 1 - i) for i in range(cp)]


def contiguous_pairs(cp):
    return [(2 * i, 2 * i + 1) for i in range(cp)]


def strided_pairs(cp):
    return [(i, i + cp) for i in range(cp)]


def mirrored_twice(cp):
    return [(i, 2 * cp - 1 - i) if i < cp - 1 else (0, 2 * cp - 1) for i in range(cp)]


def test_solutions_pass():
    assert_check_passes("16.1", merge_attention_partials)
    assert_check_passes("16.2", causal_chunk_placement)
    assert_check_passes("16.2", lambda cp: [(2 * cp - 1 - i, i) for i in reversed(range(cp))])  # any balanced order


@pytest.mark.parametrize("wrong, case, contains", [
    (merge_averaged, "two blocks", "the two outputs were averaged"),
    (merge_added, "two blocks", "the two outputs were added"),
    (merge_lse_ratio, "two blocks", "log-sum-exps are logarithms"),
    (merge_unshifted, "large scores", "exp of a log-sum-exp overflows"),
    (merge_inf_as_zero, "causal: block b fully masked", "lse_b = -inf was treated as 0"),
    (merge_lse_max, "two blocks", "this is the larger of the two"),
    (merge_no_guard, "causal: two rows see no key in either block", "some rows see no key in either block"),
])
def test_merge_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("16.1", wrong, case, contains=contains)


@pytest.mark.parametrize("wrong, case, contains", [
    (contiguous_pairs, "cp = 2", "this is the contiguous split again"),
    (strided_pairs, "cp = 2", "chunk i with chunk i + cp"),
    (mirrored_twice, "cp = 2", "held twice [0, 3], held by nobody [1, 2]"),
])
def test_placement_mistakes_are_named(wrong, case, contains):
    assert_public_case_fails("16.2", wrong, case, contains=contains)


def test_integers_of_any_kind_are_accepted_and_a_wrong_type_is_named():
    """Issue 36: the right pairs built from NumPy ints were told "expected a list of 2 pairs, got a list of 2 items"."""
    import numpy as np
    assert_check_passes("16.2", lambda cp: [(np.int64(a), np.int64(b)) for a, b in causal_chunk_placement(cp)])
    assert_check_passes("16.2", lambda cp: [(torch.tensor(a), torch.tensor(b)) for a, b in causal_chunk_placement(cp)])
    assert_check_passes("16.2", lambda cp: np.array(causal_chunk_placement(cp)))
    assert_check_passes("16.2", lambda cp: torch.tensor(causal_chunk_placement(cp)))
    assert_public_case_fails("16.2", lambda cp: [(float(a), b) for a, b in causal_chunk_placement(cp)], "cp = 2",
                             contains="chunk ids are ints; rank 0's pair holds float 0")
    assert_public_case_fails("16.2", lambda cp: [a for a, b in causal_chunk_placement(cp)], "cp = 2",
                             contains="item 0 (rank 0) is int 0")


def merge_unnormalised(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return lse_a.exp()[..., None] * out_a + lse_b.exp()[..., None] * out_b, lse


def merge_inverted(out_a, lse_a, out_b, lse_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return torch.exp(lse - lse_a)[..., None] * out_a + torch.exp(lse - lse_b)[..., None] * out_b, lse


def test_merge_learner_round_mistakes_are_named():
    assert_public_case_fails("16.1", merge_unnormalised, "two blocks", contains="with nothing dividing by the total")
    assert_public_case_fails("16.1", merge_inverted, "two blocks", contains="the inverse of its share")


def merge_lse_summed(out_a, lse_a, out_b, lse_b):
    """Wrong: the outputs merged right, the log-sum-exps added (the log of a product of the sums)."""
    lse = torch.logaddexp(lse_a, lse_b)
    out = torch.exp(lse_a - lse)[..., None] * out_a + torch.exp(lse_b - lse)[..., None] * out_b
    return out, lse_a + lse_b


def test_lse_summed_is_named():
    """Issue 36's audit: each named mistake of 16.1 has a wrong answer whose line names it."""
    assert_public_case_fails("16.1", merge_lse_summed, "two blocks", contains="this is lse_a + lse_b, the log of a "
                             "product of sums")
