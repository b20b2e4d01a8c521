"""The kit a graded kernel imports: labkit without the assignment's references until they are graded.

The answer is made ABSENT from the graded kernel, never refused in the source (the threats, and
the tests that show each: ``docs/grading.md``). For each submission the grader (as root) builds a
copy of the installed kit (:func:`build_kit`) in which, for every exercise of the pinned
assignment, each reference (:meth:`~labkit.grading.registry.Exercise.reference_names`), the
helpers of its module that only it uses, and every kit function or class from which one of them
can be reached (:mod:`labkit.grading.reach`: ``build_schedule`` runs ``gpipe_schedule``) is a
stub with the same signature whose body calls :func:`labkit._withheld.load`. Its code lies in
the copy's ``_withheld`` folder, mode 0600 and the grader's, until
:meth:`WithheldKit.release_after` makes it readable once every exercise it is withheld for has
been graded. However the learner's code reaches ``bubble_formula`` before 1.1 is graded, it gets::

    RuntimeError: labkit's bubble_formula (labkit.pipeline.simulate) is withheld while this assignment is graded ...

No shipped cell of the learner notebook and no kernel-side helper (:mod:`labkit.grading.kernelside`)
may need a withheld name before its exercise is graded: :func:`problems` lists what breaks that
rule (``python -m labkit build --check`` fails on it). The copy also leaves out
``labkit/grading/exercises``, ``references.py``, ``labkit/grading/hidden`` and the solved notebooks.
The learner's own copy of the kit's source is not closed this way: that goes to the instructor.

Sources: issue 16 and 40, principles 2 and 3.
"""
from __future__ import annotations

import ast
import functools
import glob
import os
import shutil
import textwrap

__all__ = ["withheld", "problems", "build_kit", "kit_plan", "WithheldKit", "LEFT_OUT", "shipped_cells",
           "withheld_calls"]

# relative to the kit's folder: never in the kernel's copy
LEFT_OUT = ("grading/exercises", "grading/references.py", "grading/hidden", "_solutions")


def _kit_dir() -> str:
    import labkit

    return os.path.dirname(os.path.abspath(labkit.__file__))


def _major(notebook: str) -> str:
    return str(int(notebook.split("_")[0])) if notebook[:2].isdigit() else notebook


@functools.lru_cache(maxsize=None)
def shipped_cells(major: str, folder: str | None = None) -> tuple[str, ...]:
    """The code cells of the learner notebook ``major`` ("2") in ``folder`` (default: the kit's
    ``_notebooks``, the learner notebooks it ships), in order, as written."""
    import json

    folder = folder or os.path.join(_kit_dir(), "_notebooks")
    out: list[str] = []
    if major.isdigit():
        for path in sorted(glob.glob(os.path.join(folder, f"{int(major):02d}_*.ipynb"))):
            try:
                with open(path, encoding="utf-8") as f:
                    nb = json.load(f)
            except (OSError, ValueError):
                continue
            out += ["".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code"]
    return tuple(out)


def _python(src: str) -> ast.Module:
    """A cell's Python as IPython runs it (:func:`labkit.grading.assignments.cell_python`)."""
    from .assignments import cell_python

    try:
        return ast.parse(cell_python(src))
    except (SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[])


def bind_kit_imports(tree: ast.AST, bound: dict[str, str]) -> None:
    """Add to ``bound`` ({name: dotted path into labkit}) the names ``tree``'s imports and
    from-imports of labkit bind, aliases included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "labkit":
                    bound[a.asname or "labkit"] = a.name if a.asname else "labkit"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit" and not node.level:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"


def dotted_path(node, bound: dict[str, str], own=()) -> str:
    """The labkit path that ``node`` (a name, or an attribute chain on one) stands for where its root is a
    name of ``bound`` ({name: dotted path}) not in ``own``; else ""."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound and node.id not in own:
        return ".".join([bound[node.id], *reversed(chain)])
    return ""


def _label(dotted: str) -> str:
    """"module:name" of a dotted path into the kit (the longest module prefix, then the next
    name), or "" outside labkit."""
    from .reach import _module_files

    modules = set(_module_files()) | {"labkit"}
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:i]) in modules:
            return f"{'.'.join(parts[:i])}:{parts[i]}"
    return ""


