"""Which labs and benches ``python -m labkit lab|bench NAME`` knows, and running one by name.

Kept apart from :mod:`labkit.__main__` so that :mod:`labkit.doctor` can run the labs exactly
as the command line does without importing the command line (which imports the doctor).
No heavy import here: each lab or bench module is imported only when it runs.
"""
from __future__ import annotations

import importlib
import sys

# lab name -> module of labkit.labs holding its LAB (a labkit.labs.harness.Lab); a module name
# cannot start with a digit, and "moe --eplb" is a lab of its own (see lab())
LAB_MODULES = {"pipeline": "pipeline", "tensor": "tensor", "moe": "moe", "3d": "threed"}
LABS = tuple(LAB_MODULES)
BENCHES = ("pipeline", "tensor", "moe", "dp")


def lab(name: str, argv: list[str]):
    """The :class:`labkit.labs.harness.Lab` that ``python -m labkit lab NAME ARGV`` runs
    (``moe`` with ``--eplb``: :mod:`labkit.labs.moe_eplb`). KeyError for an unknown name."""
    module = LAB_MODULES[name]
    if name == "moe":
        from .labs.moe_common import wants_eplb
        module = "moe_eplb" if wants_eplb(argv) else "moe"
    return importlib.import_module(f"labkit.labs.{module}").LAB


def run_module(cmd: str, name: str, argv: list[str]) -> int:
    """Run lab (``cmd`` "lab") or bench (``cmd`` "bench") ``name`` with ``argv``; returns its exit
    code (2 with one ``error:`` line for an unknown name)."""
    names = LABS if cmd == "lab" else BENCHES
    if name not in names:
        print(f"error: unknown {cmd} {name!r}; choose one of {', '.join(names)}", file=sys.stderr)
        return 2
    if cmd == "lab":
        from .labs.harness import run
        return run(lab(name, argv), argv).rc
    return importlib.import_module(f"labkit.bench.{name}").main(argv) or 0
