"""Batch grading: ``python -m labkit grade submissions/*.ipynb --results-dir DIR --gradebook grades.csv -j N``.

Each submission is graded by its own ``python -m labkit grade SUBMISSION --results DIR/NAME.json``
process (its own kernel, isolation and clean-up, as for one notebook), N at a time (default: the
cores), forked from this process once it has imported torch and the grader, read the exercises and
planned each assignment's withheld kit (about 6 s of CPU each would otherwise pay again); it runs no
learner code before it forks. One line is printed as each finishes (:func:`display_names`). The
gradebook (:func:`gradebook_rows`), its ``error`` column (:func:`zero_reason`; the command exits 1
when a submission could not be graded), its inert cells (:func:`inert`) and the results files'
names (:func:`safe_name`) are described in ``docs/instructors.md``. A submission's path is handed
to its grader after ``--``, so ``-2+3.ipynb`` is graded like any other file. With
``--results-dir`` this process writes the integrity report there (:mod:`labkit.grading.integrity`).

Ctrl-C or SIGTERM (or SIGHUP) stops the batch: the graders still running are told to stop (each
kills its kernel and removes its folders), the gradebook is written with the rows of the
submissions that finished and a ``stopped: ...`` row for each of the others, one line on stderr
says what was stopped, and the command exits 130 (Ctrl-C) or 128 + the signal.
"""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from .contain import kill_quietly
from .sheet import FORMULA_START, inert  # noqa: F401 - batch.inert, as the gradebook's docs name it

__all__ = ["grade_batch", "input_problem", "gradebook_rows", "batch_assignments", "display_names", "safe_name", "inert",
           "zero_reason"]


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def input_problem(results_dir: Path | None, gradebook: Path | None, jobs: int | None) -> str:
    """What is wrong with the batch options ("" when nothing)."""
    if jobs is not None and jobs < 1:
        return f"-j must be >= 1 submission at a time, got {jobs}"
    if results_dir is not None and results_dir.exists() and not results_dir.is_dir():
        return f"--results-dir {results_dir} exists and is not a folder"
    if gradebook is not None:
        if gradebook.is_dir():
            return f"--gradebook {gradebook} is a folder; give the path of the CSV file to write"
        parent = gradebook.parent if str(gradebook.parent) else Path(".")
        if not parent.is_dir():
            return f"--gradebook {gradebook}: its folder {parent} does not exist"
    return ""


_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(stem: str) -> str:
    """A file name for a submission's results whatever the submission is called: letters, digits,
    ``.``, ``_`` and ``-`` only (every other run of characters becomes ``_``), never starting with
    ``-`` or ``.`` (no option, no hidden file), at most 100 characters, never empty."""
    name = _SAFE.sub("_", stem).lstrip("-.")[:100]
    return name or "submission"


def _result_names(paths: list[Path]) -> list[str]:
    """One results-file name per submission: :func:`safe_name` of its stem, made unique with
    -2, -3, ... (case-insensitively, for file systems that fold case)."""
    names, seen = [], set()
    for p in paths:
        base = name = safe_name(p.stem)
        n = 1
        while name.lower() in seen:
            n += 1
            name = f"{base}-{n}"
        seen.add(name.lower())
        names.append(name)
    return names


def zero_reason(obj: dict) -> str:
    """Why a graded submission scored 0, in one line for the gradebook's ``error`` column:
    ``not attempted`` (the learner notebook as shipped, or no answer defined), ``another
    notebook`` (it does not hold the assignment), ``timed out``, ``raised`` (a cell or the answer
    raised), ``the kernel died``, else ``wrong answers`` with the first exercise's message."""
    stopped = ""
    for line in str(obj.get("output", "")).splitlines()[1:]:
        m = re.match(r"^.*?: [\d.]+ / [\d.]+ \((.*)\)$", line)
        if m:
            stopped = m.group(1)
    messages = [t.get("output", "") for t in obj.get("tests", []) if "number" in t and t.get("score", 0) == 0]
    first = messages[0] if messages else ""
    every = " ".join([stopped, *messages])
    if "does not hold assignment" in stopped or ", not assignment " in stopped:
        kind, why = "another notebook", stopped
    elif "as shipped" in first:
        kind, why = "not attempted", "the learner notebook as shipped (every stub untouched)"
    elif "time budget" in every or "time limit" in every or "ran until" in every:
        kind, why = "timed out", stopped or first
    elif "killed the kernel" in every or "kernel died" in every:
        kind, why = "the kernel died", stopped or first
    elif " raised " in every:
        kind, why = "raised", next((m for m in messages if " raised " in m), stopped)
    elif messages and all(m.startswith("not attempted") for m in messages):
        kind, why = "not attempted", first.removeprefix("not attempted: ")
    else:
        kind, why = "wrong answers", first
    return f"{kind}: {why}" if why else kind


