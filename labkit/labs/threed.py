"""Lab: 3D parallelism, TP x PP x DP on one process grid, proved equal to one device.

    python -m labkit lab 3d [--tp 2] [--pp 2] [--dp 2] [--schedule 1f1b|gpipe|interleaved|zb-h1|zbv|dualpipev]
                            [--chunks v] [--microbatches M] [--zero [STAGE]] [--hsdp R] [--tied] [--sp]
                            [--recompute none|selective|full] [--steps N] [--data PATH]
                            [--cp C --cp-attention ring|allgather|ulysses] [--cp-no-load-balance]
                            [--ignore-frac F]
    torchrun --nproc-per-node 8 -m labkit.labs.threed --tp 2 --pp 2      # d = WORLD_SIZE / (t*p*cp)

Megatron-LM's recipe (Narayanan et al. 2021, sec. 3.3): N = t * p * d devices; TP inside a node
(the all-reduces of every layer need the fastest links), PP across nodes (one activation per
microbatch and stage boundary), t * p just large enough for the model to fit, then DP to scale.
The GPT is built from the reference GPT's weights on the grid (:class:`labkit.parallel.ParallelGPT`)
and trained on the default corpus with Adam; the same training runs once on a single device.

Printed: one table per axis (collectives and bytes per step counted on each rank next to the
formula: TP all-reduces, PP sends, DP all-reduce or reduce-scatter/all-gather, the tied
embedding's all-reduce), the measured pipeline bubble next to (p-1)/(vM+p-1), the share of the
DP all-reduce time hidden behind backward, peak parameter/gradient/optimizer bytes per rank and
tokens per second; per rank a table of measured bytes next to the planner's (:mod:`labkit.plan`):
parameters, gradients and optimizer state (exact; ``--zero 3`` also the peak of the gathered FSDP
units), activations (the peak of the last step measured with saved_tensors_hooks, within 2 %) and
the payload bytes per axis (exact; DDP and ZeRO-2 count one collective per gradient bucket, the
planner one per chunk: compared by bytes); then the verdict of
:mod:`labkit.labs.verdict` (every step, loss and every gradient against the single-device model
at the same parameters). Exit status 1 when the verdict or a count fails. Saved under
``runs/3d-<time>/``: ``loss_curves.png``, ``rank_grid.png``
(which rank holds which layers and which shard), ``losses.csv``.

For the planner: :func:`run_3d` returns the measured data without printing: per rank
``memory`` (``{"params", "grads", "optimizer", "gathered"}`` bytes), ``comm`` (per step, ``{axis: {kind:
(count, bytes)}}`` counted by :class:`labkit.comm.CommLog`), ``wire`` (per step, ``{axis: bytes
sent}`` under the ring algorithms), ``expected`` (the counts from the formulas), ``overlap``,
``bubble`` and the loss curves.

Context parallelism (``--cp C``, :mod:`labkit.context_parallel`): each sequence is split over C
ranks (load-balanced 2 C chunks; grid order tp-cp-dp-pp, N = t C p d), every attention core runs
``--cp-attention`` ring | allgather | ulysses over the CP group, and the gradients are averaged
over the d C ranks of a stage (``--zero 1|2|3`` shard over them too); with ``--sp`` (t > 1) each
CP rank's S/C tokens are split again over its TP group. The table then has a CP row (K/V traffic =
the planner's formula), the activations are compared with the planner's count of what the CP
attention core keeps (:func:`labkit.plan.memory.cp_core_activation_bytes`), and per CP rank the
causal attention work its forwards computed (query-key pairs, summed over its heads) must equal
:func:`labkit.context_parallel.attention_work` (the 2 C chunks, or the naive contiguous split with
``--cp-no-load-balance``); their compute time is printed, never judged. ``--hsdp R`` shards over
the (d/R) C ranks of each replica (R divides d; R = d leaves the C ranks); ``--recompute selective``
re-runs each CP core in backward (the planner counts the rise of the live bytes while it re-runs).
With ``--moe`` each CP rank routes its S/C tokens over its EP (= DP) group: the CP row also counts
the balance losses' gathers of the router logits and indices over CP, the DP row the local
experts' CP sum, and the experts' activations come from the rows each rank's EP peers of its CP
rank sent it (not with ``--hsdp``).

Ignored targets (``--ignore-frac F``, :func:`padded_documents`): each sequence of a batch is a
document of random length padded with -100 targets (about F of the step's targets, between 0 and
2F per sequence), so the DP ranks, the CP ranks' chunks and the microbatches hold different
numbers of valid targets, some none. The loss is the mean over the step's valid targets on every
layout (:mod:`labkit.parallel.loss`: their count is one more all-reduce of 8 bytes, the table's
"loss" row), and the verdict compares every gradient with one device's on those batches. The
default, 0, keeps every target.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..cliparse import Parser
from ..pipeline.registry import lookup, names
from . import (
    HelpFormatter,
    bad_lr,
    bad_memory,
    bad_number,
    bad_out,
    bad_seed,
    is_main_rank,
    save_figure,
    schedule_name,
    write_bytes_atomic,
)
from .harness import Lab, Launch, Reference, Report, add_shared_options, execute, lockstep, run, train_reference
from .threed_setup import RankMeasures, _batch, _config, _loss, _model, _moe_config, _v, padded_documents  # noqa: F401

TITLE = "Train the GPT with TP x PP x DP on one process grid and prove it equals one device."


def _parser():
    p = Parser(prog="python -m labkit lab 3d", formatter_class=HelpFormatter, description=TITLE)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree t (ranks of a node)")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel degree p")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel degree d (unset: 2; under torchrun WORLD_SIZE / (t*p*cp))")
    p.add_argument("--schedule", default="1f1b", choices=names(),
                   type=schedule_name,
                   help="pipeline schedule (zb-h1, zbv, dualpipev: zero-bubble, backward split into I and W; "
                        "aliases: zbh1 = zb-h1, zb-v = zbv)")
    p.add_argument("--chunks", type=int, default=None,
                   help="v model chunks per rank, with --schedule interleaved (unset: 2; zbv/dualpipev: always 2)")
    p.add_argument("--microbatches", type=int, default=4, help="M microbatches per step and DP rank")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree C: each sequence split over C ranks")
    p.add_argument("--cp-attention", default="ring", choices=("ring", "allgather", "ulysses"),
                   help="attention under context parallelism: ring (K/V passed around), allgather (Llama 3), "
                        "ulysses (all-to-all over heads)")
    p.add_argument("--cp-no-load-balance", action="store_true",
                   help="with --cp: the naive contiguous split (rank r holds tokens r*S/cp ..) instead of the 2 cp "
                        "chunks r and 2cp-1-r (to measure the causal imbalance)")
    p.add_argument("--zero", type=int, nargs="?", const=1, default=0, choices=(0, 1, 2, 3), metavar="STAGE",
                   help="ZeRO stage over the DP group: 0 DDP, 1 optimizer state sharded (the bare flag), 2 also the "
                        "gradients, 3 also the parameters (FSDP units: embedding, each block, head; tied at p = 1: "
                        "embedding and head one unit)")
    p.add_argument("--hsdp", type=int, default=1, metavar="R",
                   help="HSDP with --zero 3: the d DP ranks as R replicas x d/R shards (R divides d; with --cp C "
                        "each replica shards over its (d/R) C ranks)")
    p.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism inside each TP group (Korthikanti et al. 2022): LayerNorms and "
                        "dropouts on S/t tokens per rank")
    p.add_argument("--recompute", default="none", choices=("none", "selective", "full"),
                   help="activation recomputation: selective = the attention core, full = every block")
    p.add_argument("--moe", action="store_true",
                   help="the MoE GPT (every other block's MLP an MoE layer) with EP folded onto DP: the experts "
                        "of each MoE layer spread over the d ranks of the DP group")
    p.add_argument("--experts", type=int, default=4, help="with --moe: routed experts E, divisible by d")
    p.add_argument("--topk", type=int, default=2, help="with --moe: experts per token k")
    p.add_argument("--bucket-cap-mb", type=float, default=0.02, help="DDP bucket size (MiB)")
    p.add_argument("--steps", type=int, default=12, help="Adam steps")
    p.add_argument("--batch", type=int, default=16, help="global batch B (sequences), divisible by d*M")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence S")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks L, divisible by p*v")
    p.add_argument("--embd", type=int, default=32, help="hidden size H")
    p.add_argument("--heads", type=int, default=4, help="attention heads, divisible by t")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--ignore-frac", type=float, default=0.0, metavar="F",
                   help="share of the targets set to -100, as variable-length documents padded to --seq (0 <= F "
                        "< 1): the shards of a step then hold different numbers of valid targets, some none")
    p.add_argument("--impl", default="labkit", choices=("labkit", "torch", "both"),
                   help="labkit: labkit's own layers, pipeline runtime and DDP/ZeRO; torch: PyTorch's own APIs "
                        "(DeviceMesh, parallelize_module, FSDP2, torch.distributed.pipelining; labkit.parallel."
                        "torch_native); both: the two side by side, with the step-time ratio")
    add_shared_options(p, plots=True)
    # the one rule (labkit.cliparse.Parser.needs): an option that changes nothing in this layout is refused
    p.needs("--chunks", lambda a: lookup(a.schedule).chunks is None,
            "--schedule interleaved (gpipe, 1f1b, zb-h1 run 1 chunk per rank, zbv and dualpipev 2; got --schedule "
            "{schedule})", "--schedule interleaved")
    p.needs("--cp-attention", lambda a: a.cp > 1, "--cp > 1 (got --cp {cp})", "--cp")
    p.needs("--cp-no-load-balance", lambda a: a.cp > 1, "--cp > 1 (it chooses how --cp splits each sequence; "
            "got --cp {cp})", "--cp")
    p.needs("--hsdp", lambda a: a.zero == 3, "--zero 3 (HSDP shards the parameters; got --zero {zero})", "--zero 3")
    p.needs("--sp", lambda a: a.tp > 1, "--tp > 1 (SP splits the sequence inside a TP group; got --tp {tp})", "--tp")
    p.needs("--experts", lambda a: a.moe, "--moe", "--moe")
    p.needs("--topk", lambda a: a.moe, "--moe", "--moe")
    p.needs("--bucket-cap-mb", lambda a: a.zero in (0, 2) and (a.dp is None or a.dp * a.cp > 1),
            "DDP buckets: --zero 0 or 2 with --dp * --cp > 1 (got --zero {zero}, --dp {dp}, --cp {cp})", "--dp")
    return p


def _bubble_formula(a) -> float:
    """Idle fraction from the formulas with equal costs per stage (T_F = T_I = T_W = 1, T_B = 2):
    bubble time / (ideal time v*M*(T_F + T_B) + bubble time). GPipe/1F1B/interleaved:
    (p-1)/(vM+p-1) (Narayanan et al. 2021); zero-bubble: :func:`labkit.pipeline.bubble_time_formula`."""
    info = lookup(a.schedule)
    p, M, v = a.pp, a.microbatches, _v(a)
    if not info.zero_bubble:
        return float(info.bubble_fraction(p, M, v))
    bubble = float(info.bubble_time(p))
    return bubble / (v * M * 3 + bubble)


def _bad_args(a, world) -> str | None:
    """The first rule the options break, as one message naming the values; None if all are fine."""
    for flag, value in (("--tp", a.tp), ("--pp", a.pp), ("--dp", a.dp), ("--cp", a.cp), ("--chunks", _v(a)),
                        ("--microbatches", a.microbatches), ("--steps", a.steps), ("--batch", a.batch),
                        ("--seq", a.seq), ("--layers", a.layers), ("--embd", a.embd), ("--heads", a.heads),
                        *((("--experts", a.experts),) if a.moe else ())):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if not 0.0 <= a.ignore_frac < 1.0:     # NaN fails too
        return f"--ignore-frac must be a share of the targets, 0 <= F < 1, got {a.ignore_frac}"
    bad = (bad_lr(a.lr) or bad_number("--tolerance", a.tolerance)
           or bad_number("--bucket-cap-mb", a.bucket_cap_mb) or bad_seed(a.seed) or bad_out(a.out, "--out"))
    if bad:
        return bad
    if a.cp_no_load_balance and a.cp > 1 and a.seq % (2 * a.cp):
        return (f"--seq {a.seq} must be divisible by 2 * --cp = {2 * a.cp} (the planner's CP formulas count 2 cp "
                f"chunks; the bytes are the same for the contiguous split)")
    if a.moe and not 1 <= a.topk <= a.experts:
        return f"--topk {a.topk} must be between 1 and --experts {a.experts} (each token goes to k distinct experts)"
    if a.moe and a.cp > 1 and a.hsdp > 1:
        return (f"--moe with --cp {a.cp} is not combined with --hsdp {a.hsdp} here: use --zero 3 without --hsdp, "
                f"or --cp 1")
    info, v = lookup(a.schedule), _v(a)
    if v > 1 and a.pp == 1:
        return (f"--schedule {a.schedule} runs {v} model chunks per rank"
                f"{' in a V over the p ranks' if info.v_shaped else ''}: it needs --pp > 1, got --pp 1")
    rounds = max(1, a.microbatches // a.pp)
    if v > 1 and a.microbatches % rounds:
        return (f"--schedule {a.schedule} with {v} chunks per rank on --pp {a.pp} runs the microbatches in rounds = "
                f"max(1, M // p) = {rounds} equal rounds (torch's ScheduleInterleaved1F1B rule, which the "
                f"lab's communication count follows), which must divide --microbatches {a.microbatches}; "
                f"e.g. --microbatches {rounds * a.pp} or {(rounds + 1) * a.pp}")
    try:
        cfg = _config(a)
        from ..parallel import check_layout
        from ..parallel.gpt import check_cp_layout
        v = _v(a)
        check_layout(cfg, world // a.cp, a.tp, a.pp, a.dp, v, a.microbatches, a.batch, a.schedule,
                     sequence_parallel=a.sp, recompute=a.recompute, seq_len=a.seq, zero=a.zero, hsdp=a.hsdp,
                     n_experts=a.experts if a.moe else None, cp=a.cp)
    except ValueError as e:
        return _with_flags(str(e))
    if a.cp > 1 and a.seq % (2 * a.cp):
        return (f"--seq {a.seq} must be divisible by 2 * --cp = {2 * a.cp} (each sequence splits into 2 cp chunks, "
                f"two per CP rank: r and 2cp-1-r, which balances the causal attention work)")
    if a.cp > 1 and a.cp_attention == "ulysses" and (a.heads // a.tp) % a.cp:
        return (f"--cp-attention ulysses splits each TP rank's heads over the --cp {a.cp} ranks: --heads {a.heads} / "
                f"--tp {a.tp} = {a.heads // a.tp} heads per TP rank must be divisible by --cp {a.cp}")
    try:  # its names are per TP rank (n_head = --heads / t): no option to name
        check_cp_layout(cfg, a.tp, a.cp, a.cp_attention, sequence_parallel=a.sp, zero=a.zero, seq_len=a.seq,
                        hsdp=a.hsdp, load_balance=not a.cp_no_load_balance, recompute=a.recompute)
    except ValueError as e:
        return str(e)
    from ..parallel.gpt import planner_spec
    from ..plan.spec import Layout
    # the planner's bytes; GPipe keeps the most activations of any schedule (all M in flight)
    spec = planner_spec(cfg, a.seq, a.batch, _moe_config(a) if a.moe else None, 2)
    lay = Layout(t=a.tp, p=a.pp, d=a.dp, b=a.batch // (a.dp * a.microbatches), M=a.microbatches, schedule="gpipe",
                 ep=a.dp if a.moe else 1, zero=a.zero, sequence_parallel=a.sp, recompute=a.recompute,
                 precision="fp32", cp=a.cp, etp=1 if a.moe else None,   # labkit's MoE: whole experts
                 shard_experts=False)
    return bad_memory(spec, lay, f"--layers {a.layers} --embd {a.embd} --seq {a.seq} --batch {a.batch} "
                                 f"({world} ranks)")


# the library's names (GPTConfig, the layout checks) for the options that set them
_FLAG_OF = {"n_embd": "--embd", "n_head": "--heads", "n_layer": "--layers", "n_routed_experts": "--experts",
            "block_size": "--seq", "vocab_size": "the tokenizer's vocabulary"}


def _with_flags(message: str) -> str:
    """``message`` with the options that set the library's names it uses ("n_embd=30 must be divisible by
    n_head=4 (n_embd is --embd, n_head is --heads)")."""
    import re

    named = [f"{name} is {flag}" for name, flag in _FLAG_OF.items() if re.search(rf"\b{name}\b", message)]
    return message + (f" ({', '.join(named)})" if named else "")


