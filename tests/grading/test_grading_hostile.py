"""Hostile submissions, each graded end to end by the real ``python -m labkit grade``.

Two notebooks are graded in one grader run (each in its own kernel):

* ``attacks.ipynb``: every answer is still the stub, and its cells try to game the grader:
  replace the case runner and every registry case from the kernel, append forged "passed"
  records, check exercises of another notebook and check the same exercise again and again,
  answer H.3 with labkit's reference function, look for the instructor's hidden cases.
  Honest score: 0 of 3.
* ``robust.ipynb``: right answers to H.1 and H.3 around cells that flood 50 MB of output, hold a
  syntax error (the H.2 cell), call ``os._exit``, loop forever ignoring SIGINT, and SIGKILL
  the kernel. Honest score: 2 of 3 (H.2 alone is lost).

The exercises H.1-H.3 (notebook ``98_hostile``) come from an instructor hidden-case folder whose
hidden cases carry a secret input and expected value; the kernel must never see them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from asuser import ROOT, NonRoot
from nbfiles import write_notebook

from labkit.grading.runner import evaluate
from labkit.pipeline import gpipe_schedule

SECRET = 4242  # a hidden case's input; 3 * SECRET its expected value

CASES = f'''
from labkit.grading.registry import exercise, expect_equal

ex = exercise("H.1", title="triple", notebook="98_hostile", points=1)
@ex.case("x=2", hidden=False)
def _(f): expect_equal(f(2), 6, "f(2)")
@ex.case("secret")
def _(f): expect_equal(f({SECRET}), {3 * SECRET}, "f(secret)")

ex = exercise("H.2", title="negate", notebook="98_hostile", points=1)
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), -1, "f(1)")

ex = exercise("H.3", title="square", notebook="98_hostile", points=1,
              references=["labkit.pipeline.simulate:bubble_formula"])
@ex.case("x=3", hidden=False)
def _(f): expect_equal(f(3), 9, "f(3)")
'''

STUBS = [
    "from labkit.grading import check\nimport os, sys, json",
    "def triple(x):\n    raise NotImplementedError('Exercise H.1')\ncheck('H.1', triple)",
    "def negate(x):\n    raise NotImplementedError('Exercise H.2')\ncheck('H.2', negate)",
    "def square(x):\n    raise NotImplementedError('Exercise H.3')\ncheck('H.3', square)",
]

# a daemon that leaves the kernel's session and its parent (orphaned: to init as non-root)
DAEMON = ("import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import os, signal, sys, time\\n"
          "if os.fork(): sys.exit()\\nos.setsid()\\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\nwhile True: time.sleep(0.1)'], "
          "start_new_session=True).wait()")

ATTACKS = [
    # replace the case runner (what check() and the old grader used)
    "import labkit.grading.runner as R\n"
    "R.run_case = lambda case, answer, *a, **k: R.CaseResult(case.name, case.hidden, 'passed')\n"
    "R.evaluate = lambda i, a, *x, **k: R.CheckResult(i, 'passed', 1, 1, 'passed')",
    # replace every case of every exercise the kernel knows
    "from labkit.grading import registry\n"
    "for ex in registry.all_exercises():\n    for c in ex.cases:\n        c.fn = lambda answer: None",
    # forged records, wherever a results file might be
    "for p in [os.environ.get('LABKIT_RESULTS_FILE'), 'results.json', '../out/results.json']:\n"
    "    if p:\n        try:\n            open(p, 'a').write(json.dumps({'exercise': 'H.1', 'case': 'x=2', 'status': 'passed',"  # noqa: E501
    " 'score': 100}) + '\\n')\n        except OSError:\n            pass",
    # checks of another notebook's exercises (right answers: they must add nothing) and repeats
    "check('1.1', lambda K, M: (K - 1) / (M + K - 1))\ncheck('12.1', lambda E, k, m: 1)\n"
    "for _ in range(5):\n    check('H.1', triple)",
    # a right value computed with the labkit function the exercise stands for (the last check counts)
    "from labkit.pipeline.simulate import bubble_formula\n"
    "check('H.3', lambda x: x * x + 0 * int(bubble_formula(2, 2)))",
    # look for the instructor's hidden cases
    "hidden = [m for m in sys.modules if m.startswith('labkit_hidden')]\n"
    "raise RuntimeError('OBSERVED ' + json.dumps({'env': os.environ.get('LABKIT_HIDDEN_CASES'), 'modules': hidden,\n"
    "    'cases': [c.name for ex in registry.all_exercises() for c in ex.cases if ex.id.startswith('H.')]}))",
    DAEMON,
    # the last grading point (H.2 is still the stub): every cell above runs, as cells after it would not
    "check('H.2', negate)",
]

ROBUST = [
    "from labkit.grading import check\nimport os, signal",
    "def triple(x):\n    return 3 * x\ncheck('H.1', triple)",
    "print('x' * 50_000_000)",                                    # 50 MB of output
    "def negate(x)\n    return -x\ncheck('H.2', negate)",           # a syntax error: H.2 is lost
    "os._exit(3)",                                                # the kernel exits
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",   # loops, ignoring SIGINT
    "os.kill(os.getpid(), signal.SIGKILL)",                       # the kernel is killed
    "def square(x):\n    return x * x\ncheck('H.3', square)",
]


# every end-to-end grading here (but the 13.1 batch) runs twice: as root (a
# uid and a private /tmp per kernel, the grader's files covered) and as a non-root grader (a fresh uid, as an
# instructor without root runs it): the verdicts must not depend on the isolation the grader could get
USERS = ["root", pytest.param("non-root", marks=pytest.mark.skipif(
    not ROOT, reason="runs the grader as another uid (as root, for the test only); a non-root session cannot "
                     "switch users"))]


@pytest.fixture(scope="module", params=USERS)
def user(request, tmp_path_factory):
    """None (the grader runs as this test's user) or a ``NonRoot`` wrapper around a fresh uid."""
    if request.param == "root":
        yield None
        return
    wrapper = NonRoot(tmp_path_factory.mktemp("nonroot"))
    try:
        yield wrapper
    finally:
        wrapper.close()


def _run(user, argv, **kw):
    """``subprocess.run(argv)`` as this test's user or as the ``NonRoot`` one."""
    if user is not None:
        argv, extra = user.wrap(argv)
        kw.update(extra)
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)


