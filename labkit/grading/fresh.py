"""Fresh inputs for hidden cases: drawn in the grader's process, new every grading run.

Fixed case inputs ship with the package, so a lookup table of them passes every fixed case.
A fresh case draws its inputs from a generator seeded with the operating system's randomness
(``os.urandom``) inside the case's own process (a fork of the grader, so every case of every
run draws anew) and computes the expected values there; only the inputs reach the learner's
kernel, as arguments of the call. The shipped fixed cases stay, for feedback a learner can
reproduce.

Usage in an exercise module::

    fresh_case(ex12, "random K and target", lambda r: (r.randint(1, 32), r.uniform(0.01, 0.9)),
               _target_case)           # _target_case(K, target) returns a case function
"""
from __future__ import annotations

import os
import random
from typing import Any, Callable

__all__ = ["rng", "seed", "fresh_case"]

DRAWS = 4  # inputs drawn per fresh case


def rng() -> random.Random:
    """A ``random.Random`` seeded from 128 bits of ``os.urandom`` (never from the clock or a fork's copy)."""
    return random.Random(int.from_bytes(os.urandom(16), "big"))


def seed(r: random.Random) -> int:
    """A seed for ``torch.Generator().manual_seed`` drawn from ``r`` (31 bits)."""
    return r.getrandbits(31)


def fresh_case(ex, name: str, draw: Callable[[random.Random], tuple], factory: Callable[..., Callable[[Any], None]],
               n: int = DRAWS, **case_kw) -> None:
    """Register on exercise ``ex`` a hidden case "``name`` (fresh inputs)": each run draws ``n``
    argument tuples ``draw(rng())`` and runs ``factory(*args)(answer)`` for each (the factory is
    the exercise's own fixed-case builder, so messages and checks are the same)."""

    @ex.case(f"{name} (fresh inputs)", hidden=True, **case_kw)
    def _(answer):
        r = rng()
        for _ in range(n):
            factory(*draw(r))(answer)
