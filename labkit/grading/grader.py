"""``python -m labkit grade PATH... [--results results.json]``: the autograder.

The grader starts the learner's kernel (:class:`~labkit.grading.session.KernelSession`, contained
and isolated as root, with a self-check at start: :func:`~labkit.grading.session.isolation_problem`),
runs the notebook's code cells one by one and, at each exercise's grading point, grades the answer
the notebook defines for it: each case runs here, its calls on the answer go to the kernel and
come back as data (:mod:`labkit.grading.wire`), and the verdict is made here. Expected values and
hidden cases never enter the kernel; the results file is written only here, atomically, after the
kernel is dead. Which exercises count: ``--assignment NN_name``, else the notebook the submission
names (:mod:`labkit.grading.which`). An instructor's hidden cases run after all of that, in a
fresh kernel (:func:`_secret_pass`). Points are all or nothing per exercise; an exercise never
graded scores zero with the reason. The integrity report (:mod:`labkit.grading.integrity`) goes
to the instructor, never into a score.

The contract (threat -> mechanism -> test): ``docs/grading.md``; the results format and the
options: ``docs/instructors.md``.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..cliparse import Parser
from .registry import HIDDEN_ENV, Exercise, exercises_for_notebook
from .which import _nbformat, _notebook_names  # noqa: F401 - grader._notebook_names is their home in the docs

__all__ = ["grade_notebook", "grade_paths", "results_json", "validate_results", "format_table", "main",
           "ExerciseGrade", "CaseGrade", "NotebookGrade", "write_results"]

DEFAULT_CELL_TIMEOUT = 300  # seconds one cell may run under the grader
MAX_RESTARTS = 3  # fresh kernels after a cell killed one or ran past the limit
HIDDEN_OUTPUT = "A hidden case failed (its details are not shown)."


@dataclass
class CaseGrade:
    name: str
    hidden: bool
    status: str  # passed | failed | not_attempted | not_reached
    message: str


@dataclass
class ExerciseGrade:
    exercise: Exercise
    status: str  # passed | failed | not_attempted | not_reached
    message: str
    cases: list[CaseGrade] = field(default_factory=list)

    @property
    def score(self) -> float:
        """All or nothing: the exercise's points only when every case passed."""
        return float(self.exercise.points) if self.status == "passed" else 0.0

    @property
    def max_score(self) -> float:
        return float(self.exercise.points)


def _points(x: float) -> str:
    return f"{round(x, 2):g}"


@dataclass
class NotebookGrade:
    path: str
    notebook: str
    stopped: str  # "" when every cell ran cleanly, else what went wrong (cells that raised, killed, ...)
    exercises: list[ExerciseGrade] = field(default_factory=list)
    isolation: str = ""
    graded: bool = True  # False: the grader could not run the notebook (its exercises score zero)


def _first(text: str, limit: int = 200) -> str:
    lines = [l for l in str(text).strip().splitlines() if l.strip()]
    line = lines[0].strip() if lines else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _exercise_grade(ex: Exercise, res, reason: str = "") -> ExerciseGrade:
    """An :class:`ExerciseGrade` from a :class:`~labkit.grading.runner.CheckResult` (None: the
    exercise was never checked, ``reason`` says why)."""
    if res is None:
        status = "not_reached" if reason.startswith("not reached") else "not_attempted"
        msg = reason or f"not attempted: no check(\"{ex.id}\", ...) ran"
        return ExerciseGrade(ex, status, msg, [CaseGrade(c.name, c.hidden, status, msg) for c in ex.cases])
    by_name = {r.name: r for r in res.cases}
    cases = []
    for c in ex.cases:
        r = by_name.get(c.name)
        if r is None:
            cases.append(CaseGrade(c.name, c.hidden, "failed", "this case was not run"))
        else:
            cases.append(CaseGrade(c.name, c.hidden, r.status, r.message))
    if cases and all(c.status == "passed" for c in cases):
        status = "passed"
    elif any(c.status == "not_attempted" for c in cases):
        status = "not_attempted"
    else:
        status = "failed"
    return ExerciseGrade(ex, status, res.message, cases)


def _grade_in_kernel(ex: Exercise, session, deadline: float | None = None, secret: bool = False):
    """Run the cases of ``ex`` here (the instructor's secret ones when ``secret``, else the
    others), their calls going to the answer registered in ``session``, none past ``deadline``
    (a ``time.monotonic()`` value); the CheckResult."""
    from .proxy import KernelBackend
    from .runner import evaluate

    info, pid = dict(session.info), session.pid

    def factory(case):
        token = uuid.uuid4().hex
        return lambda: KernelBackend(info, pid, token)

    def go_on(result) -> bool:  # after a failed case: is the kernel still answering?
        return session.request({"op": "ping"}, wait=5) is not None

    from . import relay

    relay.SOCKET_DIR = session.sockets  # a jailed kernel has a network of its own: its relay is a Unix socket
    try:
        res = evaluate(ex.id, None, stop_at_first_failure=False, backend_factory=factory, go_on=go_on,
                       deadline=deadline, only=lambda c: c.secret == secret)
    finally:
        relay.SOCKET_DIR = None
    session.request({"op": "end"}, wait=10)
    return res


