"""The graded kernel's kit (labkit/grading/withhold.py) and its file system of its own (_jail.py --root).

As root, the kernel imports a copy of the kit in which each reference of the assignment's
exercises is a stub that raises until the grader has graded the exercise (its code lies in a
file only the grader may read, made readable then), and it sees no file of the checkout but
the kit's folder. Each check has a control without the mechanism, which the check fails.
"""
from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from nbfiles import write_notebook

from labkit.grading.contain import UidLease, kill_uid
from labkit.grading.withhold import _is_def, _strip, build_kit, withheld

ROOT = os.geteuid() == 0
KIT_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.stem for p in (KIT_ROOT / "labkit" / "_notebooks").glob("*.ipynb"))


def _as_fresh_uid(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` run by this Python as a uid no one else has (the kit's files as they are: plain file permissions)."""
    from labkit.grading.session import KernelUser

    lease = UidLease()
    stage = ""
    try:
        user = KernelUser(f"uid {lease.uid}", lease.uid, lease.gid, True, jail=True)  # Python's folder reachable
        stage = tempfile.mkdtemp(prefix="labkit-test-stage-")  # the jail's mount point: a folder of the grader's
        os.chmod(stage, 0o755)
        argv, kw = user.command([sys.executable, "-S", "-c", code, *args], None, [f"--stage={stage}"], stage=stage)
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd="/", **kw,
                              env={"PATH": os.environ.get("PATH", "/usr/bin"), "OMP_NUM_THREADS": "1"})
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        kill_uid(lease.uid, 5)
        lease.release()


@pytest.fixture
def open_dir():
    """A folder other uids may enter (pytest's tmp_path sits in a 0700 one), removed afterwards."""
    d = tempfile.mkdtemp(prefix="labkit-test-kit-")
    os.chmod(d, 0o755)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _real(label: str):
    import importlib

    mod, _, name = label.partition(":")
    return getattr(importlib.import_module(mod), name)


_PROBE = r"""
import importlib, inspect, json, sys
sys.path.insert(0, sys.argv[1])
import labkit
assert labkit.__file__.startswith(sys.argv[1]), labkit.__file__
site = [p for p in sys.argv[3:]]
sys.path[1:1] = site
out = {}
for label in json.loads(sys.argv[2]):
    mod, _, name = label.partition(":")
    obj = getattr(importlib.import_module(mod), name)
    fns = [obj] if not isinstance(obj, type) else [  # the class's own methods (not a dataclass's generated ones)
        v for v in (getattr(v, "fget", v) for v in vars(obj).values()) if inspect.isfunction(getattr(v, "__func__", v))
        and getattr(v, "__func__", v).__code__.co_filename.rpartition("/")[2] not in ("<string>", "dataclasses.py")
        and getattr(v, "__name__", "") != "<lambda>"]
    errors = []
    for v in fns:
        f = getattr(v, "__func__", v)
        params = [p for p in inspect.signature(f).parameters.values() if p.default is p.empty]
        try:
            f(*[None for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)],
              **{p.name: None for p in params if p.kind is p.KEYWORD_ONLY})
        except RuntimeError as e:
            errors.append("withheld" if "is withheld" in str(e) else "other")
        except BaseException:  # a released main() parsing the probe's argv exits
            errors.append("other")
        else:
            errors.append("other")
    sig = str(inspect.signature(obj)) if not isinstance(obj, type) else ""
    out[label] = [sig, errors]
print(json.dumps(out))
"""


def _site() -> list[str]:
    return [p for p in sys.path if p and os.path.isdir(p) and "site-packages" in p]


@pytest.mark.skipif(not ROOT, reason="the kernel's uid must differ from the grader's")
def test_every_withheld_reference_raises_until_released_and_keeps_its_signature(open_dir):
    """Every notebook's withheld references, imported from the grader's copy by another uid: each
    function (each method of a class) raises "withheld", and a function keeps its signature (so a
    kit cell's call is unchanged once it is released). Control: after release none raises
    "withheld", so the check can fail."""
    labels = sorted({lab for nb in NOTEBOOKS for lab in withheld(nb) if _is_def(lab)})
    assert len(labels) >= 250, len(labels)  # the references and every kit function that reaches one
    kit = build_kit(NOTEBOOKS, str(open_dir / "kit"))
    assert set(kit.files) == set(labels)
    run = _as_fresh_uid(_PROBE, str(open_dir / "kit"), json.dumps(labels), *_site())
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout)
    for label in labels:
        sig, errors = seen[label]
        real = _real(label)
        if not isinstance(real, type):
            assert sig == str(inspect.signature(real)), label
        assert errors and set(errors) == {"withheld"}, (label, errors)
    kit.release_after({ex for ids in kit.exercises.values() for ex in ids})
    run = _as_fresh_uid(_PROBE, str(open_dir / "kit"), json.dumps(labels), *_site())
    assert run.returncode == 0, run.stderr[-2000:]
    assert not any("withheld" in errors for _, errors in json.loads(run.stdout).values())
    kit.withhold()  # and back: the secret pass starts with every reference withheld again
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in kit.files.values())


_RELEASED = r"""
import sys
sys.path.insert(0, sys.argv[1])
sys.path[1:1] = sys.argv[2:]
from fractions import Fraction
from labkit.pipeline.simulate import bubble_formula, simulate
from labkit.pipeline.schedules import gpipe_schedule
from labkit.grid import ProcessGrid
import torch
from labkit.tensor_parallel.layers import VocabParallelEmbedding
assert bubble_formula(4, 8) == Fraction(3, 11), bubble_formula(4, 8)
assert simulate(gpipe_schedule(4, 8)).makespan > 0
g = ProcessGrid(tp=2, pp=2, dp=2)
assert g.coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}, g.coords(5)
torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
full = torch.nn.Embedding(10, 4)
emb = VocabParallelEmbedding.from_full(full, None)
x = torch.tensor([[1, 2, 9]])
assert torch.equal(emb(x), full(x))
print("ok")
"""


@pytest.mark.skipif(not ROOT, reason="the kernel's uid must differ from the grader's")
def test_a_released_reference_is_labkits_own(open_dir):
    """Once released, a withheld function, a class's method and a module subclass with super()
    compute what labkit's own do (a kit cell after the exercise runs as it would)."""
    kit = build_kit(["01_pipeline_bubble", "07_attention_embedding_loss", "08_3d_parallelism"],
                    str(open_dir / "kit"))
    kit.release_after({ex for ids in kit.exercises.values() for ex in ids})
    run = _as_fresh_uid(_RELEASED, str(open_dir / "kit"), *_site())
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_the_copy_rewrites_only_the_bodies():
    src = ('"""doc"""\nfrom __future__ import annotations\nimport functools\n\n\n@functools.lru_cache\n'
           'def f(a, b=2, *args, c, d=4, **kw):\n    """(a+b): the formula"""\n    return a + b\n\n\n'
           'def g(x): return x\n\n\nclass C(dict):\n    k = 1\n\n    def __init__(self, v):\n'
           '        super().__init__(v=v)\n\n    @staticmethod\n    def s(y):\n        return y\n')
    out, taken = _strip(src, {"m:f": ("1.1",), "m:C": ("1.2",)}, "m")
    assert "the formula" not in out and "a + b" not in out and "super()" not in out
    assert "def f(a, b=2, *args, c, d=4, **kw):" in out and "@functools.lru_cache" in out
    assert "_labkit_withheld('m:f')(a, b, *args, c=c, d=d, **kw)" in out
    assert "def g(x): return x" in out  # not withheld: untouched
    assert "_labkit_withheld('m:C', 1)(y)" in out and "k = 1" in out
    assert "a + b" in taken["m:f"] and "lru_cache" not in taken["m:f"]
    assert "def labkit_m0(self, v)" in taken["m:C"] and "staticmethod" not in taken["m:C"]


def test_nothing_is_kept_and_the_kit_functions_that_reach_a_reference_are_withheld_too():
    """No shipped cell needs a reference before its exercise, so every reference is withheld, with
    every kit function or class that reaches it (09's ``MoELayer`` runs ``route``; 02's
    ``build_schedule`` runs ``gpipe_schedule``)."""
    from labkit.grading.withhold import problems

    held = withheld("09_moe_routing")
    assert "9.1" in held["labkit.moe.router:route"] and "9.1" in held["labkit.moe.experts:MoELayer"]
    assert "2.1" in withheld("02_gpipe")["labkit.pipeline.explorer:build_schedule"]
    assert "labkit.pipeline.simulate:bubble_formula" in withheld("01_pipeline_bubble")
    assert {nb: problems(nb) for nb in NOTEBOOKS} == {nb: [] for nb in NOTEBOOKS}


def test_a_references_helpers_and_the_exercise_modules_own_references_are_withheld_too():
    """A reference that hands its work to a helper of its module would be withheld in name only
    (a red team answered 13.2 with ``zero_bubble._zb_h1_order``); an exercise module's own
    ``references=[...]`` count like the table's (15.1's ``shard_flat``). Each stays withheld for
    the exercises graded before a shipped cell uses it."""
    held = withheld("13_zero_bubble")
    assert "13.2" in held["labkit.pipeline.zero_bubble:_zb_h1_order"]
    assert "13.1" in held["labkit.pipeline.split_backward:_classify"]
    held = withheld("15_sharded_data_parallel")
    assert "15.1" in held["labkit.data_parallel.flat:shard_flat"]


_HELPER_13_2 = ("from labkit.pipeline import zero_bubble as _zb\n\ndef zb_h1_order(K, M):\n"
                "    return {r: getattr(_zb, '_zb_h1_' + 'order')(K, M, r) for r in range(K)}\n")


@pytest.mark.skipif(not ROOT, reason="withholding needs the kernel under a uid of its own")
@pytest.mark.parametrize("helpers", [True, False], ids=["helpers-withheld", "control-reference-alone"])
def test_a_references_private_helper_reached_by_a_computed_name_earns_nothing(helpers, tmp_path, monkeypatch):
    """Control: with the reference alone withheld, the helper answers 13.2."""
    from labkit.grading import grader, reach
    from labkit.grading.session import kernel_user

    if not (kernel_user() and kernel_user().newroot):
        pytest.skip("no file system of the kernel's own here")
    withheld.cache_clear()
    if not helpers:
        monkeypatch.setattr(reach, "callees_in_module", lambda label: frozenset())
        monkeypatch.setattr(grader, "_kernel_kit", lambda user, names: build_kit(names, tempfile.mkdtemp()))
    sol = json.loads((KIT_ROOT / "solutions" / "13_zero_bubble.ipynb").read_text())
    cells = ["".join(c["source"]) for c in sol["cells"] if c["cell_type"] == "code"]
    k = next(i for i, s in enumerate(cells) if s.lstrip().startswith("# Exercise 13.2"))
    cells[k] = _HELPER_13_2
    write_notebook(tmp_path / "sub.ipynb", cells[:k + 2], "13_zero_bubble")  # up to 13.2's check
    grade = grader.grade_notebook(tmp_path / "sub.ipynb", assignment="13_zero_bubble")
    by = {eg.exercise.id: eg for eg in grade.exercises}
    assert by["13.1"].status == "passed", by["13.1"].message
    withheld.cache_clear()
    if helpers:
        assert by["13.2"].status == "failed" and "_zb_h1_order" in by["13.2"].message and "withheld" in \
            by["13.2"].message, by["13.2"].message
    else:
        assert by["13.2"].status == "passed", by["13.2"].message


def _dynamic_reference_notebook(path: Path) -> None:
    """Solved 01 with 1.1 answered by labkit's reference, reached by names the source cannot show."""
    sol = json.loads((KIT_ROOT / "solutions" / "01_pipeline_bubble.ipynb").read_text())
    cells = ["".join(c["source"]) for c in sol["cells"] if c["cell_type"] == "code"]
    k = next(i for i, s in enumerate(cells) if s.lstrip().startswith("# Exercise 1.1"))
    cells[k] = ("import importlib\n\ndef bubble_fraction(K, M):\n    if K < 1 or M < 1:\n"
                "        raise ValueError('K >= 1 and M >= 1')\n"
                "    m = importlib.import_module('labkit.pipeline.' + 'simulate')\n"
                "    return float(getattr(m, 'bubble_' + 'formula')(K, M))\n")
    write_notebook(path, cells, "01_pipeline_bubble")


@pytest.mark.skipif(not ROOT, reason="withholding needs the kernel under a uid of its own")
@pytest.mark.parametrize("withholding", [True, False], ids=["withheld", "control-not-withheld"])
def test_the_reference_reached_by_computed_names_earns_nothing(withholding, tmp_path, monkeypatch, open_dir):
    """An answer that reaches bubble_formula through computed names (no rule reads them) fails 1.1
    with the "withheld" message; 1.2 keeps its points. Control: a copy that withholds nothing lets
    the same answer pass."""
    from labkit.grading import grader
    from labkit.grading.session import kernel_user

    if not (kernel_user() and kernel_user().newroot):
        pytest.skip("no file system of the kernel's own here")
    if not withholding:
        monkeypatch.setattr(grader, "_kernel_kit", lambda user, names: build_kit([], str(open_dir / "kit")))
    _dynamic_reference_notebook(tmp_path / "sub.ipynb")
    grade = grader.grade_notebook(tmp_path / "sub.ipynb", assignment="01_pipeline_bubble")
    by = {eg.exercise.id: eg for eg in grade.exercises}
    assert by["1.2"].status == "passed", by["1.2"].message
    if withholding:
        assert by["1.1"].status == "failed" and "bubble_formula (labkit.pipeline.simulate) is withheld" in \
            by["1.1"].message, by["1.1"].message
    else:
        assert by["1.1"].status == "passed", by["1.1"].message


_READS = r"""
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        open(p, "rb").read(1)
        out[p] = True
    except OSError:
        out[p] = False
print(json.dumps(out))
"""


@pytest.mark.skipif(not ROOT, reason="the jail runs as root")
@pytest.mark.parametrize("newroot", [True, False], ids=["new-root", "control-shared-root"])
def test_the_kernel_sees_the_kit_but_no_other_file_of_the_checkout(newroot, open_dir):
    """In its own file system the kernel's uid can read the kit and Python, but not the checkout's
    git history, the solutions, the README or the grader's exercise code, whatever their modes.
    Control: without --root the checkout's world-readable files are readable."""
    from labkit.grading.session import KernelUser, kernel_user

    template = kernel_user()
    if not (template and template.jail and template.newroot):
        pytest.skip("no file system of the kernel's own here")
    lease = UidLease()
    try:
        user = KernelUser(f"uid {lease.uid}", lease.uid, lease.gid, True, jail=True, newroot=newroot)
        kit = build_kit([], str(open_dir / "kit"))
        sol = KIT_ROOT / "solutions" / "01_pipeline_bubble.ipynb"
        secret = [KIT_ROOT / ".git" / "HEAD", KIT_ROOT / "README.md", sol,
                  KIT_ROOT / "labkit" / "grading" / "references.py"]
        visible = [KIT_ROOT / "labkit" / "__init__.py", Path(sys.executable)]
        stage = open_dir / "stage"
        stage.mkdir()
        os.chmod(stage, 0o755)
        argv, kw = user.command([sys.executable, "-S", "-c", _READS, *map(str, secret + visible)], None,
                                [f"--tmp={2 ** 20}", f"--stage={stage}"], kit=kit.path, stage=str(stage))
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)
        assert run.returncode == 0, run.stderr[-2000:]
        seen = json.loads(run.stdout)
        assert all(seen[str(p)] for p in visible), seen
        if newroot:
            assert not any(seen[str(p)] for p in secret), seen
        else:
            assert seen[str(KIT_ROOT / "README.md")] and seen[str(KIT_ROOT / ".git" / "HEAD")], seen
    finally:
        kill_uid(lease.uid, 5)
        lease.release()


def _tcp_listeners(uid: int) -> int:
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        n += sum(1 for r in rows if r.split()[3] == "0A" and int(r.split()[7]) == uid)
    return n


@pytest.mark.skipif(not ROOT, reason="a uid per kernel needs root")
@pytest.mark.parametrize("own", [True, False], ids=["own-network-and-sockets", "control-shared-tcp"])
def test_no_other_process_can_reach_the_kernel_nor_the_kernel_them(own, monkeypatch):
    """A jailed kernel's channels are Unix sockets in a folder of its own, signed with a key, and it
    runs in a network namespace of its own: no other process of the machine (another submission's
    kernel in a batch) can subscribe to its IOPub channel (which needs no key) and read its cells,
    or reach a torch store of its ranks; and it cannot reach the machine's 127.0.0.1 (a listener
    there stays silent). Control: the shared network with TCP channels, as before: 5 listening
    ports, and the listener is reached."""
    import dataclasses
    import socket

    import jupyter_client.connect as connect

    from labkit.grading.session import KernelSession, kernel_user

    user = kernel_user()
    if not (user and user.jail and user.newroot):
        pytest.skip("no network namespace here")
    if not own:
        user = dataclasses.replace(user, newroot=False)
        real = connect.write_connection_file
        monkeypatch.setattr(connect, "write_connection_file",
                            lambda fname, **kw: real(fname, **{**kw, "ip": "127.0.0.1", "transport": "tcp"}))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    s = KernelSession(user)
    try:
        s.start()
        probe = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3).close()\n"
                 f"except OSError:\n    pass\nelse:\n    raise RuntimeError('reached')")
        status, ename, _ = s.execute(probe, 60)
        assert s.info["key"]  # messages are signed
        n = _tcp_listeners(s.user.uid)  # in this (the machine's) network
        if own:
            assert s.info["transport"] == "ipc" and n == 0 and status == "ok", (s.info, n, ename)
        else:
            assert s.info["transport"] == "tcp" and n >= 5 and ename == "RuntimeError", (n, ename)
    finally:
        s.kill()
        listener.close()


def test_the_relay_socket_is_made_open_to_its_folder_without_a_chmod_by_name(open_dir, monkeypatch):
    """The relay's Unix socket lies in the kernel's folder, which the kernel owns: a chmod by name
    after bind() would follow a link the kernel swapped in (the grader is root). It is created
    0666 instead. Control: the mode is what a chmod-free bind gives under the grader's umask."""
    import stat

    from labkit.grading import relay

    def no_chmod(*a, **k):
        raise AssertionError("chmod by name in the kernel's folder")

    monkeypatch.setattr(relay.os, "chmod", no_chmod)
    monkeypatch.setattr(relay, "SOCKET_DIR", str(open_dir))
    old = os.umask(0o077)
    try:
        with relay.Relay(2) as r:
            kind, path, _ = r.address()
            assert kind == "unix" and stat.S_IMODE(os.stat(path).st_mode) == 0o666
            assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert not os.path.exists(path)
    finally:
        os.umask(old)


@pytest.mark.skipif(not ROOT, reason="a uid per kernel needs root")
@pytest.mark.parametrize("small", [True, False], ids=["tmpfs", "control-on-disk"])
def test_the_kernels_socket_folder_cannot_fill_the_machines_disk(small, monkeypatch):
    """The socket folder is the one place of the machine's file system the kernel may write: as
    root it is a tmpfs of 1 MiB and 64 files (a red team filled the disk through it in a batch,
    and the other submissions' ranks failed with "No space left on device"). Control: the folder
    on disk takes 4 MiB."""
    from labkit.grading import session as session_mod
    from labkit.grading.session import KernelSession, kernel_user

    user = kernel_user()
    if not (user and user.jail and not user.userns):
        pytest.skip("no root jail here")
    if not small:
        real = session_mod.subprocess.run
        monkeypatch.setattr(session_mod.subprocess, "run",
                            lambda argv, *a, **k: None if argv[0] == "mount" else real(argv, *a, **k))
    s = KernelSession(user)
    try:
        s.start()
        fill = ("import json, os\nd = os.path.dirname(json.load(open(os.path.expanduser('~/kernel.json')))['ip'])\n"
                "n = 0\ntry:\n    for i in range(4):\n        with open(os.path.join(d, f'f{i}'), 'wb') as f:\n"
                "            f.write(b'x' * (1 << 20))\n        n += 1\nexcept OSError:\n    pass\n"
                "if n == 4:\n    raise RuntimeError('filled')")
        status, ename, _ = s.execute(fill, 60)
        assert (status == "ok") is small and (ename == "RuntimeError") is not small, (status, ename)
    finally:
        s.kill()
    assert not os.path.exists(s.dir)