# ----------------------------------------------------------------------------- the run


@dataclass
class RankResult(RankMeasures):
    """One rank's measurements: what every rank reports (:class:`RankMeasures`; ``comm`` counted by
    :class:`labkit.comm.CommLog`), and ``memory``: peak bytes ``{"params", "grads", "optimizer"}``;
    ``expected``: the formulas' counts of one step; ``seconds``: wall time of the timed steps (1..); ``overlap``:
    per step, the share of the DP all-reduce hidden behind backward; ``timelines``: per step the
    pipeline's measured ``(action, start, end)`` (ranks d0 t0 only, else None); ``verdict``: rank
    0's :class:`labkit.labs.verdict.LockstepResult` (None elsewhere)."""
    expected: dict
    seconds: float
    overlap: list
    memory: dict
    timelines: list | None
    verdict: object
    device: str
    backend: str
    activations: int | None = None     # peak bytes saved for backward in the last step (steps >= 2)
    cp_rank: int = 0
    cp_work: int = 0          # CP attention: query-key pairs per sequence (x heads) computed in the last step
    cp_seconds: float = 0.0   # CP attention: seconds of its forward compute in the last step
    moe_loads: dict | None = None   # --moe, last step: {(stage, layer): [(tokens per expert, offset, local)]}


@dataclass
class Result3D:
    """What :func:`run_3d` measured: ``ranks`` (one :class:`RankResult` each), ``single`` (the
    single-device training, :class:`labkit.labs.harness.Reference`), ``losses`` (the parallel
    run's global-batch loss per step), ``bubble`` ``(measured, formula)`` and ``overlap`` (mean
    DP share hidden; NaN without DDP)."""
    ranks: list
    single: Reference
    losses: list
    bubble: tuple
    overlap: float


