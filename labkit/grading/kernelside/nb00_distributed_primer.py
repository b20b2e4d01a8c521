"""Kernel side of notebook 00_distributed_primer's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb00_distributed_primer` (what runs here and why: :mod:`labkit.grading.kernelside`).

The ring's ranks have no process group: their send/recv reach the grader's
:class:`~labkit.grading.relay.Relay`, whose log the case judges.
"""
from __future__ import annotations

import torch

from ..registry import CheckFailure
from ..relay import run_ranks

RING_TIMEOUT = 16.0  # seconds the learner's ranks may take in all (a deadlock the grader's relay reports at once)


def _p2p_refused(name: str) -> CheckFailure:
    return CheckFailure(f"ring_all_reduce must use send/recv only, but it called {name}")


def _ring_rank(ctx, ring_all_reduce, inputs):
    x = inputs[ctx.rank].clone()
    out = ring_all_reduce(ctx, x)
    if out is None:
        out = x  # reduced in place
    if not isinstance(out, torch.Tensor):
        raise CheckFailure(f"ring_all_reduce returned {type(out).__name__}, not a tensor")
    return out.detach().clone()


def _run_ring(ring_all_reduce, inputs, relay_address):
    """Kernel side: the learner's ring on len(inputs) ranks talking through the grader's relay at
    ``relay_address``; each rank's output. The sum it must reproduce, and what its messages
    must be, are the grader's."""
    return run_ranks(_ring_rank, len(inputs), relay_address, ring_all_reduce, inputs, refuse=_p2p_refused,
                     timeout=RING_TIMEOUT)
