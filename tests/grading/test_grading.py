"""Course machinery: check() lines, time limits, hidden cases, strict mode, the Gradescope results
format, the autograder on a small notebook, and wrong answers for notebooks 00 and 01."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
import torch

from labkit import comm
from labkit.dist import launch
from labkit.grading import check, registry
from labkit.grading.grader import CaseGrade, ExerciseGrade, NotebookGrade, results_json, validate_results
from labkit.grading.registry import exercise, expect_close, expect_equal
from labkit.grading.runner import Case, CheckNotPassed, evaluate, run_case
from labkit.grading.testing import assert_check_fails, assert_check_passes

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- test exercises

T1 = exercise("T.1", title="double", notebook="zz_grading_test", points=3, hint="Multiply by two.")


@T1.case("x=2")
def _(f):
    expect_equal(f(2), 4, "f(2)")


@T1.case("x=-1.5")
def _(f):
    expect_close(f(-1.5), -3.0, "f(-1.5)")


@T1.case("secret", hidden=True)
def _(f):
    expect_equal(f(1000), 2000, "f(SECRET_INPUT_1000)")


T_SLOW = exercise("T.slow", title="slow", notebook="zz_grading_test", hint="Return quickly.")


@T_SLOW.case("quick enough", timeout=1)
def _(f):
    f()


def double(x):
    return 2 * x


# ----------------------------------------------------------------------------- check()


def test_check_prints_one_line_passed(capsys):
    res = check("T.1", double)
    out = capsys.readouterr().out
    assert out == "Exercise T.1 (double): passed, 3/3 cases.\n"
    assert res.status == "passed" and res.passed == 3 and res.total == 3 and bool(res)
    assert repr(res) == "CheckResult(exercise='T.1', status='passed', passed=3, total=3)"
    assert res._ipython_display_() is None  # a check() on a cell's last line adds no Out[] line


def test_check_failure_names_case_expected_got_and_hint(capsys):
    res = check("T.1", lambda x: x + 2)
    out = capsys.readouterr().out
    # issue 36: the verdict, the case, what was checked, expected/got and the hint on lines of their own
    assert out == ('Exercise T.1 (double): failed\n'
                   '  case "x=-1.5"\n'
                   '  f(-1.5):\n'
                   '  expected -3, got 0.5; got -0.1667 x the expected value.\n'
                   '  Hint: Multiply by two.\n')
    assert res.status == "failed"


def test_hidden_failure_reveals_nothing(capsys):
    res = check("T.1", lambda x: 2 * x if x < 100 else 0)
    line = capsys.readouterr().out
    assert line == ("Exercise T.1 (double): failed\n  a hidden case failed (2 of 3 cases passed; its details "
                    "are not shown).\n  Hint: Multiply by two.\n")
    assert "SECRET" not in line and "2000" not in line and "secret" not in line
    assert res.status == "failed"


def test_stub_is_not_attempted_and_exceptions_are_reported(capsys):
    def stub(x):
        raise NotImplementedError("Exercise T.1: double x")

    assert check("T.1", stub).status == "not_attempted"
    assert capsys.readouterr().out == "Exercise T.1 (double): not attempted (the stub still raises NotImplementedError).\n"  # noqa: E501
    res = check("T.1", lambda x: 1 / 0)
    assert "ZeroDivisionError: division by zero" in res.message


def test_strict_mode_raises(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    with pytest.raises(CheckNotPassed, match="failed"):
        check("T.1", lambda x: x)
    with pytest.raises(CheckNotPassed, match="not attempted"):
        check("T.1", lambda x: (_ for _ in ()).throw(NotImplementedError()))
    assert check("T.1", double).status == "passed"


def test_unknown_exercise_raises_keyerror():
    with pytest.raises(KeyError, match="no exercise 'nope'"):
        check("nope", double)


def test_learner_output_does_not_leak(capfd):
    def noisy(x):
        print("learner says hi")
        os.write(1, b"raw fd write\n")
        return 2 * x

    check("T.1", noisy)
    out = capfd.readouterr().out
    assert "learner" not in out and "raw fd" not in out
    assert out.count("\n") == 1


def test_messages_are_deterministic():
    lines = {evaluate("T.1", lambda x: x * 3).message for _ in range(3)}
    assert len(lines) == 1


# ----------------------------------------------------------------------------- time limits


def test_hanging_case_is_stopped_with_the_limit_named(capsys):
    t0 = time.monotonic()
    res = check("T.slow", lambda: time.sleep(60))
    assert time.monotonic() - t0 < 10
    assert res.status == "failed"
    assert "did not finish within the time limit of 1 s" in res.message


def _hang_in_ranks(pid_dir):
    def body(ctx):
        Path(pid_dir, f"rank{ctx.rank}").write_text(str(os.getpid()))
        time.sleep(60)

    launch(body, 2, timeout=60)


def test_timeout_kills_ranks_the_case_launched(tmp_path):
    case = Case("ranks hang", lambda answer: _hang_in_ranks(tmp_path), timeout=5)
    res = run_case(case, None)
    assert res.status == "failed" and "time limit of 5 s" in res.message
    pids = [int(p.read_text()) for p in tmp_path.glob("rank*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                    alive.append(pid)
            except (ProcessLookupError, FileNotFoundError):
                pass
        time.sleep(0.1)
    assert not alive, f"ranks {alive} outlived the stopped case"


# ----------------------------------------------------------------------------- hidden case files


def test_hidden_case_folder_adds_cases(tmp_path, monkeypatch):
    exercise("T.h", title="hidden extra", notebook="zz_grading_test", points=1)
    (tmp_path / "extra_cases.py").write_text(textwrap.dedent('''
        from labkit.grading.registry import exercise, expect_equal
        ex = exercise("T.h")

        @ex.case("instructor only")
        def _(f):
            expect_equal(f(7), 49, "f(7)")
    '''))
    monkeypatch.setenv("LABKIT_HIDDEN_CASES", str(tmp_path))
    registry.load_all(reload_hidden=True)
    cases = registry.get_exercise("T.h").cases
    assert [(c.name, c.hidden) for c in cases] == [("instructor only", True)]
    assert evaluate("T.h", lambda x: x * x).status == "passed"
    res = evaluate("T.h", lambda x: x + x)
    assert res.status == "failed" and "hidden case failed" in res.message and "49" not in res.message
    registry.load_all(reload_hidden=True)  # running the files again does not duplicate cases
    assert len(registry.get_exercise("T.h").cases) == 1


def test_registry_errors():
    with pytest.raises(ValueError, match="no exercise 'T.none'"):
        exercise("T.none")
    with pytest.raises(ValueError, match="already declared by notebook 'zz_grading_test'"):
        exercise("T.1", title="x", notebook="other")
    with pytest.raises(ValueError, match="needs notebook"):
        exercise("T.new", title="x")


# ----------------------------------------------------------------------------- results format


def _grade_fixture():
    ex = registry.get_exercise("T.1")
    cases = [CaseGrade("x=2", False, "passed", ""),
             CaseGrade("x=-1.5", False, "failed", "f(-1.5): expected -3, got 0.5"),
             CaseGrade("secret", True, "failed", "f(SECRET_INPUT_1000): expected 2000, got 0")]
    passed = ExerciseGrade(ex, "passed", "line", [CaseGrade(c.name, c.hidden, "passed", "") for c in cases])
    return [NotebookGrade("x.ipynb", "zz_grading_test", "", [ExerciseGrade(ex, "failed", "line", cases), passed])]


def test_results_json_is_gradescope_format():
    obj = results_json(_grade_fixture())
    validate_results(obj)
    # all or nothing: one case of three passing earns nothing; all three earn the 3 points
    assert obj["score"] == 3.0
    assert [t["name"] for t in obj["tests"][:4]] == [
        "Exercise T.1 (double)", "Exercise T.1 (double) - case: x=2", "Exercise T.1 (double) - case: x=-1.5",
        "Exercise T.1 (double) - hidden case: secret"]
    assert [t["visibility"] for t in obj["tests"][:4]] == ["visible", "visible", "visible", "after_published"]
    assert [t["status"] for t in obj["tests"]] == ["failed", "passed", "failed", "failed"] + ["passed"] * 4
    assert [(t["score"], t["max_score"]) for t in obj["tests"]] == [(0, 3), (0, 0), (0, 0), (0, 0),
                                                                     (3, 3), (0, 0), (0, 0), (0, 0)]
    assert obj["tests"][0]["output"] == "line (no points: all 3 cases must pass)"
    assert "SECRET" not in json.dumps(obj)
    assert obj["tests"][2]["output"] == "f(-1.5): expected -3, got 0.5"


@pytest.mark.parametrize("breakage, match", [
    (lambda o: o.pop("score"), "score"),
    (lambda o: o["tests"][0].update(status="ok"), "status"),
    (lambda o: o["tests"][0].update(visibility="public"), "visibility"),
    (lambda o: o["tests"][0].pop("max_score"), "max_score"),
    (lambda o: o["tests"][0].update(score=5.0), "outside"),
    (lambda o: o.update(score=2.0), "sum"),
    (lambda o: o["tests"][0].update(name=3), "name"),
])
def test_results_validator_rejects_broken_results(breakage, match):
    obj = results_json(_grade_fixture())
    breakage(obj)
    with pytest.raises(ValueError, match=match):
        validate_results(obj)


# ----------------------------------------------------------------------------- the grader, end to end

TINY_CASES = '''
import time
from labkit.grading.registry import exercise, expect_equal

ex = exercise("99.1", title="triple", notebook="99_tiny", points=2, hint="x + x + x")
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), 3, "f(1)")
@ex.case("x=5")
def _(f): expect_equal(f(5), 15, "f(5)")

ex = exercise("99.2", title="negate", notebook="99_tiny", points=2)
@ex.case("x=1", hidden=False)
def _(f): expect_equal(f(1), -1, "f(1)")
@ex.case("slow", hidden=False, timeout=1)
def _(f): f(None)

ex = exercise("99.3", title="never reached", notebook="99_tiny", points=1)
@ex.case("any", hidden=False)
def _(f): expect_equal(f(), 1, "f()")
'''


def test_grader_end_to_end(tmp_path):
    hidden = tmp_path / "cases"
    hidden.mkdir()
    (hidden / "tiny.py").write_text(TINY_CASES)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    srcs = [
        "from labkit.grading import check",
        "def triple(x):\n    return 3 * x\ncheck('99.1', triple)",
        "import time\ndef negate(x):\n    if x is None:\n        time.sleep(30)\n    return -x\ncheck('99.2', negate)",
        "raise RuntimeError('boom')",
        "check('99.3', lambda: 1)",
    ]
    nb.cells = [nbformat.v4.new_code_cell(s) for s in srcs]
    (tmp_path / "submission").mkdir()
    path = tmp_path / "submission" / "99_tiny.ipynb"  # the kernel runs in submission/
    nbformat.write(nb, str(path))
    results = tmp_path / "results.json"
    env = dict(os.environ, LABKIT_HIDDEN_CASES="cases", LABKIT_STRICT="1")  # relative to cwd
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(path), "--results", str(results)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(results.read_text())
    validate_results(obj)
    by_name = {t["name"]: t for t in obj["tests"]}
    five = by_name["Exercise 99.1 (triple) - hidden case: x=5"]  # hidden: the file's default
    assert five["status"] == "passed" and five["visibility"] == "after_published"
    slow = by_name["Exercise 99.2 (negate) - case: slow"]
    assert slow["status"] == "failed" and "time limit of 1 s" in slow["output"]
    assert by_name["Exercise 99.2 (negate) - case: x=1"]["status"] == "passed"
    assert by_name["Exercise 99.2 (negate)"]["score"] == 0  # all or nothing: "slow" failed
    assert by_name["Exercise 99.1 (triple)"]["score"] == 2
    after = by_name["Exercise 99.3 (never reached)"]  # a broken cell costs only itself
    assert after["score"] == 1 and after["status"] == "passed"
    assert math.isclose(obj["score"], 3.0)
    assert "99_tiny.ipynb (99_tiny): 3/5 points; cell 4 raised RuntimeError: boom" in proc.stdout
    assert "total 3/5 points" in proc.stdout


# ----------------------------------------------------------------------------- wrong answers, notebook 01


def test_nb01_right_answers_pass():
    def bubble(K, M):
        if K < 1 or M < 1:
            raise ValueError("K, M >= 1")
        return (K - 1) / (M + K - 1)

    assert_check_passes("1.1", bubble)
    assert_check_passes("1.2", lambda K, t: max(1, math.ceil((K - 1) / t - (K - 1) - 1e-12)))


def test_nb01_bubble_with_m_plus_k_fails():
    def wrong(K, M):
        if K < 1 or M < 1:
            raise ValueError("K, M >= 1")
        return (K - 1) / (M + K)

    assert_check_fails("1.1", wrong, contains='failed\n  case "K=4, M=8"\n  bubble_fraction(K=4, M=8):\n  '
                                              'expected 0.272727, got 0.25 (one slot too many in the step).\n  Hint:')


def test_nb01_bubble_without_input_check_fails():
    assert_check_fails("1.1", lambda K, M: (K - 1) / (M + K - 1) if M > 0 else 1.0,
                       contains="bubble_fraction(K=4, M=0): expected ValueError to be raised")


def test_nb01_smallest_m_wrong_answers_fail():
    # forgets the K-1 ramp: M = ceil((K-1)/target)
    assert_check_fails("1.2", lambda K, t: math.ceil((K - 1) / t), contains="expected 21, got 24")
    # closed form without the M >= 1 floor gives 0 for one stage
    assert_check_fails("1.2", lambda K, t: math.ceil((K - 1) / t - (K - 1)),
                       contains="smallest_microbatches(K=1, target=0.01): expected 1, got 0 (M=0 microbatches is "
                                "no schedule")


# ----------------------------------------------------------------------------- wrong answers, notebook 00


def _ring(ctx, tensor, gather_steps=None):
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        send_i, recv_i = (r - s) % n, (r - s - 1) % n
        buf = torch.empty_like(chunks[recv_i])
        req = comm.isend(chunks[send_i], right)
        comm.recv(buf, left)
        req.wait()
        chunks[recv_i] += buf
    for s in range(n - 1 if gather_steps is None else gather_steps(n)):
        send_i, recv_i = (r + 1 - s) % n, (r - s) % n
        req = comm.isend(chunks[send_i], right)
        comm.recv(chunks[recv_i], left)
        req.wait()
    return tensor


def test_nb00_right_answers_pass():
    assert_check_passes("0.1", lambda xs: list(torch.stack(xs).sum(0).chunk(len(xs))))
    assert_check_passes("0.2", _ring)


def test_nb00_reduce_scatter_without_sum_fails():
    assert_check_fails("0.1", lambda xs: [x.tensor_split(len(xs))[i] for i, x in enumerate(xs)],
                       contains="reduce_scatter_by_hand(inputs of 2 ranks x 6 elements)[0]: expected")


def test_nb00_ring_forgetting_last_step_fails():
    res = assert_check_fails("0.2", lambda ctx, t: _ring(ctx, t, gather_steps=lambda n: n - 2),
                             contains='case "N=2 ranks, 6 elements"\n  N=2, 6 elements: rank 0 ends with the '
                                      'complete sum in one chunk only')
    assert "the all-gather phase" in res.message and "does not reach chunk 0" in res.message  # the mistake, named


def test_nb00_ring_calling_all_reduce_fails():
    def cheat(ctx, t):
        return comm.all_reduce(t, ctx.group)

    assert_check_fails("0.2", cheat, contains="ring_all_reduce must use send/recv only, but it called all_reduce")


def test_nb00_ring_sending_whole_tensors_fails_the_public_traffic_case():
    def naive(ctx, t):  # correct sum, but (N-1) x the whole tensor per rank
        n = ctx.world_size
        out, cur = t.clone(), t.clone()
        for _ in range(n - 1):
            buf = torch.empty_like(cur)
            req = comm.isend(cur, (ctx.rank + 1) % n)
            comm.recv(buf, (ctx.rank - 1) % n)
            req.wait()
            out += buf
            cur = buf
        return out

    res = assert_check_fails("0.2", naive, contains="rank 0 sent 48 elements")
    sent = [c for c in res.cases if c.status == "failed"]
    assert [c.name for c in sent] == ["each rank sends 2(N-1)/N of the tensor (N=4, 16 elements)",
                                      "each rank sends 2(N-1)/N of the tensor (N=3, 12 elements)"]
    assert [c.hidden for c in sent] == [False, True]


def test_nb00_ring_deadlock_ends_with_readable_error():
    def deadlock(ctx, t):  # every rank waits to receive first
        buf = torch.empty_like(t)
        comm.recv(buf, (ctx.rank - 1) % ctx.world_size)
        return t

    res = evaluate("0.2", deadlock, stop_at_first_failure=True)
    assert res.status == "failed"
    assert "deadlock: no rank can go on" in res.message and "recv" in res.message, res.message


def test_broken_exercise_module_is_named_not_fatal(monkeypatch):
    monkeypatch.setitem(registry.IMPORT_ERRORS, "nb98_broken", "SyntaxError: invalid syntax (nb98_broken.py, line 3)")
    with pytest.raises(KeyError, match=r"exercise module nb98_broken failed to import \(SyntaxError"):
        registry.get_exercise("98.1")
    assert registry.get_exercise("T.1").title == "double"  # the others still work