def _Meter(exclude, gathered):
    """:class:`labkit.checkpoint.SavedTensorMeter` that also leaves out tensors living in a ZeRO-3
    unit's gathered buffer at the moment they are saved (weights; the buffer moves at each gather)."""
    from ..checkpoint import SavedTensorMeter

    class Meter(SavedTensorMeter):
        def _pack(self, t):
            live = {g.untyped_storage().data_ptr() for g in gathered if g.untyped_storage().nbytes()}
            self.exclude = base | live
            return super()._pack(t)

    meter = Meter(exclude)
    base = set(meter.exclude)
    return meter


def _worker(ctx, a, corpus) -> RankResult:
    from ..comm import CommLog, all_reduce
    from ..grid import ProcessGrid
    from ..parallel import ParallelGPT
    from .verdict import sharded_pieces

    torch.manual_seed(a.seed)
    v = _v(a)
    grid = ProcessGrid.build(ctx, tp=a.tp, pp=a.pp, dp=a.dp, cp=a.cp)
    pg = ParallelGPT(_model(a), grid, a.schedule, a.microbatches, v=v, zero=a.zero, hsdp=a.hsdp,
                     bucket_cap_mb=a.bucket_cap_mb, sequence_parallel=a.sp, recompute=a.recompute,
                     cp_attention=a.cp_attention, cp_load_balance=not a.cp_no_load_balance)
    opt = pg.make_optimizer("adam", a.lr)

    def ref_loss(model, step, extras):
        x, y = _batch(a, corpus, step)
        return _loss(model, x.to(ctx.device), y.to(ctx.device))

    check = lockstep(ctx, a, lambda: _model(a), ref_loss)

    def rename(m, n):
        name = pg.reference_name(m, n)
        # tied: the last stage's copy (p > 1), or the one matrix's second name (p = 1), is the reference's one
        return "embedding.wte.weight" if pg.tied and name == "head.lm_head.weight" else name

    def pieces():
        out = []
        if a.zero >= 2 and pg.dp_cp > 1:    # ZeRO-2/3: the DP shards gathered (inspection only, not counted)
            from .verdict import Piece
            for m, grads, params in zip(pg.modules, pg.tp_local("grad"), pg.tp_local("param")):
                for n, (g, dim) in grads.items():
                    if pg.tied and pg.grid.pp == 1 and rename(m, n) != pg.reference_name(m, n):
                        continue                                   # p = 1: the one matrix, once
                    mine = None if dim is None else grid.part(params[n][0].shape[dim] * grid.tp, "tp")
                    index = None if dim is None else (slice(None),) * dim + (mine,)
                    out.append(Piece(rename(m, n), params[n][0], g, index))
                out += [Piece(pg.reference_name(m, n), b.detach()) for n, b in m.named_buffers()]
            return out
        for m in pg.modules:
            out += sharded_pieces(m, grid.tp_rank, grid.tp, partial(rename, m))
        return out

    wire, losses, comm, seconds, overlaps, timelines, act_peak, loads = [], [], [], 0.0, [], [], None, None
    peak_mem = {"params": 0, "grads": 0, "optimizer": 0, "gathered": 0}
    for step in range(a.steps):
        x, y = _batch(a, corpus, step)
        pg.zero_grad()
        pg.cp_stats.clear()
        t0 = time.perf_counter()
        # activations: the peak of the last step (in the first one the runtime measures each stage's
        # first forward itself; the hooks cost time, so only one step carries them)
        meter = _Meter(pg.parameters(), pg.gathered_buffers()) if step == a.steps - 1 and step >= 1 else None
        if meter is not None and a.moe:
            loads = {}
            hooks = _record_loads(pg, loads)
        with CommLog() as log, meter if meter is not None else contextlib.nullcontext():
            loss = pg.train_step(x, y)
            if a.zero == 1 and pg.dp_cp > 1:
                opt.reduce_gradients()
        if meter is not None and a.moe:
            for h in hooks:
                h.remove()
        t_bwd = time.perf_counter() - t0
        if meter is not None:
            act_peak = meter.peak
        if a.zero == 1 and pg.dp_cp > 1:
            opt.gather_gradients()          # inspection only, outside the counted window
        if a.moe:                           # the balance losses live on every stage: sum them over PP
            aux = torch.tensor([pg.take_aux_loss()], dtype=torch.float64)
            if grid.pp > 1:
                all_reduce(aux, grid.pp_group)
            loss = None if loss is None else loss + float(aux)
        check.step(step, pieces(), loss=loss)
        t1 = time.perf_counter()
        with CommLog() as log2:
            opt.step()
        t_opt = time.perf_counter() - t1
        if step >= 1:
            seconds += t_bwd + t_opt        # step 0 is warm-up (shape messages), not timed
        comm.append(pg.comm_by_axis(log.records + log2.records))
        wire.append(pg.wire_by_axis(log.records + log2.records))
        losses.append(loss)
        overlaps.append(pg.dp_overlap())
        timelines.append([(tuple(e.action), e.start, e.end) for e in pg.schedule.timeline])
        mem = pg.memory()
        peak_mem = {k: max(peak_mem.get(k, 0), mem[k]) for k in mem}
    return RankResult(ctx.rank, grid.tp_rank, grid.dp_rank, grid.pp_rank, pg.has_last_stage, losses, comm, wire,
                      pg.expected_comm(a.batch, a.seq), seconds, overlaps, peak_mem,
                      timelines if grid.dp_rank == 0 and grid.tp_rank == 0 else None,
                      check.result(), str(ctx.device), ctx.backend, activations=act_peak,
                      cp_rank=getattr(grid, "cp_rank", 0),
                      cp_work=sum(st["work"] * st["heads"] for st in pg.cp_stats),
                      cp_seconds=sum(st["seconds"] for st in pg.cp_stats), moe_loads=loads)


