"""Launching N ranks, and the context that carries the process groups into every layer.

``launch(fn, world_size, *args)`` runs ``fn(ctx, *args)`` on ``world_size`` ranks and
returns the per-rank results in rank order. Three ways to get ranks:

* CPU (gloo): forked processes (cheap, and a notebook can launch a function it defined);
* GPU (NCCL): one spawned process per CUDA device (CUDA cannot be used after fork);
* under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set): this process *is* one rank;
  ``launch`` initialises from the environment, runs ``fn`` here and gathers every rank's result.

Each process group gets a ``timeout``, so a collective that can never complete (a wrong
schedule, a missing send) raises instead of hanging; the first rank to fail ends the launch with
:class:`RankError` naming it, and no worker outlives a launch. How (forking, signals, the reaper,
torchrun's faults) is in :mod:`labkit.launch`, which a learner need not read.

Process groups are passed in, never global: :class:`DistContext` travels into every layer, and
:class:`labkit.grid.ProcessGrid` (``make_grid``) lays the ranks out as Megatron's t x p x d grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .grid import ProcessGrid, make_grid
from .launch import (
    CLEANUP_DEADLINE,
    RankError,
    Terminated,
    in_torchrun,
    run_forked,
    run_torchrun_rank,
    stop_on_first_signal,
    terminate_as_exception,
    torchrun_env_problem,
    torchrun_where,
)

__all__ = [
    "Terminated",
    "stop_on_first_signal",
    "terminate_as_exception",
    "DistContext",
    "ProcessGrid",
    "RankError",
    "launch",
    "choose_backend",
    "make_grid",
    "in_torchrun",
    "torchrun_env_problem",
    "torchrun_where",
    "CLEANUP_DEADLINE",
]

DEFAULT_TIMEOUT = 30.0  # seconds a collective may wait before it raises


@dataclass
class DistContext:
    """What one rank knows about the launch: passed as the first argument to ``fn``.

    Fields: ``rank``, ``world_size``, ``local_rank`` (index of this rank's GPU on its
    node), ``backend`` ("gloo" or "nccl"), ``device`` (``torch.device`` tensors of this
    rank live on), ``group`` (the world process group), ``timeout`` (seconds).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    group: Any = None
    timeout: float = DEFAULT_TIMEOUT

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def new_group(self, ranks: Sequence[int]):
        """``dist.new_group`` with this launch's backend and timeout.

        Every rank must call it for every group, in the same order (a torch rule).
        """
        return dist.new_group(
            ranks=list(ranks), timeout=timedelta(seconds=self.timeout), backend=self.backend
        )


def choose_backend(world_size: int, backend: str = "auto") -> str:
    """Resolve ``backend``: "auto" picks NCCL when every rank can have its own CUDA
    device (and NCCL is built in), otherwise gloo on CPU.

    Raises ValueError for an unknown name or "nccl" without enough GPUs.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        if n_gpu >= world_size and dist.is_nccl_available():
            return "nccl"
        if in_torchrun() and n_gpu >= 1 and dist.is_nccl_available():
            return "nccl"  # several nodes: each process has its LOCAL_RANK GPU
        return "gloo"
    if backend == "nccl" and (n_gpu < 1 or not dist.is_nccl_available()):
        raise ValueError(
            f"backend='nccl' needs CUDA devices and NCCL; found {n_gpu} GPUs, "
            f"NCCL available={dist.is_nccl_available()}"
        )
    return backend


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
) -> list:
    """Run ``fn(ctx, *args)`` on ``world_size`` ranks; return the results in rank order.

    Args:
        fn: called as ``fn(ctx: DistContext, *args)`` on every rank. For CPU ranks it may
            be defined anywhere (forked); for CUDA ranks it must be importable (spawned).
        world_size: number of ranks, >= 1.
        backend: "auto" | "gloo" | "nccl" (see :func:`choose_backend`).
        timeout: seconds any collective or point-to-point operation may wait before it
            raises; a wrong schedule therefore fails within ``timeout`` plus a few seconds.

    Returns: ``[result_of_rank_0, ..., result_of_rank_{N-1}]`` (each result is pickled in
    the worker and unpickled here).

    Raises: ValueError (before any process starts) for ``world_size`` not an integer >= 1,
    ``fn`` not callable, ``timeout`` not a finite number > 0, or a bad backend;
    :class:`RankError` naming the first rank that failed and its original exception (a worker
    that died: its exit code or signal name, and the last lines of its stderr, which is also
    forwarded live to this process's stderr for forked workers). No worker is left alive after
    ``launch`` returns or raises; SIGTERM of this process while it waits raises
    :class:`Terminated` after stopping the workers and removing the rendezvous folder; after a
    SIGKILL of this process a reaper process removes that folder (Linux).

    Under ``torchrun`` this process is one rank: ``world_size`` must equal ``WORLD_SIZE``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {fn!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    backend = choose_backend(world_size, backend)
    if in_torchrun():
        return run_torchrun_rank(fn, world_size, args, backend, timeout, DistContext)
    return run_forked(fn, world_size, args, backend, timeout, DistContext)
