"""Which of labkit's functions run an exercise's reference: a static call graph of the kit's source.

The graded kernel does without each reference of the assignment's exercises until it is graded
(:mod:`labkit.grading.withhold`). A labkit function that calls the reference
(``build_schedule("GPipe", K, M)`` runs ``gpipe_schedule``; ``rebalance_experts`` runs
``balanced_packing``) would hand it over, so every labkit function from which the reference can
be reached is withheld too. This graph says which; it is built when the kernel's kit is built
(and by ``python -m labkit build --check``), never at run time in a kernel.

The graph is read from the installed kit's files (never imported or run), once per process.
Its nodes are ``"module:name"`` for each top-level function, class (its methods folded in) and
top-level assignment or import of every labkit module outside ``labkit.grading``. A node points
at every labkit node its body names: a top-level name of its own module, a name imported from
a labkit module (``from .schedules import gpipe_schedule``), or an attribute of an imported
labkit module (``schedules.gpipe_schedule``). What it does not see: calls through objects whose
class it cannot name (``obj.method()`` where ``obj`` came from elsewhere) — conservative for the
names it sees, not a proof that nothing else reaches the reference.
"""
from __future__ import annotations

import ast
import functools
import os

__all__ = ["callers_of", "callees_in_module"]


@functools.lru_cache(maxsize=1)
def _module_files() -> dict[str, str]:
    """{"labkit.x.y": path} of the installed kit, ``labkit.grading`` left out (listed once per process)."""
    import labkit

    top = os.path.dirname(os.path.abspath(labkit.__file__))
    out = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d.isidentifier() and os.path.isfile(os.path.join(folder, d, "__init__.py"))]
        rel = os.path.relpath(folder, os.path.dirname(top)).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py") and f[:-3].isidentifier():
                mod = rel if f == "__init__.py" else f"{rel}.{f[:-3]}"
                if mod != "labkit.grading" and not mod.startswith("labkit.grading."):
                    out[mod] = os.path.join(folder, f)
    return out


@functools.lru_cache(maxsize=None)
def _tree(path: str | None) -> ast.Module:
    """The parsed source of the kit's file ``path``, read once per process (an empty module when
    it cannot be read or parsed). The batch parses every file before it forks its graders."""
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return ast.Module(body=[], type_ignores=[])


def _absolute(mod: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute module of ``from {'.' * level}{name} import ...`` inside ``mod``."""
    if not level:
        return name or ""
    parts = mod.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _edges_of(mod: str, path: str, modules: set[str]) -> dict[str, set[str]]:
    """{node: referenced nodes} of one module."""
    tree = _tree(path)
    is_package = path.endswith("__init__.py")
    bound: dict[str, str] = {}      # name -> "module:name" (a labkit object) or "module" (a labkit module)
    own: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(stmt.name)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                own |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):     # imports anywhere in the module (local imports included)
        if isinstance(node, ast.ImportFrom):
            src = _absolute(mod, is_package, node.level, node.module)
            for a in node.names:
                full = f"{src}.{a.name}"
                if full in modules:
                    bound[a.asname or a.name] = full
                elif src in modules:
                    bound[a.asname or a.name] = f"{src}:{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def refs(body) -> set[str]:
        out = set()
        for sub in ast.walk(body):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in own:
                    out.add(f"{mod}:{sub.id}")
                elif sub.id in bound and ":" in bound[sub.id]:
                    out.add(bound[sub.id])
            elif isinstance(sub, ast.Attribute):
                chain, v = [sub.attr], sub.value
                while isinstance(v, ast.Attribute):
                    chain.append(v.attr)
                    v = v.value
                if isinstance(v, ast.Name) and v.id in bound and ":" not in bound[v.id]:
                    dotted = [bound[v.id], *reversed(chain)]
                    for i in range(len(dotted) - 1, 0, -1):   # the longest module prefix, then a name in it
                        if ".".join(dotted[:i]) in modules:
                            out.add(f"{'.'.join(dotted[:i])}:{dotted[i]}")
                            break
        return out

    edges: dict[str, set[str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            edges.setdefault(f"{mod}:{stmt.name}", set()).update(refs(stmt))
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        edges.setdefault(f"{mod}:{n.id}", set()).update(refs(stmt.value))
        elif isinstance(stmt, ast.ImportFrom):    # a re-export: labkit:gpipe_schedule -> its home
            for a in stmt.names:
                target = bound.get(a.asname or a.name, "")
                if ":" in target:
                    edges.setdefault(f"{mod}:{a.asname or a.name}", set()).add(target)
    return edges


@functools.lru_cache(maxsize=1)
def _callers() -> dict[str, frozenset]:
    """{node: the nodes that refer to it}, over the whole kit (read once)."""
    files = _module_files()
    modules = set(files)
    back: dict[str, set] = {}
    for mod, path in files.items():
        for node, targets in _edges_of(mod, path, modules).items():
            for t in targets:
                if t != node:
                    back.setdefault(t, set()).add(node)
    return {k: frozenset(v) for k, v in back.items()}


def callers_of(label: str) -> set[str]:
    """Every ``"module:name"`` of the kit from which ``label`` ("module:qualname"; a method's
    class stands for it) can be reached, ``label`` itself excluded."""
    start = label.split(".")[0] if ":" not in label else label.partition(":")[0] + ":" + \
        label.partition(":")[2].split(".")[0]
    back = _callers()
    seen, todo = set(), [start]
    while todo:
        for c in back.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    seen.discard(start)
    return seen


@functools.lru_cache(maxsize=None)
def callees_in_module(label: str) -> frozenset:
    """Every ``"module:name"`` of ``label``'s own module that ``label`` reaches (directly or through
    others of that module), ``label`` excluded: the helpers a reference's body hands its work to
    (``zb_h1_schedule`` -> ``_zb_h1_order``)."""
    mod = label.partition(":")[0]
    start = mod + ":" + label.partition(":")[2].split(".")[0]
    forward: dict[str, set] = {}
    for target, sources in _callers().items():
        for src in sources:
            forward.setdefault(src, set()).add(target)
    seen, todo = set(), [start]
    while todo:
        for c in forward.get(todo.pop(), ()):
            if c not in seen and c.partition(":")[0] == mod:
                seen.add(c)
                todo.append(c)
    seen.discard(start)
    return frozenset(seen)
