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

__all__ = ["assert_check_fails", "assert_check_passes"]


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
        assert contains in res.message, f"{contains!r} not in the check's line: {res.message}"
    return res


def assert_check_passes(exercise_id: str, answer: Any) -> CheckResult:
    """Assert that every case of ``exercise_id`` passes for ``answer``; returns the result."""
    res = evaluate(exercise_id, answer)
    failing = [f"{c.name}: {c.status} {c.message}" for c in res.cases if c.status != "passed"]
    assert res.status == "passed", f"exercise {exercise_id}: {res.message} | " + " | ".join(failing)
    return res
