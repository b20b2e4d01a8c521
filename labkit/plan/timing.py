"""The time model: seconds per training iteration of a layout, MFU and HFU.

Per microbatch and pipeline rank, each of the rank's layers costs (t TP degree; ts = t with
sequence parallelism, else 1; e bytes per activation element; N = b s tokens):

* GEMMs: forward ``2 x (weight elements) x N / t`` FLOPs at ``peak x compute_efficiency``
  (the model's one free constant), backward twice that (Korthikanti et al. 2022 sec. 6.3);
  the attention core (Q K^T, weights x V: ``2 s a (d_qk + d_v) N / t``) the same way;
* memory-bound element-wise work at the GPU's memory bandwidth ``hbm_bw``: two LayerNorms
  (read and write ``e`` bytes per element) and two fused bias-dropout-adds (read 2, write 1,
  a 1-byte mask): ``(10 e + 2) N h`` bytes that tensor parallelism does not split (sequence
  parallelism does: that is SP's speed-up, Korthikanti Table 4); the GeLU ``2 N f e / t``; the
  attention scores' scale-mask-softmax and dropout ``(4 e + 1) a s N / t`` (none with a fused
  attention kernel); backward moves 1.5 times the forward's bytes (it reads the output
  gradient and the saved input, and writes the input gradient);
* TP collectives: what :func:`~.comm.comm_per_rank` counts (2 all-reduces per layer forward,
  2 backward, or their reduce-scatter / all-gather pairs with SP; full recompute repeats the
  forward's) on the intra-node link;
* recompute (Korthikanti sec. 5): "full" runs each layer's forward again (GEMMs, core,
  element-wise and its collectives), "selective" runs the attention core again (core and
  softmax/dropout); the logit layer (``2 h V N / t``, times 3) is never recomputed.

A rank's microbatch time ``T`` is the sum over its layers (plus the logits on the last rank);
the slowest rank sets the pace. The pipeline runs ``v max(M, p) + min(M, p) - 1`` chunk slots
of ``T / v`` each: ``M T`` of work and a bubble of ``(p-1)/(v M)`` of it when M >= p
(Narayanan et al. 2021 sec. 2.2.2; :func:`labkit.pipeline.simulate.bubble_formula`).

Pipeline messages: each chunk boundary sends the activation forward and its gradient back,
so interleaving sends v times more messages (``2 v M`` per rank). With t > 1 Megatron
sends ``N h e / t`` per TP rank over InfiniBand and all-gathers it over NVLink
(``pp_scatter_gather``, Narayanan et al. 2021 sec. 4.1; labkit's runtime sends the whole
``N h e``, which :mod:`.comm` counts). DP, EP and the tied-embedding all-reduce add their wire
bytes over their link. No communication is hidden behind compute.

Context parallelism (cp > 1): each rank computes its s/cp tokens (GEMMs and element-wise
work divided by cp; the attention core of its queries against all s keys, balanced by the 2 cp
chunk placement), and its K/V exchange (:func:`~.comm.comm_per_rank`'s "cp" axis) is added per
microbatch on the CP link, not hidden either.

MFU and HFU by the papers' definitions (:mod:`.flops`): model FLOPs (Korthikanti eq. 7) and
hardware FLOPs (eq. 8 with selective recompute, Narayanan eq. 3 with full) over
``time x GPUs x peak``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .comm import comm_per_rank
from .flops import iteration_flops, layer_forward_flops
from .memory import BYTES, bytes_per_param, check_layout, holds_last, memory_per_rank, n_microbatches, rank_layer_chunks
from .spec import Cluster, Layout, ModelSpec

BWD_ELEM = 1.5   # backward element-wise traffic over forward's: reads the output gradient and the saved input

__all__ = ["StepTime", "step_time", "layer_times", "layer_forward_backward"]


@dataclass
class StepTime:
    """Seconds per iteration: ``compute`` (work without bubble: GEMMs, element-wise, recompute,
    TP collectives), ``bubble``, ``tp`` (the TP collectives inside ``compute``), ``pp``,
    ``dp``, ``ep``, ``total``; ``recompute`` (seconds of recomputation inside ``compute``);
    ``mfu``, ``hfu`` (fractions); ``flops`` (model FLOPs per iteration, Korthikanti eq. 7),
    ``hw_flops`` (hardware FLOPs, recompute included)."""

    compute: float
    bubble: float
    tp: float
    pp: float
    dp: float
    ep: float
    total: float
    mfu: float
    flops: float
    hfu: float = 0.0
    hw_flops: float = 0.0
    recompute: float = 0.0


def layer_times(spec: ModelSpec, lay: Layout, cluster: Cluster, moe: bool = False) -> dict:
    """Seconds of one layer on one GPU for one microbatch, without collectives:
    ``{"forward", "backward", "recompute"}`` (see the module docstring)."""
    t, ts = lay.t, (lay.t if lay.sequence_parallel else 1)
    e = BYTES[lay.precision][0]
    N = lay.b * spec.seq_len // lay.cp          # this CP rank's tokens
    rate = cluster.peak_flops * cluster.compute_efficiency
    gemm, core = layer_forward_flops(spec, moe)
    gemm, core = gemm * N / t / rate, core * N / t / rate
    width = (spec.n_activated_experts + spec.n_shared_experts) * (spec.moe_ffn or spec.ffn_hidden) if moe \
        else spec.ffn_hidden
    rep = (10 * e + 2) * N * spec.hidden / ts / cluster.hbm_bw      # 2 LayerNorms, 2 bias-dropout-adds
    gelu = 2 * N * width * e / t / cluster.hbm_bw
    scores = 0.0 if lay.fused_attention else (4 * e + 1) * spec.n_head * spec.seq_len * N / t / cluster.hbm_bw
    elem = rep + gelu + scores
    fwd = gemm + core + elem
    rc = {"none": 0.0, "selective": core + scores, "full": fwd}[lay.recompute]
    return {"forward": fwd, "backward": 2 * (gemm + core) + BWD_ELEM * elem, "recompute": rc}


def layer_forward_backward(spec: ModelSpec, lay: Layout, cluster: Cluster, moe: bool = False) -> tuple:
    """(forward, backward) seconds of one layer and one microbatch with its TP collectives, as
    Korthikanti et al. 2022 Table 4 reports them (backward includes the recompute): 2 all-reduces
    of ``N h e`` forward and 2 backward (with SP a reduce-scatter + all-gather each, the same
    wire bytes, and 2 more all-gathers in backward to re-gather the column-parallel inputs);
    full recompute repeats the forward's 2 in backward."""
    lt = layer_times(spec, lay, cluster, moe)
    t = lay.t
    wire = 2 * (t - 1) / t * lay.b * spec.seq_len * spec.hidden * BYTES[lay.precision][0] / cluster.intra_bw
    fwd_c = 2 * wire
    bwd_c = 2 * wire + (wire if lay.sequence_parallel else 0) + (2 * wire if lay.recompute == "full" else 0)
    return lt["forward"] + fwd_c, lt["backward"] + lt["recompute"] + bwd_c


