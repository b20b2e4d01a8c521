"""``python -m labkit build``: write the learner notebooks ``notebooks/`` from ``solutions/``.

The solution notebooks are the single source (the format and the options: ``docs/authoring.md``).
The learner version of each notebook:

* replaces each region between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` (markers included)
  with ``raise NotImplementedError("Exercise N.k: <task>")`` at the region's indentation, the
  task from the cell's first line ``# Exercise N.k: <task>``;
* clears every output and execution count, drops execution-timing metadata;
* tags exercise cells ``raises-exception`` so nbval and the grader accept the stub's exception;
* leaves out the cells tagged ``solution-only`` (:data:`SOLUTION_ONLY_TAG`): results and summaries that
  state an exercise's answer, which the learner must not see before the exercise is graded;
* records ``metadata.labkit.notebook`` (the solution's stem) so the grader still knows the
  notebook when a learner renames the file;
* starts with the install cell (:func:`labkit.grading.install.install_cell`), for the course's
  repository, ``[tool.labkit] repository`` in ``pyproject.toml`` (``build --repository URL``
  records it there and in ``[project.urls]``).

Output is deterministic (nbformat's stable JSON, the solution's cell ids). ``--execute`` re-runs
solutions in place: a notebook that imports one of :data:`PLOTTING_MODULES` records a fingerprint
of their code (docstrings and comments left out), so ``--check`` names it when its stored figures
are stale; a widget's stored output becomes :data:`WIDGET_NOTE`.
"""
from __future__ import annotations

import ast
import copy
import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat

from ..cliparse import Parser
from .install import INSTALL_CELL, INSTALL_CELL_ID, install_cell, repository_problem

__all__ = ["learner_version", "build_text", "build_all", "stale_notebooks", "reference_problems", "execute_notebook",
           "main", "notebooks_main", "packaged_notebooks", "INSTALL_CELL", "install_cell", "configured_repository",
           "set_repository", "project_urls_problem", "write_whole",
           "BuildError", "find_root", "PLOTTING_MODULES", "plot_code_fingerprint", "uses_plotting_code",
           "WIDGET_NOTE", "SOLUTION_ONLY_TAG"]

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
EXERCISE_RE = re.compile(r"^\s*#\s*Exercise\s+(\d+(?:\.\d+)*)\s*:\s*(.+?)\s*$")
EXCEPTION_TAG = "raises-exception"
SOLUTION_ONLY_TAG = "solution-only"  # a cell kept in solutions/ only (it states an exercise's answer)
_DROP_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")


# labkit modules that draw the figures stored in solution notebooks (explorer draws with plot)
PLOTTING_MODULES = ("labkit.pipeline.plot", "labkit.pipeline.explorer")
WIDGET_NOTE = "[interactive widget: it appears when this cell runs in a live kernel]"
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class BuildError(ValueError):
    """A solution notebook that cannot be turned into a learner notebook (message names it)."""


def find_root(start: Path | None = None) -> Path:
    """The repository root: ``start`` (default: cwd) or the nearest parent holding ``solutions/``;
    ``start`` itself when none does (``build`` then refuses: it works on the checkout you stand in,
    never on the one an editable install points at, whose notebooks it would rewrite unasked)."""
    here = (start or Path.cwd()).resolve()
    for p in (here, *here.parents):
        if (p / "solutions").is_dir():
            return p
    return here


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


def learner_version(nb: nbformat.NotebookNode, name: str, repository: str | None = None) -> nbformat.NotebookNode:
    """The learner notebook for solution notebook ``nb`` (stem ``name``); ``nb`` is unchanged. Its
    first cell installs labkit from ``repository`` (none: it says how to install labkit)."""
    nb = copy.deepcopy(nb)
    nb.cells = [c for c in nb.cells if SOLUTION_ONLY_TAG not in c.metadata.get("tags", [])]
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
    install = nbformat.v4.new_code_cell(install_cell(repository))
    install.id = INSTALL_CELL_ID
    nb.cells.insert(0, install)
    return nb


def build_text(solution_path: Path, repository: str | None = None) -> str:
    """The exact text ``build`` writes for ``solution_path`` (first cell for ``repository``)."""
    nb = nbformat.read(str(solution_path), as_version=4)
    learner = learner_version(nb, solution_path.stem, repository)
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


# ---- the course's repository: [tool.labkit] repository in pyproject.toml ---------------------------------------
_TOOL_HEADER = "[tool.labkit]"
_URLS_HEADER = "[project.urls]"


