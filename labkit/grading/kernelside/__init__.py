"""The kernel side of the exercises: code that runs next to the learner's code, one module per
notebook (``answer.run(fn, ...)`` in a case sends ``fn``'s name; the kernel imports it here).

The graded kernel cannot read :mod:`labkit.grading.exercises` (cases, expected-value code,
hidden cases), so what it must run lives here. Like everything in the kernel, this code can
be replaced by the learner's: it only runs the learner's functions on the grader's inputs and
returns their outputs as data, which the grader judges.
"""
