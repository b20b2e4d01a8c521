"""Communication per training step, per rank and per axis, and the link each axis uses.

Counted the way :class:`labkit.comm.CommLog` counts (``payload``: the bytes of this rank's
tensor argument; all-gather: the local shard, reduce-scatter: the full input) and as bytes
sent on the wire by the ring algorithms (``wire``: :func:`ring_bytes`).

Per microbatch (N = s b tokens, h hidden, e bytes per activation element):

* TP (Megatron-LM sec. 3): each layer all-reduces ``N h`` twice forward (g after attention
  and MLP) and twice backward (f); the input embedding once forward, the output layer once
  backward, the vocab-parallel cross-entropy 3 times ``N`` fp32 values. With sequence
  parallelism (Korthikanti et al. 2022 sec. 4.2.2) each all-reduce becomes a reduce-scatter +
  an all-gather (same wire bytes) and backward re-gathers the column-parallel inputs (the two
  of each layer and the output layer's); once per step the gradients of the parameters that saw
  S/t tokens (LayerNorms, row-parallel biases, the final norm, learned positions) are
  all-reduced (one coalesced all-reduce; under ZeRO-2/3 with d > 1 one per gradient bucket,
  labkit's default one per model chunk, or per FSDP unit that holds any, from the reduce-scatter
  hooks: the same bytes). Full recompute repeats the forward's collectives in backward. A MoE layer with
  expert TP 1 (``Layout.etp``, Megatron-Core's ``expert_tensor_parallel_size``) and no shared
  experts holds whole experts on every TP rank: its MLP output is already complete, so only its
  attention all-reduces (once forward, once backward). With SP (labkit's
  :class:`labkit.parallel.moe_pipeline.ParallelMoEBlock`) such a layer routes this rank's S/t
  tokens: only its attention gathers and reduce-scatters, its balance loss all-gathers the router
  logits ``N E / t`` and the top-k indices ``8 N k / t`` of this rank (forward; again with full
  recompute) and reduce-scatters the logits' gradient ``N E`` (backward), and its router and local
  experts join the sequence-parallel gradient all-reduce (under ZeRO-2/3 the whole experts in
  one more all-reduce, outside the buckets or units).
* PP: each stage boundary sends ``N h`` forward and the gradient back (with SP each TP rank
  sends its ``N h / t`` shard, as Megatron does); a tied embedding adds one all-reduce of
  its gradient between the first and the last stage per step (axis "embedding").
* DP (Rajbhandari et al. 2020 sec. 7): ZeRO-0 all-reduces the gradients once per step
  (``2 (d-1)/d`` Psi on the wire), ZeRO-1/2 reduce-scatter the gradients and all-gather the
  updated parameters (the same wire bytes); ZeRO-3 (labkit's FSDP: one padded buffer per unit)
  all-gathers each unit's parameters before every microbatch's forward and again before its
  backward (``reshard_after_forward``; 3 (d-1)/d Psi, 1.5x) and reduce-scatters each unit's
  gradient once per step, with no all-gather after the step. Expert gradients go over the
  d/ep ranks that share an expert.
* CP (:mod:`labkit.context_parallel`; the sequence split over cp ranks, each layer's K/V
  exchanged, per microbatch and layer, kv = b (s/cp) (a_kv/t) d e bytes of K or of V): "allgather"
  (Llama 3) 2 all-gathers of kv forward and 2 reduce-scatters of cp kv backward; "ring" cp - 1
  sends of K and V forward, backward cp - 1 sends of K and V and cp of their gradients; "ulysses"
  4 all-to-alls (q, k, v, output) forward and 4 backward of b (s/cp) d e (2a + 2a_kv)/t bytes in
  all. Recompute repeats the forward's (full; selective too, which checkpoints the CP core). The
  parameter gradients are reduced over the d cp ranks (the DP axis's group becomes d cp,
  Megatron-Core's data-parallel group with CP; the local experts' over the d/ep cp ranks that hold
  them: ZeRO shards them there too, or with ``Layout.shard_experts`` False one all-reduce). A MoE
  layer's balance losses (labkit's :class:`labkit.parallel.moe_pipeline.ParallelMoEBlock`)
  all-gather over CP the router logits ``N E e`` and the top-k indices ``8 N k`` of this CP rank's
  N tokens (after the TP gather with SP; again with full recompute) and reduce-scatter the
  logits' gradient ``cp N E e``.
* EP: each MoE layer sends its k routed copies of the tokens to the experts' ranks and back
  (2 all-to-alls forward, 2 backward).
* loss (:mod:`labkit.parallel.loss`): the ranks of the last stage count the step's valid targets
  before the first backward, one all-reduce of a 0-d int64 (8 bytes) over the d cp ranks, and
  report the step's loss after it, one all-reduce of a 0-d float64 (8 bytes): the loss is the mean
  over every valid target of the step on every layout, equal to one device's.

Links: ranks are ordered TP innermost, then CP, then DP, then PP (Megatron-Core): a group of size n and
stride k stays inside a node of g GPUs when ``n k <= g``. Put the chatty axis (TP) on the
fast wire.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..wire import ring_bytes
from .memory import (
    _zero_shard,
    bytes_per_param,
    check_layout,
    holds_first,
    holds_last,
    n_microbatches,
    rank_layer_chunks,
    rank_param_counts,
    rank_stages,
    zero3_split_gathers,
    zero3_stage_units,
    zero3_units,
)
from .spec import Cluster, Layout, ModelSpec

__all__ = ["AxisComm", "comm_per_rank", "tp_comm", "axis_links", "ring_bytes"]



@dataclass
class AxisComm:
    """One axis on one rank: ``ops`` {kind: (count, payload bytes)}, ``wire`` bytes sent,
    ``group`` size, ``link`` ("intra-node" | "inter-node" | "-")."""

    axis: str
    group: int
    link: str
    ops: dict = field(default_factory=dict)
    wire: int = 0

    def add(self, kind: str, count: int, payload_each: int) -> None:
        """``count`` operations of ``kind`` whose payload is ``payload_each`` bytes each."""
        if count <= 0 or (self.group <= 1 and kind not in ("send", "recv")):
            return
        c, b = self.ops.get(kind, (0, 0))
        self.ops[kind] = (c + count, b + count * payload_each)
        self.wire += count * ring_bytes(kind, payload_each, self.group)

    @property
    def payload(self) -> int:
        return sum(b for _, b in self.ops.values())


def axis_links(lay: Layout, cluster: Cluster) -> dict:
    """``{"tp", "cp", "dp", "pp", "ep"}`` -> link for Megatron-Core's rank order (TP, CP, DP, PP)."""
    g = cluster.gpus_per_node

    def link(n, stride):
        if n <= 1:
            return "-"
        return "intra-node" if n * stride <= g else "inter-node"
    tc = lay.t * lay.cp
    return {"tp": link(lay.t, 1), "cp": link(lay.cp, lay.t), "dp": link(lay.d * lay.cp, lay.t),
            "pp": link(lay.p, tc * lay.d), "ep": link(lay.ep, tc)}