def _merge(ex: Exercise, first, second):
    """One CheckResult of ``ex`` from the visible pass and the secret pass (None: it did not run)."""
    from .runner import CaseResult, result_of

    if second is None:
        second_cases = [CaseResult(c.name, c.hidden, "failed", "not run: the fresh kernel for the instructor's "
                                                             "cases stopped before this exercise")
                        for c in ex.cases if c.secret]
    else:
        second_cases = list(second.cases)
    return result_of(ex, list(first.cases) + second_cases, len(ex.cases))


def _limit(cell_timeout: float, deadline: float) -> float:
    """Seconds one cell may run: the cell limit, cut to what the time budget leaves (at least 1 s)."""
    return max(1.0, min(cell_timeout, deadline - time.monotonic()))


def _secret_pass(wanted, results, due, cells, replay, launch, cell_timeout, deadline: float,
                 release=lambda k: None) -> None:
    """The instructor's secret cases (hidden-case files), after every visible result is fixed:
    a fresh kernel replays the cells that ran (``replay``: positions, in order) and, at each
    exercise's grading point, the secret cases run against the pinned answer. Merged into
    ``results``; a secret case that could not run counts as failed."""
    from .assignments import answer_name, register_code

    todo = {i for i, r in results.items() if any(c.secret for c in wanted[i].cases)}
    if not todo:
        return
    last = max(k for k, ids in due.items() if todo & set(ids))  # no cell after it can matter
    second: dict = {}
    session = None
    try:
        if deadline - time.monotonic() >= 1:  # else no kernel is started: the secret cases count as failed below
            session = launch()
            session.wait_ready(deadline)
            for k in replay:
                if k > last or deadline - time.monotonic() < 1:
                    break
                st, _, _ = session.execute(cells[k][1], _limit(cell_timeout, deadline))
                if st not in ("ok", "error") or not session.alive():
                    break
                for ex_id in due.get(k, ()):
                    if ex_id not in todo:
                        continue
                    code = register_code(ex_id, answer_name(ex_id, cells))
                    if code and session.execute(code, _limit(cell_timeout, deadline))[0] != "ok":
                        continue
                    second[ex_id] = _grade_in_kernel(wanted[ex_id], session, deadline, secret=True)
                release(k)
    except Exception:  # noqa: BLE001 - a kernel that would not start: its cases count as failed
        pass
    finally:
        if session is not None:
            session.kill()
    for ex_id in todo:
        results[ex_id] = _merge(wanted[ex_id], results[ex_id], second.get(ex_id))


def _kernel_kit(user, names):
    """The grader's copy of the kit for this submission's kernels (:mod:`labkit.grading.withhold`),
    or None where kernels do not get a file system of their own, nor a private kit (root without
    CAP_SYS_ADMIN, the installed kit root-only: the kernel imports this copy). As root, the references of
    the exercises of ``names`` are withheld until graded; a non-root grader's kernel runs as its
    own user, who could read them, so its copy only leaves the grader's files out."""
    if user is None or not (user.jail and user.newroot or user.kit_private):
        return None
    from .session import kit_folder
    from .withhold import build_kit

    folder = tempfile.mkdtemp(prefix="labkit-kit-", dir=kit_folder(user))
    if user.kit_private:  # no jail binds it: the kernel's uid imports it from here
        os.chmod(folder, 0o755)
    try:
        return build_kit([] if user.userns else names, folder)
    except BaseException:  # a kit that could not be built leaves nothing in TMPDIR
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _registered(session) -> dict:
    reply = session.request({"op": "answers"}, wait=30)
    ok = reply.get("ok") if reply else None
    if not isinstance(ok, dict):
        return {}
    return {str(k): v for k, v in ok.items() if isinstance(v, int)}


def default_time_budget(cell_timeout: float, exercises, n_cells: int) -> float:
    """Seconds one submission may take in all, by default (``--time-budget``): cells that run
    up to their limit (at most ``MAX_RESTARTS + 2`` of them: each one costs a fresh kernel),
    5 s per cell for the replays, every case of its exercises up to its own limit, and a
    minute of kernel starts."""
    cases = sum(c.timeout for ex in exercises for c in ex.cases)
    return min(n_cells, MAX_RESTARTS + 2) * cell_timeout + (MAX_RESTARTS + 1) * 5 * n_cells + cases + 60


