"""The kit a graded kernel imports: labkit with the assignment's references withheld until graded.

The source policy (:mod:`labkit.grading.policy`) refuses code that names labkit's reference for
an exercise. It judges source text, so it is a list of refused constructs, and each red team
found one more way to reach a function by a name the policy could not read. This module removes
the prize instead. For each submission the grader (as root) builds a copy of the installed kit
(:func:`build_kit`) in which each reference of the pinned assignment's exercises (the table in
:mod:`labkit.grading.references`, the exercise module's own ``references=``, and the helpers
of its module that a reference hands its work to) is a stub with the same signature whose body
calls :func:`labkit._withheld.load`. Its code lies in the copy's ``_withheld`` folder, mode 0600
and the grader's, until :meth:`WithheldKit.release_after` makes it readable, once the grading
point of every exercise it is withheld for has passed; a kit cell after that runs as usual.
The graded kernel sees only that copy (:mod:`labkit.grading._jail`'s ``--root``: a file system
of its own in which the kit's folder is the copy and nothing else of the checkout, its git
history or the solutions exists). However the learner's code reaches ``bubble_formula`` before
1.1 is graded, it gets::

    RuntimeError: labkit's bubble_formula (labkit.pipeline.simulate) is withheld while this assignment is graded ...

Not withheld, so guarded by the source policy alone: a reference that a cell of the shipped
notebook uses before its exercise, or that the grader's kernel-side helpers
(:mod:`labkit.grading.kernelside`) use, directly or through a kit function that reaches it
(:mod:`labkit.grading.reach`), e.g. 09's ``route`` under the ``MoELayer`` a kit cell builds
before 9.1. :func:`withheld` lists, per assignment, what is withheld and what is kept and why.
The copy also leaves out what the kernel never needs and must not read:
``labkit/grading/exercises`` (cases, expected-value code), ``references.py``,
``labkit/grading/hidden`` and the solved notebooks.

Sources: issue 16, principles 2 and 3 (the kernel cannot read the grader; the reference is not
the learner's to call).
"""
from __future__ import annotations

import ast
import functools
import os
import shutil
import textwrap

__all__ = ["withheld", "build_kit", "WithheldKit", "LEFT_OUT"]

# relative to the kit's folder: never in the kernel's copy
LEFT_OUT = ("grading/exercises", "grading/references.py", "grading/hidden", "_solutions")


def _kit_dir() -> str:
    import labkit

    return os.path.dirname(os.path.abspath(labkit.__file__))


def _major(notebook: str) -> str:
    return str(int(notebook.split("_")[0])) if notebook[:2].isdigit() else notebook


@functools.lru_cache(maxsize=None)
def _kernelside_labels(major: str) -> frozenset:
    """The labkit "module:name" nodes the grader's kernel-side helpers of notebook ``major`` import."""
    from .reach import _absolute

    folder = os.path.join(_kit_dir(), "grading", "kernelside")
    out = set()
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if not (name.startswith("nb") and name[2:4].isdigit() and str(int(name[2:4])) == major):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        here = f"labkit.grading.kernelside.{name[:-3]}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                mod = _absolute(here, False, node.level, node.module)
                if mod.startswith("labkit") and not mod.startswith("labkit.grading"):
                    out |= {f"{mod}:{a.name}" for a in node.names}
    return frozenset(out)


def _loads_by_cell(major: str) -> list[set[str]]:
    """For each code cell of the shipped learner notebook ``major``, in order: the labkit
    "module:name" nodes it uses (reads a name a cell imported from labkit, or an attribute of a
    labkit module; an import alone uses nothing: a withheld function may be imported)."""
    from .policy import _home_label, _labkit_label, _labkit_uses, _Names, _python, _shipped_sources

    cells = _shipped_sources(major)
    trees = [t for s in cells if (t := _python(s)) is not None]
    names = _Names(trees)
    out = []
    for src in cells:
        used: set[str] = set()
        for node in ast.walk(_python(src) or ast.Module(body=[], type_ignores=[])):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                dotted = [o for o in names.origins.get(node.id, ()) if o.startswith("labkit")]
            elif isinstance(node, ast.Attribute):
                dotted = _labkit_uses(node, names)
            else:
                continue
            for d in dotted:
                if lab := _labkit_label(d):
                    used |= {lab, _home_label(lab)}
        out.append(used)
    return out


