"""A Ctrl-C under torchrun reaches the ranks one by one: the agent signals its workers in turn, so a
rank whose peer already stopped loses its connection before its own signal comes. It must not report
that as a failure ("lost its connection to a peer"): the peer recorded ``stopped/<rank>`` in
torchrun's store before it exited, so the survivor waits for its own signal, bounded by a deadline
of the program's (``STOP_WAIT``), after which it stops with the stop's line naming the peer that the
signal reached. The order is forced, not left to timing: this test plays torchrun's agent (it serves
the store and starts three ranks), stops the last rank first, and signals rank 0 only once rank 0 has
recorded that it waits (after its 1 s peer check); rank 1 is never signalled and ends at its
deadline. A peer that dies without such a record is still a failure that names it
(test_torchrun_faults.py)."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

from procs import kill_groups, live_processes

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist
    import labkit.launch.torchrun as torchrun
    from labkit.dist import launch
    from labkit.labs import run_cli

    torchrun.STOP_WAIT = float(sys.argv[2])

    def fn(ctx, ready):
        open(os.path.join(ready, f"{ctx.rank}-{os.getpid()}"), "w").close()
        if ctx.rank < ctx.world_size - 1:
            dist.recv(torch.zeros(1), src=ctx.world_size - 1)   # blocked in a gloo receive from the last rank
        else:
            time.sleep(120)

    sys.exit(run_cli(lambda: launch(fn, int(os.environ["WORLD_SIZE"]), sys.argv[1], timeout=90)))
""")


def test_a_rank_whose_peer_was_stopped_first_waits_for_its_own_signal(tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    script, ready = tmp_path / "stop.py", tmp_path / "ready"
    script.write_text(SCRIPT)
    ready.mkdir()
    world, run_id = 3, "order"
    base = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0")
    stop_wait = {0: "60", 1: "0.5", 2: "60"}   # rank 1 is never signalled: it ends at its (short) deadline
    procs = [subprocess.Popen([sys.executable, str(script), str(ready), stop_wait[r]], stderr=subprocess.PIPE,
                              text=True, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), start_new_session=True)
             for r in range(world)]
    try:
        deadline = time.monotonic() + 120
        while len(os.listdir(ready)) < world and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        assert len(os.listdir(ready)) == world, [(p.poll(), p.stderr.read()[-2000:] if p.poll() is not None else "")
                                                 for p in procs]
        procs[2].send_signal(signal.SIGINT)             # the agent's first signal: the last rank stops
        err2 = procs[2].communicate(timeout=30)[1]
        # ranks 0 and 1 recorded that they end with the stop (each after its 1 s peer check), or ended
        while any(procs[r].poll() is None and not store.check([f"labkit/{run_id}/0/stopped/{r}"]) for r in (0, 1)) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGINT)         # the agent's later signal reaches rank 0 only now
        err0 = procs[0].communicate(timeout=30)[1]
        err1 = procs[1].communicate(timeout=30)[1]
    finally:
        kill_groups(procs)
    assert (procs[2].returncode, err2) == (130, "interrupted (Ctrl-C, SIGINT): rank 2 (node 0, local rank 2) "
                                                "stopped\n"), err2
    assert (procs[0].returncode, err0) == (130, "interrupted (Ctrl-C, SIGINT): rank 0 (node 0, local rank 0) "
                                                "stopped\n"), err0
    peer = f"rank 2 (node 0, local rank 2, host {socket.gethostname()})"
    assert (procs[1].returncode, err1) == (130, "interrupted (Ctrl-C, SIGINT): rank 1 (node 0, local rank 1) stopped "
                                                f"(the signal stopped its peer {peer}; none reached this rank within "
                                                "0.5 s)\n"), err1
    assert all(live_processes(pgid=p.pid) == [] for p in procs)
