"""Two honest habits that cost points before issue 40's follow-up (graded as root, full isolation).

* **Magics in the cell that defines an answer, its ``check`` cell deleted.** The grader finds where
  an exercise's answer is defined by reading the cells; ``%%time`` above the ``def``, or a
  ``%timeit``, ``!echo``, ``func?`` line beside it, made the cell unreadable as Python, so the
  exercise was "not attempted".
* **Files of the learner's own in the working folder.** ``%%writefile bubble_search.py`` then
  ``import bubble_search``, a CSV written and read back and a figure saved, by relative paths,
  as in Jupyter (the notebook's folder first on ``sys.path``, writable). The graded kernel had
  no writable working folder of its own on ``sys.path``, so the import failed.

One grader run of the solved notebook 01 holding both, started in the submission's folder with
TMPDIR inside it: full marks, and each habit's cell is named when a point is lost.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

SOLVED = Path(__file__).resolve().parents[2] / "solutions" / "01_pipeline_bubble.ipynb"

# 1.1: its defining cell under a cell magic (no check cell)
TIMED_DEF = "%%time\n"
# 1.2: a helper module of the learner's own, written by a cell magic
WRITE_HELPER = ("%%writefile bubble_search.py\n"
                "def first_at_most(f, target):\n"
                "    M = 1\n    while f(M) > target:\n        M += 1\n    return M\n")
# 1.2: line magics, a shell line, a help request, own files by relative paths, the helper imported (no check cell)
ANSWER_12 = ("import os\nimport bubble_search\n"
             "!echo searching\n"
             "%timeit -n 1 -r 1 bubble_fraction(4, 8)\n"
             "bubble_fraction?\n"
             "with open('targets.csv', 'w') as f:\n    f.write('target\\n0.1\\n')\n"
             "assert open('targets.csv').read().splitlines()[1] == '0.1'\n"
             "fig.savefig('bubbles.png')\nassert os.path.getsize('bubbles.png') > 0\n\n"
             "def smallest_microbatches(K: int, target: float) -> int:\n"
             "    return bubble_search.first_at_most(lambda M: bubble_fraction(K, M), target)\n")


def _habits(folder: Path) -> Path:
    nb = nbformat.read(str(SOLVED), as_version=4)
    by_id = {c.get("id"): c for c in nb.cells}
    by_id["01-05"].source = TIMED_DEF + by_id["01-05"].source
    by_id["01-10"].source = ANSWER_12
    at = nb.cells.index(by_id["01-10"])
    helper = nbformat.v4.new_code_cell(WRITE_HELPER)
    helper.id = "01-10-helper"
    nb.cells.insert(at, helper)
    nb.cells = [c for c in nb.cells if not (c.cell_type == "code" and c.source.lstrip().startswith("check("))]
    path = folder / "habits.ipynb"
    nbformat.write(nb, str(path))
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="graded as root, as autograder containers do (full isolation)")
def test_magics_beside_an_answer_and_files_of_ones_own_cost_no_point():
    # the grader started in the submission's folder, with its TMPDIR inside it, both open to every uid (as
    # `cd /tmp` would be): `python -m` puts the working folder on the grader's sys.path; once bound into the
    # kernel's root it hid the kernel's sockets and every kernel exited while starting
    tmp_path = Path(tempfile.mkdtemp(prefix="labkit-habits-", dir="/tmp"))
    try:
        os.chmod(tmp_path, 0o755)
        path = _habits(tmp_path)
        (tmp_path / "tmp").mkdir(mode=0o755)
        p = subprocess.run([sys.executable, "-m", "labkit", "grade", str(path), "--assignment", "01_pipeline_bubble",
                            "--cell-timeout", "120"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                           env=dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp")))
        out = p.stdout + p.stderr
        assert "each kernel runs as a uid of its own" in p.stdout, out  # full isolation, as in a real grading
        rows = {line.split()[0]: line for line in p.stdout.splitlines() if line.split()[:1] in (["1.1"], ["1.2"])}
        assert "2/2" in rows.get("1.1", ""), "1.1's answer cell under %%time, no check cell: not found or lost\n" + out
        assert "2/2" in rows.get("1.2", ""), ("1.2's answer cell with %timeit, !echo, func? and no check cell, a "
                                              "module written by %%writefile and imported, a CSV and a figure saved "
                                              "by relative paths: lost points\n" + out)
        assert "total 4/4 points" in p.stdout and p.returncode == 0, out
        assert sorted(os.listdir(tmp_path)) == ["habits.ipynb", "tmp"], "the kernel's files were left beside it"
        assert not os.listdir(tmp_path / "tmp"), "the grader left files in TMPDIR"
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
