"""The launcher: results in rank order, errors that name the rank, no hangs, no leftovers."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from procs import live_processes

from labkit import comm
from labkit.dist import RankError, choose_backend, launch, make_grid


def _children_alive():
    """PIDs of this process's live children (zombies excluded)."""
    return live_processes(ppid=os.getpid())


def _rank_info(ctx, scale):
    x = torch.full((3,), float(ctx.rank + 1))
    comm.all_reduce(x, group=ctx.group)
    return ctx.rank, ctx.world_size, x.tolist(), scale


def test_launch_returns_results_in_rank_order():
    out = launch(_rank_info, 4, 10)
    assert [o[0] for o in out] == [0, 1, 2, 3]
    assert all(o[1] == 4 and o[3] == 10 for o in out)
    assert all(o[2] == [10.0, 10.0, 10.0] for o in out)  # 1+2+3+4


def test_launch_four_ranks_is_fast():
    launch(_rank_info, 4, 0)  # warm
    t0 = time.perf_counter()
    launch(_rank_info, 4, 0)
    assert time.perf_counter() - t0 < 2.0


def _fails_on_rank_2(ctx):
    if ctx.rank == 2:
        raise ValueError("bad value on purpose")
    x = torch.ones(2)
    dist.all_reduce(x)
    return 1


def test_exception_names_rank_and_original_error():
    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        launch(_fails_on_rank_2, 4, timeout=5)
    e = info.value
    assert e.rank == 2 and e.exc_type == "ValueError"
    assert "rank 2" in str(e) and "bad value on purpose" in str(e)
    assert time.perf_counter() - t0 < 5 + 3
    assert _children_alive() == []


def _mutual_recv(ctx):
    x = torch.zeros(4)
    dist.recv(x, src=(ctx.rank + 1) % ctx.world_size)  # everyone waits: a deadlock
    return 0


def test_deadlock_times_out_with_rank_error_and_no_leftovers():
    t0 = time.perf_counter()
    with pytest.raises(RankError) as info:
        launch(_mutual_recv, 3, timeout=2)
    assert "rank" in str(info.value)
    assert "Timed out" in str(info.value) or "timed out" in str(info.value).lower()
    assert time.perf_counter() - t0 < 2 + 4
    assert _children_alive() == []


def _dies(ctx):
    if ctx.rank == 1:
        os._exit(3)
    time.sleep(0.5)
    return 0


def test_worker_that_dies_is_reported():
    with pytest.raises(RankError) as info:
        launch(_dies, 2, timeout=3)
    assert info.value.rank == 1 and "exit" in str(info.value)
    assert _children_alive() == []


def _aborts(ctx):
    if ctx.rank == 1:
        import faulthandler
        faulthandler.disable()  # pytest's dump would only add noise to the test log
        print("rank 1: about to abort on purpose", file=sys.stderr, flush=True)
        os.abort()  # what a native (C++) abort does: SIGABRT, no Python traceback
    time.sleep(0.5)
    return 0


def test_worker_killed_by_a_signal_is_reported_with_its_name_and_stderr(capfd):
    with pytest.raises(RankError) as info:
        launch(_aborts, 2, timeout=3)
    e = info.value
    assert e.rank == 1 and e.exc_type == "ProcessDied"
    assert "signal SIGABRT (a native abort)" in str(e).splitlines()[0]
    assert "last lines of rank 1's stderr:\nrank 1: about to abort on purpose" in str(e)
    assert "rank 1: about to abort on purpose" in capfd.readouterr().err  # forwarded live, too
    assert _children_alive() == []


@pytest.mark.parametrize("ws", [0, -1, 2.0, True])
def test_bad_world_size(ws):
    with pytest.raises(ValueError, match="world_size"):
        launch(_rank_info, ws, 0)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "5"])
def test_bad_timeout_and_fn(timeout):
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0"):
        launch(_rank_info, 2, 0, timeout=timeout)
    with pytest.raises(ValueError, match="fn must be callable, got True"):
        launch(True, 2)


def test_backend_choice_on_cpu():
    assert choose_backend(4, "auto") == "gloo"
    with pytest.raises(ValueError, match="backend"):
        choose_backend(2, "mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl"):
            choose_backend(2, "nccl")


def _grid_groups(ctx):
    g = make_grid(ctx, tp=2, pp=2, dp=2)
    out = {}
    for name, grp in (("tp", g.tp_group), ("dp", g.dp_group), ("pp", g.pp_group)):
        members = torch.zeros(ctx.world_size)
        members[ctx.rank] = 1
        dist.all_reduce(members, group=grp)
        out[name] = [i for i, m in enumerate(members.tolist()) if m]
    return out, (g.tp_rank, g.dp_rank, g.pp_rank), g.pp_ranks


def test_grid_rank_order_tp_innermost_pp_outermost():
    res = launch(_grid_groups, 8)
    # rank = pp*4 + dp*2 + tp
    groups, coords, pp_ranks = res[5]
    assert coords == (1, 0, 1)
    assert groups["tp"] == [4, 5]
    assert groups["dp"] == [5, 7]
    assert groups["pp"] == [1, 5] == pp_ranks
    assert res[0][0]["tp"] == [0, 1] and res[0][0]["dp"] == [0, 2] and res[0][0]["pp"] == [0, 4]


def _bad_grid(ctx):
    make_grid(ctx, tp=3, pp=1, dp=1)


def test_grid_that_does_not_fit_raises_before_communication():
    with pytest.raises(RankError, match=r"tp=3 \* dp=1 \* pp=1 = 3 must equal world_size=2"):
        launch(_bad_grid, 2, timeout=3)


