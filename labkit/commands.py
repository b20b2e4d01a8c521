"""Which labs and benches ``python -m labkit lab|bench NAME`` knows, and running one by name.

Kept apart from :mod:`labkit.__main__` so that :mod:`labkit.doctor` can run the labs exactly
as the command line does without importing the command line (which imports the doctor).
No heavy import here: each lab or bench module is imported only when it runs.
"""
from __future__ import annotations

import importlib
import sys

LABS = ("pipeline", "tensor", "moe", "3d")
BENCHES = ("pipeline", "tensor", "moe", "dp")
MODULES = {"3d": "threed"}  # a module name cannot start with a digit


def run_module(cmd: str, name: str, argv: list[str]) -> int:
    """Run ``labkit.labs.NAME`` (``cmd`` "lab") or ``labkit.bench.NAME`` (``cmd`` "bench") with
    ``argv``; returns its exit code (2 with one ``error:`` line for an unknown name)."""
    names = LABS if cmd == "lab" else BENCHES
    if name not in names:
        print(f"error: unknown {cmd} {name!r}; choose one of {', '.join(names)}", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"labkit.{'labs' if cmd == 'lab' else 'bench'}.{MODULES.get(name, name)}")
    return mod.main(argv) or 0
