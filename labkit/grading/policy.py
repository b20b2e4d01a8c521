"""The source policy: what an exercise's code may not use, checked on the notebook's text.

The learner's kernel is the learner's: anything measured there (a tripwire, a patched module)
is a claim the learner controls. So the grader also reads the SOURCE of the submission
(``python -m labkit grade`` parses the notebook file; the interactive ``check`` reads the
cells its kernel ran, so an honest learner meets the same rule before submitting) and judges it
against two kinds of rules. A violation gives the exercise 0 points, reported with its cell and
line (:class:`Violation`).

1. **Everywhere** (every code cell up to the exercise's grading point, see
   :func:`labkit.grading.assignments.grading_points`): nothing that makes or rewrites code at
   run time, reaches into the interpreter, or starts processes (:data:`FORBIDDEN_NAMES`,
   :data:`FORBIDDEN_ATTRS`, :data:`FORBIDDEN_MODULES`: ``exec``, ``eval``, ``compile``,
   ``__code__``, ``types.FunctionType``, ``importlib.reload``, ``subprocess``, ``ctypes``,
   ``sys.modules``, ``sys.path``, ``gc``, ``os.system``/``os.fork``/..., unpickling,
   ``torch.hub``, torch function and dispatch modes, global module hooks and ``torch.library``
   (code torch would run behind every call, which no answer's closure shows), IPython magics
   and shell escapes, ``matplotlib.use`` and ``pyplot.switch_backend`` (a backend name,
   ``"module://name"``, imports a module; the graded kernel resolves its backend before the
   first cell, so one put in ``rcParams`` later imports nothing); annotation strings evaluated
   as code: ``typing.get_type_hints``,
   ``inspect.get_annotations``, ``singledispatch``, ``eval_str=``; ``string.Formatter().get_field``;
   unpickling: ``weights_only``/``allow_pickle`` other than the literal safe value, torch's and
   numpy's loaders with more than the file positionally, ``*``/``**`` or as a value, ``torch.load``
   without ``weights_only=True``, ``torch.package``); no module used as a value (passed on,
   stored, returned, looked into by ``getattr`` with a computed name): a module is read only as
   the base of a written-out attribute (``S.name``, ``getattr(S, "name")``), so every attribute
   the code takes from a module is a dotted path the rules can see, and each path is judged
   on the object it reaches too (``collections._sys.modules`` is ``sys.modules``,
   ``enum.bltns.exec`` a builtin reached through a module); no private name (``_x``) of a
   module the learner did not write (``torch._utils``, ``collections._sys``), no ``__self__``
   (``len.__self__`` is builtins), an AttributeError's ``.obj`` or ``inspect.getmodule``
   (module objects from values); no import from
   ``labkit.grading`` but ``from labkit.grading import check``; **imports only from an allow-list**
   (:data:`ALLOWED_IMPORTS`: torch and the parts of it the course uses, numpy, matplotlib,
   the standard numerics and a few plain standard modules, and labkit's own modules as
   installed when the grader started): a module the notebook writes to disk, or any other
   package, holds code this policy cannot read, so importing it is a violation; and no
   assignment to (or ``setattr``/``del`` of) an attribute of a module, or of a class the
   learner did not define (``torch.distributed.all_reduce = ...``, ``nn.Linear.forward = ...``).
   No class pattern (``case C(attr=...)`` reads attributes by names), ``string.Formatter``,
   ``inspect.getattr_static`` or ``getattr`` with a computed name in a learner's cell, and no
   private name of something imported read through an alias (``S = Cls; S._builder``).
   **labkit only through the names the notebook gives** (an allow-list, :func:`_unprovided`):
   a learner's cell may import or read through a module only the labkit functions, classes and
   constants that the shipped learner notebook's own cells import, and those its text tells the
   learner to call (:data:`PROVIDED`); any other part of the kit may compute an answer without
   being listed as a reference. A labkit type named only in annotations is allowed.
   The kit's cells are exempt from the reference rule and the allow-list as written, with only
   their literals or comments changed (:func:`_skeleton`), and each of their import statements
   is exempt where a learner's cell repeats it; a name local to a function (a parameter, an
   assignment, a loop target) is not the import of the same name.
   And labkit's reference for the exercise (or a labkit function from which it can be reached,
   :mod:`labkit.grading.reach`) may not be named in any of these cells at all: imported, read
   through a module, or read where a cell the kit ships imported it (the shipped learner
   notebook's own cells are exempt; a name a package exports lazily is judged where its
   object was defined); no flow through globals, containers, decorators or exceptions then
   hides it.
2. **In the exercise's code**: the answer's definition and everything it reaches through the
   notebook's top-level names (helpers, aliases, tables built at the top level; the
   "closure" of the answer) must not use labkit's reference for that exercise
   (:mod:`labkit.grading.references`), nor what the exercise itself rules out
   (:data:`EXERCISE_RULES`: in 0.2's send/recv ring a collective, a process group or store
   of its own, files, pipes, sockets or shared memory; in 13.1's split backward
   ``.backward()``, ``.grad`` and ``zero_grad``, which the returned gradients cannot show when
   ``.grad`` is cleared first); nor look attributes up by computed names
   (``getattr(m, name)``), nor read source text (``inspect.getsource``, except where the
   exercise is about labkit's source, :data:`ALLOW`).

The check is static, conservative and flow-aware: a name read at the top level has the value
of its last outright binding before that point (def, class, import, ``x = ...``) plus every
later statement that mutates it or hands it to a call (``x.update(...)``, ``fill(x)``); a
function body may run at any later time, so its names are read both where it was reached and
at the grading point. A name bound by an import of labkit's reference (under any alias) is the
reference. What it does not see: code retyped from labkit's source, and a learner's function
that happens to compute the reference's value another way (that is an honest answer). Source
policy is one layer: the grader's files are also unreadable by the kernel's user when grading
as root, and every verdict is judged on data in the grader (see :mod:`labkit.grading`).
"""
from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass

__all__ = ["Violation", "check_cells", "check_history", "describe", "FORBIDDEN_NAMES", "FORBIDDEN_ATTRS",
           "MODULE_ATTRS", "FORBIDDEN_MODULES", "ALLOWED_IMPORTS", "allowed_import", "P2P_ONLY", "EXERCISE_RULES",
           "ALLOW"]

# names refused wherever they appear as a name (builtins and what ``from ... import`` binds)
FORBIDDEN_NAMES = {
    "exec": "runs code from a string", "eval": "runs code from a string", "compile": "builds code objects",
    "__import__": "imports by computed name", "reload": "re-executes a module",
    "FunctionType": "builds a function from a code object", "CodeType": "builds code objects",
    "LambdaType": "builds a function from a code object",
    "globals": "reaches names by computed strings", "vars": "reaches names by computed strings",
    "locals": "reaches names by computed strings (at the top of a cell, every global and the builtins)",
    "help": "imports the module a string names (pydoc)",
    "get_ipython": "runs magics and shell commands", "__builtins__": "reaches the interpreter's builtins",
    "breakpoint": "stops in a debugger",
    **{n: "evaluates annotation strings as code" for n in (
        "get_type_hints", "get_annotations", "ForwardRef", "_eval_type", "singledispatch", "singledispatchmethod")},
}
# attribute names refused on any object
FORBIDDEN_ATTRS = {
    "__code__": "copies or swaps a function's code", "__globals__": "reaches a function's module",
    "__closure__": "reaches a function's cells", "__dict__": "reaches attributes by computed names",
    "__subclasses__": "reaches classes not imported", "__setattr__": "assigns attributes behind the rules",
    "__delattr__": "deletes attributes behind the rules", "__getattribute__": "looks attributes up by name",
    "__reduce__": "rebuilds objects by name", "__reduce_ex__": "rebuilds objects by name",
    "__loader__": "reaches module loaders", "__spec__": "reaches module loaders",
    "__builtins__": "reaches the interpreter's builtins", "__import__": "imports by computed name",
    "FunctionType": "builds a function from a code object", "CodeType": "builds code objects",
    "LambdaType": "builds a function from a code object", "reload": "re-executes a module",
    "get_ipython": "runs magics and shell commands",
    "_getframe": "reaches callers' frames", "f_globals": "reaches a frame's module",
    "f_locals": "reaches a frame's names", "f_back": "reaches callers' frames",
    "gi_frame": "reaches a generator's frame", "tb_frame": "reaches a traceback's frame",
    "cr_frame": "reaches a coroutine's frame", "ag_frame": "reaches an async generator's frame",
    "chmod": "makes a file executable: a program of yours that a library could start",
    "collect_env": "runs shell commands", "CompilationUnit": "compiles code from a string",
    "f_builtins": "reaches the interpreter's builtins", "f_code": "reaches a frame's code",
    "gi_code": "reaches a generator's code", "cr_code": "reaches a coroutine's code",
    "ag_code": "reaches an async generator's code", "tb_next": "walks a traceback's frames",
    "settrace": "traces every call", "setprofile": "traces every call", "getmembers": "reaches attributes by name",
    "getattr_static": "reaches attributes by name", "getmembers_static": "reaches attributes by name",
    "__match_args__": "makes a class pattern read attributes by name",
    "attrgetter": "looks attributes up by name", "methodcaller": "looks attributes up by name",
    "get_field": "looks attributes up by name", "_tensor_to_object": "unpickles (rebuilds objects by name)",
    "__self__": "reaches the module a builtin belongs to (len.__self__ is builtins)",
    "obj": "reaches the object an AttributeError was raised on (a module, passed on as a value)",
    "getmodule": "reaches a module as a value", "f2py": "compiles and loads code",
    **{n: "looks attributes up by name" for n in ("getattr_static", "getmembers_static", "classify_class_attrs")},
    # the kernel's shell runs code from strings (run_cell, ex, ev) and holds every name (user_ns); ``exit._ip``
    # and a widget's ``comm.kernel.shell`` reach it
    **{n: "reaches the kernel's shell, which runs code from strings" for n in (
        "_ip", "shell", "kernel", "user_ns", "user_global_ns", "run_cell", "run_line_magic", "run_cell_magic")},
    **{n: "evaluates annotation strings as code" for n in (
        "get_type_hints", "get_annotations", "ForwardRef", "_eval_type", "singledispatch", "singledispatchmethod")},
    "hub": "loads and runs code from a folder or the network", "load_library": "loads compiled code",
    "load_inline": "compiles and loads code", "cpp_extension": "compiles and loads code",
    "ctypeslib": "calls C and rewrites memory",
    # a module reached through another module's attribute (``os.sys.modules``), past the rules on its name
    **{n: "reaches a module through another module, past the rules on its name" for n in (
        "sys", "os", "builtins", "subprocess", "ctypes", "importlib", "gc", "pickle", "marshal", "multiprocessing",
        "threading", "_thread", "runpy", "pty")},
    # code torch runs on its own, called by no answer (so outside any answer's closure)
    **{n: "makes torch run code of yours behind every call" for n in (
        "TorchFunctionMode", "BaseTorchFunctionMode", "TorchDispatchMode", "_python_dispatch",
        "register_module_forward_hook", "register_module_forward_pre_hook", "register_module_full_backward_hook",
        "register_module_backward_hook", "register_module_full_backward_pre_hook",
        "register_module_buffer_registration_hook", "register_module_module_registration_hook",
        "register_module_parameter_registration_hook")},
}
# keyword arguments any call may pass only as their literal safe value: any other value (``allow_pickle=not 0``,
# ``weights_only=[]``) unpickles, which rebuilds objects by name and runs code, or evaluates strings as code
SAFE_KEYWORDS = {"weights_only": (True, "unpickles (runs code by name) unless it is the literal True"),
                 "allow_pickle": (False, "unpickles (runs code by name) unless it is the literal False"),
                 "eval_str": (False, "evaluates annotation strings as code unless it is the literal False")}
