"""The grader works wherever it is installed, or refuses before grading (issue 40, item 5).

A checkout with a venv is put under /tmp, /var/tmp, /dev/shm (the folders a kernel gets private
tmpfs mounts of), in a path with a space, editable (the checkout on ``sys.path``) and not (the kit
copied into site-packages), with ``TMPDIR`` a fresh folder of mode 755 or 700. Each grades the
solved notebook 01 as root: full marks, full isolation (a uid of its own, a file system of its
own), and nothing left in ``TMPDIR``. Today's bug, for the control: before the fix every such
install under /tmp graded 0 ("No module named 'labkit'": the private /tmp hid the kit). When the
kernel's uid cannot start Python with its packages (the venv's site-packages mode 700), the
self-check at start stops the grader before grading with one line naming the cause and the fix
(exit 2).

A plain chroot (the grader installed under its /var/tmp, entered with ``chroot`` as root): full
marks and full isolation where its folder is a mount point and /proc is mounted; a refusal
naming cause and fix without /proc or where its folder is a plain folder. A Docker-like
container (root without CAP_SYS_ADMIN, Docker's default capability set, by ``setpriv``): a
refusal, and with ``--allow-partial-isolation`` and a kit every uid may read an output that says
the references are not withheld (the root-only kit, graded: ``test_autograder.py``). Each case
checks that nothing is left: TMPDIR, /tmp and /var/tmp, processes, mounts.

The venv is tiny: ``python -m venv --without-pip`` plus a ``.pth`` naming this environment's
site-packages for torch and the other dependencies (their own ``.pth`` files, this checkout's
editable hook among them, are not read from there), so each place costs about a second to set up.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

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


def _grade(py: Path, tmpdir: Path, *extra: str, folder: str = "solutions") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "COV"))}
    env.update(TMPDIR=str(tmpdir), OMP_NUM_THREADS="1")
    nb = py.parents[2] / folder / "01_pipeline_bubble.ipynb"
    return subprocess.run([str(py), "-m", "labkit", "grade", str(nb), "--assignment", "01_pipeline_bubble",
                           "--cell-timeout", "120", *extra], capture_output=True, text=True, env=env,
                          cwd=str(py.parents[2]), timeout=400)


PLACES = [  # (install folder, editable, TMPDIR mode); an install under /var/tmp, not editable, with TMPDIR of
    # mode 700 in /var/tmp: the chroot's case below
    ("/tmp/labkit place test {}", True, 0o755),
    ("/dev/shm/labkit place test {}", True, 0o700),
]


@pytest.mark.parametrize("where, editable, mode", PLACES, ids=["tmp-space-editable", "devshm-space-tmpdir700"])
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


def test_packages_the_kernel_uid_cannot_read_stop_the_grader_before_grading(tmp_path):
    base = Path(f"/tmp/labkit-place-refused-{os.getpid()}")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    try:
        py = _install(base, True)
        # the kernel's uid cannot enter the venv's site-packages (ipykernel, torch). A kit of mode 700 alone stops
        # nothing: every kernel imports the grader's copy (the bundle's setup.sh makes the installed kit root-only)
        site = next((base / ".venv" / "lib").glob("python3*/site-packages"))
        os.chmod(site, 0o700)
        proc = _grade(py, tmpdir)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and "cannot isolate" in lines[0] and "Fix:" in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr and "points" not in proc.stdout  # stopped before grading
        assert sorted(os.listdir(tmpdir)) == [], "left in TMPDIR"
        # --allow-partial-isolation waives no kernel as root: the same one line, nothing graded
        proc = _grade(py, tmpdir, "--allow-partial-isolation", folder="notebooks")
        lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and "would run as root" in lines[0], proc.stdout + proc.stderr
        assert "points" not in proc.stdout and sorted(os.listdir(tmpdir)) == [], proc.stdout
        # control: the packages readable again, the same grader isolates fully although the kit stays root-only
        # (the learner notebook as shipped: graded without a kernel, so the control costs no kernel start)
        os.chmod(site, 0o755)
        os.chmod(base / "labkit", 0o700)
        proc = _grade(py, tmpdir, folder="notebooks")
        assert proc.returncode == 0 and "total 0/4 points" in proc.stdout, proc.stdout + proc.stderr
        assert FULL in proc.stdout, proc.stdout + proc.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- a plain chroot
# One root folder, made once for the cases below: the host's /usr and /etc and this environment's Python
# and site-packages bound read-only (so its /root is open: Python sits under /root/.pyenv here), the grader
# installed (not editable) under its /var/tmp in a path with a space, and mode-1777 /tmp and /var/tmp.
# Each case enters it from a mount namespace of its own (``unshare --mount``), so every mount made for it
# (the binds, /proc, /dev, the folder bound on itself) ends with the case, whatever happens.
INSIDE = f"/var/tmp/labkit place {os.getpid()}"
KERNEL_NOT_ROOT = "import os\nassert os.getuid() != 0 and os.geteuid() != 0, 'the kernel runs as root'\n"


@pytest.fixture(scope="module")
def chroot_dir():
    import json

    root = Path(f"/var/tmp/labkit-chroot-{os.getpid()}")
    try:
        py = _install(root / INSIDE.lstrip("/"), editable=False)
        for name in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink("/" + name):
                os.symlink(os.readlink("/" + name), root / name)
        for d in ("usr", "etc", "dev", "proc", "root", "tmp", "var/tmp", *_binds()):
            (root / d.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for d, mode in (("root", 0o755), ("tmp", 0o1777), ("var/tmp", 0o1777)):
            os.chmod(root / d, mode)
        # the solved notebook, whose 1.1 answer cell first proves that the kernel is not root
        nb = json.loads((py.parents[2] / "solutions" / "01_pipeline_bubble.ipynb").read_text())
        cell = next(c for c in nb["cells"] if c.get("id") == "01-05")
        cell["source"] = KERNEL_NOT_ROOT + "".join(cell["source"])
        (py.parents[2] / "solved-not-root.ipynb").write_text(json.dumps(nb))
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _binds() -> list[str]:
    return ["/usr", "/etc", sys.base_prefix, sysconfig.get_paths()["purelib"]]


def _in_chroot(root: Path, *extra: str, proc=True, mount_point=True, docker=False,
               notebooks=("solved-not-root.ipynb",)) -> subprocess.CompletedProcess:
    """Grade the solved notebook in ``root`` as root, entered with ``chroot``: /proc mounted or not, the
    folder a mount point or a plain folder, and ``docker``: without CAP_SYS_ADMIN (Docker's default set,
    Gradescope's container) by ``setpriv``. TMPDIR is a folder of mode 700 in its /var/tmp."""
    tmpdir = root / "var" / "tmp" / "td"
    shutil.rmtree(tmpdir, ignore_errors=True)
    tmpdir.mkdir(mode=0o700)
    mounts = [f"mount --bind {root} {root}"] if mount_point else []
    for b in _binds():
        mounts += [f"mount --bind {b} {root}{b}", f"mount -o remount,bind,ro {root}{b}"]
    mounts.append(f"mount --rbind /dev {root}/dev")
    if proc:
        mounts.append(f"mount -t proc proc {root}/proc")
    grade = [*(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "--"] if docker else []),
             "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "TMPDIR=/var/tmp/td",
             "OMP_NUM_THREADS=1", shutil.which("chroot"), str(root), f"{INSIDE}/.venv/bin/python", "-m", "labkit",
             "grade", *(f"{INSIDE}/{nb}" for nb in notebooks), "--assignment", "01_pipeline_bubble", "--cell-timeout",
             "120", *extra]
    script = " && ".join(mounts) + " && exec " + " ".join(map(shlex.quote, grade))
    proc_ = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
                           capture_output=True, text=True, timeout=400, cwd="/")
    # nothing left: no file in TMPDIR or the root's /tmp and /var/tmp, no process, no mount
    assert os.listdir(tmpdir) == [] and os.listdir(root / "tmp") == [], "left in TMPDIR or /tmp"
    assert sorted(os.listdir(root / "var" / "tmp")) == sorted(["td", os.path.basename(INSIDE)]), "left in /var/tmp"
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if INSIDE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                left.append(pid)
        except OSError:
            pass
    assert left == [], f"processes left: {left}"
    assert str(root) not in Path("/proc/self/mountinfo").read_text(), "a mount left"
    return proc_


