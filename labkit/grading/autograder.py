"""A Gradescope autograder bundle: ``python -m labkit autograder ASSIGNMENT --out autograder.zip``.

Gradescope (https://gradescope-autograders.readthedocs.io, "Autograder Specifications") unzips
the bundle into ``/autograder/source``, runs ``setup.sh`` there once, as root, on its Ubuntu
image, and for each submission copies the upload to ``/autograder/submission``, runs
``/autograder/run_autograder`` (as root) and reads ``/autograder/results/results.json``.

The bundle holds, at its root:

* ``setup.sh``: installs ``python3-venv`` when Python has no ``ensurepip``; makes a venv in
  ``$ROOT/venv`` with the CPU torch wheel pinned as in ``requirements.txt`` (the default wheel
  on PyPI brings CUDA: ``LABKIT_PIP_ARGS`` defaults to PyTorch's CPU index plus PyPI); copies
  labkit's source from the bundle into the venv; creates the unprivileged kernel user
  ``labkit-kernel``; makes the installed kit and the bundle's source (``hidden/`` included)
  readable by root only: every kernel imports the grader's copy of the kit, references withheld
  until graded, also where it gets no file system of its own (``--allow-partial-isolation``).
* ``run_autograder``: makes ``submission_metadata.json`` (the learner's name, earlier results)
  readable by root only, then runs :func:`run` with the venv's Python.
* ``labkit/`` (the kit's source), ``requirements.txt``, ``hidden/*.py`` (``--hidden-cases``)
  and ``labkit_assignment.json`` (the assignment, cell timeout and whether hints are shown).

``$ROOT`` is ``/autograder`` unless ``LABKIT_AUTOGRADER_ROOT`` says otherwise (tests run the
bundle in a temporary tree). ``LABKIT_PIP_ARGS`` replaces the pip source/index options (e.g.
``--no-index`` offline); ``LABKIT_REUSE_SITE`` (tests only) makes the venv see the packages of
an existing environment's site-packages, so that nothing is downloaded.

:func:`run` grades exactly the assignment's notebook: the one ``.ipynb`` uploaded, whatever its
file name, pinned to the assignment (``grade_notebook(..., assignment=...)``: another notebook
scores zero, with a message naming both). No notebook, or several, gives a results file with
every exercise at zero and a message saying what to upload. Instructor detail (the isolation
note, paths) goes to stdout, which ``stdout_visibility: hidden`` keeps from students.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zipfile
from pathlib import Path

__all__ = ["build_bundle", "run", "main", "TORCH_PIN", "RUNTIME_REQUIREMENTS", "DEFAULT_BUNDLE_CELL_TIMEOUT"]

TORCH_PIN = "torch==2.13.0"  # as in requirements.txt (tests/grading/test_autograder.py checks they agree)
# labkit's runtime dependencies (pyproject.toml), torch pinned
RUNTIME_REQUIREMENTS = [TORCH_PIN, "numpy>=1.22", "matplotlib>=3.6", "tqdm>=4.62", "nbformat>=5.1",
                        "nbclient>=0.6", "ipykernel>=6.0", "ipython>=8.0", "ipywidgets>=8.0", "jupyter_client>=7.0",
                        "pyzmq>=23", "copydetect==0.5.0"]
# Gradescope's default limit for a whole run is 10 minutes; one cell gets at most this by default
DEFAULT_BUNDLE_CELL_TIMEOUT = 120
CONFIG = "labkit_assignment.json"
ROOT_ENV = "LABKIT_AUTOGRADER_ROOT"

SETUP_SH = r"""#!/usr/bin/env bash
# labkit autograder setup: Gradescope runs this once, as root, on its Ubuntu image.
set -euo pipefail
ROOT="${LABKIT_AUTOGRADER_ROOT:-/autograder}"
SRC="$ROOT/source"
PY="${LABKIT_PYTHON:-python3}"
# the CPU wheel of torch (PyPI's default wheel brings CUDA); LABKIT_PIP_ARGS replaces these sources
# (set and empty: pip's own configuration, e.g. a local index)
PIP_ARGS="${LABKIT_PIP_ARGS-"--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"}"
if ! "$PY" -c "import ensurepip, venv" >/dev/null 2>&1; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv
fi
if [ -n "${LABKIT_REUSE_SITE:-}" ]; then  # tests: see an existing environment's packages (pip too)
    "$PY" -m venv --without-pip "$ROOT/venv"
else
    "$PY" -m venv "$ROOT/venv"
fi
VPY="$ROOT/venv/bin/python"
SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ -n "${LABKIT_REUSE_SITE:-}" ]; then
    echo "$LABKIT_REUSE_SITE" > "$SITE/labkit-reuse-site.pth"
