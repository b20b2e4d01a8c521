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


# ----------------------------------------------------------------------------- figures (issue 36)


def _figures(name, ids):
    """Run the solution notebook ``name``'s code cells ``ids`` (in order, one namespace); the figures shown."""
    nb = json.loads((ROOT / "solutions" / name).read_text())
    by_id = {c.get("id"): "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"}
    plt.close("all")
    drawn = []
    ns = {"plt": type("P", (), {"__getattr__": lambda self, k: getattr(plt, k),
                                "show": lambda self: drawn.append(plt.gcf())})()}
    with contextlib.redirect_stdout(io.StringIO()):
        for cid in ids:
            src = by_id[cid].replace("import matplotlib.pyplot as plt", "")
            exec(compile(src, cid, "exec"), ns)
    return drawn


def _data_boxes(fig):
    """Display-space boxes of what is plotted: line points (sampled along each segment), bars and
    broken_barh patches."""
    import numpy as np
    from matplotlib.collections import PolyCollection
    from matplotlib.transforms import Bbox

    fig.canvas.draw()
    boxes = []
    for ax in fig.axes:
        for line in ax.get_lines():
            xy = ax.transData.transform(np.column_stack(line.get_data()).astype(float))
            for a, b in zip(xy[:-1], xy[1:]):
                for s in np.linspace(0, 1, 25):
                    p = a + s * (b - a)
                    boxes.append(Bbox([p - 1, p + 1]))
        for patch in ax.patches:
            boxes.append(patch.get_window_extent())
        for coll in ax.collections:
            if isinstance(coll, PolyCollection):
                t = coll.get_transform()
                boxes += [path.transformed(t).get_extents() for path in coll.get_paths()]
    return boxes


def _legends(fig):
    return [leg for leg in [ax.get_legend() for ax in fig.axes] + list(fig.legends) if leg is not None]


def _covered(fig):
    """Plotted boxes that a legend's box overlaps."""
    out = []
    for leg in _legends(fig):
        lb = leg.get_window_extent()
        out += [b for b in _data_boxes(fig) if b.width >= 0 and lb.overlaps(b)]
    return out


def test_no_legend_covers_a_curve_in_notebook_05():
    """Issue 36: 05's legend sat on the curves."""
    figs = _figures("05_checkpointing.ipynb", ["05-01", "05-03", "05-05"])
    assert len(figs) == 2 and all(_legends(f) for f in figs)
    for f in figs:
        assert not _covered(f), [b.bounds for b in _covered(f)][:3]
    plt.close("all")


def test_the_fsdp_timeline_legend_covers_no_bar():
    """Issue 36: 15's FSDP timeline legend covered the embedding's forward bar."""
    figs = _figures("15_sharded_data_parallel.ipynb", ["2b0ded8b", "4338ee54"])
    assert len(figs) == 1 and _legends(figs[0])
    assert not _covered(figs[0]), [b.bounds for b in _covered(figs[0])][:3]
    plt.close("all")


def test_the_rank_grid_digits_are_readable():
    """Issue 36: solutions/08's rank-grid digits were about 6 px high; at the figure's dpi every text of the
    grid is now at least 13 px high (10 pt) and the figure is not wider than a notebook shows unscaled."""
    _, drawn = _run_grid_cell("solutions")
    fig = drawn[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    digits = [t for t in fig.axes[0].texts if any(ch.isdigit() for ch in t.get_text())]
    assert digits and min(t.get_window_extent(renderer).height for t in digits) >= 13  # 10 pt at 100 dpi
    assert fig.get_size_inches()[0] * fig.dpi <= 1300
    plt.close("all")
