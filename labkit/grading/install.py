"""The first cell of every learner notebook, apart from :mod:`labkit.grading.build` so that the
grader can recognise it without importing nbformat (whose jsonschema import compiles
rfc3987-syntax's grammars: seconds per kernel, python-jsonschema/jsonschema#1428)."""

__all__ = ["INSTALL_CELL", "INSTALL_CELL_ID", "REPOSITORY_URL"]

REPOSITORY_URL = "https://github.com/labkit-course/labkit"  # also in pyproject.toml's [project.urls]
INSTALL_CELL_ID = "install-labkit"
INSTALL_CELL = f"""# Colab / JupyterHub: install labkit when this Python lacks it (does nothing where it is installed)
import importlib.util, os
if importlib.util.find_spec("labkit") is None:
    %pip install -q {{os.environ.get("LABKIT_PIP_SOURCE", "git+{REPOSITORY_URL}")}}"""