def _untouched(nb, names: list[str]) -> bool:
    """Whether the submission's code cells are exactly those of the learner notebook shipped for
    its one assignment (``labkit/_notebooks``): every exercise there is a stub that raises
    NotImplementedError (``make test`` runs each learner notebook), so it grades 0 with no kernel.
    Any edit, however small, and a bundle without the shipped notebooks, take the normal path."""
    from .build import packaged_notebooks

    if len(names) != 1:
        return False
    shipped = next((p for p in packaged_notebooks("notebooks") if p.stem == names[0]), None)
    if shipped is None:
        return False
    code = [c.get("source", "") for c in nb.cells if c.get("cell_type") == "code"]
    ref = [c.get("source", "") for c in _nbformat().read(str(shipped), as_version=4).cells
           if c.get("cell_type") == "code"]
    return code == ref


def _answer_cell_broke(ex_id: str, cells, k: int, cell_problems: dict[int, str]) -> str:
    """Why exercise ``ex_id``'s answer is not defined at its grading point (code cell ``k``) when the
    reason is an earlier cell: the last cell before ``k`` that defines the answer ran past the time
    limit, raised or killed the kernel (its definition is lost, and a fresh kernel does not replay it);
    "" when that is not so (the NameError is then the learner's own)."""
    from .assignments import answer_name, defines

    name = answer_name(ex_id, cells)
    if not name:
        return ""
    for j in range(k - 1, -1, -1):
        idx, src = cells[j]
        if defines(src, name):
            problem = cell_problems.get(idx)
            return (f"not attempted: the cell that defines {name} (cell {idx + 1}) did not finish: {problem}"
                    if problem else "")
    return ""


def _did_not_run(ex_id: str, cells, k: int, problem: str) -> str:
    """Why exercise ``ex_id``, graded after code cell ``k`` of ``cells``, was not: that cell broke
    (``problem``), and it is the exercise's ``check`` cell or the one that defines its answer."""
    from .assignments import _check_pattern, answer_name

    if _check_pattern(ex_id).search(cells[k][1]):
        return f"not attempted: check(\"{ex_id}\", ...) did not run: {problem}"
    return f"not attempted: the cell that defines {answer_name(ex_id, cells) or 'the answer'} did not finish: {problem}"