# torch's and numpy's loaders that unpickle what a positional argument, a ``*``/``**`` unpacking or (torch) an
# environment variable can switch on: {name: positional arguments allowed} (numpy's load(file, mmap_mode,
# allow_pickle); read_array(fp, allow_pickle); NpzFile(fid, own_fid, allow_pickle); torch's load(f,
# map_location, pickle_module), whose weights_only TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off unless passed)
LOADERS = {"load": 2, "read_array": 1, "NpzFile": 2}
# attributes refused on one module (``sys.modules``, ``os.system``; also ``from os import system``)
# (signals and sessions are not here: they produce no answer, and containing processes is the
# operating system's job, see labkit.grading.session)
_PROCESS = "starts another program or process, where labkit's reference could run unchecked"
_BACKEND_IMPORT = ("imports the module a backend name gives (\"module://name\"); the kernel's backend is set, "
                   "plots show as they are")
MODULE_ATTRS = {
    "sys": {"modules": "reaches every imported module", "settrace": "traces every call",
            "addaudithook": "hands a hook of yours the interpreter's events and their objects (sys.path, code)",
            "call_tracing": "traces every call",
            **{n: "changes where imports come from" for n in ("path", "meta_path", "path_hooks",
                                                              "path_importer_cache")},
            "setprofile": "traces every call", "_getframe": "reaches callers' frames"},
    "torch": {"compile": "runs a compiler as a process, one its options may name (cpp.cxx: a script of yours)",
              "library": "replaces torch's operators by code of yours", "overrides": "makes torch run code of yours "
              "behind every call", "_C": "reaches torch's internals",
              "package": "imports and runs code from an archive (and unpickles)"},
    "inspect": {**{n: "reaches callers' frames and their names" for n in (
        "currentframe", "stack", "trace", "getouterframes", "getinnerframes", "getargvalues", "getclosurevars",
        "getgeneratorlocals", "getcoroutinelocals", "getasyncgenlocals")},
        # signature(f, eval_str=True), also passed as **{"eval_str": True}, evaluates annotation strings as code
        **{n: "can evaluate annotation strings as code (eval_str)" for n in (
            "signature", "Signature", "get_annotations", "getfullargspec")}},
    "matplotlib": {"use": _BACKEND_IMPORT},
    "string": {"Formatter": "a Formatter hands your code the objects a format string looks up by name "
                            "(\"{0.__globals__}\"), which the rules cannot see"},
    "matplotlib.pyplot": {"switch_backend": _BACKEND_IMPORT},
    "os": {n: _PROCESS for n in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv",
                                 "putenv", "unsetenv", "chmod", "fchmod", "lchmod", "open", "symlink", "link",
                                 "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv",
                                 "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                                 "register_at_fork")},
}
# modules whose import alone is refused
FORBIDDEN_MODULES = {
    "subprocess": "starts processes", "ctypes": "calls C and rewrites memory", "cffi": "calls C",
    "gc": "reaches every live object", "importlib": "imports and reloads by name", "imp": "imports by name",
    "runpy": "runs modules by name", "code": "runs code from strings", "codeop": "compiles strings",
    "marshal": "builds code objects", "pickle": "rebuilds objects by name", "dill": "rebuilds objects by name",
    "cloudpickle": "rebuilds objects by name", "shelve": "rebuilds objects by name", "copyreg": "rebuilds objects",
    "multiprocessing": "starts processes", "pty": "starts processes", "builtins": "rewrites the interpreter",
    "pdb": "a debugger runs code from strings", "threading": "runs code after the cell ends",
    "_thread": "runs code after the cell ends", "concurrent": "runs code after the cell ends",
    "asyncio": "runs code after the cell ends",
}
# collectives (torch.distributed, labkit.comm, ProcessGroup methods) refused in point-to-point exercises
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
               "reduce", "gather", "scatter", "all_reduce_coalesced", "allreduce", "allgather", "alltoall",
               "alltoall_base", "allgather_into_tensor_coalesced", "_allgather_base", "_reduce_scatter_base",
               "allreduce_coalesced", "reduce_scatter_tensor_coalesced")
P2P_ONLY = {"0.2": COLLECTIVES}
_P2P_WHY = "a collective; this exercise builds it from send/recv"
# what moves data between 0.2's ranks behind the relay's back: a process group or store of their own,
# files, pipes, sockets, shared memory (signals and timing are not data the policy can name)
_SIDE_CHANNELS = ("init_process_group", "new_group", "new_subgroups", "TCPStore", "FileStore", "HashStore",
                  "PrefixStore", "Store", "ProcessGroupGloo", "open", "save", "load", "from_file", "share_memory_",
                  "tofile", "fromfile", "memmap", "read_text", "write_text", "read_bytes", "write_bytes", "read",
                  "write", "pipe", "mkfifo", "socket", "socketpair", "mmap", "kill", "Queue", "Pipe")
_SIDE_WHY = "moves data outside send/recv; the ring's ranks may talk only through send and recv"
_GRAD_WHY = ("writes or reads .grad; 13.1 asks for the two gradients from torch.autograd.grad, leaving .grad "
             "alone (a .backward() after clearing .grad returns the right values but destroys what .grad held)")
# per exercise: attribute or imported name -> why it is refused in the exercise's code (its closure)
EXERCISE_RULES = {
    "0.2": {**{n: _SIDE_WHY for n in _SIDE_CHANNELS}, **{n: _P2P_WHY for n in COLLECTIVES}},
    "13.1": {"backward": _GRAD_WHY, "grad": _GRAD_WHY, "zero_grad": _GRAD_WHY},
    # the ModelSpec 9.3 receives counts its own parameters: its counting methods are labkit's answer
    "9.3": {n: "a ModelSpec method that counts parameters is labkit's own count (labkit.plan.spec); count "
               "them from the spec's sizes yourself" for n in (
            "total_params", "active_params", "layer_params", "mlp_params", "attention_params", "norm_params",
            "embedding_params", "head_params")},
}
# per exercise: modules none of whose names the exercise's code may read (0.2: files and processes)
EXERCISE_MODULES = {"0.2": ("os", "tempfile", "io", "pathlib", "shutil", "socket", "mmap", "json", "signal")}
# modules the cells may import, by exact name (a submodule not listed is refused); labkit's own
# modules, as installed when this module was first imported, are added by :func:`allowed_import`
ALLOWED_IMPORTS = frozenset({
    "__future__", "torch", "torch.nn", "torch.nn.functional", "torch.nn.init", "torch.distributed",
    "torch.autograd", "torch.utils.checkpoint", "torch.func", "torch.optim", "torch.testing",
    # notebook 17: PyTorch's own parallelism APIs
    "torch.distributed.device_mesh", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp", "torch.distributed.pipelining",
    "numpy", "matplotlib", "matplotlib.pyplot", "matplotlib.patches", "matplotlib.colors", "matplotlib.ticker",
    "ipywidgets", "IPython.display",
    "math", "cmath", "fractions", "decimal", "statistics", "random", "numbers", "itertools", "functools",
    "operator", "collections", "collections.abc", "dataclasses", "typing", "enum", "copy", "heapq", "bisect",
    "time", "json", "re", "string", "textwrap", "pprint", "warnings", "contextlib", "os", "os.path", "sys",
    "signal", "tempfile", "inspect",
})
_IMPORT_WHY = ("not on the list of modules a notebook may import (torch, numpy, matplotlib, the standard numerics, "
               "labkit): code in any other module, one the notebook writes to disk included, is code the grader "
               "cannot read")


