"""Ctrl-C under torchrun (issue 37). A terminal's Ctrl-C reaches torchrun's agent, which passes it
on to its workers as SIGINT (they run in sessions of their own) and SIGKILLs them only after 30 s.
Every rank must end within seconds with ONE line naming itself, even while blocked in a gloo
receive (C++: no Python handler runs); during start-up (before the rank joins its process group)
the node prints one line, not a KeyboardInterrupt traceback per rank. The bound is the program's:
the workers end on the signal itself, not on a timeout."""
import os
import signal
import textwrap
import time

from procs import live_processes
from test_torchrun_faults import SCRIPT as AT_WORK  # at work: rank 0 blocked in a gloo receive (C++)
from test_torchrun_faults import _labkit_lines, _port, _torchrun

# start-up: labkit imported (as `-m labkit...` does first), torch not yet; the rank waits where a slow import would
STARTING = textwrap.dedent("""
    import os, sys, time
    import labkit  # noqa: F401
    open(os.path.join(sys.argv[1], f"{os.environ['RANK']}-{os.getpid()}"), "w").close()
    time.sleep(120)
    import torch  # noqa: F401
""")


def test_ctrl_c_under_torchrun_ends_every_rank_with_one_line(tmp_path):
    runs = {}
    for name, text in (("work", AT_WORK), ("start", STARTING)):
        script, ready = tmp_path / f"{name}.py", tmp_path / name
        script.write_text(text)
        ready.mkdir()
        runs[name] = (ready, _torchrun(script, ready, "--nproc-per-node", "2", "--master-port", _port()))
    try:
        deadline = time.monotonic() + 150
        for name, (ready, p) in runs.items():
            while len(os.listdir(ready)) < 2 and time.monotonic() < deadline and p.poll() is None:
                time.sleep(0.1)
            assert len(os.listdir(ready)) == 2, (name, p.poll(), p.stderr.read()[-3000:] if p.poll() is not None
                                                 else "")
        workers = {name: [int(f.split("-")[1]) for f in os.listdir(ready)] for name, (ready, _) in runs.items()}
        t0 = time.monotonic()
        for _, p in runs.values():
            os.killpg(p.pid, signal.SIGINT)        # what a terminal's Ctrl-C does (torchrun's foreground group)
        results = {name: p.communicate(timeout=60) for name, (_, p) in runs.items()}
        took = time.monotonic() - t0
        assert took < 15, took                     # seconds, not torchrun's 30 s grace and SIGKILL
        for name, (_, p) in runs.items():
            assert live_processes(pgid=p.pid) == [], name
            assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
                       for pid in workers[name]), name
            assert "KeyboardInterrupt" not in results[name][1] or "/labkit/" not in results[name][1]
        err = results["work"][1]
        assert sorted(ln for ln in err.splitlines() if ln.startswith("interrupted (")) == [
            "interrupted (Ctrl-C, SIGINT): rank 0 (node 0, local rank 0) stopped",
            "interrupted (Ctrl-C, SIGINT): rank 1 (node 0, local rank 1) stopped"], err[-3000:]
        assert _labkit_lines(err) == [] and "no rank is left running" not in err, err[-3000:]
        err = results["start"][1]
        lines = [ln for ln in err.splitlines() if "labkit" in ln or ln.startswith(("interrupted", "Traceback"))
                 and "torch/distributed" not in ln]
        assert [ln for ln in err.splitlines() if ln.startswith("interrupted (")] == [
            "interrupted (Ctrl-C, SIGINT) during start-up: the 2 ranks of node 0 stopped before any work"], err[-3000:]
        assert "File \"" + str(tmp_path) not in err, lines   # no worker traceback
    finally:
        for _, p in runs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def test_a_rank_stopped_by_a_signal_removes_the_file_it_was_writing(tmp_path):
    """The stop watcher ends the rank with os._exit (no finally block runs): a temporary file that
    labkit.labs.write_bytes_atomic was writing is removed first. A signal not from the agent (here,
    from `kill`, not from the test that started it) during start-up names this rank alone."""
    import subprocess
    import sys
    part = tmp_path / ".losses.csv.1.tmp"
    code = textwrap.dedent(f"""
        import os, time
        import labkit
        from labkit.launch.torchrun import PENDING_FILES
        open({str(part)!r}, "w").close()
        PENDING_FILES.add({str(part)!r})
        open({str(tmp_path / 'ready')!r}, "w").close()
        time.sleep(60)
    """)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", TORCHELASTIC_RUN_ID="t", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=_port())
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        subprocess.run(["kill", "-TERM", str(p.pid)], check=True)   # from a process that is not its agent
        err = p.communicate(timeout=20)[1]
    finally:
        p.kill()
    assert p.returncode == 143 and not part.exists(), (p.returncode, err)
    assert err == "terminated (SIGTERM) during start-up: rank 0 (local rank 0) stopped before any work\n", err