fi
# shellcheck disable=SC2086
"$VPY" -m pip install -q $PIP_ARGS -r "$SRC/requirements.txt"
rm -rf "$SITE/labkit"
cp -r "$SRC/labkit" "$SITE/labkit"
chmod -R a+rX "$ROOT/venv"
# the installed kit: root only. Every kernel imports the grader's copy, whose references are withheld until
# graded: bound into a file system of its own where the container allows namespaces, else (a container without
# CAP_SYS_ADMIN, a bundle built with --allow-partial-isolation) from PYTHONPATH, so this folder must stay shut
chown -R root:root "$SITE/labkit"
chmod 700 "$SITE/labkit"
(cd / && "$VPY" -c "import torch, labkit.grading.grader as g
print('labkit autograder: torch', torch.__version__, 'labkit', g.__file__)")
# the unprivileged user the submission's kernel runs as
id labkit-kernel >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin --user-group labkit-kernel
# hidden cases, and the whole bundle (the kit's full source, references included): root only
mkdir -p "$SRC/hidden"
chown -R root:root "$SRC"
chmod 700 "$SRC" "$SRC/hidden"
find "$SRC/hidden" -type f -exec chmod 600 {} +
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# labkit autograder: Gradescope runs this, as root, for each submission.
ROOT="${LABKIT_AUTOGRADER_ROOT:-/autograder}"
if [ ! -x "$ROOT/venv/bin/python" ]; then
    mkdir -p "$ROOT/results"
    MSG="The autograder is not set up (setup.sh did not finish); tell your instructor."
    echo "{\"score\": 0, \"output\": \"$MSG\", \"tests\": []}" > "$ROOT/results/results.json"
    echo "error: $ROOT/venv/bin/python is missing: setup.sh did not finish" >&2
    exit 1
fi
# the learner's name and e-mail, and their earlier submissions' results (hidden cases' outputs among them): root only
chmod 600 "$ROOT/submission_metadata.json" 2>/dev/null
cd "$ROOT"  # not a folder with another labkit in it: the venv's copy is graded with
exec "$ROOT/venv/bin/python" -m labkit.grading.autograder --root "$ROOT"
"""


def _problem(assignment: str, out: Path, hidden: Path | None, cell_timeout: float) -> str:
    from .registry import (
        HIDDEN_ENV,
        IMPORT_ERRORS,
        all_exercises,
        exercises_for_notebook,
        hidden_cases_problem,
        load_all,
        load_hidden_problem,
    )

    if hidden is not None:
        bad = hidden_cases_problem(hidden, f"--hidden-cases {hidden}")
        if bad:
            return bad
        saved = os.environ.get(HIDDEN_ENV)
        os.environ[HIDDEN_ENV] = str(hidden.resolve())
        try:
            bad = load_hidden_problem(str(hidden))
        finally:   # only for this check: the bundle carries the folder, the caller's environment stays its own
            if saved is None:
                os.environ.pop(HIDDEN_ENV, None)
            else:
                os.environ[HIDDEN_ENV] = saved
        if bad:
            return bad
    else:
        load_all()
    if IMPORT_ERRORS:
        m, e = sorted(IMPORT_ERRORS.items())[0]
        return f"exercise module {m} does not import ({e}): fix the kit before bundling it"
    if not exercises_for_notebook(assignment):
        known = sorted({ex.notebook for ex in all_exercises()})
        return f"assignment {assignment!r} has no exercises; choose one of {', '.join(known)}"
    if not cell_timeout > 0:
        return f"--cell-timeout must be a positive number of seconds, got {cell_timeout!r}"
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir() or not parent.is_dir():
        return f"--out {out}: give a .zip path in an existing folder"
    import tempfile
    try:   # tried, not judged from the mode bits: root writes where they say no, and a read-only mount refuses root
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"--out {out}: cannot write in its folder {parent} ({e.strerror or e})"
    return ""


def _add(z: zipfile.ZipFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
    info.external_attr = (0o100000 | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def build_bundle(assignment: str, out: Path, hidden: Path | None = None,
                 cell_timeout: float = DEFAULT_BUNDLE_CELL_TIMEOUT, hints: bool = True,
                 allow_partial_isolation: bool = False) -> Path:
    """Write the Gradescope bundle for ``assignment`` (a notebook name) to ``out``; returns ``out``.
    ``allow_partial_isolation``: the run side grades even where its self-check finds that kernels
    cannot be fully isolated (else it stops before grading, exit 2).

    Raises ValueError naming the problem (unknown assignment, missing hidden-case folder, ...)."""
    import labkit

    out = Path(out)
    problem = _problem(assignment, out, hidden, cell_timeout)
    if problem:
        raise ValueError(problem)
    pkg = Path(labkit.__file__).resolve().parent
    config = {"assignment": assignment, "cell_timeout": cell_timeout, "hints": bool(hints),
              "allow_partial_isolation": bool(allow_partial_isolation)}
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        _write_bundle(tmp, pkg, assignment, config, hidden)
        os.replace(tmp, out)
    except BaseException as e:   # a full disk, or Ctrl-C: no half-written bundle is left
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise BundleWriteError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    return out


class BundleWriteError(Exception):
    """The bundle could not be written (after the checks: a full disk); the message names the file."""


def _write_bundle(tmp: Path, pkg: Path, assignment: str, config: dict, hidden: Path | None) -> None:
    with zipfile.ZipFile(tmp, "w") as z:
        _add(z, "setup.sh", SETUP_SH.encode(), 0o755)
        _add(z, "run_autograder", RUN_AUTOGRADER.encode(), 0o755)
        _add(z, "requirements.txt", ("\n".join(RUNTIME_REQUIREMENTS) + "\n").encode())
        _add(z, CONFIG, (json.dumps(config, indent=2) + "\n").encode())
        for f in sorted(pkg.rglob("*")):
            # not the solved notebooks: the submission's kernel could read them (the learner one is added below)
            rel = f.relative_to(pkg)
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc" \
                    and rel.parts[0] not in ("_notebooks", "_solutions"):
                _add(z, "labkit/" + f.relative_to(pkg).as_posix(), f.read_bytes())
        learner = pkg / "_notebooks" / f"{assignment}.ipynb"
        if learner.is_file():  # the learner version as shipped (no secret): the grader reads its grading points
            _add(z, f"labkit/_notebooks/{assignment}.ipynb", learner.read_bytes())
        for f in sorted(hidden.glob("*.py")) if hidden is not None else []:
            _add(z, "hidden/" + f.name, f.read_bytes(), 0o600)


def _notebooks(folder: Path) -> list[Path]:
    """The .ipynb files uploaded (any depth; checkpoints and dot-folders left out)."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*.ipynb") if p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _rebuild(problem: str, config: dict, source: Path) -> str:
    """The self-check's refusal (:func:`~labkit.grading.session.isolation_problem`) with the fix an
    instructor can apply on Gradescope, whose container is not theirs to change: the command that
    rebuilds this bundle with ``--allow-partial-isolation``, and what grading here then gives and
    lacks, in the words of the isolation note for the kernel user the self-check just probed."""
    from .session import isolation_note, kernel_user

    cmd = ["python -m labkit autograder", config["assignment"], "--allow-partial-isolation"]
    if list((source / "hidden").glob("*.py")):
        cmd.append("--hidden-cases YOUR_CASES_FOLDER")
    if float(config.get("cell_timeout", DEFAULT_BUNDLE_CELL_TIMEOUT)) != DEFAULT_BUNDLE_CELL_TIMEOUT:
        cmd.append(f"--cell-timeout {config['cell_timeout']:g}")
    if not config.get("hints", True):
        cmd.append("--no-hints")
    then = isolation_note(kernel_user()).removeprefix("isolation is partial: ")  # probed: no new probe
    cause, _, fix = problem.partition(" Fix: ")
    full = fix.partition("; or pass --allow-partial-isolation")[0]
    return (f"{cause} Fix: rebuild the bundle with --allow-partial-isolation ({' '.join(cmd)} --out autograder.zip), "
            f"upload it and regrade; here it then grades with this weaker isolation: {then}. For full isolation "
            f"instead, on a machine whose container you configure: {full}")


