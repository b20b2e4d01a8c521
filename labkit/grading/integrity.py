"""The integrity report: what the instructor may want to read, never a score (issue 40, item 3).

Pasting the kit's source (or the solved notebook's answer) cannot be prevented, and two learners
can share code: this shows it to the instructor, per submission and exercise (the columns and how
to read them: ``docs/instructors.md``). Similarity is the share of the answer's code (the
definition it is graded from and the notebook's functions it uses) covered by winnowed
fingerprints of the token stream (as MOSS; Schleimer, Wilkerson and Aiken, SIGMOD 2003), from
``copydetect``, with names, strings and layout filtered out and the learner notebook's starter
code excluded; it is measured against the kit's references for the exercise
(:func:`labkit.grading.references.references_for`, with the kit functions each calls) and the
solved notebook's answer, and in a batch between submissions. Dynamic code worth reading
(``exec``/``eval``/``compile``, ``__import__``, code objects, a ``.py`` written and imported, the
kit's private names) is flagged with its cell and lines. So is an answer whose code names the
exercise's reference, or a kit function the withholding plan lists for it
(:func:`labkit.grading.withhold.withheld`), by import, from-import, alias or attribute
(``from labkit.pipeline.simulate import bubble_formula`` in 1.1): where the references are not
withheld (the uid-only tier) that call earns the points, and a short answer that calls it looks
like nothing in the similarity columns; it ranks with a full copy. Nothing here runs the
submission.

Thresholds (:data:`FLAG_REFERENCE`, :data:`FLAG_PAIR`) were chosen on the corpus in
``tests/grading/integrity_corpus.py``, whose test reports precision and recall.
"""
from __future__ import annotations

import ast
import csv
import html
import importlib
import inspect
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

from .assignments import cell_python
from .withhold import _home, _label, _python, bind_kit_imports, dotted_path, withheld

__all__ = ["Flag", "Row", "analyse", "analyse_batch", "for_submissions", "write_report", "format_report",
           "FLAG_REFERENCE", "FLAG_PAIR", "similarity"]

K = 20  # characters of the filtered token stream per fingerprint (a line or two of code)
WINDOW = 4  # winnowing window: any match of K + WINDOW - 1 characters is found
FLAG_REFERENCE = 0.5  # share of an answer's code found in a reference: flagged from here
FLAG_PAIR = 0.7  # share of an answer's code found in another submission's answer to the same exercise
MIN_CHARS = 40  # answers shorter than this (filtered) are not compared: every short answer looks alike


@dataclass
class Flag:
    """One thing to read: ``kind`` (reference, pair, dynamic, names reference), what was found, where (cell 1-based
    as the notebook shows it, lines within the cell), and a score in [0, 1] for similarity flags."""
    kind: str
    what: str
    cell: int
    lines: tuple[int, int]
    score: float = 0.0

    def where(self) -> str:
        a, b = self.lines
        return f"cell {self.cell}, line {a}" + (f"-{b}" if b != a else "")


@dataclass
class Row:
    submission: str
    exercise: str
    reference: float = 0.0  # highest share of the answer found in a reference
    reference_name: str = ""
    pair: float = 0.0
    pair_with: str = ""
    flags: list[Flag] = field(default_factory=list)

    @property
    def suspicion(self) -> float:
        # an answer that names the exercise's reference ranks with a full copy: it is one, by name
        calls = 1.0 if any(f.kind == "names reference" for f in self.flags) else 0.0
        return max(self.reference, self.pair, calls) + 0.01 * sum(f.kind == "dynamic" for f in self.flags)

    @property
    def flagged(self) -> bool:
        return self.reference >= FLAG_REFERENCE or self.pair >= FLAG_PAIR or any(
            f.kind in ("dynamic", "names reference") for f in self.flags)


# ---------------------------------------------------------------- code of a notebook
@dataclass
class _Def:
    name: str
    cell: int  # 1-based notebook cell number
    start: int
    end: int
    text: str
    uses: set[str]
    function: bool = True  # a def or class (a helper), not a value the notebook assigned


# False in a batch's forked graders: the batch writes one report for all of them (labkit.grading.batch)
PER_GRADER = True