def grade_notebook(path: str | Path, cell_timeout: float = DEFAULT_CELL_TIMEOUT,
                   assignment: str | None = None, time_budget: float | None = None,
                   limits=None, hints: bool = True) -> NotebookGrade:
    """Run notebook ``path`` in an isolated kernel and grade every exercise of its notebook.

    ``assignment`` (e.g. "02_gpipe") pins the notebook whose exercises count, whatever the
    submission holds (:mod:`labkit.grading.assignments`); None reads it from the submission
    (metadata, file name, check calls). The shipped learner version, unedited, grades 0 ("not
    attempted") without a kernel. Each code cell up to the last grading point runs once, in order;
    each exercise is graded once, from its pinned name at its grading point. ``time_budget``
    (seconds, default :func:`default_time_budget`) bounds the whole submission: what it leaves no
    time for is "not reached". ``limits``: a :class:`~labkit.grading.contain.Limits` for the kernel
    (root only). ``hints=False`` leaves the hints out of the messages.
    """
    from .assignments import answer_name, grading_points, register_code
    from .session import KernelSession, KernelStartError, KernelStartTimeout, isolation_note, kernel_user

    path = Path(path)
    nb = _nbformat().read(str(path), as_version=4)
    names = [assignment] if assignment else _notebook_names(nb, path)
    exercises = [ex for name in names for ex in exercises_for_notebook(name)]
    wanted = {ex.id: ex for ex in exercises}
    cells = [(i, c.get("source", "")) for i, c in enumerate(nb.cells) if c.get("cell_type") == "code"]
    if time_budget is None:
        time_budget = default_time_budget(cell_timeout, exercises, len(cells))
    deadline = time.monotonic() + time_budget
    out_of_time = f"the submission's time budget of {time_budget:g} s ran out"
    points = grading_points(cells, list(wanted))
    grades: dict[str, ExerciseGrade] = {}
    due: dict[int, list[str]] = {}
    for ex_id, k in points.items():
        if k is not None:
            due.setdefault(k, []).append(ex_id)
    expected_errors = {i for i, c in enumerate(nb.cells)
                       if "raises-exception" in c.get("metadata", {}).get("tags", [])}
    user = kernel_user(limits)
    if exercises and _untouched(nb, names):  # a blank submission: nothing to run
        grade = NotebookGrade(str(path), ", ".join(names), "", isolation=isolation_note(user))
        grade.exercises = [_exercise_grade(ex, None, "not attempted: the notebook is the learner version as shipped "
                                           "(the stub still raises NotImplementedError)") for ex in exercises]
        return grade
    cell_problems: dict[int, str] = {}
    stop = ""

    spare: list = []
    kit = _kernel_kit(user, names)  # the kit the kernel imports: the assignment's references withheld

    def release(k: int) -> None:
        """Every reference whose exercises have all been graded (grading point <= k) becomes loadable."""
        if kit is not None:
            kit.release_after(ex_id for ex_id, p in points.items() if p is None or p <= k)

    release(-1)

    def launch():
        s = KernelSession(user, kit=kit.path if kit is not None else None)
        s.launch()
        return s

    def start():
        # after a first dead or stuck cell a spare kernel warms up while the next one is used
        s = spare.pop() if spare else launch()
        for attempt in (1, 2):
            try:
                s.wait_ready(deadline)  # starting a kernel counts against the budget
                break
            except KernelStartError as e:  # before any code of the submission ran in it: one more try
                s.kill()
                if attempt == 2:
                    raise
                print(f"warning: {path.name}: {e}; starting another kernel", file=sys.stderr)
                s = launch()
            except BaseException:
                s.kill()  # a kernel that did not start must not outlive grading either
                raise
        if restarts and not spare:
            spare.append(launch())
        return s

    # cells after the last grading point cannot change a grade: they are not run (nor, when the
    # submission holds none of the exercises, is a kernel started)
    end = 1 + max((k for k in points.values() if k is not None), default=-1)
    restarts = 0
    ran: list[int] = []  # positions in ``cells`` that ran without an error (replayed in a fresh kernel)
    raised: list[int] = []  # positions of cells that raised (replayed for the secret cases only)
    results: dict = {}  # exercise id -> CheckResult of its visible (not secret) cases
    session = None
    try:
        try:
            session = start() if end else None
        except KernelStartTimeout as e:
            if not e.budget:
                raise
            session, end, stop = None, 0, f"{out_of_time} while the kernel started"
        from .session import secret_files

        hidden = [str(f) for f in _hidden_files()]
        for f in session.hidden_files_readable(hidden + [f for f in secret_files() if f not in hidden]) if end else ():
            what = "the hidden case file" if f in hidden else "the grader's file"
            print(f"warning: the submission's kernel can read {what} {f}; make it readable by root only "
                  f"(chmod o-r, and its folder o-x)", file=sys.stderr)
        k = 0
        while k < end:
            idx, src = cells[k]
            left = deadline - time.monotonic()
            if left < 1:
                stop = f"{out_of_time} before cell {idx + 1}"
                break
            status, ename, evalue = session.execute(src, min(cell_timeout, left))
            if status in ("ok", "error"):
                if status == "error":
                    cell_problems[idx] = f"cell {idx + 1} raised {ename}: {_first(evalue)}".rstrip(": ")
                    raised.append(k)
                else:
                    ran.append(k)
                for ex_id in due.get(k, ()):  # graded here, from the pinned name, once
                    if deadline - time.monotonic() < 1:
                        stop = f"{out_of_time} while cell {idx + 1}'s checks were graded"
                        break
                    code = register_code(ex_id, answer_name(ex_id, cells))
                    left = _limit(cell_timeout, deadline)
                    st, en, ev = session.execute(code, left) if code else ("ok", "", "")
                    if st == "ok" and (code or ex_id in _registered(session)):
                        results[ex_id] = _grade_in_kernel(wanted[ex_id], session, deadline)
                    elif st == "error" and en == "NameError" and (
                            broke := _answer_cell_broke(ex_id, cells, k, cell_problems)):
                        # the answer's own cell broke earlier (ran past the time limit, raised): say that
                        grades[ex_id] = _exercise_grade(wanted[ex_id], None, broke)
                    elif st == "error" and status == "error" and en == "NameError":  # the cell broke
                        grades[ex_id] = _exercise_grade(wanted[ex_id], None, _did_not_run(ex_id, cells, k,
                                                                                          cell_problems[idx]))
                    elif st == "error":
                        grades[ex_id] = _exercise_grade(wanted[ex_id], None, _undefined(answer_name(ex_id, cells),
                                                                                        ex_id, en, ev))
                if stop:
                    break
                release(k)
                if session.alive():
                    k += 1
                    continue
                cell_problems.setdefault(idx, f"the kernel died while cell {idx + 1}'s checks were graded")
            elif status == "timeout" and deadline - time.monotonic() < 1:
                stop = cell_problems[idx] = f"cell {idx + 1} ran until {out_of_time}"
                break
            elif status == "timeout":
                cell_problems[idx] = f"cell {idx + 1} ran past the time limit of {cell_timeout:g} s"
            else:
                cell_problems[idx] = f"cell {idx + 1} killed the kernel (it exited or was killed)"
            # a fresh kernel: replay what ran, skip the bad cell, go on
            session.kill()
            restarts += 1
            if restarts > MAX_RESTARTS:
                stop = f"{cell_problems[idx]}; gave up after {MAX_RESTARTS} fresh kernels"
                break
            try:
                session = start()
            except KernelStartTimeout as e:
                if not e.budget:
                    raise
                session, stop = None, f"{cell_problems[idx]}; {out_of_time} while a fresh kernel started"
                break
            for j in ran:
                st, _, _ = session.execute(cells[j][1], _limit(cell_timeout, deadline))
                if st not in ("ok", "error"):
                    stop = f"{cell_problems[idx]}; replaying cell {cells[j][0] + 1} in a fresh kernel failed"
                    break
            if stop:
                break
            release(k)
            k += 1
        # every visible result is fixed: only now do the instructor's secret inputs reach a (fresh) kernel,
        # with every reference withheld again until its exercise's secret cases have run
        if kit is not None:
            kit.withhold()
            release(-1)
        for s in filter(None, [session, *spare]):  # every kernel of this submission
            s.kill()
        session = None
        spare.clear()
        _secret_pass(wanted, results, due, cells, sorted(set(ran) | set(raised)), launch, cell_timeout, deadline,
                     release)
    finally:
        for s in filter(None, [session, *spare]):  # every kernel of this submission
            s.kill()
        if kit is not None:
            shutil.rmtree(os.path.dirname(kit.path), ignore_errors=True)
    if not hints:
        from .runner import format_line

        for ex_id, res in results.items():
            res.message = format_line(wanted[ex_id], res, hints=False)
    grades.update({ex_id: _exercise_grade(wanted[ex_id], res) for ex_id, res in results.items()})
    # a cell tagged raises-exception (it uses an answer, e.g. a plot) may raise: not a problem
    problems = "; ".join(cell_problems[i] for i in sorted(cell_problems)
                         if not (i in expected_errors and " raised " in cell_problems[i]))
    grade = NotebookGrade(str(path), ", ".join(names) or path.stem, stop or problems, isolation=isolation_note(user))
    for ex in exercises:
        if ex.id in grades:
            grade.exercises.append(grades[ex.id])
            continue
        reason = ""
        k = points.get(ex.id)
        if k is None:
            reason = (f"not attempted: the notebook defines no {answer_name(ex.id, cells) or 'answer'!r} and has "
                      f"no check(\"{ex.id}\", ...)")
        elif cells[k][0] in cell_problems:
            reason = _did_not_run(ex.id, cells, k, cell_problems[cells[k][0]])
        if not reason and stop:
            reason = f"not reached: {stop}"
        grade.exercises.append(_exercise_grade(ex, None, reason))
    if assignment and exercises:
        held = _notebook_names(nb, path)
        note = ""
        if all(points.get(ex.id) is None for ex in exercises):
            note = (f"the submission does not hold assignment {assignment}: no cell defines "
                    f"{', '.join(answer_name(ex.id, cells) or ex.id for ex in exercises)}"
                    + (f" (it looks like {', '.join(held)})" if held and held != [assignment] else ""))
        elif held and assignment not in held:  # another notebook that happens to define (or import) a name
            note = (f"the submission looks like {', '.join(held)}, not assignment {assignment}: it was graded on "
                    f"{assignment}'s exercises; upload your {assignment} notebook")
        grade.stopped = "; ".join(x for x in (grade.stopped, note) if x)
    return grade