def _logit_time(spec: ModelSpec, lay: Layout, cluster: Cluster) -> float:
    rate = cluster.peak_flops * cluster.compute_efficiency
    return 3 * 2 * spec.hidden * spec.vocab_size * lay.b * spec.seq_len / lay.cp / lay.t / rate


def _pp_message_time(spec: ModelSpec, lay: Layout, cluster: Cluster, link_bw: float) -> float:
    e = BYTES[lay.precision][0]
    act = lay.b * spec.seq_len // lay.cp * spec.hidden * e
    if lay.t > 1 and (lay.pp_scatter_gather or lay.sequence_parallel):
        gather = 0.0 if lay.sequence_parallel else act * (lay.t - 1) / lay.t / cluster.intra_bw
        return act / lay.t / link_bw + gather
    return act / link_bw


def _optimizer_time(spec: ModelSpec, lay: Layout, cluster: Cluster) -> float:
    """The optimizer step on the most loaded rank, memory-bound: per parameter of the rank's
    ZeRO shard it reads the gradient for the gradient norm (clipping) and for Adam, reads and
    writes the fp32 master weight and both moments, writes the 16-bit weight (mixed precision)
    and zeroes the gradient: ``3 g + 2 x 12 + 2`` bytes (38 with Megatron's fp32 gradients)."""
    r = max(memory_per_rank(spec, lay), key=lambda m: m.total)
    pb, gb, ob = bytes_per_param(lay)
    n = r.optimizer / ob                    # elements this rank updates (its ZeRO shard)
    return n * (3 * gb + 2 * ob + (pb if lay.precision == "bf16" else 0)) / cluster.hbm_bw