def _definitions(cells) -> dict[str, _Def]:
    """Top-level functions, classes and assignments of ``cells`` ([(index, source)]); the last one
    of each name wins (as when the notebook runs top to bottom)."""
    out: dict[str, _Def] = {}
    for idx, src in cells:
        code = cell_python(src)
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            continue
        lines = code.splitlines()
        for stmt in tree.body:
            names = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [stmt.name]
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
            if not names:
                continue
            start = min([stmt.lineno] + [d.lineno for d in getattr(stmt, "decorator_list", [])])
            text = "\n".join(lines[start - 1: stmt.end_lineno])
            uses = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            function = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            for name in names:
                out[name] = _Def(name, idx + 1, start, stmt.end_lineno, text, uses, function)
    return out


def _closure(defs: dict[str, _Def], name: str) -> list[_Def]:
    """The definition of ``name`` and of every notebook name it uses, transitively (its helpers)."""
    seen, todo, out = set(), [name], []
    while todo:
        n = todo.pop(0)
        if n in seen or n not in defs:
            continue
        seen.add(n)
        out.append(defs[n])
        todo += sorted(u for u in defs[n].uses - seen if u in defs and defs[u].function)
    return out


# ---------------------------------------------------------------- fingerprints
def _fingerprint(text: str, boilerplate=()):
    from copydetect import CodeFingerprint

    return CodeFingerprint("answer.py", K, WINDOW, boilerplate=list(boilerplate), language="python",
                           fp=io.StringIO(text))


def similarity(answer: str, other: str, boilerplate=()) -> tuple[float, list[tuple[int, int]]]:
    """(share of ``answer``'s tokens covered by fingerprints also in ``other``, the character
    ranges of ``answer`` that match), ``boilerplate`` fingerprints ignored. 0 for an answer too
    short to judge (:data:`MIN_CHARS` filtered characters)."""
    from copydetect import compare_files

    a, b = _fingerprint(answer, boilerplate), _fingerprint(other, boilerplate)
    if len(a.filtered_code) < MIN_CHARS or not a.hashes:
        return 0.0, []
    _overlap, (sim_a, _sim_b), (slices_a, _slices_b) = compare_files(a, b)
    ranges = [(int(s), int(e)) for s, e in zip(*slices_a)] if len(slices_a) else []
    return float(sim_a), ranges


def _boilerplate(starter: list[str]) -> set:
    hashes: set = set()
    for src in starter:
        try:
            hashes |= set(_fingerprint(cell_python(src)).hashes)
        except Exception:  # noqa: BLE001
            continue
    return hashes


def _reference_sources(ex_id: str) -> list[tuple[str, str]]:
    """(name, source) of the kit's references for ``ex_id`` and the kit functions each calls
    (one level), read from the grader's kit (never the kernel's)."""
    from .references import references_for

    out, seen = [], set()

    def add(obj, label):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        try:
            out.append((label, inspect.getsource(obj)))
        except (OSError, TypeError):
            return
        module = inspect.getmodule(obj)
        try:
            tree = ast.parse(inspect.getsource(obj).lstrip())
        except (SyntaxError, OSError, TypeError):
            return
        if label.count("+") >= 1:  # helpers of helpers are not followed
            return
        for n in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}:
            target = getattr(module, n, None)
            # its helpers: the kit functions it calls that the same module defines (its own building
            # blocks, e.g. add_communication for gpipe_schedule), not the kit's general machinery
            if inspect.isfunction(target) and target.__module__ == getattr(module, "__name__", None) and \
                    len(inspect.getsource(target)) < 4000:
                add(target, f"{label}+{target.__module__}:{target.__qualname__}")

    for label in references_for(ex_id):
        mod, _, qual = label.partition(":")
        try:
            obj = importlib.import_module(mod)
            for part in qual.split("."):
                obj = getattr(obj, part)
        except Exception:  # noqa: BLE001 - a reference that moved: nothing to compare with
            continue
        add(obj, label)
    return out


def _solved_answer(notebook: str, ex_id: str) -> str:
    """The answer code in the kit's solved notebook ``notebook`` for ``ex_id`` ("" when none)."""
    from .assignments import answer_name
    from .build import packaged_notebooks

    path = next((p for p in packaged_notebooks("solutions") if p.stem == notebook), None)
    if path is None:
        return ""
    cells = _code_cells(path)
    name = answer_name(ex_id, cells)
    return "\n\n".join(d.text for d in _closure(_definitions(cells), name)) if name else ""


