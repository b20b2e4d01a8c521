"""Run any pipeline schedule on real ranks with point-to-point messages.

The interpreter: it executes actions and emits events. Names follow
``torch.distributed.pipelining``: wrap each stage module in :class:`PipelineStage`, build a
schedule object (:class:`PipelineSchedule` with any ``{rank: [Action]}`` data, e.g. a
learner's, or a named one from :mod:`.schedule_classes`: ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ...), and call ``step(x, target=y, losses=losses)`` on every rank
of the pipeline group.

What ``step`` does on one rank, action by action (semantics in :mod:`.schedules`):

* ``RECV_F``/``RECV_B``: post ``irecv`` into a fresh buffer; wait for it just before the
  F/B that needs it.
* ``F``: run the stage on microbatch m; the last stage also computes
  ``loss_fn(output, target_m) / M``. The loss is scaled once, here, so that the M
  backwards accumulate the gradient of the minibatch mean; gradients are never rescaled.
* ``SEND_F``/``SEND_B``: ``isend`` the output (or input gradient); all sends are waited
  for at the end of the step.
* ``B``: ``torch.autograd.backward`` of the stored output with the received gradient (or
  of the scaled loss); parameter gradients accumulate in ``.grad`` across microbatches and
  across steps (zero them yourself, as with any optimizer loop).
* ``I`` / ``W`` (zero-bubble schedules): the same backward in two parts, the input
  gradient(s) first (sent by SEND_B) and the parameter gradients later
  (:mod:`.split_backward`); the microbatch's activations stay until its W. A stage wrapped in
  :class:`labkit.data_parallel.FullyShardedDataParallel` runs each I and W inside its
  ``split_backward(last)`` (its units gathered first and kept until the stage's last W of the
  step; torch's schedules unshard FSDP2 stages the same way) and differentiates its gathered
  per-parameter leaves (``unsharded_parameters()``).

Stage boundaries: a stage may return one tensor or a tuple of tensors; the next stage is
called with them as positional arguments (``submod(*outputs)``), and ``step(*args)`` gives
stage 0 its arguments the same way (each split into M microbatches along dim 0). Which tensors
carry a gradient is found once, at the first step (a forward of every stage on zeros), and the
two sides of a boundary agree on it through the shape message: only outputs that require
grad get a gradient back (SEND_B/RECV_B move those, possibly none), so an integer mask, a
tensor computed without parameters from the data, or the output of a frozen (or
parameter-free) first stage travels forward only. A stage whose outputs need no gradient
runs no backward at all.

With ``recompute=True`` a forward keeps only the stage input and runs without autograd;
the backward runs the stage forward again and then backward (GPipe's re-materialisation,
Huang et al. 2019, sec. 2.3). Gradients are identical; the bytes stashed for backward,
measured with ``torch.autograd.graph.saved_tensors_hooks``, drop to one input per
microbatch.

A schedule that cannot finish (possible only with ``validate=False``) fails when a wait
times out: the error's first line names the first action that cannot complete (found by
running the schedule symbolically, the same on every rank) and says which rank reported it (by its
global rank too, inside a larger grid), and where that rank was waiting (:mod:`.hang`).

Measurements: the interpreter only executes actions and emits one :class:`~.stats.Event`
per action (action, start, end, bytes; seconds from a common start taken right after a
barrier), kept as ``events`` after each step. :mod:`.stats` derives the figures from them:
``timeline`` (``[TimedAction]``), ``peak_in_flight``, ``stash_peak_bytes`` and
``stash_bytes`` (stage -> list of bytes per microbatch), ``peak_waiting_for_w``,
``w_grads_peak_bytes`` and ``w_only_peak_bytes`` (see :class:`~.stats.StepStats`); a
forward-only step leaves the last training step's figures. The bytes one microbatch's
forward saves for backward are measured with the hooks on the first forward of each stage and
reused afterwards (the shapes are fixed; the hooks cost time). With ``measure_w_memory=True``,
``w_only_bytes`` (stage -> bytes of one microbatch's saved activations that only W needs) is
measured once per stage at its first I with :func:`.split_backward.w_only_saved_bytes`.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import comm
from .boundary import as_tuple, exchange_metadata, replay_rng, rng_state
from .boundary import nbytes as tensor_bytes
from .hang import explain_hang
from .schedules import Action, Schedule, ScheduleError
from .split_backward import backward_input, backward_weight, w_only_saved_bytes
from .stats import Event, step_stats
from .stats import timeline as timed_actions
from .validate import validate_schedule

_as_tuple = as_tuple  # the old private name (tests/pipeline/test_pipeline_boundaries.py)

__all__ = ["PipelineStage", "PipelineSchedule", "explain_hang"]


def _check_cost_model(cost_model):
    """None, or a dict kind -> seconds >= 0 for kinds among F, B, I, W (ValueError otherwise)."""
    if cost_model is None:
        return None
    if not isinstance(cost_model, dict):
        raise ValueError(f"cost_model must be a dict like {{'F': 0.02, 'I': 0.02, 'W': 0.02}}, got {cost_model!r}")
    for k, t in cost_model.items():
        if k not in ("F", "B", "I", "W") or not isinstance(t, (int, float)) or t < 0:
            raise ValueError(f"cost_model entries are F, B, I, W -> seconds >= 0; got {k!r}: {t!r}")
    return dict(cost_model)


def _compute_params(submod: nn.Module):
    """The tensors a split backward differentiates: FSDP's gathered per-parameter leaves
    (``unsharded_parameters()``), else the module's parameters."""
    fn = getattr(submod, "unsharded_parameters", None)
    return fn() if fn is not None else submod.parameters()