def gradebook_rows(entries: list[tuple[str, dict | None, str]],
                   assignments: list[list[tuple[str, float]]] | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the gradebook from ``(submission, results object or None, error)``.

    Columns: ``submission``, one per exercise id, ``total``, ``max``, ``error``. ``assignments``: what the
    batch grades, each assignment as its ``[(exercise id, points), ...]`` in order (the pinned one, else
    those detected in the submissions: :func:`batch_assignments`), so that the header is the same whatever
    was graded (a batch stopped before its first grade too); the assignments of the results are added.

    The rule (why: ``docs/instructors.md``): every exercise of a submission's assignment holds a number,
    0 when it earned nothing for whatever reason, with the reason in ``error``; the maximum is the
    assignment's. A cell is blank only for an exercise of another assignment (a submission that could
    not be read has no assignment, and no maximum)."""
    groups = [list(g) for g in (assignments or []) if g]
    for _, obj, _ in entries:
        g = [(t["number"], t["max_score"]) for t in (obj or {}).get("tests", []) if "number" in t]
        if g and not any({i for i, _ in g} == {i for i, _ in h} for h in groups):
            groups.append(g)
    ids: list[str] = []
    for g in groups:
        ids += [i for i, _ in g if i not in ids]
    only = groups[0] if len(groups) == 1 else None  # one assignment: a submission not graded is 0 out of it
    rows = []
    for name, obj, err in entries:
        if obj is not None:
            scores = {t["number"]: f"{t['score']:g}" for t in obj.get("tests", []) if "number" in t}
            total, top = f"{obj['score']:g}", f"{sum(t['max_score'] for t in obj.get('tests', [])):g}"
        elif only is not None:
            scores, total, top = {i: "0" for i, _ in only}, "0", f"{sum(p for _, p in only):g}"
        else:
            scores, total, top = {}, "0", ""
        if not err and obj is not None and obj.get("score", 0) == 0:
            err = zero_reason(obj)  # every zero says why
        rows.append([inert(name)] + [scores.get(i, "") for i in ids] + [total, top, inert(err)])
    return ["submission"] + [f"exercise {inert(i)}" for i in ids] + ["total", "max", "error"], rows


def batch_assignments(names_per_submission: list[list[str]]) -> list[list[tuple[str, float]]]:
    """The assignments a batch grades, each as ``[(exercise id, points), ...]`` (registry order), from the
    notebook names each submission is graded on (the pinned assignment, or what each holds), first seen first."""
    from .registry import exercises_for_notebook

    out: list[list[tuple[str, float]]] = []
    for names in names_per_submission:
        g = [(ex.id, ex.points) for name in names for ex in exercises_for_notebook(name)]
        if g and g not in out:
            out.append(g)
    return out


def display_names(paths: list[Path]) -> list[str]:
    """How the batch names each submission in its lines: the file name, with as many of its folders as
    tell it apart from the others (``sec1/alice.ipynb`` and ``sec2/alice.ipynb``)."""
    parts = [Path(os.path.abspath(p)).parts for p in paths]
    depth = [1] * len(paths)
    while True:
        shown = [os.path.join(*q[-d:]) for q, d in zip(parts, depth)]
        clash = {n for n in shown if shown.count(n) > 1}
        grow = [k for k, n in enumerate(shown) if n in clash and depth[k] < len(parts[k])]
        if not grow:
            return [str(p) if n in clash else n for p, n in zip(paths, shown)]
        for k in grow:
            depth[k] += 1


def _warm_up(paths, assignment: str | None) -> list[list[str]]:
    """What every submission's grader does first (torch, the exercises, the plan of its assignment's
    withheld kit: the kit's source parsed once), done once here so that the forked graders inherit it.
    Returns the notebook names each submission is graded on ([] for one that cannot be read)."""
    import torch  # noqa: F401
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (runner.run_case imports it before a case forks)

    from . import registry, withhold
    from .which import _nbformat, _notebook_names  # also sets up nbformat as each grader does

    names: list[list[str]] = []
    for p in paths:
        got = []
        try:
            got = [assignment] if assignment else _notebook_names(_nbformat().read(str(p), 4), p)
            if got:
                withhold.kit_plan(got)
        except Exception:  # noqa: BLE001 - its grader says what is wrong with it
            pass
        names.append(got)
    registry.all_exercises()
    return names


class _Grader:
    """``python -m labkit grade ARGV`` in a child forked from this process, its output to ``log``
    (a file); ``poll``/``terminate``/``kill``/``wait`` as :class:`subprocess.Popen`'s."""

    def __init__(self, argv: list[str], log):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:  # the child: a grader process of its own, exactly as if started from the command line
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh process has them; its
                signal.signal(signal.SIGTERM, signal.SIG_DFL)              # run_cli installs its own
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                from ..__main__ import main
                from . import integrity

                integrity.PER_GRADER = False  # the batch writes one integrity report for all
                code = main(["grade", *argv])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - the supervisor reads the last line
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)

    def poll(self):
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 1 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def _signal(self, sig) -> None:
        if self.returncode is None:
            kill_quietly(self.pid, sig)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(["labkit", "grade"], timeout)
            time.sleep(0.05)
        return self.returncode