@functools.lru_cache(maxsize=None)
def _top_names(mod: str) -> dict[str, str]:
    """{name: "def" | "module:name" it is imported from} for the top level of the kit's module ``mod``
    (read from its file, never imported: ``build --check`` does not import torch)."""
    from .reach import _absolute, _module_files, _tree

    path = _module_files().get(mod)
    out: dict[str, str] = {}
    for stmt in _tree(path).body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[stmt.name] = "def"
        elif isinstance(stmt, ast.ImportFrom):
            src = _absolute(mod, path.endswith("__init__.py"), stmt.level, stmt.module)
            for a in stmt.names:
                out.setdefault(a.asname or a.name, f"{src}:{a.name}")
    return out


@functools.lru_cache(maxsize=None)
def _home(label: str) -> str:
    """"module:name" where the function or class the kit's ``label`` stands for is defined
    (``labkit.pipeline:simulate`` -> ``labkit.pipeline.simulate:simulate``; a package's lazy
    export is looked up in its submodules), or "" when it is none: read from the kit's source."""
    from .reach import _module_files

    for _ in range(8):
        mod, _, name = label.partition(":")
        where = _top_names(mod).get(name)
        if where == "def":
            return label
        if where:
            label = where
            continue
        subs = [m for m in _module_files() if m.rsplit(".", 1)[0] == mod and _top_names(m).get(name) == "def"]
        return f"{subs[0]}:{name}" if len(subs) == 1 else ""
    return ""


def cell_names(cells) -> list[tuple[set[str], set[str]]]:
    """For each cell source of ``cells``, in order: (the kit's "module:name" labels it USES, those it
    USES or IMPORTS). A use is a read of a name a cell imported from labkit, of an attribute of a
    labkit module, or of a name an earlier cell bound to something that used one (a function
    that calls ``checkpoint``, a ``MoELayer`` a cell made); each label comes with its home
    (:func:`_home`)."""
    trees = [_python(src) for src in cells]
    bound: dict[str, str] = {}   # name -> dotted path (across the notebook: cells share one namespace)
    for tree in trees:
        bind_kit_imports(tree, bound)

    def labels(dotted: str) -> set[str]:
        lab = _label(dotted)
        return {x for x in (lab, _home(lab) if lab else "") if x}

    made: dict[str, set[str]] = {}   # a name a cell bound -> the labels its value used

    def uses(stmt) -> set[str]:
        used: set[str] = set()
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id in bound:
                    used |= labels(bound[node.id])
                used |= made.get(node.id, set())
            elif isinstance(node, ast.Attribute) and (path := dotted_path(node, bound)):
                used |= labels(path)
        return used

    out = []
    for tree in trees:
        used: set[str] = set()
        imported: set[str] = set()
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").split(".")[0] == "labkit" and not stmt.level:
                for a in stmt.names:
                    imported |= labels(f"{stmt.module}.{a.name}")
                continue
            here = uses(stmt)
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                made[stmt.name] = made.get(stmt.name, set()) | here  # runs when called: a use where it is
                continue
            used |= here
            for target in ast.walk(stmt):
                if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store):
                    made[target.id] = made.get(target.id, set()) | here
        out.append((used, imported | used))
    return out


@functools.lru_cache(maxsize=None)
def _kernelside_labels(major: str) -> frozenset:
    """The labkit "module:name" labels the grader's kernel-side helpers of notebook ``major`` import."""
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
                    for a in node.names:
                        out |= {x for x in (f"{mod}:{a.name}", _home(f"{mod}:{a.name}")) if x}
    return frozenset(out)


_IMPORT_METHODS = ("__init__", "__post_init__", "__new__", "__init_subclass__", "__set_name__")


def _calls(mod: str, nodes) -> set[str]:
    """The kit's functions and classes that ``nodes`` (statements of module ``mod``) CALL when they
    run: ``f(...)`` or ``module.f(...)``; a function body, a lambda and an ``if __name__ ==
    "__main__":`` block do not run, a class body and decorators do."""
    from .reach import _module_files

    names, modules = _top_names(mod), set(_module_files())
    out: set[str] = set()

    def resolve(func) -> str:
        if isinstance(func, ast.Name) and func.id in names:
            target = f"{mod}:{func.id}" if names[func.id] == "def" else names[func.id]
            return _home(target) if ":" in target else ""
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in names:
            where = names[func.value.id]
            base = where.replace(":", ".") if where != "def" else ""
            return _home(f"{base}:{func.attr}") if base in modules else ""
        return ""

    def visit(node) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in node.decorator_list + node.args.defaults + [d for d in node.args.kw_defaults if d]:
                visit(sub)
            return
        if isinstance(node, ast.Lambda):
            return
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Call) and (lab := resolve(node.func)):
            out.add(lab)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in nodes:
        visit(node)
    return out


