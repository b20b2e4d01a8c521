"""Data parallelism with bucketed all-reduces that overlap the backward pass.

Every DP rank holds the whole model (or, combined with TP/PP, its whole shard) and trains on
its own slice of the global batch: with d ranks and a global batch of B sequences, DP rank r
takes rows ``r*B/d .. (r+1)*B/d - 1``. The gradient of the global-batch mean loss is then the
*average* of the d local gradients (each a local-batch mean), so after backward every rank
holds ``(g_0 + ... + g_{d-1}) / d`` and takes the same optimizer step.

How the average is computed (PyTorch DDP, Li et al. 2020, "PyTorch Distributed", sec. 3.2):

1. parameters are grouped into *buckets* of at most ``bucket_cap_mb`` MiB, in reverse order of
   registration (roughly the order in which backward produces their gradients);
2. a hook on each parameter (``register_post_accumulate_grad_hook``) fires when its gradient is
   ready; when a bucket's last gradient is ready the bucket is copied into one flat buffer and
   an *asynchronous* all-reduce is started, while backward goes on computing the gradients of
   earlier layers. Buckets start in index order on every rank (collectives must be issued in
   the same order everywhere);
3. at the end of backward (a callback queued on the autograd engine) every all-reduce is
   waited for, divided by d and copied back into ``param.grad``. When some parameter got no
   gradient yet (a zero-bubble W that runs several backward calls, or an unused parameter) the
   sync stays open until the rest arrives or :meth:`DistributedDataParallel.finish_grad_sync`.

What a ring all-reduce costs: each rank sends and receives ``2(d-1)/d`` of the buffer's bytes
(reduce-scatter then all-gather; Patarasuk & Yuan 2009). :class:`labkit.comm.CommLog` counts
the payload (the bucket's bytes; ``CommLog.wire_bytes`` the ring's); the planner
(:func:`labkit.plan.comm.comm_per_rank`) predicts both numbers.

``no_sync()``: inside it the hooks do nothing, gradients accumulate locally (gradient
accumulation over microbatches); the first backward outside it reduces the accumulated sum.

Overlap measurement: for each bucket the launch time and, through the work's future, the
completion time are recorded; :attr:`DistributedDataParallel.last_overlap` says which share of
the time the all-reduces were in flight lies before the end of backward (hidden behind it).
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .flat import NoSyncMixin  # DDP's bucket rule (one home: flat.py)
from .flat import bucket_groups as assign_buckets

__all__ = ["DistributedDataParallel", "broadcast_parameters", "assign_buckets", "overlap_share"]


def _group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


@torch.no_grad()
def broadcast_parameters(module: nn.Module, process_group=None, buffers: bool = True) -> None:
    """Copy every parameter (and buffer) of DP rank 0 to the other ranks of ``process_group``,
    so that all replicas start equal (what DDP does at construction). One broadcast per tensor."""
    src = _group_ranks(process_group)[0]
    tensors = list(module.parameters()) + (list(module.buffers()) if buffers else [])
    for t in tensors:
        comm.broadcast(t.data, src=src, group=process_group)


def overlap_share(intervals: list[tuple[float, float]], backward_end: float) -> float:
    """Share of the time covered by ``intervals`` ([start, end] of each all-reduce, seconds)
    that lies before ``backward_end``: 1.0 = fully hidden behind backward, 0.0 = fully exposed."""
    if not intervals:
        return 0.0
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in merged)
    hidden = sum(max(0.0, min(b, backward_end) - a) for a, b in merged)
    return hidden / total if total > 0 else 0.0


class _Bucket:
    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype, device=params[0].device)
        self.ready = 0
        self.work = None
        self.times = [0.0, 0.0]


class DistributedDataParallel(NoSyncMixin, nn.Module):
    """``DistributedDataParallel(module, process_group=None, bucket_cap_mb=25.0)`` as in torch.

    Args:
        module: the replica (on this rank's device). Its parameters are broadcast from the
            group's rank 0 at construction.
        process_group: the DP group (d ranks); None: the default group.
        bucket_cap_mb: largest bucket in MiB (2**20 bytes); a parameter larger than the cap gets
            a bucket of its own.
        expert_params: names (in ``module``) of parameters that differ across the DP ranks
            (expert parallelism folded onto the DP axis): they are NOT all-reduced, only scaled
            by 1/d, the DP mean of the loss (Megatron-Core's expert gradient scaling; their
            gradient already sums every rank's tokens through the backward all-to-all). The
            scaling is a tensor hook on each contribution, before it is accumulated (also under
            :meth:`no_sync`), so it does not depend on how many autograd runs a backward is
            split into nor on whether the experts' gradients come after the buckets completed
            (a zero-bubble W runs one autograd call per boundary node: issue 17).
        broadcast_buffers: broadcast buffers too at construction.

    ``forward(*args, **kwargs)`` calls ``module``. After each backward outside :meth:`no_sync`
    every ``param.grad`` holds the DP average. Raises ValueError for ``bucket_cap_mb <= 0`` or
    parameters of different dtypes/devices (before any communication).
    Measurements after each synchronised backward: ``last_overlap`` (share hidden, 0..1),
    ``last_intervals`` (per bucket (start, end) seconds on ``time.perf_counter``),
    ``last_backward_end``.
    """

    def __init__(self, module: nn.Module, process_group=None, bucket_cap_mb: float = 25.0,
                 expert_params: Iterable[str] = (), broadcast_buffers: bool = True):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.module = module
        self.process_group = process_group
        self.bucket_cap_mb = bucket_cap_mb
        self.d = dist.get_world_size(process_group)
        self.require_backward_grad_sync = True
        experts = set(expert_params)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        unknown = experts - {n for n, _ in named}
        if unknown:
            raise ValueError(f"expert_params {sorted(unknown)} are not parameters of the module")
        self.expert_params = [p for n, p in named if n in experts]
        params = [p for n, p in named if n not in experts]
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("all parameters must share one dtype and device: "
                             f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
        # broadcast from DP rank 0 (replicated parameters only: experts differ by design)
        replicated = {id(p) for p in params}
        src = _group_ranks(process_group)[0]
        with torch.no_grad():
            for p in module.parameters():
                if id(p) in replicated:
                    comm.broadcast(p.data, src=src, group=process_group)
            if broadcast_buffers:
                for b in module.buffers():
                    comm.broadcast(b.data, src=src, group=process_group)
        # buckets in reverse registration order, each at most bucket_cap_mb
        order = list(reversed(params))
        groups = [[order[i] for i in g] for g in assign_buckets([p.numel() * p.element_size() for p in order],
                                                                 bucket_cap_mb)]
        self.buckets = [_Bucket(i, g) for i, g in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next = 0
        self._callback_queued = False
        self.last_overlap, self.last_intervals, self.last_backward_end = 0.0, [], 0.0
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)
        for p in self.expert_params:
            p.register_hook(self._expert_hook)

    def forward(self, *args, **kwargs):
        if self.require_backward_grad_sync and self._in_progress():
            missing = [n for n, p in self.module.named_parameters()
                       if id(p) in self._bucket_of and not self._bucket_of[id(p)].work
                       and p.requires_grad]
            raise RuntimeError(
                "DistributedDataParallel: the last synchronised backward left the gradient sync open: some "
                f"parameters got no gradient ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}); "
                "call finish_grad_sync() after backward (it counts them as zero) or use every parameter")
        return self.module(*args, **kwargs)

    # ----------------------------------------------------------------- hooks

    def _queue_finalize(self):
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _expert_hook(self, grad: torch.Tensor) -> torch.Tensor:
        # each contribution / d before accumulation: the sum is the DP mean whatever the order
        return grad / self.d

    def _hook(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return
        self._queue_finalize()
        bucket = self._bucket_of[id(p)]
        bucket.ready += 1
        # start every consecutive full bucket, in index order (the same order on every rank)
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        # one copy of the bucket's gradients into its flat buffer, 1/d folded in (the all-reduce
        # then sums means); a parameter without a gradient counts as zero
        torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in b.params],
                  out=b.buffer)
        b.buffer.div_(self.d)
        b.times = [time.perf_counter(), None]
        b.work = comm.all_reduce(b.buffer, self.process_group, async_op=True)

        def done(_fut, times=b.times):
            times[1] = time.perf_counter()
        b.work.get_future().then(done)

    def _in_progress(self) -> bool:
        return self._next > 0 or any(b.ready for b in self.buckets)

    def _finalize(self) -> None:
        """End of an autograd run. When every bucket has started: wait for them, write
        ``buffer / d`` back into the gradients. Otherwise the sync stays open: a zero-bubble
        W runs several backward calls, and the rest of the gradients come in the next ones
        (:meth:`finish_grad_sync` closes it, counting unused parameters as zero)."""
        self._callback_queued = False
        self._backward_end = time.perf_counter()
        if self._next == len(self.buckets):
            self._complete()

    def finish_grad_sync(self) -> None:
        """Close an open gradient sync (Megatron-Core's name): start the buckets whose
        parameters got no gradient (counted as zero), wait, write the averages back. No-op when
        no sync is open."""
        if not self._in_progress():
            return
        for b in self.buckets[self._next:]:
            self._launch(b)
        self._next = len(self.buckets)
        self._complete()

    def _complete(self) -> None:
        backward_end = getattr(self, "_backward_end", time.perf_counter())
        for b in self.buckets:
            b.work.wait()
            offset = 0
            for p in b.params:
                n = p.numel()
                view = b.buffer[offset:offset + n].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)
                offset += n
        end = time.perf_counter()
        self.last_intervals = [(b.times[0], b.times[1] if b.times[1] is not None else end) for b in self.buckets]
        self.last_backward_end = backward_end
        self.last_overlap = overlap_share(self.last_intervals, backward_end)
        for b in self.buckets:
            b.ready, b.work = 0, None
        self._next = 0