def _labkit_modules() -> frozenset:
    """"labkit", "labkit.x", "labkit.x.y", ... for each module file of the installed kit (read once)."""
    import os

    import labkit

    top = os.path.dirname(os.path.abspath(labkit.__file__))
    out = set()
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d.isidentifier() and os.path.isfile(os.path.join(folder, d, "__init__.py"))]
        rel = os.path.relpath(folder, os.path.dirname(top)).replace(os.sep, ".")
        out |= {rel if f == "__init__.py" else f"{rel}.{f[:-3]}" for f in files
                if f.endswith(".py") and f[:-3].isidentifier()}
    return frozenset(m for m in out if m != "labkit.grading" and not m.startswith("labkit.grading."))


_LABKIT_MODULES = _labkit_modules()  # now, before any kernel of this grader could add a file to the kit


def allowed_import(module: str) -> bool:
    """Whether the cells may import ``module`` (see :data:`ALLOWED_IMPORTS`)."""
    return module in ALLOWED_IMPORTS or module in _LABKIT_MODULES


_SOURCE = ("getsource", "getsourcelines", "getsourcefile", "getfile")
# exercises whose point is reading labkit's source: reading it is allowed in their code
ALLOW = {"12.3": set(_SOURCE)}
_ALLOWED_GRADING_IMPORTS = {"check"}  # ``from labkit.grading import check``
_BUILTIN_NAMES = set(dir(builtins))


@dataclass
class Violation:
    """One broken rule: ``cell`` (a label such as "cell 7" or "In [3]"), ``line`` (1-based,
    within the cell), ``what`` (the construct) and ``why`` (the rule)."""

    cell: str
    line: int
    what: str
    why: str

    def __str__(self) -> str:
        return f"{self.cell}, line {self.line}: {self.what} ({self.why})"


def _is_install_cell(src: str) -> bool:
    """True for the exact first cell ``build`` writes into every learner notebook (it installs labkit
    with one ``%pip`` line where labkit is missing): the kit's own text, not the learner's, so its
    magic and import are allowed; any edit to it makes it an ordinary cell again."""
    from .install import INSTALL_CELL

    def norm(text: str) -> str:
        try:
            from IPython.core.inputtransformer2 import TransformerManager

            text = TransformerManager().transform_cell(text)
        except Exception:  # noqa: BLE001 - no IPython here: plain Python
            pass
        return text.strip()

    if "find_spec" not in src:  # the install cell's test, which IPython's transforms never write: no IPython import
        return False
    return src.strip() == INSTALL_CELL.strip() or norm(src) == norm(INSTALL_CELL)


