"""Grader robustness found by a user test: the total of a notebook without metadata, hidden-case
lines that say how many cases passed, per-case hints, per-case points that add up, and a grade
run without the kernel's stderr noise."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading import check
from labkit.grading.grader import (
    NotebookGrade,
    _exercise_grade,
    _notebook_names,
    grade_notebook,
    results_json,
    validate_results,
)
from labkit.grading.registry import exercise, expect_equal, get_exercise
from labkit.grading.runner import CaseResult, CheckResult

ROOT = Path(__file__).resolve().parents[2]
SOLUTION_01 = ROOT / "solutions" / "01_pipeline_bubble.ipynb"

TF = exercise("T.fix", title="square", notebook="zz_grading_fixes", points=1, hint="Multiply x by itself.")


@TF.case("x=3")
def _(f):
    expect_equal(f(3), 9, "f(3)")


@TF.case("rejects negative x", hint="Raise ValueError for x < 0.")
def _(f):
    try:
        f(-1)
    except ValueError:
        return
    raise AssertionError("f(-1) did not raise ValueError")


# ----------------------------------------------------------------------------- which notebook


def _code_nb(*sources, metadata_notebook=None):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if metadata_notebook:
        nb.metadata["labkit"] = {"notebook": metadata_notebook}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_notebook_from_metadata_stem_or_check_calls():
    nb = _code_nb("check('1.1', f)", metadata_notebook="02_gpipe")
    assert _notebook_names(nb, Path("sub.ipynb")) == ["02_gpipe"]
    nb = _code_nb("x = 1")
    assert _notebook_names(nb, Path("/x/01_pipeline_bubble.ipynb")) == ["01_pipeline_bubble"]
    nb = _code_nb("from labkit.grading import check", "x = 1\ncheck( \"1.2\" , g)", "check('no.such', h)")
    assert _notebook_names(nb, Path("sub.ipynb")) == ["01_pipeline_bubble"]
    assert _notebook_names(_code_nb("print('hi')"), Path("sub.ipynb")) == []


def _metadata_less_solution_01(tmp_path: Path, extra_source: str, after_check: str | None) -> Path:
    nb = nbformat.read(str(SOLUTION_01), as_version=4)
    nb.metadata.pop("labkit", None)
    index = 0 if after_check is None else 1 + next(
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and f'check("{after_check}"' in c.source)
    nb.cells.insert(index, nbformat.v4.new_code_cell(extra_source))
    path = tmp_path / "sub.ipynb"  # renamed: the stem names no notebook
    nbformat.write(nb, str(path))
    return path


def test_metadata_less_copy_with_a_broken_cell_keeps_every_exercise(tmp_path):
    # a cell that raises costs only what depends on it: 1.2, after it, is still graded
    path = _metadata_less_solution_01(tmp_path, "undefined_name_in_submission", after_check="1.1")
    g = grade_notebook(path, cell_timeout=120)
    assert g.notebook == "01_pipeline_bubble"
    assert "raised NameError" in g.stopped
    by_id = {eg.exercise.id: eg for eg in g.exercises}
    assert sorted(by_id) == ["1.1", "1.2"]
    assert by_id["1.1"].status == "passed" and by_id["1.1"].score == 2
    assert by_id["1.2"].status == "passed" and by_id["1.2"].score == 2
    assert sum(eg.max_score for eg in g.exercises) == 4


def test_metadata_less_copy_past_the_cell_time_limit_scores_out_of_the_full_total(tmp_path):
    # The first cell sleeps past the limit: no check ever runs; the grade still has every
    # exercise of notebook 01 (found from the check("1.k", ...) calls in the sources), and the
    # kernel's stderr (ZMQError traceback, TCP warning) does not reach the grader's output.
    # A fresh kernel then goes on after that cell, so both exercises are still graded.
    path = _metadata_less_solution_01(tmp_path, "import time\ntime.sleep(60)", after_check=None)
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(path), "--cell-timeout", "8"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "(01_pipeline_bubble): 4/4 points; cell 1 ran past the time limit of 8 s" in proc.stdout
    assert "ZMQError" not in proc.stderr and "IPKernelApp" not in proc.stderr
    assert "without encryption" not in proc.stderr


# ----------------------------------------------------------------------------- lines and hints


def test_float_answer_to_1_2_fails_a_public_case(capsys):
    def as_float(K, target):
        M = 1
        while (K - 1) / (M + K - 1) > target:
            M += 1
        return float(M)

    res = check("1.2", as_float)
    line = capsys.readouterr().out
    assert res.status == "failed"
    assert line.startswith('Exercise 1.2 (smallest M for a target bubble): failed\n  case "returns an int"\n'
                           '  smallest_microbatches(K=4, target=0.0625):\n  expected an int, got float 45.\n'
                           '  Hint: A number of microbatches is a whole number')
    assert not next(c for c in get_exercise("1.2").cases if c.name == "returns an int").hidden


def test_hidden_failure_line_counts_passed_cases_deterministically():
    wrong = lambda K, M: 0.5 if K == 8 else _bubble_checked(K, M)  # noqa: E731 - wrong only for K=8
    from labkit.grading import runner

    hint = get_exercise("1.1").hint
    lines = set()
    for _ in range(2):  # the same line each time (a repeated failure would add the second hint: reset)
        runner._FAILED_CHECKS.pop("1.1", None)
        lines.add(check("1.1", wrong).message)
    runner._FAILED_CHECKS.pop("1.1", None)
    assert lines == {"Exercise 1.1 (bubble fraction): failed\n  a hidden case failed (5 of 6 cases passed; its "
                     f"details are not shown).\n  Hint: {hint}"}


def _bubble_checked(K, M):
    if K < 1 or M < 1:
        raise ValueError(f"K={K}, M={M}")
    return (K - 1) / (M + K - 1)


def test_case_hint_replaces_the_exercise_hint():
    res = check("T.fix", lambda x: x * x)
    assert res.message.endswith("Hint: Raise ValueError for x < 0.") and "Multiply" not in res.message
    res = check("T.fix", lambda x: x + x if x >= 0 else 1 / 0)
    assert res.message.endswith("Hint: Multiply x by itself.")
    res = check("1.1", lambda K, M: (K - 1) / (M + K - 1) if M > 0 else 1.0)
    assert 'case "rejects M=0 with ValueError"' in res.message
    assert "Hint: What is a bubble fraction for zero microbatches" in res.message and "time slots" not in res.message


# ----------------------------------------------------------------------------- points add up


def _graded_01(passing: dict[str, int | None]) -> dict:
    """Results for notebook 01 where exercise id -> how many of its cases pass (None: all)."""
    grade = NotebookGrade("sub.ipynb", "01_pipeline_bubble", "")
    for ex_id, n in passing.items():
        ex = get_exercise(ex_id)
        n = len(ex.cases) if n is None else n
        res = CheckResult(ex.id, "passed" if n == len(ex.cases) else "failed", n, len(ex.cases), "line",
                          [CaseResult(c.name, c.hidden, "passed" if k < n else "failed", "" if k < n else "wrong")
                           for k, c in enumerate(ex.cases)])
        grade.exercises.append(_exercise_grade(ex, res))
    obj = results_json([grade])
    validate_results(obj)
    return obj


def test_exercise_points_are_all_or_nothing_and_add_up_for_notebook_01():
    assert [len(get_exercise(i).cases) for i in ("1.1", "1.2")] == [6, 8]
    obj = _graded_01({"1.1": None, "1.2": None})
    by_name = {t["name"]: t for t in obj["tests"]}
    for ex_id in ("1.1", "1.2"):
        ex = get_exercise(ex_id)
        mine = [t for t in obj["tests"] if t["name"].startswith(ex.label)]
        assert len(mine) == 1 + len(ex.cases)  # the exercise's test, then one per case
        assert by_name[ex.label]["max_score"] == ex.points == by_name[ex.label]["score"]
        assert sum(t["max_score"] for t in mine) == ex.points
    assert obj["score"] == 4 and sum(t["max_score"] for t in obj["tests"]) == 4
    assert "Total 4 / 4" in obj["output"]
    # every case but one passes: no points for that exercise; each case still listed with its status
    obj = _graded_01({"1.1": 5, "1.2": None})
    ex = get_exercise("1.1")
    assert obj["score"] == 2 and {t["name"]: t for t in obj["tests"]}[ex.label]["score"] == 0
    statuses = [t["status"] for t in obj["tests"] if t["name"].startswith(ex.label + " - ")]
    assert statuses == ["passed"] * 5 + ["failed"]
    assert _graded_01({"1.1": 0, "1.2": 6})["score"] == 0


def _bad_input(tmp_path, case):
    """(argv, env) for one bad ``grade`` command line (see the parametrization)."""
    nb = tmp_path / "ok.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), str(nb))
    env = {}
    argv = [str(nb)]
    if case == "binary":
        (tmp_path / "bin.ipynb").write_bytes(bytes(range(256)))
        argv = [str(tmp_path / "bin.ipynb")]
    elif case == "empty-json":
        (tmp_path / "empty.ipynb").write_text("{}")
        argv = [str(tmp_path / "empty.ipynb")]
    elif case == "missing-notebook":
        argv = [str(tmp_path / "nope.ipynb")]
    elif case == "results-is-folder":
        argv += ["--results", str(tmp_path)]
    elif case == "results-folder-missing":
        argv += ["--results", str(tmp_path / "no" / "r.json")]
    elif case == "hidden-missing":
        env["LABKIT_HIDDEN_CASES"] = str(tmp_path / "no-such-cases")
    elif case.startswith("--"):
        argv += case.split("=", 1)
    else:
        argv += ["--cell-timeout", case.split("=", 1)[1]]
    return argv, env


@pytest.mark.parametrize("case,words", [
    ("binary", "is not a Jupyter notebook"), ("empty-json", "is not a Jupyter notebook"),
    ("missing-notebook", "no such notebook"), ("results-is-folder", "is a folder"),
    ("results-folder-missing", "does not exist"), ("hidden-missing", "LABKIT_HIDDEN_CASES="),
    ("timeout=-5", "--cell-timeout must be a positive"), ("timeout=0", "--cell-timeout must be a positive"),
    ("timeout=nan", "--cell-timeout must be a positive"), ("timeout=inf", "--cell-timeout must be a positive"),
    ("--time-budget=0", "--time-budget must be a positive"), ("--max-memory=5", "--max-memory must be at least 1024"),
    ("--max-processes=2", "--max-processes must be at least 16"), ("--tmp-size=0", "--tmp-size must be at least 1 MiB"),
])
def test_grade_refuses_bad_input_with_one_error_line_before_running(tmp_path, monkeypatch, capsys, case, words):
    from labkit.grading import grader

    argv, env = _bad_input(tmp_path, case)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(grader, "grade_paths", lambda *a, **k: pytest.fail("graded despite bad input"))
    assert grader.main(argv + ["--results", str(tmp_path / "r.json")] if "--results" not in argv else argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert out == "" and not (tmp_path / "r.json").exists()


def test_grade_cli_bad_input_is_one_line_not_a_traceback(tmp_path):
    (tmp_path / "bin.ipynb").write_bytes(bytes(range(256)))
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(tmp_path / "bin.ipynb")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr


def test_nb02_accumulation_hint_is_a_hint_not_the_solution():
    hint = get_exercise("2.3").hint
    assert "mean" in hint.lower() and ".grad" in hint
    for answer in ("/ M", "/M", "model(x_m", "x.chunk(M)", "loss.backward()"):
        assert answer not in hint, answer


# ----------------------------------------------------------------------------- a kernel that dies while starting


def _dying_kernels(monkeypatch, how_many: int) -> list:
    """The first ``how_many`` kernels the grader launches are killed at once (before they answer)."""
    from labkit.grading import session as S

    launched, launch = [], S.KernelSession.launch

    def launch_then_die(self):
        launch(self)
        launched.append(self.proc.pid)
        if len(launched) <= how_many:
            self.proc.kill()
            self.proc.wait()

    monkeypatch.setattr(S.KernelSession, "launch", launch_then_die)
    return launched


def test_a_kernel_that_dies_while_starting_is_replaced_once(tmp_path, monkeypatch, capsys):
    # a kernel that exits before it answers ran no code of the submission: the grader starts one more
    # (a loaded machine's rare start failure must not zero an honest submission) and says so to the instructor
    path = tmp_path / "sub.ipynb"
    nbformat.write(_code_nb("from labkit.grading import check", "def f(x):\n    if x < 0:\n        raise ValueError\n"
                            "    return x * x\ncheck('T.fix', f)", metadata_notebook="zz_grading_fixes"), str(path))
    launched = _dying_kernels(monkeypatch, 1)
    g = grade_notebook(path, cell_timeout=60)
    assert len(launched) == 2, launched
    assert g.stopped == "" and [eg.status for eg in g.exercises] == ["passed"], g.stopped
    assert "exited while starting" in capsys.readouterr().err
    # twice in a row: the start failure is the grade's reason, not a retry without end
    monkeypatch.undo()
    launched = _dying_kernels(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="exited while starting"):
        grade_notebook(path, cell_timeout=60)
    assert len(launched) == 2, launched


def test_answer_whose_cell_ran_past_the_time_limit_says_so(tmp_path):
    # the cell defines a right bubble_fraction, then never ends: the fresh kernel that goes on does not
    # have the name, and the exercise's line names the cell that ran past the limit, not the NameError
    nb = _code_nb("from labkit.grading import check",
                  "def bubble_fraction(K, M):\n    return (K - 1) / (M + K - 1)\n\nwhile True:\n    pass",
                  'check("1.1", bubble_fraction)')
    path = tmp_path / "sub.ipynb"
    nbformat.write(nb, str(path))
    g = grade_notebook(path, cell_timeout=3, assignment="01_pipeline_bubble")
    one = next(eg for eg in g.exercises if eg.exercise.id == "1.1")
    assert one.status == "not_attempted" and one.score == 0
    assert "cell 2 ran past the time limit of 3 s" in one.message, one.message
    assert "bubble_fraction" in one.message and "NameError" not in one.message, one.message
