"""One assignment per grade (``--assignment``), hints held back, exit status, ``execution_time``,
student-visible output without instructor detail, and batch grading with a gradebook."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest
from tinyassign import CASES, _nb  # noqa: E402

from labkit.grading.grader import main, validate_results

SOLVED = ["check('98.1', lambda x: 3 * x)", "check('98.2', lambda x: -x)", "check('97.1', lambda x: x)"]
WRONG = ["check('98.1', lambda x: 2 * x)", "check('98.2', lambda x: -x)"]


@pytest.fixture
def env(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny.py").write_text(CASES)
    return dict(os.environ, LABKIT_HIDDEN_CASES=str(tmp_path / "cases"))


def _grade(args, env, cwd):
    return subprocess.run([sys.executable, "-m", "labkit", "grade", *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_assignment_pin_hints_exit_status_and_what_students_see(tmp_path, env):
    sub = _nb(tmp_path / "my upload.ipynb", "98_alpha", WRONG + ["check('97.1', lambda x: x)"])
    res = tmp_path / "r.json"
    p = _grade([sub, "--assignment", "98_alpha", "--no-hints", "--results", res], env, tmp_path)
    assert p.returncode == 0, p.stderr
    obj = json.loads(res.read_text())
    validate_results(obj)
    # only the pinned notebook's exercises count: 97.1's check in the same notebook adds nothing
    assert {t.get("number") for t in obj["tests"] if "number" in t} == {"98.1", "98.2"}
    assert obj["score"] == 1 and sum(t["max_score"] for t in obj["tests"]) == 3
    names = [t["name"] for t in obj["tests"]]
    assert len(names) == len(set(names))  # each exercise and case once
    assert "HINT-TRIPLE" not in json.dumps(obj) and "Hint:" not in json.dumps(obj)
    assert isinstance(obj["execution_time"], int) and obj["execution_time"] >= 0
    assert obj["stdout_visibility"] == "hidden"
    assert str(tmp_path) not in obj["output"] and "isolation" not in obj["output"]
    assert obj["output"].splitlines()[1].startswith("my upload.ipynb: 1 / 3")
    assert "isolation" in p.stdout  # instructor detail stays in stdout

    # the same notebook graded for another assignment: only that assignment's exercises count, each
    # from the answer the notebook holds (issue 16, principle 5): here 97.1's answer, so 97.1's points
    p = _grade([sub, "--assignment", "97_beta", "--results", res], env, tmp_path)
    assert p.returncode == 0, p.stderr
    obj = json.loads(res.read_text())
    validate_results(obj)
    assert [t["number"] for t in obj["tests"] if "number" in t] == ["97.1"]
    assert obj["score"] == sum(t["max_score"] for t in obj["tests"]) > 0
    # a notebook that holds nothing of the assignment scores zero, and the output says why
    only98 = _nb(tmp_path / "only98.ipynb", "98_alpha", WRONG)
    p = _grade([only98, "--assignment", "97_beta", "--results", res], env, tmp_path)
    assert p.returncode == 0, p.stderr
    obj = json.loads(res.read_text())
    assert obj["score"] == 0 and [t["number"] for t in obj["tests"] if "number" in t] == ["97.1"]
    assert "does not hold assignment 97_beta" in p.stdout, p.stdout



def _grade_here(args, env, monkeypatch, capsys) -> tuple[int, str]:
    """``python -m labkit grade ARGS`` in this process (bad input ends before any kernel starts)."""
    monkeypatch.setenv("LABKIT_HIDDEN_CASES", env["LABKIT_HIDDEN_CASES"])
    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # the option parser's own errors
        code = e.code
    return code, capsys.readouterr().err


def test_an_unknown_assignment_is_one_error_line(tmp_path, env, monkeypatch, capsys):
    sub = _nb(tmp_path / "a.ipynb", "98_alpha", SOLVED)
    code, err = _grade_here([sub, "--assignment", "96_nothing"], env, monkeypatch, capsys)
    assert code == 2 and err.startswith("error: --assignment 96_nothing is not a notebook with "
                                        "exercises; known:"), err
    assert "Traceback" not in err


def test_batch_grading_writes_one_file_per_submission_and_a_gradebook(tmp_path, env):
    subs = tmp_path / "submissions"
    subs.mkdir()
    good = _nb(subs / "alice.ipynb", "98_alpha", SOLVED)
    wrong = _nb(subs / "bob.ipynb", "98_alpha", WRONG)
    broken = subs / "carol.ipynb"
    broken.write_text("{ this is not a notebook")
    other = _nb(subs / "dave.ipynb", "97_beta", ["check('97.1', lambda x: x)"])
    out, book = tmp_path / "results", tmp_path / "grades.csv"
    p = _grade([good, wrong, broken, other, "--assignment", "98_alpha", "--results-dir", out, "--gradebook", book,
                "-j", "2"], env, tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr  # carol's could not be graded
    assert "error: 1 of 4 submissions could not be graded: carol.ipynb" in p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("[")]
    assert sorted(l.split("] ")[0] for l in lines) == ["[1/4", "[2/4", "[3/4", "[4/4"]
    by = {l.split("] ")[1].split(":")[0]: l for l in lines}
    assert "alice.ipynb: 3/3 points" in by["alice.ipynb"] and "bob.ipynb: 1/3 points" in by["bob.ipynb"]
    assert "NOT GRADED" in by["carol.ipynb"] and "is not a Jupyter notebook" in by["carol.ipynb"]
    assert "dave.ipynb: 0/3 points" in by["dave.ipynb"]
    assert sorted(f.name for f in out.iterdir()) == ["alice.json", "bob.json", "dave.json", "integrity.csv",
                                                     "integrity.html"]  # and the instructor's integrity report
    for f in out.glob("*.json"):
        validate_results(json.loads(f.read_text()))
    rows = list(csv.reader(book.open()))
    assert rows[0] == ["submission", "exercise 98.1", "exercise 98.2", "total", "max", "error"]
    table = {os.path.basename(r[0]): r[1:] for r in rows[1:]}
    assert table["alice.ipynb"] == ["2", "1", "3", "3", ""]
    assert table["bob.ipynb"] == ["0", "1", "1", "3", ""]
    assert table["dave.ipynb"][:4] == ["0", "0", "0", "3"]  # every zero gives its reason
    assert table["dave.ipynb"][4].startswith("another notebook: the submission does not hold assignment 98_alpha")
    # not a notebook: 0 for each exercise of the assignment, like every other zero, with the reason in error
    assert table["carol.ipynb"][:4] == ["0", "0", "0", "3"] and "not a Jupyter notebook" in table["carol.ipynb"][4]


def test_batch_bad_options_are_one_error_line(tmp_path, env, monkeypatch, capsys):
    sub = _nb(tmp_path / "a.ipynb", "98_alpha", SOLVED)
    for args, msg in ((["-j", "0"], "error: -j must be >= 1 submission at a time, got 0"),
                      (["--gradebook", tmp_path / "nowhere" / "g.csv"], "its folder"),
                      (["--results-dir", tmp_path / "d", "--results", tmp_path / "r.json"],
                       "--results writes one file")):
        code, err = _grade_here([sub, *args], env, monkeypatch, capsys)
        assert code == 2 and err.startswith("error:") and msg in err, err
        assert "Traceback" not in err


def test_a_batch_passes_every_per_submission_option_on():
    captured = {}   # a shipped assignment: the hidden-case registry loads once per process, in any test order

    def fake_batch(paths, results_dir, gradebook, jobs, options):
        captured.update(options=options, jobs=jobs)
        return 0

    import labkit.grading.batch as batch

    real, batch.grade_batch = batch.grade_batch, fake_batch
    try:
        assert main(["--gradebook", "/dev/null", "-j", "1", "--assignment", "01_pipeline_bubble", "--no-hints",
                     "--no-source-policy", "--cell-timeout", "7", "--time-budget", "50", "--max-processes", "64",
                     "--max-file-size", "8", "--max-memory", "2048", "--tmp-size", "16", __file__]) == 0
    finally:
        batch.grade_batch = real
    assert captured["jobs"] == 1
    assert captured["options"] == ["--cell-timeout", "7", "--time-budget", "50", "--assignment", "01_pipeline_bubble",
                                   "--max-processes", "64", "--max-file-size", "8", "--max-memory", "2048",
                                   "--tmp-size", "16", "--no-hints", "--no-source-policy"]


def test_a_notebook_that_cannot_be_graded_is_named_with_the_reason(tmp_path, env, monkeypatch, capsys):
    # an exception while grading (here: one raised by the grading itself) reaches the instructor's error line, which
    # the batch shows for that submission, with its reason rather than only the path
    import labkit.grading.grader as grader

    def broken(*a, **k):
        raise RuntimeError("the kernel died while starting")
    monkeypatch.setattr(grader, "grade_notebook", broken)
    sub = _nb(tmp_path / "dana.ipynb", "00_distributed_primer", SOLVED)
    assert main([str(sub), "--assignment", "00_distributed_primer", "--results", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert "could not be graded" in err and "RuntimeError: the kernel died while starting" in err, err