def _python(src: str) -> ast.Module | None:
    """The cell as Python: IPython's own transforms (magics, ``!shell``) first, as the kernel does;
    None when it does not parse (then it raised SyntaxError in the kernel and ran nothing)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        src = TransformerManager().transform_cell(src)
    except Exception:  # noqa: BLE001 - no IPython here: plain Python
        pass
    try:
        return ast.parse(src)
    except (SyntaxError, ValueError):
        return None


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
        node = node.value
    return node


class _Names:
    """What the cells' imports bind: ``origins`` {name: ["module.name", ...]} and ``foreign``
    (names bound to something the learner did not define: imports and their aliases)."""

    def __init__(self, trees):
        self.origins: dict[str, list[str]] = {}
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        bound = a.asname or a.name.split(".")[0]
                        self.origins.setdefault(bound, []).append(a.name if a.asname else bound)
                elif isinstance(node, ast.ImportFrom):
                    for a in node.names:
                        self.origins.setdefault(a.asname or a.name, []).append(f"{node.module or ''}.{a.name}")
        self.foreign = set(self.origins)
        for tree in trees:  # d = torch.distributed; c = type(x): aliases of what is not the learner's
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                    v = node.value
                    r = _root(v)
                    alias = (isinstance(v, (ast.Name, ast.Attribute)) and isinstance(r, ast.Name)
                             and r.id in self.foreign) or (isinstance(v, ast.Call) and isinstance(v.func, ast.Name)
                                                           and v.func.id == "type")
                    if alias:
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                            if isinstance(t, ast.Name):
                                self.foreign.add(t.id)

    def module_of(self, name: str) -> set[str]:
        """Top-level modules ``name`` is bound to (``os`` for ``import os`` or ``import os as o``)."""
        return {o for o in self.origins.get(name, ()) if "." not in o}


_ATTR_FUNCS = ("getattr", "hasattr", "setattr", "delattr")
_MODULE_ATTR_NAMES = {n for attrs in MODULE_ATTRS.values() for n in attrs}
_MADE_BY_ITERATING = ("parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
                      "children", "named_children")
_MADE_BY = ("torch", "numpy", "labkit", "matplotlib")   # libraries whose calls make new objects


class _Scopes:
    """Where each attribute assignment's base name comes from: ``made(name, fn)`` is True when
    every binding of ``name`` in its scope (function ``fn``, else the cells' top level) gives it
    an object the code made: the result of calling a class of its own or a torch / numpy /
    labkit / matplotlib callable, an item of ``x.parameters()`` (and the like), a function or
    class it defined, or the first parameter of a method of its own class (``self``, ``ctx``).
    Anything else (a loop over a tuple, an alias, another parameter) may be a module or a class
    it did not define, which the grader cannot tell from the text."""

    def __init__(self, trees, names: "_Names", classes: set[str]):
        self.names, self.classes = names, classes
        self.methods: dict[int, str] = {}       # id(def) -> its first parameter, for defs in own classes
        self.top: list = []                     # (name, safe) of top-level bindings, every cell
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    for d in node.body:
                        if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.args.args:
                            self.methods[id(d)] = d.args.args[0].arg
            self.top += self._bindings(tree.body)
        self.defs = {n.name for t in trees for n in ast.walk(t)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def _made_call(self, v) -> bool:
        if not isinstance(v, ast.Call):
            return False
        r = _root(v.func)
        if not isinstance(r, ast.Name):
            return False
        if r.id in self.classes:
            return True
        return any(o.split(".")[0] in _MADE_BY for o in self.names.origins.get(r.id, ()))

    def _bindings(self, body) -> list[tuple[str, bool]]:
        """(name, safe) for every binding in ``body``, not descending into nested defs."""
        out = []
        todo = list(body)
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                if not isinstance(node, ast.Lambda):
                    out.append((node.name, True))
                continue
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                safe = self._made_call(node.value)
                out += [(t.id, safe) for t in targets if isinstance(t, ast.Name)]
                out += [(n.id, False) for t in targets if not isinstance(t, ast.Name)
                        for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
                todo += [node.value]
                continue
            if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                it = node.iter
                safe = isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) \
                    and it.func.attr in _MADE_BY_ITERATING
                t = node.target
                if safe and it.func.attr.startswith("named_") and isinstance(t, ast.Tuple) and len(t.elts) == 2:
                    out += [(n.id, False) for n in ast.walk(t.elts[0]) if isinstance(n, ast.Name)]
                    t = t.elts[1]
                out += [(n.id, safe) for n in ast.walk(t) if isinstance(n, ast.Name)]
                todo += [it] + (list(node.body) + list(node.orelse) if not isinstance(node, ast.comprehension)
                                else list(node.ifs))
                continue
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.append((node.id, False))       # with ... as x, x += ..., walrus, import-free others
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out += [(a.asname or a.name.split(".")[0], False) for a in node.names]
            todo += list(ast.iter_child_nodes(node))
        return out

    def made(self, name: str, fn) -> bool:
        if fn is not None:
            params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
            params |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
            if name in params:
                return self.methods.get(id(fn)) == name
            local = [safe for n, safe in self._bindings(fn.body) if n == name]
            if local:
                return all(local)
        top = [safe for n, safe in self.top if n == name]
        return bool(top) and all(top)


_ENVIRON = ("os.environ", "os.environb", "posix.environ")
_ENV_READS = ("get", "keys", "items", "values", "copy")


def _everywhere(tree: ast.Module, names: _Names, classes: set[str], allow: set[str],
                scopes: "_Scopes | None" = None, learner: bool = True) -> list[tuple[int, str, str]]:
    """Rule 1 on one cell: (line, what, why) for each construct refused everywhere. ``learner``:
    the cell is not one the kit ships (a kit cell may look an attribute up by a computed name)."""
    out = []
    parent = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 1)
        if isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load) and any(
                p in _ENVIRON for p in (_paths(node, names) if isinstance(node, ast.Attribute)
                                        else names.origins.get(node.id, ()))):
            up = parent.get(id(node))
            read = (isinstance(up, ast.Subscript) and up.value is node and isinstance(up.ctx, ast.Load)) or (
                isinstance(up, ast.Attribute) and up.attr in _ENV_READS
                and isinstance(parent.get(id(up)), ast.Call)) or (
                isinstance(up, ast.Compare) and node in up.comparators)
            if not read:
                out.append((line, f"`{ast.unparse(node)}` {'assigned or passed on' if up is not None else ''}".strip(),
                            "the environment may only be read (os.environ[...], .get): a changed PATH, LD_PRELOAD or "
                            "PYTHONPATH makes the programs a library starts (latex, a compiler) run code of yours"))
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
                if isinstance(stmt, (ast.Import, ast.ImportFrom)) or (
                        isinstance(value, (ast.Name, ast.Attribute)) and isinstance(_root(value), ast.Name)
                        and _root(value).id in names.foreign):
                    out.append((stmt.lineno, f"`{ast.unparse(stmt).splitlines()[0]}` in the body of class "
                                f"{node.name}", "binds a module or something imported as a class attribute, where "
                                "the rules on names do not follow it (C.m.x); import at the top of a cell"))
        if isinstance(node, (ast.Global, ast.Nonlocal)) and any(n in names.origins for n in node.names):
            out.append((line, f"`{ast.unparse(node)}`", "a function that rebinds an imported name hides which object "
                        "the name holds where it is read (a loop over it, then an import in the function); use "
                        "another name"))
        if isinstance(node, ast.MatchClass):
            out.append((line, "a class pattern (`case C(...)`)", "reads attributes by names (its keywords, or the "
                        "class's __match_args__) that the rules cannot check as attributes; use isinstance and "
                        "written-out attributes"))
        elif learner and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _ATTR_FUNCS and len(node.args) >= 2 \
                and not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            out.append((line, f"`{node.func.id}` with a computed name", "the grader cannot see which attribute it "
                        "reaches (a dunder such as __globals__ leads anywhere); write the attribute out"))

    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    enclosing: dict[int, ast.AST] = {}       # id(node) -> the innermost def around it
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(fn):
                if sub is not fn:
                    enclosing[id(sub)] = fn     # inner defs come later in the walk and win
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 1)
        if learner and isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                and not node.attr.startswith("__") and not _own_base(node, classes, scopes, enclosing) \
                and not any(map(_is_module, _paths(node.value, names) or names.origins.get(
                    getattr(node.value, "id", None), ()))):  # a module's: its own rule, its own words
            out.append((line, f"`{ast.unparse(node)}`", "a private name of code you did not write (the kit's or a "
                        "library's internals, whatever the name or expression it is reached through); use "
                        "private names only of your own classes (self._x)"))
        if isinstance(node, ast.Name) and node.id in _ATTR_FUNCS and isinstance(node.ctx, ast.Load) \
                and id(node) not in called and node.id not in classes and node.id not in names.origins:
            out.append((line, f"`{node.id}` used as a value", "hides which attribute it reaches from the grader; "
                        "call it by name with the attribute written out"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTR_FUNCS \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            attr = node.args[1].value
            if attr in FORBIDDEN_ATTRS and attr not in allow:
                out.append((line, f"`{node.func.id}(..., {attr!r})`", FORBIDDEN_ATTRS[attr]))
            elif attr in _MODULE_ATTR_NAMES or attr in FORBIDDEN_NAMES:
                out.append((line, f"`{node.func.id}(..., {attr!r})`", "reaches by name what the rules refuse"))
        if scopes is not None and isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        r = _root(sub)
                        if isinstance(r, ast.Name) and r.id not in classes and r.id not in names.foreign \
                                and r.id not in _BUILTIN_NAMES and not scopes.made(r.id, enclosing.get(id(node))):
                            out.append((line, f"assigning `{ast.unparse(sub)}`", f"`{r.id}` may be a module or a "
                                        "class you did not define (the grader cannot tell from the code); assign "
                                        "attributes only of objects you make (x = SomeClass(...), torch.empty(...)), "
                                        "of self in your own class, or of tensors from .parameters()"))
        rebound = (node.id if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)) else
                   node.name if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else
                   node.arg if isinstance(node, ast.arg) else
                   (node.asname or node.name.split(".")[0]) if isinstance(node, ast.alias) else None)
        if rebound in _ATTR_FUNCS:
            out.append((line, f"rebinding `{rebound}`", "the rules read getattr and friends by name (a getattr of "
                        "your own, or one deleted again, would hide what is looked up); use another name"))
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES and node.id not in allow:
            out.append((line, f"`{node.id}`", FORBIDDEN_NAMES[node.id]))
        elif isinstance(node, ast.Attribute):
            if node.attr in FORBIDDEN_ATTRS and node.attr not in allow:
                out.append((line, f"`.{node.attr}`", FORBIDDEN_ATTRS[node.attr]))
            elif isinstance(node.value, ast.Name):
                for mod in names.module_of(node.value.id):
                    if node.attr in MODULE_ATTRS.get(mod, {}):
                        out.append((line, f"`{mod}.{node.attr}`", MODULE_ATTRS[mod][node.attr]))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out += _import_problems(node, allow)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)):
                        r = _root(sub)
                        theirs = isinstance(r, ast.Call) or isinstance(r, ast.Name) and r.id not in classes and (
                            r.id in names.foreign or r.id in _BUILTIN_NAMES)
                        if theirs:
                            out.append((line, f"assigning `{ast.unparse(sub)}`", "changes a module or a class you "
                                        "did not define; define your own function or class instead"))
        if isinstance(node, ast.Call):
            for k in node.keywords:
                if k.arg in SAFE_KEYWORDS and not (isinstance(k.value, ast.Constant)
                                                   and k.value.value is SAFE_KEYWORDS[k.arg][0]):
                    out.append((line, f"`{k.arg}={ast.unparse(k.value)}`", SAFE_KEYWORDS[k.arg][1]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            r = _root(node.args[0]) if node.args else None
            if not isinstance(r, ast.Name) or r.id not in classes and (r.id in names.foreign or r.id in _BUILTIN_NAMES):
                what = ast.unparse(node.args[0]) if node.args else "?"
                out.append((line, f"`{node.func.id}({what}, ...)`", "changes a module or a class you did not define"))
    return out + _module_values(tree, names)


def _own_base(node: ast.Attribute, classes: set[str], scopes: "_Scopes | None", enclosing: dict) -> bool:
    """Whether the attribute is read from the learner's own class or object: the class by name, the
    first parameter of a method of it (self, cls), or super()."""
    r = node.value  # directly: C._x, self._x, super()._x (not C.m._x: m may be anything)
    if isinstance(r, ast.Call) and isinstance(r.func, ast.Name) and r.func.id == "super":
        return True
    if not isinstance(r, ast.Name):
        return False
    if r.id in classes:
        return True
    fn = enclosing.get(id(node))
    while fn is not None:
        if scopes is not None and scopes.methods.get(id(fn)) == r.id:
            return True
        fn = enclosing.get(id(fn))
    return False


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _own_locals(fn) -> set[str]:
    """Names local to one function, lambda or comprehension scope: its parameters (or targets) and
    what its own body assigns, nested scopes and imports left out (a name an import binds keeps
    its module), less the names it declares global or nonlocal."""
    out, declared = set(), set()
    if isinstance(fn, _COMPREHENSIONS):
        return {n.id for g in fn.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
    a = fn.args
    out |= {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [v for v in (a.vararg, a.kwarg) if v]}
    todo = list(fn.body) if isinstance(fn.body, list) else [fn.body]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, (ast.Lambda, *_COMPREHENSIONS, ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            declared |= set(node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            out.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            out.add(node.name)
        todo += list(ast.iter_child_nodes(node))
    return out - declared


def _imported_in(node) -> set[str]:
    """Names an import anywhere inside ``node`` binds (such a name may hold the module there)."""
    return {a.asname or a.name.split(".")[0] for sub in ast.walk(node) if isinstance(sub, (ast.Import, ast.ImportFrom))
            for a in sub.names}


def _shadowed_loads(tree: ast.Module) -> set[int]:
    """ids of the Name loads that read a name local to an enclosing function, lambda or
    comprehension, or the target of an enclosing ``for`` or ``with`` in its body (a parameter or
    loop variable ``P`` is not the module ``P`` a cell imported, unless an import inside binds it)."""
    out: set[int] = set()

    def visit(node, local: frozenset) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            outer = [*getattr(node, "decorator_list", []), *a.defaults, *[d for d in a.kw_defaults if d],
                     *[x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs if x.annotation],
                     *[getattr(node, "returns", None)] * bool(getattr(node, "returns", None))]
            for sub in outer:
                visit(sub, local)
            inner = (local | _own_locals(node)) - _imported_in(node)
            for sub in node.body if isinstance(node.body, list) else [node.body]:
                visit(sub, inner)
            return
        if isinstance(node, _COMPREHENSIONS):
            visit(node.generators[0].iter, local)
            inner = local | _own_locals(node)
            for i, g in enumerate(node.generators):
                for sub in ([] if i == 0 else [g.iter]) + list(g.ifs):
                    visit(sub, inner)
            for sub in ([node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]):
                visit(sub, inner)
            return
        if isinstance(node, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
            # the body of a loop (or with) sees its target bound to an item (or the context's value); a module
            # gets there only from a container or context that names it as a value, which is refused itself
            heads = [node.iter] if isinstance(node, (ast.For, ast.AsyncFor)) else [i.context_expr for i in node.items]
            targets = [node.target] if isinstance(node, (ast.For, ast.AsyncFor)) else \
                [i.optional_vars for i in node.items if i.optional_vars is not None]
            for sub in heads + targets + list(getattr(node, "orelse", [])):
                visit(sub, local)
            bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            inner = (local | bound) - _imported_in(node)
            for sub in node.body:
                visit(sub, inner)
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in local:
            out.add(id(node))
        for sub in ast.iter_child_nodes(node):
            visit(sub, local)

    visit(tree, frozenset())
    return out


_MISSING = object()


@functools.lru_cache(maxsize=4096)
def _resolve(dotted: str):
    """The object the dotted path (``torch.distributed``, ``collections._sys``) names, looked up
    (never imported) through the modules this process has loaded, statically (no ``__getattr__``
    runs); :data:`_MISSING` when it cannot be found so. The longest prefix that is one of the kit's
    modules or on :data:`ALLOWED_IMPORTS` is imported first (code the grader trusts, which the
    kernel may import too), so that the path is judged as the kernel sees it (``ipywidgets``'s
    attributes; ``labkit.pipeline.simulate``, a function the package re-exports, not the submodule
    it hides). A path through a submodule that neither imports it names stays unresolved."""
    import importlib
    import inspect
    import sys

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in ALLOWED_IMPORTS or prefix == "labkit" or prefix in _LABKIT_MODULES:
            if prefix not in sys.modules:
                try:
                    importlib.import_module(prefix)
                except Exception:  # noqa: BLE001 - a module that does not import here: unresolved
                    pass
            break
    obj = sys.modules.get(parts[0], _MISSING)
    for part in parts[1:]:
        if obj is _MISSING:
            break
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            obj = _MISSING
    return obj


def _is_module(dotted: str) -> bool:
    """Whether the dotted path names a module (:func:`_resolve`; else by the allow-list, the kit's
    module list and the modules loaded here)."""
    import sys
    import types

    obj = _resolve(dotted)
    if obj is _MISSING:
        return dotted in ALLOWED_IMPORTS or dotted in _LABKIT_MODULES or dotted in sys.modules
    return isinstance(obj, types.ModuleType)


# module names (their first part) whose objects no path may reach under another name; "posix" is os
_UNDER_ANOTHER_NAME = set(FORBIDDEN_MODULES) | {"_pickle", "_imp", "_posixsubprocess", "_ctypes"}
# the kernel's own machinery (its shell runs code from strings): reached by no path, IPython.display's display
# functions and classes aside (the import the allow-list names)
_PUBLIC_PRIVATE = {"os._exit"}   # documented functions whose names start with "_"
_KERNEL_MODULES = ("IPython", "ipykernel", "jupyter_client", "jupyter_core", "zmq", "traitlets", "comm")
_DISPLAY_MODULES = ("IPython.display", "IPython.core.display", "IPython.core.display_functions", "IPython.lib.display")
_KERNEL_WHY = "reaches the kernel's machinery (its shell runs code from strings); only IPython.display may be used"


@functools.lru_cache(maxsize=4096)
def _reached_by_path(dotted: str) -> str:
    """Why the object an attribute path reaches is refused ("" when it is not), judged on the
    object (:func:`_resolve`), whatever the names it goes through: a module or a function of
    one whose import is refused (``collections._sys``'s ``modules``, ``enum.bltns.exec``,
    ``distributed_c10d._unpickler``), a builtin (``exec``, ``getattr``) reached through a module,
    or a refused attribute of ``sys``, ``os``, ``torch`` or ``inspect`` reached through an alias."""
    import builtins as _builtins
    import inspect
    import sys
    import types

    parts = dotted.split(".")
    if parts[0] == "IPython" and parts[1:2] != ["display"]:
        return _KERNEL_WHY
    if parts[:2] == ["labkit", "grading"] and parts[2:] != ["check"]:
        return "the grader's code is not the course's labkit; only `from labkit.grading import check` is allowed"
    obj = _resolve(dotted)
    if obj is _MISSING:
        return ""
    base_path, _, last = dotted.rpartition(".")
    base = _resolve(base_path) if base_path else _MISSING
    if isinstance(base, types.ModuleType):
        home = {"posix": "os", "nt": "os"}.get(base.__name__, base.__name__)
        if last in MODULE_ATTRS.get(home, {}):
            return MODULE_ATTRS[home][last]
    for mod, attrs in MODULE_ATTRS.items():   # os.system as another module's attribute of another name
        m = sys.modules.get(mod)
        for attr, why in attrs.items():
            if m is not None and not isinstance(obj, (int, str, bool)) \
                    and inspect.getattr_static(m, attr, _MISSING) is obj:
                return why
    if dotted not in _PUBLIC_PRIVATE and any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
                                             for p in parts[1:]):
        return ("a private name of a module you did not write (not course material; private helpers import, "
                "unpickle and run code by name)")
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = getattr(obj, "__module__", None) if isinstance(obj, (type, types.FunctionType,
                                                                      types.BuiltinFunctionType)) else None
        if name == "builtins" and getattr(_builtins, getattr(obj, "__name__", ""), None) is obj \
                and isinstance(base, types.ModuleType):
            return "reaches the interpreter's builtins through a module"
        if name == "builtins":
            return ""
    if isinstance(name, str) and name.split(".")[0] in _UNDER_ANOTHER_NAME:
        return f"reaches {name} (whose import is refused) under another name"
    if isinstance(name, str) and name.split(".")[0] in _KERNEL_MODULES and not any(
            name == m or name.startswith(m + ".") for m in _DISPLAY_MODULES):
        return _KERNEL_WHY
    return ""


def _module_values(tree: ast.Module, names: "_Names") -> list[tuple[int, str, str]]:
    """(line, what, why) for each module the cell uses as a value: a name an import bound to a
    module, or an attribute chain from one that names a module (``torch.distributed``), read
    anywhere but as the base of a written-out attribute (``S.gpipe_schedule``, ``torch.cat``,
    ``getattr(torch, "float32")``).
    Passed to a function (``getattr(S, ...)``, ``Formatter().get_field(..., (S,), ...)``, ``dir``),
    stored (``box = [S]``, ``for m in (sys,)``) or returned, a module hides which of its
    attributes the code reaches, so the rules on labkit's references and on module attributes
    (``sys.modules``) could not see them; and torch's and numpy's unpickling loaders
    (:data:`LOADERS`) called with more than the file and its map location positionally, with
    ``*``/``**`` unpacking, used as a value, or (torch's) without ``weights_only=True``."""
    parent = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    shadowed = _shadowed_loads(tree)
    out = []
    reached: dict[int, tuple] = {}   # id(node) -> (node, why) of paths reaching a refused object
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            paths = () if id(node) in shadowed else names.origins.get(node.id, ())
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) or _const_getattr(node) is not None:
            paths = _paths(node, names)
        else:
            continue
        up = parent.get(id(node))
        base = isinstance(up, ast.Attribute) and up.value is node or (  # m.name, getattr(m, "name"), hasattr
            isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id in ("getattr", "hasattr")
            and len(up.args) >= 2 and up.args[0] is node and isinstance(up.args[1], ast.Constant)
            and isinstance(up.args[1].value, str))
        if isinstance(node, (ast.Attribute, ast.Call)):
            why = next(filter(None, map(_reached_by_path, paths)), "")
            if why:
                reached[id(node)] = (node, why)
        if any(_is_module(p) for p in paths) and not base:
            out.append((node.lineno, f"`{ast.unparse(node)}` used as a value", "a module passed on, stored or "
                        "looked into by a computed name hides which of its attributes the code reaches; write "
                        "the attribute out (module.function)"))
        loader = next((p for p in paths if p.split(".")[0] in ("torch", "numpy")
                       and p.rsplit(".", 1)[-1] in LOADERS), "")
        if not loader:
            continue
        call = up if isinstance(up, ast.Call) and up.func is node else None
        keywords = {k.arg: k.value for k in call.keywords} if call else {}
        wo = keywords.get("weights_only")
        problem = ("used as a value" if call is None else
                   "with * or ** unpacking" if None in keywords or any(isinstance(a, ast.Starred) for a in call.args)
                   else "with more positional arguments than the file and its map location"
                   if len(call.args) > LOADERS[loader.rsplit(".", 1)[-1]] else
                   "without weights_only=True" if loader.startswith("torch.") and not (
                       isinstance(wo, ast.Constant) and wo.value is True) else "")
        if problem:
            out.append((node.lineno, f"`{ast.unparse(node)}` {problem}", "can unpickle (runs code by name); call "
                        "it with the file alone, and torch.load with weights_only=True"))
    for node, why in reached.values():   # the shortest path that reaches it (not every longer one)
        if id(node.value if isinstance(node, ast.Attribute) else node.args[0]) not in reached:
            out.append((node.lineno, f"`{ast.unparse(node)}`", why))
    return out


def _import_problems(node, allow: set[str]) -> list[tuple[int, str, str]]:
    out, line = [], node.lineno
    if isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
    else:
        mods = [node.module or ""]
    if isinstance(node, ast.ImportFrom) and node.level:
        return [(line, f"`from {'.' * node.level}{node.module or ''} import ...`", _IMPORT_WHY)]
    if isinstance(node, ast.ImportFrom) and node.module == "labkit":
        mods += [f"labkit.{a.name}" for a in node.names if a.name == "grading"]
    for full in mods:
        top = full.split(".")[0]
        if top in FORBIDDEN_MODULES:
            out.append((line, f"import of `{full}`", FORBIDDEN_MODULES[top]))
        elif not allowed_import(full) and not full.startswith("labkit.grading"):
            out.append((line, f"import of `{full}`", _IMPORT_WHY))
        if full == "labkit.grading" or full.startswith("labkit.grading."):
            ok = isinstance(node, ast.ImportFrom) and full == "labkit.grading" and all(
                a.name in _ALLOWED_GRADING_IMPORTS for a in node.names)
            if not ok:
                out.append((line, f"import from `{full}`", "the grader's code is not the course's labkit; only "
                            "`from labkit.grading import check` is allowed"))
    if isinstance(node, ast.ImportFrom):
        top = (node.module or "").split(".")[0]
        for a in node.names:
            if a.name == "*":
                out.append((line, f"`from {node.module} import *`", "binds names the grader cannot see; import "
                            "the names you use"))
            elif a.name in FORBIDDEN_NAMES and a.name not in allow:
                out.append((line, f"import of `{a.name}`", FORBIDDEN_NAMES[a.name]))
            elif a.name in FORBIDDEN_ATTRS and a.name not in allow:
                out.append((line, f"import of `{a.name}`", FORBIDDEN_ATTRS[a.name]))
            elif a.name in MODULE_ATTRS.get(top, {}):
                out.append((line, f"import of `{top}.{a.name}`", MODULE_ATTRS[top][a.name]))
            elif a.name.startswith("_") and not (a.name.startswith("__") and a.name.endswith("__")):
                out.append((line, f"import of `{a.name}`", "a private name of a module you did not write (not "
                            "course material; private helpers import, unpickle and run code by name)"))
    return out


def _bound_inside(fn) -> set[str]:
    """Names local to a function or class body: its arguments, what it assigns, and the functions
    and classes defined in it (less those declared ``global``). Names a local import binds are
    not local here: they are judged as imports (conservative)."""
    out, declared_global = set(), set()
    for sub in ast.walk(fn):
        if isinstance(sub, ast.arg):
            out.add(sub.arg)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and sub is not fn:
            out.add(sub.name)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            declared_global |= set(sub.names)
    return out - declared_global


def _free(stmt: ast.stmt) -> list[ast.Name]:
    """The Name nodes of ``stmt`` that read a top-level (or imported) name."""
    local = _bound_inside(stmt) if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else set()
    return [n for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local]


def _attrs(stmt: ast.stmt) -> list[tuple[int, str, str]]:
    """(line, attribute name, the name or attribute it is taken from, else "") for each attribute
    the statement names; ``getattr(x, "name")`` counts (taken from "")."""
    out = []
    for sub in ast.walk(stmt):
        if isinstance(sub, ast.Attribute):
            v = sub.value
            out.append((sub.lineno, sub.attr, v.id if isinstance(v, ast.Name) else getattr(v, "attr", "")))
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in ("getattr", "hasattr") \
                and len(sub.args) >= 2 and isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str):
            out.append((sub.lineno, sub.args[1].value, ""))
    return out


