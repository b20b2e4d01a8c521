"""The kernel side of the exercises: code that runs next to the learner's code, one module per
notebook (``answer.run(fn, ...)`` in a case sends ``fn``'s name; the kernel imports it here).

The graded kernel cannot read :mod:`labkit.grading.exercises` (cases, expected-value code,
hidden cases), so what it must run lives here; none of it computes an expected value or needs an
exercise's reference (``build --check`` fails otherwise). Like everything in the kernel, this code can
be replaced by the learner's: it only runs the learner's functions on the grader's inputs and
returns their outputs as data, which the grader judges. Nothing it measures about how an answer
worked decides a verdict; where that is the point (0.2, 7.3), the ranks started here have no
process group and talk only through the grader's relay (:mod:`labkit.grading.relay`).
"""
