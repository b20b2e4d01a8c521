"""Exercise registry: what each exercise is and the cases that judge an answer.

Exercise modules live in ``labkit/grading/exercises/nbNN_topic.py`` (one per notebook; every
module in that package is imported by :func:`load_all`). A module declares its exercises::

    from labkit.grading.registry import exercise, CheckFailure, expect_equal, expect_close

    ex = exercise("1.1", title="bubble fraction", notebook="01_pipeline_bubble", points=2,
                  hint="Count the time slots of one stage: in how many does it wait?")
    ex.hint2 = "Does the count depend on which stage you pick?"   # after repeated failed checks

    @ex.case("K=4, M=8")                      # public case: its details are shown on failure
    def _(answer):                            # answer: a proxy for what check("1.1", ...) got
        expect_close(answer(4, 8), 3 / 11, "bubble_fraction(4, 8)")

    @ex.case("K=8, M=3", hidden=True, timeout=20)   # hidden: a failure says only "a hidden case"
    def _(answer): ...

Authoring format (the case runs in the GRADER, the answer in the LEARNER's kernel)
---------------------------------------------------------------------------------
A case has three parts: inputs (chosen in the case), a call made where the learner's code is,
and a judgement made in the case. ``answer`` is a :class:`~labkit.grading.proxy.Answer`:

* ``answer(*args, **kwargs)`` calls the learner's function with (copies of) ``args`` and
  returns its result as DATA (:mod:`labkit.grading.wire`: numbers, strings, lists, tuples,
  dicts, tensors, numpy arrays, ``Action``...). An exception raised by the learner's code comes
  back with its name (``expect_raises(ValueError, answer, 4, 0)`` works), and
  ``NotImplementedError`` still means "not attempted". Objects that are not data (a class, a
  module, a function) come back as placeholders that only say their type's name.
* ``answer.run(fn, *args, **kwargs)`` runs ``fn(learner_answer, *args, **kwargs)`` next to the
  learner's code and returns its result as data. ``fn`` must be a TOP-LEVEL function of a
  labkit module (it is imported by name there). Use it when the answer is a class
  (``answer.apply``), a function to run on ranks (``launch(body, N, answer)``), or when the
  check needs autograd through the learner's result. ``fn`` must return only what the learner's
  code produced (outputs, gradients); it must never compute or receive an expected value:
  compute those in the case, after the call. Nor may a verdict rest on anything ``fn``
  measures about how the answer worked (a count of sends, a flag): the learner can replace
  ``fn``. To judge how data moves between ranks, run them through a
  :class:`labkit.grading.relay.Relay` in the case and judge its log.

So a case that today calls ``answer`` and compares numbers stays as it is; one that touches
the answer's attributes or runs it on ranks moves that part into a top-level kernel-side
function::

    def _ring_outputs(ring_all_reduce, inputs):          # runs in the kernel
        return launch(_ring_rank, len(inputs), ring_all_reduce, inputs)

    @ex.case("N=4 ranks")
    def _(answer):                                        # runs in the grader
        inputs = _inputs(4, 16)
        for r, out in enumerate(answer.run(_ring_outputs, inputs)):
            expect_close(out, sum(inputs), f"rank {r}")

Interactive ``check`` (a notebook, pytest) runs the same cases with the answer in the same
process (every call still makes the data round trip), so its verdicts are the grader's.
An exercise may list the labkit functions it asks the learner to write:
``exercise(..., references=[gpipe_schedule])`` (or ``"module:qualname"`` strings; the central
table is :mod:`labkit.grading.references`).

A case passes when it returns; it fails when it raises :class:`CheckFailure` (the ``expect_*``
helpers raise it with "what: expected X, got Y") or any other exception (reported with its type
and first line). A case whose answer raises ``NotImplementedError`` (the learner stub) makes the
exercise "not attempted". Each case runs in a forked child and is stopped after ``timeout``
seconds (default :data:`DEFAULT_TIMEOUT`), including the time of the learner's calls. A case may
carry its own ``hint=``, shown instead of the exercise's when it is the first to fail; ``ex.hint2``
follows the first hint from the second failed ``check``. Points are all or nothing per exercise.

Writing exercises, hints and cases, step by step: ``docs/authoring.md``. Hidden case files
(``LABKIT_HIDDEN_CASES``, read by :func:`load_all`): ``docs/instructors.md``; a file there looks up an
exercise by id (``exercise("1.1")``) and adds cases, hidden unless ``hidden=False``; a case with
the name of an earlier one replaces it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import math
import numbers
import os
import pkgutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = [
    "CheckFailure",
    "Case",
    "Exercise",
    "exercise",
    "get_exercise",
    "all_exercises",
    "exercises_for_notebook",
    "load_all",
    "expect_equal",
    "expect_close",
    "expect_true",
    "expect_raises",
    "explain_index_errors",
    "as_int",
    "type_name",
    "expect_named",
    "DEFAULT_TIMEOUT",
]

DEFAULT_TIMEOUT = 10.0  # seconds one case may run before it is stopped and failed
HIDDEN_ENV = "LABKIT_HIDDEN_CASES"

_REGISTRY: dict[str, "Exercise"] = {}
IMPORT_ERRORS: dict[str, str] = {}  # exercise module -> the error its import raised
_LOADED = False
_ADDING_HIDDEN = False  # True while a hidden-case file runs: its cases default to hidden


class CheckFailure(AssertionError):
    """Raised by a case (or an ``expect_*`` helper) when the answer is wrong.

    The message is shown to the learner for public cases, so make it say what was checked,
    what was expected and what came back.
    """


@dataclass
class Case:
    """One test of an exercise: ``fn(answer)`` raises when the answer is wrong."""

    name: str
    fn: Callable[[Any], Any]
    hidden: bool = False
    timeout: float = DEFAULT_TIMEOUT
    hint: str | None = None  # replaces the exercise's hint when this case is the one that failed
    secret: bool = False  # from an instructor's hidden-case file: graded in a fresh kernel after the visible results


@dataclass
class Exercise:
    """An exercise of a notebook: id "N.k", title, notebook stem, points, hint and cases."""

    id: str
    title: str
    notebook: str
    points: float = 1.0
    hint: str = ""
    hint2: str = ""  # a more specific second hint, shown after repeated failed checks (runner.check)
    # the verdict of a person-like review of hint and hint2 against the solution ("leads: ...; reviewed
    # <date>"); never shown to the learner (tests/grading/test_grading_hints.py checks every exercise has one)
    hint_review: str = ""
    cases: list[Case] = field(default_factory=list)
    references: list[str] = field(default_factory=list)  # "module:qualname" the learner must not call

    def reference_names(self) -> list[str]:
        """Labkit functions this exercise asks the learner to write (its own list and the table's)."""
        from .references import references_for

        names = list(self.references)
        return names + [n for n in references_for(self.id) if n not in names]

    def case(self, name: str, hidden: bool | None = None, timeout: float | None = None,
             hint: str | None = None):
        """Decorator registering ``fn(answer)`` as a case named ``name``.

        ``hidden`` defaults to False (True inside a hidden-case file); ``timeout`` in seconds
        defaults to :data:`DEFAULT_TIMEOUT`; ``hint``, when given, is shown instead of the
        exercise's hint when this case is the first one that fails.
        """
        if hidden is None:
            hidden = _ADDING_HIDDEN
        t = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        if not (t > 0 and math.isfinite(t)):
            raise ValueError(f"case {name!r} of exercise {self.id}: timeout must be > 0 s, got {timeout!r}")

        def register(fn):
            new = Case(str(name), fn, bool(hidden), t, None if hint is None else str(hint),
                       secret=_ADDING_HIDDEN and bool(hidden))
            for i, c in enumerate(self.cases):
                if c.name == new.name:
                    self.cases[i] = new
                    break
            else:
                self.cases.append(new)
            return fn

        return register

    @property
    def label(self) -> str:
        return f"Exercise {self.id} ({self.title})" if self.title else f"Exercise {self.id}"


def _ref_name(r) -> str:
    if isinstance(r, str):
        if ":" not in r:
            raise ValueError(f"reference {r!r}: write it as 'module:qualname'")
        return r
    return f"{r.__module__}:{r.__qualname__}"


def exercise(id: str, title: str | None = None, notebook: str | None = None,
             points: float | None = None, hint: str | None = None, references=None) -> Exercise:
    """Declare exercise ``id`` (e.g. "1.1") or, with the id alone, return the existing one.

    Declaring an id again with the same notebook updates its title/points/hint and keeps its
    cases (so a module may be re-imported). Raises ValueError when the id alone names no
    exercise, when a new exercise lacks ``notebook``, or when the id is already used by
    another notebook.
    """
    id = str(id)
    ex = _REGISTRY.get(id)
    refs = [_ref_name(r) for r in references or ()]
    if title is None and notebook is None and points is None and hint is None and not refs:
        if ex is None:
            _ensure_loaded_for_lookup()
            ex = _REGISTRY.get(id)
        if ex is None:
            raise ValueError(f"no exercise {id!r} is registered (known: {', '.join(sorted(_REGISTRY)) or 'none'})")
        return ex
    if ex is not None:
        if notebook is not None and notebook != ex.notebook:
            raise ValueError(
                f"exercise {id!r} is already declared by notebook {ex.notebook!r}, not {notebook!r}")
        if title is not None:
            ex.title = title
        if points is not None:
            ex.points = float(points)
        if hint is not None:
            ex.hint = hint
        ex.references += [r for r in refs if r not in ex.references]
        return ex
    if not notebook:
        raise ValueError(f"exercise {id!r}: a new exercise needs notebook='NN_topic'")
    if points is not None and not points >= 0:
        raise ValueError(f"exercise {id!r}: points must be >= 0, got {points!r}")
    ex = Exercise(id, title or "", notebook, 1.0 if points is None else float(points), hint or "", references=refs)
    _REGISTRY[id] = ex
    return ex


def _ensure_loaded_for_lookup() -> None:
    # A hidden-case file runs during load_all (modules already imported); a direct call
    # from elsewhere triggers the load.
    if not _LOADED and not _ADDING_HIDDEN:
        load_all()


def _sort_key(ex_id: str):
    parts = []
    for p in ex_id.split("."):
        parts.append((0, int(p), "") if p.isdigit() else (1, 0, p))
    return parts


def load_all(reload_hidden: bool = False) -> dict[str, Exercise]:
    """Import every exercise module, then run the hidden-case files; return the registry.

    Idempotent: later calls return the registry unless ``reload_hidden`` (then hidden-case
    files run again, e.g. after ``LABKIT_HIDDEN_CASES`` changed).
    """
    global _LOADED, _ADDING_HIDDEN
    if _LOADED and not reload_hidden:
        return _REGISTRY
    from . import exercises as pkg

    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        # One broken exercise module must not break the checks of every other notebook:
        # its error is kept and shown when one of its exercises is looked up.
        try:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception as e:  # noqa: BLE001
            IMPORT_ERRORS[info.name] = f"{type(e).__name__}: {e}"
    _LOADED = True
    folders = [Path(__file__).parent / "hidden"]
    folders += [Path(p) for p in os.environ.get(HIDDEN_ENV, "").split(os.pathsep) if p]
    for folder in folders:
        if not folder.is_dir():
            if folder.name != "hidden" or folder.parent != Path(__file__).parent:
                raise FileNotFoundError(f"{HIDDEN_ENV} names {str(folder)!r}, which is not a folder")
            continue
        for path in sorted(folder.glob("*.py")):
            if path.name.startswith("_"):
                continue
            _run_hidden_file(path)
    return _REGISTRY


def hidden_cases_problem(folder: Path | str, label: str) -> str | None:
    """Why ``folder`` cannot be a folder of hidden cases (missing, a file, no ``.py`` case file),
    as one message starting with ``label`` (``"--hidden-cases X"``, ``"LABKIT_HIDDEN_CASES=X"``);
    None when it can. The one check of ``grade`` (the variable) and ``autograder --hidden-cases``."""
    folder = Path(folder)
    if not folder.exists():
        return f"{label}: no such folder"
    if not folder.is_dir():
        return f"{label} is not a folder (a file): give the folder that holds the hidden-case .py files"
    if not any(p.is_file() and not p.name.startswith("_") for p in folder.glob("*.py")):
        return f"{label}: the folder holds no .py case files (files named _*.py are helpers, not run)"
    return None


def load_hidden_problem(label: str) -> str | None:
    """:func:`load_all` with the hidden cases run again; the message when one of them does not
    load (a syntax error, a case that raises), naming the file, else None."""
    try:
        load_all(reload_hidden=True)
    except Exception as e:  # noqa: BLE001 - an instructor's case file: one line, not its traceback
        where = ""
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename not in (__file__,) and "importlib" not in tb.tb_frame.f_code.co_filename:
                where = f" ({tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno})"
            tb = tb.tb_next
        if isinstance(e, SyntaxError):
            where = f" ({e.filename}, line {e.lineno})"
            e = SyntaxError(e.msg)
        return f"the hidden cases in {label} do not load: {type(e).__name__}: {e}{where}"
    return None


def _hidden_module(path: Path) -> str:
    return f"labkit_hidden_cases_{abs(hash(str(Path(path).resolve())))}"


def hidden_case_notebooks(folder: Path | str) -> dict[str, int]:
    """{notebook: number of cases} that the hidden-case files in ``folder`` added to the registry (after
    :func:`load_all` ran them), e.g. to warn when none is for the assignment being bundled."""
    modules = {_hidden_module(p) for p in Path(folder).glob("*.py") if not p.name.startswith("_")}
    out: dict[str, int] = {}
    for ex in _REGISTRY.values():
        n = sum(getattr(c.fn, "__module__", None) in modules for c in ex.cases)
        if n:
            out[ex.notebook] = out.get(ex.notebook, 0) + n
    return out


def _run_hidden_file(path: Path) -> None:
    global _ADDING_HIDDEN
    name = _hidden_module(path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # cases defined there stay picklable/inspectable
    _ADDING_HIDDEN = True
    try:
        spec.loader.exec_module(module)
    finally:
        _ADDING_HIDDEN = False


def get_exercise(id: str) -> Exercise:
    """The registered exercise ``id``; raises KeyError naming the known ids."""
    load_all()
    try:
        return _REGISTRY[str(id)]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY, key=_sort_key)) or "none"
        broken = "".join(f"; exercise module {m} failed to import ({err})" for m, err in sorted(IMPORT_ERRORS.items()))
        raise KeyError(f"no exercise {id!r}; known exercises: {known}{broken}") from None


