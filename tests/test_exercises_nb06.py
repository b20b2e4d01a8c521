"""Exercises of notebook 06_megatron_ffn: the solutions pass, plausible wrong answers fail with
a message that says what was expected and what came back."""
import numpy as np
import pytest
import torch

from labkit import comm
from labkit.grading import evaluate
from labkit.grading.testing import assert_check_fails, assert_check_passes
from labkit.grading.exercises.nb06_megatron_ffn import gelu


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
    ("6.2", CopyNoReduce, ["dL/dX on rank 0", "all-reduce"]),
    ("6.2", ReduceFromRegion, ["forward output Z on rank 0"]),
    ("6.3", ReduceBothWays, ["dL/dX on rank 0"]),
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
