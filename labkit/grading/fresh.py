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

import contextlib
import os
import random
from typing import Any, Callable

__all__ = ["rng", "seed", "fresh_case", "reproducible", "has_fresh_case", "EXEMPT", "MARK"]

DRAWS = 4  # inputs drawn per fresh case
MARK = "(fresh inputs)"  # the end of a fresh case's name

# Exercises with no inputs to draw: what the learner returns does not depend on arguments, so there is
# nothing a lookup table could key on and nothing fresh to draw. Every other exercise of labkit's
# notebooks has a fresh case (tests/grading/test_grading_fresh.py holds both lists to that).
EXEMPT: dict[str, str] = {
    "12.3": "no inputs: gate_lines() names lines of labkit's own source (route, MoELayer.forward), which the "
            "case reads with inspect; the answer is one fixed mapping",
    "12.4": "no inputs: deepseek_v3_gate() returns one configuration (DeepSeek-V3's published numbers); its "
            "hidden routing case only exercises that configuration",
}


_FIXED_SEED: int | None = None  # set by the interactive check only (see :func:`reproducible`)


def rng() -> random.Random:
    """A ``random.Random`` seeded from 128 bits of ``os.urandom`` (never from the clock or a fork's copy);
    inside :func:`reproducible` (the learner's interactive ``check``) a fixed seed instead."""
    if _FIXED_SEED is not None:
        return random.Random(_FIXED_SEED)
    return random.Random(int.from_bytes(os.urandom(16), "big"))


@contextlib.contextmanager
def reproducible(seed_value: int = 0):
    """Fixed draws while the block runs: the interactive ``check`` is feedback, and its line must be the
    same each time a learner runs it (nbval compares it); the grader never enters this block, so a
    grading run always draws anew."""
    global _FIXED_SEED
    old, _FIXED_SEED = _FIXED_SEED, seed_value
    try:
        yield
    finally:
        _FIXED_SEED = old


def seed(r: random.Random) -> int:
    """A seed for ``torch.Generator().manual_seed`` drawn from ``r`` (31 bits)."""
    return r.getrandbits(31)


def has_fresh_case(ex) -> bool:
    """Whether exercise ``ex`` has a hidden case that draws fresh inputs (one made by :func:`fresh_case`)."""
    return any(c.hidden and c.name.endswith(MARK) for c in ex.cases)


def fresh_case(ex, name: str, draw: Callable[[random.Random], tuple], factory: Callable[..., Callable[[Any], None]],
               n: int = DRAWS) -> None:
    """Make exercise ``ex``'s last hidden case also run ``n`` fresh draws: each run draws
    argument tuples ``draw(rng())`` and runs ``factory(*args)(answer)`` for each (the factory is
    the exercise's own fixed-case builder, so the checks and messages are the same).

    The fixed inputs of that case still run first, and the case is renamed
    "<its name>; <name> (fresh inputs)". Extending a case rather than adding one keeps each
    exercise's number of cases (the line ``check`` prints) and its time limit. An exercise
    without a hidden case gets a new one named "<name> (fresh inputs)".
    """
    from .registry import DEFAULT_TIMEOUT, Case

    def draws(answer):
        r = rng()
        for _ in range(n):
            factory(*draw(r))(answer)

    hidden = [i for i, c in enumerate(ex.cases) if c.hidden]
    if not hidden:
        ex.cases.append(Case(f"{name} {MARK}", draws, True, DEFAULT_TIMEOUT))
        return
    i = hidden[-1]
    old = ex.cases[i]

    def both(answer, _fixed=old.fn):
        _fixed(answer)
        draws(answer)

    ex.cases[i] = Case(f"{old.name}; {name} {MARK}", both, True, old.timeout, old.hint, old.secret)
