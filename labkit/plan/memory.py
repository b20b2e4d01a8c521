"""Bytes per GPU for a model and a layout: parameters, gradients, optimizer state, activations.

Model states (Rajbhandari et al. 2020, "ZeRO", sec. 3.1): with Adam and mixed precision
every parameter costs 2 bytes (bf16 weights) + 2 (bf16 gradients) + K = 12 (fp32 master
weights, first and second moments); in fp32 training 4 + 4 + 8. ZeRO stage 1 divides the
optimizer state by the DP degree d, stage 2 also the gradients, stage 3 also the parameters
(sec. 5; the flat buffers are padded to a multiple of d, as in labkit's ZeroRedundancyOptimizer).
ZeRO-3 as labkit's FullyShardedDataParallel does it (torch FSDP2): one flat buffer per unit (the
embedding, each layer, the head), each padded to a multiple of d; at the peak a rank also holds
the gathered parameters of two neighbouring units (the current one and the prefetched next), or
of every unit with ``reshard_after_forward=False`` (:func:`zero3_units`, ``RankMemory.gathered``).

Which parameters a rank holds (Megatron-LM): TP splits attention and MLP matrices and the
vocabulary by t (biases of row-parallel layers and the norms are replicated); PP gives rank
r the layers of its stages (L/p, in v chunks for interleaving), the input embedding to the
first rank and the final norm and output layer to the last (a tied embedding is kept on both
ends, Megatron-LM sec. 5 / Narayanan et al. 2021); expert parallelism (ep ranks, folded onto
DP) gives each rank E/ep experts, each split over ``etp`` of the TP ranks (Megatron-Core's
``expert_tensor_parallel_size``, ``Layout.etp``; default t; 1: whole experts on every TP rank).

Activations (Korthikanti et al. 2022, sec. 4): per layer and microbatch as in
:mod:`.activations`; the first pipeline rank holds the most microbatches: 1F1B min(p, M),
GPipe M, interleaved 1F1B ``p v + p - 1`` chunks of L/(p v) layers, i.e. the 1F1B's p
microbatches times ``1 + (p-1)/(p v)`` (sec. 4.2.3; ``(v-1) g + 2p - 1`` with rounds of g
microbatches when p does not divide M, torch's rule). Pipeline rank r of 1F1B holds p - r.
DualPipe (DeepSeek-V3): two stages per rank and p + 1 stage-microbatches in flight.
The embedding-dropout mask (``s b h``, with dropout > 0) is counted on the first stage.
Gradients: 2 bytes (bf16, labkit's convention) or 4 (``fp32_grads``, Megatron-LM's).

Context parallelism (cp > 1, :mod:`labkit.context_parallel`): every activation is split along
the sequence, so each rank keeps the activations of s/cp tokens; with a fused attention kernel
that is the whole count. Without one, the attention core keeps what labkit's CP algorithm keeps
(:func:`cp_core_activation_bytes`: ring no scores, all-gather the gathered K/V and s/cp x s
scores, Ulysses s x s scores of a/cp heads). The weights are replicated over
CP; ZeRO shards over the d cp ranks that reduce the gradients together (Megatron-Core's
data-parallel group with context parallelism).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .activations import (
    layer_activation_bytes,
    moe_layer_activation_bytes,
    moe_row_bytes,
    selective_bytes_before_core,
    torch_saved_bytes_per_element,
)
from .spec import PRECISIONS, SCHEDULES, Layout, ModelSpec

__all__ = ["rank_stages", "rank_layer_chunks", "holds_first", "holds_last", "RankMemory", "memory_per_rank",
           "most_loaded_rank",
           "check_layout", "in_flight_units",
           "BYTES", "rank_param_counts", "rank_chunks", "stage_in_flight", "interleaved_group", "bytes_per_param",
           "grad_convention", "zero3_units", "zero3_gathered_peak", "zero3_stage_units", "zero3_shared_unit",
           "zero3_split_gathered_peak", "zero3_split_gathers", "schedule_activation_peak", "moe_balanced_rows"]

# bytes per parameter element: (parameter, gradient, optimizer state) -- ZeRO sec. 3.1
BYTES = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}
CP_ATTENTIONS = ("allgather", "ring", "ulysses")


@dataclass
class RankMemory:
    """Bytes on one rank (pipeline rank ``pp_rank``): ``params``, ``grads``, ``optimizer``,
    ``activations``; ``total``; ``param_count`` (elements held before ZeRO-3's split);
    ``in_flight`` (microbatch-chunks whose activations are alive at the peak); ``layers``;
    ``gathered`` (ZeRO-3: the peak bytes of all-gathered unit parameters, in ``total``)."""

    pp_rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    param_count: int
    in_flight: int
    layers: int
    gathered: int = 0

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    def as_dict(self) -> dict:
        return {"pp_rank": self.pp_rank, "params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "total": self.total}


def bytes_per_param(lay: Layout) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per element: :data:`BYTES` of the
    precision, with 4-byte gradients when ``lay.fp32_grads`` (Megatron-LM's fp32 gradient
    accumulation: 18 bytes per parameter, ``6 + 12/d`` with the distributed optimizer, ZeRO-1)."""
    pb, gb, ob = BYTES[lay.precision]
    return pb, (4 if lay.fp32_grads else gb), ob


def grad_convention(lay: Layout) -> str:
    """Which convention a memory figure uses, in words (printed by the CLI and the notebook)."""
    pb, gb, ob = bytes_per_param(lay)
    if lay.precision == "fp32":
        return f"fp32 training: {pb}+{gb}+{ob} = {pb + gb + ob} bytes per parameter"
    who = "Megatron-LM's convention, fp32 gradients" if lay.fp32_grads else "labkit's convention, bf16 gradients"
    return f"{who}: {pb}+{gb}+{ob} = {pb + gb + ob} bytes per parameter ({pb + gb} + {ob}/d with ZeRO-1)"


def n_microbatches(spec: ModelSpec, lay: Layout) -> int:
    """M: the layout's, else ``global_batch / (b d)``."""
    return lay.M if lay.M is not None else spec.global_batch // (lay.b * lay.d)


def check_layout(spec: ModelSpec, lay: Layout) -> None:
    """Raise ValueError naming the values and the rule when ``lay`` cannot run ``spec``
    (Megatron-LM's constraints: t divides the heads, key/value heads and FFN width; p v divides
    L; b d divides the global batch; interleaving needs max(1, M // p) equal rounds (torch's
    ScheduleInterleaved1F1B); DualPipe an even p and M >= 2p; SP needs t | s ...)."""
    a, akv = spec.n_head, spec.kv_heads
    rules = [
        (min(lay.t, lay.p, lay.d, lay.v, lay.b, lay.ep, lay.cp) >= 1,
         f"t, p, d, v, b, ep, cp must be >= 1 (got {lay})"),
        (lay.cp_attention in CP_ATTENTIONS, f"cp_attention must be one of {CP_ATTENTIONS}, got {lay.cp_attention!r}"),
        (lay.schedule in SCHEDULES, f"schedule must be one of {SCHEDULES}, got {lay.schedule!r}"),
        (lay.precision in PRECISIONS, f"precision must be one of {PRECISIONS}, got {lay.precision!r}"),
        (lay.zero in (0, 1, 2, 3), f"ZeRO stage must be 0, 1, 2 or 3, got {lay.zero}"),
        (lay.recompute in ("none", "selective", "full"),
         f"recompute must be none, selective or full, got {lay.recompute!r}"),
        (not lay.fp32_grads or lay.precision == "bf16", "fp32_grads needs precision 'bf16' (fp32 has 4-byte grads)"),
        (lay.hsdp >= 1 and lay.d % lay.hsdp == 0 and (lay.hsdp == 1 or lay.zero == 3),
         f"HSDP replicas R={lay.hsdp} must divide d={lay.d}, with ZeRO-3"),
    ]
    for ok, msg in rules:
        if not ok:
            raise ValueError(msg)
    rules = [
        (a % lay.t == 0, f"n_head (attention heads)={a} must be divisible by t={lay.t} (each TP rank gets an "
                         f"equal share)"),
        (akv % lay.t == 0, f"n_kv_head (KV heads)={akv} must be divisible by t={lay.t} (each TP rank gets an "
                           f"equal share)"),
        (spec.ffn_hidden % lay.t == 0, f"the FFN width f={spec.ffn_hidden} must be divisible by t={lay.t} (each TP "
                                       f"rank gets an equal share)"),
        (spec.n_layer >= lay.p * lay.v, f"p*v={lay.p}*{lay.v} stages need at least as many layers (L={spec.n_layer})"),
        (lay.v == 1 or lay.schedule == "interleaved", f"v={lay.v} > 1 needs schedule 'interleaved'"),
        (lay.placement in ("loop", "v"), f"placement must be 'loop' or 'v', got {lay.placement!r}"),
        (lay.placement == "loop" or (lay.v == 2 and lay.schedule != "dualpipe"),
         f"placement 'v' holds two stages per rank: needs v = 2 (got v={lay.v}, schedule {lay.schedule!r})"),
        (lay.schedule != "interleaved" or lay.p > 1, "the interleaved schedule needs p > 1"),
        (lay.schedule != "dualpipe" or (lay.p >= 2 and lay.p % 2 == 0 and lay.v == 1),
         f"DualPipe needs an even p >= 2 and v = 1 (got p={lay.p}, v={lay.v})"),
        (not lay.sequence_parallel or spec.seq_len % lay.t == 0,
         f"sequence parallelism needs t={lay.t} to divide the sequence length s={spec.seq_len}"),
        (not spec.is_moe or spec.n_routed_experts % lay.ep == 0,
         f"n_routed_experts E={spec.n_routed_experts} must be divisible by the EP size {lay.ep} (EP folded onto DP)"),
        (lay.d % lay.ep == 0, f"the EP size ep={lay.ep} must divide d={lay.d} (EP folded onto DP)"),
        (lay.etp is None or (lay.etp >= 1 and lay.t % lay.etp == 0
                             and (spec.moe_ffn or spec.ffn_hidden) % lay.etp == 0),
         f"the expert TP size etp={lay.etp} must be >= 1 and divide t={lay.t} (each expert split over etp of the "
         f"TP ranks)"),
        (spec.is_moe or lay.ep == 1, f"ep={lay.ep} > 1 needs a MoE model"),
        (lay.cp == 1 or spec.seq_len % (2 * lay.cp) == 0,
         f"context parallelism needs 2 cp = {2 * lay.cp} to divide the sequence length s={spec.seq_len} "
         f"(two chunks per CP rank)"),
        (lay.cp == 1 or not lay.sequence_parallel or (spec.seq_len // lay.cp) % lay.t == 0,
         f"sequence parallelism with context parallelism needs t={lay.t} to divide each CP rank's "
         f"s/cp = {spec.seq_len}/{lay.cp} = {spec.seq_len // lay.cp} tokens"),
        (lay.cp_attention != "ulysses" or (a // lay.t) % lay.cp == 0 and (akv // lay.t) % lay.cp == 0,
         f"Ulysses needs cp={lay.cp} to divide the heads per TP rank a/t={a // lay.t} and a_kv/t={akv // lay.t}"),
    ]
    if lay.M is None:
        rules.append((spec.global_batch % (lay.b * lay.d) == 0,
                      f"b*d={lay.b}*{lay.d} must divide the global batch {spec.global_batch}"))
    M = n_microbatches(spec, lay)
    rules.append((M >= 1, f"M={M} microbatches: need >= 1"))
    if lay.schedule == "dualpipe":
        rules.append((M >= 2 * lay.p and M % 2 == 0, f"DualPipe needs M={M} even and >= 2p = {2 * lay.p} "
                                                     f"(half the microbatches enter from each end)"))
    if lay.schedule == "interleaved" and M >= 1:
        rounds = max(1, M // lay.p)
        rules.append((M % rounds == 0, f"the interleaved schedule runs rounds = max(1, M // p) = {rounds} rounds "
                                       f"of equal size (torch's ScheduleInterleaved1F1B), which must divide M={M}"))
    for ok, msg in rules:
        if not ok:
            raise ValueError(f"layout {lay.describe()} is not valid for {spec.name}: {msg}")


def interleaved_group(p: int, M: int) -> int:
    """Microbatches per round of interleaved 1F1B, ``M / max(1, M // p)`` (torch's
    ``ScheduleInterleaved1F1B``; p when p divides M, Megatron's groups of p), the rule of
    :func:`labkit.pipeline.schedules.interleaved_group`."""
    return M // max(1, M // p)


def _interleaved_warmup(p: int, M: int, v: int, r: int) -> int:
    """Warm-up forwards of pipeline rank r: ``(v-1) g + 2 (p-1-r)``, at most ``v M``
    (today's Megatron-Core and torch; also at M = p)."""
    return min((v - 1) * interleaved_group(p, M) + 2 * (p - 1 - r), v * M)


def in_flight_units(lay: Layout, M: int, pp_rank: int) -> int:
    """Microbatch-chunks alive at the peak on pipeline rank ``pp_rank`` (each chunk: L/(p v)
    layers of one microbatch). GPipe ``M`` (all forwards first); 1F1B ``min(p - r, M)``;
    interleaved ``min((v-1) g + 2 (p-1-r) + 1, M v)`` with g microbatches per round
    (:func:`interleaved_group`): the warm-up plus one. That is today's Megatron-Core and torch
    rule, also at M = p (rank p-1 then holds p + 1 chunks at v = 2; Megatron-LM v2 ran every
    forward first there and held 2p)."""
    p, v, r = lay.p, lay.v, pp_rank
    if lay.schedule == "gpipe":
        return M * v
    if lay.schedule == "1f1b":
        return min(p - r, M)
    if lay.schedule == "dualpipe":     # DeepSeek-V3 report, Table 2: PP + 1 stage-microbatches per device
        return p + 1
    return min(_interleaved_warmup(p, M, v, r) + 1, M * v)


def _interleaved_chunk_peak(p: int, M: int, v: int, r: int, chunk: int) -> int:
    """Most microbatches alive at once in model chunk ``chunk`` of pipeline rank r, counted
    along the rank's action order (the k-th forward runs chunk ``(k // g) % v``, the j-th
    backward chunk ``v - 1 - (j // g) % v``)."""
    g, w, total = interleaved_group(p, M), _interleaved_warmup(p, M, v, r), v * M
    fwd = [(k // g) % v for k in range(total)]
    bwd = [v - 1 - (j // g) % v for j in range(total)]
    order = fwd[:w] + [x for i in range(total - w) for x in (fwd[w + i], -1 - bwd[i])] + \
        [-1 - b for b in bwd[total - w:]]
    live = top = 0
    for c in order:
        live += (c == chunk) - (c == -1 - chunk)
        top = max(top, live)
    return top


def stage_in_flight(lay: Layout, M: int, which: str) -> int:
    """Microbatches alive at the peak on the FIRST stage (it holds the input embedding) or the
    LAST stage (the output layer and loss): GPipe M and M; 1F1B ``min(p, M)`` and 1;
    interleaved: counted along the schedule's order (chunk 0 of rank 0, chunk v-1 of rank p-1;
    ``min(2p, M)`` and 1 when p divides M and M > p)."""
    p = lay.p
    if lay.schedule == "gpipe":
        return M
    if lay.schedule == "dualpipe":    # an upper bound at the first stage; 1 at the last, as 1F1B
        return 1 if which == "last" else min(p + 1, M)
    if lay.schedule == "1f1b":
        return 1 if which == "last" else min(p, M)
    if which == "last":
        return _interleaved_chunk_peak(p, M, lay.v, p - 1, lay.v - 1)
    return _interleaved_chunk_peak(p, M, lay.v, 0, 0)


def rank_chunks(n_layer: int, p: int, v: int, pp_rank: int) -> list[range]:
    """Layer ids of each of the v chunks (stages ``pp_rank``, ``pp_rank + p``, ...) of a pipeline
    rank. L / (p v) layers per stage when it divides (labkit's ``stage_layers``); otherwise the
    first ``L mod (p v)`` stages get one layer more (Megatron's uneven split)."""
    S = p * v
    base, extra = divmod(n_layer, S)
    out = []
    for c in range(v):
        s = c * p + pp_rank
        start = s * base + min(s, extra)
        out.append(range(start, start + base + (1 if s < extra else 0)))
    return out


def rank_stages(lay: Layout, pp_rank: int) -> list[int]:
    """Stage ids (of p v) on pipeline rank r: ``r, r + p, ...`` (loop placement) or ``r, 2p-1-r``
    (V placement). DualPipe's two directions are :func:`rank_layer_chunks`' business."""
    if lay.placement == "v":
        return [pp_rank, 2 * lay.p - 1 - pp_rank]
    return [c * lay.p + pp_rank for c in range(lay.v)]


def rank_layer_chunks(spec: ModelSpec, lay: Layout, pp_rank: int) -> list[range]:
    """Layer ids of each model chunk a pipeline rank holds: :func:`rank_chunks` (v chunks,
    looped placement; V placement: stages r and 2p-1-r), or for DualPipe (DeepSeek-AI 2024,
    sec. 3.2.1) the two stages r and p-1-r of the two directions (L/p layers each: twice the
    parameters of 1F1B)."""
    if lay.placement == "v":
        first = rank_chunks(spec.n_layer, lay.p, 2, pp_rank)[0]
        return [first, rank_chunks(spec.n_layer, lay.p, 2, lay.p - 1 - pp_rank)[1]]
    if lay.schedule == "dualpipe":
        return rank_chunks(spec.n_layer, lay.p, 1, pp_rank) + rank_chunks(spec.n_layer, lay.p, 1, lay.p - 1 - pp_rank)
    return rank_chunks(spec.n_layer, lay.p, lay.v, pp_rank)


def holds_first(lay: Layout, pp_rank: int) -> bool:
    """Whether the rank holds the first stage (input embedding): rank 0, and rank p-1 in DualPipe."""
    return pp_rank == 0 or (lay.schedule == "dualpipe" and pp_rank == lay.p - 1)


def holds_last(lay: Layout, pp_rank: int) -> bool:
    """Whether the rank holds the last stage (output layer, loss): rank p-1 (rank 0 in V placement),
    and rank 0 in DualPipe."""
    if lay.placement == "v":
        return pp_rank == 0
    return pp_rank == lay.p - 1 or (lay.schedule == "dualpipe" and pp_rank == 0)


def rank_param_counts(spec: ModelSpec, lay: Layout, pp_rank: int) -> dict:
    """Elements of parameters on one rank of pipeline rank ``pp_rank`` (any TP/DP rank):
    ``{"dense": n, "expert": n, "layers": n}`` (experts separately: their DP group is d/ep)."""
    t, p = lay.t, lay.p
    layer_ids = [i for ch in rank_layer_chunks(spec, lay, pp_rank) for i in ch]
    dense = expert = 0
    for i in layer_ids:
        lp = spec.layer_params(spec.is_moe_layer(i))
        dense += lp["split"] // t + lp["replicated"]
        if lp["experts"] and lay.expert_tp < t:   # expert TP: etp of the t ranks split the matrices, not biases
            e_split, e_rep = spec.mlp_params(spec.moe_ffn or spec.ffn_hidden)
            expert += (e_split // lay.expert_tp + e_rep) * (lp["experts"] // lay.ep)
        else:
            expert += lp["expert"] * lp["experts"] // lay.ep // t
    vocab = math.ceil(spec.vocab_size / t)
    if holds_first(lay, pp_rank):
        emb_split, emb_rep = spec.embedding_params()
        dense += vocab * spec.hidden + emb_rep
    if holds_last(lay, pp_rank):
        head_split, head_rep = spec.head_params()
        out = vocab * spec.hidden if (head_split or (spec.tied_embeddings and p > 1)) else 0
        dense += out + head_rep
    return {"dense": dense, "expert": expert, "layers": len(layer_ids)}


def zero3_units(spec: ModelSpec, lay: Layout, pp_rank: int) -> list[int]:
    """Dense parameter elements of each FSDP unit on a rank of pipeline rank ``pp_rank``, in
    forward order: the embedding (first rank), each of its layers, the head (last rank: final
    norm and output layer). A tied embedding at p = 1 is one unit with the head (the one matrix
    and the final norm; listed first). Their sum is ``rank_param_counts(...)["dense"]``."""
    t = lay.t
    vocab = math.ceil(spec.vocab_size / t)
    units = []
    if holds_first(lay, pp_rank):
        units.append(vocab * spec.hidden + spec.embedding_params()[1])
    for i in (i for ch in rank_layer_chunks(spec, lay, pp_rank) for i in ch):
        lp = spec.layer_params(spec.is_moe_layer(i))
        units.append(lp["split"] // t + lp["replicated"])
    if holds_last(lay, pp_rank):
        head_split, head_rep = spec.head_params()
        out = vocab * spec.hidden if (head_split or (spec.tied_embeddings and lay.p > 1)) else 0
        if zero3_shared_unit(spec, lay):
            units[0] += head_rep
        else:
            units.append(out + head_rep)
    return units


def zero3_shared_unit(spec: ModelSpec, lay: Layout) -> bool:
    """Whether the embedding and the head are one FSDP unit: a tied embedding at p = 1 (the one
    matrix serves both; FSDP units that share a parameter are one unit)."""
    return spec.tied_embeddings and lay.p == 1


def zero3_stage_units(spec: ModelSpec, lay: Layout, pp_rank: int) -> list[list[int]]:
    """:func:`zero3_units` per stage of the rank (the order of :func:`rank_stages`; loop or V
    placement): each stage is its own FSDP wrapper."""
    units = zero3_units(spec, lay, pp_rank)
    chunks = rank_layer_chunks(spec, lay, pp_rank)
    first = 1 if holds_first(lay, pp_rank) else 0
    out, k = [], first
    for ch in chunks:
        out.append(units[k:k + len(ch)])
        k += len(ch)
    if first:
        out[0].insert(0, units[0])
    if k < len(units):                    # the head: with the last stage, the last chunk of the rank
        out[-1].append(units[k])
    return out


def zero3_gathered_peak(units: list[int], d: int, reshard_after_forward: bool = True,
                        shared_first_last: bool = False) -> int:
    """Peak elements of gathered ZeRO-3 parameters: the largest sum of two neighbouring units'
    padded sizes (unit i computing while unit i+1's all-gather is prefetched), or of all units
    when they are not resharded after forward (FSDP2, Zhao et al. 2023 sec. 3.3).
    ``shared_first_last``: ``units[0]`` serves the first and the last call of the forward (a tied
    embedding and head at p = 1): it stays gathered through the step's forward and backward, on top
    of the two neighbouring units between."""
    pads = [_zero_shard(n, d) * d for n in units]
    if not pads:
        return 0
    if not reshard_after_forward:
        return sum(pads)
    if shared_first_last:
        rest = pads[1:]
        return pads[0] + max([0] + rest[:1] + [a + b for a, b in zip(rest, rest[1:])])
    return max([pads[0]] + [a + b for a, b in zip(pads, pads[1:])])


def zero3_split_gathered_peak(spec: ModelSpec, lay: Layout, pp_rank: int) -> int:
    """Peak elements of gathered ZeRO-3 parameters of one stage under a schedule with split backward
    (ZB-H1, ZB-V, DualPipeV): each I and W first gathers every unit of its stage, so the peak is
    the largest stage's units all at once (padded; :class:`labkit.data_parallel.FullyShardedDataParallel`
    measures per stage wrapper)."""
    d = lay.d // lay.hsdp * lay.cp
    return max(sum(_zero_shard(n, d) * d for n in st) for st in zero3_stage_units(spec, lay, pp_rank))


def zero3_split_gathers(actions, stage: int, n_microbatches: int, reshard_after_forward: bool = True) -> int:
    """All-gathers per unit of ``stage`` in one step, counted along this rank's ``actions``
    (``kind`` F | B | I | W, ``stage``; other kinds skipped) with FSDP's rules: F gathers a
    resharded unit and reshards it after (``reshard_after_forward``), B gathers and reshards after;
    I and W (split backward) gather a resharded unit and keep it until the stage's last W of the
    step (the ``n_microbatches``-th). Every unit of the stage moves together at action granularity."""
    gathered, n = False, 0
    w = 0
    for a in actions:
        if a.stage != stage or a.kind not in ("F", "B", "I", "W"):
            continue
        n += 0 if gathered else 1
        if a.kind == "F":
            gathered = not reshard_after_forward
        elif a.kind == "B":
            gathered = False
        elif a.kind == "I":
            gathered = True
        else:
            w += 1
            gathered = w < n_microbatches
    return n


def _zero_shard(n: int, d: int) -> int:
    """Elements one rank keeps of a flat buffer of n split over d ranks (padded to a multiple of d)."""
    return -(-n // d)


def cp_local(spec: ModelSpec, lay: Layout) -> ModelSpec:
    """The spec with this CP rank's s/cp tokens per sequence (for the token-linear activation terms)."""
    if lay.cp == 1:
        return spec
    return dataclasses.replace(spec, seq_len=spec.seq_len // lay.cp, max_position=spec.max_position or spec.seq_len)


def cp_core_activation_bytes(spec: ModelSpec, lay: Layout) -> int:
    """Bytes labkit's context-parallel attention core (:mod:`labkit.context_parallel`, no fused
    kernel, dropout 0, causal) keeps for backward, one layer, one microbatch, one rank: what
    ``saved_tensors_hooks`` sees, counted from the code. Notation: local tokens s' = s/cp,
    N' = s' b, heads per TP rank a/t, e bytes per element, masks 1 byte (bool).

    * ``ring`` (hand-written backward, FlashAttention-2 style: Liu et al. 2023 sec. 3; Dao 2023
      Alg. 2): q, its own un-gathered k and v (a_kv heads, not repeated), the merged output and
      the log-sum-exp [b, a/t, s'], no scores: ``N' (2a + 2a_kv)(h/a) e / t + N' a e / t``.
    * ``allgather`` (Llama 3, Dubey et al. 2024 sec. 3.3.2; autograd through the local math): q,
      the gathered K and V of all s tokens (repeated to a heads for GQA, which the matmuls keep),
      the scores (logsumexp's input) and the probabilities, both [b, a/t, s', s], the
      log-sum-exp, the causal mask [s', s] and the log-sum-exp's -inf mask:
      ``N' h e/t + 2 cp N' h e/t + 2 a b s' s e/t + N' a e/t + s' s + N' a/t``.
    * ``ulysses`` (Jacobs et al. 2023 sec. 3): after the all-to-all the head-sharded q, k, v of
      all s tokens (a/(t cp) heads, k and v repeated), scores and probabilities
      [b, a/(t cp), s, s], the log-sum-exp, the causal mask [s, s] (whole, on every rank) and the
      -inf mask: ``3 N' h e/t + 2 a b s^2 e/(t cp) + N' a e/t + s^2 + N' a/t``.

    The output projection's input (``N' h e / t``) is the layer's, counted outside the core."""
    s, cp, t, b, e = spec.seq_len, lay.cp, lay.t, lay.b, BYTES[lay.precision][0]
    sl = s // cp
    N, h, a = sl * b, spec.hidden, spec.n_head
    lse = N * a * e // t
    if lay.cp_attention == "ring":
        return N * (2 * a + 2 * spec.kv_heads) * (h // a) * e // t + lse
    inf_mask = N * a // t
    if lay.cp_attention == "allgather":
        return N * h * e // t + 2 * cp * N * h * e // t + 2 * a * b * sl * s * e // t + lse + sl * s + inf_mask
    return 3 * N * h * e // t + 2 * (a // t // cp) * b * s * s * e + lse + s * s + inf_mask


def cp_core_recompute_bytes(spec: ModelSpec, lay: Layout) -> int:
    """Bytes the CP attention core saves anew when selective recompute re-runs it in backward (one
    layer, one microbatch, one rank; its checkpoint already holds q, k, v): ring's autograd
    function saves its inputs as they are, so only the merged output and the log-sum-exp are new
    (``N' h e/t + N' a e/t``); the all-gather and Ulysses cores save what they save in a forward
    without recompute (:func:`cp_core_activation_bytes`: their matmuls keep contiguous copies of
    the transposed q, the gathered or all-to-all'd K/V, and the s'/s x s scores and probabilities)."""
    if lay.cp_attention == "ring":
        sl = spec.seq_len // lay.cp
        N, e, t = sl * lay.b, BYTES[lay.precision][0], lay.t
        return N * spec.hidden * e // t + N * spec.n_head * e // t
    return cp_core_activation_bytes(spec, lay)


def _selective_cp_transient(spec: ModelSpec, lay: Layout, device: str) -> int:
    """Context parallelism with selective recompute: how far the live bytes rise above the stash
    while a layer's backward re-runs its CP core (labkit's checkpoint of the core), i.e. the core's
    new saves (:func:`cp_core_recompute_bytes`) less what the layer's backward freed before it
    reaches the core (:func:`.activations.selective_bytes_before_core`: the MLP, LN2 and
    output-projection part; autograd runs the later nodes first). May be negative (no new peak)."""
    lspec, one = cp_local(spec, lay), dataclasses.replace(lay, cp=1)
    e = BYTES[lay.precision][0]
    saved = torch_saved_bytes_per_element(e, device)
    held = selective_bytes_before_core(lspec.seq_len, lay.b, spec.hidden, spec.n_head, lay.t, lay.sequence_parallel,
                                       e, spec.kv_heads, saved["ln_stat"])
    return cp_core_recompute_bytes(spec, lay) - (_layer_act(lspec, one, False, device) - held)


def _layer_act(spec: ModelSpec, lay: Layout, moe: bool, device: str) -> int:
    """Activation bytes of one layer, one microbatch, on one rank (s/cp tokens with CP)."""
    if lay.cp > 1:
        n = _layer_act(cp_local(spec, lay), dataclasses.replace(lay, cp=1), moe, device)
        if moe and lay.recompute != "full" and spec.is_moe:   # the balance loss sees the b s tokens gathered over CP
            n += _moe_loss_act(spec.seq_len * lay.b, spec, lay) - _moe_loss_act(spec.seq_len * lay.b // lay.cp, spec,
                                                                                 lay)
        if lay.fused_attention or lay.recompute != "none":
            return n
        # labkit's unfused layer at s/cp tokens, its attention core replaced by what the CP core keeps
        sl, e, t = spec.seq_len // lay.cp, BYTES[lay.precision][0], lay.t
        reference_core = 3 * sl * lay.b * spec.hidden * e // t + sl * sl + spec.n_head * sl * sl * lay.b * e // t
        return n - reference_core + cp_core_activation_bytes(spec, lay)
    e = BYTES[lay.precision][0]
    saved = torch_saved_bytes_per_element(e, device)
    mult = 2 if spec.mlp == "swiglu" else 1           # SwiGLU keeps gate, up and their product
    # an MoE layer: its shared experts (over t) in the layer's count, the routed part in _moe_act
    width = spec.n_shared_experts * (spec.moe_ffn or spec.ffn_hidden) if moe else spec.ffn_hidden
    ffn = mult * width
    ffn += (-ffn) % lay.t                              # layer_activation_bytes divides by t
    n = layer_activation_bytes(spec.seq_len, lay.b, spec.hidden, spec.n_head, t=lay.t,
                               sequence_parallel=lay.sequence_parallel, recompute=lay.recompute,
                               bytes_per_element=e, ffn=ffn, kv_heads=spec.kv_heads,
                               dropout=spec.dropout > 0,
                               mask_bytes=saved["mask"], ln_stat_bytes=saved["ln_stat"],
                               fused_attention=lay.fused_attention)
    if moe and lay.recompute != "full":
        n += _moe_act(spec, lay)
    return n


def moe_balanced_rows(spec: ModelSpec, lay: Layout) -> int:
    """Rows one rank's experts receive per MoE layer and microbatch when the routing is balanced:
    ``s b k`` (every rank sends ``s b k`` slots, so this is the mean over the EP group); with
    sequence parallelism ``s b k / t`` (each TP rank routes its S/t tokens over its EP group), with
    context parallelism ``/ cp`` (each CP rank routes its S/cp tokens)."""
    return spec.seq_len * lay.b * spec.n_activated_experts // (lay.t if lay.sequence_parallel else 1) // lay.cp


def _moe_loss_act(tokens: int, spec: ModelSpec, lay: Layout) -> int:
    """The Switch aux loss's part of :func:`.activations.moe_layer_activation_bytes` over ``tokens``."""
    n = moe_layer_activation_bytes(0, spec.hidden, spec.n_routed_experts, spec.n_activated_experts,
                                   spec.moe_ffn or spec.ffn_hidden, BYTES[lay.precision][0], 0, loss_tokens=tokens)
    return n


def _moe_act(spec: ModelSpec, lay: Layout, received_rows: int | None = None) -> int:
    """The routed part of one MoE layer, one microbatch (:func:`.activations.moe_layer_activation_bytes`:
    the router on this rank's s b (/t with SP) tokens, the balance loss on the group's s b (with SP
    gathered over TP), the experts on ``received_rows``, default :func:`moe_balanced_rows`; each
    expert's width split over ``etp``)."""
    rows = moe_balanced_rows(spec, lay) if received_rows is None else received_rows
    return moe_layer_activation_bytes(spec.seq_len * lay.b // (lay.t if lay.sequence_parallel else 1), spec.hidden,
                                      spec.n_routed_experts, spec.n_activated_experts,
                                      spec.moe_ffn or spec.ffn_hidden, BYTES[lay.precision][0], rows,
                                      glu=spec.mlp == "swiglu", expert_tp=lay.expert_tp,
                                      loss_tokens=spec.seq_len * lay.b)


def _embedding_act(spec: ModelSpec, lay: Layout, device: str = "cuda") -> int:
    """Input embedding, one microbatch: token ids (int64), positions, the vocab-parallel mask
    and, with dropout > 0, the embedding-dropout mask ``s b h`` elements of the mask size
    (split by t under sequence parallelism, where the embedding output is scattered first)."""
    sb = spec.seq_len * lay.b
    ts = lay.t if lay.sequence_parallel else 1         # SP: this rank's S/t positions
    n = sb * 8 + (spec.seq_len * 8 // ts if spec.position == "learned" else 0) + (sb if lay.t > 1 else 0)
    if spec.dropout > 0:
        mask = torch_saved_bytes_per_element(BYTES[lay.precision][0], device)["mask"]
        n += sb * spec.hidden * mask // (lay.t if lay.sequence_parallel else 1)
    return n


def _head_act(spec: ModelSpec, lay: Layout, device: str) -> int:
    """Final norm, output layer and cross-entropy, one microbatch (logits' softmax in fp32)."""
    e = BYTES[lay.precision][0]
    st = torch_saved_bytes_per_element(e, device)["ln_stat"]
    sb = spec.seq_len * lay.b
    ts = lay.t if lay.sequence_parallel else 1
    vocab = math.ceil(spec.vocab_size / lay.t)
    norm_and_linear = 2 * sb * spec.hidden * e // ts + 2 * sb * st // ts
    if lay.t == 1:   # F.cross_entropy: log-softmax output and the int64 targets
        return norm_and_linear + sb * spec.vocab_size * e + 8 * sb
    # vocab_parallel_cross_entropy: fp32 softmax of the local vocabulary, int64 local targets, 2 masks
    return norm_and_linear + sb * vocab * 4 + 10 * sb


def memory_per_rank(spec: ModelSpec, lay: Layout, device: str = "cuda") -> list[RankMemory]:
    """:class:`RankMemory` of every pipeline rank (index = pp_rank; TP and DP ranks of one
    pipeline rank hold the same bytes). ``device``: "cuda" or "cpu" (what torch keeps for
    dropout masks and LayerNorm statistics, see :mod:`.activations`).
    Raises ValueError (from :func:`check_layout`) for an impossible layout."""
    check_layout(spec, lay)
    M = n_microbatches(spec, lay)
    pb, gb, ob = bytes_per_param(lay)
    z, d = lay.zero, lay.d // lay.hsdp * lay.cp    # ZeRO shards over the d cp ranks (HSDP: d/R) that reduce
    d_exp = max(1, lay.d // lay.ep) * lay.cp
    aspec = cp_local(spec, lay)
    out = []
    for r in range(lay.p):
        cnt = rank_param_counts(spec, lay, r)
        dense, expert = cnt["dense"], cnt["expert"]
        # dense parameters: one flat buffer padded to d (ZeRO-1/2), one per unit under ZeRO-3
        units3 = zero3_units(spec, lay, r) if z == 3 else [dense]
        dense_shard = sum(_zero_shard(n, d) for n in units3)
        ds = lambda stage: dense_shard if z >= stage else dense                        # noqa: E731, B023
        es = lambda stage: _zero_shard(expert, d_exp) if z >= stage and lay.shard_experts else expert  # noqa: E731, B023
        params, grads, opt = pb * (ds(3) + es(3)), gb * (ds(2) + es(2)), ob * (ds(1) + es(1))
        # ZeRO-3's gathered units (two neighbours at a time, the next one prefetched)
        gathered = pb * zero3_gathered_peak(units3, d, lay.reshard_after_forward, zero3_shared_unit(spec, lay)) \
            if z == 3 and d > 1 else 0
        units = in_flight_units(lay, M, r)
        # the rank's layers may differ (dense / MoE, uneven chunks): average over its chunks
        chunks = rank_layer_chunks(spec, lay, r)
        ids = [i for ch in chunks for i in ch]
        moe = [spec.is_moe_layer(i) for i in ids]
        chunk_act = sum(_layer_act(spec, lay, m, device) for m in moe) / len(chunks)
        act = units * chunk_act
        if lay.recompute == "full":
            # the layer being recomputed in backward holds its whole stash again (its input is already
            # counted); on the last stage that microbatch's head stash is freed by then
            none = Layout(**{**lay.__dict__, "recompute": "none"})
            rec = max(_layer_act(spec, none, m, device) - _layer_act(spec, lay, m, device) for m in moe)
            act += max(rec - _head_act(spec, lay, device), 0) if holds_last(lay, r) else rec
        elif lay.recompute == "selective" and lay.cp > 1 and not lay.fused_attention:
            # the first backward after the peak re-runs a layer's CP core (on the last stage that
            # microbatch's head stash is freed by then)
            rec = _selective_cp_transient(spec, lay, device)
            act += max(rec - _head_act(aspec, lay, device), 0) if holds_last(lay, r) else max(rec, 0)
        if holds_first(lay, r):
            act += stage_in_flight(lay, M, "first") * _embedding_act(aspec, lay, device)
        if holds_last(lay, r):
            act += stage_in_flight(lay, M, "last") * _head_act(aspec, lay, device)
        out.append(RankMemory(r, params, grads, opt, int(act), dense + expert, units, cnt["layers"], gathered))
    return out


def most_loaded_rank(spec: ModelSpec, lay: Layout, device: str = "cuda") -> RankMemory:
    """The pipeline rank with the largest total (usually the first: most microbatches in flight)."""
    return max(memory_per_rank(spec, lay, device), key=lambda m: m.total)


def schedule_activation_peak(spec: ModelSpec, lay: Layout, actions: list, pp_rank: int, device: str = "cuda",
                             moe_rows: dict | None = None) -> int:
    """Peak activation bytes of pipeline rank ``pp_rank`` counted along its ``actions`` (objects
    with ``kind`` "F" | "B" | "I" | "W", ``stage``, ``microbatch``; other kinds are skipped), for
    the schedules whose backward is split (Qi et al. 2024, sec. 2-3: ZB-H1, ZB-V, DualPipeV).

    F adds the stage's stash of one microbatch (its layers, the embedding on stage 0, the head
    on the last stage); B frees it. I keeps the autograd graph for W (labkit's
    :mod:`labkit.pipeline.split_backward`), so a microbatch between its I and its W still holds
    the stash of its layers and its output layer's input; only the cross-entropy's part (the
    softmax and the targets, not on the way to a parameter) goes at I; W frees the rest. The
    peak is taken after each F. V placement (``lay.placement == "v"``, ZB-V and DualPipeV, sec. 4):
    rank r holds stages r and 2p-1-r (:func:`rank_stages`), so rank 0 stashes the embedding with
    stage 0 and the output layer and loss with stage 2p-1, and a microbatch's two stages on one
    rank are two entries. Schedules without split backward (F and B only) give the in-flight
    formulas' figure. ``moe_rows``: ``{(stage, microbatch): rows}``, the rows the rank's experts
    received in that forward, summed over the stage's MoE layers (the routing a run had; absent
    keys and None: balanced, :func:`moe_balanced_rows` per layer; a value may also be a list, one
    entry per MoE layer of the stage in order); each row costs :func:`.activations.moe_row_bytes`.
    Context parallelism with selective recompute: the CP core re-run inside a backward adds its
    saves on top of the live bytes (I keeps the whole graph: :func:`cp_core_recompute_bytes`; a
    whole backward, B or stage 0's W, has freed the layer's later part and the head by then:
    :func:`_selective_cp_transient`).

    ``recompute="full"`` (schedules without split backward only: ValueError for I or W): F keeps
    each layer's input (and the embedding's and head's stash); B frees the head's stash, then
    recomputes the layers last to first, the peak taken while layer j's whole stash is alive again
    (its routed part from its own rows: give per-layer lists when a stage has several MoE
    layers, an int is split evenly over them) with the inputs of the layers before it, and frees
    layer j's input after it."""
    if lay.recompute == "full":
        return _full_recompute_peak(spec, lay, actions, pp_rank, device, moe_rows)
    aspec = cp_local(spec, lay)
    last = (2 if lay.placement == "v" else lay.v) * lay.p - 1
    rec_i = rec_b = 0
    if lay.recompute == "selective" and lay.cp > 1 and not lay.fused_attention:
        rec_i = cp_core_recompute_bytes(spec, lay)         # I keeps the graph: the core's saves come on top
        rec_b = _selective_cp_transient(spec, lay, device)  # a whole backward has freed the layer's later part
    full, at_i, n_moe, heads = {}, {}, {}, {}
    for stage, layers in zip(rank_stages(lay, pp_rank), rank_layer_chunks(spec, lay, pp_rank)):
        n = sum(_layer_act(spec, lay, spec.is_moe_layer(i), device) for i in layers)
        n_moe[stage] = sum(spec.is_moe_layer(i) for i in layers)
        n += _embedding_act(aspec, lay, device) if stage == 0 else 0
        head = _head_act(aspec, lay, device) if stage == last else 0
        keep = 0
        if head:   # the final norm and the output layer's input stay for W; the cross-entropy's part goes
            e = BYTES[lay.precision][0]
            sb, ts = aspec.seq_len * lay.b, (lay.t if lay.sequence_parallel else 1)
            keep = 2 * sb * spec.hidden * e // ts + 2 * sb * torch_saved_bytes_per_element(e, device)["ln_stat"] // ts
        full[stage], at_i[stage], heads[stage] = n + head, head - keep, head
    per_row = moe_row_bytes(spec.hidden, spec.moe_ffn or spec.ffn_hidden, BYTES[lay.precision][0],
                            spec.mlp == "swiglu", lay.expert_tp) if spec.is_moe else 0
    alive = {}
    live = peak = 0
    for act in actions:
        key = (act.stage, act.microbatch)
        if act.kind == "F":
            alive[key] = full[act.stage]
            if moe_rows and key in moe_rows:    # the routing this forward had instead of the balanced one
                rows = moe_rows[key] if isinstance(moe_rows[key], int) else sum(moe_rows[key])
                alive[key] += per_row * (rows - n_moe[act.stage] * moe_balanced_rows(spec, lay))
            live += alive[key]
            peak = max(peak, live)
        elif act.kind == "I" and key in alive:
            if act.stage != 0:                 # stage 0 has no input gradient: its W is the whole backward
                peak = max(peak, live + rec_i)
            freed = at_i[act.stage]
            alive[key] -= freed
            live -= freed
        elif act.kind in ("B", "W") and key in alive:
            if act.kind == "B" or act.stage == 0:   # a whole backward: the head's stash goes first
                peak = max(peak, live + max(rec_b - heads[act.stage], 0))
            live -= alive.pop(key)
    return int(peak)


def _full_recompute_peak(spec: ModelSpec, lay: Layout, actions: list, pp_rank: int, device: str,
                         moe_rows: dict | None) -> int:
    """:func:`schedule_activation_peak` with ``recompute="full"`` (see there)."""
    if any(act.kind in ("I", "W") for act in actions):
        raise ValueError("schedule_activation_peak: recompute='full' is modelled for schedules without split "
                         "backward (F and B) only")
    aspec = cp_local(spec, lay)
    none = dataclasses.replace(lay, recompute="none")
    last = (2 if lay.placement == "v" else lay.v) * lay.p - 1
    per_row = moe_row_bytes(spec.hidden, spec.moe_ffn or spec.ffn_hidden, BYTES[lay.precision][0],
                            spec.mlp == "swiglu", lay.expert_tp) if spec.is_moe else 0
    layers_of = dict(zip(rank_stages(lay, pp_rank), rank_layer_chunks(spec, lay, pp_rank)))
    alive, live, peak = {}, 0, 0
    for act in actions:
        if act.kind not in ("F", "B") or act.stage not in layers_of:
            continue
        key, layers = (act.stage, act.microbatch), list(layers_of[act.stage])
        inputs = [_layer_act(spec, lay, spec.is_moe_layer(i), device) for i in layers]
        emb = _embedding_act(aspec, lay, device) if act.stage == 0 else 0
        head = _head_act(aspec, lay, device) if act.stage == last else 0
        if act.kind == "F":
            alive[key] = sum(inputs) + emb + head
            live += alive[key]
            peak = max(peak, live)
            continue
        if key not in alive:
            continue
        moe_ids = [i for i in layers if spec.is_moe_layer(i)]
        rows = moe_rows.get(key) if moe_rows else None
        if isinstance(rows, int):
            rows = [rows // len(moe_ids)] * len(moe_ids) if moe_ids else []
        live -= head                                           # the head's backward runs first
        for j in reversed(range(len(layers))):
            i = layers[j]
            stash = _layer_act(spec, none, spec.is_moe_layer(i), device)
            if rows is not None and i in moe_ids:              # this forward's routing, not the balanced one
                stash += per_row * (rows[moe_ids.index(i)] - moe_balanced_rows(spec, lay))
            peak = max(peak, live - inputs[j] + stash)       # the recomputed layer: its input is in its stash
            live -= inputs[j]
        live -= emb
        alive.pop(key)
    return int(peak)