def _split_pass(submod: nn.Module, last: bool):
    """FSDP's ``split_backward(last)`` around an I or W (its units gathered, kept until the last W),
    or nothing for a module without it."""
    fn = getattr(submod, "split_backward", None)
    return fn(last) if fn is not None else contextlib.nullcontext()


class PipelineStage:
    """One stage of the model on this rank.

    Args: ``submodule`` (the stage's layers: ``submodule(*inputs)`` with the previous stage's
    output(s) [b, ...] -> one tensor or a tuple of tensors [b, ...]),
    ``stage_index`` (0..num_stages-1), ``num_stages`` (K * v), ``device`` (default CPU),
    ``group`` (the pipeline process group; None: the default group). Stage i must be on
    group rank ``i % K`` (looped placement); the schedule checks this."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str | None = None, group=None):
        if not 0 <= stage_index < num_stages:
            raise ScheduleError(f"stage_index={stage_index} outside 0..num_stages-1={num_stages - 1}")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.group = group
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1


class _StepState:
    """The tensors one rank holds during a step, keyed by (stage, microbatch): stage inputs
    and outputs (until the backward), input gradients (until sent), posted receives, what I
    keeps for W, RNG states (recompute), results of the last stage; the pending sends and the
    events emitted so far (:class:`~.stats.Event`)."""

    def __init__(self, x_mbs, t_mbs, losses, forward_only, stages):
        self.x_mbs, self.t_mbs, self.losses, self.forward_only = x_mbs, t_mbs, losses, forward_only
        self.inputs, self.outputs, self.grads, self.pending, self.results, self.rng = {}, {}, {}, {}, {}, {}
        self.weight_grads: dict = {}  # (stage, mb) -> what I kept for W (zero-bubble schedules)
        self.n_backward = {s: 0 for s in stages}
        self.sends: list = []
        self.events: list = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def emit(self, a: Action, start: float, nbytes: int = 0, end: float | None = None):
        """Record that ``a`` ran from ``start`` to ``end`` (default: now)."""
        self.events.append(Event(a, start, self.now() if end is None else end, nbytes))


class PipelineSchedule:
    """Execute ``actions`` (``{rank: [Action]}``, any valid schedule) with the given stages.

    Args:
        stages: this rank's :class:`PipelineStage` (or a list, for several chunks per rank).
        n_microbatches: M; each input batch is split into M equal microbatches along dim 0.
        loss_fn: ``loss_fn(output, target) -> 0-d tensor`` (mean over the microbatch).
        actions: the schedule (every rank passes the same dict).
        recompute: keep only stage inputs, recompute the forward in backward.
        validate: run :func:`validate_schedule` first (turn off only to test failures).
        timeout: seconds to wait for any receive (default: the group's, else 30).
        cost_model: ``{"F": t_F, "B": t_B, "I": t_I, "W": t_W}`` in seconds (missing kinds:
            no padding): each such action still computes for real, then sleeps until it has
            taken its chosen time, so its duration is max(real, chosen) without holding a
            core. With chosen times well above the real ones the measured bubble shows the
            schedule's formula even on fewer cores than ranks (see ``timeline``).
        measure_w_memory: measure ``w_only_bytes`` / ``w_only_peak_bytes`` (split backward
            only; costs a few extra I passes of one microbatch per stage at its first I, run
            before the I's timeline entry starts, with the RNG state restored afterwards).

    Raises ScheduleError before any communication when M < 1, the group size does not equal
    the schedule's K, or this rank's stages do not match the placement stage i -> rank i % K.
    """

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None, actions: dict | None = None,
                 recompute: bool = False, validate: bool = True, timeout: float | None = None,
                 cost_model: dict | None = None, measure_w_memory: bool = False):
        self.stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if not self.stages:
            raise ScheduleError("no stages given")
        if not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ScheduleError(f"n_microbatches (M) must be an integer >= 1, got {n_microbatches!r}")
        self.n_microbatches = M = n_microbatches
        self.loss_fn = loss_fn
        self.recompute = recompute
        self.timeout = timeout
        self.cost_model = _check_cost_model(cost_model)
        self.measure_w_memory = bool(measure_w_memory)
        self.w_only_bytes: dict = {}       # stage -> bytes per microbatch of activations only W needs
        self.group = self.stages[0].group
        self.num_stages = S = self.stages[0].num_stages
        self.world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        if actions is None:
            actions = self._build(self.world, M, len(self.stages))
        K = len(actions)
        if K != self.world:
            raise ScheduleError(f"the schedule has K={K} ranks but the pipeline group has world size {self.world}; "
                                f"they must match")
        if S % K:
            raise ScheduleError(f"num_stages={S} is not a multiple of K={K} ranks")
        shaped = Schedule.of(actions, M, S)
        self.placement = shaped.placement  # "loop" (stage i on rank i % K) or "v" (ZB-V, DualPipeV)
        mine = sorted(st.stage_index for st in self.stages)
        expected = [s for s in range(S) if shaped.rank_of(s) == self.rank]
        if mine != expected:
            rule = "stage i on rank i % K" if self.placement == "loop" else "V placement: rank r holds r and 2K-1-r"
            raise ScheduleError(f"{self._who} holds stages {mine} but with K={K} ranks and {S} stages it must "
                                f"hold {expected} ({rule})")
        if any(st.num_stages != S for st in self.stages):
            raise ScheduleError("all stages must agree on num_stages")
        self.actions = validate_schedule(shaped, placement=self.placement) if validate else shaped
        self.K = K
        self._by_index = {st.stage_index: st for st in self.stages}
        self._shapes = None  # stage -> (input shape, input dtype, output shape, output dtype)
        self._stash_cache: dict = {}  # stage -> bytes saved for backward by one microbatch's forward
        ranks = dist.get_process_group_ranks(self.group) if dist.is_initialized() and self.group is not None \
            else list(range(K))
        self._global = ranks
        self._param_ptrs = {st.stage_index: {p.untyped_storage().data_ptr() for p in st.submod.parameters()}
                            for st in self.stages}
        self.events: list[Event] = []       # this rank's last step, as emitted (:mod:`.stats`)
        self.stats = step_stats([], self._by_index, M, {} if self.measure_w_memory else None)

    def _build(self, K, M, v):  # overridden by the named schedules
        raise ScheduleError("PipelineSchedule needs actions={rank: [Action, ...]}")

    # ------------------------------------------------------------------ helpers

    # the figures of the last training step (:class:`~.stats.StepStats`), under their old names
    timeline = property(lambda self: timed_actions(self.events), doc="this rank's last step as [TimedAction]")
    peak_in_flight = property(lambda self: self.stats.peak_in_flight)
    stash_bytes = property(lambda self: self.stats.stash_bytes)
    stash_peak_bytes = property(lambda self: self.stats.stash_peak_bytes)
    peak_waiting_for_w = property(lambda self: self.stats.peak_waiting_for_w)
    w_grads_peak_bytes = property(lambda self: self.stats.w_grads_peak_bytes)
    w_only_peak_bytes = property(lambda self: self.stats.w_only_peak_bytes)

    def _rank_of(self, stage: int) -> int:
        return self.actions.rank_of(stage)

    @property
    def _who(self) -> str:
        """This rank in messages: "rank r", or "pipeline rank r (global rank g)" when its global rank
        (the one a launch or torchrun names) differs, as in a pipeline inside a larger grid."""
        g = dist.get_global_rank(self.group, self.rank) if dist.is_initialized() and self.group is not None \
            else self.rank
        return f"rank {self.rank}" if g == self.rank else f"pipeline rank {self.rank} (global rank {g})"

    def _peer(self, stage: int) -> int:
        return self._global[self._rank_of(stage)]

    def _wait(self, work):
        if self.timeout is not None:
            work.wait(timedelta(seconds=self.timeout))
        else:
            work.wait()

    def _infer_shapes(self, x_mb):
        """Boundary metadata of this rank's stages (:func:`.boundary.exchange_metadata`)."""
        return exchange_metadata(self._by_index, self.num_stages, self._rank_of, self.rank, self._peer, self.group,
                                 x_mb)

    def _split(self, t, what):
        M = self.n_microbatches
        if t is None:
            raise ValueError(f"this rank holds the {what} stage and needs the "
                             f"{'input' if what == 'first' else 'target'}")
        if t.shape[0] % M:
            raise ValueError(f"batch size {t.shape[0]} is not divisible by n_microbatches M={M}")
        return list(t.chunk(M, dim=0))

    def _split_args(self, args) -> list:
        """The M microbatches of stage 0's arguments, each a tuple (one entry per argument)."""
        if not args:
            self._split(None, "first")
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                raise ValueError(f"step argument {i} must be a tensor (split into M microbatches along dim 0), "
                                 f"got {type(a).__name__}")
        return list(zip(*(self._split(a, "first") for a in args)))

    # ------------------------------------------------------------------ step

    def step(self, *args, target=None, losses: list | None = None, forward_only: bool = False):
        """Run one schedule step: forward and backward of M microbatches.

        ``args``: the batch [B, ...] (needed on the rank of stage 0; several tensors become
        stage 0's positional arguments), ``target``: [B, ...] (needed on the rank of the last
        stage); B must be divisible by M. ``losses``: a list that receives the M unscaled
        microbatch losses (last stage). ``forward_only``: run the F actions only, without
        autograd (evaluation; keeps the last training step's in-flight and stash numbers).
        Returns the last stage's output [B, ...] on its rank (a tuple of concatenations if it
        returns a tuple), else None. Afterwards ``self.timeline`` holds this rank's
        :class:`TimedAction` list.
        """
        M, S = self.n_microbatches, self.num_stages
        x_mbs = self._split_args(args) if 0 in self._by_index else None
        needs_target = (S - 1) in self._by_index and self.loss_fn is not None
        t_mbs = self._split(target, "last") if needs_target and not (forward_only and target is None) else None
        if self._shapes is None:
            self._shapes = self._infer_shapes(x_mbs[0] if x_mbs else None)
        elif x_mbs is not None:
            got, want = [tuple(t.shape) for t in x_mbs[0]], [m.shape for m in self._shapes[0][0]]
            if got != want:
                raise ValueError(f"microbatch shape(s) {got} differ from the first step's {want}; build a new "
                                 f"schedule for another shape")
        st = _StepState(x_mbs, t_mbs, losses, forward_only, list(self._by_index))
        if dist.is_initialized():
            dist.barrier(group=self.group)  # a common start for every rank's timeline
        st.t0 = time.perf_counter()
        run = {"RECV_F": self._do_recv, "RECV_B": self._do_recv, "SEND_F": self._do_send,
               "SEND_B": self._do_send, "F": self._do_forward, "B": self._do_backward,
               "I": self._do_backward_input, "W": self._do_backward_weight}
        for a in self.actions[self.rank]:
            if forward_only and a.kind in ("B", "I", "W", "SEND_B", "RECV_B"):
                continue
            if a.kind not in run:
                raise ScheduleError(f"{self._who}: unknown action kind {a.kind!r}")
            run[a.kind](a, st)
            if self.cost_model and a.kind in self.cost_model and not st.forward_only:
                self._pad(st, self.cost_model[a.kind])
        for works, _, a in st.sends:
            for work in works:
                self._wait_or_explain(work, a, a)
        if st.pending:
            raise ScheduleError(f"{self._who}: receives posted but never used: {sorted(st.pending)}")
        self.events = st.events
        if not forward_only:
            self.stats = step_stats(st.events, self._by_index, M,
                                    self.w_only_bytes if self.measure_w_memory else None)
        if (S - 1) in self._by_index:
            outs = [st.results[m] for m in range(M)]
            if isinstance(outs[0], torch.Tensor):
                return torch.cat(outs, dim=0)
            return tuple(torch.cat(parts, dim=0) for parts in zip(*outs))
        return None

    # ------------------------------------------------------------------ the six actions

    def _do_recv(self, a: Action, st: "_StepState"):
        """Post an irecv for each input (RECV_F) or for each output gradient (RECV_B: only of
        the outputs that require grad, possibly none) of stage a.stage."""
        ins, outs = self._shapes[a.stage]
        fwd = a.kind == "RECV_F"
        metas = ins if fwd else [o for o in outs if o.requires_grad]
        device = self._by_index[a.stage].device
        bufs = [torch.empty(meta.shape, dtype=meta.dtype, device=device) for meta in metas]
        src = a.stage - 1 if fwd else a.stage + 1
        t = st.now()
        works = [comm.irecv(buf, self._peer(src), self.group) for buf in bufs]
        st.pending[(a.kind, a.stage, a.microbatch)] = (works, tuple(bufs), len(st.events))
        st.emit(a, t, tensor_bytes(bufs), end=t)

    def _do_send(self, a: Action, st: "_StepState"):
        """isend the output(s) of F (SEND_F) or the input gradient(s) of B (SEND_B: only of the
        inputs that require grad, possibly none); waited for at the end of the step."""
        key = (a.stage, a.microbatch)
        t = st.now()
        if a.kind == "SEND_F":
            if key not in st.outputs:
                raise ScheduleError(f"{self._who}: {a!r} before F{a.microbatch}@s{a.stage} ran")
            tensors, dst = tuple(o.detach() for o in st.outputs[key]), a.stage + 1
        else:
            if key not in st.grads:
                raise ScheduleError(f"{self._who}: {a!r} before B{a.microbatch}@s{a.stage} (or "
                                    f"I{a.microbatch}@s{a.stage}) ran")
            tensors, dst = st.grads.pop(key), a.stage - 1
        works = [comm.isend(t_, self._peer(dst), self.group) for t_ in tensors]
        st.sends.append((works, tensors, a))
        st.emit(a, t, tensor_bytes(tensors), end=t)

    def _do_forward(self, a: Action, st: "_StepState"):
        s, m = a.stage, a.microbatch
        stage = self._by_index[s]
        ins = self._shapes[s][0]
        if s == 0:
            inp = st.x_mbs[m]
        elif self._rank_of(s - 1) == self.rank:  # previous stage on this rank (K = 1; V placement's turn)
            inp = tuple(t.detach() for t in st.outputs[(s - 1, m)])
        else:
            inp = self._take(st, ("RECV_F", s, m), a)
        if s > 0 and not st.forward_only:
            for t, meta in zip(inp, ins):   # B needs the gradient of exactly these inputs
                t.requires_grad_(meta.requires_grad)
        start = st.now()
        target = st.t_mbs[m] if stage.is_last and st.t_mbs is not None else None
        out, loss, stash = self._forward(stage, inp, target, s, m, st.forward_only, st.rng)
        if stage.is_last:
            st.results[m] = out.detach() if isinstance(out, torch.Tensor) else tuple(o.detach() for o in out)
            if loss is not None and st.losses is not None:
                st.losses.append(loss.detach())
            # what B differentiates: the loss scaled by 1/M (nothing when no loss needs a gradient)
            st.outputs[(s, m)] = (loss / self.n_microbatches,) if loss is not None and loss.requires_grad else ()
        else:
            out = as_tuple(out, f"the output of stage {s} (sent to stage {s + 1})")
            if not (st.forward_only or self.recompute):   # (recompute: this forward ran without autograd)
                rg = [o.requires_grad for o in out]
                want = [meta.requires_grad for meta in self._shapes[s][1]]
                if rg != want:
                    raise ScheduleError(f"{self._who}: {a!r}: which outputs require grad {rg} changed since "
                                        f"the first step {want}; the next stage expects gradients for the latter")
            st.outputs[(s, m)] = out
        st.emit(a, start, stash)
        if st.forward_only:
            st.outputs.pop((s - 1, m), None)
            return
        st.inputs[(s, m)] = inp

    def _backward_inputs(self, a: Action, st: "_StepState", keep_inputs: bool):
        """What B and I share: the output gradient(s) (received, or from the next stage on this
        rank), the stage's outputs (re-materialised first under recompute) and the inputs.
        Returns ``(start, inp, tensors, grads)``: the outputs that carry a gradient and their
        gradients, paired. ``keep_inputs``: I keeps the inputs for W."""
        s, m = a.stage, a.microbatch
        stage = self._by_index[s]
        if stage.is_last:
            grads = None  # the scaled loss is a scalar
        elif self._rank_of(s + 1) == self.rank:  # next stage on this rank (K = 1; V placement's turn)
            grads = st.grads.pop((s + 1, m))
        else:
            grads = self._take(st, ("RECV_B", s, m), a)
        start = st.now()
        inp = st.inputs[(s, m)] if keep_inputs else st.inputs.pop((s, m))
        out = st.outputs.pop((s, m))
        if self.recompute:  # GPipe re-materialisation: run the forward again, now with autograd
            with replay_rng(stage.device, st.rng.pop((s, m))):  # same dropout masks as the forward
                out = stage.submod(*inp)
            if stage.is_last:
                loss = self.loss_fn(out, st.t_mbs[m]) / self.n_microbatches if st.t_mbs is not None else None
                out = (loss,) if loss is not None and loss.requires_grad else ()
            else:
                out = as_tuple(out, f"the output of stage {s}")
        # differentiate the outputs that carry a gradient; none: a frozen or parameter-free
        # stage fed by data, nothing to do (and no input gradient to send)
        tensors = [o for o in out if o.requires_grad]
        if grads is None:
            grads = (None,) * len(tensors)
        if len(tensors) != len(grads):
            raise ScheduleError(f"{self._who}: {a!r}: {len(tensors)} output(s) require grad but "
                                f"{len(grads)} gradient(s) arrived")
        return start, inp, tensors, grads

    def _do_backward(self, a: Action, st: "_StepState"):
        s, m = a.stage, a.microbatch
        stage = self._by_index[s]
        start, inp, tensors, grads = self._backward_inputs(a, st, keep_inputs=False)
        # a stage wrapped in DistributedDataParallel reduces its gradients in its last backward
        # of the step only; the others run under no_sync() (torch.distributed.pipelining's rule)
        st.n_backward[s] += 1
        last = st.n_backward[s] == self.n_microbatches
        with contextlib.nullcontext() if last or not hasattr(stage.submod, "no_sync") else stage.submod.no_sync():
            if tensors:
                torch.autograd.backward(tensors, grad_tensors=list(grads))  # parameter .grad accumulate
        if s > 0:
            st.grads[(s, m)] = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                                     for t, meta in zip(inp, self._shapes[s][0]) if meta.requires_grad)
        st.emit(a, start)

    # ------------------------------------------------------------------ split backward (zero bubble)

    def _pad(self, st: "_StepState", seconds: float):
        """Cost model: sleep until the compute action just recorded has lasted ``seconds``
        (from its start, after its input arrived), and stamp its new end."""
        e = st.events[-1]
        rest = e.start + seconds - st.now()
        if rest > 0:
            time.sleep(rest)
        st.events[-1] = e._replace(end=st.now())

    def _do_backward_input(self, a: Action, st: "_StepState"):
        """I: the gradient(s) with respect to the stage input(s) only (what stage s-1 waits
        for); the graph and what W needs stay alive (:mod:`.split_backward`)."""
        s, m = a.stage, a.microbatch
        stage = self._by_index[s]
        start, inp, tensors, grads = self._backward_inputs(a, st, keep_inputs=True)
        if self.measure_w_memory and not self.recompute and s not in self.w_only_bytes:
            self.w_only_bytes[s] = self._measure_w_only(stage, inp, grads, st, m)
            start = st.now()  # the measurement is not part of this I's time
        wants = [t for t, meta in zip(inp, self._shapes[s][0]) if meta.requires_grad] if s > 0 else []
        with _split_pass(stage.submod, last=False):
            gins, pending = backward_input(tensors, wants, list(grads), _compute_params(stage.submod))
        if s > 0:
            st.grads[(s, m)] = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(gins, wants))
        st.weight_grads[(s, m)] = pending
        st.emit(a, start, pending.nbytes)

    def _measure_w_only(self, stage: PipelineStage, inp, grads, st: "_StepState", m: int) -> int:
        """Bytes of one microbatch's saved activations that only W needs on ``stage``
        (:func:`.split_backward.w_only_saved_bytes` on a fresh forward of microbatch ``m``;
        the last stage differentiates its scaled loss). RNG states are restored afterwards."""
        module = getattr(stage.submod, "module", stage.submod)  # DDP: measure the wrapped module, no hooks
        if stage.is_last:
            target = st.t_mbs[m] if st.t_mbs is not None else None
            if target is None or self.loss_fn is None:
                return 0

            def fn(*x):
                return self.loss_fn(module(*x), target) / self.n_microbatches
            gs = None
        else:
            fn, gs = module, [g for g in grads if g is not None] if grads is not None else None
        devices = [] if stage.device.type == "cpu" else [stage.device]
        with torch.random.fork_rng(devices=devices):
            return w_only_saved_bytes(fn, [t.detach() for t in inp], gs, _compute_params(stage.submod))["w_only"]

    def _do_backward_weight(self, a: Action, st: "_StepState"):
        """W: the parameter gradients of (stage, microbatch) from what its I kept; they
        accumulate in ``.grad`` like B's (a DistributedDataParallel stage reduces in its last
        W of the step only). Frees the microbatch's activations."""
        s, m = a.stage, a.microbatch
        stage = self._by_index[s]
        start = st.now()
        st.n_backward[s] += 1
        last = st.n_backward[s] == self.n_microbatches
        pending = st.weight_grads.pop((s, m))
        with contextlib.nullcontext() if last or not hasattr(stage.submod, "no_sync") else stage.submod.no_sync(), \
                _split_pass(stage.submod, last):
            backward_weight(pending)
        st.inputs.pop((s, m))
        st.emit(a, start)

    # ------------------------------------------------------------------ waiting, and explaining a hang

    def _take(self, st: "_StepState", key, needed_by: Action):
        """Wait for a posted receive; returns its buffers and stamps the RECV's end time."""
        if key not in st.pending:
            raise ScheduleError(f"{self._who}: {needed_by!r} needs {key[0]}{key[2]}@s{key[1]}, which this "
                                f"rank did not post before it")
        works, bufs, i = st.pending.pop(key)
        for work in works:
            self._wait_or_explain(work, needed_by, st.events[i].action)
        st.events[i] = st.events[i]._replace(end=st.now())
        return bufs

    def _wait_or_explain(self, work, a: Action, comm_action: Action):
        """Wait for one message of ``comm_action`` (which ``a`` needs); on a timeout or failure
        raise a RuntimeError whose first line names the first action that cannot complete."""
        try:
            self._wait(work)
        except Exception as e:
            raise RuntimeError(explain_hang(self.actions, self.rank, a, comm_action, e, self._global)) from e

    def _forward(self, st: PipelineStage, inp, target, s, m, forward_only, rng):
        """Stage forward (and loss when ``target`` is given); returns (output, loss or None,
        bytes stashed for backward). The loss is the unscaled microbatch mean."""
        def run():
            out = st.submod(*inp)
            return out, (self.loss_fn(out, target) if target is not None else None)

        if forward_only:
            with torch.no_grad():
                return (*run(), 0)
        if self.recompute:
            rng[(s, m)] = rng_state(st.device)
            with torch.no_grad():
                out, loss = run()
            return out, loss, tensor_bytes(inp)
        if s in self._stash_cache:  # same shapes every microbatch: measure once per stage
            return (*run(), self._stash_cache[s])
        seen: dict = {}
        params = self._param_ptrs[s]

        def pack(t):
            stor = t.untyped_storage()
            ptr = stor.data_ptr()
            if ptr not in params:
                seen[ptr] = stor.nbytes()
            return t.detach()   # not t: a saved output would hold its own node (a cycle; see checkpoint._Saved)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, loss = run()
        self._stash_cache[s] = sum(seen.values())
        return out, loss, self._stash_cache[s]