def _node(label: str):
    """The top-level statement of the kit's source that defines ``label`` ("module:name"), or None."""
    from .reach import _module_files, _tree

    mod, _, name = label.partition(":")
    return next((n for n in _tree(_module_files().get(mod)).body if getattr(n, "name", None) == name), None)


@functools.lru_cache(maxsize=1)
def import_time() -> frozenset:
    """The kit's functions and classes that run while a kit module is imported (``KINDS =
    names(...)``, a table of ``ScheduleInfo(...)``), and those they call in turn: they are never
    stubbed, or importing the kit would raise. Their route to a reference ends at the reference,
    which is stubbed."""
    from .reach import _module_files, _tree

    todo = [lab for mod, path in _module_files().items() for lab in _calls(mod, _tree(path).body)]
    seen: set[str] = set()
    while todo:
        label = todo.pop()
        if label in seen:
            continue
        seen.add(label)
        mod, node = label.partition(":")[0], _node(label)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo += _calls(mod, node.body)
        elif isinstance(node, ast.ClassDef):
            runs = [n for n in node.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            runs += [b for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name in _IMPORT_METHODS for b in n.body]
            todo += _calls(mod, runs)
    return frozenset(seen)


@functools.lru_cache(maxsize=None)
def _has_code(label: str) -> bool:
    """Whether the kit's function or class ``label`` holds code to withhold (a class: a method of its
    own; a dataclass of fields only holds none)."""
    node = _node(label)
    if isinstance(node, ast.ClassDef):
        return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))


def _is_def(label: str) -> bool:
    """Whether the kit's ``label`` ("module:name") is a function or class defined in its module."""
    return _home(label) == label


def _private_helpers(refs: set[str]) -> set[str]:
    """The functions of the references' modules that only the references (or each other) call:
    ``zb_h1_schedule`` hands its work to ``_zb_h1_order``, which nothing else calls. A helper
    that other kit code shares stays (it does not reach the reference)."""
    from .reach import _callers, callees_in_module

    cand = {h for r in refs for h in callees_in_module(r) if _is_def(h) and h not in refs}
    back = _callers()
    while True:
        drop = {h for h in cand if not set(back.get(h, ())) <= (refs | cand)}
        if not drop:
            return cand
        cand -= drop


@functools.lru_cache(maxsize=None)
def withheld(notebook: str) -> dict[str, tuple[str, ...]]:
    """What the graded kernel of assignment ``notebook`` ("01_pipeline_bubble") does without:
    {"module:name": the exercise ids it is withheld for, until all of them are graded}.

    For each exercise: its references in the kit (``Exercise.reference_names()``; those in
    ``labkit.grading`` are not in the kernel's copy at all), the helpers only they call, and
    every function, class or module-level name of the kit from which one of them can be reached
    (:func:`labkit.grading.reach.callers_of`), but those the kit runs while it is imported
    (:func:`import_time`: a stub there would break ``import labkit``; whatever reference they
    reach is itself a stub). Computed from the kit's source, never by running it."""
    from .reach import callers_of
    from .registry import exercises_for_notebook

    out: dict[str, list[str]] = {}
    for ex in exercises_for_notebook(notebook):
        refs = set()
        for label in ex.reference_names():
            mod, _, qual = label.partition(":")
            if mod.startswith("labkit.") and not mod.startswith("labkit.grading"):
                refs.add(f"{mod}:{qual.split('.')[0]}")
        refs |= _private_helpers(refs)
        for r in sorted(refs):
            for node in (r, *sorted(callers_of(r))):
                if node in import_time() or (_is_def(node) and not _has_code(node)):
                    continue
                if ex.id not in out.setdefault(node, []):
                    out[node].append(ex.id)
    return {label: tuple(ids) for label, ids in out.items()}