@functools.lru_cache(maxsize=None)
def withheld(notebook: str) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """What the graded kernel of assignment ``notebook`` ("01_pipeline_bubble") does without, and
    until when.

    Returns ``(withheld, kept)``. ``withheld`` is {"module:qualname": exercise ids}: a reference
    of those exercises (``Exercise.reference_names()``: the table in
    :mod:`labkit.grading.references` and the exercise module's own) or a function of its module
    it reaches, withheld for the exercises the shipped notebook grades before any of its cells
    uses it, until all of them are graded (:meth:`WithheldKit.release_after`). ``kept`` is
    {"module:qualname": why} for the assignment's references that stay available from the
    start: a shipped cell before their first exercise uses something that reaches them
    (:mod:`labkit.grading.reach`; e.g. 09 builds a ``MoELayer``, which runs ``route``, before
    9.1), or the grader's kernel-side helpers use them. Those are guarded by the source policy
    only. References in ``labkit.grading`` are not listed: their modules are not in the
    kernel's copy at all."""
    from .assignments import grading_points
    from .policy import _home_label, _shipped_sources
    from .reach import callees_in_module, callers_of
    from .registry import exercises_for_notebook

    major = _major(notebook)
    loads = _loads_by_cell(major)
    cells = _shipped_sources(major)
    exercises = exercises_for_notebook(notebook)
    position = {ex_id: len(cells) if k is None else k  # the shipped notebook's grading points
                for ex_id, k in grading_points(list(enumerate(cells)), [ex.id for ex in exercises]).items()}
    helper_uses = set(_kernelside_labels(major))
    helper_uses |= {_home_label(lab) for lab in helper_uses}
    ids: dict[str, list[str]] = {}
    for ex in exercises:
        # the table's references and the exercise module's own, and each one's helpers in its module
        # (a reference that hands its work to ``_zb_h1_order`` would be withheld in name only)
        for label in ex.reference_names():
            mod, _, qual = label.partition(":")
            if not mod.startswith("labkit.") or mod.startswith("labkit.grading"):
                continue
            top = f"{mod}:{qual.split('.')[0]}"
            for node in (top, *sorted(callees_in_module(top))):
                if node == top or _is_function(node):
                    if ex.id not in ids.setdefault(node, []):
                        ids[node].append(ex.id)
    out: dict[str, tuple[str, ...]] = {}
    kept: dict[str, str] = {}
    for label, exs in ids.items():
        reachers = callers_of(label) | {label}
        first_use = next((i for i, used in enumerate(loads) if used & reachers), len(cells) + 1)
        # withheld for the exercises graded before any cell uses it (released once they are all graded)
        protected = tuple(e for e in exs if position[e] <= first_use)
        if reachers & helper_uses:
            kept[label] = f"the grader's kernel-side code uses {sorted(reachers & helper_uses)[0]}"
        elif not protected:
            used = sorted(reachers & loads[first_use])[0]
            kept[label] = f"cell {first_use + 1}, before exercise {exs[0]}, uses {used}, which reaches it"
        else:
            out[label] = protected
    return out, kept


def _is_function(label: str) -> bool:
    """Whether the kit's ``label`` ("module:name") is a plain function (a helper worth withholding)."""
    import importlib
    import inspect

    mod, _, name = label.partition(":")
    try:
        return inspect.isfunction(getattr(importlib.import_module(mod), name))
    except (ImportError, AttributeError):
        return False


def _message(qual: str, mod: str, ids) -> str:
    return (f"labkit's {qual} ({mod}) is withheld until exercise {', '.join(ids)} is graded: it is the reference "
            f"implementation the exercise asks you to write")


def _forward(fn) -> str:
    """The argument list that passes ``fn``'s parameters on unchanged: ``a, b, *args, c=c, **kw``."""
    a = fn.args
    parts = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        parts.append(f"*{a.vararg.arg}")
    parts += [f"{x.arg}={x.arg}" for x in a.kwonlyargs]
    if a.kwarg:
        parts.append(f"**{a.kwarg.arg}")
    return ", ".join(parts)


def _replace_body(lines, fn, call: str, edits) -> None:
    """Replace ``fn``'s body (its docstring too: it may state the formula) by ``return call``."""
    indent = " " * (fn.body[0].col_offset if fn.body[0].lineno != fn.lineno else fn.col_offset + 4)
    first = fn.body[0].lineno
    if first == fn.lineno:  # def f(x): return x   (the body on the def's line)
        head = lines[fn.lineno - 1][:fn.body[0].col_offset].rstrip()
        edits.append((fn.lineno, fn.body[-1].end_lineno, [f"{head}\n", f"{indent}return {call}\n"]))
    else:
        edits.append((first, fn.body[-1].end_lineno, [f"{indent}return {call}\n"]))


HELPER = "_labkit_withheld"