def _tables(text: str) -> list[tuple[str, int, int]]:
    """(header, start, end) of each ``[table]`` of a TOML text: from its header line to the next."""
    heads = [(m.group(1).strip(), m.start()) for m in re.finditer(r"^(\[[^\[\]\n]+\])[ \t]*(?:#.*)?$", text, re.M)]
    return [(h, start, heads[i + 1][1] if i + 1 < len(heads) else len(text)) for i, (h, start) in enumerate(heads)]


def _table(text: str, header: str) -> tuple[int, int] | None:
    for h, start, end in _tables(text):
        if h == header:
            return start, end
    return None


def configured_repository(root: Path) -> str | None:
    """The course's repository, ``[tool.labkit] repository`` in ``root/pyproject.toml`` (None when
    unset, empty, or there is no pyproject.toml). BuildError for a value that is not an https URL
    of a git repository (:func:`labkit.grading.install.repository_problem`)."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    span = _table(text, _TOOL_HEADER)
    if span is None:
        return None
    m = re.search(r'^repository\s*=\s*(?:"([^"\n]*)"|\'([^\'\n]*)\')\s*(?:#.*)?$', text[span[0]:span[1]], re.M)
    url = (m.group(1) if m.group(1) is not None else m.group(2)) if m else ""
    if not url:
        return None
    problem = repository_problem(url)
    if problem:
        raise BuildError(f"pyproject.toml, [tool.labkit]: {problem}")
    return url


def _project_urls(repository: str | None) -> str:
    if not repository:
        return ""
    home = repository.split("@")[0].removesuffix(".git") if "@" in repository.split("//", 1)[-1] else \
        repository.removesuffix(".git")
    return (f"{_URLS_HEADER}\n# written by `python -m labkit build` from [tool.labkit] repository\n"
            f'Homepage = "{home}"\nRepository = "{home}"\n\n')


def _with_project_urls(text: str, repository: str | None) -> str:
    span = _table(text, _URLS_HEADER)
    if span is not None:
        text = text[:span[0]] + text[span[1]:]
    block = _project_urls(repository)
    if block:
        after = _table(text, "[project]")
        nxt = [s for h, s, _ in _tables(text) if after and s >= after[1]]
        at = nxt[0] if nxt else len(text)
        text = text[:at] + block + text[at:]
    return text


def project_urls_problem(root: Path, repository: str | None) -> str:
    """What is stale in ``root/pyproject.toml``'s ``[project.urls]`` ("" when it matches ``repository``)."""
    path = root / "pyproject.toml"
    if not path.is_file():
        return ""
    text = path.read_text(encoding="utf-8")
    if _with_project_urls(text, repository) != text:
        want = f"name {repository}" if repository else "be absent ([tool.labkit] repository is not set)"
        return f"pyproject.toml: [project.urls] should {want}"
    return ""


def _write_project_urls(root: Path, repository: str | None) -> None:
    path = root / "pyproject.toml"
    if path.is_file():
        text = path.read_text(encoding="utf-8")
        new = _with_project_urls(text, repository)
        if new != text:
            path.write_text(new, encoding="utf-8")


def set_repository(root: Path, repository: str) -> None:
    """Record ``repository`` ("" clears it) as ``[tool.labkit] repository`` in ``root/pyproject.toml``
    (the table is added when missing). BuildError for a URL that
    :func:`labkit.grading.install.repository_problem` refuses or a missing pyproject.toml."""
    if repository:
        problem = repository_problem(repository)
        if problem:
            raise BuildError(problem)
    path = root / "pyproject.toml"
    if not path.is_file():
        raise BuildError(f"--repository: no pyproject.toml in {root} to record it in")
    text = path.read_text(encoding="utf-8")
    line = f'repository = "{repository}"'
    span = _table(text, _TOOL_HEADER)
    if span is None:
        text = text.rstrip("\n") + f"\n\n{_TOOL_HEADER}\n{line}\n"
    else:
        body = text[span[0]:span[1]]
        new, n = re.subn(r"^repository\s*=.*$", line, body, count=1, flags=re.M)
        if not n:
            head, _, rest = body.partition("\n")
            new = f"{head}\n{line}\n{rest}"
        text = text[:span[0]] + new + text[span[1]:]
    path.write_text(text, encoding="utf-8")


def _solutions(root: Path) -> list[Path]:
    return sorted((root / "solutions").glob("*.ipynb"))


PACKAGED = ("labkit", "_notebooks")  # the learner notebooks a wheel or `pip install` of a checkout ships


