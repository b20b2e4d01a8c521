"""Loads a reference the grader withheld from a graded kernel, once the grader releases it.

Only the grader's copy of the kit (:mod:`labkit.grading.withhold`) calls this: there, the body
of each reference of the assignment being graded is ``return _labkit_withheld("module:name")(...)``
and its code lies in this folder as ``module:name.src`` (with ``--`` for ``:``), mode 0600 and
owned by the grader, so the kernel's uid cannot read it until the grader has graded the
exercise and made it readable. Until then every call raises :class:`RuntimeError`. The
installed kit holds no such files and never calls this.
"""
from __future__ import annotations
import __future__

import os
import sys

_CACHE: dict[str, type | object] = {}


def load(label: str, index: int | None = None):
    """The real function for ``label`` ("module:name"), or, with ``index``, the ``index``-th
    method of the real class (a plain function: the caller passes ``self`` or ``cls``).

    Raises RuntimeError while the file is unreadable (the grader has not released it)."""
    real = _CACHE.get(label)
    if real is None:
        mod, _, name = label.partition(":")
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), label.replace(":", "--") + ".src")
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError:
            raise RuntimeError(f"labkit's {name} ({mod}) is withheld while this assignment is graded, until the "
                               f"exercise it belongs to has been graded: it is, or runs, the implementation "
                               f"an exercise asks you to write") from None
        module = sys.modules[mod]
        g = module.__dict__
        stub = g.get(name)
        code = compile(source, getattr(module, "__file__", mod), "exec",
                       flags=__future__.annotations.compiler_flag, dont_inherit=True)
        try:
            exec(code, g)  # noqa: S102 - the kit's own code, released by the grader
            real = g[name]
        finally:
            g[name] = stub
        if isinstance(real, type):  # zero-argument super() in a method: the class its instances have
            for value in vars(real).values():
                fn = getattr(value, "__func__", value)
                free = getattr(getattr(fn, "__code__", None), "co_freevars", ())
                if "__class__" in free:
                    fn.__closure__[free.index("__class__")].cell_contents = stub
        _CACHE[label] = real
    return real if index is None else vars(real)[f"labkit_m{index}"]