def _constant(node) -> bool:
    """A literal that no call can mutate (number, string, tuple of such)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant(node.left) and _constant(node.right)
    return isinstance(node, ast.Tuple) and all(_constant(e) for e in node.elts)


def _fixed(stmts, names: "_Names") -> set[str]:
    """Names no call can change: imported ones and those only ever bound to literals."""
    literal: dict[str, bool] = {}
    for _, stmt in stmts:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Assign):
                for t in sub.targets:
                    if isinstance(t, ast.Name):
                        literal[t.id] = literal.get(t.id, True) and _constant(sub.value)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                literal.setdefault(sub.id, False)
    for _, stmt in stmts:  # a name also bound another way (for, with, augmented) is not fixed
        for sub in ast.walk(stmt):
            if isinstance(sub, (ast.AugAssign, ast.For, ast.With, ast.AnnAssign, ast.NamedExpr)):
                for t in ast.walk(sub.target if not isinstance(sub, ast.With) else sub):
                    if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                        literal[t.id] = False
    return {n for n, ok in literal.items() if ok} | (set(names.origins) - set(literal))


def _defines(stmt: ast.stmt, fixed: set[str]) -> set[str]:
    """Top-level names this statement binds, mutates or hands to a call (a conservative reading:
    ``x.update(...)`` and ``fill(x)`` may change ``x``, unless ``x`` is in ``fixed``)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {a.asname or a.name.split(".")[0] for a in stmt.names}
    out = set()
    for sub in ast.walk(stmt):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            out.add(sub.id)
        elif isinstance(sub, (ast.Attribute, ast.Subscript)) and isinstance(sub.ctx, (ast.Store, ast.Del)):
            r = _root(sub)
            if isinstance(r, ast.Name):
                out.add(r.id)
        elif isinstance(sub, ast.Call):
            changed = []
            if isinstance(sub.func, ast.Attribute):
                changed.append(_root(sub.func.value))  # x.update(...), x[k].append(...)
            if not (isinstance(sub.func, ast.Name) and sub.func.id == "check"):
                changed += [_root(a) for a in list(sub.args) + [k.value for k in sub.keywords]]  # fill(table)
            out |= {r.id for r in changed if isinstance(r, ast.Name) and r.id not in fixed}
    return out


