"""What the learner sees in a notebook before and after answering (issue 21): notebook 08's grid
cell calls the learner's code first and, on a stub, prints one "not attempted" line and draws no
(empty) figure."""
import contextlib
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _cells(folder, name, *numbers):
    """Cells ``numbers`` of the solution notebook ``name``, counted without the install cell that
    ``build`` puts first in every learner notebook (so the same numbers serve both folders)."""
    from labkit.grading.build import INSTALL_CELL_ID

    nb = json.loads((ROOT / folder / name).read_text())
    cells = [c for c in nb["cells"] if c.get("id") != INSTALL_CELL_ID]
    return ["".join(cells[i]["source"]) for i in numbers]


def _run_grid_cell(folder):
    """Cells 3 and 5 (exercises 8.1, 8.2) and 8 (the grid) of notebook 08; (stdout, figures drawn)."""
    ns = {"plt": plt}
    plt.close("all")
    drawn = []
    ns["plt"] = type("P", (), {"__getattr__": lambda self, k: getattr(plt, k),
                               "show": lambda self: drawn.append(plt.gcf())})()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for src in _cells(folder, "08_3d_parallelism.ipynb", 3, 5, 8):
            exec(compile(src, "cell", "exec"), ns)
    return out.getvalue(), drawn


def test_grid_cell_on_the_stubs_is_one_line_and_no_figure():
    out, drawn = _run_grid_cell("notebooks")
    assert out == ("Exercise 8.2: not attempted (the stub still raises NotImplementedError); "
                   "the grid is drawn once it is written\n"), out
    assert drawn == [] and plt.get_fignums() == []


def test_grid_cell_with_the_answers_draws_the_grid():
    out, drawn = _run_grid_cell("solutions")
    assert out == "" and len(drawn) == 1
    texts = [t.get_text() for t in drawn[0].axes[0].texts]
    assert [str(r) for r in range(16)] == [t for t in texts if t.isdigit()]
    plt.close("all")
