"""Helpers for pytest: one-line tests that an exercise's cases accept a right answer and reject
a plausible wrong one with a useful message.

    from labkit.grading.testing import assert_check_fails, assert_check_passes

    def test_bubble_off_by_one_fails():
        assert_check_fails("1.1", lambda K, M: (K - 1) / (M + K), contains="expected 0.272727")

Both run every case (as the grader does) and print nothing.
"""
from __future__ import annotations

from typing import Any

from .runner import CheckResult, evaluate

__all__ = ["assert_check_fails", "assert_check_passes", "assert_public_case_fails", "with_ints_as"]


def assert_check_fails(exercise_id: str, wrong_answer: Any, contains: str | None = None,
                       status: str = "failed") -> CheckResult:
    """Assert that ``check(exercise_id, wrong_answer)`` does not pass.

    ``status``: the expected status ("failed" by default, or "not_attempted").
    ``contains``: text the printed line must include (e.g. part of "expected X, got Y"),
    so the test also proves the message is useful. Returns the :class:`CheckResult`.
    """
    res = evaluate(exercise_id, wrong_answer)
    assert res.status == status, f"expected status {status!r} for exercise {exercise_id}, got: {res.message}"
    if contains is not None:
        assert _flat(contains) in _flat(res.message), f"{contains!r} not in the check's text: {res.message}"
    return res


def _flat(text: str) -> str:
    """``text`` with its line breaks and indents as single spaces: ``contains`` is about what the verdict
    says, whichever of its lines (verdict, case, what, expected/got, hints) the words fall on."""
    return " ".join(str(text).split())


def assert_check_passes(exercise_id: str, answer: Any) -> CheckResult:
    """Assert that every case of ``exercise_id`` passes for ``answer``; returns the result."""
    res = evaluate(exercise_id, answer)
    failing = [f"{c.name}: {c.status} {c.message}" for c in res.cases if c.status != "passed"]
    assert res.status == "passed", f"exercise {exercise_id}: {res.message} | " + " | ".join(failing)
    return res


def assert_public_case_fails(exercise_id: str, wrong_answer: Any, case: str, contains: str | None = None,
                             hint: str | None = None) -> CheckResult:
    """Assert that ``wrong_answer`` fails a PUBLIC case whose name starts with ``case``, as the first
    failing case (so the learner sees its details), with ``contains`` in the printed line and, when
    given, ``hint`` in the line's hint. Stops at that case, as ``check`` in a notebook does."""
    res = evaluate(exercise_id, wrong_answer, stop_at_first_failure=True)
    assert res.status == "failed", f"expected exercise {exercise_id} to fail, got: {res.message}"
    first = next(c for c in res.cases if c.status == "failed")
    assert not first.hidden, f"exercise {exercise_id}: the first failing case is hidden ({first.name!r}): {res.message}"
    assert first.name.startswith(case), f"exercise {exercise_id}: first failing case is {first.name!r}, not {case!r}"
    if contains is not None:
        assert _flat(contains) in _flat(res.message), f"{contains!r} not in the check's text: {res.message}"
    assert "\n  Hint: " in res.message, f"no hint on a line of its own in: {res.message}"
    if hint is not None:
        assert hint in res.message.split(" Hint: ", 1)[1], f"{hint!r} not in the hint of: {res.message}"
    return res


def with_ints_as(kind: str, fn: Any) -> Any:
    """``fn`` whose results carry their Python ints (not bools), in lists, tuples and dict values at any
    depth, as ``kind``: "numpy" (``numpy.int64``) or "tensor" (0-d int64 tensors). An exercise that asks
    for an int must accept either (issue 36)."""
    import numpy as np
    import torch

    make = {"numpy": np.int64, "tensor": lambda v: torch.tensor(v, dtype=torch.int64)}[kind]

    def convert(x):
        if isinstance(x, int) and not isinstance(x, bool):
            return make(x)
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        return x

    def wrapped(*args, **kwargs):
        return convert(fn(*args, **kwargs))

    return wrapped
