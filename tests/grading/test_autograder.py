"""The Gradescope bundle, run as Gradescope runs it: unzipped into a temporary tree laid out like
/autograder, setup.sh then run_autograder as root, results.json checked for a solved, a wrong, an
empty, a wrong-assignment and a two-notebook submission, with full isolation although setup.sh made
the installed kit root-only. Then, in the same tree, as in a Docker container with its default
capabilities (no CAP_SYS_ADMIN, likely Gradescope's): the bundle refuses in one line that gives the
rebuild command and what it then gives; rebuilt with ``--allow-partial-isolation`` (setup.sh again)
the solved 01 gets full marks from a kernel that is not root, and an answer that reaches labkit's
``bubble_formula`` by any route in the tree earns nothing for it, with no manual step.

SLOW (about 2-3 minutes on 2 cores shared by several test runs: setup.sh ~30-45 s, each of the
five run_autograder calls ~15-20 s, mostly importing torch): setup.sh makes a real venv, but offline and without
copying torch (LABKIT_PIP_ARGS="": pip.conf's local index; LABKIT_REUSE_SITE=this environment's
site-packages); only two submissions start a kernel. Needs root (as Gradescope's container)."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

from labkit.grading.autograder import RUNTIME_REQUIREMENTS, TORCH_PIN, build_bundle
from labkit.grading.autograder import main as autograder_main
from labkit.grading.grader import validate_results

ROOT = Path(__file__).resolve().parents[2]
from tinyassign import CASES, _nb  # noqa: E402


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "labkit", "autograder", *map(str, args)], capture_output=True,
                          text=True, timeout=120, **kw)


def test_torch_pin_and_requirements_agree_with_the_project():
    assert TORCH_PIN in (ROOT / "requirements.txt").read_text().splitlines()
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(RUNTIME_REQUIREMENTS[1:]) == sorted(d for d in deps if not d.startswith("torch"))


def test_bundle_layout_and_bad_input(tmp_path, capsys):
    p = _cli("01_pipeline_bubble", "--out", tmp_path / "ag.zip", "--no-hints")
    assert p.returncode == 0, p.stderr
    with zipfile.ZipFile(tmp_path / "ag.zip") as z:
        names = z.namelist()
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
        config = json.loads(z.read("labkit_assignment.json"))
    assert {"setup.sh", "run_autograder", "requirements.txt", "labkit/__init__.py",
            "labkit/grading/autograder.py"} <= set(names)
    assert not any("__pycache__" in n for n in names) and not any(n.startswith("hidden/") for n in names)
    # the learner version of the assignment (the grader reads its grading points), no solved notebook
    assert "labkit/_notebooks/01_pipeline_bubble.ipynb" in names
    notebooks = [n for n in names if "_solutions" in n or "_notebooks" in n]
    assert notebooks == ["labkit/_notebooks/01_pipeline_bubble.ipynb"], notebooks
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert config == {"assignment": "01_pipeline_bubble", "cell_timeout": 120, "hints": False,
                      "allow_partial_isolation": False}
    for args, msg in ((["99_nope"], "error: assignment '99_nope' has no exercises; choose one of"),
                      (["01_pipeline_bubble", "--hidden-cases", tmp_path / "none"], "no such folder"),
                      (["01_pipeline_bubble", "--cell-timeout", "0"], "--cell-timeout must be a positive"),
                      (["01_pipeline_bubble", "--out", tmp_path / "no" / "ag.zip"], "in an existing folder")):
        assert autograder_main([str(a) for a in args]) == 2  # in-process: each CLI run would import torch again
        err = capsys.readouterr().err
        assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1, err


@pytest.mark.skipif(os.geteuid() != 0, reason="Gradescope runs setup.sh and run_autograder as root")
def test_bundle_on_a_tree_laid_out_like_gradescope(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "tiny.py").write_text(CASES)
    bundle = tmp_path / "autograder.zip"
    p = _cli("98_alpha", "--out", bundle, "--hidden-cases", tmp_path / "cases", "--cell-timeout", "60",
             env=dict(os.environ, LABKIT_HIDDEN_CASES=""))
    assert p.returncode == 0, p.stderr
    root = Path(tempfile.mkdtemp(prefix="labkit-autograder-"))  # like /autograder: others may enter
    try:
        os.chmod(root, 0o755)
        with zipfile.ZipFile(bundle) as z:
            z.extractall(root / "source")
        shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
        env = dict(os.environ, LABKIT_AUTOGRADER_ROOT=str(root), LABKIT_PIP_ARGS="",  # pip.conf here: local wheels only
                   LABKIT_REUSE_SITE=sysconfig.get_paths()["purelib"], LABKIT_PYTHON=sys._base_executable)
        env.pop("LABKIT_HIDDEN_CASES", None)
        _setup(root, env)
        hidden = root / "source" / "hidden"
        assert stat.S_IMODE(hidden.stat().st_mode) == 0o700
        assert stat.S_IMODE((hidden / "tiny.py").stat().st_mode) == 0o600

        def grade(files, docker=False):
            for d in ("submission", "results"):
                shutil.rmtree(root / d, ignore_errors=True)
                (root / d).mkdir()
            for name, (notebook, sources) in files.items():
                if notebook is None:
                    (root / "submission" / name).write_text(sources)
                elif isinstance(notebook, dict):
                    (root / "submission" / name).write_text(json.dumps(notebook))
                else:
                    _nb(root / "submission" / name, notebook, sources)
            run = _run_autograder(root, env, docker)
            obj = json.loads((root / "results" / "results.json").read_text())
            validate_results(obj)
            assert isinstance(obj["execution_time"], int) and obj["stdout_visibility"] == "hidden"
            if not docker:
                assert sum(t["max_score"] for t in obj["tests"]) == 3  # always the assignment's exercises
            assert str(root) not in obj["output"] and "isolation" not in obj["output"]
            return run, obj

        solved = ["check('98.1', lambda x: 3 * x)", "check('98.2', lambda x: -x)"]
        run, obj = grade({"Homework (final) v2.ipynb": ("98_alpha", solved)})
        assert run.returncode == 0, run.stderr
        assert obj["score"] == 3 and all(t["status"] == "passed" for t in obj["tests"]), obj
        assert "isolation" in run.stdout  # instructor detail: isolation, in stdout only
        if os.geteuid() == 0 and shutil.which("unshare"):  # the kit installed in the venv, alone in the kernel's files
            assert "a file system of its own" in run.stdout, run.stdout
        hidden_case = next(t for t in obj["tests"] if t["name"] == "Exercise 98.1 (triple) - hidden case: x=5")
        assert hidden_case["visibility"] == "after_published"

        run, obj = grade({"sub.ipynb": ("98_alpha", ["check('98.1', lambda x: 2 * x)", "check('98.2', lambda x: -x)"])})
        assert obj["score"] == 1
        first = next(t for t in obj["tests"] if t.get("number") == "98.1")
        assert first["status"] == "failed" and "expected 3, got 2" in first["output"]
        assert "HINT-TRIPLE" in first["output"]  # the bundle shows hints unless --no-hints

        run, obj = grade({"notes.txt": (None, "nothing")})
        assert obj["score"] == 0
        assert "no notebook (.ipynb) was uploaded: upload your 98_alpha.ipynb" in obj["output"]
        assert [t["output"] for t in obj["tests"] if t["max_score"]] == \
            ["not attempted: nothing was graded (see the message at the top)"] * 2  # the reason once, at the top

        run, obj = grade({"98_alpha.ipynb": ("97_beta", ["check('97.1', lambda x: x)"])})
        assert obj["score"] == 0
        assert "does not hold assignment 98_alpha" in obj["output"] and "97_beta" in obj["output"]

        run, obj = grade({"a.ipynb": ("98_alpha", solved), "b.ipynb": ("98_alpha", solved)})
        assert obj["score"] == 0
        assert "2 notebooks were uploaded (a.ipynb, b.ipynb): upload exactly one" in obj["output"]

        # a Docker container with its default capabilities: no CAP_SYS_ADMIN, no namespaces. The bundle built
        # without the flag refuses before grading, in one line giving the rebuild command and what it then gives
        shutil.rmtree(root / "results")
        run = _run_autograder(root, env, docker=True)
        assert run.returncode == 2 and not (root / "results").exists(), run.stdout + run.stderr
        assert run.stderr.startswith("error:") and len(run.stderr.splitlines()) == 1, run.stderr
        for words in ("without CAP_SYS_ADMIN", "Fix: rebuild the bundle with --allow-partial-isolation (python -m "
                      "labkit autograder 98_alpha --allow-partial-isolation --hidden-cases YOUR_CASES_FOLDER "
                      "--cell-timeout 60 --out autograder.zip), upload it and regrade",
                      "each kernel runs as a uid of its own", "The installed kit is readable by root only and the "
                      "kernel imports the grader's copy, with the assignment's labkit references withheld",
                      "shares /tmp, the network and the view of /proc", "--cap-add SYS_ADMIN"):
            assert words in run.stderr, (words, run.stderr)
        assert "NOT withheld" not in run.stderr and "chmod" not in run.stderr, run.stderr  # nothing left to do by hand

        # rebuilt with --allow-partial-isolation for 01 and set up again, no manual step: the solved notebook gets
        # full marks from a kernel that is not root and cannot read the learner's metadata; an answer that reaches
        # bubble_formula by any route in the tree (the installed kit, the bundle's source, the grader's copy)
        # earns nothing for it, where it would earn full marks if it got it
        build_bundle("01_pipeline_bubble", tmp_path / "partial.zip", allow_partial_isolation=True)
        shutil.rmtree(root / "source")
        with zipfile.ZipFile(tmp_path / "partial.zip") as z:
            z.extractall(root / "source")
        shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
        _setup(root, env)
        (root / "submission_metadata.json").write_text('{"users": [{"email": "learner@example.com"}]}')
        nb = json.loads((ROOT / "solutions" / "01_pipeline_bubble.ipynb").read_text())
        cell = next(c for c in nb["cells"] if c.get("id") == "01-05")
        solved = "".join(cell["source"])
        cell["source"] = KERNEL_ALONE.format(root=root) + solved
        run, obj = grade({"01.ipynb": (nb, None)}, docker=True)
        assert obj["score"] == 4, run.stdout + run.stderr + json.dumps(obj["tests"])
        assert ISOLATION_UID_ONLY in run.stdout and "NOT withheld" not in run.stdout, run.stdout
        cell["source"] = CALLS_REFERENCE.format(root=root)
        run, obj = grade({"01.ipynb": (nb, None)}, docker=True)
        first = next(t for t in obj["tests"] if t.get("number") == "1.1")
        assert obj["score"] == 2 and first["score"] == 0, run.stdout + run.stderr + json.dumps(obj["tests"])
        assert "bubble_formula (labkit.pipeline.simulate) is withheld" in first["output"], first["output"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


ONLY_01 = '''
from labkit.grading.registry import exercise, expect_equal

ex = exercise("1.1")
@ex.case("K=3, M=6 (hidden)")
def _(f): expect_equal(f(3, 6), 0.25, "f(3, 6)")
'''


def test_hidden_cases_none_of_which_is_for_the_assignment_get_one_warning_line(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "nb01.py").write_text(ONLY_01)
    env = dict(os.environ, LABKIT_HIDDEN_CASES="")
    p = _cli("03_1f1b", "--out", tmp_path / "ag.zip", "--hidden-cases", tmp_path / "cases", env=env)
    assert p.returncode == 0, p.stderr
    warned = [line for line in p.stderr.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "03_1f1b" in warned[0] and "01_pipeline_bubble" in warned[0], p.stderr
    p = _cli("01_pipeline_bubble", "--out", tmp_path / "ag.zip", "--hidden-cases", tmp_path / "cases", env=env)
    assert p.returncode == 0 and "warning" not in p.stderr, p.stderr


ISOLATION_UID_ONLY = ("each kernel runs as a uid of its own in its own session, with limits (it cannot signal the "
                      "grader or write the results), but no private namespaces")
# the answer cell of 1.1 first checks that the kernel is not root and cannot read the learner's metadata
KERNEL_ALONE = """import os
assert os.getuid() != 0 and os.geteuid() != 0, 'the kernel runs as root'
try:
    open('{root}/submission_metadata.json').close()
    raise AssertionError('the kernel reads submission_metadata.json')
