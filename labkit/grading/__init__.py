"""Course machinery: exercise checks, the notebook builder and the autograder.

Learners use one function::

    from labkit.grading import check
    check("1.1", bubble_fraction)     # prints one line: passed / failed (why, hint) / not attempted

``check`` returns a :class:`~labkit.grading.runner.CheckResult` (status, passed, total, message)
that displays nothing in a notebook, so the printed line is the cell's only output.

Instructor workflow::

    python -m labkit build                       # notebooks/ (learner versions) from solutions/
    python -m labkit build --check               # CI: exit 1 naming each stale notebook
    LABKIT_HIDDEN_CASES=/secret/cases \
        python -m labkit grade submission.ipynb --results results.json   # Gradescope format

Author workflow: write ``solutions/NN_topic.ipynb`` (exercise regions between
``### BEGIN SOLUTION`` / ``### END SOLUTION``) and ``labkit/grading/exercises/nbNN_topic.py``,
then ``python -m labkit build --execute NN`` and commit both folders.

The grade is earned by what the learner's functions return on the grader's inputs, and by nothing
else. The contract (threat -> mechanism -> the test that shows it, and what is not covered) has
one home: ``docs/grading.md`` (:mod:`labkit.grading.wire`, :mod:`labkit.grading.withhold`,
:mod:`labkit.grading._jail`, :mod:`labkit.grading.integrity`).

Interactive ``check`` in a notebook is feedback, not a grade: it runs the same cases in the
notebook's own process (each call still makes the data round trip, so verdicts match), judges
only the function it is given, and says when the answer calls something the graded kernel will
not have.

Instructors and authors: :mod:`labkit.grading.registry` (declaring exercises and cases, hidden
case files), :mod:`labkit.grading.build` (``python -m labkit build``),
:mod:`labkit.grading.grader` (``python -m labkit grade``), :mod:`labkit.grading.testing`
(one-line wrong-answer tests), :mod:`labkit.grading.session` (the kernel the grader runs),
:mod:`labkit.grading.kernel` and :mod:`labkit.grading.proxy` (the two ends of a call),
:mod:`labkit.grading.contain` (uids, cgroups, limits, sweeps). Names are imported lazily, so
``python -m labkit build`` does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "check": "runner", "evaluate": "runner", "CheckResult": "runner", "CheckNotPassed": "runner",
    "CheckFailure": "registry", "exercise": "registry", "expect_close": "registry",
    "expect_equal": "registry",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
