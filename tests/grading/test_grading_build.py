"""``python -m labkit build``: stubs, tags, cleared outputs, determinism, --check, and no
solution text left in the learner notebooks (the committed ones and a synthetic one)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.build import (
    BEGIN,
    END,
    INSTALL_CELL,
    WIDGET_NOTE,
    BuildError,
    _code_only,
    build_all,
    build_text,
    learner_version,
    plot_code_fingerprint,
    stale_notebooks,
    uses_plotting_code,
)

ROOT = Path(__file__).resolve().parents[2]
CHECK_CALL = re.compile(r"(?<![\w.])check\(\s*[\"']")
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))

EXERCISE_CELL = '''# Exercise 3.1: return the "answer", indented
import math

def answer(x):
    """Docstring stays."""
    y = x
    ### BEGIN SOLUTION
    secret_line_one = math.sqrt(y)
    return secret_line_one * 42
    ### END SOLUTION


# Exercise 3.1 continued at top level
### BEGIN SOLUTION
top_level_secret = answer(4)
### END SOLUTION
print("after")'''


def _synthetic(root: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    md = nbformat.v4.new_markdown_cell("# Title")
    code = nbformat.v4.new_code_cell(EXERCISE_CELL)
    code.outputs = [nbformat.v4.new_output("stream", name="stdout", text="after\n")]
    code.execution_count = 3
    code.metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00"}
    plain = nbformat.v4.new_code_cell("check('3.1', answer)")
    plain.metadata["tags"] = ["nbval-ignore-output"]
    for i, c in enumerate((md, code, plain)):
        c.id = f"cell-{i}"
    nb.cells = [md, code, plain]
    (root / "solutions").mkdir(parents=True)
    (root / "notebooks").mkdir()
    path = root / "solutions" / "03_synthetic.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_learner_version_stubs_regions_and_clears_outputs(tmp_path):
    sol = _synthetic(tmp_path)
    learner = nbformat.reads(build_text(sol), as_version=4)
    assert learner.cells[0].source == INSTALL_CELL  # first: install labkit where it is missing
    code = learner.cells[2]
    assert code.source == '''# Exercise 3.1: return the "answer", indented
import math

def answer(x):
    """Docstring stays."""
    y = x
    raise NotImplementedError("Exercise 3.1: return the \\"answer\\", indented")


# Exercise 3.1 continued at top level
raise NotImplementedError("Exercise 3.1: return the \\"answer\\", indented")
print("after")'''
    compile(code.source, "cell", "exec")  # still valid Python
    assert code.outputs == [] and code.execution_count is None and "execution" not in code.metadata
    assert code.metadata["tags"] == ["raises-exception"]
    assert learner.cells[3].metadata["tags"] == ["nbval-ignore-output"]  # other tags kept
    assert [c.id for c in learner.cells] == ["install-labkit", "cell-0", "cell-1", "cell-2"]
    assert learner.metadata["labkit"] == {"notebook": "03_synthetic"}
    text = build_text(sol)
    for secret in ("secret_line_one", "top_level_secret", "42", BEGIN, END):
        assert secret not in text
    assert build_text(sol) == text  # deterministic


def test_solution_only_cells_stay_out_of_the_learner_notebook(tmp_path):
    """Issue 36: a result or summary that states an exercise's answer is kept in solutions/ only."""
    sol = _synthetic(tmp_path)
    nb = nbformat.read(str(sol), as_version=4)
    result = nbformat.v4.new_markdown_cell("The answer is x + 1, the secret_summary_line.")
    result.metadata["tags"] = ["solution-only"]
    result.id = "cell-result"
    nb.cells.append(result)
    nbformat.write(nb, str(sol))
    text = build_text(sol)
    assert "secret_summary_line" not in text
    assert [c.id for c in nbformat.reads(text, as_version=4).cells] == ["install-labkit", "cell-0", "cell-1", "cell-2"]


def test_shipped_learner_notebooks_show_no_answer_of_notebooks_15_and_16():
    """Issue 36: 15's Summary gave 4 + 12/d, 2 + 14/d, 16/d, its plot cell under 15.2's check held the formula and
    15.3's heading 1.5x; 16.2's prompt and Summary gave chunks r and 2cp-1-r."""
    def text(name):
        nb = nbformat.read(str(ROOT / "notebooks" / f"{name}.ipynb"), as_version=4)
        return "\n".join(c.source for c in nb.cells)

    t15, t16 = text("15_sharded_data_parallel"), text("16_context_parallel")
    for leak in ("12/d", "14/d", "16/d", "1.5x", "12 * psi / (d if", "two gathered units at once"):
        assert leak not in t15, leak
    for leak in ("2\\,\\mathrm{cp}-1-r", "2cp-1-r", "one chunk from the start and one from the end"):
        assert leak not in t16, leak