def _strip(source: str, labels: dict[str, tuple[str, ...]], mod: str) -> tuple[str, dict[str, str]]:
    """(``source`` with each withheld function's or class's code taken out, {label: the code taken out}).

    A withheld function keeps its decorators and signature; its body becomes a call of
    :func:`labkit._withheld.load`, which raises until the grader releases it. A withheld class
    keeps its bases, decorators, class attributes and method signatures; each method's body
    becomes such a call (the method by its position in the class). The code taken out is the
    function without decorators, or the class with each method renamed ``labkit_m<i>`` and
    undecorated (so that the loader finds the ``i``-th method as a plain function)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []
    taken = {}
    for node in tree.body:
        label = f"{mod}:{getattr(node, 'name', '')}"
        if label not in labels:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            taken[label] = "".join(lines[node.lineno - 1:node.end_lineno])
            _replace_body(lines, node, f"{HELPER}({label!r})({_forward(node)})", edits)
        elif isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            real = ast.parse(textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))).body[0]
            real.decorator_list = []
            k = 0
            for n in real.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n.name, n.decorator_list, k = f"labkit_m{k}", [], k + 1
            taken[label] = ast.unparse(real) + "\n"
            for i, fn in enumerate(methods):
                _replace_body(lines, fn, f"{HELPER}({label!r}, {i})({_forward(fn)})", edits)
    for first, last, new in sorted(edits, reverse=True):
        lines[first - 1:last] = new
    out = "".join(lines)
    if taken:
        out += f"\n\nfrom labkit._withheld import load as {HELPER}  # noqa: E402 (the grader's copy)\n"
    ast.parse(out)  # a rewrite that broke the module is a bug here, never the learner's
    return out, taken


def build_kit(notebooks, dest: str) -> "WithheldKit":
    """Write the kernel's copy of the installed kit under ``dest`` (``dest/labkit``): the kit
    without :data:`LEFT_OUT` and ``__pycache__``, the references :func:`withheld` lists for
    ``notebooks`` taken out (each into ``labkit/_withheld/<label>.src``, mode 0600: the
    grader's, until :meth:`WithheldKit.release`), byte-compiled, every other file readable
    by every user and writable by none. Root only (the kernel's uid must not read the 0600
    files)."""
    import py_compile

    src = _kit_dir()
    kit = os.path.join(dest, "labkit")
    skip = {os.path.join(src, p) for p in LEFT_OUT}

    def ignore(folder, names):
        return [n for n in names if os.path.join(folder, n) in skip]

    shutil.copytree(src, kit, ignore=ignore, symlinks=False)  # mtimes kept: the byte code stays valid
    for left in LEFT_OUT:  # an empty folder where a folder was (as the jail's empty mounts left it)
        if os.path.isdir(os.path.join(src, left)) and not os.path.islink(os.path.join(src, left)):
            os.makedirs(os.path.join(kit, left), exist_ok=True)
    plan: dict[str, dict[str, tuple[str, ...]]] = {}
    for nb in notebooks:
        for label, ids in withheld(nb)[0].items():
            plan.setdefault(label.partition(":")[0], {})[label] = ids
    store = os.path.join(kit, "_withheld")
    files: dict[str, str] = {}
    for mod, labels in plan.items():
        rel = mod.split(".")[1:]
        path = os.path.join(kit, *rel) + ".py"
        if not os.path.isfile(path):
            path = os.path.join(kit, *rel, "__init__.py")
        with open(path, encoding="utf-8") as f:
            text, taken = _strip(f.read(), labels, mod)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        stem = os.path.splitext(os.path.basename(path))[0]
        cache = os.path.join(os.path.dirname(path), "__pycache__")
        for n in os.listdir(cache) if os.path.isdir(cache) else ():
            if n.split(".")[0] == stem:  # the original's byte code holds the reference
                os.remove(os.path.join(cache, n))
        py_compile.compile(path, dfile=os.path.join(src, os.path.relpath(path, kit)), doraise=True)
        for label, code in taken.items():
            files[label] = os.path.join(store, label.replace(":", "--") + ".src")
            header = f"# {_message(label.partition(':')[2], mod, labels[label])}\n"
            with open(files[label], "w", encoding="utf-8") as f:
                f.write(header + code)
    for folder, _dirs, names in os.walk(kit):
        os.chmod(folder, 0o755)
        for n in names:
            os.chmod(os.path.join(folder, n), 0o644)
    kit_obj = WithheldKit(kit, files, {lab: ids for labels in plan.values() for lab, ids in labels.items()})
    kit_obj.withhold()
    os.chmod(dest, 0o755)
    return kit_obj


class WithheldKit:
    """The kernel's copy of the kit (:func:`build_kit`): ``path`` (its ``labkit`` folder),
    ``files`` {label: the file holding that reference's code}, ``exercises`` {label: the
    exercise ids it is withheld for}."""

    def __init__(self, path: str, files: dict[str, str], exercises: dict[str, tuple[str, ...]]):
        self.path, self.files, self.exercises = path, files, exercises
        self.released: set[str] = set()

    def withhold(self) -> None:
        """Every reference unreadable by the kernel's uid again (mode 0600, the grader's)."""
        for f in self.files.values():
            os.chmod(f, 0o600)
        self.released.clear()

    def release_after(self, graded) -> list[str]:
        """Release every reference all of whose exercises are in ``graded`` (ids whose grading
        point has passed): mode 0644, so that the kernel's next call loads it. Returns the labels
        released now."""
        graded = set(graded)
        now = [lab for lab, ids in self.exercises.items()
               if lab not in self.released and lab in self.files and set(ids) <= graded]
        for lab in now:
            os.chmod(self.files[lab], 0o644)
            self.released.add(lab)
        return now