def _undefined(name: str, ex_id: str, ename: str, evalue: str) -> str:
    if ename == "NameError":
        return f"not attempted: {name!r} is not defined where exercise {ex_id} is graded"
    return f"not attempted: registering {name!r} for exercise {ex_id} raised {ename}: {_first(evalue)}"


def _hidden_files() -> list[Path]:
    out = []
    for p in os.environ.get(HIDDEN_ENV, "").split(os.pathsep):
        if p and Path(p).is_dir():
            out += sorted(Path(p).glob("*.py"))
    return out


def grade_paths(paths, cell_timeout: float = DEFAULT_CELL_TIMEOUT, assignment: str | None = None,
                time_budget: float | None = None, limits=None, hints: bool = True) -> list[NotebookGrade]:
    """:func:`grade_notebook` for each path; one that cannot be graded gets ``graded=False`` and zeros."""
    out = []
    for p in paths:
        try:
            out.append(grade_notebook(p, cell_timeout, assignment=assignment, time_budget=time_budget,
                                      limits=limits, hints=hints))
        except Exception as e:  # noqa: BLE001 - a broken submission or kernel still gets a grade
            g = NotebookGrade(str(p), Path(p).stem, f"the notebook could not be graded: {type(e).__name__}: "
                                                    f"{_first(str(e))}", graded=False)
            try:
                nb = _nbformat().read(str(p), as_version=4)
                for name in [assignment] if assignment else _notebook_names(nb, Path(p)):
                    for ex in exercises_for_notebook(name):
                        g.exercises.append(_exercise_grade(ex, None, f"not reached: {g.stopped}"))
            except Exception:  # noqa: BLE001
                pass
            out.append(g)
    return out


