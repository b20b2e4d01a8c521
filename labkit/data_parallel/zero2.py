"""ZeRO stage 2: shard the gradients and the optimizer state over the d data-parallel ranks.

Rajbhandari et al. 2020 (ZeRO, sec. 5.2, P_os+g); DeepSpeed's ``zero_optimization.stage = 2``
with ``overlap_comm``. Every rank still holds all parameters (as in ZeRO-1), but no rank keeps
the whole gradient: as in :class:`~.ddp.DistributedDataParallel` the gradients are grouped into
buckets (reverse registration order, at most ``bucket_cap_mb`` MiB each) and a hook on each
parameter starts the bucket's collective as soon as its last gradient is ready, while backward
goes on. The collective is a **reduce-scatter** instead of an all-reduce: the bucket (padded to
a multiple of d, :mod:`.flat`) is summed over the ranks and rank r receives only shard r, which
it divides by d (the DP mean) and keeps; the bucket's full gradients are dropped at once. Rank r
then steps only its shards (optimizer state of n_pad/d elements) and an **all-gather** per
bucket brings every rank the whole updated parameters.

Memory per rank (mixed-precision Adam, ZeRO's 2 + 2 + 12 bytes per parameter): 2 + 14/d bytes
per parameter. Traffic per step: reduce-scatter of n_pad + all-gather of n_pad/d, under the ring
(d-1)/d n_pad each: the all-reduce of plain DP, padding included.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .flat import NoSyncMixin, bucket_groups, flatten, padded_numel, shard_flat

__all__ = ["ZeroStage2", "expected_zero2"]


def expected_zero2(param_numels: Sequence[int], bucket_cap_mb: float, d: int, bytes_per_element: int = 4) -> dict:
    """The formula for one step of :class:`ZeroStage2`. ``param_numels`` in bucket order
    (reverse registration order). Returns ``buckets``, ``reduce_scatter`` (count, bytes: each
    bucket's padded length), ``all_gather`` (count, bytes: each bucket's shard), ``shard_bytes``
    (gradient bytes kept per rank = per-moment optimizer bytes = sum of the bucket shards) and
    ``ring_bytes`` (what one rank sends under the ring algorithms)."""
    b = bytes_per_element
    sizes = [sum(param_numels[i] for i in g) for g in bucket_groups([n * b for n in param_numels], bucket_cap_mb)]
    pads = [padded_numel(n, d) for n in sizes]
    rs, ag = sum(pads) * b, sum(p // d for p in pads) * b
    return {"buckets": len(pads), "reduce_scatter": (len(pads), rs), "all_gather": (len(pads), ag),
            "shard_bytes": ag, "ring_bytes": (d - 1) * rs // d + (d - 1) * ag}


class _Bucket:
    def __init__(self, params: list[nn.Parameter], d: int, rank: int):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.padded = padded_numel(self.numel, d)
        self.shard = nn.Parameter(shard_flat(flatten([p.detach() for p in params], d), d, rank))
        self.ready, self.work, self.out, self.buffer = 0, None, None, None
        self.deferred = False


class ZeroStage2(NoSyncMixin, nn.Module):
    """ZeRO-2 around ``module`` over ``process_group`` (d ranks) with ``optimizer_class(**defaults)``.

    Args:
        module: the replica (the same weights on every rank: see
            :func:`~.ddp.broadcast_parameters`). ``forward`` calls it.
        optimizer_class: an elementwise ``torch.optim.Optimizer`` class (SGD, Adam, AdamW).
        process_group: the DP group; None: the default group.
        bucket_cap_mb: largest gradient bucket in MiB (2**20 bytes).
        partial_grad_group, is_partial: see "Partial gradients" below (None: none).
        expert_params: names (in ``module``) of parameters not sharded (see below).
        defer_reduce: names (in ``module``) of parameters whose bucket is reduce-scattered only
            in :meth:`finish_grad_sync`, after backward: until then their full ``.grad`` stays,
            for a reduction the caller must do first that cannot run inside backward (a tied
            embedding's gradient summed between the first and the last pipeline stage, whose
            backwards run at different times; Megatron-Core's ``finalize_model_grads``).
        **defaults: passed to ``optimizer_class``.

    After a synchronised backward no ``param.grad`` is left on the module; each bucket's
    ``shard.grad`` holds rank r's part of the DP-mean gradient. :meth:`step` steps the shards and
    all-gathers the parameters. ``no_sync()`` accumulates full local gradients (the next
    synchronised backward reduce-scatters the sum).

    When the sync closes (DDP's rule, :class:`~.ddp.DistributedDataParallel`): at the end of an
    autograd run in which the last bucket started. A parameter without a gradient, or a backward
    split into several autograd runs (a checkpointed block's recompute runs its own nested
    backward; a zero-bubble W runs one per microbatch), leaves it open until the rest arrives or
    :meth:`finish_grad_sync` (which :meth:`step` calls first) closes it, counting missing
    gradients as zero: every bucket is reduce-scattered exactly once per step.

    Partial gradients (``partial_grad_group``): parameters for which ``is_partial(p)`` holds
    (default: Megatron-Core's ``sequence_parallel`` attribute) saw only this rank's share of the
    tokens of that group (sequence parallelism: S/t of them over TP), so their gradients are summed
    over it first, one coalesced all-reduce per bucket that holds any, just before the bucket's
    reduce-scatter (the same sum as reducing the shards over TP afterwards; Korthikanti et al.
    2022 sec. 4.2.2). ``expert_params``: names of parameters that differ across the DP ranks
    (expert parallelism folded onto DP): not sharded, their full gradient is only divided by d
    (as in DDP: each contribution, by a tensor hook before accumulation, so a zero-bubble W whose
    experts come after the buckets completed neither misses the scaling nor reopens the sync)
    and they are stepped whole by :attr:`expert_optim`.

    Raises ValueError (before any communication) for ``bucket_cap_mb <= 0``, no parameters,
    mixed dtypes/devices, or unknown ``expert_params``.
    """

    def __init__(self, module: nn.Module, optimizer_class=torch.optim.Adam, process_group=None,
                 bucket_cap_mb: float = 25.0, partial_grad_group=None, is_partial=None,
                 expert_params: Sequence[str] = (), defer_reduce: Sequence[str] = (), **defaults):
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        unknown = (set(expert_params) | set(defer_reduce)) - {n for n, _ in named}
        if unknown:
            raise ValueError(f"expert_params/defer_reduce {sorted(unknown)} are not parameters of the module")
        self.expert_params = [p for n, p in named if n in set(expert_params)]
        params = [p for n, p in named if n not in set(expert_params)]
        if not params:
            raise ValueError("ZeroStage2 got a module without parameters that require grad")
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("all parameters must share one dtype and device")
        self.module, self.process_group = module, process_group
        self.d, self.rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        order = list(reversed(params))
        groups = bucket_groups([p.numel() * p.element_size() for p in order], bucket_cap_mb)
        self.buckets = [_Bucket([order[i] for i in g], self.d, self.rank) for g in groups]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for n, p in named:
            if n in set(defer_reduce):
                self._bucket_of[id(p)].deferred = True
        self.optim = optimizer_class([b.shard for b in self.buckets], **defaults)
        self.expert_optim = optimizer_class(self.expert_params, **defaults) if self.expert_params else None
        self.partial_grad_group = partial_grad_group
        self.is_partial = is_partial or (lambda p: getattr(p, "sequence_parallel", False))
        self.require_backward_grad_sync = True
        self._next, self._callback_queued = 0, False
        for p in params:
            p.register_post_accumulate_grad_hook(self._hook)
        for p in self.expert_params:
            p.register_hook(self._expert_hook)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def param_groups(self):
        return self.optim.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for b in self.buckets:
            b.shard.grad = None
        for p in self.module.parameters():
            p.grad = None

    def grad_bytes(self) -> int:
        """Gradient bytes on this rank: the shards' ``.grad`` plus any full ``param.grad`` left."""
        shards = sum(b.shard.grad.numel() * b.shard.grad.element_size() for b in self.buckets
                     if b.shard.grad is not None)
        return shards + sum(p.grad.numel() * p.grad.element_size() for p in self.module.parameters()
                            if p.grad is not None)

    # ------------------------------------------------------------------ backward

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _expert_hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.d       # each contribution: the sum is the DP mean whatever the order

    def _hook(self, p: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return
        self._queue_finalize()
        self._bucket_of[id(p)].ready += 1
        # start every consecutive full bucket in index order (the same on every rank); a deferred
        # one is skipped here and started in finish_grad_sync
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not b.deferred:
                if b.ready < len(b.params):
                    break
                self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        if self.partial_grad_group is not None:   # partial sums over e.g. TP first (coalesced)
            part = [q.grad for q in b.params if q.grad is not None and self.is_partial(q)]
            if part:
                flat = torch.cat([g.reshape(-1) for g in part])
                comm.all_reduce(flat, self.partial_grad_group)
                offset = 0
                for g in part:
                    g.copy_(flat[offset:offset + g.numel()].view_as(g))
                    offset += g.numel()
        b.buffer = torch.zeros(b.padded, dtype=b.shard.dtype, device=b.shard.device)
        offset = 0
        for q in b.params:
            if q.grad is not None:
                b.buffer[offset:offset + q.numel()].copy_(q.grad.reshape(-1))
            offset += q.numel()
            q.grad = None                       # the full gradient is not kept: only the shard
        b.out = torch.empty_like(b.shard)
        b.work = comm.reduce_scatter_tensor(b.out, b.buffer, self.process_group, async_op=True)

    def _in_progress(self) -> bool:
        return self._next > 0 or any(b.ready for b in self.buckets)

    def _finalize(self) -> None:
        """End of an autograd run: complete the sync when every bucket has started, else leave
        it open (a nested recompute backward, a zero-bubble W, a parameter without gradient)."""
        self._callback_queued = False
        if self._next == len(self.buckets) and not any(b.deferred for b in self.buckets):
            self._complete()

    def finish_grad_sync(self) -> None:
        """Close an open sync (Megatron-Core's name): start the buckets not started yet, deferred
        ones included, in index order (missing gradients count as zero) and complete. No-op when
        none is open."""
        if not self._in_progress():
            return
        for b in self.buckets:
            if b.work is None:
                self._launch(b)
        self._complete()

    def _complete(self) -> None:
        for b in self.buckets:
            b.work.wait()
            b.out.div_(self.d)
            if b.shard.grad is None:
                b.shard.grad = b.out
            else:
                b.shard.grad.add_(b.out)
            b.ready, b.work, b.out, b.buffer = 0, None, None, None
        self._next = 0

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self) -> None:
        """Close an open gradient sync, step this rank's shards (and the experts), then
        all-gather every bucket's parameters (all started asynchronously, then waited for) and
        copy them into the module."""
        self.finish_grad_sync()
        self.optim.step()
        if self.expert_optim is not None:
            self.expert_optim.step()
        gathered = []
        for b in self.buckets:
            full = torch.empty(b.padded, dtype=b.shard.dtype, device=b.shard.device)
            gathered.append((b, full, comm.all_gather_into_tensor(full, b.shard.detach(), self.process_group,
                                                                  async_op=True)))
        for b, full, work in gathered:
            work.wait()
            offset = 0
            for q in b.params:
                q.copy_(full[offset:offset + q.numel()].view_as(q))
                offset += q.numel()

    @torch.no_grad()
    def full_grads(self) -> dict[int, torch.Tensor]:
        """For inspection only: all-gather the gradient shards; ``{id(param): full gradient}``."""
        out = {}
        for b in self.buckets:
            full = torch.empty(b.padded, dtype=b.shard.dtype, device=b.shard.device)
            comm.all_gather_into_tensor(full, b.shard.grad, self.process_group)
            offset = 0
            for q in b.params:
                out[id(q)] = full[offset:offset + q.numel()].view_as(q).clone()
                offset += q.numel()
        return out