def test_same_code_under_torchrun(tmp_path):
    script = tmp_path / "tr.py"
    script.write_text(textwrap.dedent("""
        import torch
        from labkit import comm
        from labkit.dist import launch
        def fn(ctx):
            x = torch.tensor([float(ctx.rank + 1)])
            comm.all_reduce(x, group=ctx.group)
            return ctx.rank, x.item()
        out = launch(fn, 2)
        import os
        if os.environ["RANK"] == "0":
            print("RESULT", out)
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "RESULT [(0, 3.0), (1, 3.0)]" in p.stdout


def test_doctor_cli():
    p = subprocess.run([sys.executable, "-m", "labkit", "doctor"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert "torch" in p.stdout and "auto backend for world size 4: gloo" in p.stdout


def test_a_launch_that_fails_before_its_ranks_start_leaves_no_folder(tmp_path, monkeypatch):
    """The second rank cannot be started (fork refused, as under a process limit): the error comes
    out, the first rank and the folder's reaper are gone, and so is the rendezvous folder."""
    import multiprocessing.context
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = multiprocessing.context.ForkProcess.start
    started = []

    def start(self):
        if started:
            raise OSError(11, "injected: fork refused")
        started.append(self)
        real(self)
    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", start)
    with pytest.raises(OSError, match="injected"):
        launch(_rank_info, 2, 0, timeout=5)
    assert os.listdir(tmp_path) == []
    assert _children_alive() == []


@pytest.mark.parametrize("after", [0.0, 0.1], ids=["at-fork", "before-set-up"])
def test_a_sigterm_to_a_rank_just_forked_kills_it_and_never_runs_the_launchers_code(tmp_path, monkeypatch, after):
    """A rank SIGTERMed the moment it is forked (as the clean-up of a failed launch does, or a
    ``kill`` from outside), before it reached its own signal set-up: it dies of SIGTERM.
    ``at-fork``: the signal lands before Python's after-fork code, which drops pending Python-level
    signals: the rank used to survive it. ``before-set-up``: the launcher's SIGTERM handler
    (inherited by fork) ran in the child and raised before multiprocessing's child code took
    over, which sent the forked copy of the caller (a pytest worker) back into the caller's own
    code. Here the child is held 0.3 s right after fork; a handler run in it ends it with exit
    code 86."""
    import signal
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_fork = os.fork

    def slow_child_fork():
        if not sys._getframe(1).f_code.co_filename.endswith("popen_fork.py"):
            return real_fork()  # the folder's reaper
        pid = real_fork()
        if pid == 0:
            try:
                time.sleep(0.3)  # a loaded machine: the child is not scheduled yet
            except BaseException:
                os._exit(86)  # the parent's handler ran in the child
            return 0
        time.sleep(after)
        os.kill(pid, signal.SIGTERM)
        return pid

    monkeypatch.setattr(os, "fork", slow_child_fork)
    with pytest.raises(RankError) as err:
        launch(_rank_info, 2, 0, timeout=5)
    assert "signal SIGTERM" in str(err.value) and "exit code 86" not in str(err.value), str(err.value)
    assert os.listdir(tmp_path) == []
    assert _children_alive() == []


def test_ctrl_c_just_after_the_folder_is_made_leaves_no_folder(tmp_path, monkeypatch):
    """A Ctrl-C landing the moment the rendezvous folder exists (before the launch knows its name):
    KeyboardInterrupt comes out, and neither the folder nor its reaper is left."""
    import signal
    import tempfile

    import labkit.launch.forked as forked
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = forked._rendezvous_folder

    def made_then_interrupted():
        path = real()
        os.kill(os.getpid(), signal.SIGINT)
        return path
    monkeypatch.setattr(forked, "_rendezvous_folder", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(_rank_info, 2, 0, timeout=5)
    assert os.listdir(tmp_path) == []
    assert _children_alive() == []


def test_ctrl_c_as_a_rank_is_forked_leaves_no_rank(tmp_path, monkeypatch):
    """A Ctrl-C landing the moment a rank was forked (before the launch has it in the list that its clean-up
    kills): KeyboardInterrupt comes out, and no rank is left running (rank 0 waited for its peer until the
    timeout), no folder."""
    import multiprocessing.context
    import signal
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real = multiprocessing.context.ForkProcess.start

    def started_then_interrupted(self):
        real(self)
        os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", started_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch(_rank_info, 2, 0, timeout=30)
    assert _children_alive() == []
    assert os.listdir(tmp_path) == []


def _stub_body(ctx, x):
    return _learner_stub(x)


def _learner_stub(x):
    raise NotImplementedError("Exercise 0.2: write ring_all_reduce")


def test_a_rank_error_shows_the_learners_frames_and_message_in_ipython():
    """Issue 36: a notebook showed 43 lines of launcher internals before the stub's message."""
    import os

    from labkit.dist import RankError, launch

    with pytest.raises(RankError) as info:
        launch(_stub_body, 2, 1, timeout=20)
    shown = info.value._render_traceback_()  # what IPython prints instead of the traceback
    text = "\n".join(shown)
    assert len(shown) <= 12, text
    assert shown[-2] == "NotImplementedError: Exercise 0.2: write ring_all_reduce", text
    assert "in _learner_stub" in text and 'raise NotImplementedError("Exercise 0.2' in text, text
    assert os.path.basename(__file__) in text  # the learner's frames: the caller's and the rank's
    assert "labkit/launch" not in text and "multiprocessing" not in text, text
    assert "rank 0" in shown[0] or "rank 1" in shown[0], text
    assert "NotImplementedError" in info.value.remote_traceback  # the whole traceback is still there
