"""The labs' verdict: is the parallel run training the single-device model, step by step?

Why not compare loss curves. Two fp32 trainings of the same model, one on 1 rank and one on
N, differ at step 1 by ~1e-7 (the sums run in another order). Adam then amplifies that
difference step after step, and with MoE a top-k choice that flips makes it jump: after tens
of steps two *correct* runs have visibly different curves. A threshold on the curves either
cries wolf (a tight one) or lets bugs through (a loose one).

What is compared instead (the rule of every lab). At every step, after the parallel run's
backward and before its optimizer step, every rank sends the parameters it holds (whole
tensors or shards), their gradients and its loss to rank 0. Rank 0 loads those parameters
into the single-device reference model, runs its forward and backward on the same batch and
compares:

* the loss: ``|loss - loss_ref| <= atol + rtol * |loss_ref|``;
* every gradient element of every copy or shard:
  ``|g - g_ref| <= atol + rtol * max|g_ref|`` (the max over that parameter's full tensor, so an
  element that is ~0 in a large tensor is held to the tensor's scale, not to 0);
* NaN or inf in any loss or gradient of either side: always FAIL; when the reference itself
  gives NaN/inf at those parameters, the verdict says training diverged (on one device too);
* every element of every reference parameter must be covered by some rank's piece.

Defaults ``rtol = 1e-5, atol = 1e-6`` (the kit's fp32 rule). Because both sides are evaluated at
the *same* parameters, the error does not accumulate: a correct run passes for any seed, any
number of steps, any grid and schedule, while a bug (a gradient scaled by M or t, a missing
all-reduce, a dropped microbatch, a wrong schedule) shows at the step where it acts, usually
step 0, by orders of magnitude.

Rank side (every rank calls it, collectively, every step)::

    check = Lockstep(ctx.group, ctx.rank, reference=ref if ctx.rank == 0 else None,
                     loss_fn=lambda model, step, extras: model(x_of(step), y_of(step)))
    ...                    # forward + backward of the parallel model
    check.step(step, module_pieces(my_module), loss=my_loss_or_None)
    opt.step()
    return {"verdict": check.result(), ...}     # rank 0's result holds the records

Parent side: ``ok, text = report({"1f1b": result, ...})`` prints the fixed wording (what was
compared, the tolerance, why the loss curves may drift) and one line per run.
A new lab (3D, ZeRO, ...) needs only :class:`Piece` lists that name the reference's
parameters; :func:`module_pieces` and :func:`sharded_pieces` build the usual ones.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..grid import even_part

__all__ = ["RTOL", "ATOL", "Piece", "module_pieces", "sharded_pieces", "Lockstep", "LockstepResult",
           "StepRecord", "report", "verdict_exit", "RULE", "add_tolerance_option", "check_tolerance"]

RTOL = 1e-5  # relative tolerance (of the reference tensor's largest magnitude)
ATOL = 1e-6  # absolute floor

RULE = (
    "verdict rule: at every step the parallel run's loss and every parameter gradient (each rank's copy\n"
    "or shard) were compared with the single-device model's, evaluated AT THE SAME PARAMETERS (the\n"
    "parallel run's, loaded into the reference) on the same batch: |g - g_ref| <= atol + rtol*max|g_ref|\n"
    "per parameter tensor, |loss - loss_ref| <= atol + rtol*|loss_ref|, rtol={rtol:g}, atol={atol:g};\n"
    "NaN or inf anywhere is a FAIL. The loss curves in the plot are two separate trainings: they start\n"
    "~1e-7 apart (sums in another order) and may drift apart over many Adam steps (with MoE a flipped\n"
    "top-k choice makes them jump) without anything being wrong; the verdict does not use them."
)


@dataclass
class Piece:
    """One rank's part of one reference parameter (or buffer).

    ``name``: the parameter's (or buffer's) name in the reference model (``named_parameters``
    / ``named_buffers``). ``value``: this rank's copy or shard. ``grad``: its gradient (None for
    a buffer, which is only loaded). ``index``: where ``value`` sits in the full tensor,
    ``full[index]`` has ``value``'s shape (a tuple of slices, as from :func:`sharded_pieces`);
    None: the whole tensor.
    """

    name: str
    value: torch.Tensor
    grad: torch.Tensor | None = None
    index: tuple | None = None

    def cpu(self) -> "Piece":
        return Piece(self.name, self.value.detach().cpu(),
                     None if self.grad is None else self.grad.detach().cpu(), self.index)


def module_pieces(module: nn.Module, rename: Callable[[str], str] = lambda n: n,
                  buffers: bool = True) -> list[Piece]:
    """Whole-tensor pieces: every parameter (with its gradient; a missing ``.grad`` counts as
    zeros) and, with ``buffers``, every buffer of ``module``, named ``rename(local_name)``."""
    out = [Piece(rename(n), p.detach(), p.grad if p.grad is not None else torch.zeros_like(p))
           for n, p in module.named_parameters()]
    if buffers:
        out += [Piece(rename(n), b.detach()) for n, b in module.named_buffers()]
    return out


def sharded_pieces(module: nn.Module, rank: int, size: int, rename: Callable[[str], str] = lambda n: n,
                   buffers: bool = True) -> list[Piece]:
    """Like :func:`module_pieces` for a Megatron-sharded module: a parameter marked
    ``tensor_model_parallel`` with ``partition_dim`` d is the ``rank``-th of ``size`` equal
    consecutive blocks of the full tensor along d (how :mod:`labkit.tensor_parallel` shards)."""
    out = []
    for piece, (_, p) in zip(module_pieces(module, rename, buffers=False), module.named_parameters()):
        if getattr(p, "tensor_model_parallel", False) and size > 1:
            d, n = p.partition_dim, p.shape[p.partition_dim]
            piece.index = (slice(None),) * d + (even_part(n * size, size, rank),)
        out.append(piece)
    if buffers:
        out += [Piece(rename(n), b.detach()) for n, b in module.named_buffers()]
    return out


@dataclass
class StepRecord:
    """One step's comparison. ``loss``/``ref_loss``: nats (None if no rank reported a loss);
    ``loss_err``, ``grad_err``: largest |difference| divided by its allowed bound (<= 1 passes);
    ``grad_diff``/``grad_bound``: the worst gradient's |difference| and bound, ``worst``: its name;
    ``problem``: why the step fails outside the numbers (NaN, a missing parameter, ...), else None;
    ``diverged``: the reference itself (the single-device model) gave NaN/inf loss or gradients
    at these parameters: training diverged, whichever side runs it; ``nonfinite``: NaN/inf was
    found anywhere (parameters, gradients or losses of either side)."""

    step: int
    loss: float | None
    ref_loss: float
    loss_err: float
    grad_err: float
    grad_diff: float
    grad_bound: float
    worst: str
    problem: str | None = None
    diverged: bool = False
    nonfinite: bool = False

    @property
    def ok(self) -> bool:
        return self.problem is None and self.loss_err <= 1.0 and self.grad_err <= 1.0


@dataclass
class LockstepResult:
    """What :meth:`Lockstep.result` returns on rank 0 (picklable): tolerances and one
    :class:`StepRecord` per step."""

    rtol: float
    atol: float
    records: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.records) and all(r.ok for r in self.records)

    def first_failure(self) -> StepRecord | None:
        return next((r for r in self.records if not r.ok), None)


DIVERGED = "training diverged (NaN/inf) on the single device too: lower --lr"


def _names(names: Sequence[str], first: int = 3) -> str:
    """``a, b, c and 7 more``: a FAIL line names a few parameters, never hundreds."""
    names = list(dict.fromkeys(names))
    more = len(names) - first
    return ", ".join(names[:first]) + (f" and {more} more" if more > 0 else "")


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all()) if t.is_floating_point() else True


class Lockstep:
    """Compares a parallel run with the single-device reference at the same parameters, every step.

    Args: ``group`` (the process group of all ranks of the run), ``rank`` (this rank's rank in
    ``group``), ``reference`` (rank 0 only: the single-device model, on the device where it
    should run; its parameters are overwritten every step), ``loss_fn(reference, step, extras)``
    (rank 0 only: the reference's loss on step ``step``'s whole batch, a 0-d tensor; or a tuple
    ``(loss, problem)`` where a non-None ``problem`` string fails the step; ``extras`` is the
    list of every rank's ``extra`` argument to :meth:`step`, in rank order), ``rtol``, ``atol``.
    The losses the ranks report are averaged (ranks that do not compute it pass None), so each
    reported loss must be the mean over an equal share of the batch (or the whole batch).

    Communication: one ``gather_object`` to rank 0 and one barrier per step, outside
    :class:`labkit.comm.CommLog` (it calls ``torch.distributed`` directly, so the lab's counted
    bytes are the training's only).
    """

    def __init__(self, group, rank: int, reference: nn.Module | None = None,
                 loss_fn: Callable | None = None, rtol: float = RTOL, atol: float = ATOL):
        if rank == 0 and (reference is None or loss_fn is None):
            raise ValueError("rank 0 of a Lockstep needs the reference model and loss_fn")
        check_tolerance(rtol, "rtol")
        check_tolerance(atol, "atol")
        self.group, self.rank, self.reference, self.loss_fn = group, rank, reference, loss_fn
        self._result = LockstepResult(rtol, atol)

    def step(self, step: int, pieces: Sequence[Piece], loss: float | torch.Tensor | None = None,
             extra: Any = None) -> None:
        """Collective: every rank calls it once per step, after backward, before the optimizer."""
        if isinstance(loss, torch.Tensor):
            loss = float(loss.detach())
        payload = ([p.cpu() for p in pieces], loss, extra)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            gathered = [None] * dist.get_world_size(self.group) if self.rank == 0 else None
            dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            dist.gather_object(payload, gathered, dst=dst, group=self.group)
        else:
            gathered = [payload]
        if self.rank == 0:
            self._result.records.append(self._compare(step, gathered))
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)  # every rank starts the next step together (timelines)

    def result(self) -> LockstepResult | None:
        """Rank 0: the records so far; other ranks: None."""
        return self._result if self.rank == 0 else None

    def _compare(self, step: int, gathered: list) -> StepRecord:
        rtol, atol = self._result.rtol, self._result.atol
        ref = self.reference
        params, buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
        problems = []
        covered = {n: torch.zeros(p.shape, dtype=torch.bool) for n, p in params.items()}
        pieces = [p for ps, _, _ in gathered for p in ps]
        with torch.no_grad():
            for p in pieces:
                target = params.get(p.name, buffers.get(p.name))
                if target is None:
                    raise ValueError(f"piece {p.name!r} names no parameter or buffer of the reference")
                idx = p.index if p.index is not None else ...
                if tuple(target[idx].shape) != tuple(p.value.shape):
                    raise ValueError(f"piece {p.name!r}{'' if p.index is None else list(p.index)} has shape "
                                     f"{tuple(p.value.shape)}, the reference's part {tuple(target[idx].shape)}")
                target[idx] = p.value.to(target.device, target.dtype)
                if p.name in covered:
                    covered[p.name][idx] = True
        missing = [n for n, c in covered.items() if not bool(c.all())]
        if missing:
            problems.append(f"no rank holds (all of) {_names(missing)}")
        nan_params, differ = [], []
        for p in pieces:  # copies of one parameter on several ranks must agree
            target = params.get(p.name, buffers.get(p.name))
            part = target.detach()[p.index if p.index is not None else ...].cpu()
            if not _finite(p.value):
                nan_params.append(p.name)
            elif p.value.is_floating_point() and not torch.allclose(p.value.to(part.dtype), part, rtol, atol):
                differ.append(p.name)
        if nan_params:
            problems.append(f"parameters hold NaN/inf: {_names(nan_params)}")
        if differ:
            problems.append(f"the ranks' copies differ: {_names(differ)}")
        for q in params.values():
            q.grad = None
        out = self.loss_fn(ref, step, [e for _, _, e in gathered])
        ref_loss, problem = out if isinstance(out, tuple) else (out, None)
        if problem:
            problems.append(problem)
        ref_loss.backward()
        ref_loss = float(ref_loss.detach())
        losses = [l for _, l, _ in gathered if l is not None]
        loss = sum(losses) / len(losses) if losses else None
        loss_err = 0.0
        # diverged: the reference is NaN/inf at finite parameters (NaN parameters: the update did it)
        diverged = not nan_params and not math.isfinite(ref_loss) or not nan_params and any(
            q.grad is not None and not _finite(q.grad) for q in params.values())
        if loss is not None:
            if not (math.isfinite(loss) and math.isfinite(ref_loss)):
                problems.append(f"loss is {loss} (reference {ref_loss})")
            else:
                loss_err = abs(loss - ref_loss) / (atol + rtol * abs(ref_loss))
        worst = (0.0, 0.0, 0.0, "")
        scale = {}
        nan_grads = {"parallel run": [], "reference": []}
        for p in pieces:
            if p.grad is None or p.name not in params:
                continue
            g_ref = params[p.name].grad
            if g_ref is None:
                g_ref = torch.zeros_like(params[p.name])
            if p.name not in scale:
                scale[p.name] = float(g_ref.abs().max()) if g_ref.numel() else 0.0
            g_ref = g_ref.detach()[p.index if p.index is not None else ...].cpu().to(p.grad.dtype)
            if not (_finite(p.grad) and _finite(g_ref)):
                nan_grads["parallel run" if not _finite(p.grad) else "reference"].append(p.name)
                continue
            bound = atol + rtol * scale[p.name]
            diff = float((p.grad - g_ref).abs().max()) if p.grad.numel() else 0.0
            if diff / bound > worst[0]:
                worst = (diff / bound, diff, bound, p.name)
        for side, names in nan_grads.items():
            if names:
                problems.append(f"gradients hold NaN/inf ({side}): {_names(names)}")
        nonfinite = bool(diverged or nan_params or any(nan_grads.values())
                         or (loss is not None and not math.isfinite(loss)))
        if diverged:  # the reference is NaN/inf at these parameters: one short line says so
            problems = [DIVERGED]
        return StepRecord(step, loss, ref_loss, loss_err, worst[0], worst[1], worst[2], worst[3],
                          "; ".join(dict.fromkeys(problems)) or None, diverged, nonfinite)


def _diverged(res: LockstepResult, reference_losses) -> bool:
    """True when ``res`` fails because training diverged: its first failing step is NaN/inf and
    the single-device training diverged too (NaN/inf in ``reference_losses``, the lab's own
    single-device run), or the reference gave NaN/inf at finite parameters."""
    bad = res.first_failure()
    if bad is None:
        return False
    ref_bad = reference_losses is not None and not all(math.isfinite(x) for x in reference_losses)
    return bad.diverged or (ref_bad and bad.nonfinite)


def report(results: dict, rtol: float | None = None, atol: float | None = None,
           reference_losses: Sequence[float] | None = None) -> tuple[bool, str]:
    """The verdict text every lab prints: the rule (what was compared, the tolerance, why the
    curves may drift), then one line per run. ``results``: run name -> :class:`LockstepResult`;
    ``reference_losses``: the lab's single-device training losses, if it ran one (NaN/inf there
    turns a NaN failure's line into the one short "training diverged" line).
    Returns ``(ok, text)``; ok is False when any run has a failing step or no steps."""
    first = next(iter(results.values()), None)
    rtol = first.rtol if rtol is None and first is not None else (RTOL if rtol is None else rtol)
    atol = first.atol if atol is None and first is not None else (ATOL if atol is None else atol)
    lines = [RULE.format(rtol=rtol, atol=atol)]
    ok = bool(results)
    width = max((len(n) for n in results), default=0)
    for name, res in results.items():
        bad = res.first_failure()
        n_bad = sum(not r.ok for r in res.records)
        if not res.records:
            ok = False
            lines.append(f"FAIL {name:<{width}}  no step was compared")
        elif bad is None:
            w = max(res.records, key=lambda r: max(r.grad_err, r.loss_err))
            err = max(w.grad_err, w.loss_err)
            if err == 0 and w.grad_diff == 0:   # nothing to name as "largest": say it matched exactly
                lines.append(f"OK   {name:<{width}}  {len(res.records)} steps; every loss and gradient equals the "
                             f"single device's exactly (difference 0)")
            else:
                lines.append(f"OK   {name:<{width}}  {len(res.records)} steps; largest error {err:.2g} of the "
                             f"tolerance (step {w.step}: gradient of {w.worst or '-'} off by {w.grad_diff:.1e}, "
                             f"allowed {w.grad_bound:.1e})")
        else:
            ok = False
            if _diverged(res, reference_losses):
                why = DIVERGED
            elif bad.problem:
                why = bad.problem
            elif bad.grad_err > 1:
                why = (f"gradient of {bad.worst} differs by {bad.grad_diff:.3g} > allowed {bad.grad_bound:.2g}")
            else:
                why = f"loss {bad.loss:.7g} vs reference {bad.ref_loss:.7g}"
            lines.append(f"FAIL {name:<{width}}  step {bad.step} (first of {n_bad} failing of {len(res.records)}): "
                         f"{why}")
    return ok, "\n".join(lines)


def check_tolerance(value: float, flag: str = "--tolerance") -> float:
    """``value`` if it is a finite number > 0, else ValueError naming the flag and the value."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{flag} must be a finite number > 0, got {value}")
    return float(value)


def add_tolerance_option(parser: argparse.ArgumentParser) -> None:
    """``--tolerance RTOL`` (default 1e-5) for a lab's parser; atol is RTOL/10."""
    parser.add_argument("--tolerance", type=float, default=RTOL,
                        help="verdict's relative tolerance rtol (atol = rtol/10): see labkit/labs/verdict.py")


def verdict_exit(results: dict, reference_losses: Sequence[float] | None = None) -> int:
    """Print :func:`report` (stdout) and the one-line conclusion: ``OK: ...`` on stdout (returns 0)
    or ``FAIL: ...`` on stderr (returns 1); when every failing run diverged (see :func:`report`'s
    ``reference_losses``) that line is ``FAIL: training diverged (NaN/inf) on the single device
    too: lower --lr``. Every lab ends with this."""
    import sys
    ok, text = report(results, reference_losses=reference_losses)
    print("\n" + text)
    if ok:
        print(f"OK: every run ({', '.join(results)}) equals single-device training at every step")
        return 0
    bad = [n for n, r in results.items() if not r.ok]
    if bad and all(_diverged(results[n], reference_losses) for n in bad):
        print(f"FAIL: {DIVERGED}", file=sys.stderr)
    else:
        print(f"FAIL: {_names(bad)} differ from single-device training (see the lines above)", file=sys.stderr)
    return 1