def _record_loads(pg, loads: dict) -> list:
    """Forward hooks on this rank's MoE layers: each forward appends to ``loads[(stage, layer
    name)]`` ``(tokens per expert [E] of this rank's tokens, first local expert, local experts)``
    (the routing the run had; the rows a rank receives are its EP peers' loads on its experts)."""
    from ..checkpoint import recomputing
    from ..moe.expert_parallel import ExpertParallelMoE
    hooks = []
    for stage, module in zip(pg.stage_ids, pg.modules):
        for name, layer in module.named_modules():
            if isinstance(layer, ExpertParallelMoE):
                def hook(mod, inputs, out, key=(stage, name)):
                    if recomputing():      # full recompute: the same routing again, once per forward counted
                        return
                    loads.setdefault(key, []).append((out[1].tokens_per_expert.tolist(), mod.expert_offset,
                                                      mod.n_local_experts))
                hooks.append(layer.register_forward_hook(hook))
    return hooks


def _reference(a, corpus) -> Reference:
    """The same training on one device (one CPU thread, like each rank): loss curve and time."""
    return train_reference(_model(a), a.steps, lambda m, step: _loss(m, *_batch(a, corpus, step)), a.lr)


def _summarise(a, ranks: list, single: Reference) -> Result3D:
    """The run's global loss per step, its measured bubble (mean over the timed steps of the
    pipeline of d0 t0) and its DP overlap, from the ranks' results."""
    from ..pipeline import TimedAction, bubble_fraction
    from ..pipeline.schedules import Action
    pipe = sorted((r for r in ranks if r.timelines is not None), key=lambda r: r.pp_rank)
    measured = []
    for i in range(1, a.steps) if a.steps > 1 else [0]:
        tl = {r.pp_rank: [TimedAction(Action(*act), s, e) for act, s, e in r.timelines[i]] for r in pipe}
        measured.append(float(bubble_fraction(tl, a.pp)))
    losses = []
    for step in range(a.steps):
        ls = [r.losses[step] for r in ranks if r.last and r.tp_rank == 0]
        losses.append(sum(ls) / len(ls))
    pred = _planner(a)
    if pred is not None:   # the expected counts are the planner's (DDP: the run's buckets, the same bytes)
        for r in ranks:
            exp = {ax: dict(kinds) for ax, kinds in pred[1][r.pp_rank].items()}
            for kind in _BUCKETED if a.zero == 2 else ("all_reduce",):   # ZeRO-2 also by bucket
                if kind in r.expected.get("dp", {}) and kind in exp.get("dp", {}):
                    exp["dp"][kind] = (r.expected["dp"][kind][0], exp["dp"][kind][1])
            if a.zero == 2 and a.sp and "all_reduce" in exp.get("tp", {}):   # SP sums: one per bucket holding any
                exp["tp"]["all_reduce"] = (r.expected["tp"]["all_reduce"][0], exp["tp"]["all_reduce"][1])
            r.expected = exp
    ov = [o for r in ranks for o in r.overlap[1:] if o == o] if a.dp > 1 and not a.zero else []
    return Result3D(ranks, single, losses, (sum(measured) / len(measured), _bubble_formula(a)),
                    sum(ov) / len(ov) if ov else float("nan"))


def run_3d(a, corpus=None) -> Result3D:
    """Run the lab's training (no printing, no files) and return its :class:`Result3D`. ``a``: the
    parsed options with ``a.dp`` set (see ``python -m labkit lab 3d --help``; :func:`parse_args`
    builds them). Under torchrun, on ranks other than 0: None."""
    from ..data import Corpus
    corpus = corpus if corpus is not None else Corpus.load(a.data)
    outcome = execute(LAB, a, corpus)
    return None if outcome is None else _summarise(a, outcome.results[_run_name(a)], outcome.reference)


def _run_name(a) -> str:
    cp = f" cp{a.cp} {a.cp_attention}" if a.cp > 1 else ""
    return f"t{a.tp}{cp} p{a.pp} d{a.dp} {a.schedule}"


# ----------------------------------------------------------------------------- report


def _mib(b):
    return b / 2**20


# schedule -> (the planner's schedule with the same stages per rank and messages, placement, whether the
# planner's in-flight counts model its activations). The zero-bubble ones keep microbatches until their W:
# their activations are counted along their actions (plan.memory.schedule_activation_peak; ZB-V and
# DualPipeV on the V, two stages per rank; with CP too). Full recompute is not run with them (check_layout).
_PLANNER_SCHEDULE = {"gpipe": ("gpipe", "loop", True), "1f1b": ("1f1b", "loop", True),
                     "interleaved": ("interleaved", "loop", True), "zb-h1": ("1f1b", "loop", False),
                     "zbv": ("interleaved", "v", False), "dualpipev": ("interleaved", "v", False)}


_BUCKETED = ("all_reduce", "reduce_scatter", "all_gather")   # DDP / ZeRO-2: one per gradient bucket