def _targets(root: Path) -> list[Path]:
    """Where ``build`` writes the learner notebooks: ``notebooks/`` (what a learner of a checkout opens and
    edits) and, in a checkout of labkit, ``labkit/_notebooks/`` (the package data ``pip install`` ships:
    built from solutions/, never the working tree's edited copies; issue 36)."""
    folders = [root / "notebooks"]
    if (root / PACKAGED[0] / "__init__.py").is_file():
        folders.append(root.joinpath(*PACKAGED))
    return folders


def build_all(root: Path) -> list[Path]:
    """Write ``notebooks/NAME.ipynb`` (and ``labkit/_notebooks/NAME.ipynb`` in a checkout) for every
    ``solutions/NAME.ipynb`` (first cell for the :func:`configured_repository`) and ``pyproject.toml``'s
    ``[project.urls]``; return the written notebook paths."""
    repository = configured_repository(root)
    _write_project_urls(root, repository)
    written = []
    for out_dir in _targets(root):
        if out_dir.is_symlink():  # an older checkout linked the package data to notebooks/
            out_dir.unlink()
        out_dir.mkdir(exist_ok=True)
        for sol in _solutions(root):
            target = out_dir / sol.name
            text = build_text(sol, repository)
            if not target.exists() or target.read_text(encoding="utf-8") != text:
                write_whole(target, text.encode("utf-8"))
            written.append(target)
        if out_dir != root / "notebooks":
            for extra in sorted(out_dir.glob("*.ipynb")):
                if extra.name not in {s.name for s in _solutions(root)}:
                    extra.unlink()  # the package ships exactly the built notebooks
    return written


