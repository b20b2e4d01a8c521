"""Course machinery: exercise checks, the notebook builder and the autograder.

Learners use one function::

    from labkit.grading import check
    check("1.1", bubble_fraction)     # prints one line: passed / failed (why, hint) / not attempted

Instructors and authors: :mod:`labkit.grading.registry` (declaring exercises and cases, hidden
case files), :mod:`labkit.grading.build` (``python -m labkit build``),
:mod:`labkit.grading.grader` (``python -m labkit grade``), :mod:`labkit.grading.testing`
(one-line wrong-answer tests).
"""
from .registry import CheckFailure, exercise, expect_close, expect_equal  # noqa: F401
from .runner import CheckNotPassed, CheckResult, check, evaluate  # noqa: F401

__all__ = ["check", "evaluate", "CheckResult", "CheckNotPassed", "CheckFailure", "exercise",
           "expect_close", "expect_equal"]