except PermissionError:
    pass
"""
# a complete 1.1 if labkit's reference were reachable: from any copy of its source in the tree (run as a module
# of the kit's package, once), else by import
CALLS_REFERENCE = """import glob, importlib.util, sys
reference = None
for f in glob.glob('{root}/**/labkit/pipeline/simulate.py', recursive=True):
    try:
        spec = importlib.util.spec_from_file_location('labkit.pipeline.copied', f)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        reference = module.bubble_formula
        break
    except Exception:
        pass
def bubble_fraction(K, M):
    if K < 1 or M < 1:
        raise ValueError(f"need K >= 1 and M >= 1, got K={{K}}, M={{M}}")
    if reference is not None:
        return float(reference(K, M))
    from labkit.pipeline.simulate import bubble_formula
    return float(bubble_formula(K, M))
"""


def _setup(root: Path, env: dict) -> None:
    """setup.sh, as Gradescope runs it when the image is built; the installed kit and the bundle end root-only."""
    setup = subprocess.run(["bash", "setup.sh"], cwd=root / "source", env=env, capture_output=True, text=True,
                           timeout=600)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert f"labkit {root}/venv/lib/" in setup.stdout  # the bundled copy, not this checkout
    kit = next((root / "venv" / "lib").glob("python3*/site-packages/labkit"))
    assert stat.S_IMODE(kit.stat().st_mode) == 0o700 and stat.S_IMODE((root / "source").stat().st_mode) == 0o700


def _run_autograder(root: Path, env: dict, docker: bool) -> subprocess.CompletedProcess:
    """``run_autograder`` as root; ``docker``: without CAP_SYS_ADMIN (Docker's default capability set) by
    ``setpriv``. Here Python lies under a folder other users cannot enter (/root/.pyenv, /root mode 700), which a
    container's Python does not: for that run, in a mount namespace of its own, that folder is a tmpfs of mode
    755 with Python's prefix bound back, so that the kernel's uid can start Python as it could there."""
    cmd = ["bash", str(root / "run_autograder")]
    if docker:
        cmd = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", "--", *cmd]
        prefix, top = Path(sys.base_prefix), None
        for p in reversed(prefix.parents):
            if p != Path("/") and not p.stat().st_mode & 0o001:
                top = p
                break
        if top is not None:
            stage = tempfile.mkdtemp(prefix="labkit-python-")
            script = (f'mount --bind "{prefix}" "{stage}" && mount -t tmpfs -o mode=755 labkit-open "{top}" && '
                      f'mkdir -p "{prefix}" && mount --move "{stage}" "{prefix}" && exec "$@"')
            cmd = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", *cmd]
    try:
        return subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=300)
    finally:
        if docker and top is not None:
            os.rmdir(stage)