def _reference_names(exercise_id: str) -> dict[str, str]:
    """{name: "module:qualname"} of labkit's references for the exercise (first part of each qualname)."""
    try:
        from .registry import get_exercise

        labels = get_exercise(exercise_id).reference_names()
    except Exception:  # noqa: BLE001 - an exercise this process does not know: the table alone
        from .references import references_for

        labels = references_for(exercise_id)
    out = {}
    for label in labels:
        qual = str(label).partition(":")[2] or str(label)
        out[qual.split(".")[0]] = str(label)
    return out


def _ref_why(label: str) -> str:
    mod, _, qual = str(label).partition(":")
    return f"labkit's own {qual or mod} ({mod}) is the reference this exercise asks you to write"


def _launder_why(node: str, label: str) -> str:
    mod, _, name = node.partition(":")
    rmod, _, rqual = str(label).partition(":")
    return (f"labkit's {name} ({mod}) runs labkit's own {rqual or rmod} ({rmod}), the reference this exercise "
            f"asks you to write")


def _labkit_label(dotted: str) -> str:
    """"module:name" of a dotted path into the kit (``labkit.pipeline.explorer.build_schedule``:
    the longest module prefix, then the next name), or "" outside labkit."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        mod = ".".join(parts[:i])
        if mod == "labkit" or mod in _LABKIT_MODULES:
            return f"{mod}:{parts[i]}"
    return ""


def _const_getattr(node) -> str | None:
    """The attribute name of ``getattr(x, "name")`` (a written-out name, as ``x.name``), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) in (2, 3) and isinstance(node.args[1], ast.Constant) \
            and isinstance(node.args[1].value, str):
        return node.args[1].value
    return None


@functools.lru_cache(maxsize=1024)
def _home_label(node: str) -> str:
    """"module:name" where the object that the kit's ``node`` ("labkit.pipeline:gpt_stages_for_rank")
    stands for was defined (``labkit.pipeline.stages:gpt_stages_for_rank``): the module imported
    and the name looked up as the kernel would (the kit's own code, a package's lazy
    ``__getattr__`` included); "" when it is not a function or class of the kit."""
    import importlib

    mod, _, name = node.partition(":")
    if not mod or not name:
        return ""
    try:
        obj = getattr(importlib.import_module(mod), name)
    except Exception:  # noqa: BLE001 - no such name in the kit
        return ""
    home, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (isinstance(home, str) and isinstance(qual, str) and home.startswith("labkit.")):
        return ""
    return f"{home}:{qual.split('.')[0]}"


def _paths(node: ast.expr, names: "_Names") -> list[str]:
    """The dotted paths an attribute chain stands for (``getattr(x, "name")`` read as ``x.name``), one
    per import origin of the name it starts at; [] for anything else."""
    chain, v = [], node
    while True:
        if isinstance(v, ast.Attribute):
            chain.append(v.attr)
            v = v.value
        elif (attr := _const_getattr(v)) is not None:
            chain.append(attr)
            v = v.args[0]
        else:
            break
    if not chain or not isinstance(v, ast.Name):
        return []
    return [".".join([origin, *reversed(chain)]) for origin in names.origins.get(v.id, ())]



def _rebinds(stmt: ast.stmt, name: str) -> bool:
    """Whether ``stmt`` gives ``name`` a new value outright (def, class, import, ``name = ...``)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return True
    return isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)


def _import_origin(stmt: ast.stmt, name: str) -> str:
    """"module.name" that an import statement binds to ``name`` ("" for other statements)."""
    if isinstance(stmt, ast.ImportFrom):
        return next((f"{stmt.module or ''}.{a.name}" for a in stmt.names if (a.asname or a.name) == name), "")
    if isinstance(stmt, ast.Import):
        return next((a.name if a.asname else name for a in stmt.names if (a.asname or a.name.split(".")[0]) == name),
                    "")
    return ""


def _is_autograd(base: str, names: _Names) -> bool:
    """Whether ``base`` (what ``.grad`` is taken from) is ``torch.autograd`` or ``torch.func``,
    whose ``grad`` returns gradients without writing ``.grad``."""
    return base in ("autograd", "func") or any(o in ("torch.autograd", "torch.func")
                                               for o in names.origins.get(base, ()))


def _in_answer(exercise_id: str, answer: str, stmts, names: _Names) -> list[tuple[str, int, str, str]]:
    """Rule 2: (cell, line, what, why) for each forbidden use in the answer's closure.

    Flow-aware: a name read at top-level position p has the value of its last outright binding
    before p plus every change made to it after that binding; a function body may run at any
    later time, so its names are read both where it was reached and at the end."""
    refs = _reference_names(exercise_id)
    rules = EXERCISE_RULES.get(exercise_id, {})
    banned_modules = EXERCISE_MODULES.get(exercise_id, ())
    from .reach import reaching

    # a kit function or class from which the reference can be reached (a kit cell's MoELayer whose router
    # the answer drives): judged in the answer's closure too, whatever cell made the object
    launder = reaching(tuple(refs.values())) if refs else {}

    def laundered(dotted: str) -> str:
        node = _kit_node(dotted, launder)
        return _launder_why(node, launder[node]) if node else ""
    allow = ALLOW.get(exercise_id, set())
    fixed = _fixed(stmts, names)
    by_name: dict[str, list] = {}
    for pos, (_cell, stmt) in enumerate(stmts):
        for n in _defines(stmt, fixed):
            by_name.setdefault(n, []).append(pos)
    end = len(stmts)

    def value_at(name: str, p: int) -> list[int]:
        out = []
        for pos in reversed([q for q in by_name.get(name, ()) if q < p]):
            out.append(pos)
            if _rebinds(stmts[pos][1], name):
                break
        return out

    out: list[tuple[str, int, str, str]] = []
    todo: list[tuple[str, int]] = [(answer, end)]
    roots = []
    for pos, (cell, stmt) in enumerate(stmts):  # check("N.k", <expression>): its expression counts too
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "check" \
                    and sub.args and isinstance(sub.args[0], ast.Constant) and sub.args[0].value == exercise_id:
                roots.append((pos, cell, ast.Expr(ast.Tuple(sub.args[1:], ast.Load()), lineno=sub.lineno,
                                                  col_offset=0)))
    seen: set = set()
    # the last check counts; (pos, cell, statement, context position)
    visits = [(pos, cell, node, pos) for pos, cell, node in roots[-1:]]
    while todo or visits:
        while todo:
            name, p = todo.pop()
            if (name, p) in seen:
                continue
            seen.add((name, p))
            for pos in value_at(name, p):
                visits.append((pos, stmts[pos][0], stmts[pos][1], p))
        if not visits:
            break
        pos, cell, stmt, ctx = visits.pop()
        if ("stmt", id(stmt), ctx) in seen:
            continue
        seen.add(("stmt", id(stmt), ctx))
        is_def = isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            continue  # judged where the name it binds is read
        free = _free(stmt)
        for n in free:
            at = [ctx, end] if is_def else [pos]
            for q in at:
                todo.append((n.id, q))
                if n.id in rules and n.id in _BUILTIN_NAMES and not value_at(n.id, q):  # open(...)
                    out.append((cell, n.lineno, f"`{n.id}`", rules[n.id]))
                for b in value_at(n.id, q):
                    origin = _import_origin(stmts[b][1], n.id)
                    last = origin.rsplit(".", 1)[-1]
                    if origin.startswith("labkit.") and last in refs:
                        out.append((cell, n.lineno, f"`{n.id}`", _ref_why(refs[last])))
                    elif origin.startswith("labkit.") and (why := laundered(origin)):
                        out.append((cell, n.lineno, f"`{n.id}`", why))
                    elif origin and last in rules:
                        out.append((cell, n.lineno, f"`{n.id}`", rules[last]))
                    elif origin and origin.split(".")[0] in banned_modules:
                        out.append((cell, n.lineno, f"`{n.id}` (from `{origin.split('.')[0]}`)", _SIDE_WHY))
                    elif origin and last in _SOURCE and last not in allow:
                        out.append((cell, n.lineno, f"`{n.id}`", "reads source text; write the computation yourself"))
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Attribute):
                why = next(filter(None, (laundered(p) for p in _paths(sub, names) if p.startswith("labkit."))), "")
                if why:
                    out.append((cell, sub.lineno, f"`{ast.unparse(sub)}`", why))
        for line, attr, base in _attrs(stmt):
            if attr in refs:
                out.append((cell, line, f"`.{attr}`", _ref_why(refs[attr])))
            elif attr in rules and not (attr == "grad" and _is_autograd(base, names)):  # torch.autograd.grad
                out.append((cell, line, f"`.{attr}`", rules[attr]))
            elif attr in _SOURCE and attr not in allow:
                out.append((cell, line, f"`.{attr}`", "reads source text; write the computation yourself"))
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) \
                    and sub.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(sub.args) >= 2 \
                    and not (isinstance(sub.args[1], ast.Constant) and isinstance(sub.args[1].value, str)):
                out.append((cell, sub.lineno, f"`{sub.func.id}` with a computed name",
                            "the grader cannot see which attribute it reaches; name the attribute"))
    return out


def _shipped_cells(exercise_id: str) -> frozenset:
    """The code cells of the learner notebook the kit ships for the exercise (``labkit/_notebooks``,
    normalised): the kit's own text, which may import what the learner may not."""
    return _shipped_for(str(exercise_id).split(".")[0])