def results_json(grades: list[NotebookGrade], execution_time: float | None = None) -> dict:
    """The Gradescope results object for ``grades``.

    What a student sees carries no instructor detail: the top-level ``output`` names notebooks
    by file name (no grader paths) and leaves out the isolation note, which goes to the
    grader's stdout; ``stdout_visibility`` is ``hidden`` so that stdout stays with the
    instructor. Each exercise's test carries its id as Gradescope's ``number``.
    ``execution_time``: seconds the grading took (Gradescope's field), when given."""
    tests = []
    for g in grades:
        for eg in g.exercises:
            # the exercise's points, all or nothing, on one test; then each case, worth 0
            passed = eg.status == "passed"
            tests.append({
                "name": eg.exercise.label,
                "number": eg.exercise.id,
                "score": round(eg.score, 6),
                "max_score": round(eg.max_score, 6),
                "status": "passed" if passed else "failed",
                "output": (f"passed: all {len(eg.cases)} cases" if passed else
                           f"{eg.message or 'failed'} (no points: all {len(eg.cases)} cases must pass)"
                           if eg.status == "failed" else eg.message),
                "visibility": "visible",
            })
            for c in eg.cases:
                passed = c.status == "passed"
                if passed:
                    output = "passed"
                elif c.hidden and c.status == "failed" and not c.message.startswith("not run"):
                    output = HIDDEN_OUTPUT
                elif c.status == "not_attempted" and not c.message.startswith("not attempted"):
                    output = "not attempted (the stub still raises NotImplementedError)"
                elif c.status in ("not_attempted", "not_reached"):
                    output = "not run: see the exercise's line above" if c.message == eg.message else c.message
                else:
                    output = c.message or "failed"
                tests.append({
                    "name": f"{eg.exercise.label} - {'hidden case' if c.hidden else 'case'}: {c.name}",
                    "score": 0,
                    "max_score": 0,
                    "status": "passed" if passed else "failed",
                    "output": output,
                    "visibility": "after_published" if c.hidden else "visible",
                })
    score = round(sum(t["score"] for t in tests), 4)
    total = round(sum(t["max_score"] for t in tests), 4)
    lines = [f"{Path(g.path).name}: {_points(sum(e.score for e in g.exercises))} / "
             f"{_points(sum(e.max_score for e in g.exercises))}"
             + (f" ({g.stopped.replace(str(Path(g.path).parent) + os.sep, '')})" if g.stopped else "") for g in grades]
    obj = {"score": score, "output": "\n".join([f"Total {_points(score)} / {_points(total)}"] + lines),
           "stdout_visibility": "hidden", "tests": tests}
    if execution_time is not None:
        obj["execution_time"] = max(0, int(math.ceil(execution_time)))
    return obj


def write_results(path: Path, obj: dict) -> None:
    """Write ``obj`` as JSON to ``path`` atomically, readable by its owner only
    (:func:`labkit.grading.build.write_whole`)."""
    from .build import write_whole

    write_whole(Path(path), (json.dumps(obj, indent=2) + "\n").encode("utf-8"), 0o600)


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
                kind = "a string" if typ is str else "a number"
                raise ValueError(f"{where}.{key} must be {kind}, got {t.get(key)!r}")
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
                   + (f"; {g.stopped}" if g.stopped else ""))
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
    out += sorted({g.isolation for g in grades if g.isolation})
    return "\n".join(out)


