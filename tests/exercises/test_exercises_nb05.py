"""Exercises of notebook 05_checkpointing: the solutions pass, plausible wrong answers fail with a
message that says what was expected and what came back."""
import math

import pytest
import torch

from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


def segment_boundaries(n, k):
    if not 1 <= k <= n:
        raise ValueError("k must be in 1..n")
    return [(j * n) // k for j in range(k + 1)]


def boundaries_remainder_last(n, k):
    """Wrong: equal segments of n // k layers, the remainder all in the last one."""
    if not 1 <= k <= n:
        raise ValueError("k must be in 1..n")
    return [j * (n // k) for j in range(k)] + [n]


def boundaries_range_step(n, k):
    """Wrong: range(0, n + 1, n // k) gives the wrong number of boundaries when k does not divide n."""
    if not 1 <= k <= n:
        raise ValueError("k must be in 1..n")
    return list(range(0, n + 1, n // k))


def best_segment_count(n, input_bytes, layer_bytes):
    return min(range(1, n + 1), key=lambda k: k * input_bytes + math.ceil(n / k) * layer_bytes)


def best_sqrt(n, input_bytes, layer_bytes):
    """Wrong: Chen's sqrt(n) whatever the sizes."""
    return max(1, round(math.sqrt(n)))


class MyCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, x):
        ctx.run, ctx.rng = run, torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


class CheckpointNoRng(torch.autograd.Function):
    """Wrong: recomputes with whatever RNG state there is (new dropout masks)."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


class CheckpointSavedAfter(torch.autograd.Function):
    """Wrong: saves the RNG state after the forward drew its masks (issue 36: one line with no restore)."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            y = run(x)
        ctx.rng = torch.get_rng_state()
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


class CheckpointNoFork(torch.autograd.Function):
    """Wrong (caught by a public case since issue 13): restores the RNG state without fork_rng,
    rewinding the training stream."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run, ctx.rng = run, torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        torch.set_rng_state(ctx.rng)
        with torch.enable_grad():
            y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


class CheckpointNoGrad(torch.autograd.Function):
    """Wrong: recomputes without torch.enable_grad() (backward runs with autograd off)."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run, ctx.rng = run, torch.get_rng_state()
        ctx.save_for_backward(x)
        return run(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)
            y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


@pytest.mark.parametrize("ex, answer", [("5.1", segment_boundaries), ("5.2", best_segment_count),
                                        ("5.3", MyCheckpoint)])
def test_solution_passes(ex, answer):
    assert_check_passes(ex, answer)


@pytest.mark.parametrize("ex, answer, contains", [
    ("5.1", boundaries_remainder_last, "got sizes [2, 2, 2, 4] from boundaries [0, 2, 4, 6, 10]"),
    ("5.1", boundaries_range_step, "expected k+1 = 5 boundaries (k segments), got 6"),
    ("5.2", best_sqrt, "k=10 (sqrt(n)) has a peak of 90 bytes, but k=25 has 57"),
    ("5.3", CheckpointNoRng, 'case "dropout p=0.5: the recomputation draws the same masks"\n  dropout p=0.5: dL/dx'),
    ("5.3", CheckpointNoRng, "the recomputation drew new dropout masks: the RNG state was not set back"),
    ("5.3", CheckpointSavedAfter, "the RNG state was saved after the forward had already drawn its masks"),
    ("5.3", CheckpointNoGrad, "the recomputation ran with gradients disabled"),
])
def test_wrong_answer_fails_with_a_useful_message(ex, answer, contains):
    res = assert_check_fails(ex, answer, contains=contains)
    assert "Hint:" in res.message


def test_not_a_function_class():
    assert_check_fails("5.3", lambda run, x: run(x), contains="autograd.Function subclass")


def test_restoring_the_rng_without_fork_fails_a_public_case():
    assert_public_case_fails("5.3", CheckpointNoFork, "the RNG stream after backward",
                             contains="torch.rand(3) right after backward (the RNG stream of the rest of training "
                                      "must not be rewound by the recomputation): expected tensor([",
                             hint="still leave the training stream where it was")
    assert any(c.hidden and "RNG stream" in c.name for c in get_exercise("5.3").cases)


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
@pytest.mark.parametrize("ex, answer", [("5.1", segment_boundaries), ("5.2", best_segment_count)])
def test_integers_of_any_kind_are_accepted(ex, answer, kind):
    """Issue 36: a NumPy int or a 0-d int tensor is an int."""
    from labkit.grading.testing import with_ints_as
    assert_check_passes(ex, with_ints_as(kind, answer))


def test_new_segment_count_mistakes_are_named():
    """Issue 36's learner round: sqrt(n) whatever the sizes, and the smooth optimum rounded."""
    import math
    assert_public_case_fails("5.2", lambda n, a, s: max(1, round(math.sqrt(n))), "n=100",
                             contains="sqrt(n) is the best k only when a layer saves as much as a segment's input")
    assert_public_case_fails("5.2", lambda n, a, s: max(1, min(n, round(math.sqrt(n * s / a)))), "n=100",
                             contains="the smooth optimum sqrt(n s / a) rounded")
