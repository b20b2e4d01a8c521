"""The answer is absent, not refused (issue 40): for every exercise, the graded kernel's kit lacks its
reference and every kit function that reaches one until it is graded; ``build --check`` fails on a
shipped cell that would need one earlier; the learner's ``check`` judges the function it is given,
whatever else the kernel ran (a magic, a shell line, a ring written with ``comm.send``), and says
before submission when the answer calls something the graded kernel will not have.

Cheap on purpose: one kit built for all notebooks, read, never 45 notebooks graded.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from labkit.grading.reach import callers_of
from labkit.grading.references import NOTHING_TO_WITHHOLD
from labkit.grading.registry import exercises_for_notebook
from labkit.grading.withhold import LEFT_OUT, _has_code, _is_def, build_kit, import_time, problems, withheld

KIT_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.stem for p in (KIT_ROOT / "labkit" / "_notebooks").glob("*.ipynb"))
EXERCISES = [ex for nb in NOTEBOOKS for ex in exercises_for_notebook(nb)]


@pytest.fixture(scope="module")
def kit():
    d = tempfile.mkdtemp(prefix="labkit-test-absent-")
    try:
        yield build_kit(NOTEBOOKS, os.path.join(d, "kit"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _module_file(kit_path: str, mod: str) -> Path:
    rel = mod.split(".")[1:]
    path = Path(kit_path, *rel).with_suffix(".py")
    return path if path.is_file() else Path(kit_path, *rel, "__init__.py")


def test_every_exercise_is_covered():
    assert len(EXERCISES) >= 45, len(EXERCISES)


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda ex: ex.id)
def test_the_reference_is_not_in_the_graded_kernels_kit(ex, kit):
    """Each reference of the exercise, and every kit function or class from which one can be reached
    (however an answer gets there: an import, a computed name, a frame, an object a cell made), has
    no code in the kernel's copy: its body is a stub and its code lies in a file of mode 0600 (the
    grader's) until the exercise is graded. References the exercise modules hold are not in the copy
    at all. An exercise with nothing to withhold says why (references.NOTHING_TO_WITHHOLD)."""
    labels = [lab for lab in ex.reference_names() if lab.startswith("labkit.")]
    if not labels:
        assert NOTHING_TO_WITHHOLD.get(ex.id), f"{ex.id}: no reference and no reason why nothing is withheld"
        return
    for label in labels:
        mod, _, qual = label.partition(":")
        top = f"{mod}:{qual.split('.')[0]}"
        if mod.startswith("labkit.grading"):
            rel = os.path.relpath(_module_file(kit.path, mod), kit.path)
            assert any(rel == p or rel.startswith(p + os.sep) or rel == p + ".py" for p in LEFT_OUT), rel
            assert not _module_file(kit.path, mod).is_file() or _module_file(kit.path, mod).stat().st_size == 0
            continue
        assert top not in import_time(), f"{ex.id}: the kit runs its reference {top} when it is imported"
        # those the kit runs while it is imported stay (their route to the reference ends at the stub)
        for node in {top} | {c for c in callers_of(top) if _is_def(c) and _has_code(c) and c not in import_time()}:
            assert node in kit.files, f"{ex.id}: {node} (reaches {top}) is in the kernel's kit"
            assert ex.id in kit.exercises[node] and ex.id in withheld(ex.notebook)[node], node
            assert stat.S_IMODE(os.stat(kit.files[node]).st_mode) == 0o600, node
        assert _stubbed(_module_file(kit.path, mod), qual.split(".")[0]), f"{ex.id}: {top} keeps code in the copy"


def _stubbed(path: Path, name: str) -> bool:
    """Whether the top-level function or class ``name`` of the copy's module ``path`` holds no code: each
    body (each method's, for a class) is only ``return _labkit_withheld(...)(...)``."""
    import ast

    node = next(n for n in ast.parse(path.read_text(encoding="utf-8")).body if getattr(n, "name", None) == name)
    fns = [node] if not isinstance(node, ast.ClassDef) else [
        n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return bool(fns) and all(
        len(f.body) == 1 and isinstance(f.body[0], ast.Return) and "_labkit_withheld(" in ast.unparse(f.body[0])
        for f in fns)


def test_what_the_kit_runs_at_import_is_never_a_stub():
    """``KINDS = names(...)`` and the registry's ``ScheduleInfo(...)`` run when their modules are
    imported: they are kept (a stub would break ``import labkit``), and no reference is among them."""
    assert {"labkit.pipeline.registry:names", "labkit.pipeline.registry:ScheduleInfo"} <= import_time()
    refs = {f"{lab.partition(':')[0]}:{lab.partition(':')[2].split('.')[0]}" for ex in EXERCISES
            for lab in ex.reference_names()}
    assert not refs & import_time()


def test_the_control_an_unwithheld_kit_keeps_the_code(tmp_path):
    """Control: a kit built for no assignment keeps bubble_formula's code, so the checks above can fail."""
    bare = build_kit([], str(tmp_path / "kit"))
    assert not bare.files
    assert not _stubbed(_module_file(bare.path, "labkit.pipeline.simulate"), "bubble_formula")


def _learner_cells(nb: str) -> list[str]:
    data = json.loads((KIT_ROOT / "notebooks" / f"{nb}.ipynb").read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in data["cells"] if c["cell_type"] == "code"]


def test_build_check_fails_on_a_cell_that_needs_a_reference_before_its_exercise(tmp_path, capsys):
    """A demo cell that builds a MoELayer (which runs route, 9.1's reference) before 9.1 fails
    ``build --check`` with the cell and the exercise named; so does a cell that only calls a
    notebook function which does. Control: the shipped notebook passes."""
    from labkit.grading import build

    cells = _learner_cells("09_moe_routing")
    assert problems("09_moe_routing", cells) == []
    k = next(i for i, s in enumerate(cells) if 'check("9.1"' in s)
    bad = cells[:1] + ["from labkit.moe import MoELayer\n\ndef demo():\n    return MoELayer\n", "layer = demo()"] \
        + cells[1:]
    found = problems("09_moe_routing", bad)
    assert any("code cell 3 uses labkit.moe" in p and "exercise 9.1" in p for p in found), found
    assert any("code cell 2 imports labkit.moe" in p for p in found), found
    assert k  # 9.1 is graded after those cells
    # end to end: the command exits 1 on a solution with such a cell, 0 without
    root = tmp_path / "repo"
    (root / "solutions").mkdir(parents=True)
    sol = json.loads((KIT_ROOT / "solutions" / "09_moe_routing.ipynb").read_text(encoding="utf-8"))
    (root / "solutions" / "09_moe_routing.ipynb").write_text(json.dumps(sol), encoding="utf-8")
    assert build.main(["--root", str(root)]) == 0
    assert build.main(["--root", str(root), "--check"]) == 0
    at = next(i for i, c in enumerate(sol["cells"]) if c["cell_type"] == "code" and "import" in "".join(c["source"]))
    sol["cells"].insert(at + 1, {"cell_type": "code", "id": "demo", "metadata": {}, "outputs": [],
                                 "execution_count": None, "source": ["from labkit.moe import route\n", "route"]})
    (root / "solutions" / "09_moe_routing.ipynb").write_text(json.dumps(sol), encoding="utf-8")
    assert build.main(["--root", str(root)]) == 0
    capsys.readouterr()
    assert build.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "uses labkit.moe" in err and "route" in err and "exercise 9.1" in err, err


def test_the_kernel_side_helpers_need_no_reference():
    """06's helpers ran labkit's f and g (the references of 6.2 and 6.3) in the kernel; now the
    grader sums what those would have summed. Every notebook: no kernel-side import is withheld."""
    for nb in NOTEBOOKS:
        assert not [p for p in problems(nb) if "kernel-side" in p], nb


def test_check_says_when_the_answer_calls_what_the_graded_kernel_lacks(capsys):
    """1.1 answered with labkit's bubble_formula: the check fails saying it will not be there when
    graded. Control: the same formula written out passes."""
    from fractions import Fraction

    from labkit.grading import check
    from labkit.pipeline.simulate import bubble_formula

    def bubble_fraction(K, M):
        if K < 1 or M < 1:
            raise ValueError("K >= 1 and M >= 1")
        return float(bubble_formula(K, M))

    res = check("1.1", bubble_fraction)
    out = capsys.readouterr().out
    assert res.status == "failed", out
    assert "your answer calls labkit's bubble_formula" in out and "not available when the notebook is graded" in out
    assert "write it yourself" in out

    def mine(K, M):
        if K < 1 or M < 1:
            raise ValueError("K >= 1 and M >= 1")
        return float(Fraction(K - 1, M + K - 1))

    assert check("1.1", mine).status == "passed", capsys.readouterr().out


_KERNEL_CELLS = [
    "import torch\nfrom labkit import comm\nfrom labkit.grading import check",
    "%timeit -n 1 -r 1 sum(range(10))",
    "!echo hello from the shell",
    "%config InlineBackend.figure_format = 'png'",
    # 0.2 written with blocking send/recv, as the exercise text says (even ranks send first)
    "def ring_all_reduce(ctx, tensor):\n"
    "    n, r = ctx.world_size, ctx.rank\n"
    "    right, left = (r + 1) % n, (r - 1) % n\n"
    "    chunks = list(torch.tensor_split(tensor, n))\n"
    "    def step(send_i, recv_i, add):\n"
    "        incoming = torch.empty_like(chunks[recv_i])\n"
    "        if r % 2 == 0:\n"
    "            comm.send(chunks[send_i], right)\n"
    "            comm.recv(incoming, left)\n"
    "        else:\n"
    "            comm.recv(incoming, left)\n"
    "            comm.send(chunks[send_i], right)\n"
    "        if add:\n"
    "            chunks[recv_i] += incoming\n"
    "        else:\n"
    "            chunks[recv_i].copy_(incoming)\n"
    "    for s in range(n - 1):\n"
    "        step((r - s) % n, (r - s - 1) % n, True)\n"
    "    for s in range(n - 1):\n"
    "        step((r + 1 - s) % n, (r - s) % n, False)\n"
    "    return tensor",
    "print(check('0.2', ring_all_reduce).status)",
    "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError('K >= 1 and M >= 1')\n"
    "    return (K - 1) / (M + K - 1)",
    "print(check('1.1', bubble_fraction).status)",
]


def test_check_in_a_kernel_after_magics_and_a_send_ring_passes_the_solution(tmp_path):
    """In a real kernel: after ``%timeit``, a ``!`` line and ``%config``, a 0.2 ring written with
    ``comm.send``/``comm.recv`` passes, and so does a later check (nothing about habits poisons the
    kernel's checks)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in _KERNEL_CELLS]
    env = dict(os.environ, LABKIT_STRICT="0", OMP_NUM_THREADS="1")
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute(
        env=env)
    text = ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream") for c in nb.cells]
    assert "hello from the shell" in text[2]
    assert "passed" in text[5].splitlines()[-1] and "ring all-reduce" in text[5], text[5]
    assert text[7].splitlines()[-1] == "passed", text[7]


def test_a_released_references_source_is_back_in_its_module_file(tmp_path):
    """12.3 reads ``route``'s source after 12.2 is graded: the stubs keep every line's number, and a
    release puts the released lines back (a withheld one's stay a stub); withholding again for the
    secret pass puts the stubs back."""
    import inspect

    from labkit.moe import router

    kit = build_kit(["12_deepseek_moe"], str(tmp_path / "kit"))
    path = _module_file(kit.path, "labkit.moe.router")
    original = Path(inspect.getsourcefile(router)).read_text(encoding="utf-8")
    stubbed = path.read_text(encoding="utf-8")
    assert _stubbed(path, "route") and len(stubbed.splitlines()) >= len(original.splitlines())
    kit.release_after({"12.2"})
    text = path.read_text(encoding="utf-8")
    assert not _stubbed(path, "route")
    real = inspect.getsource(router.route)
    assert real in text, "route's own lines are back, at their own line numbers"
    assert text.splitlines()[:len(original.splitlines())].index(real.splitlines()[0]) == \
        original.splitlines().index(real.splitlines()[0])
    kit.withhold()
    assert path.read_text(encoding="utf-8") == stubbed
