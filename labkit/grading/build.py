"""``python -m labkit build``: write the learner notebooks ``notebooks/`` from ``solutions/``.

The solution notebooks are the single source. In a solution code cell the exercise cell starts
with a line ``# Exercise N.k: <one-line task>`` and the learner's part sits between the lines
``### BEGIN SOLUTION`` and ``### END SOLUTION`` (indented like the code around them). The
learner version of each notebook:

* replaces each region (markers included) with ``raise NotImplementedError("Exercise N.k: <task>")``
  at the region's indentation;
* clears every output and execution count, drops execution-timing metadata;
* tags exercise cells ``raises-exception`` so nbval and the grader accept the stub's exception
  (tag other cells that *use* an exercise's answer ``raises-exception`` in the solution);
* records ``metadata.labkit.notebook`` (the solution's stem) so the grader still knows the
  notebook when a learner renames the file;
* starts with :data:`INSTALL_CELL`, which installs labkit with one ``%pip`` line when the
  kernel's Python lacks it (Colab, a JupyterHub image with torch) and does nothing where labkit
  is installed (the repository's venv, the grader's kernel). ``LABKIT_PIP_SOURCE`` replaces
  the source it installs from.

Output is deterministic (nbformat's stable JSON, the solution's cell ids).

Stored outputs of the solutions (``--execute``):

* a notebook that imports one of labkit's plotting modules (:data:`PLOTTING_MODULES`) records a
  fingerprint of their code in ``metadata.labkit.plot_code``; ``--check`` names the notebook when
  the code has changed since (its stored figures are then stale: re-execute it). The fingerprint
  ignores docstrings and comments, so only a change to what is drawn counts;
* an interactive widget's stored output is replaced by one line saying that it appears in a live
  kernel (a notebook viewer would otherwise show the widget's ``VBox(children=...)`` text).

Usage::

    python -m labkit build                     # write notebooks/*.ipynb
    python -m labkit build --check             # exit 1 naming each notebook that is stale
    python -m labkit build --execute [NAME...] # re-run solutions (in place, nbclient), then build

NAME is a notebook stem or its number prefix ("01" or "01_pipeline_bubble").
"""
from __future__ import annotations

import ast
import copy
import hashlib
import os
import re
import sys
from pathlib import Path

import nbformat

from ..cliparse import Parser
from .install import INSTALL_CELL, INSTALL_CELL_ID, REPOSITORY_URL