def problems(notebook: str, cells=None) -> list[str]:
    """Why the graded kernel of ``notebook`` could not do without its references: a shipped cell
    that uses or imports a withheld name (:func:`withheld`) at or before the grading point of an
    exercise it is withheld for, or a kernel-side helper that imports one. ``cells``: the learner
    notebook's code cells (default: the shipped ones, :func:`shipped_cells`). Empty when none."""
    from .assignments import grading_points
    from .registry import exercises_for_notebook

    major = _major(notebook)
    cells = tuple(shipped_cells(major) if cells is None else cells)
    held = withheld(notebook)
    ids = [ex.id for ex in exercises_for_notebook(notebook)]
    position = {e: len(cells) if k is None else k for e, k in grading_points(list(enumerate(cells)), ids).items()}
    out = []
    for k, (used, imported) in enumerate(cell_names(cells)):
        for label in sorted(imported):
            if _home(label) not in ("", label) and _home(label) in imported:
                continue  # said once, where it is defined
            early = [e for e in held.get(label, ()) if k <= position[e]]
            if early:
                how = "uses" if label in used else "imports"
                out.append(f"{notebook}: code cell {k + 1} {how} {label}, which is (or reaches) the reference of "
                           f"exercise {early[0]}, graded after code cell {position[early[0]] + 1}: move the cell "
                           f"after the exercise or give it precomputed values")
    for label in sorted(_kernelside_labels(major)):
        if label in held:
            out.append(f"{notebook}: the kernel-side helpers (labkit/grading/kernelside) import {label}, which is "
                       f"(or reaches) the reference of exercise {held[label][0]}: compute it in the grader instead")
    return out