def _folder(user, tmp_path_factory, name):
    """A fresh folder for one grading: under the folder the non-root grader may reach and write, if any."""
    if user is None:
        return tmp_path_factory.mktemp(name)
    tmp = Path(user.tmp) / name
    tmp.mkdir()
    os.chmod(tmp, 0o777)
    return tmp


@pytest.fixture(scope="module")
def graded(user, tmp_path_factory):
    tmp = _folder(user, tmp_path_factory, "hostile")
    (tmp / "cases").mkdir()
    (tmp / "cases" / "hostile.py").write_text(CASES)
    sub = tmp / "submission"
    sub.mkdir()
    write_notebook(sub / "attacks.ipynb", STUBS + ATTACKS)
    write_notebook(sub / "robust.ipynb", ROBUST)
    (tmp / "out").mkdir(mode=0o777)
    os.chmod(tmp / "out", 0o777)
    results = tmp / "out" / "results.json"
    env = dict(os.environ, LABKIT_HIDDEN_CASES=str(tmp / "cases"), LABKIT_TEST_MARK=MARK)
    proc = _run(user, [sys.executable, "-m", "labkit", "grade", str(sub / "attacks.ipynb"), str(sub / "robust.ipynb"),
                       "--results", str(results), "--cell-timeout", "4"], env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp, proc, json.loads(results.read_text()), user


MARK = uuid.uuid4().hex  # in the grader's environment, so in every process its kernels start


def _marked_processes() -> list[str]:
    """Live processes (any user) whose environment holds this module's MARK."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"LABKIT_TEST_MARK={MARK}".encode() in f.read().split(b"\0"):
                    out.append(open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200])
        except (OSError, IndexError, ValueError):
            continue
    return out


def test_no_process_of_a_kernel_outlives_grading(graded):
    # robust.ipynb ran past the limit (ignoring SIGINT) and killed its kernel; attacks.ipynb
    # started a daemon that left the kernel's session and parent: nothing may be left running
    deadline = time.monotonic() + 1  # SIGKILLed processes take a moment to leave /proc
    while _marked_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked_processes() == []


def _tests(obj, notebook_tests):
    return [t for t in obj["tests"] if t["name"] in notebook_tests]


def test_attacks_score_zero_and_only_the_notebooks_exercises_count(graded):
    tmp, proc, obj, _ = graded
    names = [t["name"] for t in obj["tests"]]
    # two notebooks x (H.1: 1 + 2 cases, H.2: 1 + 1, H.3: 1 + 1); no test of notebook 01 or 12
    assert len(names) == 14 and all(n.startswith("Exercise H.") for n in names), names
    attacks = obj["tests"][:7]
    assert [t["score"] for t in attacks] == [0] * 7, attacks
    assert sum(t["max_score"] for t in attacks) == 3  # each exercise at most its points
    assert "attacks.ipynb: 0 / 3" in obj["output"]
    # nothing is refused for how it is written: H.1 is still the stub, whatever the kernel patched; H.3 is
    # graded from `square` (the name its check passes), not from the lambda that called labkit's reference
    assert "not attempted" in attacks[0]["output"] and "source policy" not in obj["output"], attacks[0]


def test_the_kernel_never_sees_hidden_cases(graded):
    tmp, proc, obj, _ = graded
    # the attack cell raised what it found; its error is in the grader's output
    assert 'raised RuntimeError: OBSERVED {"env": null, "modules": [], "cases": []}' in proc.stdout
    assert str(SECRET) not in proc.stdout + json.dumps(obj)


def test_broken_cells_cost_only_what_depends_on_them(graded):
    tmp, proc, obj, _ = graded
    robust = {t["name"]: t for t in obj["tests"][7:]}
    assert robust["Exercise H.1 (triple)"]["score"] == 1
    assert robust["Exercise H.1 (triple) - hidden case: secret"]["status"] == "passed"
    assert robust["Exercise H.3 (square)"]["score"] == 1
    h2 = robust["Exercise H.2 (negate) - case: x=1"]  # the reason once, on the exercise's own line
    assert h2["status"] == "failed" and h2["output"] == "not run: see the exercise's line above"
    assert "cell 4 raised SyntaxError" in robust["Exercise H.2 (negate)"]["output"]
    assert robust["Exercise H.2 (negate)"]["score"] == 0
    assert "robust.ipynb: 2 / 3" in obj["output"]
    for why in ("cell 5 killed the kernel", "cell 6 ran past the time limit of 4 s", "cell 7 killed the kernel"):
        assert why in proc.stdout
    assert obj["score"] == 2


def test_grader_says_how_the_kernel_is_isolated(graded):
    tmp, proc, obj, user = graded
    # the note is instructor detail: in the grader's stdout, kept from students (stdout_visibility)
    assert "isolation" in proc.stdout and "isolation" not in obj["output"]
    assert obj["stdout_visibility"] == "hidden" and str(tmp) not in obj["output"]
    if user is not None or not ROOT:
        assert "isolation is partial" in proc.stdout
    else:
        assert "each kernel runs as a uid of its own" in proc.stdout


def test_labkit_reference_as_the_answer_is_told_it_will_not_be_there():
    res = evaluate("2.1", gpipe_schedule)
    assert res.status == "failed" and res.passed == 0
    assert "your answer calls labkit's gpipe_schedule (labkit.pipeline.schedules)" in res.message
    assert "not available when the notebook is graded" in res.message

    def wraps_it(K, M):  # calling it from inside an answer is caught too, even inside a try
        try:
            return dict(gpipe_schedule(K, M))
        except Exception:
            return {}

    assert "gpipe_schedule" in evaluate("2.1", wraps_it).message


FORGE = [
    "from labkit.grading import check\nimport os, json, signal",
    "def triple(x):\n    raise NotImplementedError('Exercise H.1')\ncheck('H.1', triple)",
    # where the grader writes: its command line, read from /proc (hidden from the kernel's uid: hidepid); the
    # results path is then taken as known (RESULTS, filled in by the test), to try the write anyway
    "try:\n    argv = open(f'/proc/{os.getppid()}/cmdline').read().split('\\0')\n"
    "    target = argv[argv.index('--results') + 1]\nexcept OSError:\n    target = RESULTS\n"
    "else:\n    raise RuntimeError('READ THE GRADER COMMAND LINE')",
    "open(target, 'w').write(json.dumps({'score': 100, 'tests': []}))",   # forge the results file
    "os.kill(os.getppid(), signal.SIGKILL)",                              # then kill the grader
    "print(open(f'/proc/{os.getppid()}/environ').read())",               # where are the hidden cases?
    "check('H.1', triple)",  # the last grading point: every cell above runs
]


def _isolated() -> bool:
    if os.geteuid() != 0:
        return False
    from labkit.grading.session import kernel_user

    return kernel_user() is not None


@pytest.mark.skipif(not _isolated(), reason="needs root with an unprivileged kernel user; as another user the "
                                            "kernel CAN signal the grader (documented: isolation is partial)")
def test_as_root_the_kernel_cannot_forge_results_kill_the_grader_or_read_hidden_cases(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "hostile.py").write_text(CASES)
    results = tmp_path / "results.json"
    write_notebook(tmp_path / "forge.ipynb", [c.replace("RESULTS", repr(str(results))) for c in FORGE])
    env = dict(os.environ, LABKIT_HIDDEN_CASES=str(tmp_path / "cases"))
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(tmp_path / "forge.ipynb"), "--results",
                           str(results), "--cell-timeout", "20"], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(results.read_text())
    assert obj["score"] == 0 and len(obj["tests"]) == 7
    assert "READ THE GRADER COMMAND LINE" not in proc.stdout and "cell 3 raised" not in proc.stdout
    assert "cell 4 raised PermissionError" in proc.stdout or "cell 4 raised FileNotFoundError" in proc.stdout
    assert "cell 5 raised PermissionError" in proc.stdout  # the grader cannot be signalled
    # nor its environment read: not even listed in the kernel's /proc
    assert "cell 6 raised FileNotFoundError" in proc.stdout
    assert "each kernel runs as a uid of its own" in proc.stdout


def test_kernel_kill_ends_a_daemon_that_left_the_session_without_root_isolation():
    # no unprivileged user (as a non-root grader): the daemon is orphaned to init, not to the
    # grader, so only the kernel's environment mark finds it
    from labkit.grading.session import KernelSession

    s = KernelSession(None)
    os.environ["LABKIT_TEST_MARK"] = MARK
    try:
        s.start()
    finally:
        del os.environ["LABKIT_TEST_MARK"]
    try:
        # its working folder is its own, on sys.path as in Jupyter (a module the notebook writes imports);
        # nothing comes from the user's site-packages, nor its IPython startup files and matplotlib rc from a
        # folder an earlier kernel of this user could write
        own = (f"import os, sys\nassert os.getcwd() == {s.work!r} and '' in sys.path, sys.path\n"
               "open('mine.py', 'w').write('X = 1')\nimport mine\nassert mine.X == 1\n"
               f"assert sys.flags.no_user_site\nassert os.environ['IPYTHONDIR'] == {s.dir + '/ipython'!r}\n"
               f"assert os.environ['MPLCONFIGDIR'] == {s.dir + '/mpl'!r}")
        assert s.execute(own, 20)[:2] == ("ok", ""), s.execute(own, 20)
        assert s.execute(DAEMON, 20)[0] == "ok"
        assert s.execute("while True:\n    pass", 1)[0] == "timeout"
        assert len(_marked_processes()) >= 2  # the kernel and the daemon
    finally:
        s.kill()
    deadline = time.monotonic() + 1
    while _marked_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _marked_processes() == []


# ----------------------------------------------------------------------------- claims the kernel used to make
# Submissions of notebook 00 whose 0.2 games how the ring is measured, with helper modules the learner
# writes to disk and imports (nothing refuses that): the relay's judgement holds on its own. 0.1 is right:
# honest score 2 of 6 each. (--no-source-policy is passed as old scripts do: accepted, no effect.)
RS = ("def reduce_scatter_by_hand(inputs):\n    return list(torch.stack(inputs).sum(dim=0).chunk(len(inputs)))\n"
      "check('0.1', reduce_scatter_by_hand)")
HEAD = "import sys\nimport torch\nfrom labkit import comm\nfrom labkit.grading import check\nsys.path.insert(0, '.')"
CLAIMS = {
    # a real collective, through an alias bound before any case runs (it used to pass, sending nothing)
    "alias": [HEAD, RS, "open('ringhelp.py', 'w').write('import torch.distributed as d\\npass_on = d.all_reduce\\n')\n"
                        "import ringhelp",
              "def ring_all_reduce(ctx, tensor):\n    ringhelp.pass_on(tensor)\n    return tensor\n"
              "check('0.2', ring_all_reduce)"],
    # the kernel-side helper rebound to return the right sums, and an answer that returns None
    "rebound": [HEAD, RS, "open('ringfix.py', 'w').write('import torch\\n"
                          "import labkit.grading.kernelside.nb00_distributed_primer as K\\n"
                          "K._run_ring = lambda ring, inputs, *a: [torch.stack(inputs).sum(0)] * len(inputs)\\n')\n"
                          "import ringfix",
                "def ring_all_reduce(ctx, tensor):\n    return None\ncheck('0.2', ring_all_reduce)"],
}


# the honest control in the same batch: the ring written with blocking comm.send/comm.recv as the exercise text
# says (the old source policy gave it 0: "`send` is not one of the labkit names notebook 00 gives you"), after
# a %timeit and a shell line; honest score 6 of 6
SEND_RING = ("def ring_all_reduce(ctx, tensor):\n    n, r = ctx.world_size, ctx.rank\n"
             "    chunks = list(torch.tensor_split(tensor, n))\n"
             "    def step(send_i, recv_i, add):\n        incoming = torch.empty_like(chunks[recv_i])\n"
             "        if r % 2 == 0:\n            comm.send(chunks[send_i], (r + 1) % n)\n"
             "            comm.recv(incoming, (r - 1) % n)\n        else:\n"
             "            comm.recv(incoming, (r - 1) % n)\n            comm.send(chunks[send_i], (r + 1) % n)\n"
             "        if add:\n            chunks[recv_i] += incoming\n        else:\n"
             "            chunks[recv_i].copy_(incoming)\n"
             "    for s in range(n - 1):\n        step((r - s) % n, (r - s - 1) % n, True)\n"
             "    for s in range(n - 1):\n        step((r + 1 - s) % n, (r - s) % n, False)\n"
             "    return tensor\ncheck('0.2', ring_all_reduce)")
HONEST = {"send": [HEAD, "%timeit -n 1 -r 1 sum(range(10))\n!echo hi", RS, SEND_RING]}


@pytest.fixture(scope="module")
def claims(user, tmp_path_factory):
    return _grade_batch(user, _folder(user, tmp_path_factory, "claims"), {**CLAIMS, **HONEST},
                        "00_distributed_primer", "--no-source-policy")


def test_a_send_recv_ring_as_the_exercise_text_says_earns_its_points(claims):
    results, proc = claims
    assert results["send"]["score"] == 6, (results["send"]["output"], proc.stdout[-3000:])


def _grade_batch(user, tmp, notebooks: dict, assignment: str, *extra: str):
    """Grade ``notebooks`` ({name: cells}) in one batch pinned to ``assignment``, as ``user`` (None: this
    test's): ({name: results}, proc)."""
    for name, cells in notebooks.items():
        write_notebook(tmp / f"{name}.ipynb", cells, notebook=assignment)
    proc = _run(user, [sys.executable, "-m", "labkit", "grade", *(str(tmp / f"{n}.ipynb") for n in notebooks),
                       "--assignment", assignment, "--results-dir", str(tmp / "out"), "--cell-timeout", "30",
                       *extra], cwd=tmp)
    outs = {f.name: f.read_text()[:3000] for f in sorted((tmp / "out").glob("*.json"))}   # what each result says
    assert proc.returncode == 0, (proc.stdout + proc.stderr, outs)
    return {n: json.loads((tmp / "out" / f"{n}.json").read_text()) for n in notebooks}, proc


@pytest.mark.parametrize("name", list(CLAIMS))
def test_a_ring_that_games_the_measurement_scores_its_honest_score(claims, name):
    results, proc = claims
    obj = results[name]
    assert obj["score"] == 2, (name, obj["output"], proc.stdout[-3000:])
    ring = [t for t in obj["tests"] if t["name"].startswith("Exercise 0.2")]
    assert ring[0]["score"] == 0 and "source policy" not in ring[0].get("output", ""), ring[0]
    # judged on what reached the grader's relay: no process group for the alias, no message for the rebinding
    why = {"alias": "process group", "rebound": "nothing that rank 0 received by send/recv carried them"}[name]
    assert any(why in t.get("output", "") for t in ring), ring


# ----------------------------------------------------------------------------- 13.1, judged on returned gradients
# Submissions of notebook 13 whose 13.1 attacks how its gradients are judged (returned values, with .grad
# preset, and what .grad holds after the call returned too); 13.3 is right in each, graded before the attack's
# cells: honest score 13.3's points. Nothing reads how the code is written: a .grad written shows in the data,
# labkit's reference is absent from the graded kernel however it is reached (a module on disk, builtins' exec,
# the kernel's shell), and a replaced kernel-side helper returns data that is judged like any answer.
_NB13 = json.loads((Path(__file__).parents[2] / "solutions" / "13_zero_bubble.ipynb").read_text())["cells"]
BUBBLE = next("".join(c["source"]) for c in _NB13 if "def bubble_time" in "".join(c["source"]))
HEAD13 = ["import sys\nimport torch\nfrom labkit.grading import check", BUBBLE, 'check("13.3", bubble_time)']
ONDISK = "sys.path.insert(0, '/tmp')\nopen('/tmp/{0}.py', 'w').write({1!r})\nimport {0}"
SPLIT = {
    # .grad cleared, then a plain .backward(): the returned values are right, what .grad held is lost
    "cleared": HEAD13 + ["def split_linear_backward(layer, x, grad_out):\n"
                         "    x.grad = layer.weight.grad = layer.bias.grad = None\n"
                         "    layer(x).backward(grad_out)\n"
                         "    return x.grad, layer.weight.grad, layer.bias.grad\ncheck('13.1', split_linear_backward)"],
    # labkit's reference (backward_input), from a module the notebook writes to disk
    "reference": HEAD13 + [ONDISK.format("ref13", "import torch\nfrom labkit.pipeline.split_backward import "
                                                  "backward_input\ndef split(layer, x, g):\n    out = layer(x)\n"
                                                  "    gi, _ = backward_input(out, x, g, [])\n"
                                                  "    return (gi, *torch.autograd.grad(out, [layer.weight, "
                                                  "layer.bias], g))\n"),
                           "def split_linear_backward(layer, x, grad_out):\n"
                           "    return ref13.split(layer, x, grad_out)\ncheck('13.1', split_linear_backward)"],
    # the checker's kernel side rebound (from a module on disk) to compute the gradients itself; the answer is None
    "patched": HEAD13 + [ONDISK.format("fix13", "import torch\nimport labkit.grading.kernelside.nb13_zero_bubble as K\n"
                                                "def run(fn, w, b, x, g, held):\n"
                                                "    w, b, x = (t.clone().requires_grad_(True) for t in (w, b, x))\n"
                                                "    out = torch.nn.functional.linear(x, w, b)\n"
                                                "    return torch.autograd.grad(out, [x, w, b], g)\n"
                                                "K._split_run = run\n"),
                         "def split_linear_backward(layer, x, grad_out):\n    return None\n"
                         "check('13.1', split_linear_backward)"],
}
# a third red team: labkit's reference kept where the answer reads it (a global box) by code outside the answer's
# closure that never names it: builtins' exec through len.__self__, the kernel's shell evaluating a string
BOX = "class Box:\n    pass\nbox = Box()\n"
BY_BOX = ("def split_linear_backward(layer, x, grad_out):\n    out = layer(x)\n"
          "    gi, _ = box.f(out, x, grad_out, [])\n"
          "    return (gi, *torch.autograd.grad(out, [layer.weight, layer.bias], grad_out))\n"
          "check('13.1', split_linear_backward)")
SPLIT.update({
    # builtins' exec, reached through a builtin's __self__, runs a string no cell shows
    "exec": HEAD13 + [BOX + "len.__self__.exec('from labkit.pipeline.split_backward import backward_input as _bi')\n"
                      "box.f = _bi", BY_BOX],
    # the kernel's own shell evaluates a string no cell shows
    "shell": HEAD13 + ["import IPython.display\nsh = IPython.core.interactiveshell.InteractiveShell.instance()\n" + BOX
                       + "box.f = sh.ev(\"__import__('labkit.pipeline.split_backward', fromlist=['x'])"
                         ".backward_input\")", BY_BOX],
})
_ABSENT = "backward_input (labkit.pipeline.split_backward) is withheld"
SPLIT_WHAT = {"cleared": "x.grad changed during the call", "reference": _ABSENT, "patched": "kernel-side code returned",
              "shell": _ABSENT, "exec": _ABSENT}


@pytest.fixture(scope="module")
def split_attacks(tmp_path_factory):
    # graded once, by this test's user (root: the reference is withheld only where the kernel has a uid of its own)
    return _grade_batch(None, tmp_path_factory.mktemp("split"), SPLIT, "13_zero_bubble")


@pytest.mark.parametrize("name", list(SPLIT))
def test_a_split_backward_that_games_its_judgement_scores_its_honest_score(split_attacks, name):
    results, proc = split_attacks
    obj = results[name]
    tests = {t["name"].split(" (")[0]: t for t in obj["tests"] if " - " not in t["name"]}
    assert tests["Exercise 13.3"]["score"] == tests["Exercise 13.3"]["max_score"] > 0, obj["output"]
    assert obj["score"] == tests["Exercise 13.3"]["max_score"], (name, obj["output"], proc.stdout[-3000:])
    split = tests["Exercise 13.1"]
    assert split["score"] == 0 and SPLIT_WHAT[name] in split["output"], split
