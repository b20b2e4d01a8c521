"""Process plumbing behind :func:`labkit.dist.launch`: forking ranks, torchrun, signals, the reaper.

A learner need not read this module: :mod:`labkit.dist` (``launch``, ``DistContext``) and
:mod:`labkit.grid` (``ProcessGrid``) are the API. What happens here:

* CPU (gloo): ranks are forked (~0.1 s per rank instead of ~10 s for ``spawn``, and a notebook
  can launch a function it defined in a cell); GPU (NCCL): one spawned process per CUDA device.
  They meet through a FileStore in a private folder ``labkit-store-*`` under the temporary
  directory, removed whatever ends the launch (below).
* Failure: the first rank to fail ends the launch with :class:`RankError`, naming the rank and
  carrying its traceback (or, for a worker killed by a signal or a native abort, its exit code or
  signal name and the last lines of its stderr); every other worker is terminated and joined.
* Faults of the parent: forked workers die with it whatever kills it (Linux ``PR_SET_PDEATHSIG``);
  SIGTERM / Ctrl-C stop every worker and remove the folder (SIGTERM raises :class:`Terminated`);
  a clean-up that takes longer than ``CLEANUP_DEADLINE`` seconds is cut short by a watchdog that
  SIGKILLs every worker; a SIGKILLed parent's folder is removed by a small reaper process in its
  own session (so that a ``killpg`` of the parent's group, as the grader's, does not take it too).
* Under ``torchrun`` this process is one rank (:func:`run_torchrun_rank`): it dies with its
  torchrun agent (a lost node takes its workers with it), stops within moments on SIGTERM even
  while blocked in C++ (one line, exit 143), and a rank whose work raised prints one line naming
  itself by global rank and node and, when a peer is gone, that peer by global rank and node
  (each rank's heartbeat in torchrun's store tells which), then exits 1. A rank stopped by a signal
  records it in that store before it exits, so that a peer that loses it before its own signal comes
  (the agent signals its workers one by one) waits for that signal, at most ``STOP_WAIT`` s, instead
  of reporting a failure; a peer that dies without that record is still a failure naming it.
"""
from __future__ import annotations

from .errors import RankError
from .forked import CLEANUP_DEADLINE, run_forked
from .signals import Terminated, stop_on_first_signal, terminate_as_exception
from .torchrun import in_torchrun, run_torchrun_rank, torchrun_env_problem, torchrun_where

__all__ = [
    "CLEANUP_DEADLINE",
    "RankError",
    "Terminated",
    "in_torchrun",
    "run_forked",
    "run_torchrun_rank",
    "stop_on_first_signal",
    "terminate_as_exception",
    "torchrun_env_problem",
    "torchrun_where",
]