def _seconds(text: str) -> float | None:
    """``text`` as a positive, finite number of seconds (None when it is not one)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _hidden_env_problem() -> str | None:
    """``LABKIT_HIDDEN_CASES``: each folder it names checked as ``autograder --hidden-cases`` checks
    its folder (:func:`labkit.grading.registry.hidden_cases_problem`), then the cases loaded; the
    first problem as one message, or None."""
    from .registry import hidden_cases_problem, load_hidden_problem

    value = os.environ.get(HIDDEN_ENV)
    if value is None:
        return None
    for folder in value.split(os.pathsep):
        if folder:
            bad = hidden_cases_problem(folder, f"{HIDDEN_ENV}={folder}")
            if bad:
                return bad
    return load_hidden_problem(f"{HIDDEN_ENV}={value}") if value.strip(os.pathsep) else None


def _input_problem(paths: list[Path], results: Path | None) -> str:
    """What is wrong with the command's inputs ("" when nothing): checked before anything runs."""
    for x in paths:
        if x.exists() and not x.is_file():
            import stat
            kind = "a folder" if x.is_dir() else "a FIFO (named pipe)" if stat.S_ISFIFO(x.stat().st_mode) \
                else "not a regular file"
            return f"{x} is {kind}; give the path of a notebook file (.ipynb)"
        if not x.is_file():
            return f"no such notebook: {x}"
        try:
            nb = _nbformat().read(str(x), as_version=4)
            _nbformat().validate(nb)
        except Exception as e:  # noqa: BLE001 - binary, not JSON, not a notebook
            return f"{x} is not a Jupyter notebook ({type(e).__name__}: {_first(str(e), 160)})"
        spec = nb.metadata.get("kernelspec") or {}
        language = spec.get("language") or (nb.metadata.get("language_info") or {}).get("name") or "python"
        if str(language).lower() != "python":
            return (f"{x} declares the kernel {spec.get('name', '?')!r} (language {language}); the grader runs "
                    f"every notebook in its own Python kernel, so it cannot grade this one")
    if results is not None:
        if results.is_dir():
            return f"--results {results} is a folder; give the path of the JSON file to write"
        parent = results.parent if str(results.parent) else Path(".")
        if not parent.is_dir():
            return f"--results {results}: its folder {parent} does not exist"
        if not os.access(parent, os.W_OK | os.X_OK):
            return f"--results {results}: its folder {parent} is not writable"
    return ""


_BATCH_ONLY = {"help", "paths", "results", "results_dir", "gradebook", "jobs"}


def _submission_options(parser, args) -> list[str]:
    """The command-line options, as given, that a batch passes on to each submission's grader:
    every option of ``parser`` but the batch's own (one list, so none is forgotten)."""
    out: list[str] = []
    for action in parser._actions:  # noqa: SLF001 - argparse's list of declared options
        if action.dest in _BATCH_ONLY or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a flag (store_true)
            out += [action.option_strings[0]] if value else []
        elif value is not None and value != action.default:
            out += [action.option_strings[0], str(value)]
    return out