def _planner(a):
    """The planner's prediction for this run: ``(memory per pipeline rank, {pp_rank: {axis: {kind:
    (count, bytes)}}}, what is compared: "all" | "moe", moe_peak)``, or None when
    the planner cannot take the layout. MoE: expert TP 1 (``Layout.etp``: labkit's MoE blocks hold
    whole experts on every TP rank, Megatron-Core's ``expert_tensor_parallel_size=1``); "moe" compares
    the bytes that follow the routing as :func:`_planner_table` says; ``moe_peak(pp_rank, rows)``: the
    activation peak counted along the schedule's actions with ``rows`` ``{(stage, microbatch): rows
    received}`` (:func:`labkit.plan.memory.schedule_activation_peak`)."""
    from ..parallel.gpt import hsdp_dp_comm, planner_spec
    from ..plan.comm import comm_per_rank
    from ..plan.memory import memory_per_rank, schedule_activation_peak, zero3_split_gathered_peak
    from ..plan.spec import Layout
    if a.schedule not in _PLANNER_SCHEDULE:
        return None
    schedule, placement, act_modeled = _PLANNER_SCHEDULE[a.schedule]
    compared = "moe" if a.moe else "all"
    spec = planner_spec(_config(a), a.seq, a.batch, _moe_config(a) if a.moe else None, 2)
    try:
        lay = Layout(t=a.tp, p=a.pp, d=a.dp, v=_v(a), b=a.batch // (a.dp * a.microbatches), M=a.microbatches,
                     ep=a.dp if a.moe else 1, etp=1 if a.moe else None,
                     schedule=schedule, placement=placement, zero=a.zero, sequence_parallel=a.sp,
                     recompute=a.recompute, precision="fp32", cp=a.cp, cp_attention=a.cp_attention, hsdp=a.hsdp,
                     shard_experts=False)   # labkit's ZeRO keeps the local experts whole
        mem = memory_per_rank(spec, lay, device="cpu")   # HSDP: Layout.hsdp shards over d/R
        # the zero-bubble schedules: counted along their actions (ZB-H1, and ZB-V / DualPipeV on the V)
        actions = lookup(a.schedule).build(a.pp, a.microbatches, _v(a)) if not act_modeled else None
        if actions is not None:   # ZeRO-3: a whole stage's units gathered for each I and W
            split_peak = a.zero == 3 and a.dp * a.cp > 1
            mem = [dataclasses.replace(m, activations=schedule_activation_peak(spec, lay, actions[m.pp_rank],
                                                                               m.pp_rank, device="cpu"),
                                       gathered=4 * zero3_split_gathered_peak(spec, lay, m.pp_rank) if split_peak
                                       else m.gathered)
                   for m in mem]
        comm = {r: {ax: dict(c.ops) for ax, c in comm_per_rank(spec, lay, pp_rank=r, act_bytes=4,
                                                                actions=actions[r] if actions else None).items()
                    if c.ops}
                for r in range(a.pp)}
        for r in range(a.pp) if a.hsdp > 1 else ():
            comm[r]["dp"] = hsdp_dp_comm(spec, lay, a.hsdp, r, actions=actions[r] if actions else None)
    except ValueError:
        return None

    def moe_peak(pp_rank, rows):
        actions = lookup(a.schedule).build(a.pp, a.microbatches, _v(a))
        return schedule_activation_peak(spec, lay, actions[pp_rank], pp_rank, "cpu", rows)
    return mem, comm, compared, moe_peak


def _moe_rows(a, ranks) -> dict:
    """``{rank: {(stage, microbatch): [rows per MoE layer]}}``: the rows each rank's experts received
    in the last step, one entry per MoE layer of the stage in order: its EP peers' (the DP ranks of
    its pipeline, CP and TP rank; with SP each routed its S/t tokens, with CP its S/cp) recorded
    tokens per expert on its local experts. The c-th forward of a stage is the microbatch of the
    stage's c-th F action. Ranks without records (a run of one step): absent."""
    actions = lookup(a.schedule).build(a.pp, a.microbatches, _v(a))
    peers = {}
    for r in ranks:
        peers.setdefault((r.pp_rank, r.cp_rank, r.tp_rank), []).append(r)
    out = {}
    for r in ranks:
        if r.moe_loads is None:
            continue
        order = {}
        for act in actions[r.pp_rank]:
            if act.kind == "F":
                order.setdefault(act.stage, []).append(act.microbatch)
        rows = {}
        for key, calls in r.moe_loads.items():
            for c, (_, first, n) in enumerate(calls):
                got = sum(sum(q.moe_loads[key][c][0][first:first + n])
                          for q in peers[(r.pp_rank, r.cp_rank, r.tp_rank)])
                rows.setdefault((key[0], order[key[0]][c]), []).append(got)
        out[r.rank] = rows
    return out