@functools.lru_cache(maxsize=None)
def _shipped_sources(major: str) -> tuple[str, ...]:
    """The code cells of the learner notebook the kit ships for notebook ``major``
    (``labkit/_notebooks``), in order, as written."""
    import glob
    import json
    import os

    import labkit

    folder = os.path.join(os.path.dirname(os.path.abspath(labkit.__file__)), "_notebooks")
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


@functools.lru_cache(maxsize=None)
def _shipped_for(major: str) -> frozenset:
    """:func:`_shipped_sources`, normalised, as a set."""
    return frozenset(src.strip() for src in _shipped_sources(major))


def _skeleton(tree: ast.AST) -> str:
    """The cell's code with every literal blanked: a kit cell whose seed, sizes or labels a learner
    changed keeps the kit's code. Kept: an attribute name given to getattr and its kind, and every
    string of a cell that looks an attribute up by a computed name (``getattr(row, part)`` over a
    tuple of field names: there a string is a name)."""
    import copy

    t = copy.deepcopy(tree)
    calls = [n for n in ast.walk(t) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in _ATTR_FUNCS and len(n.args) >= 2]
    keep_strings = any(not isinstance(c.args[1], ast.Constant) for c in calls)
    names = {id(c.args[1]) for c in calls}
    for n in ast.walk(t):
        if isinstance(n, ast.Constant) and id(n) not in names and not (
                keep_strings and isinstance(n.value, (str, bytes))):
            n.value = ...
    return ast.dump(t)


