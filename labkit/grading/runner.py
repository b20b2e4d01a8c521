"""Running an exercise's cases against an answer, and the verdict ``check`` prints.

Each case runs in a forked child process (fork keeps functions defined in a notebook usable):

* the child gets its own process group, so at the time limit the parent kills the child and
  every rank it launched (``labkit.dist.launch`` forks from it) with one ``killpg``;
* the child's stdout/stderr (Python objects and file descriptors 1/2) are redirected to
  /dev/null, so what the learner's code prints never reaches the notebook in random order;
* only a small picklable verdict travels back through a pipe: a status and a one-line
  message, never the learner's objects.

Statuses: ``passed``, ``failed``, ``not_attempted`` (the answer raised NotImplementedError,
i.e. it is still the stub; directly or inside a rank of ``launch``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch  # imported here, before any fork, so case children never pay for it

from ..dist import RankError
from .kernel import GRADING_ENV, _read_frame, _write_frame, kill_and_reap, register
from .proxy import Answer, CaseTimeout, KernelFailure, LocalBackend, ReferenceImplementationUsed, set_deadline
from .registry import Case, CheckFailure, Exercise, get_exercise

__all__ = ["CaseResult", "CheckResult", "run_case", "evaluate", "result_of", "format_line", "STRICT_ENV"]

STRICT_ENV = "LABKIT_STRICT"  # "1": check() raises when an exercise is not passed
SECOND_HINT_AFTER = 2  # failed check() calls of one exercise before its second hint (Exercise.hint2) shows
_FAILED_CHECKS: dict[str, int] = {}  # exercise id -> failed check() calls in this process
MAX_MESSAGE = 400  # characters of a case message shown in the verdict


@dataclass
class CaseResult:
    """Verdict of one case: ``status`` in passed | failed | not_attempted; one-line ``message``."""

    name: str
    hidden: bool
    status: str
    message: str = ""


@dataclass
class CheckResult:
    """What ``check`` returns: ``status`` (passed | failed | not_attempted), ``passed`` and
    ``total`` case counts, the printed ``message`` line, and per-case ``cases``.

    In a notebook the result displays nothing (``_ipython_display_``), so a ``check(...)``
    on a cell's last line adds no ``Out[...]`` line; ``repr`` is deterministic.
    """

    exercise: str
    status: str
    passed: int
    total: int
    message: str
    cases: list[CaseResult] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.status == "passed"

    def __repr__(self) -> str:
        return (f"CheckResult(exercise={self.exercise!r}, status={self.status!r}, passed={self.passed}, "
                f"total={self.total})")

    def _ipython_display_(self) -> None:  # the line was already printed by check()
        return None


def _one_line(text: str, limit: int = MAX_MESSAGE) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_BACKEND_NOISE = re.compile(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")
_STALLED = re.compile(r"timed out|timeout|connection closed|connection reset", re.I)


def _clean_backend_text(text: str) -> str:
    """First sentence of a gloo/NCCL message without the C++ source location."""
    text = _BACKEND_NOISE.sub("", " ".join(str(text).split()))
    cut = text.find(". This is typically")
    return text[:cut + 1] if cut >= 0 else text


def _verdict(exc: BaseException, timeout: float = 0.0) -> tuple[str, str]:
    """Map an exception raised by a case to (status, message)."""
    if isinstance(exc, CaseTimeout):
        return "failed", _time_limit_message(timeout)
    if isinstance(exc, ReferenceImplementationUsed):
        from .references import reference_message  # not at import: the graded kernel cannot read it

        return "failed", _one_line(reference_message(exc.name))
    if isinstance(exc, KernelFailure):
        return "failed", _one_line(str(exc))
    if isinstance(exc, NotImplementedError):
        return "not_attempted", _one_line(str(exc) or "NotImplementedError")
    if isinstance(exc, CheckFailure):
        return "failed", _one_line(str(exc))
    if isinstance(exc, RankError):
        if exc.exc_type == "NotImplementedError":
            return "not_attempted", _one_line(exc.original_message)
        if exc.exc_type == "CheckFailure":
            return "failed", _one_line(f"rank {exc.rank}: {exc.original_message}")
        text = _clean_backend_text(exc.original_message)
        if _STALLED.search(text):
            text += " (a send/recv or collective never completed: a deadlock, or a peer that stopped early)"
        return "failed", _one_line(f"rank {exc.rank} raised {exc.exc_type}: {text}")
    first = (str(exc).strip().splitlines() or [""])[0]
    return "failed", _one_line(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def _fmt_seconds(t: float) -> str:
    return f"{int(t)} s" if float(t).is_integer() else f"{t:g} s"


def _child(case: Case, backend_factory, exercise_id: str, references, wfd: int, timeout: float) -> None:
    """Body of the forked child: run the case, write (status, message) to ``wfd``, exit."""
    status, message = "failed", "the case process ended without a verdict"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
        torch.set_num_threads(1)  # a forked child can hang in threaded kernels otherwise
        set_deadline(time.monotonic() + timeout)
        try:
            case.fn(Answer(backend_factory(), exercise_id, references))
            status, message = "passed", ""
        except BaseException as e:  # noqa: BLE001 - every exception is a verdict
            status, message = _verdict(e, timeout)
    except BaseException as e:  # noqa: BLE001
        status, message = "failed", _one_line(f"grader error: {type(e).__name__}: {e}")
    try:
        _write_frame(wfd, json.dumps([status, message]).encode())
    finally:
        os._exit(0)


def _withheld_calls(exercise_id: str) -> tuple[str, ...]:
    """What the graded kernel lacks while ``exercise_id`` is graded (:func:`labkit.grading.withhold.withheld_calls`):
    an answer that calls one fails here as it would there, with a message saying so. () where that cannot be
    computed (the graded kernel's own copy of the kit holds no exercise modules)."""
    try:
        from .withhold import withheld_calls

        return withheld_calls(exercise_id)
    except Exception:  # noqa: BLE001 - feedback only: never the reason a check cannot run
        return ()


def run_case(case: Case, answer: Any, exercise: Exercise | None = None, backend_factory=None) -> CaseResult:
    """Run ``case`` in a forked child, stopped after ``case.timeout`` s.

    The case function gets an :class:`~labkit.grading.proxy.Answer`: by default its calls run
    ``answer`` in the child itself (:class:`~labkit.grading.proxy.LocalBackend`); the grader
    passes ``backend_factory`` (called in the child) to send them to the learner's kernel."""
    if backend_factory is None:
        backend_factory = lambda: LocalBackend(answer)  # noqa: E731
    ex_id = exercise.id if exercise is not None else ""
    refs = _withheld_calls(ex_id) if ex_id else ()
    # torch imports sympy lazily on the first ``backward(grad)`` / ``autograd.grad(..., grad)`` (about 1 s):
    # once here, inherited by every case's child, instead of once in each (as labkit.launch does for ranks)
    import torch.fx.experimental.symbolic_shapes  # noqa: F401
    rfd, wfd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        os.close(rfd)
        try:
            os.setpgid(0, 0)
        except OSError:
            pass
        _child(case, backend_factory, ex_id, refs, wfd, case.timeout)
    os.close(wfd)
    try:
        os.setpgid(pid, pid)  # both sides set it: no race with an early kill
    except OSError:
        pass
    deadline = time.monotonic() + case.timeout + 1.0  # the child stops its own calls at case.timeout
    try:
        data = _read_frame(rfd, deadline)
    except TimeoutError:
        return CaseResult(case.name, case.hidden, "failed", _time_limit_message(case.timeout))
    finally:
        os.close(rfd)
        kill_and_reap(pid)  # and every rank the case launched (its process group)
    try:
        status, message = json.loads(data.decode())
    except Exception:
        status, message = "failed", "the case process died before reporting (crashed or was killed)"
    return CaseResult(case.name, case.hidden, status, message)


def _time_limit_message(timeout: float) -> str:
    return f"did not finish within the time limit of {_fmt_seconds(timeout)} (stopped)"


def evaluate(exercise_id: str, answer: Any, stop_at_first_failure: bool = False, backend_factory=None,
             go_on=None, deadline: float | None = None, only=None) -> CheckResult:
    """Run every case of ``exercise_id`` against ``answer``; return a :class:`CheckResult`.

    Prints nothing and never raises for a wrong answer (KeyError for an unknown id). Once a case
    finds the stub (NotImplementedError) the rest are not run ("not attempted"); with
    ``stop_at_first_failure`` neither are those after the first failing public case. The grader's
    arguments: ``backend_factory(case)`` returns what makes, in the case's process, the backend that
    reaches the learner's kernel; ``go_on(result)`` after a failed case may return False to skip the
    rest (the kernel stopped answering); ``deadline`` (``time.monotonic()``) cuts each case's limit
    to the time left, and the cases it leaves no time for fail as "not run"; ``only(case)`` selects
    the cases that run (the instructor's secret cases run in a pass of their own).
    """
    ex = get_exercise(exercise_id)
    results: list[CaseResult] = []
    chosen = [c for c in ex.cases if only is None or only(c)]
    for i, case in enumerate(chosen):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < 0.5:
                results += [CaseResult(c.name, c.hidden, "failed", "not run: the submission's time budget ran out")
                            for c in chosen[i:]]
                break
            if left < case.timeout:
                case = dataclasses.replace(case, timeout=left)
        r = run_case(case, answer, ex, None if backend_factory is None else backend_factory(case))
        results.append(r)
        if r.status == "not_attempted":
            results += [CaseResult(c.name, c.hidden, "not_attempted", "not run: the stub raises NotImplementedError")
                        for c in chosen[i + 1:]]
            break
        if r.status == "failed" and go_on is not None and not go_on(r):
            results += [CaseResult(c.name, c.hidden, "failed", "not run: the learner's kernel stopped answering")
                        for c in chosen[i + 1:]]
            break
        # a failing hidden case does not stop the run: its line says how many cases passed
        if r.status == "failed" and stop_at_first_failure and not case.hidden:
            results += [CaseResult(c.name, c.hidden, "failed", "not run (an earlier case failed)")
                        for c in chosen[i + 1:]]
            break
    return result_of(ex, results, len(chosen))


def result_of(ex: Exercise, cases: list[CaseResult], total: int) -> CheckResult:
    """The :class:`CheckResult` of ``ex`` from its case results (``total`` cases asked for): not
    attempted when one found the stub, passed when all ``total`` passed, else failed."""
    passed = sum(r.status == "passed" for r in cases)
    status = ("not_attempted" if any(r.status == "not_attempted" for r in cases) else
              "passed" if passed == total else "failed")
    res = CheckResult(ex.id, status, passed, total, "", cases)
    res.message = format_line(ex, res)
    return res


def format_line(ex: Exercise, res: CheckResult, failures: int = 1, hints: bool = True) -> str:
    """The deterministic text ``check`` prints for ``res``: one line when the exercise passed or is not
    attempted; for a failure the verdict, the case, what was checked, the expected/got and each hint
    on lines of their own (issue 36: a failure was one unbroken 6-line paragraph)::

        Exercise 1.1 (bubble fraction): failed
          case "K=4, M=8"
          bubble_fraction(K=4, M=8):
          expected 0.272727, got 0.25; got 0.9167 x the expected value.
          Hint: ...
          Second hint: ...

    From the ``SECOND_HINT_AFTER``-th failure of the exercise (``failures``) the exercise's second hint
    follows the first; ``hints=False`` leaves out the hints (a graded run that holds hints back:
    ``grade --no-hints``)."""
    if not ex.cases:
        return f"{ex.label}: no cases are registered for this exercise."
    if res.status == "passed":
        return f"{ex.label}: passed, {res.total}/{res.total} cases."
    if res.status == "not_attempted":
        return f"{ex.label}: not attempted (the stub still raises NotImplementedError)."
    first = next(r for r in res.cases if r.status == "failed")
    case = next((c for c in ex.cases if c.name == first.name), None)
    text = case.hint if case is not None and case.hint is not None else ex.hint
    hint = [f"  Hint: {text}"] if text and hints else []
    second = getattr(ex, "hint2", "")
    if second and hints and failures >= SECOND_HINT_AFTER:
        hint.append(f"  Second hint: {second}")
    if first.hidden:
        counts = f"{res.passed} of {res.total} cases passed"
        what = f"a hidden case failed ({counts}; its details are not shown)."
        if "time limit" in first.message:
            what = f"a hidden case failed ({counts}): {first.message}."
        return "\n".join([f"{ex.label}: failed", f"  {what}"] + hint)
    msg = first.message.rstrip(".")
    body = [f"  {msg}."]
    cut = msg.find(": expected ")
    if cut > 0:
        body = [f"  {msg[:cut]}:", f"  {msg[cut + 2:]}."]
    return "\n".join([f"{ex.label}: failed", f"  case \"{first.name}\""] + body + hint)


class CheckNotPassed(AssertionError):
    """Raised by ``check`` under ``LABKIT_STRICT=1`` when an exercise is not passed."""


def check(exercise_id: str, answer: Any) -> CheckResult:
    """Check ``answer`` against exercise ``exercise_id`` and print its verdict (:func:`format_line`);
    the cases stop at the first failing public one. Returns a :class:`CheckResult` that displays
    nothing in a notebook; never raises for a wrong answer (KeyError for an unknown id), unless
    ``LABKIT_STRICT=1``: then anything but "passed" raises :class:`CheckNotPassed` (CI runs
    solutions/ this way). From the second failed ``check`` of an exercise in this process the line
    adds its second hint. In a kernel started by ``python -m labkit grade`` (``LABKIT_GRADING=1``)
    nothing is judged here: the answer is only registered, and the line says "recorded for grading".
    """
    if os.environ.get(GRADING_ENV) == "1":
        # the kernel may not know the exercise (hidden-case files declare some): register by id
        register(str(exercise_id), answer)
        res = CheckResult(str(exercise_id), "recorded", 0, 0, f"Exercise {exercise_id}: recorded for grading.")
        print(res.message, flush=True)
        return res
    ex = get_exercise(exercise_id)
    from .fresh import reproducible

    with reproducible():  # feedback: the same line every run (the grader draws fresh inputs)
        res = evaluate(ex.id, answer, stop_at_first_failure=True)
    if res.status == "failed":  # a learner who failed this exercise before also gets its second hint
        _FAILED_CHECKS[ex.id] = _FAILED_CHECKS.get(ex.id, 0) + 1
        res.message = format_line(ex, res, _FAILED_CHECKS[ex.id])
    print(res.message, flush=True)
    if os.environ.get(STRICT_ENV, "") not in ("", "0") and res.status != "passed":
        raise CheckNotPassed(res.message)
    return res