def _planner_table(a, out) -> tuple[list[str], list[str]]:
    """Per rank, measured bytes next to the planner's: lines of the table and the mismatches
    (memory and communication exact, activations within 2 %). DP all-reduces (and ZeRO-2's
    reduce-scatters, all-gathers and, with SP, its TP all-reduces of the SP gradients) are
    compared by bytes (the run reduces in buckets, the planner counts one per model chunk).

    MoE (EP folded onto DP, no token dropped: the lab sets no capacity): parameters, gradients,
    optimizer state and the TP, PP, DP bytes exactly. EP all-to-alls: the count exactly (the
    planner's dispatch and combine, forward and backward, plus labkit's per-expert counts exchange,
    one all-to-all of E int64 per MoE layer and microbatch, twice with full recompute); the bytes a
    rank sends follow the routing (its kept slots and the rows it receives), so the exact check is
    their sum over each EP group (every slot is sent out and back once in each direction), i.e. the planner's balanced
    bytes per rank times ep. Activations: within 2 % on every rank. An MoE layer's saved bytes are
    a part that follows from the rank's own tokens (router, slots, the returned rows) and a part
    per row its experts RECEIVED (:func:`labkit.plan.activations.moe_layer_activation_bytes`); the
    received rows follow the routing, which is deterministic (same seed, same batch) but known only
    by running the router: the planner takes them from the routing the run had (every rank records
    its tokens per expert in the last step, :func:`_record_loads`; a rank's rows are its EP peers'
    counts on its experts, :func:`_moe_rows`; with SP each TP rank routes its S/t tokens over the EP
    ranks of its TP rank, with CP each CP rank its S/cp tokens over those of its CP rank) and counts
    the peak along the schedule's actions (full recompute: each layer's recomputed stash in the
    backward, :func:`labkit.plan.memory.schedule_activation_peak`).
    The counts come from the run, the bytes from the formula."""
    pred = _planner(a)
    if pred is None:
        return [f"planner: not shown for this layout (--schedule {a.schedule}, v={_v(a)})"], []
    mem, comm, compared, moe_peak = pred
    moe_rows = _moe_rows(a, out.ranks) if compared == "moe" else {}
    bad, rows, ep_groups = [], [], {}
    head = (f"{'rank':>4}  {'params':>9} {'(planner)':>9}  {'grads':>9} {'(planner)':>9}  {'optimizer':>9} "
            f"{'(planner)':>9}  {'activations':>11} {'(planner)':>9} {'diff':>6}  "
            f"communication bytes per axis (planner)")
    rows += [head, "-" * len(head)]
    for r in sorted(out.ranks, key=lambda r: r.rank):
        pm, m = mem[r.pp_rank], r.memory
        act_modeled = compared == "all" or (compared == "moe" and r.rank in moe_rows)
        if compared == "moe" and r.rank in moe_rows:   # the experts' part from the rows this rank received
            pm = dataclasses.replace(pm, activations=moe_peak(r.pp_rank, moe_rows[r.rank]))
        for k in ("params", "grads", "optimizer") + (("gathered",) if a.zero == 3 and a.dp * a.cp > 1 else ()):
            if m.get(k, 0) != getattr(pm, k):
                bad.append(f"rank {r.rank} {k}: measured {m.get(k, 0)} B, planner {getattr(pm, k)} B")
        act = r.activations
        diff = (pm.activations / act - 1) if act else float("nan")
        if act_modeled and not abs(diff) <= 0.02:
            bad.append(f"rank {r.rank} activations: measured {act} B, planner {pm.activations} B "
                       f"({diff:+.1%}, more than 2 %)")
        got, want = r.comm[-1], comm[r.pp_rank]
        cells = []
        for ax in sorted(set(got) | set(want)):
            g, w = got.get(ax, {}), want.get(ax, {})
            for kind in sorted(set(g) | set(w)):
                (gc, gb), (wc, wb) = g.get(kind, (0, 0)), w.get(kind, (0, 0))
                by_bucket = ax == "dp" and (kind == "all_reduce" or (a.zero == 2 and kind in _BUCKETED))
                # ZeRO-2 + SP: one TP all-reduce of the SP gradients per bucket holding any (the planner: one
                # per chunk); the count is checked against the run's buckets in the formula table
                by_bucket = by_bucket or (ax, kind) == ("tp", "all_reduce") and a.zero == 2 and a.sp and a.dp > 1
                if (ax, kind) == ("ep", "all_to_all") and compared == "moe":
                    # one counts exchange per MoE layer and microbatch forward (full recompute: again in
                    # backward, with the dispatch and combine: 6 of the planner's per layer and microbatch)
                    exchanges = wc // 3 if a.recompute == "full" else wc // 4
                    wb += exchanges * a.experts * 8
                    w = {**w, kind: (wc + exchanges, wb)}
                    if gc != wc + exchanges:
                        bad.append(f"rank {r.rank} ep all_to_all: measured {gc} x; planner {wc} x + {exchanges} "
                                   f"counts exchanges")
                    ep_groups.setdefault((r.pp_rank, r.cp_rank, r.tp_rank), []).append((r.rank, gb, wb))
                elif gb != wb or (gc != wc and not by_bucket):
                    bad.append(f"rank {r.rank} {ax} {kind}: measured {gc} x, {gb} B; planner {wc} x, {wb} B")
            cells.append(f"{ax} {sum(b for _, b in g.values())} ({sum(b for _, b in w.values())})")
        rows.append(f"{r.rank:>4}  {m['params']:>9} {pm.params:>9}  {m['grads']:>9} {pm.grads:>9}  "
                    f"{m['optimizer']:>9} {pm.optimizer:>9}  {act if act else '-':>11} "
                    f"{pm.activations if act_modeled else 'n/a':>9} "
                    f"{f'{diff:+.1%}' if act_modeled else '-':>6}  "
                    f"{', '.join(cells)}")
    rows.append("bytes per rank, measured next to the planner's (in parentheses for communication); diff: the "
                "planner's activations / measured - 1 (within 2 % passes; - where the planner has no formula)")
    for _, members in sorted(ep_groups.items()):
        got_sum, want_sum = sum(gb for _, gb, _ in members), sum(wb for _, _, wb in members)
        if got_sum != want_sum:
            bad.append(f"EP group of ranks {[m[0] for m in members]} all_to_all: measured {got_sum} B in all, "
                       f"planner {want_sum} B")
    if compared == "moe":
        rows.append("(MoE, expert TP 1: whole experts on every TP rank. EP all-to-all bytes per rank follow the "
                    "routing: compared summed over each EP group, counts per rank (+1 counts exchange per MoE "
                    "layer and microbatch); activations: the experts' part counted from the rows each rank "
                    "received in the last step (the run's routing, from every EP peer's tokens per expert), "
                    "the rest from the formula)")
    if a.zero == 3 and a.dp * a.cp > 1:
        what = "a whole stage's units, gathered for each I and W" if lookup(a.schedule).zero_bubble else \
            "the tied embedding+head unit and two neighbouring blocks" if a.tied and a.pp == 1 else \
            "the largest two neighbouring units"
        rows.append(f"ZeRO-3 gathered units, peak bytes per rank (planner: {what}): "
                    + ", ".join(f"rank {r.rank} {r.memory.get('gathered', 0)} ({mem[r.pp_rank].gathered})"
                                for r in sorted(out.ranks, key=lambda r: r.rank))
                    + "; the gathered weights saved for backward are not counted as activations")
    return rows, bad


def _axis_table(a, out) -> tuple[list[str], bool]:
    """Lines of the per-axis table (max over ranks of the per-step counts, steps after the first)
    and whether every rank's counts equal the formula at every timed step."""
    ranks = out.ranks
    ok = all(c == r.expected for r in ranks for c in r.comm[1:])
    rows = []
    labels = {"tp": f"TP (t={a.tp})", "cp": f"CP (cp={a.cp})", "pp": f"PP (p={a.pp})",
              "dp": f"DP (d={a.dp})" if a.cp == 1 else f"DP (d*cp={a.dp * a.cp})", "ep": f"EP (={a.dp}, on DP)",
              "embedding": "embedding", "loss": "loss"}
    kinds = sorted({(ax, k) for r in ranks for ax in r.expected for k in r.expected[ax]},
                   key=lambda x: (list(labels).index(x[0]), x[1]))
    head = f"{'axis':<12}{'collective':<16}{'count/step':>11}{'(formula)':>10}{'MiB/step':>10}{'(formula)':>10}  ranks"
    rows += [head, "-" * len(head)]
    for ax, k in kinds:
        meas = [r.comm[-1].get(ax, {}).get(k, (0, 0)) for r in ranks]
        exp = [r.expected.get(ax, {}).get(k, (0, 0)) for r in ranks]
        i = max(range(len(ranks)), key=lambda j: exp[j][1])
        n_ranks = sum(1 for e in exp if e[0])
        rows.append(f"{labels[ax]:<12}{k:<16}{meas[i][0]:>11d}{exp[i][0]:>10d}{_mib(meas[i][1]):>10.3f}"
                    f"{_mib(exp[i][1]):>10.3f}  {n_ranks} of {len(ranks)}")
    axes = [ax for ax in labels if any(ax in r.wire[-1] for r in ranks)]
    sent = ", ".join(f"{labels[ax]} {_mib(max(r.wire[-1].get(ax, 0) for r in ranks)):.3f}" for ax in axes)
    rows.append(f"MiB sent per step on the wire (ring algorithms, busiest rank): {sent}")
    return rows, ok


def _print_cp_balance(a, ranks) -> list[str]:
    """Causal work per CP rank (load-balanced 2 cp chunks) next to the contiguous split's, and what
    each CP rank of pipeline rank 0 (d0 t0) measured in the last step: the work its attention
    forwards computed (query-key pairs per sequence, summed over the heads it computes) next to
    :func:`labkit.context_parallel.attention_work`, and their compute seconds. Returns the FAIL lines
    (the measured work differs from the formula)."""
    from ..context_parallel import attention_work, causal_work
    lb = not a.cp_no_load_balance
    contiguous = causal_work(a.seq, a.cp, load_balance=False)
    if lb:
        print(f"\ncausal attention work per CP rank (query-key pairs per sequence and head; 2 cp chunks, rank r "
              f"holds r and 2cp-1-r): {causal_work(a.seq, a.cp)}; a contiguous split would give {contiguous}")
    else:
        print(f"\ncausal attention work per CP rank (query-key pairs per sequence and head; the contiguous split, "
              f"--cp-no-load-balance): {contiguous}; the 2 cp chunks would give "
              + (f"{causal_work(a.seq, a.cp)}" if a.seq % (2 * a.cp) == 0 else f"(S={a.seq} not divisible by 2 cp)"))
    heads = a.heads // a.tp
    if a.cp_attention == "ulysses":
        print(f"ulysses: each rank computes {heads // a.cp} of the {heads} heads (per TP rank) for all {a.seq} "
              f"positions, so every rank does 1/cp of the whole causal triangle whatever the chunk placement: "
              f"balance comes from the head split (the chunk placement only sets the positions of a rank's tokens)")
    elif a.cp_attention == "allgather":
        print("allgather: each rank computes its own queries on all S keys with the masked scores too (one dense "
              "[S/cp, S] block per head), so its compute time follows S/cp x S on every rank; the work column is "
              "what a kernel that skips masked tiles would do (the contiguous split would leave it unbalanced)")
    row = sorted((r for r in ranks if r.tp_rank == 0 and r.dp_rank == 0 and r.pp_rank == 0), key=lambda r: r.cp_rank)
    layers = a.layers // (a.pp * _v(a)) * _v(a)
    runs = layers * a.microbatches       # full recompute's second forward is not recorded (_cp_core)
    want = [w * runs for w in attention_work(a.seq, a.cp, a.cp_attention, heads, lb)]
    print(f"measured in the last step, {a.cp_attention} attention forwards on pipeline rank 0 (per CP rank): work "
          + ", ".join(str(r.cp_work) for r in row) + f" (formula x {layers} layers x M={a.microbatches}"
          + f", {heads} heads: "
          + ", ".join(str(w) for w in want) + "); compute ms " + ", ".join(f"{1e3 * r.cp_seconds:.1f}" for r in row))
    if a.steps == 1:      # step 0 also runs each stage's probe forward on zeros (the pipeline runtime's)
        print("(one step only: it includes the pipeline runtime's probe forward of each stage; work not compared)")
        return []
    return [] if [r.cp_work for r in row] == want else [
        f"FAIL: CP attention work per rank measured {[r.cp_work for r in row]}, formula {want}"]


