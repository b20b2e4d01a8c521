"""ZeRO stage 3 / FSDP: parameters, gradients and optimizer state sharded over the DP ranks.

Rajbhandari et al. 2020 (ZeRO, sec. 5.3, P_os+g+p) and torch FSDP2 (``fully_shard``; Zhao et
al. 2023, "PyTorch FSDP", sec. 3). The model is cut into *units* (here: the embedding, each
transformer block, the head). Each unit's parameters are one flat buffer of n elements padded
to ``n_pad = ceil(n/d) * d`` (:mod:`.flat`); rank r keeps only its shard of ``n_pad/d``
elements, as an ``nn.Parameter`` that the optimizer steps (so the optimizer state is 1/d
too). Around each unit's computation:

* **before its forward**: all-gather the unit's full flat parameters over the DP group; the
  module's weights are views of that buffer, one autograd leaf per parameter (FSDP2's unsharded
  parameters), each with its own ``.grad``;
* **after its forward**: with ``reshard_after_forward=True`` (ZeRO-3, FSDP2's default) free the
  gathered buffer; with ``False`` (Llama 3's choice, ZeRO-2-like traffic) keep it until backward;
* **before its backward** (a hook on the unit's output gradient): all-gather again if it was
  freed;
* **after its backward** (every leaf's gradient accumulated): free the parameters and
  **reduce-scatter** the leaves' gradients as one padded flat buffer: rank r receives the sum of
  shard r, divides by d (the DP mean) and keeps it as its shard's ``.grad``.

**Shared parameters**: listed modules that share a parameter (a tied embedding and output layer,
``GPTConfig.share_embeddings_and_output_weights``) are one unit, gathered before its first
module's forward and kept until its last module's forward; autograd sums the gradients of both
uses into the one leaf before the unit's backward is complete.

**Split backward** (zero-bubble schedules, Qi et al. 2024: I then W, :mod:`labkit.pipeline.split_backward`):
the pipeline runtime runs each I and W inside :meth:`FullyShardedDataParallel.split_backward`
and differentiates :meth:`~FullyShardedDataParallel.unsharded_parameters`. Each I and W first
gathers every resharded unit of the stage; a unit stays gathered after I and after W (the W of
other microbatches read its weights later) until the stage's last W of the step, whose completion
reshards each unit and reduce-scatters its gradient, the sum of all M microbatches' W (the
other W run under ``no_sync()``). Forward passes keep their ``reshard_after_forward`` rule, so how
often a unit is gathered depends on the schedule's order
(:func:`labkit.plan.memory.zero3_split_gathers`); the peak is the stage's units all at once.

**Prefetch** (FSDP's forward/backward prefetch): when unit i starts its forward, the
all-gather of unit i+1 is started asynchronously, so it runs while unit i computes; in backward,
unit i-1's all-gather starts when unit i's backward starts. So at most two units are gathered
at once: the peak parameter bytes per rank are the shards plus the largest two neighbouring
units (:func:`expected_fsdp`). Units must be listed in the order their forwards run.

**Traffic** per step, per rank, for n_pad elements in all: all-gather in forward (n_pad), again
in backward (n_pad, only when resharded), reduce-scatter (n_pad). Under the ring algorithm each
moves ``(d-1)/d * n_pad`` elements: 3 (d-1)/d n_pad, **1.5x** the all-reduce of plain DP
(2 (d-1)/d n); with ``reshard_after_forward=False`` 2 (d-1)/d n_pad, the same as DP.

**HSDP** (hybrid sharding; FSDP2 with a 2-D mesh ``(replicate, shard)``): pass
``replicate_group`` too. Parameters are sharded over ``process_group`` (S ranks) and replicated
over ``replicate_group`` (R ranks); after the reduce-scatter in the shard group the shard's
gradient is all-reduced across the replicas and divided by R*S.

``no_sync()``: gradients accumulate unsharded (the full flat gradient of each unit stays on the
rank; FSDP2's ``set_requires_gradient_sync(False)``); the first backward outside it
reduce-scatters the sum.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .flat import NoSyncMixin, flatten, padded_numel, shard_flat, unflatten

__all__ = ["FullyShardedDataParallel", "fully_shard", "default_units", "expected_fsdp"]


def default_units(module: nn.Module) -> list[str]:
    """The FSDP units of a labkit GPT (or a pipeline stage of one), in forward order: the
    embedding, each block, the head (``embedding``, ``blocks.0`` ..., ``head``; absent parts
    skipped; forward order even where a stage registers its head before its blocks, as the MoE
    GPT's do: a unit prefetched out of order stays gathered, stale, into the next step). Other
    modules: their direct children that hold parameters, ModuleLists expanded."""
    names = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            names += [f"{name}.{i}" for i, c in enumerate(child) if any(True for _ in c.parameters())]
        elif any(True for _ in child.parameters()):
            names.append(name)
    # forward order whatever the registration order (the MoE GPT's stages register the head first)
    return sorted(names, key=lambda n: {"embedding": 0, "head": 2}.get(n, 1))


def expected_fsdp(unit_numels: Sequence[int], d: int, reshard_after_forward: bool = True,
                  bytes_per_element: int = 4, replicas: int = 1) -> dict:
    """What :class:`FullyShardedDataParallel` does per rank in one synchronised step.

    ``unit_numels``: parameter elements per unit, in forward order; ``d``: ranks that shard
    (the shard group). Returns, in bytes (payload as :class:`labkit.comm.CommLog` counts it):
    ``shard_bytes`` (sum n_pad/d: parameters, gradients, and per Adam moment), ``all_gather``
    (count, bytes: the local shard of each gather), ``reduce_scatter`` (count, bytes: the full
    padded gradient), ``all_reduce`` (HSDP across ``replicas``: count, bytes of the shards),
    ``ring_bytes`` (what one rank sends under the ring algorithms), ``dp_all_reduce_ring_bytes``
    (plain DP's all-reduce of the unpadded n, for the 1.5x comparison) and
    ``peak_gathered_bytes`` (largest sum over two neighbouring units' n_pad when resharded, the
    sum of all units' when not). Source: ZeRO sec. 7 (3x / 1.5x traffic), FSDP sec. 3.2."""
    pads = [padded_numel(n, d) for n in unit_numels]
    b = bytes_per_element
    gathers = len(pads) * (2 if reshard_after_forward else 1)
    ag_bytes = sum(p // d for p in pads) * b * (2 if reshard_after_forward else 1)
    rs_bytes = sum(pads) * b
    shard = sum(p // d for p in pads) * b
    if reshard_after_forward:
        peak = max([pads[0]] + [pads[i] + pads[i + 1] for i in range(len(pads) - 1)]) * b
    else:
        peak = sum(pads) * b
    ring = (d - 1) * ag_bytes + (d - 1) * rs_bytes // d
    ar = (len(pads), shard) if replicas > 1 else (0, 0)
    if replicas > 1:
        ring += 2 * (replicas - 1) * shard // replicas
    n = sum(unit_numels)
    return {"shard_bytes": shard, "all_gather": (gathers, ag_bytes), "reduce_scatter": (len(pads), rs_bytes),
            "all_reduce": ar, "ring_bytes": ring, "dp_all_reduce_ring_bytes": 2 * (d * replicas - 1) * n * b
            // (d * replicas), "peak_gathered_bytes": peak}


def _time_completion(work, event: dict) -> None:
    """Set ``event["end"]`` when ``work`` completes (through its future where the backend has
    one; gloo's reduce-scatter has none: then at the wait)."""
    def done(_fut):
        event["end"] = time.perf_counter()
    try:
        work.get_future().then(done)
    except RuntimeError:
        pass


class _Unit:
    """One FSDP unit: its flat shard (the parameter the optimizer sees), the buffer its full
    parameters are gathered into, and one autograd leaf per original parameter (a view of that
    buffer) wherever the parameter was registered (``parts``: ``[(name, module)]``, several
    modules when they share a parameter, as a tied embedding and output layer do)."""

    def __init__(self, parts, d: int, rank: int, is_partial=None, skip=frozenset()):
        named, slots, self.aliases = [], {}, {}
        for mname, module in parts:
            for n, p in module.named_parameters(remove_duplicate=False):
                if not p.requires_grad or id(p) in skip:
                    continue
                owner, _, attr = n.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                if id(p) not in slots:
                    named.append((f"{mname}.{n}", p))
                    slots[id(p)] = []
                elif f"{mname}.{n}" != named[[id(q) for _, q in named].index(id(p))][0]:
                    self.aliases[f"{mname}.{n}"] = [id(q) for _, q in named].index(id(p))   # a tied copy's name
                if (sub, attr) not in slots[id(p)]:
                    slots[id(p)].append((sub, attr))
        self.name = "+".join(m for m, _ in parts)
        if not named:
            raise ValueError(f"FSDP unit {self.name!r} has no parameters that require grad")
        self.modules = [m for _, m in parts]
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numel = sum(p.numel() for _, p in named)
        starts = [sum(q.numel() for _, q in named[:i]) for i in range(len(named))]
        # (offset, numel) in the flat buffer of the parameters whose gradients are partial sums
        self.partial = [(o, p.numel()) for o, (_, p) in zip(starts, named) if is_partial and is_partial(p)]
        self.padded = padded_numel(self.numel, d)
        flat = flatten([p.detach() for _, p in named], d)
        self.shard = nn.Parameter(shard_flat(flat, d, rank))
        # the buffer the all-gather writes into, and per parameter a leaf over its bytes with a
        # version counter of its own (``.data``): re-gathering before backward is not an "in-place
        # change of a saved tensor" (the bytes are the same ones); each leaf gets its own ``.grad``
        self.raw = torch.zeros(self.padded, dtype=flat.dtype, device=flat.device)
        self.leaves = [view.data.requires_grad_(True) for view in unflatten(self.raw, self.shapes)]
        for (_, p), leaf in zip(named, self.leaves):
            for sub, attr in slots[id(p)]:
                del sub._parameters[attr]
                setattr(sub, attr, leaf)
        self.nbytes = self.padded * flat.element_size()
        self.raw.untyped_storage().resize_(0)
        self.state = "sharded"           # sharded | pending | gathered
        self.work = None
        self.backward_started = False
        self.accumulated = 0             # leaves whose gradient arrived in the backward under way

    def flat_grad(self) -> torch.Tensor:
        """The leaves' gradients as one padded flat buffer (the leaves' ``.grad`` then dropped)."""
        parts = [leaf.grad.reshape(-1) for leaf in self.leaves]
        parts.append(parts[0].new_zeros(self.padded - self.numel))
        for leaf in self.leaves:
            leaf.grad = None
        return torch.cat(parts)


class FullyShardedDataParallel(NoSyncMixin, nn.Module):
    """ZeRO-3 / FSDP over ``process_group`` (d ranks), one flat shard per unit.

    Args:
        module: the model (the same weights on every rank, or ``sync_module_states=True``).
            Its parameters are replaced by the shards; ``self.parameters()`` yields the shards
            (hand them to any elementwise optimizer: SGD, Adam, AdamW).
        units: names of submodules, in forward order, that each become one unit (default
            :func:`default_units`); every parameter must be in one of them, none nested in another;
            modules that share a parameter (a tied embedding and head) become one unit.
        process_group: the group that shards (None: the default group).
        reshard_after_forward: free each unit's gathered parameters after its forward and
            gather them again for backward (True, ZeRO-3) or keep them (False).
        prefetch: start the next unit's all-gather while the current one computes.
        replicate_group: HSDP's replica group (R ranks holding the same shard), or None.
        sync_module_states: broadcast rank 0's weights first (in the shard and replicate groups).
        expert_params: names of parameters left out of the units (torch FSDP's ``ignored_params``):
            they differ across the DP ranks (expert parallelism folded onto DP, an expert-DP group
            of one rank), stay ordinary whole parameters of the module (``self.parameters()``
            yields them too), are not reduced, and their gradient is only divided by the DP size
            (the loss's DP mean; their gradient already sums every rank's tokens through the
            all-to-all): each contribution, by a tensor hook before accumulation (as in DDP and
            ZeRO-2), so the result does not depend on how many autograd runs carry it.
        partial_grad_group: a group over which the gradients of the parameters marked
            ``sequence_parallel`` (Megatron-Core's attribute; sequence parallelism's LayerNorm
            weights, which saw S/t tokens on each TP rank) are partial sums: summed over it, one
            coalesced all-reduce per unit that holds any, just before the unit's reduce-scatter
            (Korthikanti et al. 2022 sec. 4.2.2). None: no such parameters.
        defer_reduce: names of parameters whose unit is reduce-scattered only in
            :meth:`finish_grad_sync`, after backward; until then the unit's full flat gradient
            stays (:meth:`unsharded_grad` views it), for a reduction the caller must do first
            that cannot run inside backward (a tied embedding's gradient summed between the first
            and the last pipeline stage; Megatron-Core's ``finalize_model_grads``).

    After a synchronised backward every shard's ``.grad`` holds its part of the DP-mean
    gradient. Measurements: ``peak_gathered_bytes`` (largest sum of gathered unit buffers seen
    since :meth:`reset_peak`), ``timeline`` (the last forward+backward's events: dicts with
    ``unit``, ``kind`` = forward | backward | all_gather | reduce_scatter, ``phase``, ``start``,
    ``end`` in ``time.perf_counter`` seconds). Raises ValueError (before any communication) for
    an unknown unit, a parameter in no unit, nested or repeated units, or mixed dtypes/devices.
    """

    def __init__(self, module: nn.Module, units: Sequence[str] | None = None, process_group=None,
                 reshard_after_forward: bool = True, prefetch: bool = True, replicate_group=None,
                 sync_module_states: bool = False, partial_grad_group=None, defer_reduce: Sequence[str] = (),
                 expert_params: Sequence[str] = ()):
        super().__init__()
        names = list(default_units(module) if units is None else units)
        known = dict(module.named_modules())
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"units {unknown} are not submodules of the model")
        unknown = (set(defer_reduce) | set(expert_params)) - {n for n, _ in module.named_parameters()}
        if unknown:
            raise ValueError(f"defer_reduce/expert_params {sorted(unknown)} are not parameters of the module")
        self.expert_params = [p for n, p in module.named_parameters() if n in set(expert_params)]
        self.expert_names = [n for n, _ in module.named_parameters() if n in set(expert_params)]
        skip = frozenset(id(p) for p in self.expert_params)
        nested = [(a, b) for a in names for b in names if b.startswith(a + ".")]
        if nested or len(set(names)) < len(names):
            raise ValueError(f"units must not overlap: {nested[0] if nested else sorted(names)} "
                             f"(a unit nested in another, or listed twice)")
        # units that share a parameter (a tied embedding and output layer) become one unit
        owner: dict[int, int] = {id(p): -1 for p in self.expert_params}
        group = list(range(len(names)))
        for i, n in enumerate(names):
            for p in known[n].parameters():
                if id(p) in skip:
                    continue
                j = owner.setdefault(id(p), i)
                if j != i:
                    a, b = group[i], group[j]
                    group = [min(a, b) if g in (a, b) else g for g in group]
        outside = [n for n, p in module.named_parameters() if id(p) not in owner and p.requires_grad]
        if outside:
            raise ValueError(f"parameters {outside[:4]} belong to no unit; list their module in units")
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in skip]
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError("all parameters must share one dtype and device")
        self.process_group, self.replicate_group = process_group, replicate_group
        self.d = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.reshard_after_forward, self.prefetch = reshard_after_forward, prefetch
        if sync_module_states:
            with torch.no_grad():
                for group in (process_group, replicate_group) if replicate_group is not None else (process_group,):
                    src = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)[0]
                    for p in params:
                        comm.broadcast(p.data, src=src, group=group)
        self.module = module
        self.partial_grad_group = partial_grad_group
        marked = (lambda p: getattr(p, "sequence_parallel", False)) if partial_grad_group is not None else None
        firsts = sorted(set(group))
        self.units = [_Unit([(n, known[n]) for n, g in zip(names, group) if g == first], self.d, self.rank, marked,
                            skip) for first in firsts]
        # the forward calls in order, each (unit index, module): a shared unit has several
        self.calls = [(firsts.index(g), known[n]) for n, g in zip(names, group)]
        for u in self.units:
            u.deferred = bool(set(u.names) & set(defer_reduce))
            u.held = None            # a deferred unit's full gradient between backward and finish_grad_sync
        self.shards = nn.ParameterList([u.shard for u in self.units])
        self.require_backward_grad_sync = True
        self.peak_gathered_bytes, self._live = 0, 0
        self.timeline: list[dict] = []
        self._pending: list = []
        self._callback_queued = False
        for p in self.expert_params:
            p.register_hook(self._expert_hook)
        self._split = None               # None | "open" | "last": inside split_backward (zero-bubble I or W)
        for c, (_, mod) in enumerate(self.calls):
            mod.register_forward_pre_hook(lambda m, a, c=c: self._pre_forward(c))
            mod.register_forward_hook(lambda m, a, out, c=c: self._post_forward(c, out))
        for i, u in enumerate(self.units):
            for leaf in u.leaves:
                leaf.register_post_accumulate_grad_hook(lambda t, i=i: self._leaf_grad_ready(i))

    # ------------------------------------------------------------------ public

    def forward(self, *args, **kwargs):
        if not self._callback_queued:
            self.timeline = []
        return self.module(*args, **kwargs)

    def reset_peak(self) -> None:
        self.peak_gathered_bytes = self._live

    def shard_bytes(self) -> int:
        """Parameter bytes this rank keeps between steps: the shards (sum n_pad/d per unit)."""
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units)

    def grad_bytes(self) -> int:
        """Gradient bytes this rank keeps after backward: its shards' ``.grad``."""
        return sum(u.shard.grad.numel() * u.shard.grad.element_size() for u in self.units
                   if u.shard.grad is not None)

    @torch.no_grad()
    def full_tensors(self, what: str = "param") -> dict[str, torch.Tensor]:
        """For inspection only (tests, a lab's verdict): all-gather every unit's shard of the
        parameters (``what="param"``) or of their gradients (``"grad"``) and return
        ``{name: full tensor}`` with the original module's parameter names (a shared parameter
        under each of its names, as ``named_parameters(remove_duplicate=False)``)."""
        out = {}
        for u in self.units:
            src = u.shard if what == "param" else u.shard.grad
            if src is None:
                raise RuntimeError(f"unit {u.name} has no gradient yet")
            buf = torch.empty(u.padded, dtype=src.dtype, device=src.device)
            comm.all_gather_into_tensor(buf, src.detach(), self.process_group)
            views = unflatten(buf, u.shapes)
            for n, v in zip(u.names, views):
                out[n] = v.clone()
            for n, i in u.aliases.items():          # a shared parameter under its other names too
                out[n] = out[u.names[i]]
        for n, p in zip(self.expert_names, self.expert_params):    # whole on this rank
            out[n] = (p.detach() if what == "param" else p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        return out

    # ------------------------------------------------------------------ gathering

    def _event(self, unit, kind, phase, start=None, end=None):
        ev = {"unit": unit.name, "kind": kind, "phase": phase,
              "start": time.perf_counter() if start is None else start, "end": end}
        self.timeline.append(ev)
        return ev

    def _unshard(self, u: _Unit, phase: str) -> None:
        """Start the all-gather of ``u`` (async) unless it is gathered or on its way."""
        if u.state != "sharded":
            return
        u.raw.untyped_storage().resize_(u.nbytes)
        self._live += u.nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._live)
        ev = self._event(u, "all_gather", phase)
        u.work = comm.all_gather_into_tensor(u.raw, u.shard.detach(), self.process_group, async_op=True)
        u.gather_event = ev
        _time_completion(u.work, ev)
        u.state = "pending"

    def _wait(self, u: _Unit) -> None:
        if u.state == "pending":
            u.work.wait()
            u.gather_event["end"] = u.gather_event["end"] or time.perf_counter()
            u.work, u.state = None, "gathered"

    def _reshard(self, u: _Unit) -> None:
        if u.state == "sharded":
            return
        self._wait(u)
        u.raw.untyped_storage().resize_(0)
        self._live -= u.nbytes
        u.state = "sharded"

    # ------------------------------------------------------------------ hooks

    def _pre_forward(self, c: int) -> None:
        u = self.units[self.calls[c][0]]
        self._unshard(u, "forward")
        self._wait(u)
        if self.prefetch and c + 1 < len(self.calls):
            self._unshard(self.units[self.calls[c + 1][0]], "forward")
        u.fwd_event = self._event(u, "forward", "forward")

    def _post_forward(self, c: int, out):
        i = self.calls[c][0]
        u = self.units[i]
        u.fwd_event["end"] = time.perf_counter()
        tensors = [out] if torch.is_tensor(out) else [t for t in (out if isinstance(out, (tuple, list)) else [])
                                                      if torch.is_tensor(t)]
        tensors = [t for t in tensors if t.requires_grad]
        # a shared unit (tied embedding and output layer) stays gathered until its last call's forward
        last_call = all(j != i for j, _ in self.calls[c + 1:])
        if (self.reshard_after_forward and last_call) or not tensors:
            self._reshard(u)
        for t in tensors:
            t.register_hook(lambda g, c=c: self._pre_backward(c))
        return out

    def _pre_backward(self, c: int) -> None:
        u = self.units[self.calls[c][0]]
        if u.backward_started:
            return
        u.backward_started = True
        self._queue_finalize()
        if self._split is None:   # a split backward gathered every unit first (one completed in the last W stays freed)
            self._unshard(u, "backward")
            self._wait(u)
            if self.prefetch and c > 0:
                self._unshard(self.units[self.calls[c - 1][0]], "backward")
        u.bwd_event = self._event(u, "backward", "backward")

    def _leaf_grad_ready(self, i: int) -> None:
        """A leaf's gradient was accumulated; the unit's backward is complete when every leaf's
        was (each leaf is accumulated once per backward: autograd sums a shared weight's uses)."""
        u = self.units[i]
        u.accumulated += 1
        if u.accumulated == len(u.leaves):
            u.accumulated = 0
            self._post_backward(i)

    def _post_backward(self, i: int) -> None:
        u = self.units[i]
        if hasattr(u, "bwd_event"):
            u.bwd_event["end"] = time.perf_counter()
        if self._split != "open":           # a split backward's W keeps the unit until the step's last W
            self._reshard(u)
        if not self.require_backward_grad_sync:
            return
        self._queue_finalize()
        grad = u.flat_grad()
        if u.deferred:                      # kept whole until finish_grad_sync
            u.held = grad
            return
        self._reduce_scatter(u, grad)

    # ------------------------------------------------------------------ split backward (zero bubble)

    def unsharded_parameters(self) -> list[torch.Tensor]:
        """The tensors the module computes with, which a split backward differentiates: each
        unit's per-parameter leaves (views of its gathered buffer), then the expert parameters."""
        return [leaf for u in self.units for leaf in u.leaves] + list(self.expert_params)

    @contextmanager
    def split_backward(self, last: bool):
        """Run one pass of a split backward (a zero-bubble schedule's I or W, Qi et al. 2024) inside:
        every resharded unit is all-gathered first (the stage's weights, which I and W read; the
        W passes of other microbatches read them later too), and a unit completed by a W stays
        gathered, its gradient accumulating, unless ``last``: the step's last W of this stage,
        after which each unit is resharded and (outside ``no_sync``) reduce-scattered. FSDP2
        under torch's pipeline schedules keeps units gathered the same way (no reshard after
        backward until the last). Raises RuntimeError when the last W left a unit's gradient
        incomplete (a parameter that got no gradient)."""
        for u in self.units:
            self._unshard(u, "backward")
        for u in self.units:
            self._wait(u)
        self._split = "last" if last else "open"
        try:
            yield
        finally:
            self._split = None
        if last:
            left = [u.name for u in self.units if u.state != "sharded" or u.accumulated]
            if left:
                raise RuntimeError(f"FSDP units {left} were not completed by the step's last W (every parameter "
                                   f"of a unit must get a gradient in each backward)")

    def _reduce_scatter(self, u: _Unit, grad: torch.Tensor) -> None:
        if u.partial:                       # partial sums (sequence parallelism) over their group first
            flat = torch.cat([grad[o:o + n] for o, n in u.partial])
            comm.all_reduce(flat, self.partial_grad_group)
            offset = 0
            for o, n in u.partial:
                grad[o:o + n].copy_(flat[offset:offset + n])
                offset += n
        out = torch.empty_like(u.shard)
        ev = self._event(u, "reduce_scatter", "backward")
        work = comm.reduce_scatter_tensor(out, grad, self.process_group, async_op=True)
        _time_completion(work, ev)
        self._pending.append((u, out, work, grad, ev))

    def unsharded_grad(self, name: str) -> torch.Tensor:
        """The full gradient of parameter ``name`` of a deferred unit (a view of the unit's held
        flat gradient: write into it to change what is reduce-scattered). Raises RuntimeError
        when no gradient is held for it."""
        for u in self.units:
            if name in u.names and u.held is not None:
                i = u.names.index(name)
                return unflatten(u.held, u.shapes)[i]
        raise RuntimeError(f"no unsharded gradient held for {name!r} (not in defer_reduce, or no backward yet)")

    def finish_grad_sync(self) -> None:
        """Reduce-scatter the deferred units' held gradients (after the caller's own reduction
        of them) into their shards' ``.grad``. No-op when none is held."""
        held = [u for u in self.units if u.held is not None]
        for u in held:
            grad, u.held = u.held, None
            self._reduce_scatter(u, grad)
        if held:
            self._finalize()

    def _expert_hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / (self.d * self.replicas)     # each contribution: the DP mean whatever the order

    def _queue_finalize(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _finalize(self) -> None:
        """End of backward: wait for the reduce-scatters, average (HSDP: all-reduce across the
        replicas), write each shard's ``.grad`` (added to an existing one)."""
        self._callback_queued = False
        for u, out, work, _, ev in self._pending:
            work.wait()
            ev["end"] = ev["end"] or time.perf_counter()
            if self.replicate_group is not None:
                comm.all_reduce(out, self.replicate_group)
            out.div_(self.d * self.replicas)
            if u.shard.grad is None:
                u.shard.grad = out
            else:
                u.shard.grad.add_(out)
        self._pending = []
        for u in self.units:
            u.backward_started = False


def fully_shard(module: nn.Module, process_group=None, reshard_after_forward: bool = True,
                units: Sequence[str] | None = None, **kwargs) -> FullyShardedDataParallel:
    """torch FSDP2's spelling: shard ``module`` by units over ``process_group`` and return the
    wrapper (:class:`FullyShardedDataParallel`; ``kwargs`` go to it)."""
    return FullyShardedDataParallel(module, units, process_group, reshard_after_forward, **kwargs)
