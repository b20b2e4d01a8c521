"""Kernel side of notebook 00_distributed_primer's exercises: the code that runs next to the learner's
code (``answer.run(fn, ...)`` in the cases of :mod:`labkit.grading.exercises.nb00_distributed_primer`).

It lives outside ``labkit.grading.exercises`` because the graded kernel cannot read that
package (:mod:`labkit.grading.session`); nothing here computes an expected value.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ...dist import launch
from ..registry import CheckFailure


RING_TIMEOUT = 8.0  # seconds a send/recv of the learner's ring may wait


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "all_to_all", "all_to_all_single", "broadcast", "reduce", "all_reduce_coalesced")


@contextlib.contextmanager
def _p2p_only(counter: dict):
    """Inside a rank: collectives raise; send/isend count the elements they send."""
    saved = []

    def forbid(name):
        def f(*a, **k):
            raise CheckFailure(f"ring_all_reduce must use send/recv only, but it called {name}")
        return f

    def counting(fn):
        def f(tensor, *a, **k):
            counter["elements"] += tensor.numel()
            return fn(tensor, *a, **k)
        return f

    for mod in (dist, c10d):
        for name in _COLLECTIVES:
            if hasattr(mod, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, forbid(name))
    # one wrapper object for both modules: dist.P2POp accepts only c10d's current isend
    send, isend = counting(c10d.send), counting(c10d.isend)
    for mod in (dist, c10d):
        saved += [(mod, "send", getattr(mod, "send")), (mod, "isend", getattr(mod, "isend"))]
        mod.send, mod.isend = send, isend
    try:
        yield counter
    finally:
        for mod, name, fn in reversed(saved):
            setattr(mod, name, fn)


def _ring_rank(ctx, ring_all_reduce, inputs):
    x = inputs[ctx.rank].clone()
    counter = {"elements": 0}
    with _p2p_only(counter):
        out = ring_all_reduce(ctx, x)
    if out is None:
        out = x  # reduced in place
    if not isinstance(out, torch.Tensor):
        raise CheckFailure(f"ring_all_reduce returned {type(out).__name__}, not a tensor")
    return {"output": out.detach().clone(), "sent": counter["elements"]}


def _run_ring(ring_all_reduce, inputs):
    """Kernel side: the learner's ring on len(inputs) gloo ranks; per rank its output and the
    number of elements it sent. The sum it must reproduce is computed by the grader."""
    # 8 s: a deadlocked answer fails within the case's 20 s limit with the rank's own
    # "timed out" error, while a right answer never waits that long even on a loaded machine
    return launch(_ring_rank, len(inputs), ring_all_reduce, inputs, timeout=RING_TIMEOUT)
