"""Exercise definitions, one module per notebook: ``nbNN_topic.py`` declares the exercises of
``solutions/NN_topic.ipynb`` with :func:`labkit.grading.registry.exercise`. Every module here is
imported by :func:`labkit.grading.registry.load_all`."""
from __future__ import annotations

from typing import Any, Callable


def kernel_side(answer: Any, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(learner_answer, *args, **kwargs)`` next to the learner's code and return its result.

    Under the grading proxy (an ``Answer`` of ``labkit.grading.proxy``) this is ``answer.run(fn, ...)``:
    ``fn`` must then be a top-level function of a labkit module that returns only what the learner's
    code produced (outputs, gradients, counts), never an expected value. With the answer itself (the
    in-process runner) it is a plain call, so a case reads the same either way.
    """
    if type(answer).__module__.endswith("grading.proxy"):
        return answer.run(fn, *args, **kwargs)
    return fn(answer, *args, **kwargs)