def _build_here(capsys, *argv) -> tuple[int, str]:
    """``python -m labkit build ARGV`` in this process: (exit status, stderr). A fresh ``python -m labkit`` costs
    seconds of imports; one test (below) keeps the real command line."""
    from labkit.grading.build import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def test_build_then_check_round_trip_names_stale_notebooks(tmp_path, capsys):
    sol = _synthetic(tmp_path)
    build = lambda *argv: _build_here(capsys, "--root", tmp_path, *argv)  # noqa: E731
    code, err = build("--check")
    assert code == 1 and "notebooks/03_synthetic.ipynb is missing" in err
    assert build()[0] == 0
    assert build("--check") == (0, "")
    # a solution edit makes the learner notebook stale
    nb = nbformat.read(str(sol), as_version=4)
    nb.cells[0].source = "# Title, edited"
    nbformat.write(nb, str(sol))
    code, err = build("--check")
    assert code == 1
    assert "notebooks/03_synthetic.ipynb is stale (differs from solutions/03_synthetic.ipynb)" in err
    build_all(tmp_path)
    assert stale_notebooks(tmp_path) == []
    (tmp_path / "notebooks" / "04_orphan.ipynb").write_text("{}")
    assert stale_notebooks(tmp_path) == ["notebooks/04_orphan.ipynb has no solutions/04_orphan.ipynb"]


def test_the_package_ships_the_built_notebooks_not_the_edited_ones(tmp_path):
    """Issue 36: `pip install` of a clone packaged the working tree's notebooks/ (a learner's edits); the
    package data labkit/_notebooks is now written by build from solutions/, and --check covers it."""
    sol = _synthetic(tmp_path)
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "__init__.py").write_text("")
    (tmp_path / "labkit" / "_notebooks").symlink_to("../notebooks")  # how a checkout used to ship them
    assert any("labkit/_notebooks is a link" in p for p in stale_notebooks(tmp_path))
    build_all(tmp_path)
    shipped = tmp_path / "labkit" / "_notebooks" / sol.name
    assert not shipped.parent.is_symlink() and shipped.read_text() == build_text(sol)
    assert stale_notebooks(tmp_path) == []
    (tmp_path / "notebooks" / sol.name).write_text("my work in progress")  # the learner edits their copy
    assert shipped.read_text() == build_text(sol)
    shipped.write_text("edited")
    assert stale_notebooks(tmp_path) == [
        "notebooks/03_synthetic.ipynb is stale (differs from solutions/03_synthetic.ipynb)",
        "labkit/_notebooks/03_synthetic.ipynb is stale (differs from solutions/03_synthetic.ipynb)"]
    # the repository itself: a real folder, in the package data, equal to build's output
    assert (ROOT / "labkit" / "_notebooks").is_dir() and not (ROOT / "labkit" / "_notebooks").is_symlink()
    assert '"_notebooks/*.ipynb"' in (ROOT / "pyproject.toml").read_text()


