"""The gradebook an instructor opens in a spreadsheet (issue 40, item 6): no cell is a formula,
every zero says why, results files have safe names whatever the submission is called, a file
named like an option is graded like any other, and a batch stopped by SIGTERM writes what it
finished, says what it stopped and leaves nothing behind."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tinyassign import CASES, _nb

from labkit.grading.batch import FORMULA_START, _result_names, gradebook_rows, inert, safe_name

SOLVED = ["check('98.1', lambda x: 3 * x)", "check('98.2', lambda x: -x)"]
HOSTILE_NAMES = ["=cmd|' -C calc'!A0", "+1+2", "=HYPERLINK(\"http://x\",\"y\")", "-2+3", "@SUM(1+1)", "\tx", "\rx"]


@pytest.fixture
def env(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny.py").write_text(CASES)
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    return dict(os.environ, LABKIT_HIDDEN_CASES=str(tmp_path / "cases"), TMPDIR=str(tmpdir), OMP_NUM_THREADS="1")


def _formula(cell: str) -> bool:
    return cell.startswith(FORMULA_START)


def test_every_text_cell_is_inert_and_every_results_name_safe():
    for name in HOSTILE_NAMES:
        assert inert(name) == "'" + name, (name, inert(name))
        assert not _formula(inert(name))
    assert inert("alice") == "alice" and inert("a=b") == "a=b"
    # control: without neutralising, the same names are formulas
    assert all(_formula(n) for n in HOSTILE_NAMES)
    obj = {"score": 0, "output": "Total 0 / 3\nx: 0 / 3", "tests": [
        {"number": "98.1", "score": 0, "max_score": 2, "output": "=1+1 not attempted", "name": "n"}]}
    header, rows = gradebook_rows([(f"subs/{n}.ipynb", obj, "") for n in HOSTILE_NAMES]
                                  + [(f"{n}.ipynb", None, f"{n} raised") for n in HOSTILE_NAMES])
    for row in [header] + rows:
        for cell in row:
            assert not _formula(cell), row
    names = _result_names([Path(f"{n}.ipynb") for n in HOSTILE_NAMES + ["-2+3", "../../etc/passwd", ".hidden", ""]])
    assert len(set(names)) == len(names)
    for n in names:
        assert n and not n.startswith(("-", ".")) and "/" not in n and all(c.isalnum() or c in "._-" for c in n), n
    assert safe_name("alice") == "alice" and safe_name("-2+3") == "2_3"


def _batch(args, env, cwd, **kw):
    return subprocess.Popen([sys.executable, "-m", "labkit", "grade", *map(str, args)],
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, **kw)


def _leftovers(env) -> list[str]:
    return sorted(os.listdir(env["TMPDIR"]))


def test_a_batch_with_hostile_names_and_zeros_of_every_kind(tmp_path, env):
    subs = tmp_path / "submissions"
    subs.mkdir()
    made = {
        "-2+3": _nb(subs / "-2+3.ipynb", "98_alpha", SOLVED),
        "formula": _nb(subs / "=cmd|' -C calc'!A0.ipynb", "98_alpha", SOLVED),
        "plus": _nb(subs / "+1+2.ipynb", "98_alpha", ["check('98.1', lambda x: 2 * x)", "check('98.2', lambda x: x)"]),
        "other": _nb(subs / "other.ipynb", "97_beta", ["def f(x): return x", "check('97.1', f)"]),
        "raised": _nb(subs / "raised.ipynb", "98_alpha", ["1 / 0\ncheck('98.1', lambda x: 3 * x)\n"
                                                          "check('98.2', lambda x: -x)"]),
        "slow": _nb(subs / "slow.ipynb", "98_alpha", ["import time\ntime.sleep(60)\ncheck('98.1', lambda x: 3 * x)\n"
                                                      "check('98.2', lambda x: -x)"]),
    }
    (subs / "nonb.ipynb").write_text("not a notebook")
    book = tmp_path / "grades.csv"
    # the files named as a shell glob in the submissions folder names them: "-2+3.ipynb" comes first, bare
    names = sorted(p.name for p in subs.iterdir())
    p = _batch([*names, "--assignment", "98_alpha", "--results-dir", tmp_path / "results", "--gradebook", book,
                "-j", "2", "--cell-timeout", "3"], env, subs)
    out, err = p.communicate(timeout=400)
    assert p.returncode == 1, out + err  # nonb.ipynb could not be graded
    assert "the following arguments are required" not in err
    rows = list(csv.reader(book.open(encoding="utf-8")))
    for row in rows:
        for cell in row:
            assert not _formula(cell), row
    table = {r[0]: r[1:] for r in rows[1:]}
    assert table["'-2+3.ipynb"][:4] == ["2", "1", "3", "3"], table  # graded like any other file
    assert table["=cmd|' -C calc'!A0.ipynb".join(("'", ""))][:3] == ["2", "1", "3"], table
    assert table["'+1+2.ipynb"][2] == "0" and table["'+1+2.ipynb"][4].startswith("wrong answers:"), table
    assert table["other.ipynb"][4].startswith("another notebook:"), table
    assert table["raised.ipynb"][4].startswith("raised:") and "ZeroDivisionError" in table["raised.ipynb"][4]
    assert table["slow.ipynb"][4].startswith("timed out:"), table
    assert table["nonb.ipynb"][4].startswith("no notebook:"), table
    for r in rows[1:]:
        assert r[-3] != "0" or r[-1], f"a zero without its reason: {r}"
    results = sorted(f.name for f in (tmp_path / "results").iterdir())
    assert all(not n.startswith(("-", ".")) and all(c.isalnum() or c in "._-" for c in n) for n in results), results
    assert _leftovers(env) == []
    assert made  # every submission above was written


def test_a_sigtermed_batch_writes_what_it_finished_says_what_it_stopped_and_leaves_nothing(tmp_path, env):
    subs = tmp_path / "submissions"
    subs.mkdir()
    first = _nb(subs / "a_quick.ipynb", "98_alpha", SOLVED)
    slow = [_nb(subs / f"b_slow{i}.ipynb", "98_alpha", ["import time\ntime.sleep(120)"] + SOLVED) for i in (1, 2)]
    book = tmp_path / "grades.csv"
    p = _batch([first, *slow, "--assignment", "98_alpha", "--results-dir", tmp_path / "results", "--gradebook", book,
                "-j", "1", "--cell-timeout", "200"], env, tmp_path)
    t0 = time.monotonic()
    line = ""
    while not line.startswith("[1/3]") and time.monotonic() - t0 < 300:
        line = p.stdout.readline()
        assert line or p.poll() is None, p.stderr.read()
    time.sleep(3)  # b_slow1 is being graded (its kernel sleeps), b_slow2 waits
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, out + err
    said = [l for l in err.splitlines() if l.startswith("stopped by SIGTERM")]
    assert len(said) == 1 and "1 of 3 submissions were graded" in said[0] and "b_slow1.ipynb" in said[0], err
    assert "Traceback" not in err and "rank" not in err
    table = {os.path.basename(r[0]): r[1:] for r in list(csv.reader(book.open()))[1:]}
    assert table["a_quick.ipynb"][:4] == ["2", "1", "3", "3"], table
    assert "while this submission was graded" in table["b_slow1.ipynb"][-1]
    assert "before this submission was graded" in table["b_slow2.ipynb"][-1]
    assert _leftovers(env) == [], "left in TMPDIR"
    assert json.loads((tmp_path / "results" / "a_quick.json").read_text())["score"] == 3


# ----------------------------------------------------------------------------- one rule, one header, names told apart

ONE = [("98.1", 2.0), ("98.2", 1.0)]  # 98_alpha: its exercises and points (one assignment)


def _graded(s1, s2):
    return {"score": s1 + s2, "output": "Total", "tests": [
        {"number": "98.1", "score": s1, "max_score": 2, "output": "x", "name": "n"},
        {"number": "98.2", "score": s2, "max_score": 1, "output": "x", "name": "n"}]}


def test_every_exercise_of_the_assignment_holds_a_number_and_error_says_why():
    # a graded row, a row whose kernel died (its grader wrote zeros), a non-notebook, a stopped one: the
    # same shape; a blank would read as "no grade yet" in an LMS import, and a spreadsheet sums it as 0
    header, rows = gradebook_rows([("a.ipynb", _graded(2, 1), ""),
                                   ("died.ipynb", _graded(0, 0), "the kernel died"),
                                   ("nonb.ipynb", None, "no notebook: nonb.ipynb is not a Jupyter notebook"),
                                   ("stop.ipynb", None, "stopped: the batch was stopped by Ctrl-C")], [ONE])
    assert header == ["submission", "exercise 98.1", "exercise 98.2", "total", "max", "error"]
    table = {r[0]: r[1:] for r in rows}
    assert table["a.ipynb"][:4] == ["2", "1", "3", "3"]
    for name in ("died.ipynb", "nonb.ipynb", "stop.ipynb"):
        assert table[name][:4] == ["0", "0", "0", "3"], (name, table[name])
        assert table[name][4], name


def test_the_header_is_the_same_whatever_was_graded():
    full = gradebook_rows([("a.ipynb", _graded(2, 1), "")], [ONE])[0]
    assert gradebook_rows([("a.ipynb", None, "stopped: before this submission was graded")], [ONE])[0] == full
    assert gradebook_rows([("a.ipynb", _graded(2, 1), "")])[0] == full  # from the results when not told


class _FakeGrader:
    """A grader that writes a full-marks results file at once (``interrupt``: Ctrl-C as the first one is polled)."""
    interrupt = False

    def __init__(self, argv, log):
        out = Path(argv[argv.index("--results") + 1])
        out.write_text(json.dumps({"score": 4, "output": "", "tests": [
            {"number": "1.1", "score": 2, "max_score": 2, "output": "", "name": "n"},
            {"number": "1.2", "score": 2, "max_score": 2, "output": "", "name": "n"}]}))
        self.returncode = 0

    def poll(self):
        if _FakeGrader.interrupt:
            raise KeyboardInterrupt
        return 0

    def terminate(self):
        pass

    kill = terminate

    def wait(self, timeout=None):
        return 0


def _two_alices(tmp_path) -> list[Path]:
    paths = []
    for folder in ("sec1", "sec2"):
        (tmp_path / folder).mkdir()
        paths.append(_nb(tmp_path / folder / "alice.ipynb", "01_pipeline_bubble", ["x = 1"]))
    return paths


def test_a_batch_stopped_before_any_grade_has_the_assignments_columns(tmp_path, monkeypatch, capsys):
    from labkit.grading import batch
    monkeypatch.setattr(batch, "_Grader", _FakeGrader)
    monkeypatch.setattr(_FakeGrader, "interrupt", True)
    book = tmp_path / "grades.csv"
    code = batch.grade_batch(_two_alices(tmp_path), tmp_path / "results", book, 1,
                             ["--assignment", "01_pipeline_bubble"])
    assert code == 130
    rows = list(csv.reader(book.open()))
    assert rows[0] == ["submission", "exercise 1.1", "exercise 1.2", "total", "max", "error"], rows
    assert all(r[1:5] == ["0", "0", "0", "4"] and r[5].startswith("stopped:") for r in rows[1:]), rows


def test_batch_lines_tell_two_files_of_the_same_name_apart(tmp_path, monkeypatch, capsys):
    from labkit.grading import batch
    monkeypatch.setattr(batch, "_Grader", _FakeGrader)
    assert batch.grade_batch(_two_alices(tmp_path), None, None, 1, ["--assignment", "01_pipeline_bubble"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and {line.split(": ")[0].split("] ")[1] for line in lines} == \
        {os.path.join("sec1", "alice.ipynb"), os.path.join("sec2", "alice.ipynb")}, lines
