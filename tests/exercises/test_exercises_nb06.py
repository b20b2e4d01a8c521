"""Exercises of notebook 06_megatron_ffn: the solutions pass, plausible wrong answers fail with
a message that says what was expected and what came back."""
import pytest
import torch

from labkit import comm
from labkit.grading import evaluate
from labkit.grading.exercises.nb06_megatron_ffn import gelu
from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_passes, assert_public_case_fails
from labkit.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region


def mlp_partials(X, A, B, t):
    F = A.shape[1]
    if t < 1 or F % t:
        raise ValueError(f"t={t} must divide F={F}")
    w = F // t
    return [gelu(X @ A[:, i * w:(i + 1) * w]) @ B[i * w:(i + 1) * w, :] for i in range(t)]


def partials_rows_of_A(X, A, B, t):
    """Wrong: A split by rows (X by columns), GeLU applied to the partial sums."""
    if A.shape[1] % t:
        raise ValueError("t must divide F")
    H = A.shape[0]
    w = max(1, H // t)
    return [gelu(X[:, i * w:(i + 1) * w] @ A[i * w:(i + 1) * w]) @ B for i in range(t)]


def partials_interleaved(X, A, B, t):
    """Wrong for this exercise: rank i takes every t-th column of A and the same rows of B. The sum is
    right, but the layers' shards are contiguous blocks (rank i: columns i*F/t .. (i+1)*F/t - 1)."""
    if A.shape[1] % t:
        raise ValueError("t must divide F")
    return [gelu(X @ A[:, i::t]) @ B[i::t] for i in range(t)]


class CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), group=ctx.group), None


class CopyNoReduce(torch.autograd.Function):
    """Wrong f: identity both ways (forgets that X fed t branches)."""

    @staticmethod
    def forward(ctx, x, group):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceBothWays(torch.autograd.Function):
    """Wrong g: also all-reduces the gradient in backward (t times too large)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.contiguous().clone(), group=group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.contiguous().clone(), group=ctx.group), None


@pytest.mark.parametrize("ex, answer", [("6.1", mlp_partials), ("6.2", CopyToRegion), ("6.3", ReduceFromRegion)])
def test_solution_passes(ex, answer):
    assert_check_passes(ex, answer)


@pytest.mark.parametrize("ex, answer, words", [
    ("6.1", partials_rows_of_A, ["partial 0 expected", "do not sum"]),
    ("6.1", partials_interleaved, ["partial 0 expected", "i-th block of columns"]),
    ("6.2", CopyNoReduce, ["dL/dX on rank 0 is only the share of its own branch", "never summed"]),
    ("6.2", ReduceFromRegion, ["the sum of the ranks' partial outputs"]),
    ("6.3", ReduceBothWays, ["the sum of the ranks' dL/dX shares", "g's backward must pass the gradient through"]),
    ("6.3", CopyToRegion, ["forward output Z on rank 0", "Hint"]),
])
def test_wrong_answer_fails_with_a_useful_message(ex, answer, words):
    res = evaluate(ex, answer, stop_at_first_failure=True)
    assert res.status == "failed"
    for w in words:
        assert w in res.message, res.message


def test_not_a_function_class():
    res = evaluate("6.2", lambda x, group: x, stop_at_first_failure=True)
    assert res.status == "failed" and "autograd.Function" in res.message, res.message


def partials_divisible_H(X, A, B, t):
    """Wrong: checks that t divides H (the hidden size) instead of F (the FFN width)."""
    if X.shape[1] % t:
        raise ValueError(f"t={t} must divide H={X.shape[1]}")
    w = A.shape[1] // t
    return [gelu(X @ A[:, i * w:(i + 1) * w]) @ B[i * w:(i + 1) * w, :] for i in range(t)]


def test_raising_on_H_instead_of_F_fails_a_public_case():
    assert_public_case_fails("6.1", partials_divisible_H, "t=4, X [3, 6], A [6, 24]: t divides F, not H",
                             contains="ValueError: t=4 must divide H=6", hint="So which of the two must t divide")
    hidden = [c.name for c in get_exercise("6.1").cases if c.hidden]
    assert "t=8, X [7, 5], A [5, 40]" in hidden


def row_parallel(x_shard, weight_shard, bias, group):
    return reduce_from_tensor_model_parallel_region(x_shard @ weight_shard.t(), group) + bias


def row_parallel_bias_before_reduce(x_shard, weight_shard, bias, group):
    """Wrong: every rank adds the bias to its partial product, so the all-reduce sums t biases."""
    return reduce_from_tensor_model_parallel_region(x_shard @ weight_shard.t() + bias, group)


def row_parallel_no_reduce(x_shard, weight_shard, bias, group):
    """Wrong: forgets the all-reduce (each rank returns its partial product plus the bias)."""
    return x_shard @ weight_shard.t() + bias


def test_row_parallel_bias_before_the_all_reduce_fails_naming_t_biases():
    assert_public_case_fails("6.4", row_parallel_bias_before_reduce, "t=2 ranks",
                             contains="the output on rank 0 is the single device's plus 1 x bias, i.e. it holds "
                                      "the bias 2 times", hint="the output holds it exactly once")


def row_parallel_bias_on_rank0(x_shard, weight_shard, bias, group):
    """Wrong: only rank 0 adds the bias (before the sum): the output is right, rank 1's bias gets no gradient."""
    partial = x_shard @ weight_shard.t()
    if torch.distributed.get_rank(group) == 0:
        partial = partial + bias
    return reduce_from_tensor_model_parallel_region(partial, group)


def row_parallel_f_instead_of_g(x_shard, weight_shard, bias, group):
    """Wrong: f (identity forward, all-reduce backward) where g belongs."""
    return copy_to_tensor_model_parallel_region(x_shard @ weight_shard.t(), group) + bias


@pytest.mark.parametrize("wrong, contains", [
    (row_parallel_no_reduce, "the output on rank 0 is only its own partial product x_r W_r^T plus the bias: the 2 "
                             "partial products were never summed over the group"),
    (row_parallel_f_instead_of_g, "the output on rank 0 is only its own partial product plus the bias, and dL/dx_r "
                                  "is 2 x too large: this is f (identity forward, all-reduce backward) where the "
                                  "layer needs g"),
    (row_parallel_bias_on_rank0, "dL/dbias is None on rank 1 but set on rank(s) [0]: the bias entered the output "
                                 "only through some ranks' computation"),
])
def test_row_parallel_mistakes_are_named(wrong, contains):
    assert_public_case_fails("6.4", wrong, "t=2 ranks", contains=contains)


def test_row_parallel_right_answer_passes_the_public_cases():
    res = evaluate("6.4", row_parallel, stop_at_first_failure=True)
    assert all(c.status == "passed" for c in res.cases if not c.hidden), res.message


def test_a_t_that_does_not_divide_F_must_raise():
    """Issue 36's audit: the case named after the mistake (t=3 does not divide F=16) has a wrong answer that
    triggers it: w = F // t silently drops the last columns."""
    def no_check(X, A, B, t):
        w = A.shape[1] // t
        return [gelu(X @ A[:, i * w:(i + 1) * w]) @ B[i * w:(i + 1) * w, :] for i in range(t)]
    assert_public_case_fails("6.1", no_check, "t=3 does not divide F=16", contains="expected ValueError")