def run(root: Path) -> int:
    """Grade ``root/submission`` for the bundle in ``root/source``; write ``root/results/results.json``.

    Returns 0 when the results are the submission's grade (whatever its score), 1 when the
    notebook could not be graded, 2 when the self-check at start finds that kernels cannot be
    isolated here (:func:`labkit.grading.session.isolation_problem`: one ``error:`` line with the
    cause and the fix, before anything of the submission runs)."""
    from .grader import (
        NotebookGrade,
        _exercise_grade,
        format_table,
        grade_paths,
        results_json,
        validate_results,
        write_results,
    )
    from .registry import HIDDEN_ENV, exercises_for_notebook, load_all

    t0 = time.monotonic()
    source = root / "source"
    config = json.loads((source / CONFIG).read_text())
    from .session import isolation_problem, place_problem

    allow = bool(config.get("allow_partial_isolation"))
    problem = place_problem()
    if not problem:
        problem = isolation_problem(allow_partial=allow)
        if problem and not allow and not isolation_problem(allow_partial=True):  # the flag waives it (probed once)
            problem = _rebuild(problem, config, source)
    if problem:  # before anything of the submission runs
        print(f"error: {problem}", file=sys.stderr)
        return 2
    assignment = config["assignment"]
    hidden = source / "hidden"
    if hidden.is_dir() and list(hidden.glob("*.py")):
        os.environ[HIDDEN_ENV] = str(hidden)
    load_all()
    found = _notebooks(root / "submission")
    want = f"{assignment}.ipynb"
    if len(found) == 1:
        grade = grade_paths([found[0]], float(config.get("cell_timeout", DEFAULT_BUNDLE_CELL_TIMEOUT)),
                            assignment=assignment, hints=bool(config.get("hints", True)))[0]
    else:
        if not found:
            why = f"no notebook (.ipynb) was uploaded: upload your {want}"
        else:
            names = ", ".join(p.relative_to(root / "submission").as_posix() for p in found)
            why = f"{len(found)} notebooks were uploaded ({names}): upload exactly one, your {want}; nothing was graded"
        grade = NotebookGrade(want, assignment, why)
        # the reason once, at the top of the results; each exercise points there
        grade.exercises = [_exercise_grade(ex, None, "not attempted: nothing was graded (see the message at the top)")
                           for ex in exercises_for_notebook(assignment)]
    print(format_table([grade]))  # instructor only (stdout_visibility: hidden)
    from .grader import _print_integrity

    _print_integrity([grade] if len(found) == 1 else [], assignment)  # instructor only too; never a score
    obj = results_json([grade], execution_time=time.monotonic() - t0)
    validate_results(obj)
    (root / "results").mkdir(parents=True, exist_ok=True)
    write_results(root / "results" / "results.json", obj)
    return 0 if grade.graded else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit autograder ASSIGNMENT --out autograder.zip [--hidden-cases DIR] [--cell-timeout S]
    [--no-hints]``; bad input ends with one ``error:`` line (exit 2)."""
    from ..cliparse import Parser
    from .grader import _seconds

    p = Parser(prog="python -m labkit autograder",
               description="Write a Gradescope autograder bundle (setup.sh, run_autograder, labkit) for one notebook.")
    p.add_argument("assignment", help="the notebook graded, e.g. 01_pipeline_bubble")
    p.add_argument("--out", type=Path, default=Path("autograder.zip"), help="the zip to write")
    p.add_argument("--hidden-cases", type=Path, default=None, help="a folder of hidden-case .py files to bundle")
    p.add_argument("--cell-timeout", default=str(DEFAULT_BUNDLE_CELL_TIMEOUT),
                   help="seconds one cell may run (keep the notebook under Gradescope's time limit)")
    p.add_argument("--no-hints", action="store_true", help="hold hints back in the graded results")
    p.add_argument("--allow-partial-isolation", action="store_true",
                   help="grade even where the run side's self-check finds that kernels cannot get full isolation "
                        "(a uid of their own, private namespaces, a file system of their own); without it the run "
                        "stops before grading with the cause and the fix (exit 2)")
    a = p.parse_args(argv)
    t = _seconds(a.cell_timeout)
    if t is None:
        print(f"error: --cell-timeout must be a positive number of seconds, got {a.cell_timeout!r}", file=sys.stderr)
        return 2
    try:
        out = build_bundle(a.assignment, a.out, a.hidden_cases, t, hints=not a.no_hints,
                           allow_partial_isolation=a.allow_partial_isolation)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BundleWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.hidden_cases is not None:
        from .registry import hidden_case_notebooks
        for_what = hidden_case_notebooks(a.hidden_cases)
        if a.assignment not in for_what:
            print(f"warning: none of the hidden cases in {a.hidden_cases} is for {a.assignment} (they are for "
                  f"{', '.join(sorted(for_what)) or 'no exercise'}): the bundle grades with the built-in cases only",
                  file=sys.stderr)
    print(f"wrote {out}: Gradescope autograder for {a.assignment} (cell timeout {t:g} s, hints "
          f"{'hidden' if a.no_hints else 'shown'}{', hidden cases bundled' if a.hidden_cases else ''}); upload it "
          f"as a zip autograder on Gradescope's default Ubuntu image")
    return 0


def _run_main(argv: list[str]) -> int:
    from ..cliparse import Parser

    p = Parser(prog="python -m labkit.grading.autograder")
    p.add_argument("--root", type=Path, default=Path(os.environ.get(ROOT_ENV, "/autograder")))
    root = p.parse_args(argv).root
    config = root / "source" / CONFIG
    try:   # the bundle's own file: a root (or LABKIT_AUTOGRADER_ROOT) without it is one line, not a traceback
        json.loads(config.read_text())
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        print(f"error: {config} cannot be read ({why}): --root (or {ROOT_ENV}) must be the folder the autograder "
              f"bundle was unpacked into (source/ holds {CONFIG})", file=sys.stderr)
        return 2
    return run(root)


if __name__ == "__main__":
    sys.exit(_run_main(sys.argv[1:]))
