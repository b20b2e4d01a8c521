"""Which notebook a submission is graded as, and nbformat imported fast: shared by the grader
(:mod:`labkit.grading.grader`) and the integrity report (:mod:`labkit.grading.integrity`), which
must not import each other."""
from __future__ import annotations

import re
import sys
from pathlib import Path

from .registry import exercises_for_notebook, get_exercise

__all__ = ["_nbformat", "_notebook_names"]


def _nbformat():
    """nbformat, imported without jsonschema's optional IRI format checker: ``rfc3987_syntax``
    compiles about forty lark grammars when imported (some 2 s of CPU, a large share of grading
    a small notebook), and the notebook schema uses no IRI format."""
    sys.modules.setdefault("rfc3987_syntax", None)  # jsonschema then skips that checker (ImportError)
    import nbformat

    return nbformat


_CHECK_CALL = re.compile(r"""\bcheck\(\s*(?P<q>["'])(?P<id>[^"'\n]+)(?P=q)""")


def _notebook_names(nb, path: Path) -> list[str]:
    """The notebook(s) whose exercises ``nb`` is graded on.

    ``metadata.labkit.notebook`` (written by ``build``); else the file's stem when exercises are
    registered for it; else the notebooks of the exercise ids in ``check("N.k", ...)`` calls
    found in the code cells' sources (a static scan: a renamed copy whose metadata was lost is
    still graded on every exercise of its notebook, whatever ran). Empty when nothing matches.
    """
    name = nb.metadata.get("labkit", {}).get("notebook")
    if name:
        return [name]
    if exercises_for_notebook(path.stem):
        return [path.stem]
    names: list[str] = []
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        for m in _CHECK_CALL.finditer(cell.get("source", "")):
            try:
                ex = get_exercise(m.group("id"))
            except KeyError:
                continue
            if ex.notebook not in names:
                names.append(ex.notebook)
    return names
