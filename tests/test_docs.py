"""The README and docs/ stay true: every ``python -m labkit ...``, ``torchrun ... -m labkit...`` and
``make ...`` line they show runs (with ``--help``, or ``make -n``) and takes the options it is
shown with; every relative link, anchor and file path exists; each options table lists exactly
the options of its command; the notebook table in docs/learners.md matches solutions/; the README
stays a start page (under 8,000 characters). No lab is run: ``--help`` parses in-process."""
from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# command lines outside the pages that the pages send a reader to run
SCRIPTS = [ROOT / "examples" / "slurm" / "lab3d.sbatch"]
# link targets another issue writes (the grading contract, issue "grade-core"): allowed while missing,
# and the test fails once one exists, so that it is taken off this list
PENDING: set = set()
# notebooks another issue adds (issue "torch": notebook 17), listed in docs/learners.md ahead of it; the same rule
PENDING_NOTEBOOKS: set = set()

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"^(?:\.\./)?(?:labkit|tests|examples|solutions|notebooks|docs|\.ci)/[A-Za-z0-9_./-]*$"
                  r"|^(?:Makefile|pyproject\.toml|requirements\.txt|README\.md|conftest\.py)$")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _code(path: Path) -> list[str]:
    """Every shell line of ``path``: fenced blocks (continuations joined, comments dropped) and inline spans."""
    text = _text(path)
    if path.suffix != ".md":
        blocks, spans = [text], []
    else:
        blocks = [m.group(1) for m in FENCE.finditer(text) if not m.group(0).startswith(("```python", "```text"))]
        spans = INLINE.findall(FENCE.sub("", text))
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].split("  #")[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines + [s.strip() for s in spans]


def _commands(kind: str) -> list[tuple[str, str]]:
    """(where, line) for each line of the pages and scripts that runs labkit (``kind`` "labkit"), torchrun
    (``kind`` "torchrun") or make (``kind`` "make")."""
    out = []
    for path in PAGES + SCRIPTS:
        for line in _code(path):
            words = line.split()
            if kind == "labkit" and "-m labkit" in line and "torchrun" not in line and "pytest" not in line \
                    and re.search(r"python3? -m labkit(\s|$)", line):
                out.append((path.name, line))
            elif kind == "torchrun" and "torchrun" in words[:3] + [w.rsplit("/", 1)[-1] for w in words[:3]] \
                    and "-m" in words:
                out.append((path.name, line))
            elif kind == "make" and words[0] == "make" and len(words) > 1:
                out.append((path.name, line))
    return sorted(set(out))


@lru_cache(maxsize=None)
def _help(*argv: str) -> str:
    """What ``python -m labkit *argv --help`` prints (in-process); fails the test on a non-zero exit."""
    from labkit.__main__ import _main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = _main([*argv, "--help"])
        except SystemExit as e:
            rc = e.code
    assert rc in (0, None), f"python -m labkit {' '.join(argv)} --help exited {rc}: {buf.getvalue()[-500:]}"
    return buf.getvalue()


def _options_of(help_text: str) -> list[set[str]]:
    """The options an argparse help lists, one set of spellings per option (-h/--help left out)."""
    found = []
    for line in help_text.splitlines():
        m = re.match(r"^  (-[^ ].*?)(?:  |$)", line)
        if m:
            names = {w.rstrip(",") for w in m.group(1).split() if w.startswith("-")}
            if names - {"-h", "--help"}:
                found.append(names)
    return found


def _known(help_text: str) -> set[str]:
    return set().union(*_options_of(help_text)) | {"-h", "--help"}


def _labkit_argv(line: str) -> list[str]:
    words = shlex.split(line)
    return words[words.index("labkit") + 1:]


def _help_key(argv: list[str]) -> tuple[str, ...]:
    from labkit.commands import BENCHES, LABS

    if not argv or argv[0].startswith("-"):
        return ()
    if argv[0] in ("lab", "bench"):
        names = LABS if argv[0] == "lab" else BENCHES
        assert len(argv) > 1 and argv[1] in names, f"{' '.join(argv)}: {argv[0]} needs one of {names}"
        return (argv[0], argv[1])
    return (argv[0],)


def _flags(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if re.match(r"^--?[A-Za-z]", w)]


def _lab_problem(name: str, argv: list[str], world: int | None = None) -> str | None:
    """What a lab says about ``argv`` before any rank starts (its rules, options without effect):
    ``harness.prepare`` without loading the corpus; ``world``: torchrun's WORLD_SIZE."""
    from labkit.commands import lab

    the_lab = lab(name, argv)
    p = the_lab.parser()
    p.defer_needs = True
    a = p.parse_args(list(argv))
    return the_lab.resolve(a, world) or p.unneeded(a) or the_lab.check(a)


@pytest.mark.parametrize("where, line", _commands("labkit"))
def test_every_labkit_command_line_runs_with_help_and_takes_its_options(where, line):
    argv = _labkit_argv(line)
    key = _help_key(argv)
    text = _help(*key)
    unknown = [f for f in _flags(argv[len(key):]) if f not in _known(text)] if key else []
    assert not unknown, f"{where}: `{line}`: python -m labkit {' '.join(key)} has no option {unknown}"
    if key[:1] == ("lab",) and "--help" not in argv:   # the lab takes these options together
        bad = _lab_problem(key[1], argv[2:])
        assert not bad, f"{where}: `{line}`: the lab refuses it: {bad}"


@pytest.mark.parametrize("where, line", _commands("torchrun"))
def test_every_torchrun_line_names_a_lab_module_and_its_options(where, line):
    import importlib

    from labkit.commands import LAB_MODULES

    words = shlex.split(line)
    module = words[words.index("-m") + 1]
    assert module.startswith("labkit.labs.") and module.rsplit(".", 1)[1] in LAB_MODULES.values(), (where, line)
    mod = importlib.import_module(module)
    assert callable(getattr(mod, "main", None)), f"{module} has no main() for python -m"
    known = _known(mod.LAB.parser().format_help())
    unknown = [f for f in _flags(words[words.index("-m") + 2:]) if f not in known]
    assert not unknown, f"{where}: `{line}`: {module} has no option {unknown}"
    per_node = int(words[words.index("--nproc-per-node") + 1])
    nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words and words[
        words.index("--nnodes") + 1].isdigit() else (2 if "--nnodes" in words else 1)
    name = next(n for n, m in LAB_MODULES.items() if m == module.rsplit(".", 1)[1])
    bad = _lab_problem(name, words[words.index("-m") + 2:], per_node * nodes)
    assert not bad, f"{where}: `{line}`: the lab refuses it on {per_node * nodes} ranks: {bad}"


@pytest.mark.parametrize("where, line", _commands("make"))
def test_every_make_line_is_a_target_that_make_accepts(where, line):
    words = shlex.split(line)
    p = subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{where}: `{line}`: make -n says {p.stderr.strip()}"


def _slugs(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings."""
    out = set()
    for line in FENCE.sub("", _text(page)).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)$", line)
        if m:
            title = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_anchors_and_file_paths_exist(page):
    text = _text(page)
    bad = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if rel in PENDING:
            continue
        if not dest.exists():
            bad.append(f"link {target}: no {rel}")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
            bad.append(f"link {target}: {rel} has no heading with anchor #{anchor}")
    words = {w.strip(".,;:()") for line in _code(page) for w in line.split()}
    words |= {s.strip() for s in INLINE.findall(text)}
    for word in sorted(words):
        if PATH.match(word) and not re.search(r"NN|TIME|\*", word):
            base = page.parent if word.startswith("../") else ROOT
            if not (base / word).exists() and word not in PENDING:
                bad.append(f"path {word} does not exist")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_pending_link_targets_are_still_missing():
    """Once another issue's page lands, take it off PENDING so that its links are checked."""
    landed = [p for p in PENDING if (ROOT / p).exists()]
    landed += [n for n in PENDING_NOTEBOOKS if (ROOT / "solutions" / f"{n}.ipynb").exists()]
    assert not landed, f"{landed} exist now: remove them from PENDING or PENDING_NOTEBOOKS in tests/test_docs.py"


def _option_tables():
    """(page, commands, documented option names) for each table after a ``<!-- options: CMD, CMD -->`` line."""
    out = []
    for page in PAGES:
        lines = _text(page).splitlines()
        for i, line in enumerate(lines):
            m = re.match(r"^<!-- options: (.*) -->$", line.strip())
            if not m:
                continue
            names = set()
            for row in lines[i + 1:]:
                if not row.startswith("|"):
                    break
                first = row.split("|")[1]
                names |= set(re.findall(r"`(--?[A-Za-z][\w-]*)", first))
            cmds = [tuple(c.strip().removeprefix("python -m labkit").split()) for c in m.group(1).split(",")]
            out.append((page.name, cmds, names))
    return out


def test_options_tables_list_exactly_each_commands_options():
    tables = _option_tables()
    assert len(tables) >= 7, tables  # grade, autograder, plan, the four labs' and the shared one
    documented: dict[tuple, set] = {}
    for page, cmds, names in tables:
        for cmd in cmds:
            documented.setdefault(cmd, set()).update(names)
            known = _known(_help(*cmd))
            assert names <= known, f"{page}: python -m labkit {' '.join(cmd)} has no option {sorted(names - known)}"
    for cmd, names in documented.items():
        missing = [sorted(o)[0] for o in _options_of(_help(*cmd)) if not o & names]
        assert not missing, f"python -m labkit {' '.join(cmd)}: the docs' table lacks {missing}"
    from labkit.commands import LABS

    assert {("lab", n) for n in LABS} <= set(documented), "every lab has its options table in docs/labs.md"


def _exercise_ids(spec: str) -> list[str]:
    ids = []
    for part in spec.split(","):
        part = part.strip()
        m = re.match(r"^(\d+)\.(\d+)-(\d+)\.(\d+)$", part)
        if m:
            ids += [f"{m.group(1)}.{k}" for k in range(int(m.group(2)), int(m.group(4)) + 1)]
        elif part:
            ids.append(part)
    return ids


def test_the_notebook_table_matches_the_notebooks():
    """docs/learners.md: every solutions/ notebook in order, its exercises, a run time, and under
    "comes after" every earlier notebook its introduction names."""
    rows = [r for r in _text(ROOT / "docs" / "learners.md").splitlines() if re.match(r"^\| \d\d \|", r)]
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    cells = [c for c in cells if c[1] not in PENDING_NOTEBOOKS]
    sols = sorted((ROOT / "solutions").glob("*.ipynb"))
    assert [c[1] for c in cells] == [p.stem for p in sols], "the table lists solutions/ in order"
    for (num, name, _topic, exercises, runs_in, after), path in zip(cells, sols):
        nb = nbformat.read(str(path), as_version=4)
        ids = [m.group(1) for c in nb.cells if c.cell_type == "code"
               for m in [re.match(r"^\s*#\s*Exercise\s+(\d+\.\d+)\s*:", c.source)] if m and "### BEGIN" in c.source]
        key = lambda i: tuple(map(int, i.split(".")))  # noqa: E731
        assert sorted(_exercise_ids(exercises), key=key) == sorted(ids, key=key), f"{name}: exercises {ids}"
        assert num == name[:2] and re.fullmatch(r"\d+ (s|min)", runs_in), (name, runs_in)
        intro = next(c.source for c in nb.cells if c.cell_type == "markdown")
        earlier = {n for n in re.findall(r"[Nn]otebooks? (\d\d)", intro) if n < num}
        listed = set(re.findall(r"\d\d", after))
        assert earlier <= listed, f"{name}: its introduction builds on notebook(s) {sorted(earlier - listed)}"
        assert all(n < num for n in listed), f"{name}: comes after a later notebook {sorted(listed)}"


def test_the_readme_is_a_start_page():
    text = _text(ROOT / "README.md")
    assert len(text) < 8000, f"README.md is {len(text)} characters; keep it under 8,000 and link out"
    for page in ("learners", "instructors", "labs", "planner", "architecture", "authoring", "grading"):
        assert f"](docs/{page}.md)" in text, f"README.md links docs/{page}.md"
    assert "labkit-course" not in text


def test_the_checker_catches_what_it_is_for(tmp_path):
    """Controls: a made-up option, a missing file, a dead anchor and a wrong table are caught."""
    with pytest.raises(AssertionError, match="has no option"):
        test_every_labkit_command_line_runs_with_help_and_takes_its_options("x", "python -m labkit lab 3d --tpp 2")
    with pytest.raises(AssertionError, match="has no option"):
        test_every_torchrun_line_names_a_lab_module_and_its_options(
            "x", "torchrun --nproc-per-node 8 -m labkit.labs.threed --zerro")
    with pytest.raises(AssertionError, match="refuses it"):   # an option without effect (--sp at t = 1)
        test_every_labkit_command_line_runs_with_help_and_takes_its_options("x", "python -m labkit lab 3d --tp 1 --sp")
    with pytest.raises(AssertionError, match="refuses it on 8 ranks"):  # 8 ranks are not t p = 3 x 2 x d
        test_every_torchrun_line_names_a_lab_module_and_its_options(
            "x", "torchrun --nproc-per-node 8 -m labkit.labs.threed --tp 3 --pp 2")
    with pytest.raises(AssertionError, match="exited 2|needs one of"):
        test_every_labkit_command_line_runs_with_help_and_takes_its_options("x", "python -m labkit lab 4d")
    with pytest.raises(AssertionError, match="make -n says"):
        test_every_make_line_is_a_target_that_make_accepts("x", "make no-such-target")
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text("[a](../README.md#no-such-heading) [b](missing.md) `labkit/no_such_module.py`\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        (tmp_path / "README.md").write_text("# Title\n")
        with pytest.raises(AssertionError) as info:
            test_relative_links_anchors_and_file_paths_exist(page)
    finally:
        ROOT = saved
    msg = str(info.value)
    assert "#no-such-heading" in msg and "no docs/missing.md" in msg and "labkit/no_such_module.py" in msg
    assert _exercise_ids("8.1-8.3, 8.5") == ["8.1", "8.2", "8.3", "8.5"]


# docs/architecture.md's layers: each labkit module's first package after ``labkit.`` (a top-level module is its own)
LAYERS = {0: {"grid", "launch", "dist", "comm", "data", "model", "cliparse", "wire"},
          1: {"pipeline", "tensor_parallel", "data_parallel", "context_parallel", "moe", "checkpoint"},
          2: {"parallel", "plan"}}


@lru_cache(maxsize=None)
def _import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """labkit module -> the labkit modules it imports: anywhere in its code (lazy imports too), or only
    its top-level statements (what runs when it is imported). ``from pkg import sub`` imports ``sub``."""
    import ast

    mods = {}
    for f in (ROOT / "labkit").rglob("*.py"):
        name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    graph = {}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        tree = ast.parse(f.read_text(encoding="utf-8"))
        out = set()
        for node in (tree.body if top_level_only else ast.walk(tree)):
            if isinstance(node, ast.ImportFrom):
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                mod = f"{base}.{node.module}" if node.level and node.module else base if node.level else node.module
                subs = {f"{mod}.{a.name}" for a in node.names} & set(mods)
                out |= subs | ({mod} & set(mods) if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
        graph[m] = out - {m, "labkit"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (its modules in order), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        stack.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next((n for n, names in LAYERS.items() if part in names), 3)


def test_the_layers_architecture_md_describes_hold():
    """No module imports one of a higher layer (base < axes < composition < front ends), anywhere in
    its code, and importing labkit runs into no import cycle; control graphs with either are caught."""
    def upward(graph):
        return [f"{a} imports {b}" for a in graph for b in sorted(graph[a]) if _layer(b) > _layer(a)]

    assert upward(_import_graph()) == []
    assert _cycle(_import_graph(top_level_only=True)) == []
    control = {"labkit.pipeline.runtime": {"labkit.parallel.gpt"}, "labkit.parallel.gpt": {"labkit.pipeline.runtime"}}
    assert upward(control) == ["labkit.pipeline.runtime imports labkit.parallel.gpt"]
    assert _cycle(control) == ["labkit.parallel.gpt", "labkit.pipeline.runtime", "labkit.parallel.gpt"]


def test_every_python_block_of_the_docs_compiles():
    """The case file and exercise examples are Python a reader can paste: they parse."""
    blocks = [(page.name, m.group(1)) for page in PAGES for m in re.finditer(r"^```python\n(.*?)^```", _text(page),
                                                                           re.S | re.M)]
    assert len(blocks) >= 3, blocks
    for name, code in blocks:
        compile(code, name, "exec")


def test_what_docs_say_impl_torch_refuses_it_refuses():
    """docs/labs.md lists what `lab 3d --impl torch` refuses; each listed option must be refused by the
    rule that runs before any rank starts, and nothing it runs (--ignore-frac) may be listed."""
    from labkit.labs.threed import _bad_args, parse_args
    from labkit.labs.threed_torch import torch_bad_args
    text = " ".join((ROOT / "docs" / "labs.md").read_text().split())
    m = re.search(r"What the torch side does not have \(([^)]*)\) is refused", text)
    assert m, "docs/labs.md no longer says what --impl torch refuses"
    values = {"--tied": [], "--moe": [], "--recompute": ["full"], "--ignore-frac": ["0.3"]}
    listed = re.findall(r"`(--[a-z-]+)`", m.group(1))
    assert listed, m.group(1)
    base = ["--impl", "torch", "--tp", "2", "--pp", "2", "--dp", "2", "--steps", "2"]
    assert _bad_args(parse_args(base), 8) is None and torch_bad_args(parse_args(base)) is None
    for flag in listed:
        a = parse_args(base + [flag, *values[flag]])
        assert (_bad_args(a, 8) or torch_bad_args(a)) is not None, f"docs/labs.md says {flag} is refused, it runs"
    a = parse_args(base + ["--ignore-frac", "0.3"])
    assert torch_bad_args(a) is None and "--ignore-frac" not in listed


def test_lab_3d_help_gives_d_under_torchrun_as_the_code_computes_it():
    from labkit.labs import threed
    from labkit.labs.threed import _parser
    help_text = " ".join(_parser().format_help().split())
    assert "WORLD_SIZE / (t*p*cp)" in help_text and "WORLD_SIZE / (t*p))" not in help_text, help_text
    assert "WORLD_SIZE / (t*p)\n" not in threed.__doc__