def write_whole(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` (file mode ``mode``) all or nothing (a new file beside it, renamed over
    it): a Ctrl-C or a full disk leaves the old file or none, never half of it. OSError as the system says."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def stale_notebooks(root: Path) -> list[str]:
    """Descriptions of each ``notebooks/`` (and ``labkit/_notebooks/``) file that differs from what ``build``
    would write."""
    repository = configured_repository(root)
    problems = [p for p in [project_urls_problem(root, repository)] if p]
    sols = _solutions(root)
    for out_dir in _targets(root):
        shown = out_dir.relative_to(root).as_posix()
        if out_dir.is_symlink():
            problems.append(f"{shown} is a link to {os.readlink(out_dir)}: it must hold the notebooks as built")
            continue
        for sol in sols:
            target = out_dir / sol.name
            if not target.exists():
                problems.append(f"{shown}/{sol.name} is missing")
            elif target.read_text(encoding="utf-8") != build_text(sol, repository):
                problems.append(f"{shown}/{sol.name} is stale (differs from solutions/{sol.name})")
        names = {s.name for s in sols}
        for extra in sorted(out_dir.glob("*.ipynb")):
            if extra.name not in names:
                problems.append(f"{shown}/{extra.name} has no solutions/{extra.name}")
    for sol in sols:
        stale = _stale_figures(sol)
        if stale:
            problems.append(stale)
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
    p.add_argument("--repository", metavar="URL", default=None,
                   help="record URL (an https git repository; \"\" clears it) as [tool.labkit] repository in "
                        "pyproject.toml: the learner notebooks' first cell installs labkit from git+URL on Colab "
                        "or JupyterHub, and [project.urls] names it (unset: the cell says how to install labkit)")
    a = p.parse_args(argv)
    root = a.root.resolve() if a.root else find_root()
    if not (root / "solutions").is_dir():
        print(f"error: found no solutions/ folder in {root}{'' if a.root else ' or above it'}: `build` works on the "
              f"checkout you stand in (or --root DIR) and on no other; the learner notebooks of an installed labkit: "
              f"python -m labkit notebooks", file=sys.stderr)
        return 2
    try:
        if a.repository is not None:
            if a.check:
                raise BuildError("--repository changes pyproject.toml and the notebooks: run it without --check")
            set_repository(root, a.repository.strip())
            print(f"pyproject.toml: [tool.labkit] repository = {a.repository.strip()!r}")
        if a.execute is not None:
            for path in _select(root, a.execute):
                print(f"executing solutions/{path.name}", flush=True)
                execute_notebook(path)
        if a.check:
            problems = stale_notebooks(root) + reference_problems(root)
            for line in problems:
                print(line, file=sys.stderr)
            if problems:
                print("run `python -m labkit build` and commit notebooks/ and labkit/_notebooks/ (a cell that needs a "
                      "reference before its exercise: move it after the exercise)", file=sys.stderr)
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

    They are package data (``labkit/_notebooks``, written by ``build`` from the solutions, and
    ``labkit/_solutions``, which links to the repository's ``solutions/``), so an installed wheel has them too."""
    folder = Path(__file__).resolve().parents[1] / ("_notebooks" if kind == "notebooks" else "_solutions")
    return sorted(folder.glob("*.ipynb"))


def _bad_destination(dest: Path, jobs, force: bool) -> str | None:
    """Why the copy ``jobs`` ``[(src, dst)]`` cannot all be written under ``dest``, or None: a folder
    on the way that is a file (``DEST/solutions`` a file), a notebook's place taken by a folder
    (or, with ``force``, by something that is not a file), a folder that cannot be made or
    written in (tried: what is made to find out is removed again)."""
    from ..labs import bad_out

    folders = sorted({dst.parent for _, dst in jobs})
    for folder in folders:
        for q in (folder, *folder.parents):
            if q.exists() or q.is_symlink():
                if not q.is_dir():
                    return f"{q} exists and is a file, not a folder: the notebooks go into {folder}/"
                break
    for _, dst in jobs:
        if dst.is_dir() or (force and dst.exists() and not dst.is_file()):
            return f"{dst} exists and is not a file: it cannot be replaced by the notebook {dst.name}"
    for folder in folders:
        why = bad_out(folder, "DEST")
        if why:
            return f"cannot write {folder}/: {why.split(': ', 1)[1]}"
    return None


def notebooks_main(argv: list[str] | None = None) -> int:
    """``python -m labkit notebooks [DEST] [--solutions] [--force]``: copy the learner notebooks
    (and, when asked, the solutions into DEST/solutions) out of the installed labkit. A file
    already in DEST is kept (it may hold a learner's work) unless ``--force``."""
    p = Parser(prog="python -m labkit notebooks",
               description="Copy the learner notebooks shipped with labkit into a folder "
                           "(Colab, JupyterHub, a laptop).")
    p.add_argument("dest", nargs="?", type=Path, default=Path("labkit-notebooks"), help="folder to copy into")
    p.add_argument("--solutions", action="store_true", help="also copy the complete notebooks into DEST/solutions")
    p.add_argument("--force", action="store_true", help="replace notebooks already in DEST")
    a = p.parse_args(argv)
    a.dest = a.dest.expanduser()  # '~/nb' quoted in a shell (or from a notebook's !cell) is the home folder's nb
    if a.dest.exists() and not a.dest.is_dir():
        print(f"error: {a.dest} exists and is not a folder", file=sys.stderr)
        return 2
    jobs = [(f, a.dest / f.name) for f in packaged_notebooks("notebooks")]
    if a.solutions:
        jobs += [(f, a.dest / "solutions" / f.name) for f in packaged_notebooks("solutions")]
    bad = _bad_destination(a.dest, jobs, a.force)
    if bad:   # checked before anything is copied: a half copy is worse than none
        print(f"error: {bad}", file=sys.stderr)
        return 2
    if not jobs:
        print("error: this labkit was installed without its notebooks (labkit/_notebooks is empty); "
              "install it from a wheel (pip wheel . in a checkout) or from a checkout (pip install .)", file=sys.stderr)
        return 1
    copied, kept = 0, []
    for src, dst in jobs:
        if dst.exists() and not a.force:
            kept.append(dst.name)
            continue
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            write_whole(dst, src.read_bytes())
        except OSError as e:
            print(f"error: cannot write {dst}: {e.strerror or e}" + (f" ({copied} copied before it)" if copied else ""),
                  file=sys.stderr)
            return 1 if copied else 2  # nothing copied: DEST itself cannot be written
        copied += 1
    print(f"copied {copied} notebooks into {a.dest}" + (" (learner versions and solutions/)" if a.solutions else ""))
    if kept:
        print(f"kept {len(kept)} already there (your work; --force replaces them): {', '.join(kept)}")
    print(_open_with(a.dest))
    return 0


def _open_with(dest: Path) -> str:
    """How to open ``dest``: with Jupyter where this environment has it, else how to get it (issue 36: a venv
    with only torch and labkit was told to run `jupyter lab`, which it does not have)."""
    import importlib.util
    import shlex
    import shutil

    where = shlex.quote(str(dest))
    if importlib.util.find_spec("jupyterlab") is not None or shutil.which("jupyter-lab"):
        return f"open them with: jupyter lab {where}"
    if importlib.util.find_spec("notebook") is not None or shutil.which("jupyter-notebook"):
        return f"open them with: jupyter notebook {where}"
    return (f"this Python has no Jupyter to open them: install it with `{shlex.quote(sys.executable)} -m pip install "
            f"'labkit[lab]'` (or `pip install jupyterlab`), then run: jupyter lab {where}; on Colab or a "
            f"JupyterHub, upload or open the folder there instead")