def _message(qual: str, mod: str, ids) -> str:
    return (f"labkit's {qual} ({mod}) is withheld until exercise {', '.join(ids)} is graded: it is, or runs, the "
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
    """Replace ``fn``'s body (its docstring too: it may state the formula) by ``return call``, padded
    with blank lines to the body's length, so that every line keeps its number (the source of a
    released reference can then be put back in place: :meth:`WithheldKit.release_after`)."""
    indent = " " * fn.body[0].col_offset
    first, last = fn.body[0].lineno, fn.body[-1].end_lineno
    if first == fn.lineno:  # def f(x): return x   (the body on the def's line)
        head = lines[fn.lineno - 1][:fn.body[0].col_offset].rstrip()
        new = [f"{head} return {call}\n"]
    else:
        new = [f"{indent}return {call}\n"]
    edits.append((first, last, new + ["\n"] * (last - first + 1 - len(new))))


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


def kit_plan(notebooks) -> dict[str, dict[str, tuple[str, ...]]]:
    """{module: {"module:name": exercise ids}}: the functions and classes :func:`build_kit` takes out
    of each module of the kit for ``notebooks`` (re-exports and aliases hold the stub)."""
    plan: dict[str, dict[str, tuple[str, ...]]] = {}
    for nb in notebooks:
        for label, ids in withheld(nb).items():
            if _is_def(label):
                have = plan.setdefault(label.partition(":")[0], {}).get(label, ())
                plan[label.partition(":")[0]][label] = tuple(dict.fromkeys(have + ids))
    for mod, labels in plan.items():
        _stubbed(mod, tuple(labels.items()))  # cached: a batch plans its kits before it forks its graders
    return plan


@functools.lru_cache(maxsize=None)
def _stubbed(mod: str, labels: tuple) -> tuple[str, str, dict[str, str], dict[str, tuple[int, int]]]:
    """(the kit module ``mod``'s source, that source with ``labels`` ((label, exercise ids) pairs)
    taken out (:func:`_strip`), {label: the code taken out}, {label: its first and last line})."""
    from .reach import _module_files, _tree

    with open(_module_files()[mod], encoding="utf-8") as f:
        original = f.read()
    text, taken = _strip(original, dict(labels), mod)
    tops = [n for n in _tree(_module_files()[mod]).body if f"{mod}:{getattr(n, 'name', '')}" in taken]
    return original, text, taken, {f"{mod}:{n.name}": (min([n.lineno] + [d.lineno for d in n.decorator_list]),
                                                       n.end_lineno) for n in tops}


def build_kit(notebooks, dest: str) -> "WithheldKit":
    """Write the kernel's copy of the installed kit under ``dest`` (``dest/labkit``): the kit
    without :data:`LEFT_OUT` and ``__pycache__``, the references :func:`withheld` lists for
    ``notebooks`` taken out (each into ``labkit/_withheld/<label>.src``, mode 0600: the
    grader's, until :meth:`WithheldKit.release`), byte-compiled, every other file readable
    by every user and writable by none. Root only (the kernel's uid must not read the 0600
    files)."""
    import py_compile

    from .reach import _module_files

    src = _kit_dir()
    kit = os.path.join(dest, "labkit")
    skip = {os.path.join(src, p) for p in LEFT_OUT}

    def ignore(folder, names):
        return [n for n in names if os.path.join(folder, n) in skip]

    shutil.copytree(src, kit, ignore=ignore, symlinks=False)  # mtimes kept: the byte code stays valid
    for left in LEFT_OUT:  # an empty folder where a folder was (as the jail's empty mounts left it)
        if os.path.isdir(os.path.join(src, left)) and not os.path.islink(os.path.join(src, left)):
            os.makedirs(os.path.join(kit, left), exist_ok=True)
    plan = kit_plan(notebooks)
    store = os.path.join(kit, "_withheld")
    files: dict[str, str] = {}
    sources: dict[str, tuple] = {}
    for mod, labels in plan.items():
        original, text, taken, spans = _stubbed(mod, tuple(labels.items()))
        path = os.path.join(kit, os.path.relpath(_module_files()[mod], src))
        sources[path] = (original, text, spans)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        for pyc in glob.glob(os.path.join(os.path.dirname(path), "__pycache__", os.path.basename(path)[:-3] + ".*")):
            os.remove(pyc)  # the original's byte code holds the reference
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
    kit_obj = WithheldKit(kit, files, {lab: ids for labels in plan.values() for lab, ids in labels.items()}, sources)
    kit_obj.withhold()
    os.chmod(dest, 0o755)
    return kit_obj


class WithheldKit:
    """The kernel's copy of the kit (:func:`build_kit`): ``path`` (its ``labkit`` folder),
    ``files`` {label: the file holding that reference's code}, ``exercises`` {label: the
    exercise ids it is withheld for}, ``sources`` {module file: (its original text, the text with
    the stubs, {label: its lines})}."""

    def __init__(self, path: str, files: dict[str, str], exercises: dict[str, tuple[str, ...]],
                 sources: dict | None = None):
        self.path, self.files, self.exercises = path, files, exercises
        self.sources = sources or {}
        self.released: set[str] = set()

    def withhold(self) -> None:
        """Every reference unreadable by the kernel's uid again (mode 0600, the grader's), and its
        module's source the stub again."""
        for f in self.files.values():
            os.chmod(f, 0o600)
        self.released.clear()
        self._write_sources()

    def _write_sources(self) -> None:
        """Each module's file as the kernel should read it now: the stubbed text with the lines of
        every released reference put back (the stubs keep every line's number, so ``inspect.getsource``
        of a released function, e.g. 12.3's reading of ``route``, shows its code)."""
        for path, (original, stubbed, spans) in self.sources.items():
            lines, real = stubbed.splitlines(keepends=True), original.splitlines(keepends=True)
            for label, (first, last) in spans.items():
                if label in self.released:
                    lines[first - 1:last] = real[first - 1:last]
            text = "".join(lines)
            with open(path, encoding="utf-8") as f:
                if f.read() == text:
                    continue
            tmp = f"{path}.labkit-tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)

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
        if now:
            self._write_sources()
        return now


@functools.lru_cache(maxsize=None)
def withheld_calls(exercise_id: str) -> tuple[str, ...]:
    """The kit's functions and classes ("module:name") that the graded kernel still lacks when
    exercise ``exercise_id`` is graded: those :func:`withheld` for an exercise of its notebook
    graded at the same point or later (the shipped learner notebook's grading points). The
    interactive ``check`` stops an answer that calls one, as the graded kernel would, and says
    so (:func:`labkit.grading.references.reference_message`)."""
    from .assignments import grading_points
    from .registry import exercises_for_notebook, get_exercise

    notebook = get_exercise(exercise_id).notebook
    cells = shipped_cells(_major(notebook))
    exercises = exercises_for_notebook(notebook)
    pos = grading_points(list(enumerate(cells)), [ex.id for ex in exercises])
    at = {e: len(cells) if k is None else k for e, k in pos.items()}
    mine = at.get(str(exercise_id), len(cells))
    return tuple(label for label, ids in withheld(notebook).items()
                 if _is_def(label) and any(at.get(e, len(cells)) >= mine for e in ids))