@functools.lru_cache(maxsize=None)
def _shipped_shapes(major: str) -> tuple[frozenset, frozenset]:
    """(skeletons of the kit's cells, ``ast.dump`` of each import statement in them)."""
    trees = _shipped_trees(major)
    imports = {ast.dump(n) for t in trees for n in ast.walk(t) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return frozenset(map(_skeleton, trees)), frozenset(imports)


def _kit_import(node, major: str) -> bool:
    """Whether ``node`` is an import statement the kit's notebook has word for word."""
    return isinstance(node, (ast.Import, ast.ImportFrom)) and ast.dump(node) in _shipped_shapes(major)[1]


_TYPE_NODES = (ast.Name, ast.Attribute, ast.Subscript, ast.Tuple, ast.List, ast.Constant, ast.BinOp, ast.BitOr,
               ast.Load, ast.expr_context)


def _annotation_only(tree_list, name: str) -> bool:
    """Whether every read of ``name`` in the learner's cells is inside an annotation (a type named
    in a signature computes nothing)."""
    inside, loads = set(), []
    for tree in tree_list:
        for node in ast.walk(tree):
            anns = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                anns = [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                        if x is not None and x.annotation is not None] + ([node.returns] if node.returns else [])
            elif isinstance(node, ast.AnnAssign):
                anns = [node.annotation]
            # a type, not code: names, attributes, subscripts (list[T]), unions and literals only; an
            # annotation is evaluated when the def runs, so one with a call in it counts as code
            inside |= {id(n) for ann in anns if all(isinstance(n, _TYPE_NODES) for n in ast.walk(ann))
                       for n in ast.walk(ann)}
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id == name:
                loads.append(node)
    return all(id(n) in inside for n in loads)


@functools.lru_cache(maxsize=None)
def _shipped_trees(major: str) -> tuple:
    """The parsed code cells of the learner notebook the kit ships for notebook ``major`` (read only)."""
    return tuple(t for src in _shipped_for(major) if (t := _python(src)) is not None)


def _kit_node(dotted: str, *tables) -> str:
    """The kit's "module:name" for the dotted path, as written or where its object was defined (a
    name a package exports lazily), that one of ``tables`` holds; "" when none does."""
    lab = _labkit_label(dotted)
    for node in (lab, _home_label(lab) if lab else ""):
        if node and any(node in t for t in tables):
            return node
    return ""


def _reference_anywhere(exercise_id: str, parsed, names: "_Names") -> list[Violation]:
    """Principle 3 of issue 16 as written: labkit's reference for the exercise, or a labkit
    function from which it can be reached, named in ANY cell up to the grading point (an import,
    a module attribute, or a name a shipped cell imported), whatever the answer's code reaches:
    no flow through globals, containers, decorators or exceptions can hide it. The cells the kit
    ships in the learner notebook are exempt (they may import labkit's functions for plots)."""
    refs = _reference_names(exercise_id)
    if not refs:
        return []
    from .reach import reaching

    labels = set(refs.values())
    launder = reaching(tuple(refs.values()))

    def label_of(origin: str) -> str:
        return _kit_node(origin, labels, launder)

    def why(node: str) -> str:
        return _ref_why(node) if node in labels else _launder_why(node, launder[node])

    # names bound (anywhere) to a reference by an import; where: (cell, top-level statement) of each binding
    bound: dict[str, str] = {}
    bound_at: dict[str, list[tuple[int, int]]] = {}
    for c, (_, tree) in enumerate(parsed):
        for s, stmt in enumerate(tree.body):
            for node in ast.walk(stmt):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                    for a in node.names:
                        lab = label_of(f"{node.module}.{a.name}")
                        if lab:
                            bound[a.asname or a.name] = lab
                            bound_at.setdefault(a.asname or a.name, []).append((c, s))
    # a name the learner's own cells define (their answer may share a reference's name) is theirs from that
    # definition on, when it is a top-level def or class (a def nested in a function binds nothing global until
    # called: it clears nothing), no import binds the name again after it, and no code of the learner's names
    # it before it (what ran or was defined before the def saw the reference)
    own_at: dict[str, tuple[int, int]] = {}
    used_at: dict[str, list[tuple[int, int]]] = {}
    for c, (label, tree) in enumerate(parsed):
        if label.startswith("__shipped__"):
            continue
        for s, stmt in enumerate(tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name in bound:
                own_at.setdefault(stmt.name, (c, s))
            shadowed = _shadowed_loads(stmt)
            for node in ast.walk(stmt):
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bound \
                        and id(node) not in shadowed:
                    used_at.setdefault(node.id, []).append((c, s))
    for name, at in own_at.items():
        if all(b < at for b in bound_at[name]) and all(u >= at for u in used_at.get(name, [])):
            bound.pop(name)
    out = []
    major = str(exercise_id).split(".")[0]
    for label, tree in parsed:
        if label.startswith("__shipped__"):
            continue
        shadowed = _shadowed_loads(tree)  # a local of that name is not the import
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 1)
            if _kit_import(node, major) or id(_root(node)) in shadowed:
                continue  # the kit's own import statement (what it binds is judged where it is read)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
                for a in node.names:
                    lab = label_of(f"{node.module}.{a.name}")
                    if lab:
                        out.append(Violation(label, line, f"import of `{a.name}`", why(lab)))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in bound:
                out.append(Violation(label, line, f"`{node.id}`", why(bound[node.id])))
            elif isinstance(node, ast.Attribute) or _const_getattr(node) is not None:
                for lab in filter(None, map(label_of, _paths(node, names))):
                    out.append(Violation(label, line, f"`{ast.unparse(node)}`", why(lab)))
    return out


# labkit names a notebook's text tells the learner to call, beyond those its cells import ("communicate
# through labkit.comm.all_reduce": CommLog counts that call)
PROVIDED = {"06": {"labkit.comm:all_reduce"}, "07": {"labkit.comm:all_reduce"}}


@functools.lru_cache(maxsize=None)
def _provided(major: str) -> tuple[frozenset, frozenset]:
    """The labkit objects notebook ``major`` gives the learner: every labkit name its shipped cells
    import or read through a module, and :data:`PROVIDED`; as labels ("module:name" as written and
    where the object was defined) and as the ids of the objects themselves (a constant re-exported
    under another module has no home to compare)."""
    trees = _shipped_trees(major)
    names = _Names(trees)
    extra = PROVIDED.get(f"{int(major):02d}" if major.isdigit() else major, set())
    dotted = {lab.replace(":", ".") for lab in extra}
    for tree in trees:
        for node in ast.walk(tree):
            dotted.update(_labkit_uses(node, names))
    labels = {lab for d in dotted if (lab := _labkit_label(d))}
    labels |= {_home_label(lab) for lab in labels}
    objects = {id(obj) for d in dotted if (obj := _resolve(d)) is not _MISSING}
    return frozenset(labels - {""}), frozenset(objects)


def _labkit_uses(node, names: "_Names") -> list[str]:
    """The dotted labkit paths one node names: each name of a ``from labkit... import``, or an
    attribute chain read through a name bound to labkit."""
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
        return [f"{node.module}.{a.name}" for a in node.names]
    if isinstance(node, ast.Attribute) or _const_getattr(node) is not None:
        return [p for p in _paths(node, names) if p == "labkit" or p.startswith("labkit.")]
    return []


def _unprovided(exercise_id: str, parsed, names: "_Names") -> list[Violation]:
    """The allow-list of labkit names: a learner's cell may use (import, or read through a module)
    only the labkit functions, classes and constants the notebook's own cells import (and what its
    text tells the learner to call, :data:`PROVIDED`), a module itself (every attribute read
    through it is judged again), and ``labkit.grading.check`` (its own rule). Any other part of
    the kit may compute an answer without being one of the exercise's listed references; the
    learner writes that part with torch instead. An exercise of no notebook the kit ships (a
    course's own) has no such list."""
    major = str(exercise_id).split(".")[0]
    if not _shipped_for(major):
        return []
    labels, objects = _provided(major)
    learner = [t for label, t in parsed if not label.startswith("__shipped__")]
    out = []
    for label, tree in parsed:
        if label.startswith("__shipped__"):
            continue
        shadowed = _shadowed_loads(tree)
        for node in ast.walk(tree):
            if _kit_import(node, major) or id(_root(node)) in shadowed:
                continue
            if isinstance(node, ast.ImportFrom) and all(_annotation_only(learner, a.asname or a.name)
                                                        for a in node.names):
                continue  # a type named in signatures only
            for dotted in _labkit_uses(node, names):
                if dotted == "labkit" or dotted.startswith("labkit.grading") or _is_module(dotted):
                    continue
                lab = _labkit_label(dotted)
                if not lab or _kit_node(dotted, labels):
                    continue
                obj = _resolve(dotted)
                if obj is not _MISSING and id(obj) in objects:
                    continue
                mod, _, name = lab.partition(":")
                out.append(Violation(label, getattr(node, "lineno", 1), f"`{name}` ({mod})",
                                     f"not one of the labkit names notebook {major.zfill(2)} gives you, those its own "
                                     f"cells import: the grader accepts no other part of the kit, which could "
                                     f"compute an answer; remove the line, or write that code with torch"))
    return out

@functools.lru_cache(maxsize=None)
def _kit_reads(major: str) -> frozenset:
    """Names the kit's cells of notebook ``major`` read (call or use) but do not get from an import."""
    trees = _shipped_trees(major)
    reads = {n.id for t in trees for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return frozenset(reads - set(_Names(trees).origins))


def _kit_hooks(exercise_id: str, parsed) -> list[Violation]:
    """A learner's top-level function or class (or a name bound to one) that a kit cell calls by
    name, other than an exercise's answer: the kit cell would run it with the kit's objects (a
    ``def sum`` that catches what a kit cell sums), handing them to the learner's code."""
    from .assignments import ANSWERS

    major = str(exercise_id).split(".")[0]
    if not _shipped_for(major):
        return []
    reads = _kit_reads(major) - {name for ex, name in ANSWERS.items() if ex.split(".")[0] == major}
    out, own = [], set()
    for label, tree in parsed:
        if label.startswith("__shipped__"):
            continue
        for stmt in tree.body:
            bound = []
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(stmt.name)
                bound = [stmt.name]
            elif isinstance(stmt, ast.Assign) and (isinstance(stmt.value, ast.Lambda) or (
                    isinstance(stmt.value, ast.Name) and stmt.value.id in own)):
                bound = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
            out += [Violation(label, stmt.lineno, f"`{name}`", f"a cell of the notebook calls `{name}`: yours would "
                              f"run inside the kit's code with its objects; give your function another name")
                    for name in bound if name in reads]
    return out


def check_cells(exercise_id: str, answer: str, cells) -> list[Violation]:
    """Violations of exercise ``exercise_id``'s rules in ``cells``: ``[(label, source), ...]``,
    the code cells up to (and including) the one where the exercise is graded, in order.

    ``answer`` is the name of the learner's function or class (e.g. "bubble_fraction"). Returns
    [] when the code keeps the rules (see the module docstring); each :class:`Violation` names the
    cell, line, construct and rule, in cell order. A cell that does not parse is skipped (it
    raised SyntaxError in the kernel and ran nothing).
    """
    ex = str(exercise_id)
    allow = ALLOW.get(ex, set())
    shipped = _shipped_cells(ex)
    shapes = _shipped_shapes(ex.split(".")[0])[0]
    marked = [("__shipped__" + label if str(src).strip() in shipped or _skeleton(t) in shapes else label, t)
              for label, src in cells if not _is_install_cell(str(src)) and (t := _python(str(src))) is not None]
    parsed = [(label.removeprefix("__shipped__"), t) for label, t in marked]
    shipped_label = {id(t): label.startswith("__shipped__") for label, t in marked}
    names = _Names([t for _, t in parsed])
    classes = {n.name for _, t in parsed for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    found: list[Violation] = _reference_anywhere(ex, marked, names)
    seen = {(v.cell, v.line) for v in found}  # a reference is named once, as the reference
    found += [v for v in _unprovided(ex, marked, names) if (v.cell, v.line) not in seen]
    found += _kit_hooks(ex, marked)
    scopes = _Scopes([t for _, t in parsed], names, classes)
    for label, tree in parsed:
        found += [Violation(label, line, what, why)
                  for line, what, why in _everywhere(tree, names, classes, allow, scopes,
                                                     learner=not shipped_label.get(id(tree)))]
    stmts = [(label, s) for label, t in parsed for s in t.body]
    found += [Violation(c, line, what, why) for c, line, what, why in _in_answer(ex, answer, stmts, names)]
    order = {label: i for i, (label, _) in enumerate(parsed)}
    unique, keys = [], set()
    for v in sorted(found, key=lambda v: (order.get(v.cell, 0), v.line)):
        if (v.cell, v.line, v.what) not in keys:
            keys.add((v.cell, v.line, v.what))
            unique.append(v)
    return unique


def describe(exercise_id: str) -> str:
    """The rule of exercise ``exercise_id`` in one sentence (shown with a violation)."""
    refs = sorted(n for n in _reference_names(str(exercise_id)) if not n.startswith("_"))
    extra = []
    if refs:
        extra.append("labkit's own " + ", ".join(refs))
    if str(exercise_id) in P2P_ONLY:
        extra.append("collectives, a process group or store of its own, files, pipes, sockets or shared memory "
                     "(send/recv only)")
    if str(exercise_id) == "13.1":
        extra.append(".backward(), .grad or zero_grad (torch.autograd.grad only)")
    if str(exercise_id) == "9.3":
        extra.append("the ModelSpec's own counting methods (total_params, active_params, layer_params, ...)")
    own = f"the code of exercise {exercise_id} must not use {' or '.join(extra)}; " if extra else ""
    return (f"{own}no cell up to exercise {exercise_id}'s check may run code from strings or copies of code "
            f"(exec, eval, compile, __code__, FunctionType, reload), reach the interpreter (sys.modules, gc, "
            f"ctypes), start processes (subprocess, os.system, os.fork), import labkit.grading (except check), "
            f"import a module other than torch, numpy, matplotlib, the standard numerics or labkit (a module "
            f"written to disk included), use a labkit name the notebook's own cells do not import, or assign "
            f"attributes of modules or classes it did not define")


def check_history(exercise_id: str, answer) -> list[Violation]:
    """:func:`check_cells` on the cells this IPython kernel has run so far (labelled "In [n]");
    [] outside IPython. The answer's name is the exercise's pinned name
    (:data:`labkit.grading.assignments.ANSWERS`), else ``answer.__name__``."""
    try:
        from IPython import get_ipython as _ip
    except ImportError:
        return []
    shell = _ip()
    if shell is None:
        return []
    from .assignments import ANSWERS

    name = ANSWERS.get(str(exercise_id)) or getattr(answer, "__name__", "")
    raw = list(getattr(shell.history_manager, "input_hist_raw", []))
    cells = [(f"In [{i}]", src) for i, src in enumerate(raw) if i and src]
    return check_cells(str(exercise_id), name, cells)
