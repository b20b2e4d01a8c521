"""The grader bounds itself and contains each submission (principles 6 and 7 of issue 16).

Unit tests: wire decoding refuses what would blow up before it builds it; the cgroup v2
protocol on a fake cgroup tree; the uid lease; the sweep of files by owner. End to end (real
``python -m labkit grade``, as root with a fresh uid per kernel, and as a non-root user where
the path differs): hostile submissions still get their honest score, nothing of theirs is left
(no process of their uid in any state, no file in /tmp, /var/tmp, /dev/shm, no System V
segment), the grader's memory and time stay bounded, and each cell's checks are graded once.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest
from asuser import NonRoot
from nbfiles import write_notebook

from labkit.grading import wire
from labkit.grading.contain import Cgroup, Limits, UidLease, remove_files_of, uid_processes

ROOT = os.geteuid() == 0


def _raw(tree, blobs=()) -> bytes:
    header = json.dumps({"v": tree, "blobs": [len(b) for b in blobs]}, separators=(",", ":")).encode()
    return wire.MAGIC + struct.pack("<Q", len(header)) + header + b"".join(blobs)


@pytest.mark.parametrize("what, message", [
    ("range", "values"), ("nested", "values"), ("raw lists", "values"), ("string", "characters"),
    ("bytes", "characters")])
def test_wire_refuses_hostile_sizes_before_building_them(what, message):
    if what == "range":
        data = wire.dumps(range(30_000_000))  # 30 bytes that a case would turn into a 1 GB list
    elif what == "nested":
        data = _raw(["L", [["L", []]] * (wire.MAX_NODES + 10)])
    elif what == "raw lists":  # not even the format's own tags: 60 MB of "[]," that JSON alone would build
        data = _raw([[]] * 20_000_000)
    elif what == "string":
        data = _raw(["L", ["x" * (wire.MAX_TEXT // 4)] * 5])
    else:
        data = _raw(["L", [["B", i] for i in range(3)]], [b"\0" * (wire.MAX_TEXT // 2)] * 3)
    tracemalloc.start()
    try:
        with pytest.raises(wire.WireError, match=message):
            wire.loads(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # bounded by the limits, not by what the message would build (the raw lists: gigabytes)
    assert peak < 2 * len(data) + 96 * 2 ** 20, f"decoding held {peak} bytes for a {len(data)}-byte message"


def test_wire_still_carries_ordinary_values():
    value = {"r": range(5), "s": "a, [b]" * 1000, "l": [[1, 2]] * 1000, "b": b"xyz"}
    assert wire.loads(wire.dumps(value)) == value
    assert list(wire.loads(wire.dumps(range(10, 0, -3)))) == [10, 7, 4, 1]
    assert wire.loads(wire.dumps(range(wire.MAX_NODES - 5))) == range(wire.MAX_NODES - 5)


def test_cgroup_v2_limits_kill_and_removal_on_a_fake_tree(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "cgroup.subtree_control").write_text("")
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **k):  # the kernel creates a group's files; here the test does
        real_mkdir(self, *a, **k)
        if self.name.startswith("kernel-"):
            for f in ("memory.max", "pids.max", "cpu.max", "cgroup.procs", "cgroup.kill"):
                (self / f).write_text("")
            (self / "cgroup.events").write_text("populated 0\nfrozen 0\n")

    Path.mkdir = mkdir
    try:
        g = Cgroup(tmp_path, "kernel-7", Limits(memory=2 ** 30, processes=99, cpus=1.5))
    finally:
        Path.mkdir = real_mkdir
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (g.path / "memory.max").read_text() == str(2 ** 30)
    assert (g.path / "pids.max").read_text() == "99"
    assert (g.path / "cpu.max").read_text() == "150000 100000"
    killed = []

    def rmdir(self):  # a real group's files vanish with it
        killed.append((self / "cgroup.kill").read_text())
        shutil.rmtree(self)

    monkeypatch.setattr(Path, "rmdir", rmdir)
    assert g.kill() == [] and not g.path.exists()
    assert killed == ["1"]


@pytest.mark.skipif(not ROOT, reason="uids of their own need root")
def test_uid_leases_are_exclusive_and_files_are_swept_by_owner(tmp_path):
    a, b = UidLease(), UidLease()
    try:
        assert a.uid != b.uid
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "deep").write_text("x")
        (tmp_path / "file").write_text("x")
        (tmp_path / "other").write_text("keep")
        for p in (mine, mine / "deep", tmp_path / "file"):
            os.chown(p, a.uid, a.gid, follow_symlinks=False)
        os.chown(tmp_path / "other", b.uid, b.gid)
        assert remove_files_of(a.uid, [str(tmp_path)]) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]
    finally:
        a.release()
        b.release()


# ----------------------------------------------------------------------------- end to end

CASES = '''
from labkit.grading.registry import exercise, expect_equal

ex = exercise("H.1", title="triple", notebook="98_hostile", points=1)
@ex.case("x=2", hidden=False)
def _(f): expect_equal(f(2), 6, "f(2)")
@ex.case("x=5")
def _(f): expect_equal(f(5), 15, "f(5)")

ex = exercise("H.2", title="negate", notebook="98_hostile", points=1)
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), -1, "f(1)")

ex = exercise("H.3", title="square", notebook="98_hostile", points=1)
@ex.case("x=3", hidden=False)
def _(f): expect_equal(f(3), 9, "f(3)")
'''

TAG = uuid.uuid4().hex[:12]  # in every file name the submissions write

# a process whose main thread exits while another runs (state Z), that clears its environment,
# leaves the session and its parent, and once its kernel is gone starts killing every process it
# may signal (the next submission's kernel, when it shares the uid and outlives grading)
ESCAPE = (
    "import os, subprocess, sys\n"
    "code = ('import ctypes, os, signal, threading, time\\n'\n"
    "        'if os.fork(): os._exit(0)\\n'\n"
    "        'os.setsid()\\n'\n"
    "        'def loop():\\n'\n"
    "        '    while True:\\n'\n"
    "        '        try: os.kill(%d, 0)\\n'\n"
    "        '        except OSError: break\\n'\n"
    "        '        time.sleep(0.05)\\n'\n"
    "        '    while True:\\n'\n"
    "        '        try: os.kill(-1, signal.SIGKILL)\\n'\n"
    "        '        except OSError: pass\\n'\n"
    "        '        time.sleep(0.05)\\n'\n"
    "        'threading.Thread(target=loop).start()\\n'\n"
    "        'ctypes.CDLL(None).pthread_exit(None)\\n') % os.getpid()\n"
    "subprocess.Popen([sys.executable, '-c', code], env={}, start_new_session=True).wait()\n"
)

FILES = (
    "import ctypes, os\n"
    f"for d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
    f"    with open(os.path.join(d, 'labkit-test-{TAG}'), 'wb') as f:\n"
    "        f.write(b'x' * 2 ** 20)\n"
    "libc = ctypes.CDLL(None)\n"
    f"seg = libc.shmget({int(TAG[:6], 16)}, 2 ** 20, 0o1600)  # IPC_CREAT | 0600: a System V segment\n"
)

# what of the grader can the kernel read? (raised, so the grader's output shows it)
PEEK = ("import labkit.grading, os\nhere = os.path.dirname(labkit.grading.__file__)\n"
        "found = {}\nfor rel in ('exercises/nb08_3d_parallelism.py', 'references.py', 'grader.py'):\n"
        "    try:\n        found[rel] = len(open(os.path.join(here, rel)).read())\n"
        "    except OSError as e:\n        found[rel] = type(e).__name__\n"
        "found['hidden'] = os.path.exists('@HIDDEN_DIR@')\n"

        "try:\n    from labkit.grading.exercises.nb08_3d_parallelism import _axis\n    found['import'] = 'ok'\n"
        "except ImportError as e:\n    found['import'] = 'ImportError'\n"
        "raise RuntimeError('SEEN ' + repr(sorted(found.items())))")
# the kit's solved notebooks, the grading's other submission, the grader's environment
PEEK_MORE = ("import labkit, os\nsol = os.path.join(os.path.dirname(labkit.__file__), '_solutions')\n"
             "found = {'solutions': sorted(os.listdir(sol))[:1] if os.path.isdir(sol) else 'none'}\n"
             "try:\n    found['other'] = len(open('@OTHER@').read())\nexcept OSError as e:\n"
             "    found['other'] = type(e).__name__\n"
             "found['env'] = sorted(k for k in os.environ if 'SECRET' in k)\n"
             "raise RuntimeError('MORE ' + repr(sorted(found.items())))")

HOSTILE = [
    "from labkit.grading import check\nimport os, signal",
    FILES,
    PEEK,
    PEEK_MORE,
    "def triple(x):\n    return 3 * x\ncheck('H.1', triple)",          # right: 1 point
    "def negate(x):\n    return range(30_000_000)\ncheck('H.2', negate)",  # wrong, and a 30-byte bomb
    ESCAPE,  # before the last check: cells after the last grading point do not run
    "def square(x):\n    return x * x\ncheck('H.3', square)",          # right: 1 point
]

HONEST = [
    "from labkit.grading import check",
    "import time\ntime.sleep(1.5)",  # the escaper above would have killed this kernel by now
    "def triple(x):\n    return 3 * x\ncheck('H.1', triple)",
    "def negate(x):\n    return -x\ncheck('H.2', negate)",
    "def square(x):\n    return x * x\ncheck('H.3', square)",
]

# an IPython hook re-registers every answer after every cell: new serials each time
RESERIAL = [
    "from labkit.grading import check\nimport labkit.grading.kernel as K\n"
    "def again(*a):\n    for k, (s, v) in list(K._ANSWERS.items()):\n        K.register(k, v)\n"
    "get_ipython().events.register('post_execute', again)",
    f"def triple(x):\n    open('/tmp/calls-{TAG}', 'a').write('x')\n    return 3 * x\ncheck('H.1', triple)",
] + ["pass"] * 12 + [
    f"import os\nn = len(open('/tmp/calls-{TAG}').read())\nos.unlink('/tmp/calls-{TAG}')\n"
    "raise RuntimeError(f'CALLS {n}')",
    "check('H.3', lambda x: x)",  # wrong (0 points): the last grading point, so every cell above runs
]


def _grade(tmp: Path, notebooks: dict, *extra: str, wrap=None):
    (tmp / "cases").mkdir(exist_ok=True)
    (tmp / "cases" / "hostile.py").write_text(CASES)
    others = [tmp / f"{n}.ipynb" for n in notebooks]
    for name, cells in notebooks.items():
        other = next((str(o) for o in others if o.stem != name), "/nonexistent-file")
        write_notebook(tmp / f"{name}.ipynb", [c.replace("@HIDDEN_DIR@", str(tmp / "cases")).replace("@OTHER@", other)
                                               for c in cells])
    results = tmp / "results.json"
    # --no-source-policy: accepted and ignored (there is no source policy any more); kept as old scripts pass it
    cmd = [sys.executable, "-m", "labkit", "grade", *[str(tmp / f"{n}.ipynb") for n in notebooks],
           "--results", str(results), "--no-source-policy", *extra]
    # the grader's peak memory (and its children's) is read from a wrapper of its own
    code = ("import resource, subprocess, sys\np = subprocess.run(sys.argv[1:])\n"
            "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(p.returncode)")
    mark = uuid.uuid4().hex
    env = dict(os.environ, LABKIT_HIDDEN_CASES=str(tmp / "cases"), LABKIT_TEST_MARK=mark, GRADER_SECRET="hunter2")
    argv = [sys.executable, "-c", code, *cmd]
    kw = {}
    if wrap is not None:
        argv, kw = wrap(argv)
    seen, done = set(), threading.Event()
    watcher = threading.Thread(target=_watch_uids, args=(mark, seen, done), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp, timeout=400, **kw)
    finally:
        done.set()
        watcher.join()
    took = time.monotonic() - t0
    _grade.uids = seen
    assert proc.returncode == 0, proc.stdout + proc.stderr
    maxrss_kib = int(proc.stderr.split("MAXRSS")[1].split()[0])
    return proc, json.loads(results.read_text()), took, maxrss_kib


def _watch_uids(mark: str, seen: set, done) -> None:
    """While a grading runs: the uids of the processes carrying its environment mark (its kernels)."""
    needle = f"LABKIT_TEST_MARK={mark}".encode()
    while not done.wait(0.2):
        for entry in os.listdir("/proc"):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        seen.add(os.stat(f"/proc/{entry}").st_uid)
            except OSError:
                continue


def _left_files() -> list[str]:
    out = []
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        for root, dirs, files in os.walk(d):
            out += [os.path.join(root, f) for f in files + dirs if TAG in f]
            if root.count("/") > 4:
                dirs[:] = []
    return out


def _segments() -> list[str]:
    key = str(int(TAG[:6], 16))
    with open("/proc/sysvipc/shm") as f:
        return [l for l in f.read().splitlines()[1:] if l.split()[0] == key]


def _scores(obj, path_part: str) -> str:
    return next(l for l in obj["output"].splitlines() if path_part in l)


def _processes_of(uids) -> list[tuple]:
    """(pid, uid, state) of every process, in any state, any of whose uids is in ``uids``."""
    return [(pid, u, state) for u in sorted(uids) for pid, state, _ in uid_processes(u)]


@pytest.mark.skipif(not ROOT, reason="a uid per submission, private /tmp and limits need root")
def test_as_root_hostile_submission_gets_its_honest_score_and_leaves_nothing(tmp_path):
    proc, obj, took, maxrss = _grade(tmp_path, {"hostile": HOSTILE, "honest": HONEST}, "--cell-timeout", "20")
    uids = _grade.uids - {0}
    assert _scores(obj, "hostile.ipynb").startswith("hostile.ipynb: 2 / 3"), proc.stdout
    assert _scores(obj, "honest.ipynb") == "honest.ipynb: 3 / 3", proc.stdout  # not killed
    h2 = next(t for t in obj["tests"] if t["name"] == "Exercise H.2 (negate) - case: x=1")
    assert h2["status"] == "failed" and "more than" in h2["output"], h2
    assert "a uid of its own" in proc.stdout and "private /tmp" in proc.stdout
    # the grader's cases, expected-value code, reference list and hidden cases are out of reach
    seen = proc.stdout.split("SEEN ")[1].split("\n")[0]
    assert "('exercises/nb08_3d_parallelism.py', 'FileNotFoundError')" in seen, seen
    # not in the kernel's copy of the kit (a file system of its own), or covered by an empty file (without one)
    assert re.search(r"\('references.py', (0|'FileNotFoundError')\)", seen), seen
    assert "('hidden', False)" in seen and "('import', 'ImportError')" in seen, seen
    assert "('grader.py', 0)" not in seen  # the rest of the kit is there
    # no solved notebook, no other submission of the grading, no variable of the grader's environment
    more = proc.stdout.split("MORE ")[1].split("\n")[0]
    assert re.search(r"\('solutions', (\[\]|'none')\)", more), more
    assert re.search(r"\('other', (0|'FileNotFoundError'|'PermissionError')\)", more), more
    assert "('env', [])" in more, more
    assert "warning: the submission's kernel can read" not in proc.stderr
    assert len(uids) >= 2, uids  # a uid per kernel: at least one per submission
    deadline = time.monotonic() + 2
    while _processes_of(uids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_of(uids) == [], "a process of a submission's uid outlived grading (any state)"
    assert _left_files() == [] and _segments() == []
    assert maxrss < 1_000_000, f"the grader or a process it waited for peaked at {maxrss} KiB"
    assert took < 120


def test_each_cell_is_graded_once_whatever_serials_the_kernel_reports(tmp_path):
    proc, obj, took, _ = _grade(tmp_path, {"reserial": RESERIAL}, "--cell-timeout", "20")
    assert ": 1 / 3" in _scores(obj, "reserial.ipynb"), proc.stdout
    # H.1 is graded once: its answer ran once here, for its one visible case (not once per later cell);
    # its instructor case (x=5) runs afterwards in a fresh kernel with a /tmp of its own
    assert re.search(r"raised RuntimeError: CALLS 1\b", proc.stdout), proc.stdout


def test_the_time_budget_bounds_a_submission(tmp_path):
    cells = ["from labkit.grading import check",
             "def triple(x):\n    return 3 * x\ncheck('H.1', triple)"] + ["import time\ntime.sleep(5)"] * 6 + [
             "def square(x):\n    return x * x\ncheck('H.3', square)"]
    proc, obj, took, _ = _grade(tmp_path, {"slow": cells}, "--cell-timeout", "20", "--time-budget", "20")
    # the grader's own clock (from the first submission to the results) keeps the budget, plus killing the
    # kernel; the wall time adds starting Python and importing torch, which a loaded machine stretches
    assert obj["execution_time"] <= 20 + 8, obj["execution_time"]
    assert took < 20 + 60, took
    assert "time budget of 20 s ran out" in proc.stdout, proc.stdout
    # H.1's visible case was graded before the budget ran out; its instructor case (run after every visible
    # result, in a fresh kernel) found no time left, so it fails and H.1 (all or nothing) earns 0
    h1 = next(t for t in obj["tests"] if t["name"] == "Exercise H.1 (triple) - case: x=2")
    assert h1["status"] == "passed", h1
    assert ": 0 / 3" in _scores(obj, "slow.ipynb"), proc.stdout
    h3 = next(t for t in obj["tests"] if t["name"] == "Exercise H.3 (square)")
    assert h3["score"] == 0 and "time budget" in h3["output"], h3


def test_starting_the_kernel_counts_against_the_time_budget(tmp_path):
    # a budget shorter than a kernel's start (ipykernel plus torch: seconds): the grader stops waiting at the
    # budget and kills the kernel; the exercises are "not reached", no kernel started for the instructor case
    cells = ["from labkit.grading import check", "def triple(x):\n    return 3 * x\ncheck('H.1', triple)"]
    proc, obj, took, _ = _grade(tmp_path, {"late": cells}, "--cell-timeout", "20", "--time-budget", "0.5")
    assert obj["execution_time"] <= 0.5 + 8, obj["execution_time"]
    assert "time budget of 0.5 s ran out while the kernel started" in proc.stdout, proc.stdout
    h1 = [t for t in obj["tests"] if t["name"].startswith("Exercise H.1")]
    assert h1 and all(t["score"] == 0 for t in h1), h1
    assert _left_files() == [] and _segments() == []


@pytest.mark.skipif(not ROOT, reason="runs the grader as another uid (as root, for the test only); a non-root "
                                     "session cannot switch users")
def test_as_non_root_hostile_submission_gets_its_honest_score_and_leaves_nothing(tmp_path):
    # the grader runs as a plain user (a fresh uid, the kit and Python readable, not writable): no uid of
    # its own for the kernel, no cgroup; with user namespaces (``unshare --user``), each kernel still gets a
    # private /tmp, /var/tmp, /dev/shm and IPC namespace, the grader's secrets covered, no capabilities. The
    # same hostile submission as as root: files in the temporary folders and a System V segment, a peek
    # at the grader's files, a 30-byte bomb, a state-Z escaper that kills every process it may signal
    # once its kernel is gone; then an honest submission, which must be unharmed
    user = NonRoot(tmp_path)
    try:
        proc, obj, took, maxrss = _grade(tmp_path, {"hostile": HOSTILE, "honest": HONEST}, "--cell-timeout", "20",
                                         wrap=user.wrap)
        uid = user.uid
        assert "isolation is partial" in proc.stdout
        assert ": 2 / 3" in _scores(obj, "hostile.ipynb"), proc.stdout
        assert _scores(obj, "honest.ipynb").endswith(": 3 / 3"), proc.stdout
        h2 = next(t for t in obj["tests"] if t["name"] == "Exercise H.2 (negate) - case: x=1")
        assert h2["status"] == "failed" and "more than" in h2["output"], h2
        deadline = time.monotonic() + 2
        while uid_processes(uid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert uid_processes(uid) == [], "a process of the grader's uid outlived grading (any state)"
        assert maxrss < 1_000_000, f"the grader or a process it waited for peaked at {maxrss} KiB"
        assert took < 150, took
        seen = proc.stdout.split("SEEN ")[1].split("\n")[0]
        if shutil.which("unshare") and "namespaces of its own" in proc.stdout:
            # what the namespaces give a non-root grader: nothing left in the temporary folders, the
            # grader's cases and reference list covered (still readable through /proc/<grader>: documented)
            assert _left_files() == [] and _segments() == []
            assert "('exercises/nb08_3d_parallelism.py', 'FileNotFoundError')" in seen, seen
            assert re.search(r"\('references.py', (0|'FileNotFoundError')\)", seen), seen  # absent, or covered
            assert "('import', 'ImportError')" in seen, seen
        else:  # no user namespaces here: the note says what is left open
            assert "no user namespace" in proc.stdout, proc.stdout
    finally:
        user.close()


@pytest.mark.skipif(not ROOT, reason="the jail's own procfs needs root")
@pytest.mark.parametrize("hidepid", [True, False], ids=["kernel-jail", "without-hidepid"])
def test_the_jailed_kernel_sees_no_process_of_another_uid(hidepid, tmp_path):
    """As root the kernel's jail mounts a procfs of its own with hidepid=2: the kernel's uid lists
    only its own processes, so it cannot read the grader's command line (in a batch it names the
    other submissions) or another kernel's. Without the option (the control) it sees this test."""
    from labkit.grading.session import KernelUser

    lease = UidLease()
    try:
        user = KernelUser(f"uid {lease.uid}", lease.uid, lease.gid, True, jail=True)
        probe = ("import os\nmine = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                 "        try:\n            mine.append((int(p), open(f'/proc/{p}/cmdline', 'rb').read()))\n"
                 "        except OSError:\n            pass\nprint(sorted(pid for pid, _ in mine))")
        argv, kw = user.command([sys.executable, "-S", "-c", probe], None, ["--hidepid=1"] if hidepid else [])
        run = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
        assert run.returncode == 0, run.stderr
        seen = json.loads(run.stdout)
        assert (os.getpid() in seen) is not hidepid, seen
        if hidepid:
            assert len(seen) == 1, seen  # the probe itself
    finally:
        from labkit.grading.contain import kill_uid
        kill_uid(lease.uid, 5)
        lease.release()
