"""3D parallelism: one GPT on a ProcessGrid with TP inside pipeline stages and DP across.

Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", sec. 2-3): the N = t * p * d GPUs are a grid. Rank order (:class:`labkit.grid.ProcessGrid`):
TP innermost (neighbouring ranks, the fast links inside a node), then DP, PP outermost,
``rank = pp_rank * (d * t) + dp_rank * t + tp_rank``. On each rank:

* the model is cut by layers into ``p * v`` pipeline stages (stage i on pipeline rank i % p,
  :mod:`labkit.pipeline.stages`); stage 0 also holds the embedding, the last stage the head;
* inside each stage every layer is Megatron's tensor-parallel version over the TP group
  (:mod:`labkit.tensor_parallel`): vocab-parallel embedding, head-split attention, column/row
  MLP, column-parallel output layer and vocab-parallel cross-entropy;
* the stages exchange activations and gradients with any labkit schedule (GPipe, 1F1B,
  interleaved 1F1B, and the zero-bubble ZB-H1, ZB-V and DualPipeV whose backward is split into
  I and W: :mod:`labkit.pipeline.runtime`) over the pipeline group, which holds the
  ranks with the same (dp_rank, tp_rank): TP rank j of stage s sends to TP rank j of stage s+1;
* each stage is wrapped for data parallelism over the DP group (same pp_rank and tp_rank),
  by ZeRO stage (Rajbhandari et al. 2020; DeepSpeed's ``zero_optimization.stage``):
  0 :class:`labkit.data_parallel.DistributedDataParallel` (gradients averaged in the stage's last
  backward of the step, overlapped with it); 1 the optimizer is
  :class:`labkit.data_parallel.ZeroRedundancyOptimizer`; 2 :class:`labkit.data_parallel.ZeroStage2`
  (gradients reduce-scattered in buckets from the hooks of that last backward); 3
  :class:`labkit.data_parallel.FullyShardedDataParallel` with one unit per embedding, block and
  head of the stage (the parameters, already TP-sliced, sharded over DP). HSDP (``hsdp=R``,
  ZeRO-3 only): the DP group's d ranks are R replicas x d/R shards (shard innermost, as FSDP2's
  ``(replicate, shard)`` mesh; groups from :class:`labkit.grid.Mesh`). The first M-1 backwards of
  a step run under ``no_sync()`` (the pipeline runtime's rule), so every stage reduces once per
  step. ZeRO-2/3 compose with sequence parallelism (the LayerNorm gradients, partial over TP,
  are summed over TP inside the reduce-scatter hooks), full recompute and tied embeddings (the
  copy's bucket or unit waits for the embedding-group all-reduce after the backwards), as Llama
  3's FSDP + TP + SP, and with MoE (the local experts unsharded); ZeRO-2 and 3 also with the
  zero-bubble schedules (backward split into I and W: FSDP gathers a stage's units for each I and W
  and keeps them until the stage's last W, which reshards and reduce-scatters them). What stays
  refused: :func:`check_layout`.

Context parallelism (``grid.cp`` > 1, :mod:`labkit.context_parallel`; rank order tp-cp-dp-pp):
each CP rank holds its share of every sequence (the load-balanced 2 cp chunks), the embedding
adds those tokens' positions, every attention core runs ring attention, the all-gather of K/V
or Ulysses over the CP group (TP's local heads), and the gradients are averaged over the d cp
ranks that share a stage and TP rank (Megatron-Core's data-parallel group with CP: DDP over it,
and ZeRO 1-3 shard over it: its distributed optimizer and FSDP units span d cp ranks). With
sequence parallelism (t > 1) each CP rank's S/cp tokens are split once more over its TP group
(Megatron-Core runs TP + SP inside each CP rank): the stages exchange ``[b, S/(cp t), H]``, and
attention sees the S/cp tokens the column-parallel projections all-gather. HSDP with CP (as
torchtitan's ``(dp_replicate, dp_shard_cp)`` mesh): R replicas of the DP coordinate, each
sharding over its (d/R) cp ranks, so R = d leaves cp shard ranks. With the MoE GPT each CP rank
routes its S/cp tokens and dispatches them over its EP group (the d DP ranks of this CP rank),
the balance losses are computed on the router logits gathered over CP (and TP with SP), the
router and shared experts are averaged over the d cp ranks with the dense parameters, and the
local experts' gradients, scaled 1/(d cp) there, are summed over CP (their expert-data-parallel
group; Megatron-Core reduces expert gradients over its DP x CP expert group); no capacity
dropping and no HSDP with it (ValueError).

Global batch B: DP rank r takes rows ``r*B/d .. (r+1)*B/d - 1`` and the pipeline splits them into
M microbatches of ``b = B/(d*M)`` sequences. The loss is the mean over every valid target of the
step (targets of -100 left out, as ``F.cross_entropy`` on one device), whatever the shards hold
(:mod:`labkit.parallel.loss`): before the first backward the last stage's ranks count the N valid
targets of the step, one all-reduce of an 8-byte count over the d cp ranks (the ``"loss"`` axis of
:meth:`ParallelGPT.comm_by_axis`); each microbatch hands the runtime the sum of its valid token
losses times M (d cp) / N, the runtime divides it by M once and DDP or ZeRO averages over the d cp
ranks once, so the gradient is that of the global token mean, as on one device (also when the
shards hold different numbers of valid targets, or none). The MoE balance losses keep their own
per-group normalization (:mod:`labkit.moe.losses`).

Tied embeddings (``GPTConfig.share_embeddings_and_output_weights``): with p = 1 the stage holds
one matrix (under ZeRO-3 one FSDP unit with the embedding and the head); with p > 1 the first and
the last stage each hold a copy and, after backward, all-reduce its gradient over their *embedding
group* (the two ranks with the same dp and tp rank; Megatron-LM's rule, Shoeybi et al. 2019 and
``megatron/core/distributed/finalize_model_grads``).

What the planner reads (helper functions returning data, no printing):

* :meth:`ParallelGPT.memory` -> ``{"params", "grads", "optimizer"}``: bytes held on this rank
  (parameters, their ``.grad``, per-element optimizer state);
* :meth:`ParallelGPT.comm_by_axis` (records of a :class:`labkit.comm.CommLog`) ->
  ``{axis: {kind: (count, bytes)}}`` for axes ``"tp"``, ``"pp"``, ``"dp"``, ``"embedding"``, ``"loss"``
  (the valid-target count and the reported loss, 8 bytes each, on the last stage's ranks);
* :meth:`ParallelGPT.wire_by_axis` -> ``{axis: bytes sent under the ring algorithms}``;
* :meth:`ParallelGPT.expected_comm` -> the same dict from the formulas, for one training step
  after the first (the first also sends the pipeline's shape messages);
* :func:`layout` -> which rank holds which layers and which shard (for the rank-grid picture).
"""
from __future__ import annotations

