"""pytest settings for the notebook phases of `make test` (nbval on solutions/ and notebooks/).

A kernel that does not answer at start is started again, twice at most, with what it wrote to
stderr shown as a warning: once in a full run on 2 cores, one of three kernels starting together
stayed silent for nbval's 60 s and failed a whole notebook (nbval sends a kernel's stderr to
/dev/null, so nothing said why). The notebook's cells still run once, in a kernel that answered.
"""
from __future__ import annotations

import tempfile
import warnings

import pytest

KERNEL_STARTS = 3


def _start_new_kernel(start):
    def start_new_kernel(*args, **kwargs):
        for attempt in range(1, KERNEL_STARTS + 1):
            err = tempfile.TemporaryFile()
            try:
                return start(*args, **dict(kwargs, stderr=err))
            except RuntimeError as e:
                err.seek(0)
                said = err.read().decode(errors="replace").strip()[-2000:] or "(nothing on stderr)"
                if attempt == KERNEL_STARTS:
                    raise RuntimeError(f"{e}; {KERNEL_STARTS} kernels did not answer; the last wrote: {said}") from e
                warnings.warn(f"kernel start {attempt} of {KERNEL_STARTS} failed ({e}); it wrote: {said}",
                              stacklevel=2)
            finally:
                err.close()  # the kernel keeps its own copy of the descriptor

    return start_new_kernel


def pytest_configure(config):
    """Only in an nbval run: importing nbval (jupyter_client, zmq) elsewhere changed how the signal
    tests' processes took Ctrl-C."""
    if not (getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False)):
        return
    import nbval.kernel

    if not getattr(nbval.kernel.start_new_kernel, "labkit_retries", False):
        nbval.kernel.start_new_kernel = _start_new_kernel(nbval.kernel.start_new_kernel)
        nbval.kernel.start_new_kernel.labkit_retries = True


# ------------------------------------------------------------------------------------------ the order of the tests
# `make test` runs each phase on 2 cores with pytest-xdist. A worker that draws a long test (or notebook) last runs it
# alone while the other core idles. Handed out longest first, one unit at a time, the long ones overlap and the short
# ones fill in around them, so that the workers end together (longest processing time first). The Makefile passes
# `--dist loadgroup --no-loadscope-reorder` for tests/ and `--dist loadscope --no-loadscope-reorder` for the
# notebooks, so that xdist keeps this order and hands out one unit (a test, a group, a notebook) at a time.
# A unit's cost is a rough number of seconds on 2 busy cores; a unit not listed costs nothing and keeps its place.

# modules whose module-scoped fixtures are costly: all their tests go to one worker (one xdist group), which
# sets the fixture up once
GROUPED = {
    "tests/context_parallel/test_context_parallel.py",
    "tests/grading/test_grading_absent.py",
    "tests/grading/test_grading_hostile.py",
    "tests/grading/test_grading_integrity.py",
    "tests/moe/test_moe_hierarchical.py",
    "tests/moe/test_moe_inference.py",
    "tests/moe/test_moe_pipeline.py",
    "tests/notebooks/test_hosted_notebooks.py",
    "tests/parallel/test_parallel_cp.py",
    "tests/plan/test_activation_bytes.py",
    "tests/plan/test_plan.py",
    "tests/plan/test_plan_3d.py",
    "tests/tensor_parallel/test_sequence_parallel.py",
}

# seconds per test id prefix (the longest matching prefix counts), from `pytest --durations=0 -n 2` on 2 cores
COSTS = {
}


def _notebook_seconds() -> dict[str, float]:
    """{notebook stem: seconds} from the "runs in" column of docs/learners.md (tests/test_docs.py keeps it true)."""
    import re
    from pathlib import Path

    out = {}
    try:
        text = (Path(__file__).parent / "docs" / "learners.md").read_text(encoding="utf-8")
    except OSError:
        return out
    for row in text.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        m = re.fullmatch(r"(\d+) (s|min)", cells[4]) if len(cells) > 4 and re.fullmatch(r"\d\d", cells[0]) else None
        if m:
            out[cells[1]] = float(m.group(1)) * (60 if m.group(2) == "min" else 1)
    return out


def _cost(nodeid: str, notebooks: dict[str, float]) -> float:
    path, _, name = nodeid.partition("::")
    if path.endswith(".ipynb"):  # an nbval cell: the notebook is the unit
        return notebooks.get(path.rsplit("/", 1)[-1][:-6], 0.0)
    if name.startswith("test_solution_grades_full_marks["):  # a grade runs the notebook up to its last check
        return 5.0 + notebooks.get(name.split("[", 1)[1].rstrip("]"), 0.0)
    best = max((p for p in COSTS if nodeid.startswith(p)), key=len, default=None)
    return COSTS[best] if best is not None else 0.0


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    notebooks = _notebook_seconds()
    units: dict[str, list] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if path in GROUPED:
            item.add_marker(pytest.mark.xdist_group(path))
            unit = path
        else:
            unit = path if path.endswith(".ipynb") else item.nodeid
        units.setdefault(unit, []).append(item)
    cost = {u: _cost(its[0].nodeid, notebooks) if u.endswith(".ipynb") else sum(_cost(i.nodeid, notebooks) for i in its)
            for u, its in units.items()}
    first = {u: k for k, u in enumerate(units)}
    items[:] = [i for u in sorted(units, key=lambda u: (-cost[u], first[u])) for i in units[u]]
