"""The hosted-notebook path: the wheel ships the notebooks, ``python -m labkit notebooks`` copies
them (solutions only when asked), each learner notebook starts with the install cell, which
installs labkit into a Python that lacks it and does nothing where it is installed, and ``build``
outside a checkout says it found no solutions/. A fresh venv sees this environment's packages
(torch, IPython, pip) through a .pth line but not labkit, as on Colab; nothing is downloaded."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import nbformat
import pytest

from labkit.grading.build import INSTALL_CELL, configured_repository, install_cell

ROOT = Path(__file__).resolve().parents[2]


def test_every_learner_notebook_starts_with_the_install_cell():
    cell = install_cell(configured_repository(ROOT))  # the course's repository, or none
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = nbformat.read(str(path), as_version=4).cells[0]
        assert first.cell_type == "code" and first.source == cell, path.name
    for source in (cell, INSTALL_CELL):
        assert [line.strip().split()[0] for line in source.splitlines() if line.strip().startswith("%")] == ["%pip"]
    # no repository this project does not own is named anywhere a learner installs from
    assert "labkit-course" not in cell and "labkit-course" not in (ROOT / "pyproject.toml").read_text()


def _run_cell(python, cwd, env):
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "import sys\nr = InteractiveShell.instance().run_cell(sys.stdin.read())\nr.raise_error()\n")
    return subprocess.run([str(python), "-c", code], input=INSTALL_CELL, capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_install_cell_does_nothing_where_labkit_is_installed(tmp_path):
    env = dict(os.environ, LABKIT_PIP_SOURCE=str(tmp_path / "no-such-package"))  # pip would fail on it
    p = _run_cell(sys.executable, tmp_path, env)
    assert p.returncode == 0 and p.stdout == "", p.stdout + p.stderr


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """A venv without labkit that sees this environment's other packages; and labkit's wheel."""
    tmp = tmp_path_factory.mktemp("hosted")
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(tmp / "venv")], check=True, timeout=120)
    py = tmp / "venv" / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "reuse.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    src = tmp / "src"  # a copy: building in the checkout would leave build/ there
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("labkit", "notebooks", "solutions"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "wheel"), str(src)], check=True, timeout=300, capture_output=True)
    wheel = next((tmp / "wheel").glob("labkit-*.whl"))
    return tmp, py, wheel


def test_install_cell_installs_the_wheel_that_ships_the_notebooks(bare_venv):
    tmp, py, wheel = bare_venv
    work = tmp / "work"
    work.mkdir()
    env = dict(os.environ, LABKIT_PIP_SOURCE=str(wheel), PIP_NO_DEPS="1")  # torch & co. are there already
    env.pop("PYTHONPATH", None)
    missing = subprocess.run([str(py), "-c", "import labkit"], capture_output=True, text=True, cwd=work, env=env)
    assert missing.returncode != 0  # as on Colab: no labkit yet
    # without LABKIT_PIP_SOURCE, the cell of a course that set no repository says how to install labkit
    env.pop("LABKIT_PIP_SOURCE")
    p = _run_cell(py, work, env)
    assert p.returncode != 0 and "ModuleNotFoundError" in p.stdout + p.stderr, p.stdout + p.stderr
    assert "Ask your instructor" in p.stdout + p.stderr and "make install" in p.stdout + p.stderr
    env["LABKIT_PIP_SOURCE"] = str(wheel)
    p = _run_cell(py, work, env)
    assert p.returncode == 0, p.stdout + p.stderr
    where = subprocess.run([str(py), "-c", "import labkit; print(labkit.__file__)"], capture_output=True, text=True,
                           cwd=work, env=env)
    assert where.returncode == 0 and where.stdout.startswith(str(tmp / "venv")), where.stdout + where.stderr

    # the notebooks come with it; solutions only when asked
    p = subprocess.run([str(py), "-m", "labkit", "notebooks", "nb"], capture_output=True, text=True, cwd=work, env=env)
    assert p.returncode == 0, p.stderr
    names = sorted(f.name for f in (work / "nb").iterdir())
    assert names == sorted(f.name for f in (ROOT / "notebooks").glob("*.ipynb")) and len(names) >= 15
    assert (work / "nb" / names[0]).read_text() == (ROOT / "notebooks" / names[0]).read_text()
    (work / "nb" / names[0]).write_text("my work")
    p = subprocess.run([str(py), "-m", "labkit", "notebooks", "nb", "--solutions"], capture_output=True, text=True,
                       cwd=work, env=env)
    assert p.returncode == 0 and f"copied {len(names)} notebooks" in p.stdout  # the solutions
    assert f"kept {len(names)} already there (your work; --force replaces them): {names[0]}" in p.stdout
    assert (work / "nb" / names[0]).read_text() == "my work"
    assert sorted(f.name for f in (work / "nb" / "solutions").iterdir()) == names

    # build is for a checkout: outside one it says so and fails
    p = subprocess.run([str(py), "-m", "labkit", "build"], capture_output=True, text=True, cwd=work, env=env)
    assert p.returncode == 2 and p.stderr.startswith("error: found no solutions/ folder"), p.stdout + p.stderr
    assert not (work / "notebooks").exists()