def tp_comm(spec: ModelSpec, lay: Layout, cluster: Cluster | None = None, pp_rank: int = 0,
            act_bytes: int | None = None, regather_in_backward: bool = True) -> dict:
    """The tensor-parallel collectives of one training step on a rank of pipeline rank
    ``pp_rank``, as ``{"forward": AxisComm, "backward": AxisComm}`` (the module docstring's TP
    rules; full recompute's second forward runs in backward, the sequence-parallel gradient
    all-reduce after it). :func:`comm_per_rank`'s ``"tp"`` is their sum."""
    check_layout(spec, lay)
    cluster = cluster or Cluster()
    link = axis_links(lay, cluster)["tp"]
    pb, gb, _ = bytes_per_param(lay)
    e = act_bytes or pb
    M = n_microbatches(spec, lay)
    Ml = M // 2 if lay.schedule == "dualpipe" else M   # passes through each layer (DualPipe: half each way)
    t, r, h = lay.t, pp_rank, spec.hidden
    N = spec.seq_len * lay.b // lay.cp                         # tokens of this CP rank
    act = N * h * e
    L_r = rank_param_counts(spec, lay, r)["layers"]
    fwd, bwd = AxisComm("tp", t, link), AxisComm("tp", t, link)
    again = 1 if lay.recompute == "full" else 0                 # full recompute reruns the forward in backward
    # a MoE layer with whole experts on every TP rank (expert TP 1, no shared experts) has no tensor-parallel
    # MLP region: no collective around it (without SP its output is replicated; with SP it routes its S/t tokens)
    ids = [i for ch in rank_layer_chunks(spec, lay, r) for i in ch]
    whole = lay.expert_tp == 1 and t > 1 and not spec.n_shared_experts
    n_whole = sum(1 for i in ids if spec.is_moe_layer(i)) if whole else 0
    regions = 2 * L_r - n_whole
    if lay.sequence_parallel:
        fwd.add("all_gather", Ml * regions, act // t)            # entering the column-parallel regions
        fwd.add("reduce_scatter", Ml * regions, act)             # leaving the row-parallel regions (g-bar)
        bwd.add("all_gather", Ml * regions * (again + (1 if regather_in_backward else 0)), act // t)
        bwd.add("reduce_scatter", Ml * regions * again, act)
        bwd.add("reduce_scatter", Ml * regions, act)             # backward of g
        bwd.add("all_gather", Ml * regions, act // t)            # backward of g-bar
        if n_whole:   # the balance losses on the whole group: router logits and indices all-gathered, dlogits back
            n_logits = N * spec.n_routed_experts                 # logits of the b S tokens
            fwd.add("all_gather", Ml * n_whole, n_logits // t * e)
            fwd.add("all_gather", Ml * n_whole, N // t * spec.n_activated_experts * 8)
            bwd.add("all_gather", Ml * n_whole * again, n_logits // t * e)
            bwd.add("all_gather", Ml * n_whole * again, N // t * spec.n_activated_experts * 8)
            bwd.add("reduce_scatter", Ml * n_whole, n_logits * e)
        n_ln = L_r * (spec.norm_params() * 2 + (2 * h if spec.bias else 0))
        n_ln += spec.norm_params() if holds_last(lay, r) else 0            # the final norm
        if holds_first(lay, r) and spec.position == "learned":             # positions added per S/t block
            n_ln += spec.seq_len * h
        if n_whole:   # router and local experts saw S/t tokens; no row-parallel MLP bias
            lp = spec.layer_params(True)
            n_ln += n_whole * (spec.n_routed_experts * (h + (1 if spec.router_bias else 0))
                               + lp["expert"] * lp["experts"] // lay.ep - (h if spec.bias else 0))
        n_ar = 1 if n_ln else 0                                 # sequence-parallel gradients
        sharded = lay.zero in (2, 3) and lay.d * lay.cp > 1
        if n_ln and lay.zero == 2 and lay.d * lay.cp > 1:       # ZeroStage2: per bucket (one per chunk)
            n_ar = len(rank_stages(lay, r))
        elif n_ln and lay.zero == 3 and lay.d * lay.cp > 1:     # FSDP: per unit holding any
            n_ar = L_r + (1 if holds_last(lay, r) and spec.norm_params() else 0) + \
                (1 if holds_first(lay, r) and spec.position == "learned" else 0)
        n_ar += 1 if n_whole and sharded else 0                 # ZeRO-2/3: the whole local experts, once more
        bwd.add("all_reduce", 1 if n_ln else 0, n_ln * gb)     # the bytes of one; then the count
        if n_ar > 1:
            c, nbytes = bwd.ops["all_reduce"]
            bwd.ops["all_reduce"] = (c + n_ar - 1, nbytes)
    else:
        # g after attention and MLP, f of each in backward
        fwd.add("all_reduce", Ml * regions, act)
        bwd.add("all_reduce", Ml * regions * (1 + again), act)
    if holds_first(lay, r):                                      # vocab-parallel embedding: g
        fwd.add("reduce_scatter" if lay.sequence_parallel else "all_reduce", Ml, act)
        if lay.sequence_parallel:                                # its backward: an all-gather
            bwd.add("all_gather", Ml, act // t)
    if holds_last(lay, r):                                       # output layer f, cross-entropy
        if lay.sequence_parallel:                                # gather (+ re-gather in backward), dX
            fwd.add("all_gather", Ml, act // t)
            bwd.add("all_gather", Ml if regather_in_backward else 0, act // t)
            bwd.add("reduce_scatter", Ml, act)
        else:
            bwd.add("all_reduce", Ml, act)
        fwd.add("all_reduce", 3 * Ml, N * 4)
    return {"forward": fwd, "backward": bwd}


def comm_per_rank(spec: ModelSpec, lay: Layout, cluster: Cluster | None = None, pp_rank: int = 0,
                  act_bytes: int | None = None, regather_in_backward: bool = True,
                  dp_buckets: int | None = None, actions=None) -> dict:
    """Communication of one training step on a rank of pipeline rank ``pp_rank``:
    ``{"tp", "cp", "pp", "dp", "ep", "embedding", "loss"}`` -> :class:`AxisComm` ("embedding": the
    all-reduce of a tied embedding's gradient between the first and the last pipeline rank; "loss":
    on the last stage's ranks the valid-target count before backward and the reported loss, two
    all-reduces of 8 bytes over the d cp ranks).

    ``act_bytes``: bytes per activation element (default: the layout's precision, 2 for bf16,
    4 for fp32). ``dp_buckets``: how many all-reduces this rank's ZeRO-0 gradient reduction
    issues per step (DDP's buckets, over all its model chunks; None: one per chunk, a fused
    reduction); the payload is the same. ``actions``: this pipeline rank's actions (objects with
    ``kind`` and ``stage``); for a schedule with split backward (I and W: ZB-H1, ZB-V, DualPipeV)
    ZeRO-3's all-gathers per unit are counted along them (:func:`.memory.zero3_split_gathers`; the
    order decides how often a unit is resharded). Raises ValueError for an impossible layout.
    """
    check_layout(spec, lay)
    cluster = cluster or Cluster()
    links = axis_links(lay, cluster)
    pb, gb, _ = bytes_per_param(lay)
    e = act_bytes or pb
    M = n_microbatches(spec, lay)
    Ml = M // 2 if lay.schedule == "dualpipe" else M   # passes through each layer (DualPipe: half each way)
    t, p, v, r = lay.t, lay.p, lay.v, pp_rank
    N, h = spec.seq_len * lay.b // lay.cp, spec.hidden       # tokens of this CP rank
    act = N * h * e
    out = {k: AxisComm(k, n, links[k]) for k, n in (("tp", t), ("cp", lay.cp), ("pp", p), ("dp", lay.d * lay.cp),
                                                      ("ep", lay.ep))}
    out["embedding"] = AxisComm("embedding", 2 if p > 1 else 1, links["pp"])
    out["loss"] = AxisComm("loss", lay.d * lay.cp, links["dp"])
    if holds_last(lay, pp_rank):     # N counted before backward, the step's loss reported after it
        out["loss"].add("all_reduce", 2, 8)
    cnt = rank_param_counts(spec, lay, r)
    L_r = cnt["layers"]
    ids = [i for ch in rank_layer_chunks(spec, lay, r) for i in ch]
    n_moe = sum(1 for i in ids if spec.is_moe_layer(i))

    # ---- TP: forward and backward collectives (tp_comm), summed
    tp = out["tp"]
    for part in tp_comm(spec, lay, cluster, r, act_bytes, regather_in_backward).values():
        for k, (c, nbytes) in part.ops.items():
            c0, b0 = tp.ops.get(k, (0, 0))
            tp.ops[k] = (c0 + c, b0 + nbytes)
        tp.wire += part.wire

    # ---- CP: each layer's K/V, per microbatch
    cp = out["cp"]
    if lay.cp > 1:
        d_h = spec.head_dim
        kv = N * (spec.kv_heads // t) * d_h * e
        fwd = Ml * L_r * (1 if lay.recompute == "none" else 2)   # recompute (selective too) reruns the core
        if lay.cp_attention == "allgather":
            cp.add("all_gather", 2 * fwd, kv)
            cp.add("reduce_scatter", 2 * Ml * L_r, lay.cp * kv)
        elif lay.cp_attention == "ring":
            n = (lay.cp - 1) * fwd + (2 * lay.cp - 1) * Ml * L_r
            cp.add("send", n, 2 * kv)
            cp.add("recv", n, 2 * kv)
        else:
            q = N * (spec.n_head // t) * d_h * e
            for each in (q, kv, kv, q):
                cp.add("all_to_all", fwd + Ml * L_r, each)
        if n_moe:   # the balance losses on the whole group: logits and indices all-gathered over CP, dlogits back
            again = 2 if lay.recompute == "full" else 1
            cp.add("all_gather", Ml * n_moe * again, N * spec.n_routed_experts * e)
            cp.add("all_gather", Ml * n_moe * again, N * spec.n_activated_experts * 8)
            cp.add("reduce_scatter", Ml * n_moe, lay.cp * N * spec.n_routed_experts * e)

    # ---- PP: sends and receives of this rank's chunks
    pp = out["pp"]
    stages = rank_stages(lay, r)
    last = p * v - 1
    n_send_f = sum(1 for s in stages if s != last and s + 1 not in stages)   # V placement: p-1 -> p stays
    n_send_b = sum(1 for s in stages if s != 0 and s - 1 not in stages)
    if p > 1:                                                   # SP: each TP rank sends its S/t shard
        msg = act // t if lay.sequence_parallel else act
        pp.add("send", M * (n_send_f + n_send_b), msg)
        pp.add("recv", M * (n_send_f + n_send_b), msg)
        if spec.tied_embeddings and r in (0, p - 1) and lay.placement == "loop":   # 2 copies of a tied embedding
            out["embedding"].add("all_reduce", 1, math.ceil(spec.vocab_size / t) * h * gb)

    # ---- DP: once per step
    dp = out["dp"]
    d, d_exp = lay.d * lay.cp, max(1, lay.d // lay.ep) * lay.cp
    for k, (n, dd, buckets) in enumerate(((cnt["dense"], d, dp_buckets), (cnt["expert"], d_exp, None))):
        if n == 0 or dd == 1:
            continue
        sub = AxisComm("dp", dd, links["dp"])
        split = actions is not None and any(a.kind in ("I", "W") for a in actions)
        if lay.zero == 3 and k == 0 and split:   # split backward: gathers counted along the actions
            for stage, units in zip(rank_stages(lay, r), zero3_stage_units(spec, lay, r)):
                n_ag = zero3_split_gathers(actions, stage, M, lay.reshard_after_forward)
                for u in units:
                    padded = _zero_shard(u, dd) * dd
                    sub.add("all_gather", n_ag, padded // dd * pb)
                    sub.add("reduce_scatter", 1, padded * gb)
        elif lay.zero == 3 and k == 0:   # dense FSDP units: gathered per microbatch, no gather after the step
            for u in zero3_units(spec, lay, r):
                padded = _zero_shard(u, dd) * dd
                sub.add("all_gather", M * (2 if lay.reshard_after_forward else 1), padded // dd * pb)
                sub.add("reduce_scatter", 1, padded * gb)
        elif lay.zero == 0 or (k == 1 and not lay.shard_experts):   # one reduction per model chunk (each chunk
            #                     its own DDP), payload n in all; whole experts: all-reduced over their group
            sub.add("all_reduce", 1, n * gb)
            if (buckets or v > 1) and (k == 0 or lay.shard_experts):   # whole experts: one coalesced
                sub.ops["all_reduce"] = (buckets or v, n * gb)
        else:
            padded = _zero_shard(n, dd) * dd
            sub.add("reduce_scatter", 1, padded * gb)
            sub.add("all_gather", 1, padded // dd * pb)
            if lay.zero == 3:
                sub.add("all_gather", 2 * M, padded // dd * pb)
        for k, (c, b) in sub.ops.items():
            c0, b0 = dp.ops.get(k, (0, 0))
            dp.ops[k] = (c0 + c, b0 + b)
        dp.wire += sub.wire

    # ---- EP: dispatch and combine, forward and backward, per MoE layer
    if spec.is_moe and lay.ep > 1:
        tokens = N // (t if lay.sequence_parallel else 1)
        n_a2a = 4 + (2 if lay.recompute == "full" else 0)      # full recompute redoes the forward pair
        out["ep"].add("all_to_all", Ml * n_moe * n_a2a, tokens * spec.n_activated_experts * h * e)
    return out
