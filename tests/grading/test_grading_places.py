"""The grader works wherever it is installed, or refuses before grading (issue 40, item 5).

A checkout with a venv is put under /tmp, /var/tmp, /dev/shm (the folders a kernel gets private
tmpfs mounts of), in a path with a space, editable (the checkout on ``sys.path``) and not (the kit
copied into site-packages), with ``TMPDIR`` a fresh folder of mode 755 or 700. Each grades the
solved notebook 01 as root: full marks, full isolation (a uid of its own, a file system of its
own), and nothing left in ``TMPDIR``. Today's bug, for the control: before the fix every such
install under /tmp graded 0 ("No module named 'labkit'": the private /tmp hid the kit). When the
kernel's uid cannot import the kit (the kit's folder mode 700), the self-check at start stops
the grader before grading with one line naming the cause and the fix (exit 2).

The venv is tiny: ``python -m venv --without-pip`` plus a ``.pth`` naming this environment's
site-packages for torch and the other dependencies (their own ``.pth`` files, this checkout's
editable hook among them, are not read from there), so each place costs about a second to set up.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from policyflag import NO_POLICY

ROOT = os.geteuid() == 0
CHECKOUT = Path(__file__).resolve().parents[2]
FULL = "isolation: each kernel runs as a uid of its own"
pytestmark = pytest.mark.skipif(not ROOT, reason="the install places are graded as root (full isolation)")


def _install(base: Path, editable: bool) -> Path:
    """A checkout (the kit, the notebooks) at ``base`` and a venv in it; its Python."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(CHECKOUT / "labkit", base / "labkit", symlinks=True, ignore=skip)
    for sub in ("notebooks", "solutions"):
        shutil.copytree(CHECKOUT / sub, base / sub, ignore=skip)
    subprocess.run([os.path.join(sys.base_prefix, "bin", "python3"), "-m", "venv", "--without-pip",
                    str(base / ".venv")], check=True)
    py = base / ".venv" / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if editable:
        (site / "labkit_checkout.pth").write_text(f"{base}\n")
    else:
        shutil.copytree(base / "labkit", site / "labkit", symlinks=False, ignore=skip)
        shutil.rmtree(base / "labkit")
    return py


def _grade(py: Path, tmpdir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COV"))}
    env.update(TMPDIR=str(tmpdir), OMP_NUM_THREADS="1")
    nb = py.parents[2] / "solutions" / "01_pipeline_bubble.ipynb"
    return subprocess.run([str(py), "-m", "labkit", "grade", str(nb), "--assignment", "01_pipeline_bubble",
                           "--cell-timeout", "120", *NO_POLICY, *extra], capture_output=True, text=True, env=env,
                          cwd=str(py.parents[2]), timeout=400)


PLACES = [  # (install folder, editable, TMPDIR mode)
    ("/tmp/labkit place test {}", True, 0o755),
    ("/var/tmp/labkit-place-test-{}", False, 0o700),
    ("/dev/shm/labkit place test {}", True, 0o700),
]


@pytest.mark.parametrize("where, editable, mode", PLACES,
                         ids=["tmp-space-editable", "vartmp-installed-tmpdir700", "devshm-space-tmpdir700"])
def test_a_grader_installed_anywhere_gives_full_marks_with_full_isolation_and_leaves_nothing(where, editable, mode):
    base = Path(where.format(os.getpid()))
    tmpdir = base.parent / f"labkit-place-tmpdir-{os.getpid()}"
    try:
        py = _install(base, editable)
        tmpdir.mkdir(mode=mode)
        os.chmod(tmpdir, mode)
        where_kit = subprocess.run([str(py), "-c", "import labkit; print(labkit.__file__)"], capture_output=True,
                                   text=True, env={"PATH": os.environ["PATH"]}, cwd="/").stdout
        assert where_kit.startswith(str(base)), where_kit  # the kit of this place, not the checkout's
        proc = _grade(py, tmpdir)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "total 4/4 points" in proc.stdout, proc.stdout + proc.stderr
        assert FULL in proc.stdout and "in a file system of its own" in proc.stdout, proc.stdout
        assert "isolation is partial" not in proc.stdout
        assert sorted(os.listdir(tmpdir)) == [], "left in TMPDIR"
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)


def test_a_kit_the_kernel_uid_cannot_read_stops_the_grader_before_grading(tmp_path):
    base = Path(f"/tmp/labkit-place-refused-{os.getpid()}")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    try:
        py = _install(base, True)
        os.chmod(base / "labkit", 0o700)  # the kernel's uid cannot enter the kit's folder
        proc = _grade(py, tmpdir)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and "cannot isolate" in lines[0] and "Fix:" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr and "points" not in proc.stdout  # stopped before grading
        assert sorted(os.listdir(tmpdir)) == [], "left in TMPDIR"
        # control: the instructor may accept the weaker isolation, which the output then describes
        proc = _grade(py, tmpdir, "--allow-partial-isolation")
        assert "isolation is partial" in proc.stdout and FULL not in proc.stdout, proc.stdout + proc.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)