def _plots(a, out, folder: Path):
    from matplotlib.figure import Figure

    from ..grid import Mesh
    from ..parallel import layout

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(range(1, a.steps + 1), out.single.losses, label="single device")
    ax.plot(range(1, a.steps + 1), out.losses, "--", label=f"t={a.tp} x p={a.pp} x d={a.dp}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("3D parallelism vs one device (two separate Adam trainings)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, folder / "loss_curves.png", dpi=110)

    v = _v(a)
    cells = layout(_config(a), a.tp, a.pp, a.dp, v, lookup(a.schedule).placement)
    cols, row = a.dp * a.tp, Mesh(dp=a.dp, tp=a.tp)     # one row of the grid: d x t ranks, TP inside
    fig = Figure(figsize=(max(5.0, 1.9 * cols), max(2.4, 1.3 * a.pp + 0.8)))
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#cfe2f3", "#d9ead3", "#fff2cc", "#f4cccc", "#d9d2e9", "#fce5cd"]
    for c in cells:
        x, y = row.rank_of(dp=c["dp_rank"], tp=c["tp_rank"]), a.pp - 1 - c["pp_rank"]
        ax.add_patch(__import__("matplotlib.patches", fromlist=["Rectangle"]).Rectangle(
            (x + 0.04, y + 0.06), 0.92, 0.88, facecolor=colors[c["pp_rank"] % len(colors)], edgecolor="black"))
        extra = ("+emb " if c["embedding"] else "") + ("+head" if c["head"] else "")
        text = (f"rank {c['rank']}\nlayers {','.join(map(str, c['layers']))} {extra}\n"
                f"{c['shard'] if a.tp > 1 else 'all heads, vocab'}"
                + (f"\nAdam shard {c['dp_rank'] + 1}/{a.dp}" if a.zero and a.dp > 1 else ""))
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7)
    for d in range(1, a.dp):
        ax.axvline(d * a.tp, color="black", lw=2.5)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, a.pp)
    ax.set_xticks([i + 0.5 for i in range(cols)],
                  [f"d{row.coords(i)['dp']} t{row.coords(i)['tp']}" for i in range(cols)], fontsize=8)
    ax.set_yticks([i + 0.5 for i in range(a.pp)], [f"pipeline rank {a.pp - 1 - i}" for i in range(a.pp)], fontsize=8)
    ax.set_title(f"rank grid: TP inside (neighbouring ranks), DP across (thick lines), PP rows "
                 f"({a.schedule}, v={v})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, folder / "rank_grid.png", dpi=110)


def parse_args(argv):
    return _parser().parse_args(argv)


class ThreeDLab(Lab):
    """``python -m labkit lab 3d``: one run on the t x p x d grid."""
    name = "3d"

    def parser(self):
        return _parser()

    def resolve(self, a, world):
        if world is not None:
            mp = a.tp * a.pp * a.cp
            if a.tp < 1 or a.pp < 1 or a.cp < 1 or world % mp:
                return f"--tp {a.tp} * --pp {a.pp}" + (f" * --cp {a.cp}" if a.cp != 1 else "") + \
                    f" must divide WORLD_SIZE={world}"
            if a.dp is not None and a.dp * mp != world and is_main_rank():
                print(f"note: --dp {a.dp} ignored under torchrun: d = WORLD_SIZE / (t*p*cp) = {world // mp}",
                      file=sys.stderr)
            a.dp = world // mp
        else:
            a.dp = 2 if a.dp is None else a.dp
        return None

    def check(self, a):
        bad = _bad_args(a, a.tp * a.pp * a.dp * a.cp)
        if bad is None and a.impl != "labkit":
            from .threed_torch import torch_bad_args
            bad = torch_bad_args(a)
        return bad

    def load_corpus(self, a):
        from ..data import Corpus
        corpus = Corpus.load(a.data)
        corpus.get_batch("train", 1, a.seq)
        return corpus

    def start(self, a, corpus):
        self.t_start = time.perf_counter()

    def runs(self, a, corpus):
        from .threed_torch import torch_run_name, torch_worker
        world = a.tp * a.pp * a.dp * a.cp
        out = [Launch(_run_name(a), world, _worker, (a, corpus))] if a.impl != "torch" else []
        if a.impl != "labkit":
            out.append(Launch(torch_run_name(a), world, torch_worker, (a, corpus)))
        return out

    def reference(self, a, corpus):
        return _reference(a, corpus)

    def report(self, a, outcome):
        from .threed_torch import side_by_side, torch_run_name
        self.result = None
        if a.impl == "torch":
            th = outcome.results[torch_run_name(a)]
            print(f"\n3D-parallel GPT (L={a.layers}, H={a.embd}, heads={a.heads}) with PyTorch's own APIs on t={a.tp} "
                  f"x p={a.pp} x d={a.dp} = {len(th)} ranks, {a.schedule}{f' v={_v(a)}' if _v(a) > 1 else ''}, "
                  f"M={a.microbatches}, {_torch_dp_name(a)}{', SP' if a.sp else ''}, {a.steps} Adam steps of "
                  f"B={a.batch} x S={a.seq} tokens")
            print("\nCommunication per step (the busiest rank per row; payload bytes, labkit.comm's convention):")
            print("\n".join(side_by_side(a, None, th)))
            self._torch_planner(a, th)
            print(f"lab time: {time.perf_counter() - self.t_start:.1f} s")
            return Report({torch_run_name(a): th[0].verdict}, [])
        rep = self._report_labkit(a, outcome)
        if a.impl == "both":
            th = outcome.results[torch_run_name(a)]
            print(f"\nlabkit next to PyTorch's own APIs ({_torch_dp_name(a)}; DeviceMesh (pp, dp, tp), "
                  f"parallelize_module, torch.distributed.pipelining), the same layout, weights and batches; "
                  f"last step, busiest rank per row:")
            print("\n".join(side_by_side(a, self.result.ranks, th)))
            self._torch_planner(a, th)
            rep.verdicts[torch_run_name(a)] = th[0].verdict
        return rep

    def _torch_planner(self, a, th):
        """The torch-native run's counts next to the planner's, line by line, each equal or explained."""
        from .threed_torch import planner_lines
        pred = _planner(a) if a.steps > 1 else None
        if pred is not None:
            print("\nThe torch-native run next to the planner (labkit's formulas), per step, on each pipeline "
                  "rank's d0 t0 rank:")
            print("\n".join(planner_lines(a, th, pred[1], pred[0])))

    def _report_labkit(self, a, outcome):
        out = _summarise(a, outcome.results[_run_name(a)], outcome.reference)
        self.result = out
        v = _v(a)
        ranks = out.ranks
        print(f"\n3D-parallel GPT (L={a.layers}, H={a.embd}, heads={a.heads}{', tied embeddings' if a.tied else ''}) "
              f"on t={a.tp}{f' x cp={a.cp} ({a.cp_attention})' if a.cp > 1 else ''} x p={a.pp} x d={a.dp} = "
              f"{len(ranks)} ranks ({ranks[0].backend}), {a.schedule}"
              f"{f' v={v}' if v > 1 else ''}, M={a.microbatches}, {f'ZeRO-{a.zero}' if a.zero else 'DDP'}"
              f"{f', HSDP R={a.hsdp}' if a.hsdp > 1 else ''}"
              f"{', SP' if a.sp else ''}{f', recompute {a.recompute}' if a.recompute != 'none' else ''}"
              f"{f', MoE E={a.experts} top-{a.topk} EP={a.dp}' if a.moe else ''}, "
              f"{a.steps} Adam steps of B={a.batch} x S={a.seq} tokens"
              + (f", about {a.ignore_frac:.0%} of the targets ignored (padded documents: the shards hold "
                 f"different numbers of valid targets; the loss is the mean over the step's valid ones)"
                 if a.ignore_frac else ""))
        rows, counts_ok = _axis_table(a, out)
        if a.moe or (_planner(a) is None and (a.sp or a.recompute != "none")):
            counts_ok = True       # ParallelGPT.expected_comm models neither; the planner not these schedules
            rows.append("(the formula column does not model this layout (--moe, or --sp/--recompute with this "
                        "schedule): not compared)")
        print("\nCommunication per step and rank (the busiest rank; payload bytes as counted by labkit.comm):")
        print("\n".join(rows))
        print("formulas: TP 4 all-reduces of b*S*H per block per microbatch (+1 embedding, +1 output layer, +3 of b*S "
              "cross-entropy); PP 1 send of b*S*H per microbatch and boundary each way; DP one all-reduce per bucket "
              "of the stage's gradients (a ring moves 2(d-1)/d of it), ZeRO-1 and ZeRO-2 a reduce-scatter of n and an "
              "all-gather of n/d (ZeRO-2: per bucket), ZeRO-3 per FSDP unit an all-gather of n/d before each "
              "microbatch's forward and backward (zero-bubble: before each I or W that finds it resharded, counted "
              "along the schedule's actions) and one reduce-scatter of n (HSDP: over d/R ranks, then an "
              "all-reduce of the shard across the R replicas); loss: on the last stage, the step's valid-target "
              "count before backward and the reported loss after it, 2 all-reduces of 8 B over the d*cp ranks; "
              "b = B/(d*M)."
              + (" CP per block and microbatch: ring (cp-1) sends of K and V forward, (cp-1)+cp backward (K, V, "
              "then their gradients); allgather 2 all-gathers of K, V forward, "
              "2 reduce-scatters backward; ulysses 4 all-to-alls (q, k, v, output) each way; DP over the d*cp "
              "ranks of a stage." if a.cp > 1 else ""))
        cp_bad = _print_cp_balance(a, ranks) if a.cp > 1 else []
        meas, formula = out.bubble
        name = "(p-1)/(vM+p-1)" if not lookup(a.schedule).zero_bubble else "(T_F = T_I = T_W)"
        print(f"\npipeline bubble: measured {meas:.1%} (mean of the timed steps, pipeline of d0 t0), "
              f"formula {name} = {formula:.1%}")
        if len(ranks) > (os.cpu_count() or 1):
            print(f"note: {len(ranks)} ranks share {os.cpu_count()} CPU cores, so a rank often waits for a core; the "
                  f"measured bubble includes that wait")
        if a.dp > 1 and not a.zero:
            print(f"DP all-reduce time hidden behind backward: {out.overlap:.0%} (buckets of {a.bucket_cap_mb:g} "
                  f"MiB, started from gradient hooks)")
        mem = [r.memory for r in ranks]
        print(f"\n{'per rank (peak)':<18}{'params MiB':>11}{'grads MiB':>11}{'optimizer MiB':>15}")
        for key in ("max", "min"):
            f = max if key == "max" else min
            print(f"{key:<18}{_mib(f(m['params'] for m in mem)):>11.3f}{_mib(f(m['grads'] for m in mem)):>11.3f}"
                  f"{_mib(f(m['optimizer'] for m in mem)):>15.3f}")
        planner_bad = []
        if a.steps > 1:
            prow, planner_bad = _planner_table(a, out)
            print("\nPer rank, measured next to the planner (bytes; activations: peak saved for backward in the last "
                  "step, saved_tensors_hooks):")
            print("\n".join(prow))
        tokens = a.batch * a.seq * (a.steps - 1)
        par_s = max(r.seconds for r in ranks)
        if a.steps > 1:
            print(f"\ntokens/s: {tokens / par_s:,.0f} on {len(ranks)} ranks vs {tokens / out.single.seconds:,.0f} on "
                  f"one device (one CPU thread each; {os.cpu_count()} cores here)")
        print(f"lab time: {time.perf_counter() - self.t_start:.1f} s")
        failures = [] if counts_ok else ["FAIL: the counted collectives differ from the formula (table above)"]
        failures += [f"FAIL: planner: {line}" for line in planner_bad]
        failures += cp_bad
        return Report({_run_name(a): ranks[0].verdict}, failures)

    def files(self, a, outcome, folder):
        out = self.result
        if out is None:       # --impl torch: its losses next to the single device's
            from .threed_torch import torch_run_name
            th = outcome.results[torch_run_name(a)]
            single = outcome.reference.losses
            last = [r for r in th if r.last and r.tp_rank == 0]
            par = [sum(r.losses[i] for r in last) / len(last) for i in range(a.steps)]
            rows = ["step,single,torch"] + [f"{i},{single[i]:.7f},{par[i]:.7f}" for i in range(a.steps)]
            write_bytes_atomic(folder / "losses.csv", ("\n".join(rows) + "\n").encode())
            print(f"losses: {folder / 'losses.csv'}")
            return
        rows = ["step,single,3d"] + [f"{i},{out.single.losses[i]:.7f},{out.losses[i]:.7f}" for i in range(a.steps)]
        write_bytes_atomic(folder / "losses.csv", ("\n".join(rows) + "\n").encode())
        if not a.no_plots:
            _plots(a, out, folder)
            print(f"plots: {folder / 'loss_curves.png'}, {folder / 'rank_grid.png'}")


def _torch_dp_name(a) -> str:
    """What --zero means with --impl torch: FSDP2's reshard_after_forward True / False, or DDP."""
    if a.dp == 1:
        return "no DP"
    if a.zero == 0:
        return "DDP: FSDP2 on a replicate-only mesh"
    return (f"FSDP2 fully_shard, reshard_after_forward={a.zero == 3}" + (f", HSDP R={a.hsdp}" if a.hsdp > 1 else ""))


LAB = ThreeDLab()


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit lab 3d``: the exit code (see :func:`labkit.labs.harness.run`)."""
    return run(LAB, argv).rc


if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