def _code_cells(path) -> list[tuple[int, str]]:
    import json

    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    out = []
    for i, c in enumerate(nb.get("cells", [])):
        if c.get("cell_type") == "code":
            src = c.get("source", "")
            out.append((i, "".join(src) if isinstance(src, list) else str(src)))
    return out


def _starter(notebook: str) -> list[str]:
    from .build import packaged_notebooks

    path = next((p for p in packaged_notebooks("notebooks") if p.stem == notebook), None)
    return [src for _, src in _code_cells(path)] if path is not None else []


# ---------------------------------------------------------------- dynamic code
_DYNAMIC_CALLS = {"exec": "exec", "eval": "eval", "compile": "compile", "__import__": "__import__",
                  "import_module": "importlib.import_module", "CodeType": "a code object (types.CodeType)",
                  "FunctionType": "a function built from a code object (types.FunctionType)",
                  "spec_from_file_location": "a module loaded from a file (importlib)"}


def _dynamic(cells, starter: set[str]) -> list[Flag]:
    """Dynamic code in the submission's own cells (a cell exactly as shipped is skipped)."""
    flags: list[Flag] = []
    wrote_py: list[tuple[int, int, str]] = []
    for idx, src in cells:
        if src in starter:
            continue
        for m in re.finditer(r"^%%writefile\s+(?:-a\s+)?(\S+\.py)\b", src, re.M):
            wrote_py.append((idx + 1, src[: m.start()].count("\n") + 1, Path(m.group(1)).stem))
        tree = _python(src)
        labkit_names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                labkit_names |= {(a.asname or a.name.split(".")[0]) for a in node.names
                                 if a.name.split(".")[0] == "labkit"}
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit":
                for a in node.names:
                    labkit_names.add(a.asname or a.name)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        flags.append(Flag("dynamic", f"imports the kit's private {node.module}.{a.name}", idx + 1,
                                          (node.lineno, node.end_lineno or node.lineno)))
        for node in ast.walk(tree):
            where = (idx + 1, (getattr(node, "lineno", 1), getattr(node, "end_lineno", None) or
                               getattr(node, "lineno", 1)))
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in _DYNAMIC_CALLS and not (name == "compile" and isinstance(fn, ast.Attribute)):
                    flags.append(Flag("dynamic", f"calls {_DYNAMIC_CALLS[name]}", where[0], where[1]))
                py = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                      and a.value.endswith(".py")]
                if name == "open" and py and any(
                        isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wa")
                        for a in list(node.args[1:]) + [k.value for k in node.keywords if k.arg == "mode"]):
                    wrote_py.append((where[0], where[1][0], Path(py[0]).stem))
            elif isinstance(node, ast.Attribute):
                if node.attr in ("__code__", "__globals__", "__closure__", "f_globals", "f_locals", "f_back"):
                    flags.append(Flag("dynamic", f"reaches {node.attr}", where[0], where[1]))
                elif node.attr.startswith("_") and not node.attr.startswith("__") and _rooted_in(node, labkit_names):
                    flags.append(Flag("dynamic", f"uses the kit's private name {ast.unparse(node)}", where[0],
                                      where[1]))
    if wrote_py:
        imported = {}
        for idx, src in cells:
            for node in ast.walk(_python(src)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                for mod in mods:
                    imported.setdefault(mod.split(".")[0], (idx + 1, node.lineno))
        for cell, line, stem in wrote_py:
            if stem in imported:
                flags.append(Flag("dynamic", f"writes {stem}.py and imports it (cell {imported[stem][0]}, line "
                                             f"{imported[stem][1]})", cell, (line, line)))
    return flags


def _rooted_in(node: ast.Attribute, names: set[str]) -> bool:
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


# ---------------------------------------------------------------- the reference named
@dataclass(frozen=True)
class _Target:
    label: str  # "module:name"
    why: str  # "a reference of 1.1" or "withheld for 1.1: it runs a reference"


def _targets(notebook: str, ex) -> dict[str, _Target]:
    """{dotted path or "module:name": why} of what an answer to ``ex`` must not name: its references
    (:meth:`~labkit.grading.registry.Exercise.reference_names`) and every kit function the withholding
    plan lists for it (:func:`labkit.grading.withhold.withheld`: those from which a reference is reached)."""
    out: dict[str, _Target] = {}
    for label in ex.reference_names():
        mod, _, qual = label.partition(":")
        top = f"{mod}:{qual.split('.')[0]}"
        t = _Target(top, f"a reference of {ex.id}")
        for key in {top, f"{mod}.{qual.split('.')[0]}", _home(top) if mod.startswith("labkit.") and
                    not mod.startswith("labkit.grading") else ""} - {""}:
            out[key] = t
    try:
        plan = withheld(notebook)
    except Exception:  # noqa: BLE001 - no plan (a kit without sources): the references alone
        plan = {}
    for label, ids in plan.items():
        if ex.id in ids and label not in out:
            out[label] = _Target(label, f"which reaches a reference of {ex.id} (withheld while it is graded)")
    return out


def _kit_bindings(cells) -> dict[str, str]:
    """{name: dotted path into labkit} the submission's cells bind: imports and from-imports (anywhere,
    aliases included), and top-level aliases (``f = simulate.bubble_formula``), in cell order."""
    bound: dict[str, str] = {}
    for _idx, src in cells:
        tree = _python(src)
        bind_kit_imports(tree, bound)
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                path = dotted_path(stmt.value, bound)
                if path:
                    bound[stmt.targets[0].id] = path
                else:  # the learner's own value under that name from here on
                    bound.pop(stmt.targets[0].id, None)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.pop(stmt.name, None)  # the learner's own function, even if a kit name came first
    return bound


def _named_references(defs: list[_Def], bound: dict[str, str], targets: dict[str, _Target]) -> list[Flag]:
    """A flag (cell, lines) for each place the answer's code (``defs``) names one of ``targets``:
    a from-import of it, a name bound to it, an attribute of a kit module that is it."""
    from .reach import _module_files

    modules = set(_module_files()) | {"labkit"}

    def hit(path: str) -> _Target | None:
        if not path.startswith("labkit") or path in modules:  # a module (``sim`` of ``sim.f``) names nothing
            return None
        lab = _label(path)
        for key in (path, lab, _home(lab) if lab else ""):
            if key and key in targets:
                return targets[key]
        return None

    flags: list[Flag] = []
    seen: set[tuple] = set()
    for d in defs:
        try:
            tree = ast.parse(d.text)
        except (SyntaxError, ValueError):
            continue
        # names the answer binds itself (arguments, assignments) are its own, not the kit's
        own = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
               for a in n.posonlyargs + n.args + n.kwonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
        own |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(tree):
            paths = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "labkit" and not node.level:
                paths = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                paths = [a.name for a in node.names]
            elif isinstance(node, ast.Attribute) or isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                paths = [dotted_path(node, bound, own)]
            for path in paths:
                t = hit(path)
                if t is None:
                    continue
                a = d.start + node.lineno - 1
                b = d.start + (node.end_lineno or node.lineno) - 1
                if (d.cell, a, t.label) in seen:
                    continue
                seen.add((d.cell, a, t.label))
                mod, _, name = t.label.partition(":")
                flags.append(Flag("names reference", f"names labkit's {name} ({mod}), {t.why}", d.cell, (a, b),
                                  1.0))
    return flags


# ---------------------------------------------------------------- the analysis
def _lines_of(defs: list[_Def], ranges) -> list[tuple[int, tuple[int, int]]]:
    """Character ranges of the joined answer text -> (cell, (first line, last line)) per definition."""
    out, pos = [], 0
    spans = []
    for d in defs:
        spans.append((pos, pos + len(d.text), d))
        pos += len(d.text) + 2
    for s, e in ranges:
        for a, b, d in spans:
            if s < b and e > a:
                first = d.start + d.text[: max(0, s - a)].count("\n")
                last = d.start + d.text[: max(0, min(e, b) - a)].count("\n")
                out.append((d.cell, (first, last)))
    merged: dict[int, tuple[int, int]] = {}
    for cell, (a, b) in out:
        lo, hi = merged.get(cell, (a, b))
        merged[cell] = (min(lo, a), max(hi, b))
    return sorted(merged.items())


@dataclass
class _Answer:
    defs: list[_Def]
    text: str
    upto: int = 0  # the code cells up to the exercise's grading point: cells[:upto] ran before it is graded


def _answers(path, notebook: str) -> dict[str, _Answer]:
    from .assignments import answer_name, grading_points
    from .registry import exercises_for_notebook

    cells = _code_cells(path)
    ids = [ex.id for ex in exercises_for_notebook(notebook)]
    points = grading_points(cells, ids)
    out = {}
    for ex_id in ids:
        k, name = points.get(ex_id), answer_name(ex_id, cells)
        if k is None or not name:
            continue
        defs = _closure(_definitions(cells[: k + 1]), name)
        if defs:
            out[ex_id] = _Answer(defs, "\n\n".join(d.text for d in defs), k + 1)
    return out


def analyse(path, notebook: str, name: str | None = None) -> list[Row]:
    """The rows of one submission (``path``, graded as assignment ``notebook``): one per exercise."""
    return analyse_batch([(name or Path(path).name, path)], notebook)


def analyse_batch(submissions, notebook: str) -> list[Row]:
    """Rows for ``submissions`` ([(name, path)]) of assignment ``notebook``, pairs compared,
    sorted by suspicion (highest first)."""
    from .registry import exercises_for_notebook

    starter = _starter(notebook)
    boiler = _boilerplate(starter)
    starter_set = set(starter)
    answers: dict[str, dict[str, _Answer]] = {}
    rows: list[Row] = []
    refs_cache: dict[str, list[tuple[str, str]]] = {}
    targets_cache: dict[str, dict[str, _Target]] = {}
    for name, path in submissions:
        try:
            answers[name] = _answers(path, notebook)
            cells = _code_cells(path)
        except Exception:  # noqa: BLE001 - not a notebook: the gradebook says so; nothing to read here
            answers[name] = {}
            cells = []
        dynamic = _dynamic(cells, starter_set)
        for ex in exercises_for_notebook(notebook):
            row = Row(name, ex.id)
            ans = answers[name].get(ex.id)
            best: list = []
            if ans is not None:
                if ex.id not in targets_cache:
                    targets_cache[ex.id] = _targets(notebook, ex)
                # the names as they stand when the exercise is graded (a later cell may rebind one)
                row.flags += _named_references(ans.defs, _kit_bindings(cells[: ans.upto]), targets_cache[ex.id])
                if ex.id not in refs_cache:
                    refs = _reference_sources(ex.id)
                    solved = _solved_answer(notebook, ex.id)
                    if solved:
                        refs.append((f"the solved notebook {notebook}, exercise {ex.id}", solved))
                    refs_cache[ex.id] = refs
                for ref_name, ref_src in refs_cache[ex.id]:
                    score, ranges = similarity(ans.text, ref_src, boiler)
                    if score > row.reference:
                        row.reference, row.reference_name = score, ref_name
                        best = ranges
                if row.reference >= FLAG_REFERENCE:
                    for cell, lines in _lines_of(ans.defs, best):
                        row.flags.append(Flag("reference", f"{row.reference:.0%} of the answer matches "
                                                           f"{row.reference_name}", cell, lines, row.reference))
            # dynamic code is listed once per submission, on its first exercise's row
            if ex.id == exercises_for_notebook(notebook)[0].id:
                row.flags += dynamic
            rows.append(row)
    by = {(r.submission, r.exercise): r for r in rows}
    names = [n for n, _ in submissions]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for ex_id, ans_a in answers[a].items():
                ans_b = answers[b].get(ex_id)
                if ans_b is None:
                    continue
                s_ab, r_ab = similarity(ans_a.text, ans_b.text, boiler)
                s_ba, r_ba = similarity(ans_b.text, ans_a.text, boiler)
                for me, other, s, r, ans in ((a, b, s_ab, r_ab, ans_a), (b, a, s_ba, r_ba, ans_b)):
                    row = by[(me, ex_id)]
                    if s > row.pair:
                        row.pair, row.pair_with = s, other
                        row.flags = [f for f in row.flags if f.kind != "pair"]
                        if s >= FLAG_PAIR:
                            for cell, lines in _lines_of(ans.defs, r):
                                row.flags.append(Flag("pair", f"{s:.0%} of the answer matches {other}'s", cell,
                                                      lines, s))
    rows.sort(key=lambda r: (-r.suspicion, r.submission, r.exercise))
    return rows


# ---------------------------------------------------------------- output
HEADER = ["submission", "exercise", "suspicion", "reference similarity", "closest reference", "pair similarity",
          "closest submission", "flags"]


def _flags_text(row: Row) -> str:
    return "; ".join(f"{f.where()}: {f.what}" for f in row.flags)


def _cells(row: Row) -> list[str]:
    return [row.submission, row.exercise, f"{row.suspicion:.2f}", f"{row.reference:.2f}", row.reference_name,
            f"{row.pair:.2f}", row.pair_with, _flags_text(row)]


def write_report(rows: list[Row], folder) -> tuple[Path, Path]:
    """``integrity.csv`` and ``integrity.html`` in ``folder``; their paths."""
    from .sheet import inert

    folder = Path(folder)
    csv_path, html_path = folder / "integrity.csv", folder / "integrity.html"
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for row in rows:
            cells = _cells(row)
            w.writerow([inert(c) if i in (0, 1, 4, 6, 7) else c for i, c in enumerate(cells)])
    esc = html.escape
    body = []
    for row in rows:
        cls = ' class="flagged"' if row.flagged else ""
        flags = "".join(f"<li><b>{esc(f.where())}</b>: {esc(f.what)}</li>" for f in row.flags)
        body.append(f"<tr{cls}><td>{esc(row.submission)}</td><td>{esc(row.exercise)}</td>"
                    f"<td>{row.suspicion:.2f}</td><td>{row.reference:.0%}<br><small>{esc(row.reference_name)}"
                    f"</small></td><td>{row.pair:.0%}<br><small>{esc(row.pair_with)}</small></td>"
                    f"<td><ul>{flags}</ul></td></tr>")
    html_path.write_text(
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>labkit integrity report</title><style>"
        "body{font-family:sans-serif} table{border-collapse:collapse} td,th{border:1px solid #ccc;padding:4px;"
        "vertical-align:top} tr.flagged{background:#fff3cd} ul{margin:0;padding-left:1.2em}</style></head><body>"
        "<h1>Integrity report</h1><p>For the instructor: it never changes a score. Similarity is the share of an "
        "answer's code (winnowed fingerprints, names and layout ignored, the starter code excluded) found in the "
        f"kit's reference source or solved notebook, or in another submission; rows from {FLAG_REFERENCE:.0%} "
        f"(reference) or {FLAG_PAIR:.0%} (pair), and rows with dynamic code or that name the exercise's reference, "
        "are highlighted. Sorted by "
        "suspicion.</p><table><tr><th>submission</th><th>exercise</th><th>suspicion</th><th>reference</th>"
        "<th>pair</th><th>flags (cell, lines)</th></tr>" + "".join(body) + "</table></body></html>\n",
        encoding="utf-8")
    return csv_path, html_path


def format_report(rows: list[Row]) -> str:
    """Plain text for the instructor-only output of one grade: the flagged rows, else one line."""
    flagged = [r for r in rows if r.flagged]
    if not flagged:
        return "integrity (instructor only, no effect on the score): nothing flagged"
    out = ["integrity (instructor only, no effect on the score):"]
    for r in flagged:
        out.append(f"  {r.submission} {r.exercise}: reference {r.reference:.0%}"
                   + (f" ({r.reference_name})" if r.reference_name else "")
                   + (f", pair {r.pair:.0%} with {r.pair_with}" if r.pair_with else "")
                   + (f"; {_flags_text(r)}" if r.flags else ""))
    return "\n".join(out)


def for_submissions(paths, assignment: str | None = None, names=None) -> list[Row]:
    """Rows for submission files ``paths`` (named ``names``, default their file names): each is
    read as ``assignment``, else as the notebook its metadata, file name or checks name
    (:func:`labkit.grading.which._notebook_names`); submissions of the same notebook are
    compared with each other. Sorted by suspicion. A file that is not a notebook is skipped."""
    from .which import _nbformat, _notebook_names

    names = list(names) if names is not None else [Path(p).name for p in paths]
    groups: dict[str, list] = {}
    for name, path in zip(names, paths):
        notebooks = [assignment] if assignment else []
        if not notebooks:
            try:
                notebooks = _notebook_names(_nbformat().read(str(path), as_version=4), Path(path))
            except Exception:  # noqa: BLE001
                continue
        for nb in notebooks:
            groups.setdefault(nb, []).append((name, path))
    rows = [r for nb, subs in groups.items() for r in analyse_batch(subs, nb)]
    rows.sort(key=lambda r: (-r.suspicion, r.submission, r.exercise))
    return rows