def step_time(spec: ModelSpec, lay: Layout, cluster: Cluster) -> StepTime:
    """Predicted iteration time, MFU and HFU of ``lay`` on ``cluster`` (module docstring).
    Raises ValueError (from :func:`~.memory.check_layout`) for an impossible layout."""
    check_layout(spec, lay)
    p, v, M = lay.p, lay.v, n_microbatches(spec, lay)
    passes = M // 2 if lay.schedule == "dualpipe" else M     # microbatch passes through each of the rank's layers
    bw = {"intra-node": cluster.intra_bw, "inter-node": cluster.inter_bw, "-": float("inf")}
    per_mb, tp_mb, rc_mb, sends = [], [], [], []
    for r in range(p):
        ids = [i for ch in rank_layer_chunks(spec, lay, r) for i in ch]
        work = rc = 0.0
        for i in ids:
            lt = layer_times(spec, lay, cluster, spec.is_moe_layer(i))
            work += lt["forward"] + lt["backward"] + lt["recompute"]
            rc += lt["recompute"]
        if holds_last(lay, r):
            work += _logit_time(spec, lay, cluster)
        comm = comm_per_rank(spec, lay, cluster, r)
        tp = comm["tp"].wire / bw[comm["tp"].link] / passes
        tp += comm["cp"].wire / bw[comm["cp"].link] / passes if comm["cp"].ops else 0.0
        per_mb.append(work + tp)
        tp_mb.append(tp)
        rc_mb.append(rc)
        sends.append(comm["pp"].ops.get("send", (0, 0))[0])   # 2 v M per rank, fewer at the ends
    slow = max(range(p), key=lambda r: per_mb[r])
    T = per_mb[slow]
    compute = passes * T
    if lay.schedule == "dualpipe":       # M/2 microbatches through each of the rank's 2 stages
        bubble = (p / 2 - 1) * T / 2     # (p/2 - 1)(F&B + B - 3W), DeepSeek-V3 Table 2, without overlap gains
    else:
        slots = v * max(M, p) + min(M, p) - 1      # chunk slots of T / v each (bubble formula)
        bubble = slots * T / v - compute
    comm0 = comm_per_rank(spec, lay, cluster, 0)
    pp = max(sends) * _pp_message_time(spec, lay, cluster, bw[comm0["pp"].link]) if p > 1 else 0.0
    dp = comm0["dp"].wire / bw[comm0["dp"].link] if comm0["dp"].ops else 0.0
    ep = comm0["ep"].wire / bw[comm0["ep"].link] if comm0["ep"].ops else 0.0
    emb = comm0["embedding"].wire / bw[comm0["embedding"].link] if comm0["embedding"].ops else 0.0
    opt = _optimizer_time(spec, lay, cluster)
    total = compute + bubble + pp + dp + ep + emb + opt
    fl = iteration_flops(spec, M * lay.b * lay.d, lay.recompute)
    n, peak = lay.n_gpus, cluster.peak_flops
    return StepTime(compute, bubble, passes * tp_mb[slow], pp, dp + emb, ep, total,
                    fl["model"] / (total * n * peak), fl["model"], fl["hardware"] / (total * n * peak),
                    fl["hardware"], passes * rc_mb[slow])
