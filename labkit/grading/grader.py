"""``python -m labkit grade PATH... [--results results.json]``: the autograder.

For each notebook the grader starts a fresh kernel (nbclient, this environment's ``python3``),
runs every cell with a per-cell time limit and collects what each ``check(...)`` recorded: the
kernel gets env ``LABKIT_RESULTS_FILE`` (a temporary file) and ``check`` appends one JSON line per
case, running every case (not stopping at the first failure). ``LABKIT_STRICT`` is removed.

Which exercises a notebook has: every exercise registered for its notebook, whatever ran. The
notebook is ``metadata.labkit.notebook`` (written by ``build``), else the file's stem when
exercises are registered for it, else the notebook(s) of the exercise ids in the
``check("N.k", ...)`` calls of its code cells (read from the sources, not from what ran, so a
renamed copy whose metadata was lost keeps its full total). Exercises of other notebooks that
the notebook did check are graded too. An exercise whose check never ran scores zero:
"not reached: cell N raised <Error>: <message>" when execution stopped at a cell that raised
(cells tagged ``raises-exception`` do not stop it) or ran past the time limit, else "not
attempted: no check(...) call ran". When ``check`` ran more than once for an exercise, the last
call counts.

Points: an exercise's points are split across its cases (public and hidden) by
:func:`~labkit.grading.registry.case_points` (equal shares rounded to 4 decimals, the remainder
to the last case, so they add up to the exercise's points); each passed case earns its share.
The kernel's own stderr is discarded (its warnings are not the learner's errors). The results file follows the Gradescope autograder
format: top-level ``score`` and ``tests``, one test per case with ``name``, ``score``,
``max_score``, ``status`` ("passed" / "failed"), ``output`` and ``visibility`` (``visible`` for
public cases, ``after_published`` for hidden ones, whose output never gives details).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .registry import HIDDEN_ENV, Exercise, case_points, exercises_for_notebook, get_exercise
from .runner import STRICT_ENV
RESULTS_ENV = "LABKIT_RESULTS_FILE"  # removed next: the grader is being rewritten

__all__ = ["grade_notebook", "grade_paths", "results_json", "validate_results", "format_table", "main",
           "ExerciseGrade", "CaseGrade", "NotebookGrade"]

DEFAULT_CELL_TIMEOUT = 300  # seconds one cell may run under the grader
HIDDEN_OUTPUT = "A hidden case failed (its details are not shown)."


@dataclass
class CaseGrade:
    name: str
    hidden: bool
    status: str  # passed | failed | not_attempted | not_reached
    message: str
    score: float
    max_score: float


@dataclass
class ExerciseGrade:
    exercise: Exercise
    status: str  # passed | failed | not_attempted | not_reached
    message: str
    cases: list[CaseGrade] = field(default_factory=list)

    @property
    def score(self) -> float:
        return round(sum(c.score for c in self.cases), 4)

    @property
    def max_score(self) -> float:
        return round(sum(c.max_score for c in self.cases), 4)


def _points(x: float) -> str:
    return f"{round(x, 2):g}"


@dataclass
class NotebookGrade:
    path: str
    notebook: str
    stopped: str  # "" when every cell ran, else why execution stopped
    exercises: list[ExerciseGrade] = field(default_factory=list)


_CHECK_CALL = re.compile(r"""\bcheck\(\s*(?P<q>["'])(?P<id>[^"'\n]+)(?P=q)""")


def _notebook_names(nb, path: Path) -> list[str]:
    """The notebook(s) whose exercises ``nb`` is graded on.

    ``metadata.labkit.notebook`` (written by ``build``); else the file's stem when exercises are
    registered for it; else the notebooks of the exercise ids in ``check("N.k", ...)`` calls
    found in the code cells' sources (a static scan: a renamed copy whose metadata was lost is
    still graded on every exercise of its notebook, whatever ran). Empty when nothing matches.
    """
    name = nb.metadata.get("labkit", {}).get("notebook")
    if name:
        return [name]
    if exercises_for_notebook(path.stem):
        return [path.stem]
    names: list[str] = []
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        for m in _CHECK_CALL.finditer(cell.get("source", "")):
            try:
                ex = get_exercise(m.group("id"))
            except KeyError:
                continue
            if ex.notebook not in names:
                names.append(ex.notebook)
    return names


def _execute(nb, path: Path, results_file: str, cell_timeout: int) -> str:
    """Run ``nb`` (in place); return "" or the reason execution stopped."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    env = dict(os.environ)
    env[RESULTS_ENV] = results_file
    env.pop(STRICT_ENV, None)
    if env.get(HIDDEN_ENV):  # the kernel runs in the notebook's folder: make the paths absolute
        env[HIDDEN_ENV] = os.pathsep.join(str(Path(p).resolve()) for p in env[HIDDEN_ENV].split(os.pathsep) if p)
    current = {"index": None}

    def on_cell_execute(cell, cell_index, **_):
        current["index"] = cell_index

    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3", record_timing=False,
                            allow_errors=False, on_cell_execute=on_cell_execute,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    try:
        # The kernel's own stderr (ipykernel's "running over TCP without encryption" warning,
        # the ZMQError traceback of a kernel interrupted at the time limit) is noise here: the
        # errors that matter reach the grade through the cells' outputs and the stop reason.
        client.execute(env=env, stderr=subprocess.DEVNULL)
    except CellTimeoutError:
        return f"cell {_cell_no(current['index'])} ran past the time limit of {cell_timeout} s"
    except DeadKernelError as e:
        return f"cell {_cell_no(current['index'])} killed the kernel ({_first(str(e))})"
    except CellExecutionError as e:
        return f"cell {_cell_no(current['index'])} raised {e.ename}: {_first(e.evalue)}".rstrip(": ")
    except Exception as e:  # noqa: BLE001 - a broken notebook still gets a grade
        return f"the notebook could not run: {type(e).__name__}: {_first(str(e))}"
    return ""


def _cell_no(index) -> str:
    return "?" if index is None else str(index + 1)


def _first(text: str, limit: int = 200) -> str:
    lines = [l for l in str(text).strip().splitlines() if l.strip()]
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _read_records(results_file: str) -> dict[str, list[dict]]:
    """Per exercise, the case records of the LAST check call."""
    calls: dict[str, dict[str, list[dict]]] = {}
    order: dict[str, list[str]] = {}
    try:
        lines = Path(results_file).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        ex = rec.get("exercise")
        calls.setdefault(ex, {}).setdefault(rec.get("call"), []).append(rec)
        order.setdefault(ex, [])
        if rec.get("call") not in order[ex]:
            order[ex].append(rec.get("call"))
    return {ex: calls[ex][order[ex][-1]] for ex in calls}


def _grade_exercise(ex: Exercise, records: list[dict] | None, stopped: str) -> ExerciseGrade:
    shares = case_points(ex.points, len(ex.cases))  # add up to ex.points
    by_name = {r["case"]: r for r in records or []}
    cases = []
    if records is None:
        if stopped:
            status, msg = "not_reached", f"not reached: {stopped}"
        else:
            status, msg = "not_attempted", f"not attempted: no check(\"{ex.id}\", ...) call ran"
        for c, share in zip(ex.cases, shares):
            cases.append(CaseGrade(c.name, c.hidden, status, msg, 0.0, share))
        return ExerciseGrade(ex, status, msg, cases)
    for c, share in zip(ex.cases, shares):
        r = by_name.get(c.name)
        if r is None:
            cases.append(CaseGrade(c.name, c.hidden, "failed", "this case was not run", 0.0, share))
        else:
            ok = r["status"] == "passed"
            cases.append(CaseGrade(c.name, c.hidden, r["status"], r.get("message", ""), share if ok else 0.0, share))
    line = records[-1].get("line", "") if records else ""
    if all(c.status == "passed" for c in cases):
        status = "passed"
    elif any(c.status == "not_attempted" for c in cases):
        status = "not_attempted"
    else:
        status = "failed"
    return ExerciseGrade(ex, status, line, cases)


def grade_notebook(path: str | Path, cell_timeout: int = DEFAULT_CELL_TIMEOUT) -> NotebookGrade:
    """Execute notebook ``path`` and grade every exercise registered for it."""
    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    names = _notebook_names(nb, path)
    fd, results_file = tempfile.mkstemp(prefix="labkit-checks-", suffix=".jsonl")
    os.close(fd)
    try:
        stopped = _execute(nb, path, results_file, cell_timeout)
        records = _read_records(results_file)
    finally:
        os.unlink(results_file)
    exercises = [ex for name in names for ex in exercises_for_notebook(name)]
    for ex_id in records:  # a check of another notebook's exercise counts too
        try:
            ex = get_exercise(ex_id)
        except KeyError:
            continue
        if all(e.id != ex.id for e in exercises):
            exercises.append(ex)
            if ex.notebook not in names:
                names.append(ex.notebook)
    grade = NotebookGrade(str(path), ", ".join(names) or path.stem, stopped)
    for ex in exercises:
        grade.exercises.append(_grade_exercise(ex, records.get(ex.id), stopped))
    return grade


def grade_paths(paths, cell_timeout: int = DEFAULT_CELL_TIMEOUT) -> list[NotebookGrade]:
    return [grade_notebook(p, cell_timeout) for p in paths]


def results_json(grades: list[NotebookGrade]) -> dict:
    """The Gradescope results object for ``grades``."""
    tests = []
    for g in grades:
        for eg in g.exercises:
            for c in eg.cases:
                passed = c.status == "passed"
                if passed:
                    output = "passed"
                elif c.hidden and c.status == "failed":
                    output = HIDDEN_OUTPUT
                elif c.status in ("not_attempted", "not_reached"):
                    output = c.message
                else:
                    output = c.message or "failed"
                tests.append({
                    "name": f"{eg.exercise.label} - {'hidden case' if c.hidden else 'case'}: {c.name}",
                    "score": round(c.score, 6),
                    "max_score": round(c.max_score, 6),
                    "status": "passed" if passed else "failed",
                    "output": output,
                    "visibility": "after_published" if c.hidden else "visible",
                })
    score = round(sum(t["score"] for t in tests), 4)
    total = round(sum(t["max_score"] for t in tests), 4)
    lines = [f"{g.path}: {_points(sum(e.score for e in g.exercises))} / {_points(sum(e.max_score for e in g.exercises))}"
             + (f" (stopped: {g.stopped})" if g.stopped else "") for g in grades]
    return {"score": score, "output": f"Total {_points(score)} / {_points(total)}\n" + "\n".join(lines),
            "tests": tests}


def validate_results(obj: dict) -> None:
    """Raise ValueError naming the first field that breaks the Gradescope results format."""
    if not isinstance(obj, dict):
        raise ValueError("results must be a JSON object")
    if not isinstance(obj.get("score"), (int, float)) or isinstance(obj.get("score"), bool):
        raise ValueError("top-level 'score' must be a number")
    if not isinstance(obj.get("tests"), list):
        raise ValueError("top-level 'tests' must be a list")
    allowed_top = {"score", "tests", "output", "visibility", "stdout_visibility", "execution_time",
                   "extra_data", "leaderboard", "output_format"}
    extra = set(obj) - allowed_top
    if extra:
        raise ValueError(f"unknown top-level keys {sorted(extra)}")
    for i, t in enumerate(obj["tests"]):
        where = f"tests[{i}]"
        if not isinstance(t, dict):
            raise ValueError(f"{where} must be an object")
        for key, typ in (("name", str), ("output", str), ("score", (int, float)), ("max_score", (int, float))):
            if not isinstance(t.get(key), typ) or isinstance(t.get(key), bool):
                raise ValueError(f"{where}.{key} must be {'a string' if typ is str else 'a number'}, got {t.get(key)!r}")
        if t.get("status") not in ("passed", "failed"):
            raise ValueError(f"{where}.status must be 'passed' or 'failed', got {t.get('status')!r}")
        if t.get("visibility") not in ("visible", "hidden", "after_due_date", "after_published"):
            raise ValueError(f"{where}.visibility is not a Gradescope visibility: {t.get('visibility')!r}")
        if not 0 <= t["score"] <= t["max_score"] + 1e-9:
            raise ValueError(f"{where}: score {t['score']} outside [0, max_score={t['max_score']}]")
        if (t["status"] == "passed") != (t["score"] >= t["max_score"] - 1e-9) and t["max_score"] > 0:
            raise ValueError(f"{where}: status {t['status']!r} disagrees with score {t['score']}/{t['max_score']}")
    total = sum(t["score"] for t in obj["tests"])
    if abs(total - obj["score"]) > 1e-3:
        raise ValueError(f"score {obj['score']} is not the sum of the tests' scores {total}")


def format_table(grades: list[NotebookGrade]) -> str:
    """Plain-text table per notebook: exercise, points, status, message (one row per exercise)."""
    out = []
    for g in grades:
        score = sum(eg.score for eg in g.exercises)
        total = sum(eg.max_score for eg in g.exercises)
        out.append(f"== {g.path} ({g.notebook}): {_points(score)}/{_points(total)} points"
                   + (f"; stopped: {g.stopped}" if g.stopped else ""))
        rows = [("exercise", "points", "status", "message")]
        for eg in g.exercises:
            rows.append((eg.exercise.id, f"{_points(eg.score)}/{_points(eg.max_score)}",
                         eg.status.replace("_", " "), eg.message))
        if len(rows) == 1:
            out.append("(no exercises registered for this notebook)")
            continue
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            out.append("  ".join(r[i].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    score = sum(eg.score for g in grades for eg in g.exercises)
    total = sum(eg.max_score for g in grades for eg in g.exercises)
    out.append(f"total {_points(score)}/{_points(total)} points")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit grade", description="Run notebooks and grade their exercises.")
    p.add_argument("paths", nargs="+", type=Path, help="notebooks (.ipynb) to grade")
    p.add_argument("--results", type=Path, default=None, help="write Gradescope results JSON here")
    p.add_argument("--cell-timeout", type=int, default=DEFAULT_CELL_TIMEOUT, help="seconds per cell")
    a = p.parse_args(argv)
    missing = [str(x) for x in a.paths if not x.is_file()]
    if missing:
        print(f"no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    from .registry import IMPORT_ERRORS, load_all

    load_all()
    for module, err in sorted(IMPORT_ERRORS.items()):
        print(f"warning: exercise module {module} failed to import, its exercises are not graded: {err}",
              file=sys.stderr)
    grades = grade_paths(a.paths, a.cell_timeout)
    print(format_table(grades))
    if a.results:
        obj = results_json(grades)
        validate_results(obj)
        a.results.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {a.results}")
    return 0