import warnings
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn

from .. import comm
from ..checkpoint import recomputing
from ..context_parallel import ATTENTIONS, check_sequence_split, check_ulysses, sequence_positions, shard_sequence
from ..data_parallel import (
    DistributedDataParallel,
    FullyShardedDataParallel,
    ZeroRedundancyOptimizer,
    ZeroStage2,
    default_units,
)
from ..data_parallel.zero import optimizer_state_bytes
from ..grid import Mesh, ProcessGrid
from ..model import lm_loss
from ..moe.expert_parallel import expert_param_names
from ..moe.pipeline import finish_step
from ..pipeline.registry import canonical, lookup, names
from ..pipeline.runtime import PipelineStage
from ..pipeline.schedules import stage_rank
from ..pipeline.stages import stage_layers
from ..plan.comm import comm_per_rank
from ..plan.memory import check_layout as plan_check_layout
from ..plan.memory import rank_stages, zero3_split_gathers, zero3_stage_units
from ..plan.spec import Layout, ModelSpec
from ..tensor_parallel import allreduce_layernorm_grads, allreduce_sequence_parallel_grads, gpt_plan, parallelize
from ..tensor_parallel.mappings import all_gather_along_dim
from .loss import StepTokenCount
from .moe_pipeline import moe_block_rule, split_moe_gpt

__all__ = ["SCHEDULES", "check_layout", "check_cp_layout", "ParallelGPT", "layout"]

SCHEDULES = names()   # every schedule with a runtime (labkit.pipeline.registry; other spellings accepted)