__all__ = ["learner_version", "build_text", "build_all", "stale_notebooks", "reference_problems", "execute_notebook",
           "main",
           "notebooks_main", "packaged_notebooks", "INSTALL_CELL", "REPOSITORY_URL",
           "BuildError", "find_root", "PLOTTING_MODULES", "plot_code_fingerprint", "uses_plotting_code",
           "WIDGET_NOTE"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXERCISE_RE = re.compile(r"^\s*#\s*Exercise\s+(\d+(?:\.\d+)*)\s*:\s*(.+?)\s*$")
EXCEPTION_TAG = "raises-exception"
_DROP_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")


# labkit modules that draw the figures stored in solution notebooks (explorer draws with plot)
PLOTTING_MODULES = ("labkit.pipeline.plot", "labkit.pipeline.explorer")
WIDGET_NOTE = "[interactive widget: it appears when this cell runs in a live kernel]"
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class BuildError(ValueError):
    """A solution notebook that cannot be turned into a learner notebook (message names it)."""


def find_root(start: Path | None = None) -> Path:
    """The repository root: ``start`` (default: cwd) or a parent holding ``solutions/``,
    else the folder above the installed ``labkit`` package."""
    here = (start or Path.cwd()).resolve()
    for p in (here, *here.parents):
        if (p / "solutions").is_dir():
            return p
    return Path(__file__).resolve().parents[2]


def _exercise_header(source: str):
    for line in source.splitlines():
        if line.strip():
            m = EXERCISE_RE.match(line)
            return (m.group(1), m.group(2)) if m else None
    return None


def _stub_source(source: str, where: str) -> str:
    """Replace each solution region of ``source`` by the NotImplementedError stub."""
    header = _exercise_header(source)
    if header is None:
        raise BuildError(f"{where}: a cell with '{BEGIN}' must start with '# Exercise N.k: <task>'")
    ex_id, task = header
    message = f"Exercise {ex_id}: {task}".replace("\\", "\\\\").replace('"', '\\"')
    out, inside, indent = [], False, ""
    for n, line in enumerate(source.split("\n"), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise BuildError(f"{where}, line {n}: '{BEGIN}' inside another solution region")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("{message}")')
        elif stripped == END:
            if not inside:
                raise BuildError(f"{where}, line {n}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise BuildError(f"{where}: '{BEGIN}' is never closed by '{END}'")
    return "\n".join(out)


def learner_version(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The learner notebook for solution notebook ``nb`` (stem ``name``); ``nb`` is unchanged."""
    nb = copy.deepcopy(nb)
    for i, cell in enumerate(nb.cells, 1):
        for key in _DROP_CELL_METADATA:
            cell.metadata.pop(key, None)
        where = f"solutions/{name}.ipynb, cell {i}"
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            if any(l.strip() == BEGIN for l in cell.source.splitlines()):
                cell.source = _stub_source(cell.source, where)
                tags = list(cell.metadata.get("tags", []))
                if EXCEPTION_TAG not in tags:
                    tags.append(EXCEPTION_TAG)
                cell.metadata["tags"] = tags
            elif any(l.strip() == END for l in cell.source.splitlines()):
                raise BuildError(f"{where}: '{END}' without '{BEGIN}'")
        elif BEGIN in cell.source:
            raise BuildError(f"{where}: solution regions are only allowed in code cells")
    nb.metadata["labkit"] = {"notebook": name}
    nb.metadata.pop("widgets", None)
    install = nbformat.v4.new_code_cell(INSTALL_CELL)
    install.id = INSTALL_CELL_ID
    nb.cells.insert(0, install)
    return nb


def build_text(solution_path: Path) -> str:
    """The exact text ``build`` writes for ``solution_path``."""
    nb = nbformat.read(str(solution_path), as_version=4)
    learner = learner_version(nb, solution_path.stem)
    nbformat.validate(learner)
    return nbformat.writes(learner) + "\n"


def _module_path(module: str) -> Path:
    package_root = Path(__file__).resolve().parents[2]  # the folder holding labkit/
    return package_root.joinpath(*module.split(".")).with_suffix(".py")


def _code_only(source: str) -> str:
    """The module's code without docstrings or comments (``ast.dump`` of the tree)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def plot_code_fingerprint() -> str:
    """16 hex digits of SHA-256 over the code (docstrings and comments left out) of every module in
    :data:`PLOTTING_MODULES`: it changes exactly when what those modules draw may have changed."""
    h = hashlib.sha256()
    for module in PLOTTING_MODULES:
        h.update(module.encode() + b"\0" + _code_only(_module_path(module).read_text(encoding="utf-8")).encode())
    return h.hexdigest()[:16]


def uses_plotting_code(nb: nbformat.NotebookNode) -> bool:
    """Whether a code cell of ``nb`` imports one of :data:`PLOTTING_MODULES` (``from M import`` or
    ``import M``)."""
    pattern = re.compile(r"^\s*(?:from\s+(?:%s)\s+import|import\s+(?:%s)\b)" % (
        "|".join(map(re.escape, PLOTTING_MODULES)), "|".join(map(re.escape, PLOTTING_MODULES))), re.M)
    return any(c.cell_type == "code" and pattern.search(c.source) for c in nb.cells)


def _stale_figures(sol: Path) -> str | None:
    nb = nbformat.read(str(sol), as_version=4)
    if not uses_plotting_code(nb):
        return None
    stored = nb.metadata.get("labkit", {}).get("plot_code")
    if stored == plot_code_fingerprint():
        return None
    mods = " / ".join(str(_module_path(m).relative_to(_module_path(m).parents[2])) for m in PLOTTING_MODULES)
    why = "were drawn before the plotting code last changed" if stored else "carry no record of the plotting code"
    return (f"solutions/{sol.name}: its stored figures {why} ({mods}); run "
            f"`python -m labkit build --execute {sol.stem.split('_')[0]}`")


def _solutions(root: Path) -> list[Path]:
    return sorted((root / "solutions").glob("*.ipynb"))


def build_all(root: Path) -> list[Path]:
    """Write ``notebooks/NAME.ipynb`` for every ``solutions/NAME.ipynb``; return the written paths."""
    out_dir = root / "notebooks"
    out_dir.mkdir(exist_ok=True)
    written = []
    for sol in _solutions(root):
        target = out_dir / sol.name
        text = build_text(sol)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


def stale_notebooks(root: Path) -> list[str]:
    """Descriptions of each ``notebooks/`` file that differs from what ``build`` would write."""
    problems = []
    sols = _solutions(root)
    for sol in sols:
        target = root / "notebooks" / sol.name
        if not target.exists():
            problems.append(f"notebooks/{sol.name} is missing")
        elif target.read_text(encoding="utf-8") != build_text(sol):
            problems.append(f"notebooks/{sol.name} is stale (differs from solutions/{sol.name})")
    for sol in sols:
        stale = _stale_figures(sol)
        if stale:
            problems.append(stale)
    names = {s.name for s in sols}
    for extra in sorted((root / "notebooks").glob("*.ipynb")):
        if extra.name not in names:
            problems.append(f"notebooks/{extra.name} has no solutions/{extra.name}")
    return problems


def reference_problems(root: Path) -> list[str]:
    """Each shipped learner cell (as ``build`` would write it) or kernel-side helper that needs an
    exercise's reference, or a kit function that reaches one, before the exercise is graded
    (:func:`labkit.grading.withhold.problems`): the graded kernel does without them until then.
    Imports the exercise modules (and torch)."""
    import json

    from .withhold import problems

    out = []
    for sol in _solutions(root):
        nb = json.loads(build_text(sol))
        cells = ["".join(c.get("source", "")) for c in nb.get("cells", []) if c.get("cell_type") == "code"]
        out += problems(sol.stem, cells)
    return out


def execute_notebook(path: Path, timeout: int = 600) -> None:
    """Execute ``path`` in place with nbclient (kernel ``python3`` of this environment), with
    ``LABKIT_STRICT=1`` so a failing check stops it; outputs are saved, timing is not. Widget
    outputs become :data:`WIDGET_NOTE`; a notebook that uses :data:`PLOTTING_MODULES` records
    :func:`plot_code_fingerprint` in ``metadata.labkit.plot_code``."""
    from nbclient import NotebookClient

    nb = nbformat.read(str(path), as_version=4)
    env = dict(os.environ, LABKIT_STRICT="1")
    env.pop("LABKIT_RESULTS_FILE", None)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=env)
    for cell in nb.cells:
        for key in _DROP_CELL_METADATA:
            cell.metadata.pop(key, None)
        for out in cell.get("outputs", []):
            if _WIDGET_MIME in out.get("data", {}):
                out["data"] = {"text/plain": WIDGET_NOTE}
                out["metadata"] = {}
    nb.metadata.pop("widgets", None)  # the widgets' state: their views are gone
    meta = dict(nb.metadata.get("labkit", {}))
    meta.pop("plot_code", None)
    if uses_plotting_code(nb):
        meta["plot_code"] = plot_code_fingerprint()
    if meta:
        nb.metadata["labkit"] = meta
    else:
        nb.metadata.pop("labkit", None)
    nbformat.write(nb, str(path))


def _select(root: Path, names: list[str]) -> list[Path]:
    sols = _solutions(root)
    if not names:
        return sols
    chosen = []
    for name in names:
        stem = Path(name).stem
        hits = [s for s in sols if s.stem == stem or s.stem.split("_")[0] == stem]
        if not hits:
            raise BuildError(f"no solution notebook matches {name!r}; have {', '.join(s.stem for s in sols)}")
        chosen += [h for h in hits if h not in chosen]
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m labkit build", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="fail (exit 1) when notebooks/ is stale, or a shipped cell needs an exercise's reference "
                        "before the exercise is graded")
    p.add_argument("--execute", nargs="*", metavar="NAME", default=None,
                   help="execute these solution notebooks (all when none named) in place first")
    p.add_argument("--root", type=Path, default=None, help="repository root (default: found from cwd)")
    a = p.parse_args(argv)
    root = a.root.resolve() if a.root else find_root()
    if not (root / "solutions").is_dir():
        print(f"error: found no solutions/ folder in {root} or above {Path.cwd()}: `build` runs in a checkout of the "
              f"repository (the learner notebooks of an installed labkit: python -m labkit notebooks)", file=sys.stderr)
        return 2
    try:
        if a.execute is not None:
            for path in _select(root, a.execute):
                print(f"executing solutions/{path.name}", flush=True)
                execute_notebook(path)
        if a.check:
            problems = stale_notebooks(root) + reference_problems(root)
            for line in problems:
                print(line, file=sys.stderr)
            if problems:
                print("run `python -m labkit build` and commit notebooks/ (a cell that needs a reference: move it "
                      "after its exercise)", file=sys.stderr)
                return 1
            print(f"{_shown(root / 'notebooks')}/ is up to date ({len(_solutions(root))} notebooks)")
            return 0
        for path in build_all(root):
            print(f"wrote {_shown(path)}")
    except BuildError as e:
        print(f"build error: {e}", file=sys.stderr)
        return 2
    return 0


def _shown(path: Path) -> Path:
    """``path`` relative to the working folder when it lies inside it, else whole (``build`` run
    outside the checkout works on the checkout above the installed package: say where)."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def packaged_notebooks(kind: str = "notebooks") -> list[Path]:
    """The notebooks shipped with labkit: ``kind`` "notebooks" (learner versions) or "solutions".

    They are package data (``labkit/_notebooks`` and ``labkit/_solutions``, which link to the
    repository's ``notebooks/`` and ``solutions/``), so an installed wheel has them too."""
    folder = Path(__file__).resolve().parents[1] / ("_notebooks" if kind == "notebooks" else "_solutions")
    return sorted(folder.glob("*.ipynb"))


def notebooks_main(argv: list[str] | None = None) -> int:
    """``python -m labkit notebooks [DEST] [--solutions] [--force]``: copy the learner notebooks
    (and, when asked, the solutions into DEST/solutions) out of the installed labkit. A file
    already in DEST is kept (it may hold a learner's work) unless ``--force``."""
    import shutil

    p = Parser(prog="python -m labkit notebooks",
               description="Copy the learner notebooks shipped with labkit into a folder "
                           "(Colab, JupyterHub, a laptop).")
    p.add_argument("dest", nargs="?", type=Path, default=Path("labkit-notebooks"), help="folder to copy into")
    p.add_argument("--solutions", action="store_true", help="also copy the complete notebooks into DEST/solutions")
    p.add_argument("--force", action="store_true", help="replace notebooks already in DEST")
    a = p.parse_args(argv)
    if a.dest.exists() and not a.dest.is_dir():
        print(f"error: {a.dest} exists and is not a folder", file=sys.stderr)
        return 2
    jobs = [(f, a.dest / f.name) for f in packaged_notebooks("notebooks")]
    if a.solutions:
        jobs += [(f, a.dest / "solutions" / f.name) for f in packaged_notebooks("solutions")]
    if not jobs:
        print("error: this labkit was installed without its notebooks (labkit/_notebooks is empty); "
              f"install it from a wheel or a checkout of {REPOSITORY_URL}", file=sys.stderr)
        return 1
    copied, kept = 0, []
    for src, dst in jobs:
        if dst.exists() and not a.force:
            kept.append(dst.name)
            continue
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
        except OSError as e:
            print(f"error: cannot write {dst}: {e.strerror or e}" + (f" ({copied} copied before it)" if copied else ""),
                  file=sys.stderr)
            return 1 if copied else 2  # nothing copied: DEST itself cannot be written
        copied += 1
    print(f"copied {copied} notebooks into {a.dest}" + (" (learner versions and solutions/)" if a.solutions else ""))
    if kept:
        print(f"kept {len(kept)} already there (your work; --force replaces them): {', '.join(kept)}")
    print(f"open them with: jupyter lab {a.dest}")
    return 0
