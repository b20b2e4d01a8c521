"""``lab 3d --impl torch|both``: the same training with PyTorch's own APIs, beside labkit's.

:class:`labkit.parallel.torch_native.TorchNativeGPT` (DeviceMesh, ``parallelize_module`` with the
TP/SP plan table, FSDP2 ``fully_shard`` on the dp mesh, ``torch.distributed.pipelining``) trains
the lab's GPT on the lab's batches with Adam, under the labs' one harness and verdict
(:class:`labkit.labs.verdict.Lockstep`: every rank's full parameters and gradients, the
``full_tensor()`` of its DTensors, against the single-device model at the same parameters, every
step). Its collectives are counted by :class:`labkit.parallel.torch_native.TorchCommLog` and laid
out per axis as labkit's :class:`labkit.comm.CommLog` counts labkit's, so the two runs' tables sit
side by side (:func:`side_by_side`), with the memory per rank and the step-time ratio
labkit / torch (two separate launches on the same cores: a ratio, noisy on a shared machine).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ..labs.harness import lockstep
from .threed_setup import RankMeasures

__all__ = ["TorchRankResult", "torch_worker", "torch_bad_args", "side_by_side", "torch_run_name"]


@dataclass
class TorchRankResult(RankMeasures):
    """One rank of the torch-native run: what every rank reports (:class:`RankMeasures`), and
    ``seconds`` (the timed steps: 1.. without the counting of the last step), ``timed``: how many,
    ``memory`` (peak ``{"params", "grads", "optimizer"}`` bytes),
    ``verdict`` (rank 0's LockstepResult, else None)."""
    seconds: float
    memory: dict
    verdict: object
    timed: int = 0


def torch_run_name(a) -> str:
    return f"torch t{a.tp} p{a.pp} d{a.dp} {a.schedule}"


def torch_bad_args(a) -> str | None:
    """The first rule ``--impl torch`` adds (:func:`labkit.parallel.torch_native.check_torch_layout`),
    as one line; None if the layout runs."""
    from ..parallel.torch_native import check_torch_layout
    from .threed_setup import _config, _v
    try:
        check_torch_layout(_config(a), a.tp, a.pp, a.dp, _v(a), a.microbatches, a.batch, a.schedule, zero=a.zero,
                           hsdp=a.hsdp, sequence_parallel=a.sp, seq_len=a.seq, cp=a.cp, recompute=a.recompute,
                           moe=a.moe)
    except ValueError as e:
        return str(e)
    return None


def torch_worker(ctx, a, corpus) -> TorchRankResult:
    """One rank of the torch-native training (Adam, ``a.lr``), checked by the labs' Lockstep."""
    from ..parallel.torch_native import TorchCommLog, TorchNativeGPT, build_mesh
    from .threed_setup import _batch, _loss, _model, _v
    from .verdict import Piece

    torch.manual_seed(a.seed)
    mesh = build_mesh(a.tp, a.pp, a.dp, a.zero, a.hsdp, "cuda" if ctx.device.type == "cuda" else "cpu")
    model = TorchNativeGPT(_model(a), mesh, a.schedule, a.microbatches, _v(a), zero=a.zero,
                           sequence_parallel=a.sp)
    opt = model.make_optimizer("adam", a.lr)

    def ref_loss(ref, step, extras):
        x, y = _batch(a, corpus, step)
        return _loss(ref, x.to(ctx.device), y.to(ctx.device))

    check = lockstep(ctx, a, lambda: _model(a), ref_loss)
    losses, comm, wire, seconds, timed = [], [], [], 0.0, 0
    peak = {"params": 0, "grads": 0, "optimizer": 0}
    for step in range(a.steps):
        # TorchCommLog sees every op (a dispatch mode): only the first and the last step are counted, and
        # only the steps between them timed (step 0 is warm-up; with 2 steps the counted last one is timed)
        counted = step in (0, a.steps - 1)
        logs = (TorchCommLog(), TorchCommLog()) if counted else (contextlib.nullcontext(),) * 2
        x, y = _batch(a, corpus, step)
        model.zero_grad()
        t0 = time.perf_counter()
        with logs[0]:
            loss = model.train_step(x, y)
        t_bwd = time.perf_counter() - t0
        grads, params = model.full_tensors("grad"), dict(model.full_tensors("param"))   # inspection, not counted
        check.step(step, [Piece(n, params[n], g) for n, g in grads], loss=loss)
        t1 = time.perf_counter()
        with logs[1]:
            opt.step()
        if step >= 1 and (not counted or a.steps == 2):
            seconds += t_bwd + time.perf_counter() - t1
            timed += 1
        if counted:
            records = logs[0].records + logs[1].records
            comm.append(model.comm_by_axis(records))
            wire.append(model.wire_by_axis(records))
        losses.append(loss)
        peak = {k: max(peak[k], v) for k, v in model.memory().items()}
    return TorchRankResult(ctx.rank, model.tp_rank, model.dp_rank, model.pp_rank, model.has_last_stage, losses,
                           comm, wire, seconds, peak, check.result(), timed)


_LABELS = {"tp": "TP", "cp": "CP", "pp": "PP", "dp": "DP", "ep": "EP", "embedding": "embedding", "loss": "loss",
           "other": "other"}


def _mib(b) -> float:
    return b / 2**20


def _busiest(ranks, ax, kind):
    """(count, bytes) of the rank with the most bytes of (axis, kind) in the last step."""
    vals = [r.comm[-1].get(ax, {}).get(kind, (0, 0)) for r in ranks]
    return max(vals, key=lambda c: (c[1], c[0])) if vals else (0, 0)


def side_by_side(a, lk_ranks, th_ranks) -> list[str]:
    """Lines: the per-axis communication of the last step (busiest rank per row) of labkit's run and
    torch's, the memory per rank (max over ranks) of each, and the step time of each with the ratio
    labkit / torch. ``lk_ranks`` may be None (``--impl torch``): torch's column alone."""
    rows = []
    runs = [("labkit", lk_ranks), ("torch", th_ranks)] if lk_ranks is not None else [("torch", th_ranks)]
    keys = sorted({(ax, k) for _, rs in runs for r in rs for ax, kinds in r.comm[-1].items() for k in kinds},
                  key=lambda x: (list(_LABELS).index(x[0]) if x[0] in _LABELS else 99, x[1]))
    head = f"{'axis':<10}{'collective':<16}" + "".join(f"{name + ' count':>14}{name + ' MiB':>12}" for name, _ in runs)
    rows += [head, "-" * len(head)]
    for ax, k in keys:
        cells = "".join(f"{c:>14d}{_mib(b):>12.4f}" for c, b in (_busiest(rs, ax, k) for _, rs in runs))
        rows.append(f"{_LABELS.get(ax, ax):<10}{k:<16}{cells}")
    wire = "; ".join(f"{name} " + ", ".join(
        f"{_LABELS.get(ax, ax)} {_mib(max(r.wire[-1].get(ax, 0) for r in rs)):.4f}"
        for ax in sorted({ax for r in rs for ax in r.wire[-1]}, key=lambda x: list(_LABELS).index(x)
                         if x in _LABELS else 99)) for name, rs in runs)
    rows.append(f"MiB sent per step on the wire (ring algorithms, busiest rank): {wire}")
    rows.append("")
    rows.append(f"{'per rank (max)':<16}" + "".join(f"{name + ' ' + k:>20}" for name, _ in runs
                                                    for k in ("params", "grads", "optim")))
    vals = "".join(f"{_mib(max(r.memory[k] for r in rs)):>20.4f}" for _, rs in runs
                   for k in ("params", "grads", "optimizer"))
    rows.append(f"{'MiB':<16}{vals}")
    secs = {name: max(r.seconds / max(1, getattr(r, "timed", a.steps - 1)) for r in rs) for name, rs in runs}
    if a.steps > 1:
        line = "step time (slowest rank, mean of the timed steps; torch's without its op-level counting): " + ", ".join(
            f"{name} {1e3 * s:.1f} ms" for name, s in secs.items())
        if lk_ranks is not None:
            line += f"; ratio labkit / torch = {secs['labkit'] / secs['torch']:.2f} (below 1: labkit faster)"
        rows.append(line)
    return rows


def _expected_torch(a, pp_rank, planner: dict) -> dict:
    """``{(axis, kind): ((count, bytes), reason)}``: what the torch-native run should count on pipeline rank
    ``pp_rank`` per step where it differs from the planner's (labkit's) formula (``planner``: that rank's
    ``{axis: {kind: (count, bytes)}}``), each with the reason; lines absent here should equal the planner."""
    from ..pipeline.stages import stage_layers
    from .threed_setup import _v
    v, M, t, d = _v(a), a.microbatches, a.tp, a.dp
    n = a.pp * v
    stages = [s for s in range(n) if s % a.pp == pp_rank]
    blocks = sum(len(stage_layers(a.layers, n, s)) for s in stages)
    emb, head = 0 in stages, n - 1 in stages
    units = blocks + emb + head                       # FSDP units holding parameters (the roots hold none)
    b, S, H, e = a.batch // (d * M), a.seq, a.embd, 4
    out = {}

    def plan(ax, kind):
        return planner.get(ax, {}).get(kind, (0, 0))
    if d > 1 and a.zero == 0:
        out[("dp", "all_reduce")] = ((units, plan("dp", "all_reduce")[1]),
                                     "one all-reduce per FSDP unit (FSDP2 over the replicate-only mesh); the "
                                     "planner counts one per model chunk (labkit: one per bucket): same bytes")
    if d > 1 and a.zero == 2:
        for kind in ("all_gather", "reduce_scatter"):
            out[("dp", kind)] = ((units, plan("dp", kind)[1]),
                                 "one per FSDP unit (gathered in the first forward and kept: reshard_after_forward="
                                 "False); the planner counts one per model chunk: same bytes")
    if d > 1 and a.zero == 3:
        c, nbytes = plan("dp", "all_gather")
        out[("dp", "all_gather")] = ((units * (M + 1), nbytes * (M + 1) // (2 * M)),
                                     f"FSDP2 under torch's schedule gathers a unit before each of the M={M} forwards "
                                     f"(resharded after each) and once for the backwards (kept gathered until the "
                                     f"step's last), M + 1 = {M + 1}; labkit's ZeRO-3 before every forward and "
                                     f"backward, 2M = {2 * M} (same bytes per gather while d divides every "
                                     f"parameter's dim 0)")
        out[("dp", "reduce_scatter")] = ((units, plan("dp", "reduce_scatter")[1]), "one per FSDP unit")
    if t > 1 and a.sp:
        act = b * (S // t) * H * e
        c, nbytes = plan("tp", "all_gather")
        regather = M * (2 * blocks + head)
        wpe = M if emb else 0
        out[("tp", "all_gather")] = ((c - regather + wpe, nbytes - regather * act + wpe * (S // t) * H * e),
                                     f"labkit gathers each column-parallel input again in backward ({regather} "
                                     f"here, Korthikanti et al.'s memory choice), torch keeps the gathered copy"
                                     + (f"; torch gathers the position table's gradient in each microbatch's "
                                        f"backward ({wpe} of S/t x H)" if emb else ""))
        norms = 4 * blocks + 2 * head
        out[("tp", "all_reduce")] = ((3 * M * head + norms, 3 * M * head * b * S * e + norms * H * e),
                                     f"torch all-reduces each SequenceParallel LayerNorm weight and bias alone "
                                     f"({norms} of H), labkit all its SP parameters' gradients (norms, position "
                                     f"table, row-parallel biases) flat, once per step"
                                     + ("; the loss's 3 per microbatch the same" if head else ""))
    return out


def planner_lines(a, th_ranks, planner, memory=None) -> list[str]:
    """Lines: per pipeline rank (its d0 t0 rank), the torch-native run's counted collectives of the last step
    next to the planner's (``planner``: ``{pp_rank: {axis: {kind: (count, bytes)}}}``, labkit's formulas),
    each line ``=`` (equal), ``explained`` (equal to :func:`_expected_torch`'s value, reason printed) or
    ``not modeled``; then the memory per rank next to the planner's."""
    rows = [f"{'pp':>2} {'axis':<5}{'collective':<15}{'torch':>16}{'planner':>16}  agreement",
            "-" * 78]
    reasons = {}
    for r in sorted((r for r in th_ranks if r.tp_rank == 0 and r.dp_rank == 0), key=lambda r: r.pp_rank):
        got, want = r.comm[-1], planner[r.pp_rank]
        expl = _expected_torch(a, r.pp_rank, want)
        for ax in sorted(set(got) | set(want)):
            for kind in sorted(set(got.get(ax, {})) | set(want.get(ax, {}))):
                g, w = got.get(ax, {}).get(kind, (0, 0)), want.get(ax, {}).get(kind, (0, 0))
                if g == w:
                    status = "="
                elif (ax, kind) in expl and expl[(ax, kind)][0] == g:
                    key = len(reasons) + 1 if expl[(ax, kind)][1] not in reasons else reasons[expl[(ax, kind)][1]]
                    reasons.setdefault(expl[(ax, kind)][1], key)
                    status = f"explained [{reasons[expl[(ax, kind)][1]]}]"
                else:
                    status = "not modeled"
                rows.append(f"{r.pp_rank:>2} {ax:<5}{kind:<15}{f'{g[0]} x {g[1]} B':>16}{f'{w[0]} x {w[1]} B':>16}  "
                            f"{status}")
    rows += [f"  [{k}] {why}" for why, k in sorted(reasons.items(), key=lambda x: x[1])]
    if memory is not None:      # the planner's RankMemory per pipeline rank
        rows.append(f"{'pp':>2} {'bytes per rank':<20}{'torch':>10}{'planner':>10}  agreement")
        for r in sorted((r for r in th_ranks if r.tp_rank == 0 and r.dp_rank == 0), key=lambda r: r.pp_rank):
            pm = memory[r.pp_rank]
            for k in ("params", "grads", "optimizer"):
                g, w = r.memory[k], getattr(pm, k)
                status = "=" if g == w else (
                    "explained: FSDP2 keeps the parameters sharded between steps (reshard_after_forward=False is "
                    "ZeRO-2's traffic with ZeRO-3's parameter memory)" if k == "params" and a.zero == 2
                    and g == pm.grads else "not modeled")
                rows.append(f"{r.pp_rank:>2} {k:<20}{g:>10}{w:>10}  {status}")
    return rows