def all_exercises() -> list[Exercise]:
    """Every registered exercise, ordered by id."""
    load_all()
    return [_REGISTRY[k] for k in sorted(_REGISTRY, key=_sort_key)]


def exercises_for_notebook(notebook: str) -> list[Exercise]:
    """The exercises of notebook ``notebook`` (its stem, e.g. "01_pipeline_bubble"), by id."""
    return [ex for ex in all_exercises() if ex.notebook == notebook]


# ----------------------------------------------------------------------------- expectations


def _num(v: Any) -> str:
    """A number as the learner would write it: 6 significant digits for floats."""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, complex):
        return f"{v:.6g}"
    return str(v)


def _short(x: Any, limit: int = 120) -> str:
    """A short, deterministic text for ``x``: a 0-d tensor (or one-element NumPy array) is shown as
    its number, a small tensor by its values, a large one by shape and dtype."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            if x.dim() == 0:
                return _num(x.item())
            if x.numel() <= 6:
                vals = x.detach().cpu().reshape(-1).tolist()
                body = ", ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in vals)
                return f"tensor([{body}]" + (f", shape={tuple(x.shape)})" if x.dim() != 1 else ")")
            return f"tensor of shape {tuple(x.shape)}, dtype={str(x.dtype).replace('torch.', '')}"
    except ImportError:  # pragma: no cover
        pass
    if type(x).__module__ == "numpy" and hasattr(x, "item") and getattr(x, "size", 2) == 1 \
            and getattr(x, "ndim", 1) == 0:
        return _num(x.item())  # a NumPy scalar
    text = _num(x) if isinstance(x, (float, complex)) else repr(x)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


_SHOWN_TYPES = {"str": "str", "bytes": "bytes", "list": "list", "tuple": "tuple", "dict": "dict", "set": "set",
                "frozenset": "frozenset", "ndarray": "NumPy array"}


def _is_number(x: Any) -> bool:
    return x is None or isinstance(x, (bool, numbers.Number))


def _shown(x: Any) -> str:
    """How a value the LEARNER's code returned appears in a visible message: numbers, booleans,
    None, tensors (shown by :func:`_short`: small ones by value, others by shape) and short flat
    lists of numbers as values; anything else (text, objects, nested or long containers) by type
    and size only, so a message never echoes arbitrary text the learner's code chose (issue 16:
    an input the kernel saw must not come back in a visible result)."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return _short(x)
    except ImportError:  # pragma: no cover
        pass
    if _is_number(x):
        return _short(x)
    if isinstance(x, (list, tuple)) and len(x) <= 8 and all(_is_number(v) for v in x):
        return _short(x)
    if type(x).__module__ == "numpy" and getattr(x, "ndim", 1) == 0:
        return _short(x)
    if isinstance(x, str) and type(x) is not str:   # wire.LearnerText: a short word as it is, else its length
        return repr(x) if not repr(x).startswith("<") else f"a str of length {len(x)}"
    kind = _SHOWN_TYPES.get(type(x).__name__) if type(x).__module__ in ("builtins", "numpy") else None
    if kind is None:
        return "an object that is not data (not a number, tensor or container)"
    if kind == "NumPy array":
        return f"a NumPy array of shape {tuple(x.shape)}"
    if kind in ("str", "bytes"):
        return f"a {kind} of length {len(x)}"
    return f"a {kind} of {len(x)} {'keys' if kind == 'dict' else 'items'}"