def _refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    """One ``error:`` line naming the cause and the fix, exit 2, before grading, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Fix:" in lines[0] and all(w in lines[0] for w in words), proc.stderr
    assert "Traceback" not in proc.stderr and "points" not in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(not shutil.which("chroot") or not shutil.which("unshare"), reason="needs chroot and unshare")
def test_a_grader_in_a_plain_chroot_gives_full_marks_with_full_isolation_or_refuses(chroot_dir):
    # the chroot's folder a mount point, /proc mounted: full marks, full isolation, a kernel that is not root
    proc = _in_chroot(chroot_dir)
    assert proc.returncode == 0 and "total 4/4 points" in proc.stdout, proc.stdout + proc.stderr
    assert FULL in proc.stdout and "in a file system of its own" in proc.stdout, proc.stdout
    # without /proc nothing a submission starts could be found again: refused, whatever the flags
    for extra in ((), ("--allow-partial-isolation",)):
        _refused(_in_chroot(chroot_dir, *extra, proc=False), "/proc is not mounted", "mount -t proc")
    # a chroot made in a plain folder: a mount namespace there cannot make its mounts private
    _refused(_in_chroot(chroot_dir, mount_point=False), "/ is not a mount point", "mount --bind DIR DIR",
             "--allow-partial-isolation")


@pytest.mark.skipif(not shutil.which("setpriv") or not shutil.which("chroot"), reason="needs setpriv and chroot")
def test_a_grader_in_a_docker_like_container_refuses_or_grades_with_an_honest_weaker_isolation(chroot_dir):
    # root without CAP_SYS_ADMIN (Docker's default capability set): no mount namespace for the kernels
    _refused(_in_chroot(chroot_dir, docker=True), "without CAP_SYS_ADMIN", "--cap-add SYS_ADMIN",
             "--allow-partial-isolation", "chmod 700")
    # the instructor accepts the weaker isolation; with the installed kit readable by every uid the kernel could
    # import its references, and the output says so (the learner notebook as shipped: no kernel start)
    proc = _in_chroot(chroot_dir, "--allow-partial-isolation", docker=True,
                      notebooks=("notebooks/01_pipeline_bubble.ipynb",))
    assert proc.returncode == 0 and "total 0/4 points" in proc.stdout, proc.stdout + proc.stderr
    assert "references are NOT withheld" in proc.stdout and FULL not in proc.stdout, proc.stdout
    # with the installed kit root-only (as the Gradescope bundle's setup.sh makes it) the kernel imports the
    # grader's copy: full marks for the solved notebook from a kernel that is not root, nothing for an answer that
    # reaches the reference, an output that claims nothing it lacks (test_autograder.py, the bundle in a tree
    # laid out like Gradescope's, run as here without CAP_SYS_ADMIN)


def test_the_bundles_run_side_refuses_as_the_grader_does(tmp_path, monkeypatch, capsys):
    """``run_autograder`` checks the place (whatever the bundle allows) and then the isolation (unless the
    bundle was built with --allow-partial-isolation), before anything of the submission runs; its fix names
    the bundle's option. The checks themselves are proved in a chroot above."""
    import json

    from labkit.grading import autograder, session

    (tmp_path / "source").mkdir()
    (tmp_path / "submission").mkdir()
    docker = ("cannot isolate the submissions' kernels: the grader runs as root without CAP_SYS_ADMIN. Fix: "
              "--cap-add SYS_ADMIN; or pass --allow-partial-isolation to grade with the weaker isolation")
    monkeypatch.setattr(session, "isolation_problem",
                        lambda limits=None, allow_partial=False: "" if allow_partial else docker)
    monkeypatch.setattr(session, "kernel_user", lambda *a: None)  # what the self-check probed: its note below
    monkeypatch.setattr(session, "isolation_note", lambda user: "isolation is partial: WHAT-IT-GIVES")
    rebuild = ("without CAP_SYS_ADMIN. Fix: rebuild the bundle with --allow-partial-isolation (python -m labkit "
               "autograder 01_pipeline_bubble --allow-partial-isolation --out autograder.zip), upload it and regrade; "
               "here it then grades with this weaker isolation: WHAT-IT-GIVES. For full isolation instead, on a "
               "machine whose container you configure: --cap-add SYS_ADMIN")
    for allow, place, words in ((False, "", rebuild),
                                (True, "/proc is not mounted here. Fix: mount it", "/proc is not mounted"),
                                (False, "/proc is not mounted here. Fix: mount it", "/proc is not mounted here. Fix: "
                                                                                    "mount it")):
        (tmp_path / "source" / autograder.CONFIG).write_text(json.dumps(
            {"assignment": "01_pipeline_bubble", "allow_partial_isolation": allow}))
        monkeypatch.setattr(session, "place_problem", lambda place=place: place)
        assert autograder.run(tmp_path) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
        assert not (tmp_path / "results").exists()
