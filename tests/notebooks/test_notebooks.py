"""Every solution notebook grades 100%; every untouched learner notebook grades 0, each of its
exercises "not attempted". One test per notebook (xdist spreads them; each solution runs a kernel;
an unedited learner notebook is recognised without one, so two edited copies take the kernel's path)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit.grading.grader import grade_notebook, results_json, validate_results
from labkit.grading.registry import IMPORT_ERRORS, exercises_for_notebook

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))
LEARNER = [ROOT / "notebooks" / p.name for p in SOLUTIONS]


def _lines(grade) -> str:
    return "\n".join(f"  {eg.exercise.id}: {eg.status} {eg.score}/{eg.max_score} {eg.message}"
                     for eg in grade.exercises)


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_solution_grades_full_marks(path):
    assert exercises_for_notebook(path.stem), (f"no exercises registered for notebook {path.stem}; "
                                               f"import errors: {IMPORT_ERRORS}")
    grade = grade_notebook(path)
    assert grade.stopped == "", f"{path.name} stopped: {grade.stopped}"
    obj = results_json([grade])
    validate_results(obj)
    total = sum(t["max_score"] for t in obj["tests"])
    assert total > 0 and abs(obj["score"] - total) < 1e-3, f"{path.name}\n{_lines(grade)}"
    assert all(eg.status == "passed" for eg in grade.exercises), _lines(grade)


@pytest.mark.parametrize("path", LEARNER, ids=[p.stem for p in LEARNER])
def test_untouched_learner_notebook_grades_zero_not_attempted(path):
    if not path.exists():
        pytest.fail(f"{path.relative_to(ROOT)} is missing: run `python -m labkit build`")
    grade = grade_notebook(path)
    obj = results_json([grade])
    validate_results(obj)
    assert obj["score"] == 0, _lines(grade)
    assert grade.exercises, f"no exercises registered for {path.stem}"
    assert grade.stopped == "", (f"{path.name} stopped at an untagged cell: {grade.stopped} (tag cells that use "
                                 f"an exercise's answer 'raises-exception' in the solution)")
    not_attempted = [eg for eg in grade.exercises if eg.status != "not_attempted"]
    assert not not_attempted, _lines(grade)
    assert all("not attempted" in eg.message for eg in grade.exercises), _lines(grade)
    assert all("learner version as shipped" in eg.message for eg in grade.exercises), _lines(grade)


@pytest.mark.parametrize("name", ["00_distributed_primer", "07_attention_embedding_loss"])
def test_an_edited_untouched_notebook_runs_in_a_kernel_and_still_grades_zero(name, tmp_path):
    """One code cell (a comment) added at the end: no longer the shipped notebook, so every cell
    runs in a kernel up to the last grading point and the stubs' NotImplementedError decides."""
    nb = json.loads((ROOT / "notebooks" / f"{name}.ipynb").read_text())
    nb["cells"].append({"cell_type": "code", "id": "edited-by-the-test", "metadata": {}, "source": "# edited", "outputs": [],
                        "execution_count": None})
    copy = tmp_path / f"{name}.ipynb"
    copy.write_text(json.dumps(nb))
    grade = grade_notebook(copy)
    assert grade.stopped == "" and grade.exercises, _lines(grade)
    assert all(eg.status == "not_attempted" and "NotImplementedError" in eg.message for eg in grade.exercises), \
        _lines(grade)
    assert not any("learner version as shipped" in eg.message for eg in grade.exercises), _lines(grade)


@pytest.mark.parametrize("path", SOLUTIONS, ids=[p.stem for p in SOLUTIONS])
def test_a_notebook_leaves_no_temporary_file(path):
    # mkdtemp/mkstemp/NamedTemporaryFile(delete=False) outlive the kernel: every nbval run, grading run and learner
    # run would leave one in /tmp (notebook 13 left a labkit-nb13-* folder with its trace). A notebook uses
    # ``with tempfile.TemporaryDirectory(...)``, removed when the block ends.
    import ast

    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(ast.parse("".join(cell["source"]))):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                keeps = name in ("mkdtemp", "mkstemp") or (name == "NamedTemporaryFile" and any(
                    k.arg == "delete" and getattr(k.value, "value", True) is False for k in node.keywords))
                assert not keeps, f"{path.name} cell {i + 1}: tempfile.{name} leaves a file after the kernel ends"