def _print_integrity(grades, assignment: str | None) -> None:
    """The integrity report of the graded notebooks (:mod:`labkit.grading.integrity`) on stdout,
    the instructor-only output (Gradescope: ``stdout_visibility`` hidden); never part of a score,
    and a failure here costs no grade."""
    try:
        from . import integrity
        from .integrity import for_submissions, format_report

        if not integrity.PER_GRADER:
            return
        paths = [g.path for g in grades if g.graded]
        print(format_report(for_submissions(paths, assignment)))
    except Exception as e:  # noqa: BLE001
        print(f"warning: no integrity report: {type(e).__name__}: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit grade``; bad input ends with one ``error:`` line (exit 2) before any
    kernel starts. Exit status 0 when every notebook was graded (whatever its score), 1 when one
    could not be graded. ``--results-dir``/``--gradebook``/``-j``: batch grading
    (:mod:`labkit.grading.batch`), one kernel per submission, N at a time."""
    p = Parser(prog="python -m labkit grade", description="Run notebooks and grade their exercises.")
    p.add_argument("paths", nargs="+", type=Path, help="notebooks (.ipynb) to grade")
    p.add_argument("--results", type=Path, default=None, help="write Gradescope results JSON here")
    p.add_argument("--cell-timeout", default=str(DEFAULT_CELL_TIMEOUT), help="seconds per cell (> 0)")
    p.add_argument("--time-budget", default=None,
                   help="seconds one submission may take in all (> 0; default: from --cell-timeout and its cases)")
    p.add_argument("--assignment", default=None, metavar="NN_name",
                   help="the notebook whose exercises count, e.g. 02_gpipe, whatever the submission holds "
                        "(default: read from the submission)")
    from .contain import Limits

    d = Limits()
    p.add_argument("--max-processes", type=int, default=d.processes,
                   help=f"processes and threads of one submission (root only; default {d.processes})")
    p.add_argument("--max-file-size", type=int, default=d.file_size // 2 ** 20,
                   help=f"MiB of one file the submission writes (root only; default {d.file_size // 2 ** 20})")
    p.add_argument("--max-memory", type=int, default=d.address_space // 2 ** 20,
                   help=f"MiB of address space per process, and of memory in all under cgroup v2 (root only; "
                        f"default {d.address_space // 2 ** 20})")
    p.add_argument("--tmp-size", type=int, default=d.tmp_size // 2 ** 20,
                   help=f"MiB of each private /tmp, /var/tmp, /dev/shm (root only; default {d.tmp_size // 2 ** 20})")
    p.add_argument("--no-hints", action="store_true", help="leave hints out of the graded messages")
    p.add_argument("--allow-partial-isolation", action="store_true",
                   help="as root: grade even when the self-check at start finds that kernels cannot get full "
                        "isolation (a uid of their own, private namespaces, a file system of their own); without "
                        "it the grader stops before grading with the cause and the fix (exit 2)")
    p.add_argument("--no-source-policy", action="store_true", help="no effect (kept for old scripts)")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="batch: one results file per submission in this folder, and the integrity report "
                        "(integrity.csv, integrity.html: similarity to the kit's reference and between "
                        "submissions, dynamic code; for the instructor, never a score)")
    p.add_argument("--gradebook", type=Path, default=None,
                   help="batch: a CSV with one row per submission, one column per exercise and the total")
    p.add_argument("-j", "--jobs", type=int, default=None,
                   help="batch: submissions graded at a time (default: the cores)")
    argv = sys.argv[1:] if argv is None else list(argv)
    # a submission whose file name starts with "-" (-2+3.ipynb) is a path, not an option
    argv = [os.path.join(".", x) if x.startswith("-") and x.endswith(".ipynb") and os.path.isfile(x) else x
            for x in argv]
    a = p.parse_args(argv)
    from .session import isolation_problem, place_problem
    # before anything loads the exercises (and with them the hidden cases, and torch): /proc and what else it needs
    bad = place_problem() or _hidden_env_problem()
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    limits = Limits(processes=a.max_processes, file_size=a.max_file_size * 2 ** 20,
                    address_space=a.max_memory * 2 ** 20, memory=a.max_memory * 2 ** 20, tmp_size=a.tmp_size * 2 ** 20)
    cell_timeout = _seconds(a.cell_timeout)
    time_budget = None if a.time_budget is None else _seconds(a.time_budget)
    problem = "" if cell_timeout is not None else (
        f"--cell-timeout must be a positive number of seconds, got {a.cell_timeout!r}")
    if not problem and a.time_budget is not None and time_budget is None:
        problem = f"--time-budget must be a positive number of seconds, got {a.time_budget!r}"
    if not problem and a.assignment is not None and not exercises_for_notebook(a.assignment):
        from .registry import all_exercises

        known = ", ".join(sorted({ex.notebook for ex in all_exercises()}))
        problem = f"--assignment {a.assignment} is not a notebook with exercises; known: {known}"
    floors = (("--max-processes", a.max_processes, 16, ""), ("--max-file-size", a.max_file_size, 1, " MiB"),
              ("--max-memory", a.max_memory, 1024, " MiB"), ("--tmp-size", a.tmp_size, 1, " MiB"))
    for opt, value, low, unit in floors:
        if not problem and value < low:
            problem = f"{opt} must be at least {low}{unit}, got {value}"
    batch = a.results_dir is not None or a.gradebook is not None or a.jobs is not None
    missing = next((x for x in a.paths if not x.is_file()), None)
    # a batch grades every readable file: one that is not a notebook is reported in its row
    problem = problem or (f"no such notebook: {missing}" if batch and missing else
                          _input_problem([] if batch else a.paths, a.results))
    if not problem and batch and a.results is not None:
        problem = "--results writes one file for all notebooks; with --results-dir/--gradebook/-j leave it out"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from .registry import IMPORT_ERRORS, load_all

    load_all()
    if batch:
        from .batch import input_problem
        problem = input_problem(a.results_dir, a.gradebook, a.jobs)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    for module, err in sorted(IMPORT_ERRORS.items()):
        print(f"warning: exercise module {module} failed to import, its exercises are not graded: {err}",
              file=sys.stderr)
    problem = isolation_problem(limits, a.allow_partial_isolation)  # the self-check: the kernel's uid starts Python
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if a.assignment is None:
        print("warning: no --assignment: each submission is graded on the notebook its metadata, file name or "
              "check calls name; pass --assignment NN_name so that the submission cannot choose", file=sys.stderr)
    if batch:
        from .batch import grade_batch
        return grade_batch(a.paths, a.results_dir, a.gradebook, a.jobs, _submission_options(p, a))
    t0 = time.monotonic()
    from .session import add_private_paths
    add_private_paths([*a.paths, *([a.results] if a.results else [])])   # out of every kernel's reach
    grades = grade_paths(a.paths, cell_timeout, assignment=a.assignment, time_budget=time_budget, limits=limits,
                         hints=not a.no_hints)
    print(format_table(grades))
    _print_integrity(grades, a.assignment)
    if a.results:
        obj = results_json(grades, execution_time=time.monotonic() - t0)
        validate_results(obj)
        write_results(a.results, obj)
        print(f"wrote {a.results}")
    bad = [f"{g.path} ({g.stopped.removeprefix('the notebook could not be graded: ')})" for g in grades
           if not g.graded]   # each with the reason (the batch shows this line)
    if bad:
        print(f"error: {len(bad)} notebook(s) could not be graded: {'; '.join(bad)}", file=sys.stderr)
        return 1
    return 0
