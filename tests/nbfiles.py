"""Helper shared by the grading tests: write a submission notebook from a list of code cells."""
from pathlib import Path

import nbformat


def write_notebook(path: Path, sources: list[str], notebook: str = "98_hostile") -> None:
    """A notebook at ``path`` whose code cells are ``sources``, claiming to be ``notebook``."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["labkit"] = {"notebook": notebook}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, str(path))
