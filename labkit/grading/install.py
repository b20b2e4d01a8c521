"""The first cell of every learner notebook (:mod:`labkit.grading.build` puts it first).

Where a hosted learner (Colab, a JupyterHub without labkit) installs labkit from is the
instructor's setting, ``[tool.labkit] repository`` in ``pyproject.toml`` (or
``python -m labkit build --repository URL``, which records it there): :func:`install_cell`
writes that URL into the cell. With none set, the cell installs nothing by itself; it tells the
learner how to install labkit (this project owns no public repository to name)."""
from __future__ import annotations

import re

__all__ = ["INSTALL_CELL", "INSTALL_CELL_ID", "install_cell", "repository_problem"]

INSTALL_CELL_ID = "install-labkit"

_HEAD = """# Colab / JupyterHub: install labkit when this Python lacks it (does nothing where it is installed)
import importlib.util, os
if importlib.util.find_spec("labkit") is None:
"""
_WITH_URL = _HEAD + """    %pip install -q {{os.environ.get("LABKIT_PIP_SOURCE", "git+{url}")}}"""
_WITHOUT_URL = _HEAD + """    if "LABKIT_PIP_SOURCE" not in os.environ:
        raise ModuleNotFoundError(
            "labkit is not installed in this Python, and this course named no place to install it from. "
            "Ask your instructor for it (a git+https://... URL or a labkit .whl file), then run "
            "'%pip install <it>' in a new cell, or set LABKIT_PIP_SOURCE to it and run this cell again. "
            "On your own machine: 'make install' in a checkout of labkit, then 'jupyter lab' from its .venv.")
    %pip install -q {os.environ["LABKIT_PIP_SOURCE"]}"""

# what a repository URL may hold: no quote, brace, backslash or space can reach the cell's code
_URL_RE = re.compile(r"https?://[A-Za-z0-9.-]+(?::\d+)?(?:/[A-Za-z0-9._~/@+%=-]*)?")


def repository_problem(url: str) -> str:
    """Why ``url`` cannot be the course's repository ("" when it can): an ``http(s)://`` URL of
    a git repository (``https://github.com/you/labkit``, ``.../labkit.git@v1.0``), nothing else."""
    if not _URL_RE.fullmatch(url):
        return (f"repository {url!r} is not an http(s) URL of a git repository (letters, digits and ._~/@+%=- "
                f"only), e.g. https://github.com/your-course/labkit")
    return ""


def install_cell(repository: str | None = None) -> str:
    """The learner notebooks' first cell. With ``repository`` (an https URL, see
    :func:`repository_problem`): ``%pip install`` of ``git+repository`` when labkit is missing
    (``LABKIT_PIP_SOURCE``, a wheel, folder or other URL, replaces it). Without: the cell raises
    ModuleNotFoundError telling the learner how to install labkit, unless ``LABKIT_PIP_SOURCE``
    says where from. Where labkit is installed (a checkout's .venv, the grader's kernel) both do
    nothing. ValueError for a URL :func:`repository_problem` refuses."""
    if not repository:
        return _WITHOUT_URL
    problem = repository_problem(repository)
    if problem:
        raise ValueError(problem)
    return _WITH_URL.format(url=repository)


INSTALL_CELL = install_cell(None)