def check_layout(cfg, world_size: int, tp: int, pp: int, dp: int, v: int = 1, n_microbatches: int = 1,
                 global_batch: int | None = None, schedule: str = "1f1b", n_experts: int | None = None,
                 zero: int = 0, sequence_parallel: bool = False, recompute: str = "none",
                 seq_len: int | None = None, hsdp: int = 1, cp: int = 1) -> None:
    """Raise ValueError naming the values and the rule when a layout cannot be built; no
    communication (call it before any rank starts).

    The rules of the model and the layout are the planner's (:func:`labkit.plan.memory.check_layout`,
    the one home of them: t divides n_head, n_kv_head and the FFN width; interleaved 1F1B needs
    max(1, M // p) equal rounds; sequence parallelism t | S; E experts divisible by the EP size
    (= d); ``recompute`` one of none, selective, full). What this runtime adds, before them:
    t * p * d = world size; the registry's schedule (GPipe, 1F1B and ZB-H1 v = 1, ZB-V and
    DualPipeV v = 2, DualPipeV M >= 2p); L divisible by p * v (equal stages); after them: t
    divides the vocabulary V (no padding); the global batch divisible by d * M; tied embeddings
    with p = 1 need v = 1, and are not combined with the V-shaped schedules; ``zero`` a ZeRO stage
    0-3 (True: 1); ``hsdp`` R replicas (ZeRO-3 only) dividing d, below d unless cp > 1 (the shard
    group is the d/R x cp ranks, :func:`check_cp_layout`; ``world_size`` counts t p d, without cp).
    Refused: full recompute with a zero-bubble schedule (labkit's reentrant checkpoint
    differentiates a whole block inside I, weight gradients included: nothing is left for W, and a
    data-parallel wrapper would reduce them out of order). ZeRO-1, 2 and 3 run with MoE (the local experts whole,
    outside the flat buffer, buckets or units, their gradients scaled by 1/d: with EP = d their
    expert-DP group is one rank). ZeRO-2/3 run with sequence parallelism (the LayerNorm
    gradients summed over TP inside their hooks, before the reduce-scatter), full recompute
    (ZeRO-2's sync stays open across the recompute's nested backwards) and tied embeddings at
    p > 1 (the copy's bucket/unit reduce-scattered after the embedding-group all-reduce of its full
    gradient) and at p = 1 (ZeRO-3: the embedding and the head one FSDP unit), and with the
    zero-bubble schedules without full recompute (ZeRO-2's sync open until the last W's buckets
    start; FSDP's units gathered for each I and W and kept until the stage's last W).
    """
    zero = _zero_stage(zero)
    for name, val in (("t (--tp)", tp), ("p (--pp)", pp), ("d (--dp)", dp), ("v (chunks)", v),
                      ("M (microbatches)", n_microbatches)):
        if not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {val!r}")
    if tp * pp * dp != world_size:
        raise ValueError(f"t={tp} * p={pp} * d={dp} = {tp * pp * dp} must equal the world size {world_size}")
    info = lookup(schedule) if isinstance(schedule, str) and canonical(schedule) in SCHEDULES else None
    if info is None:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if info.v_shaped and v != 2:
        raise ValueError(f"schedule {schedule!r} runs two stages per rank (v=2, V placement); got v={v}")
    if info.chunks == 1 and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank (v=1); got v={v} (use interleaved)")
    if not isinstance(hsdp, int) or isinstance(hsdp, bool) or hsdp < 1 or dp % hsdp:
        raise ValueError(f"HSDP replicas R={hsdp!r} must be an integer >= 1 that divides d={dp} "
                         f"(d ranks = R replicas x d/R shards)")
    if hsdp > 1 and hsdp == dp and cp == 1:
        raise ValueError(f"HSDP with R = d = {dp} replicas leaves one rank per shard group (nothing is sharded): "
                         f"use R < d, or DDP")
    if hsdp > 1 and zero != 3:
        raise ValueError(f"HSDP (R={hsdp} replicas) shards the parameters: it needs ZeRO-3, got ZeRO-{zero}")
    if recompute == "full" and info.zero_bubble:
        raise ValueError(f"full recompute with {info.label}: labkit's checkpoint recomputes and differentiates a "
                         f"whole block inside the input-gradient pass (I), so the block's weight gradients cannot "
                         f"wait for W (and a data-parallel sync would see them out of order); use --recompute "
                         f"selective or none with it, or a schedule without split backward")
    if n_microbatches < info.min_microbatches(pp):
        raise ValueError(f"{info.label} needs M >= 2p microbatches: M={n_microbatches}, p={pp}")
    if cfg.n_layer % (pp * v):
        raise ValueError(f"n_layer={cfg.n_layer} layers must be divisible by p*v = {pp}*{v} = {pp * v} "
                         f"(each pipeline stage gets the same number of layers)")
    # the planner's rules: the rounds rule of loop placement with v > 1; V placement has none of its own
    B = global_batch or dp * n_microbatches
    spec = ModelSpec.from_gpt_config(cfg, seq_len=seq_len or cfg.block_size, global_batch=B)
    if n_experts is not None:
        spec = replace(spec, n_routed_experts=n_experts, n_activated_experts=1)
    pv = v if pp > 1 and info.chunks is None else 1
    lay = Layout(t=tp, p=pp, d=dp, v=pv, b=max(1, B // (dp * n_microbatches)), M=n_microbatches,
                 schedule="interleaved" if pv > 1 else "1f1b", zero=zero, precision="fp32",
                 ep=dp if n_experts is not None else 1, recompute=recompute,
                 sequence_parallel=bool(sequence_parallel) and seq_len is not None)
    plan_check_layout(spec, lay)
    if cfg.vocab_size % tp:
        raise ValueError(f"vocab_size={cfg.vocab_size} must be divisible by t={tp} (each TP rank gets an equal share)")
    if global_batch is not None and global_batch % (dp * n_microbatches):
        raise ValueError(f"global batch B={global_batch} must be divisible by d*M = {dp}*{n_microbatches} = "
                         f"{dp * n_microbatches} (each DP rank splits its B/d sequences into M microbatches)")
    tied = getattr(cfg, "share_embeddings_and_output_weights", False)
    if tied and ((pp == 1 and v > 1) or info.v_shaped):
        raise ValueError(f"tied embeddings with p={pp}, v={v}, schedule {schedule!r}: the first and last stage "
                         f"would be two modules on one rank; use p > 1 with loop placement, or v = 1")


def hsdp_dp_comm(spec: ModelSpec, lay: Layout, replicas: int, pp_rank: int, bytes_per_element: int = 4,
                 actions=None) -> dict:
    """HSDP's DP traffic of one step on pipeline rank ``pp_rank`` (``lay``: the whole layout, d
    ranks; fp32), ``{kind: (count, bytes)}`` as :class:`labkit.comm.CommLog` counts it: per FSDP
    unit (:func:`labkit.plan.memory.zero3_units`) over the S = (d/R) cp shard ranks an all-gather of its
    padded n/S shard before each of the M forwards and M backwards (a split backward: as many as
    :func:`labkit.plan.memory.zero3_split_gathers` counts along this rank's ``actions``), one
    reduce-scatter of the padded n, and across the R replicas one all-reduce of the n/S shard
    (FSDP2's HSDP; Zhao et al. 2023 sec. 3.2)."""
    S, b, M = lay.d // replicas * lay.cp, bytes_per_element, lay.M
    lay_s = replace(lay, d=S)
    per_stage = [[-(-n // S) for n in units] for units in zero3_stage_units(spec, lay_s, pp_rank)]
    if actions is not None and any(a.kind in ("I", "W") for a in actions):
        gathers = [zero3_split_gathers(actions, s, M) for s in rank_stages(lay_s, pp_rank)]
    else:
        gathers = [2 * M] * len(per_stage)
    shards = [n for st in per_stage for n in st]
    return {"all_gather": (sum(g * len(st) for g, st in zip(gathers, per_stage)),
                           sum(g * sum(st) for g, st in zip(gathers, per_stage)) * b),
            "reduce_scatter": (len(shards), sum(shards) * S * b), "all_reduce": (len(shards), sum(shards) * b)}


def _zero_stage(zero) -> int:
    """The ZeRO stage 0-3 of ``zero`` (False/True: 0/1, as before stages 2 and 3 existed)."""
    if isinstance(zero, bool):
        return int(zero)
    if not isinstance(zero, int) or not 0 <= zero <= 3:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")
    return zero


def check_cp_layout(cfg, tp: int, cp: int, cp_attention: str, sequence_parallel: bool = False,
                    zero: int = 0, seq_len: int | None = None, hsdp: int = 1, load_balance: bool = True,
                    recompute: str = "none") -> None:
    """Raise ValueError (one line, before any rank starts) when context parallelism cannot run:
    ``cp_attention`` one of ring | allgather | ulysses; Ulysses needs cp to divide the heads and K/V
    heads of each TP rank; the sequence divisible by 2 cp (cp with ``load_balance=False``), and with
    sequence parallelism at t > 1 each CP rank's S/cp tokens divisible by t (Megatron-Core runs
    TP + SP inside each CP rank); ZeRO 1-3 shard over the d cp ranks of a stage, and HSDP (``hsdp``
    = R, dividing d: :func:`check_layout`) over R replicas x (d/R) cp shard ranks (torchtitan's
    ``dp_shard_cp`` mesh dimension, Megatron-Core's data-parallel group with CP split into
    distributed-optimizer instances); selective recompute checkpoints the CP core of any kind (its
    forward communication runs again in backward, and its saves rise above the stash while it
    re-runs, as the planner counts: :func:`labkit.plan.memory.cp_core_recompute_bytes`)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp (--cp) must be an integer >= 1, got {cp!r}")
    if cp_attention not in ATTENTIONS:
        raise ValueError(f"cp attention (--cp-attention) must be one of {' | '.join(ATTENTIONS)}, got {cp_attention!r}")
    if cp > 1 and cp_attention == "ulysses":
        check_ulysses(cfg.n_head // tp, cfg.n_kv_head // tp, cp)
    if cp > 1 and seq_len is not None:
        check_sequence_split(seq_len, cp, load_balance)
        if sequence_parallel and tp > 1 and (seq_len // cp) % tp:
            raise ValueError(f"sequence parallelism with context parallelism: each CP rank's S/cp = "
                             f"{seq_len}/{cp} = {seq_len // cp} tokens must be divisible by t={tp}")


@torch.no_grad()
def _allreduce_grads(params, group) -> None:
    """Sum the ``.grad`` of ``params`` over ``group`` in one coalesced all-reduce (none without any)."""
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return
    flat = torch.cat([gr.reshape(-1) for gr in grads])
    comm.all_reduce(flat, group)
    offset = 0
    for gr in grads:
        gr.copy_(flat[offset:offset + gr.numel()].view_as(gr))
        offset += gr.numel()


def _piece_loss(head, tokens, output, target):
    """The loss one microbatch hands the pipeline runtime: the sum of its valid token losses times
    M (d cp) / N (:class:`labkit.parallel.loss.StepTokenCount`; 0 when the step has none)."""
    return tokens.piece_loss(head.loss(output, target, reduction="sum"))


def _cp_core(attention, group, positions, stats, q, k, v):
    """The attention core of one layer under CP: this rank's local heads, its S/cp queries
    (``stats``: a list the attention appends its work and compute time to, or None)."""
    kw = {"stats": stats} if stats is not None and not recomputing() else {}   # one entry per forward
    return attention(q, k, v, group, [p.to(q.device) for p in positions], causal=True, **kw)


def layout(cfg, tp: int, pp: int, dp: int, v: int = 1, placement: str = "loop") -> list[dict]:
    """For every global rank: ``{"rank", "tp_rank", "dp_rank", "pp_rank", "stages", "layers",
    "embedding", "head", "shard"}`` (``shard``: "heads a..b, vocab c..d" of this TP rank)."""
    out = []
    n_stages = pp * v
    grid = ProcessGrid(tp=tp, pp=pp, dp=dp)
    for r in range(grid.world):
        c = grid.coords(r)
        t, d, p = c["tp"], c["dp"], c["pp"]
        stages = [s for s in range(n_stages) if stage_rank(s, pp, placement) == p]
        layers = [j for s in stages for j in stage_layers(cfg.n_layer, n_stages, s)]
        h, V = cfg.n_head // tp, cfg.vocab_size // tp
        out.append({"rank": r, "tp_rank": t, "dp_rank": d, "pp_rank": p, "stages": stages, "layers": layers,
                    "embedding": 0 in stages, "head": n_stages - 1 in stages,
                    "shard": f"heads {t * h}-{(t + 1) * h - 1}, vocab {t * V}-{(t + 1) * V - 1}"})
    return out


def planner_spec(cfg, seq: int, batch: int, moe_cfg=None, moe_layer_freq: int = 1) -> ModelSpec:
    """The planner's :class:`labkit.plan.spec.ModelSpec` of labkit's GPT (``moe_cfg``: of its MoE
    variant, :class:`labkit.moe.MoEGPT`: E routed experts of width ``moe_ffn_dim``, top-k, shared
    experts, every ``moe_layer_freq``-th layer MoE)."""
    spec = ModelSpec.from_gpt_config(cfg, seq_len=seq, global_batch=batch)
    if moe_cfg is None:
        return spec
    return replace(spec, n_routed_experts=moe_cfg.n_routed_experts, n_activated_experts=moe_cfg.n_activated_experts,
                   n_shared_experts=moe_cfg.n_shared_experts, moe_ffn=moe_cfg.moe_ffn_dim,
                   moe_layer_freq=moe_layer_freq)


class ParallelGPT:
    """This rank's part of the GPT on a :class:`labkit.grid.ProcessGrid` (t, p, d).

    Args:
        reference: the single-device :class:`labkit.model.GPT` (same seed on every rank).
        grid: from ``ProcessGrid.build(ctx, tp=t, pp=p, dp=d)``.
        schedule: "gpipe" | "1f1b" | "interleaved" | "zb-h1" | "zbv" | "dualpipev" (or another
            spelling of :mod:`labkit.pipeline.registry`, e.g. "zbh1"); ``v``: chunks
            per rank (interleaved: any; zbv, dualpipev: 2 in V placement; else 1).
        n_microbatches: M per step (per DP rank).
        zero: ZeRO stage over the DP group (with CP the d cp ranks of the stage): 0 DDP, 1 ZeRO-1
            (in :meth:`make_optimizer`), 2 :class:`~labkit.data_parallel.ZeroStage2`, 3 FSDP
            units (True: 1, False: 0).
        hsdp: R replicas of HSDP (ZeRO-3; R divides d): shard over the (d/R) cp ranks, all-reduce across R.
        cp_attention, cp_load_balance: with ``grid.cp`` > 1, the CP attention (ring | allgather |
            ulysses) and the split (True: the 2 cp chunks r, 2cp-1-r; False: contiguous); the
            attention's per-forward work and compute time are appended to ``cp_stats``.
        bucket_cap_mb: DDP bucket size.
        reference may also be a :class:`labkit.moe.MoEGPT` whose MoE layers route in
            ``token_groups = d*M`` groups: its experts are spread over the DP group (EP folded onto
            DP, Megatron-Core's "parallel folding"; E divisible by d), each stage attaches its balance
            losses (:mod:`labkit.parallel.moe_pipeline`), DDP leaves the experts unreduced (their
            gradient already sums every rank's tokens through the all-to-all; ZeRO-2 keeps them
            whole in :class:`~labkit.data_parallel.ZeroStage2`, outside ZeRO-1's flat buffer and the
            FSDP units). Selective recompute checkpoints the MoE blocks' attention core too, full
            recompute the whole MoE block; with sequence parallelism each TP rank routes and
            dispatches its S/t tokens and the balance losses are computed on the router logits
            all-gathered over TP (:class:`labkit.parallel.moe_pipeline.ParallelMoEBlock`; not with
            ``capacity_factor``: ValueError); with CP likewise each CP rank's S/cp tokens (module
            docstring).
        sequence_parallel, recompute: the TP blocks' options (:class:`labkit.tensor_parallel.ParallelBlock`;
            Korthikanti et al. 2022); under SP the stages exchange this rank's ``[b, S/t, H]``
            shard and the ``sequence_parallel`` gradients are all-reduced over TP in :meth:`train_step`.

    Each stage reads: slice the reference (:meth:`labkit.model.GPT.slice`) -> parallelize it over
    the TP group (:func:`labkit.tensor_parallel.parallelize` with ``gpt_plan``) -> wrap it for
    data parallelism (DDP; or ZeRO-1 in the optimizer) -> a pipeline stage of the schedule.

    :meth:`train_step` ``(x [B, S], y [B, S])`` runs forward and backward of the global batch
    (every rank passes the same batch; each takes its DP slice; targets of -100 are left out) and
    returns the step's loss, the mean over its valid targets (the number one device reports: one
    all-reduce of 8 bytes over the d cp ranks after the step), on the last pipeline stage, else
    None. A step without any valid target returns 0.0 with zero token-loss gradients and a
    RuntimeWarning (never NaN). Raises ValueError (before communication) as :func:`check_layout`.
    """

    def __init__(self, reference: nn.Module, grid, schedule: str = "1f1b", n_microbatches: int = 1, v: int = 1,
                 zero: int = 0, bucket_cap_mb: float = 25.0, sequence_parallel: bool = False,
                 recompute: str = "none", plan: dict | None = None, cp_attention: str = "ring", hsdp: int = 1,
                 cp_load_balance: bool = True):
        cfg = reference.cfg
        cp = getattr(grid, "cp", 1)
        moe_cfg = getattr(reference, "moe_cfg", None)
        zero = _zero_stage(zero)
        if moe_cfg is not None and sequence_parallel and grid.tp > 1 and moe_cfg.capacity_factor is not None:
            raise ValueError(f"the MoE GPT with sequence parallelism (t={grid.tp}) routes each TP rank's S/t tokens "
                             f"on its own, but capacity dropping (capacity_factor={moe_cfg.capacity_factor}) "
                             f"decides over the whole group of b*S tokens: use capacity_factor=None with SP")
        if moe_cfg is not None and cp > 1 and hsdp > 1:
            raise ValueError(f"the MoE GPT with context parallelism (cp={cp}) is not combined with HSDP (R={hsdp}) "
                             f"here: use ZeRO-3 without HSDP, or cp = 1")
        if moe_cfg is not None and cp > 1 and moe_cfg.capacity_factor is not None:
            raise ValueError(f"the MoE GPT with context parallelism (cp={cp}) routes each CP rank's S/cp tokens "
                             f"on its own, but capacity dropping (capacity_factor={moe_cfg.capacity_factor}) "
                             f"decides over the whole group of b*S tokens: use capacity_factor=None with CP")
        check_layout(cfg, grid.ctx.world_size // cp, grid.tp, grid.pp, grid.dp, v, n_microbatches, schedule=schedule,
                     sequence_parallel=sequence_parallel, recompute=recompute, zero=zero, hsdp=hsdp,
                     n_experts=None if moe_cfg is None else moe_cfg.n_routed_experts, cp=cp)
        if cp > 1:
            check_cp_layout(cfg, grid.tp, cp, cp_attention, sequence_parallel, zero, hsdp=hsdp,
                            load_balance=cp_load_balance, recompute=recompute)
        self.cp, self.cp_attention, self.cp_load_balance = cp, cp_attention, bool(cp_load_balance)
        self.cp_stats: list = []    # the CP attention's {"work", "heads", "seconds", ...} (cleared by the caller)
        if moe_cfg is not None:
            if grid.ep != grid.dp:
                raise ValueError(f"ParallelGPT folds EP onto the whole DP group: ep must equal d={grid.dp}, "
                                 f"got ep={grid.ep}")
            if moe_cfg.token_groups != grid.dp * n_microbatches:
                raise ValueError(f"the reference must route in token_groups = d*M = {grid.dp * n_microbatches} "
                                 f"groups (one per microbatch and DP rank), got {moe_cfg.token_groups}")
        self.moe = moe_cfg is not None
        self.moe_cfg, self.moe_layer_freq = moe_cfg, getattr(reference, "moe_layer_freq", 1)
        self.cfg, self.grid, self.v, self.M = cfg, grid, v, n_microbatches
        self.sequence_parallel, self.recompute = bool(sequence_parallel) and grid.tp > 1, recompute
        self.zero, self.bucket_cap_mb, self.hsdp = zero, bucket_cap_mb, hsdp
        self.tied = bool(getattr(cfg, "share_embeddings_and_output_weights", False))
        t, p, d = grid.tp, grid.pp, grid.dp
        self.n_stages = n = p * v
        device = grid.ctx.device
        info = lookup(schedule)
        self.placement = placement = info.placement
        self.stage_ids = [s for s in range(n) if stage_rank(s, p, placement) == grid.pp_rank]
        group = grid.tp_group   # t = 1 too: one block class, whose saved tensors the planner counts
        if plan is None:
            plan = gpt_plan(self.sequence_parallel, recompute) if group is not None else {}
            if self.moe:
                plan = {**plan, "blocks.*": moe_block_rule(grid.ep_group, grid.ep_rank, grid.ep, plan.get("blocks.*"),
                                                           sequence_parallel=self.sequence_parallel,
                                                           recompute=recompute,
                                                           cp_group=grid.cp_group if cp > 1 else None)}
        self.modules: list[nn.Module] = []
        for s in self.stage_ids:
            if self.moe:                                                                    # slice
                stage = split_moe_gpt(reference, n, n_microbatches, [s])[0]
            else:
                stage = reference.slice(stage_layers(cfg.n_layer, n, s), s == 0, s == n - 1)
            parallelize(stage, group, plan)                                                 # parallelize
            self.modules.append(stage.to(device))
        # the local experts: replicated over CP, each copy's gradient covers its CP rank's tokens
        self._expert_params = [q for m in self.modules for nm, q in m.named_parameters() if nm in expert_param_names(m)]
        # embedding group: first and last pipeline rank with this (dp_rank, tp_rank); every rank
        # creates every group, in the same order (a torch rule)
        self.emb_group, self.emb_ranks = None, ()
        if self.tied and p > 1:
            for dd in range(d):
                for c in range(cp):
                    for tt in range(t):
                        ranks = [grid.rank_of(pp=0, dp=dd, cp=c, tp=tt), grid.rank_of(pp=p - 1, dp=dd, cp=c, tp=tt)]
                        g = grid.ctx.new_group(ranks)
                        if grid.ctx.rank in ranks:
                            self.emb_group, self.emb_ranks = g, tuple(ranks)
        self.dp_cp_group, self.dp_cp_ranks, self.dp_cp = grid.dp_group, tuple(grid.ranks("dp")), d * cp
        if cp > 1:     # the d cp ranks of this (pp, tp) reduce gradients together; every rank makes every group
            for pp_ in range(p):
                for tt in range(t):
                    ranks = [grid.rank_of(pp=pp_, dp=dd, cp=c, tp=tt) for dd in range(d) for c in range(cp)]
                    g = grid.ctx.group if len(ranks) == grid.ctx.world_size else grid.ctx.new_group(ranks)
                    if grid.ctx.rank in ranks:
                        self.dp_cp_group, self.dp_cp_ranks = g, tuple(ranks)
        self.ddp = [DistributedDataParallel(m, self.dp_cp_group, bucket_cap_mb, expert_params=expert_param_names(m))
                    if d * cp > 1 and not zero else None for m in self.modules]             # data parallel
        # TP slicing of every parameter (name -> partition dim or None), read before ZeRO-3 hides them
        self._tp_dims = [{n: (q.partition_dim if getattr(q, "tensor_model_parallel", False) and t > 1 else None)
                          for n, q in m.named_parameters(remove_duplicate=False)} for m in self.modules]
        # a tied embedding's copy (p > 1), per stage module: summed over the embedding group after the
        # step's backwards (train_step), so under ZeRO-2/3 its bucket/unit is reduce-scattered only then
        self._tied_names = [[n for n, q in m.named_parameters() if self.emb_group is not None
                             and q is self._tied_weight(m)] for m in self.modules]
        self.sharded = self._wrap_sharded() if self.dp_cp > 1 and zero >= 2 else [None] * len(self.modules)
        submods = [w if w is not None else s if s is not None else m
                   for w, s, m in zip(self.ddp, self.sharded, self.modules)]
        stages = [PipelineStage(sm, s, n, device, group=grid.pp_group)                     # pipeline stage
                  for sm, s in zip(submods, self.stage_ids)]
        heads = [m.head for m in self.modules if m.head is not None]
        # the step's valid targets N, counted before the first backward (labkit.parallel.loss): each
        # microbatch hands the runtime its SUM of valid token losses times M (d cp) / N
        self.tokens = StepTokenCount(n_microbatches, self.dp_cp)
        loss_fn = partial(_piece_loss, heads[0], self.tokens) if heads else lm_loss   # vocab-parallel under TP
        one_per_rank = info.chunks == 1
        self.schedule = info.runtime_class(stages[0] if one_per_rank else stages, n_microbatches, loss_fn)
        self.optimizer = None

    def _wrap_sharded(self) -> list:
        """ZeRO-2 or FSDP wrappers of this rank's stages over the DP group, the d cp ranks of the
        stage with CP. HSDP: the shard and replicate groups of ``Mesh(pp, replicate=R, shard=(d/R) cp,
        tp)``, created by every rank in order: the DP coordinate split into (replicate, dp_shard), and
        dp_shard x cp flattened into the shard dimension (torchtitan's ``dp_shard_cp``; the grid's
        order pp-dp-cp-tp makes those ranks a block of the mesh)."""
        g = self.grid
        partial = g.tp_group if self.sequence_parallel else None    # SP: LayerNorm grads summed over TP
        defer = self._tied_names
        if self.zero == 2:   # the optimizer class comes with make_optimizer; SGD holds the place
            # MoE: the local experts (EP = d, so their expert-DP group is one rank) stay whole
            return [ZeroStage2(m, torch.optim.SGD, self.dp_cp_group, self.bucket_cap_mb, partial_grad_group=partial,
                               defer_reduce=tied, expert_params=sorted(expert_param_names(m)), lr=0.0)
                    for m, tied in zip(self.modules, defer)]
        shard_group, replicate_group = self.dp_cp_group, None
        if self.hsdp > 1:
            mesh = Mesh(pp=g.pp, replicate=self.hsdp, shard=g.dp // self.hsdp * self.cp, tp=g.tp)
            shard_group = mesh.new_groups(g.ctx, "shard")
            replicate_group = mesh.new_groups(g.ctx, "replicate")
        return [FullyShardedDataParallel(m, default_units(m), shard_group, replicate_group=replicate_group,
                                         partial_grad_group=partial, defer_reduce=tied,
                                         expert_params=sorted(expert_param_names(m)))
                for m, tied in zip(self.modules, defer)]

    # ---------------------------------------------------------------- training

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (ZeRO-3: its flat shards, what the optimizer steps)."""
        if self.zero == 3 and self.sharded[0] is not None:    # MoE: and the whole local experts
            return [u.shard for w in self.sharded for u in w.units] + [q for w in self.sharded for q in w.expert_params]
        seen, out = set(), []
        for m in self.modules:
            for prm in m.parameters():
                if id(prm) not in seen:
                    seen.add(id(prm))
                    out.append(prm)
        return out

    def gathered_buffers(self) -> list[torch.Tensor]:
        """ZeRO-3: every FSDP unit's buffer its full parameters are all-gathered into (storage
        of size 0 while resharded; the tensors saved for backward that live in it are weights, not
        activations). Else empty."""
        return [u.raw for w in self.sharded if isinstance(w, FullyShardedDataParallel) for u in w.units]

    def make_optimizer(self, name: str = "sgd", lr: float = 0.1, **kw):
        """``torch.optim.SGD`` or ``Adam`` over this rank's parameters, or ZeRO-1 of it over
        the DP group (the d cp ranks with CP) when ``zero`` and d cp > 1. Stored as ``self.optimizer``."""
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]
        if self.zero == 2 and self.dp_cp > 1:
            self.optimizer = _Zero2Step(self.sharded, cls, lr=lr, **kw)
        elif self.zero == 1 and self.dp_cp > 1:   # MoE: the local experts whole, outside the flat buffer
            experts = [q for m in self.modules for n, q in m.named_parameters() if n in expert_param_names(m)]
            self.optimizer = ZeroRedundancyOptimizer(self.parameters(), cls, self.dp_cp_group, expert_params=experts,
                                                     lr=lr, **kw)
        else:
            self.optimizer = cls(self.parameters(), lr=lr, **kw)
        return self.optimizer

    def zero_grad(self) -> None:
        for prm in self.parameters():
            prm.grad = None
        for w in self.sharded:
            if w is not None and self.zero == 2:
                w.zero_grad()

    def train_step(self, x: torch.Tensor, y: torch.Tensor):
        """Forward and backward of the global batch; gradients averaged over DP (DDP), left
        local for ZeRO-1's reduce-scatter, or reduce-scattered into the DP shards (ZeRO-2/3) in each
        stage's last backward of the step; tied embedding gradients summed over the embedding group.
        The loss is the token mean over the step's valid targets (class docstring; ``self.tokens.n``
        holds their number N after the call)."""
        B, d = x.shape[0], self.grid.dp
        if B % (d * self.M):
            raise ValueError(f"global batch B={B} must be divisible by d*M = {d}*{self.M}")
        dev = self.grid.ctx.device
        x, y = self.grid.shard(x, "dp"), self.grid.shard(y, "dp")    # this DP rank's B/d sequences
        if self.cp > 1:                       # this CP rank's tokens
            x, y = self._context_parallel(x, y)
        if self.has_last_stage:               # N: one all-reduce of this rank's count over the d cp ranks
            self.tokens.count(y.to(dev), self.dp_cp_group if self.dp_cp > 1 else None)   # NCCL: on the GPU
            if self.tokens.n == 0:
                warnings.warn("ParallelGPT.train_step: no valid target in this step (every target is "
                              f"ignore_index={self.tokens.ignore_index}): the loss is 0 and the gradients of the "
                              "token loss are zero", RuntimeWarning, stacklevel=2)
        losses: list = []
        self.schedule.step(x.to(dev), target=y.to(dev), losses=losses)
        for w in self.ddp:
            if w is not None:
                w.finish_grad_sync()          # no-op when the last backward completed it
        if self.sequence_parallel and self.sharded[0] is None:   # ZeRO-2/3 sum them in their hooks
            # LayerNorms etc. (MoE: routers and experts too) saw S/t tokens: sum over TP, once per step
            allreduce_layernorm_grads(nn.ModuleList(self.modules), self.grid.tp_group)
        elif self.sequence_parallel and self.moe:   # ZeRO-2/3 keep the local experts whole, outside their hooks
            allreduce_sequence_parallel_grads([q for w in self.sharded for q in w.expert_params], self.grid.tp_group)
        if self.moe and self.cp > 1:     # the local experts' copies over CP each saw their CP rank's tokens
            _allreduce_grads(self._expert_params, self.grid.cp_group)
        if self.moe and any(layer.cfg.expert_bias for m in self.modules for layer in m.moe_layers().values()):
            finish_step(self.modules, self.dp_cp_group if self.dp_cp > 1 else None,    # aux-loss-free bias
                        self.grid.tp_group if self.sequence_parallel else None,
                        clear_aux_values=False)    # take_aux_loss reports and clears them
        if self.emb_group is not None:        # the two copies' gradients summed (full ones: ZeRO-2/3 defer them)
            comm.all_reduce(self._tied_grad(), self.emb_group)
        for w in self.sharded:
            if w is not None and hasattr(w, "finish_grad_sync"):
                w.finish_grad_sync()          # ZeRO-2/3: open syncs and deferred buckets/units reduce-scattered
        if losses:   # the step's token mean, the number one device reports: one more all-reduce of 8 bytes
            mine = torch.tensor(sum(float(v) for v in losses) / (self.M * self.dp_cp), dtype=torch.float64, device=dev)
            if self.dp_cp > 1:
                comm.all_reduce(mine, self.dp_cp_group)
            return float(mine)
        return None

    def _context_parallel(self, x: torch.Tensor, y: torch.Tensor):
        """Shard a batch [b, S] to this CP rank's [b, S/cp] and point the embedding and every
        attention core of this rank's stages at the CP group (positions of the load-balanced split)."""
        g, S, lb = self.grid, x.shape[1], self.cp_load_balance
        check_sequence_split(S, self.cp, lb)
        if self.sequence_parallel and (S // self.cp) % g.tp:
            raise ValueError(f"sequence parallelism with context parallelism: S/cp = {S}/{self.cp} tokens per CP "
                             f"rank must be divisible by t={g.tp}")
        positions = [sequence_positions(S, r, self.cp, lb) for r in range(self.cp)]
        core = partial(_cp_core, ATTENTIONS[self.cp_attention], g.cp_group, positions,
                       self.cp_stats)
        for m in self.modules:
            if m.embedding is not None:
                m.embedding.positions = positions[g.cp_rank]
            for block in m.blocks:
                block.attn.core = core
        return shard_sequence(x, 1, g.cp_rank, self.cp, lb), shard_sequence(y, 1, g.cp_rank, self.cp, lb)

    def take_aux_loss(self) -> float:
        """MoE: the sum over this rank's MoE layers of their balance loss averaged over the step's M
        microbatches (from the forwards whose backward ran; unscaled, as in the reference's loss),
        then forgotten. Local: the stages of the other pipeline ranks hold the other layers'."""
        total = 0.0
        for m in self.modules:
            values = getattr(m, "aux_values", None)
            if values:
                total += sum(values) / self.M
                values.clear()
        return total

    def reference_name(self, stage: nn.Module, name: str) -> str:
        """The single-device model's name of ``stage``'s parameter or buffer ``name``: global block
        index, and for a local expert its global id (``...moe.experts.<expert_offset + j>...``)."""
        if ".experts." in name:
            pre, rest = name.split(".experts.", 1)
            j, tail = rest.split(".", 1)
            offset = getattr(stage.get_submodule(pre), "expert_offset", 0)
            name = f"{pre}.experts.{offset + int(j)}.{tail}"
        return stage.reference_name(name)

    def _tied_weight(self, module: nn.Module | None = None) -> nn.Parameter | None:
        """The tied embedding/output matrix of ``module`` (default: this rank's, which must hold one)."""
        for m in [module] if module is not None else self.modules:
            if m.embedding is not None:
                return m.embedding.wte.weight
            if m.head is not None:
                return m.head.lm_head.weight
        if module is None:
            raise RuntimeError("no tied weight on this rank")
        return None

    def _tied_grad(self) -> torch.Tensor:
        """The full gradient of this rank's tied copy: its ``.grad`` (DDP, ZeRO-1; ZeRO-2 keeps it
        in its deferred bucket until finish_grad_sync) or FSDP's held unit gradient (ZeRO-3)."""
        for tied, w in zip(self._tied_names, self.sharded):
            if isinstance(w, FullyShardedDataParallel) and tied:
                return w.unsharded_grad(tied[0])
        prm = self._tied_weight()
        if prm.grad is None:
            prm.grad = torch.zeros_like(prm)
        return prm.grad

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    # ---------------------------------------------------------------- inspection

    @torch.no_grad()
    def gather_full(self, what: str = "grad") -> dict:
        """``{reference name: full-shape tensor}`` of this rank's stages (TP shards all-gathered
        over the TP group: collective over it). Tied: both ``embedding.wte.weight`` and
        ``head.lm_head.weight`` appear where held (as in ``named_parameters(remove_duplicate=False)``)."""
        if self.sharded[0] is not None:
            out = {}
            for m, named in zip(self.modules, self.tp_local(what)):
                for name, (tensor, dim) in named.items():
                    if dim is not None:
                        tensor = all_gather_along_dim(tensor, dim, self.grid.tp_group)
                    out[self.reference_name(m, name)] = tensor.detach().cpu().clone()
            return out
        out = {}
        for m in self.modules:
            for name, prm in m.named_parameters(remove_duplicate=False):
                tensor = prm.grad if what == "grad" else prm.detach()
                if tensor is not None and getattr(prm, "tensor_model_parallel", False) and self.grid.tp > 1:
                    tensor = all_gather_along_dim(tensor, prm.partition_dim, self.grid.tp_group)
                out[self.reference_name(m, name)] = None if tensor is None else tensor.detach().cpu().clone()
        return out

    @torch.no_grad()
    def tp_local(self, what: str = "grad") -> list[dict]:
        """Per stage module ``{local name: (tensor, TP partition dim or None)}``: this TP rank's
        parameter (``what="param"``) or DP-mean gradient (``"grad"``; zeros where none) in the
        TP-sliced shape, whole over DP: under ZeRO-2/3 all-gathered from the DP shards (inspection
        only, a collective over the DP group, not part of the step)."""
        out = []
        for i, m in enumerate(self.modules):
            w, dims = self.sharded[i], self._tp_dims[i]
            if isinstance(w, FullyShardedDataParallel):
                full = w.full_tensors(what)
            elif isinstance(w, ZeroStage2) and what == "grad":
                by_id = w.full_grads()     # the experts are not sharded: their own .grad
                full = {n: by_id[id(q)] if id(q) in by_id else q.grad if q.grad is not None else torch.zeros_like(q)
                        for n, q in m.named_parameters(remove_duplicate=False)}
            else:
                full = {n: (q.detach() if what == "param" else q.grad if q.grad is not None else torch.zeros_like(q))
                        for n, q in m.named_parameters(remove_duplicate=False)}
            out.append({n: (full[n], dims[n]) for n in dims})
        return out

    def memory(self) -> dict:
        """Bytes held on this rank: ``params``, ``grads`` (``.grad`` tensors), ``optimizer``
        (per-element state: Adam's two moments, SGD momentum; 1/d of it under ZeRO-1)."""
        ps = self.parameters()
        opt = self.optimizer
        if opt is None:
            ob = 0
        elif isinstance(opt, (ZeroRedundancyOptimizer, _Zero2Step)):
            ob = opt.state_bytes()
        else:
            ob = optimizer_state_bytes(opt)
        out = {"params": sum(q.numel() * q.element_size() for q in ps),
               "grads": sum(q.grad.numel() * q.grad.element_size() for q in ps if q.grad is not None),
               "optimizer": ob}
        if self.zero == 2 and self.sharded[0] is not None:
            out["grads"] = sum(w.grad_bytes() for w in self.sharded)
        if self.zero == 3 and self.sharded[0] is not None:
            out["gathered"] = max(w.peak_gathered_bytes for w in self.sharded)
        return out

    def dp_overlap(self) -> float:
        """Share of DP all-reduce time hidden behind backward in the last step (mean over stages)."""
        vals = [w.last_overlap for w in self.ddp if w is not None]
        return sum(vals) / len(vals) if vals else float("nan")

    def axis_of(self, rec) -> str:
        """Which axis a :class:`labkit.comm.CommRecord` belongs to: tp, cp, pp, dp (over the d cp ranks
        with CP), embedding or other."""
        ranks = set(rec.ranks or ())
        g = self.grid
        tp_r, dp_r = set(g.ranks("tp")), set(self.dp_cp_ranks)
        if rec.kind == "all_reduce" and rec.shape == () and ranks == dp_r and len(dp_r) > 1:
            return "loss"    # the step's valid-target count and the reported loss (0-d, labkit.parallel.loss)
        if self.cp > 1 and ranks == set(g.ranks("cp")) and rec.kind != "all_reduce" and len(rec.shape) > 1:
            return "cp"      # attention's K/V traffic: [.., s, ..] blocks (DDP's all-reduce and ZeRO's flat 1-D
            #                  buffers are DP's, over the same ranks when d = 1)
        if self.cp > 1 and ranks == set(g.ranks("cp")) and rec.kind == "all_reduce":
            return "dp"      # MoE: the local experts' gradients summed over CP (their expert-DP group)
        if rec.kind in ("send", "recv"):
            return "pp"
        if rec.kind == "all_to_all" and self.moe and ranks == set(g.ranks("dp")) and g.dp > 1:
            return "ep"      # EP folded onto the DP ranks of this CP rank (the d cp ranks' group is DP's)
        if ranks == tp_r and g.tp > 1:
            return "tp"
        if ranks == dp_r and len(dp_r) > 1:
            return "ep" if rec.kind == "all_to_all" else "dp"     # EP folded onto the DP ranks
        if self.hsdp > 1 and ranks and ranks < dp_r:
            return "dp"                                           # HSDP's shard and replicate groups
        if self.emb_ranks and ranks == set(self.emb_ranks):
            return "embedding"
        return "other"

    def comm_by_axis(self, records) -> dict:
        """``{axis: {kind: (count, bytes)}}`` of CommLog records (this rank's; :func:`labkit.comm.count_by_axis`)."""
        return comm.count_by_axis(records, self.axis_of)

    def wire_by_axis(self, records) -> dict:
        """``{axis: bytes}`` this rank sends under the ring algorithms (:func:`labkit.comm.wire_bytes_by_axis`)."""
        return comm.wire_bytes_by_axis(records, self.axis_of)

    def expected_comm(self, batch: int, seq: int, bytes_per_element: int = 4) -> dict:
        """What the planner (:func:`labkit.plan.comm.comm_per_rank`, the one home of these
        formulas) predicts for one training step of this rank (after the first), in the shape of
        :meth:`comm_by_axis`: this layout as a :class:`labkit.plan.spec.Layout` (fp32, ``b =
        B/(d M)``; the order of the actions does not change the bytes, so every schedule with v = 1
        counts as 1F1B and every other as interleaved, in this schedule's placement), with this
        rank's DDP bucket count."""
        g = self.grid
        spec = planner_spec(self.cfg, seq, batch, self.moe_cfg, self.moe_layer_freq)
        lay = Layout(t=g.tp, p=g.pp, d=g.dp, v=self.v, b=batch // (g.dp * self.M), M=self.M,
                     ep=g.dp if self.moe else 1,
                     schedule="interleaved" if self.v > 1 else "1f1b",
                     zero=self.zero, precision="fp32", placement=self.placement,
                     sequence_parallel=self.sequence_parallel, recompute=self.recompute,
                     cp=self.cp, cp_attention=self.cp_attention, shard_experts=False)
        buckets = sum(len(w.buckets) for w in self.ddp if w is not None) or None
        actions = list(self.schedule.actions[self.schedule.rank])   # split backward: ZeRO-3 gathers along them
        axes = comm_per_rank(spec, lay, pp_rank=g.pp_rank, act_bytes=bytes_per_element, dp_buckets=buckets,
                             actions=actions)
        out = {ax: dict(c.ops) for ax, c in axes.items() if c.ops}
        if self.hsdp > 1:
            out["dp"] = hsdp_dp_comm(spec, lay, self.hsdp, g.pp_rank, bytes_per_element, actions)
        if self.zero == 2 and self.dp_cp > 1:   # one reduce-scatter and one all-gather per gradient bucket
            n = sum(len(w.buckets) for w in self.sharded)
            out["dp"] = {k: (n, nbytes) for k, (_, nbytes) in out["dp"].items()}
            if self.sequence_parallel:   # SP sums: one per bucket holding any (the planner: one per chunk)
                n_sp = sum(1 for w in self.sharded for b in w.buckets if any(w.is_partial(q) for q in b.params))
                c, nbytes = out["tp"]["all_reduce"]
                out["tp"]["all_reduce"] = (c - len(self.modules) + n_sp, nbytes)
        return out


class _Zero2Step:
    """The optimizer of ZeRO-2 stages: one ``optimizer_class`` per :class:`ZeroStage2` over its
    bucket shards; :meth:`step` steps each and all-gathers its parameters."""

    def __init__(self, wrappers, optimizer_class, **defaults):
        self.wrappers = wrappers
        for w in wrappers:
            w.optim = optimizer_class([b.shard for b in w.buckets], **defaults)
            w.expert_optim = optimizer_class(w.expert_params, **defaults) if w.expert_params else None

    @property
    def param_groups(self):
        return [g for w in self.wrappers for o in (w.optim, w.expert_optim) if o is not None for g in o.param_groups]

    def step(self) -> None:
        for w in self.wrappers:
            w.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for w in self.wrappers:
            w.zero_grad()

    def state_bytes(self) -> int:
        """Per-element optimizer state bytes on this rank (its 1/d shards)."""
        return sum(optimizer_state_bytes(o) for w in self.wrappers for o in (w.optim, w.expert_optim)
                   if o is not None)