def as_int(x: Any) -> int | None:
    """``x`` as a Python ``int`` when it is an integer of any kind: a Python int, a NumPy integer
    scalar or 0-d integer array, a 0-d integer tensor; ``None`` for anything else (a bool, a float,
    even a whole one, a tensor with more than one element). Exercises that ask for an int accept
    what this accepts (issue 36: the right pairs built from NumPy ints were refused)."""
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return None
    if isinstance(x, numbers.Integral):  # int and NumPy integer scalars
        return int(x)
    try:
        import torch

        if isinstance(x, torch.Tensor):
            if x.dim() == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
                return int(x.item())
            return None
    except ImportError:  # pragma: no cover
        pass
    if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0 and getattr(x, "dtype", None) is not None \
            and x.dtype.kind in "iu":
        return int(x.item())
    return None


def type_name(x: Any) -> str:
    """The kind of ``x`` in a few words for a message that says a value has the wrong type:
    "float 2.5", "bool", "a float32 tensor of shape (3,)", "NumPy float64 2.5", "str"; never the
    value of a text (see :func:`_shown`)."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            dt = str(x.dtype).replace("torch.", "")
            return f"a 0-d {dt} tensor ({_short(x)})" if x.dim() == 0 else f"a {dt} tensor of shape {tuple(x.shape)}"
    except ImportError:  # pragma: no cover
        pass
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return f"bool {bool(x)}"
    if type(x).__module__ == "numpy":
        if getattr(x, "ndim", None) == 0:
            return f"NumPy {x.dtype} {_short(x)}"
        if hasattr(x, "shape"):
            return f"a NumPy {x.dtype} array of shape {tuple(x.shape)}"
    if isinstance(x, float):
        return f"float {_num(x)}"
    if _is_number(x):
        return f"{type(x).__name__} {_short(x)}"
    return _shown(x)


def expect_named(got: Any, expected: Any, what: str, mistakes, rtol: float = 1e-9, atol: float = 1e-12) -> None:
    """``got`` must be ``expected`` (numbers: within ``rtol``/``atol``; anything else: equal). When it is
    not, and it equals the value of a known mistake, the failure says which: ``mistakes`` is a list of
    ``(value, "what this mistake did")``, a match named as "what: expected X, got Y (mistake)" (two that give
    the same value here: "(one; or the other)");
    otherwise as :func:`expect_close` / :func:`expect_equal` would say it."""
    def same(a, b):
        if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, numbers.Real) \
                and not isinstance(a, bool):
            return math.isclose(float(a), float(b), rel_tol=rtol, abs_tol=atol)
        try:
            return bool(a == b)
        except Exception:  # noqa: BLE001
            return False

    if same(got, expected):
        return
    found = list(dict.fromkeys(text for value, text in mistakes if not same(value, expected) and same(got, value)))
    if found:  # two mistakes that give the same value here are both named
        raise CheckFailure(f"{what}: expected {_shown(expected)}, got {_shown(got)} ({'; or '.join(found[:2])})")
    if isinstance(expected, (int, float)) and not isinstance(expected, bool):
        _compare(got, expected, what, exact=False, rtol=rtol, atol=atol)
    _compare(got, expected, what, exact=True, rtol=0.0, atol=0.0)


def expect_true(cond: Any, message: str) -> None:
    """Raise :class:`CheckFailure` with ``message`` unless ``cond`` is true."""
    if not cond:
        raise CheckFailure(message)


def expect_equal(got: Any, expected: Any, what: str = "result") -> None:
    """``got == expected`` exactly (tensors: same shape, dtype and values; containers element-wise).

    Raises :class:`CheckFailure` "what: expected X, got Y". Numbers and 0-d tensors are shown as
    numbers; tensors of up to 6 elements by their values; larger tensors of the same shape by how
    they differ: "tensors of shape S differ in n of N elements; largest difference d at index
    [i, j]: expected a, got b; around it: expected [...], got [...]" and, when ``got`` is a constant
    multiple c of ``expected``, "; got c x the expected values, everywhere".
    """
    _compare(got, expected, what, exact=True, rtol=0.0, atol=0.0)


def expect_close(got: Any, expected: Any, what: str = "result", rtol: float = 1e-5,
                 atol: float = 1e-6) -> None:
    """``|got - expected| <= atol + rtol * |expected|`` for numbers and tensors (fp32 defaults).

    Containers (list/tuple/dict) are compared element-wise. Raises :class:`CheckFailure` with the
    message described in :func:`expect_equal` (an element differs when it is not within the
    tolerance; NaN always differs).
    """
    _compare(got, expected, what, exact=False, rtol=rtol, atol=atol)


def _compare(got, expected, what, exact, rtol, atol) -> None:
    import torch

    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise CheckFailure(f"{what}: expected a tensor, got {_shown(got)}")
        if tuple(got.shape) != tuple(expected.shape):
            raise CheckFailure(f"{what}: expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}")
        if exact:
            if got.dtype != expected.dtype:
                raise CheckFailure(f"{what}: expected dtype {expected.dtype}, got {got.dtype}")
            ok = torch.equal(got, expected)
        else:
            ok = torch.allclose(got.detach().double().cpu(), expected.detach().double().cpu(),
                                rtol=rtol, atol=atol)
        if not ok:
            if got.numel() <= 1:
                raise CheckFailure(f"{what}: expected {_short(expected)}, got {_shown(got)}"
                                   + (_scalar_factor(got.item(), expected.item()) if got.numel() else ""))
            if got.numel() <= 6:
                raise CheckFailure(f"{what}: expected {_short(expected)}, got {_shown(got)}"
                                   + _first_difference(got, expected) + _tensor_factor(got, expected))
            raise CheckFailure(f"{what}: {_how_tensors_differ(got, expected, exact, rtol, atol)}")
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            raise CheckFailure(f"{what}: expected a {type(expected).__name__} of {len(expected)} items, "
                               f"got {_shown(got)}")
        if len(got) != len(expected):
            raise CheckFailure(f"{what}: expected {len(expected)} items, got {len(got)}")
        for i, (g, e) in enumerate(zip(got, expected)):
            _compare(g, e, f"{what}[{i}]", exact, rtol, atol)
        return
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            raise CheckFailure(f"{what}: expected a dict, got {_shown(got)}")
        if set(got) != set(expected):
            missing = sorted(map(str, set(expected) - set(got)))
            extra = len(set(got) - set(expected))
            raise CheckFailure(f"{what}: expected keys {sorted(map(str, expected))}, got {len(got)} keys"
                               + (f"; missing {missing}" if missing else "") + (f"; {extra} other(s)" if extra else ""))
        for k in expected:
            _compare(got[k], expected[k], f"{what}[{k!r}]", exact, rtol, atol)
        return
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and isinstance(got, torch.Tensor) \
            and got.numel() == 1 and not exact:
        got = got.item()
    if isinstance(expected, (int, float)) and not isinstance(expected, bool) and not exact:
        if not isinstance(got, numbers.Real) or isinstance(got, bool):  # numpy scalars count
            raise CheckFailure(f"{what}: expected a number close to {_short(expected)}, got {_shown(got)}")
        if not math.isclose(float(got), expected, rel_tol=rtol, abs_tol=atol):
            raise CheckFailure(f"{what}: expected {_short(expected)}, got {_shown(got)}{_scalar_factor(got, expected)}")
        return
    if type(got) is bool and type(expected) is not bool or type(expected) is bool and type(got) is not bool:
        raise CheckFailure(f"{what}: expected {_short(expected)}, got {_shown(got)}")
    if got != expected:
        raise CheckFailure(f"{what}: expected {_short(expected)}, got {_shown(got)}{_scalar_factor(got, expected)}")


def _scalar_factor(got, expected) -> str:
    """'; got c x the expected value' for two numbers, as for tensors (a loss not divided by M, a bias counted t
    times): always for floats; for two ints only when c or 1/c is a whole number (else it says nothing)."""
    real = lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)  # noqa: E731
    if not (real(got) and real(expected)) or expected == 0 or got == 0:
        return ""
    g, e = float(got), float(expected)
    if not (math.isfinite(g) and math.isfinite(e)):
        return ""
    c = g / e
    if abs(c - 1) <= 1e-3:
        return ""
    if isinstance(got, numbers.Integral) and isinstance(expected, numbers.Integral):
        whole = lambda v: abs(v - round(v)) < 1e-9 and abs(round(v)) >= 2  # noqa: E731
        if not (whole(c) or whole(1 / c)):
            return ""
    return f"; got {c:.4g} x the expected value"


def _tensor_factor(got, expected) -> str:
    """'; got c x the expected values, everywhere' when the (small) tensor ``got`` is a constant multiple of
    ``expected``."""
    import torch

    try:
        gd, ed = got.detach().double().cpu(), expected.detach().double().cpu()
        denom = float((ed * ed).sum())
        if denom > 0 and torch.isfinite(gd).all():
            ratio = float((gd * ed).sum()) / denom
            if abs(ratio - 1) > 1e-3 and torch.allclose(gd, ratio * ed, rtol=1e-4, atol=1e-7):
                return f"; got {_num(round(ratio, 4))} x the expected values, everywhere"
    except (RuntimeError, TypeError):
        pass
    return ""


def _how_tensors_differ(got, expected, exact: bool, rtol: float, atol: float) -> str:
    """Text for two same-shape tensors that differ: how many elements, the largest difference and
    where, a few values of each, and the factor when ``got`` is a multiple of ``expected``."""
    import torch

    g, e = got.detach().cpu(), expected.detach().cpu()
    shape = tuple(e.shape)
    try:
        gd, ed = g.double(), e.double()
    except (RuntimeError, TypeError):  # e.g. complex: compare as they are
        gd, ed = g, e
    if exact:
        bad = gd != ed
        bad = bad & ~(torch.isnan(gd) & torch.isnan(ed)) if gd.is_floating_point() else bad
    else:
        bad = ~torch.isclose(gd, ed, rtol=rtol, atol=atol)
    diff = (gd - ed).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    diff = torch.where(bad, diff, torch.zeros_like(diff))
    flat = int(torch.argmax(diff.reshape(-1)))
    pos = [int(i) for i in torch.unravel_index(torch.tensor(flat), shape)]
    n_bad, n = int(bad.sum()), e.numel()
    text = (f"tensors of shape {shape} differ in {n_bad} of {n} elements; largest difference "
            f"{_num(float(diff.reshape(-1)[flat]))} at index {pos}: expected {_num(e.reshape(-1)[flat].item())}, "
            f"got {_num(g.reshape(-1)[flat].item())}")
    lo = max(0, min(flat - 1, n - 4))  # four neighbours in memory order, around the largest difference
    hi = min(n, lo + 4)

    def window(t):
        vals = ", ".join(_num(v) for v in t.reshape(-1)[lo:hi].tolist())
        return f"[{'..., ' if lo > 0 else ''}{vals}{', ...' if hi < n else ''}]"

    if n > 1:
        text += f"; around it: expected {window(e)}, got {window(g)}"
    return text + _tensor_factor(got, expected)  # a wrong scale (loss not divided by M, ...) is worth naming


@contextlib.contextmanager
def explain_index_errors(what: str, hint: str):
    """Inside the block, an IndexError (or torch's "index ... is out of bounds" RuntimeError) raised
    by the learner's code becomes a :class:`CheckFailure` "<what> raised IndexError: <message>; <hint>",
    e.g. the hint that a shard's rows are numbered from 0, so a global id needs its offset removed."""
    try:
        yield
    except IndexError as e:
        raise CheckFailure(f"{what} raised IndexError: {_first_line(e)}; {hint}") from None
    except RuntimeError as e:
        if "out of bounds" not in str(e) and "out of range" not in str(e):
            raise
        raise CheckFailure(f"{what} raised {type(e).__name__}: {_first_line(e)}; {hint}") from None


def _first_difference(got, expected) -> str:
    import torch

    try:
        diff = (got.detach().double().cpu() - expected.detach().double().cpu()).abs()
        if diff.numel() == 0:
            return ""
        idx = int(torch.argmax(diff.reshape(-1)))
        pos = (tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), tuple(expected.shape)))
               if expected.dim() else ())
        return (f" (largest difference at index {list(pos)}: expected {expected.reshape(-1)[idx].item():.6g}, "
                f"got {got.reshape(-1)[idx].item():.6g})")
    except Exception:
        return ""


def expect_raises(exc_type: type, fn: Callable, *args: Any, what: str = "", **kwargs: Any) -> BaseException:
    """Call ``fn(*args, **kwargs)`` and require it to raise ``exc_type``; return the exception.

    Raises :class:`CheckFailure` naming the call when nothing (or another exception) is raised.
    ``NotImplementedError`` is passed through (the exercise is then "not attempted").
    """
    call = what or f"{getattr(fn, '__name__', 'answer')}({', '.join(map(repr, args))})"
    try:
        fn(*args, **kwargs)
    except NotImplementedError:
        if exc_type is NotImplementedError:
            raise CheckFailure(f"{call}: still the stub") from None
        raise
    except exc_type as e:
        return e
    except Exception as e:
        raise CheckFailure(f"{call}: expected {exc_type.__name__}, got {type(e).__name__}: {_first_line(e)}") from None
    raise CheckFailure(f"{call}: expected {exc_type.__name__} to be raised, but it returned normally")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""