def _integrity(paths, results_dir: Path, assignment: str | None) -> None:
    """``integrity.csv`` and ``integrity.html`` in ``results_dir`` (:mod:`labkit.grading.integrity`):
    for the instructor, never part of a score; a failure here is a warning, never a lost grade."""
    from .integrity import for_submissions, write_report

    try:
        rows = for_submissions(paths, assignment, [str(p) for p in paths])
        csv_path, html_path = write_report(rows, results_dir)
    except Exception as e:  # noqa: BLE001
        print(f"warning: the integrity report could not be written: {type(e).__name__}: {e}", file=sys.stderr)
        return
    flagged = sum(r.flagged for r in rows)
    print(f"integrity report (instructor only, no effect on scores): {csv_path} and {html_path}; "
          f"{flagged} of {len(rows)} answers flagged")


def _write_gradebook(path: Path, entries, assignments=None) -> None:
    header, rows = gradebook_rows(entries, assignments)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])


def grade_batch(paths, results_dir: Path | None, gradebook: Path | None, jobs: int | None,
                options: list[str] = ()) -> int:
    """Grade each of ``paths`` in its own grader process, ``jobs`` at a time; returns the exit status
    (0: every submission graded, 1: one could not be). Results go to ``results_dir`` (a temporary
    folder when None), the CSV to ``gradebook`` when given. ``options``: the command-line options
    every submission's ``python -m labkit grade`` gets (``--assignment``, ``--cell-timeout``, the
    limits, ...; :func:`labkit.grading.grader.main` passes on all that were given)."""
    import tempfile

    paths = [Path(p) for p in paths]
    jobs = jobs or _cores()
    tmp = None
    if results_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="labkit-batch-")
        results_dir = Path(tmp.name)
    results_dir.mkdir(parents=True, exist_ok=True)
    outs = [results_dir / f"{n}.json" for n in _result_names(paths)]
    from .session import add_private_paths
    add_private_paths([*paths, results_dir])   # every submission's kernel: none of the batch's files
    assignment = options[options.index("--assignment") + 1] if "--assignment" in options else None
    assignments = batch_assignments(_warm_up(paths, assignment))  # the gradebook's columns, known now
    shown = display_names(paths)
    todo = list(range(len(paths)))
    running: dict[int, tuple[_Grader, float, object]] = {}
    done: dict[int, tuple[dict | None, str]] = {}
    stopped_by = ""  # "Ctrl-C" or "SIGTERM" when the batch was stopped
    from ..launch import Terminated

    def finish(i: int, proc: _Grader, t0: float, log) -> None:
        log.seek(0)
        text = log.read()
        log.close()
        obj, err = None, ""
        try:
            obj = json.loads(outs[i].read_text())
        except (OSError, ValueError):
            err = "no results were written"
        if proc.returncode != 0:
            last = [l for l in text.splitlines() if l.startswith("error:")] or text.strip().splitlines()[-1:]
            err = (last[-1].removeprefix("error: ") if last else f"the grader exited {proc.returncode}")
            if "is not a Jupyter notebook" in err or "no such notebook" in err:
                err = f"no notebook: {err}"
        done[i] = (obj, err)
        head = f"[{len(done)}/{len(paths)}] {shown[i]}: "
        if obj is not None:
            head += f"{obj['score']:g}/{sum(t['max_score'] for t in obj['tests']):g} points"
        print(head + (f"{'; ' if obj else ''}NOT GRADED: {err}" if err else "")
              + f" ({time.monotonic() - t0:.0f} s)", flush=True)

    try:
        while todo or running:
            while todo and len(running) < jobs:
                i = todo[0]  # still to do until it runs: a Ctrl-C now leaves it marked "not started"
                log = tempfile.TemporaryFile(mode="w+")
                # the path after "--": a submission named like an option (-2+3.ipynb) is a path like any other
                proc = _Grader([*options, "--results", str(outs[i]), "--", str(paths[i])], log)
                running[i] = (proc, time.monotonic(), log)
                todo.pop(0)
            time.sleep(0.2)
            for i, (proc, t0, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[i]
                finish(i, proc, t0, log)
    except (KeyboardInterrupt, Terminated) as e:
        stopped_by = "Ctrl-C" if isinstance(e, KeyboardInterrupt) else signal.Signals(e.signum).name
    finally:
        for proc, _, _log in running.values():  # Ctrl-C or SIGTERM: each grader cleans up its kernel
            proc.terminate()
        for proc, _, log in running.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
        if tmp is not None:
            tmp.cleanup()
    if stopped_by:
        cut = sorted(running)
        for i in cut + todo:
            when = "while" if i in running else "before"
            done[i] = (None, f"stopped: the batch was stopped by {stopped_by} {when} this submission was graded")
        finished = len(paths) - len(cut) - len(todo)
        print(f"stopped by {stopped_by}: {finished} of {len(paths)} submissions were graded; "
              f"{len(cut)} stopped while being graded ({', '.join(shown[i] for i in cut) or 'none'}) and "
              f"{len(todo)} not started; their kernels were killed", file=sys.stderr, flush=True)
        if gradebook is not None:
            rows = [(str(paths[i]), *done[i]) for i in range(len(paths)) if i not in cut and i not in todo]
            _write_gradebook(gradebook, rows + [(str(paths[i]), *done[i]) for i in cut + todo], assignments)
            print(f"wrote {gradebook} ({finished} graded, {len(cut) + len(todo)} marked stopped)", file=sys.stderr)
        return 130 if stopped_by == "Ctrl-C" else 128 + int(getattr(signal, stopped_by, signal.SIGTERM))
    failed = [shown[i] for i in sorted(done) if done[i][1]]
    if gradebook is not None:
        _write_gradebook(gradebook, [(str(paths[i]), *done[i]) for i in range(len(paths))], assignments)
        print(f"wrote {gradebook} ({len(paths)} submissions)")
    if tmp is None:
        print(f"results: one file per submission in {results_dir}")
        _integrity(paths, results_dir, assignment)
    if failed:
        print(f"error: {len(failed)} of {len(paths)} submissions could not be graded: {', '.join(failed)}",
              file=sys.stderr)
        return 1
    return 0