def test_notebooks_command_expands_home_and_says_how_to_get_jupyter(tmp_path, monkeypatch, capsys):
    """Issue 36: `labkit notebooks '~/nb'` made a folder named ~; a venv without Jupyter was told `jupyter lab`."""
    import importlib.util
    import shutil

    from labkit.grading.build import notebooks_main

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("jupyterlab", "notebook") else real(name, *a))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    assert notebooks_main(["~/nb"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "~").exists() and len(list((tmp_path / "home" / "nb").glob("*.ipynb"))) >= 15
    assert f"into {tmp_path / 'home' / 'nb'}" in out
    assert "no Jupyter" in out and "'labkit[lab]'" in out and "jupyter lab" in out, out
    assert 'lab = ["jupyterlab' in (ROOT / "pyproject.toml").read_text()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: "/usr/bin/" + name)
    assert notebooks_main([str(tmp_path / "nb2")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"open them with: jupyter lab {tmp_path / 'nb2'}"


@pytest.mark.parametrize("source, match", [
    ("x = 1\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION", "must start with '# Exercise N.k"),
    ("# Exercise 1.1: t\n### BEGIN SOLUTION\nx = 2", "never closed"),
    ("# Exercise 1.1: t\n### END SOLUTION", "without"),
    ("# Exercise 1.1: t\n### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", "inside another"),
])
def test_malformed_regions_are_errors_naming_the_cell(source, match):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("x"), nbformat.v4.new_code_cell(source)]
    with pytest.raises(BuildError, match=match) as info:
        learner_version(nb, "05_bad")
    assert "solutions/05_bad.ipynb, cell 2" in str(info.value)


def test_committed_notebooks_are_up_to_date():
    assert stale_notebooks(ROOT) == [], "run `python -m labkit build` and commit notebooks/ and labkit/_notebooks/"


def _region_lines(nb) -> tuple[set, set]:
    inside, outside = set(), set()
    for cell in nb.cells:
        in_region = False
        for line in cell.source.splitlines():
            s = line.strip()
            if s == BEGIN:
                in_region = True
            elif s == END:
                in_region = False
            elif s:
                (inside if in_region else outside).add(s)
    return inside, outside


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_no_solution_text_in_learner_notebook(solution):
    nb = nbformat.read(str(solution), as_version=4)
    inside, outside = _region_lines(nb)
    learner = nbformat.read(str(ROOT / "notebooks" / solution.name), as_version=4)
    text = "\n".join(c.source for c in learner.cells)
    learner_lines = {line.strip() for line in text.splitlines()}
    leaked = sorted((inside - outside) & learner_lines)
    assert not leaked, f"solution lines left in notebooks/{solution.name}: {leaked[:5]}"
    assert BEGIN not in text and END not in text
    assert all(not c.get("outputs") for c in learner.cells if c.cell_type == "code")


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_check_cells_print_exactly_one_line(solution):
    """In the stored solutions every check(...) cell shows one "passed" line and no Out[]."""
    nb = nbformat.read(str(solution), as_version=4)
    for i, cell in enumerate(nb.cells, 1):
        n_checks = len(CHECK_CALL.findall(cell.source)) if cell.cell_type == "code" else 0
        if not n_checks:
            continue
        results = [o for o in cell.outputs if o.output_type == "execute_result"]
        assert not results, f"{solution.name} cell {i}: check() produced an Out[] line"
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        assert text.count(": passed, ") == n_checks, f"{solution.name} cell {i}: {text!r}"


def test_build_execute_saves_outputs_then_builds(tmp_path):
    (tmp_path / "solutions").mkdir()
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("# Exercise 8.1: print the answer\n### BEGIN SOLUTION\n"
                                          "print(6 * 7)\n### END SOLUTION"),
                nbformat.v4.new_code_cell("import ipywidgets\nipywidgets.IntSlider(value=3)")]
    nb.cells[0].id, nb.cells[1].id = "only-cell", "widget-cell"
    sol = tmp_path / "solutions" / "08_exec.ipynb"
    nbformat.write(nb, str(sol))
    out = subprocess.run([sys.executable, "-m", "labkit", "build", "--root", str(tmp_path), "--execute", "08"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    executed = nbformat.read(str(sol), as_version=4).cells[0]
    assert executed.outputs[0]["text"] == "42\n" and executed.execution_count == 1
    assert "execution" not in executed.metadata  # no timestamps stored
    # a widget's stored output is one line saying where it appears, not its "IntSlider(value=3)" text
    stored = nbformat.read(str(sol), as_version=4)
    assert [o["data"] for o in stored.cells[1].outputs] == [{"text/plain": WIDGET_NOTE}]
    assert "widgets" not in stored.metadata and "labkit" not in stored.metadata  # no plotting code used
    learner = nbformat.read(str(tmp_path / "notebooks" / "08_exec.ipynb"), as_version=4).cells[1]
    assert learner.source.endswith('raise NotImplementedError("Exercise 8.1: print the answer")')
    assert learner.outputs == []
    bad = subprocess.run([sys.executable, "-m", "labkit", "build", "--root", str(tmp_path), "--execute", "99"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no solution notebook matches '99'" in bad.stderr


def test_stale_figures_are_named_until_the_notebook_is_re_executed(tmp_path):
    """A solution that draws with labkit's plotting modules records their fingerprint when executed;
    `build --check` names it when the record is missing or the plotting code changed since."""
    (tmp_path / "solutions").mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("from labkit.pipeline.plot import plot_timeline\nplot_timeline({})")]
    nb.cells[0].id = "plot"
    sol = tmp_path / "solutions" / "07_plots.ipynb"
    nbformat.write(nb, str(sol))
    build_all(tmp_path)
    problems = stale_notebooks(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(
        "solutions/07_plots.ipynb: its stored figures carry no record of the plotting code (labkit/pipeline/plot.py")
    assert problems[0].endswith("run `python -m labkit build --execute 07`")
    nb.metadata["labkit"] = {"plot_code": "0" * 16}  # drawn by other code
    nbformat.write(nb, str(sol))
    build_all(tmp_path)
    assert "were drawn before the plotting code last changed" in stale_notebooks(tmp_path)[0]
    nb.metadata["labkit"] = {"plot_code": plot_code_fingerprint()}
    nbformat.write(nb, str(sol))
    build_all(tmp_path)
    assert stale_notebooks(tmp_path) == []
    learner = nbformat.read(str(tmp_path / "notebooks" / "07_plots.ipynb"), as_version=4)
    assert learner.metadata["labkit"] == {"notebook": "07_plots"}  # no fingerprint in the learner copy


def test_plot_fingerprint_ignores_docstrings_and_comments_only():
    a = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    assert _code_only(a) == _code_only('def f(x):\n    """Other doc."""\n    return x + 1\n')
    assert _code_only(a) != _code_only('def f(x):\n    """Doc."""\n    return x + 2\n')
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import labkit.pipeline.explorer as ex")]
    assert uses_plotting_code(nb)
    nb.cells = [nbformat.v4.new_code_cell("from labkit.pipeline import simulate  # labkit.pipeline.plot later")]
    assert not uses_plotting_code(nb)


@pytest.mark.parametrize("solution", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_no_widget_text_stored_in_solutions(solution):
    """A stored widget output is the one-line note, never the widget's repr (notebook 04's explorer)."""
    nb = nbformat.read(str(solution), as_version=4)
    for i, cell in enumerate(nb.cells, 1):
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            assert "application/vnd.jupyter.widget-view+json" not in data, f"{solution.name} cell {i}"
            assert "children=(" not in data.get("text/plain", ""), f"{solution.name} cell {i}"


def test_build_run_outside_the_checkout_names_the_folder_it_works_on(tmp_path, monkeypatch, capsys):
    """From another folder, build refuses in one line naming it (it works on the checkout you stand in
    and on no other); with --root it works on that checkout and says which."""
    from labkit.grading.build import main as build_main

    monkeypatch.chdir(tmp_path)
    assert build_main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: found no solutions/ folder in {tmp_path}") and err.count("\n") == 1, err
    assert build_main(["--check", "--root", str(ROOT)]) == 0
    assert capsys.readouterr().out.startswith(f"{ROOT / 'notebooks'}/ is up to date")
    monkeypatch.chdir(ROOT)
    assert build_main(["--check"]) == 0
    assert capsys.readouterr().out.startswith("notebooks/ is up to date")


def test_the_course_repository_is_the_instructors_one_setting(tmp_path, capsys):
    """[tool.labkit] repository (or build --repository URL, which records it) goes into every learner
    notebook's first cell and pyproject's [project.urls]; with none set the first cell names no
    repository and says how to install labkit; build --check catches a setting the files do not follow."""
    from labkit.grading.build import configured_repository
    from labkit.grading.install import install_cell

    _synthetic(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "labkit"\n\n[tool.labkit]\nrepository = ""\n\n'
                                             '[tool.ruff]\nline-length = 120\n')
    build = lambda *argv: _build_here(capsys, "--root", tmp_path, *argv)  # noqa: E731
    first = lambda: nbformat.read(str(tmp_path / "notebooks" / "03_synthetic.ipynb"), 4).cells[0].source  # noqa: E731
    assert build() == (0, "")
    assert first() == INSTALL_CELL and "github" not in first() and "Ask your instructor" in first()
    assert "[project.urls]" not in (tmp_path / "pyproject.toml").read_text()

    url = "https://git.example.org/course/labkit"
    p = subprocess.run([sys.executable, "-m", "labkit", "build", "--root", str(tmp_path), "--repository", url],
                       capture_output=True, text=True)  # the command itself, once
    assert p.returncode == 0, p.stderr
    assert configured_repository(tmp_path) == url
    assert first() == install_cell(url) and f'"git+{url}"' in first()
    toml = (tmp_path / "pyproject.toml").read_text()
    assert f'Repository = "{url}"' in toml and toml.index("[project.urls]") < toml.index("[tool.labkit]")
    assert build("--check") == (0, "")

    # the setting changed by hand: --check names the notebook and the project URLs
    (tmp_path / "pyproject.toml").write_text(toml.replace(f'repository = "{url}"', 'repository = "https://x.org/a/b"'))
    code, err = build("--check")
    assert code == 1 and "03_synthetic.ipynb is stale" in err and "[project.urls]" in err

    # cleared: no URL anywhere, the cell tells the learner how to install
    assert build("--repository", "") == (0, "")
    assert first() == INSTALL_CELL and "[project.urls]" not in (tmp_path / "pyproject.toml").read_text()
    assert build("--check") == (0, "")

    # a value that could break out of the cell's string is refused in one line, nothing written
    before = (tmp_path / "pyproject.toml").read_text()
    for bad in ('https://x.org/a"); import os; ("', "git@github.com:a/b.git", "https://x.org/a b"):
        code, err = build("--repository", bad)
        assert code == 2 and err.count("\n") == 1 and "not an http(s) URL" in err, err
        with pytest.raises(ValueError, match="not an http"):
            install_cell(bad)
    assert (tmp_path / "pyproject.toml").read_text() == before
