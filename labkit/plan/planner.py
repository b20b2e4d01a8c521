"""The time model, the search over layouts, and why the best one wins.

Time model: :mod:`.timing` (per-layer GEMM, element-wise and collective time, the bubble of
1F1B / interleaved 1F1B, pipeline messages with Megatron's scatter/gather, recompute per mode;
MFU and HFU by Korthikanti et al. 2022 eq. 7 / 8 and Narayanan et al. 2021 eq. 3).

Search (Narayanan et al. 2021, sec. 3.3, "takeaways"): #1 tensor parallelism up to the GPUs
of one node, pipeline parallelism across nodes; #2 make the model-parallel size t p just large
enough for the model to fit, and scale with data parallelism. :func:`plan` enumerates every
valid (t, p, d) with t a power of two up to the node size, p <= L (uneven stages when p does
not divide L, as DeepSeek-V3's 61 layers on 16 stages), SP on whenever
t > 1, recompute none / selective / full and, for p > 1, v in 1, 2, 4 (interleaved), keeps
those that fit the GPU memory, and ranks them by predicted step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .comm import axis_links, comm_per_rank
from .memory import check_layout, grad_convention, memory_per_rank, n_microbatches
from .spec import Cluster, Layout, ModelSpec
from .timing import StepTime, step_time

__all__ = ["StepTime", "step_time", "PlanEntry", "plan", "explain", "PlanError", "smallest_memory"]

GB = 1e9


class PlanError(ValueError):
    """No layout fits; ``smallest_memory`` (bytes) is what the best layout would need."""

    def __init__(self, message: str, smallest_memory: float | None = None, layout: Layout | None = None):
        super().__init__(message)
        self.smallest_memory, self.layout = smallest_memory, layout


@dataclass
class PlanEntry:
    """One candidate: ``layout``, ``memory`` (bytes of the most loaded rank), its breakdown
    ``rank`` (:class:`~.memory.RankMemory`), ``time`` (:class:`StepTime`), ``fits``."""

    layout: Layout
    memory: int
    rank: object
    time: StepTime
    fits: bool


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def candidates(spec: ModelSpec, n_gpus: int, cluster: Cluster, zero: int = 1, precision: str = "bf16",
               b: int = 1, ep: int | None = None, fused_attention: bool = False,
               fp32_grads: bool = False) -> list[Layout]:
    """Every valid layout for ``n_gpus`` under Megatron's rule #1 (t within a node)."""
    out = []
    for t in _pow2_upto(min(cluster.gpus_per_node, n_gpus)):
        for p in range(1, spec.n_layer + 1):
            if n_gpus % (t * p):
                continue
            d = n_gpus // (t * p)
            e = 1
            if spec.is_moe:
                e = math.gcd(d, spec.n_routed_experts) if ep is None else ep
            for v in ((1, 2, 4) if p > 1 else (1,)):
                if v > 1 and spec.n_layer % (p * v):
                    continue                       # interleaving: equal chunks (Megatron)
                for rec in ("none", "selective", "full"):
                    if spec.global_batch % (b * d):
                        continue
                    lay = Layout(t=t, p=p, d=d, v=v, b=b, M=spec.global_batch // (b * d),
                                 schedule="interleaved" if v > 1 else "1f1b",
                                 zero=zero, sequence_parallel=t > 1, recompute=rec, precision=precision, ep=e,
                                 fused_attention=fused_attention, fp32_grads=fp32_grads)
                    try:
                        check_layout(spec, lay)
                    except ValueError:
                        continue
                    out.append(lay)
    return out


def evaluate(spec: ModelSpec, lay: Layout, cluster: Cluster) -> PlanEntry:
    ranks = memory_per_rank(spec, lay)
    worst = max(ranks, key=lambda m: m.total)
    return PlanEntry(lay, worst.total, worst, step_time(spec, lay, cluster), worst.total <= cluster.gpu_memory)


def _more_gpus(n_gpus: int, zero: int) -> str:
    """The rest of the advice when nothing fits: more GPUs; with them a higher ZeRO stage, below
    stage 3 only (ZeRO shards over d, which the extra GPUs give)."""
    return " or more GPUs" + (", with a higher ZeRO stage" if zero < 3 else "")


def plan(spec: ModelSpec, n_gpus: int, cluster: Cluster, zero: int = 1, precision: str = "bf16", b: int = 1,
         ep: int | None = None, fused_attention: bool = False, fp32_grads: bool = False) -> list[PlanEntry]:
    """Feasible layouts of ``spec`` on ``n_gpus`` GPUs, fastest first (ties: smaller t p first).

    Raises :class:`PlanError` when none fits, naming the smallest GPU memory that would work
    (and for which layout), or when ``n_gpus`` admits no valid layout at all.
    """
    if n_gpus < 1:
        raise PlanError(f"--gpus must be >= 1, got {n_gpus}")
    lays = candidates(spec, n_gpus, cluster, zero, precision, b, ep, fused_attention, fp32_grads)
    if not lays:
        raise PlanError(f"no valid layout of {spec.name} on {n_gpus} GPUs: t (a power of 2 <= "
                        f"{cluster.gpus_per_node} GPUs per node, dividing the {spec.n_head} heads), p (dividing "
                        f"L={spec.n_layer}) and d = n/(t p) (dividing the global batch {spec.global_batch}) "
                        f"must multiply to {n_gpus}")
    entries = [evaluate(spec, lay, cluster) for lay in lays]
    fit = [e for e in entries if e.fits]
    if not fit:
        best = min(entries, key=lambda e: e.memory)
        raise PlanError(f"{spec.name} fits no layout on {n_gpus} GPUs with {cluster.gpu_memory / GB:g} GB each: "
                        f"the smallest need is {math.ceil(best.memory / GB * 10) / 10:g} GB per GPU "
                        f"({best.layout.describe()}); use GPUs with at least that much memory"
                        f"{_more_gpus(n_gpus, zero)}", best.memory, best.layout)
    fit.sort(key=lambda e: (e.time.total, e.layout.t * e.layout.p, e.memory))
    return fit


def smallest_memory(spec: ModelSpec, n_gpus: int, cluster: Cluster, **kw) -> tuple[int, Layout]:
    """(bytes, layout) of the layout with the smallest most-loaded-rank memory."""
    entries = [evaluate(spec, lay, cluster) for lay in candidates(spec, n_gpus, cluster, **kw)]
    best = min(entries, key=lambda e: e.memory)
    return best.memory, best.layout


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def explain(spec: ModelSpec, entries: list[PlanEntry], cluster: Cluster, n_gpus: int) -> str:
    """Why the first entry wins, in Megatron's terms (rules #1 and #2), the bubble and the
    communication of each axis, and what the runner-up loses."""
    top = entries[0]
    L, T = top.layout, top.time
    links = axis_links(L, cluster)
    comm = comm_per_rank(spec, L, cluster, 0)
    lines = [f"Why {L.describe()} wins:"]
    lines.append(f"  rule 1 (TP inside a node): t={L.t} <= {cluster.gpus_per_node} GPUs per node, so its "
                 f"{comm['tp'].wire / GB:.1f} GB per step per GPU go over {links['tp']} links "
                 f"({T.tp:.2f} s)." if L.t > 1 else
                 "  rule 1: t=1, no tensor parallelism needed.")
    smaller = [e for e in entries if e.layout.t * e.layout.p < L.t * L.p]
    cands = candidates(spec, n_gpus, cluster, L.zero, L.precision, L.b, None, L.fused_attention, L.fp32_grads)
    all_mp = sorted({lay.t * lay.p for lay in cands})
    below = [mp for mp in all_mp if mp < L.t * L.p]
    if below and not smaller:
        mp = below[-1]
        need = min(evaluate(spec, lay, cluster).memory for lay in cands if lay.t * lay.p == mp)
        lines.append(f"  rule 2 (model parallelism just large enough): t*p={L.t * L.p} is the smallest that fits; "
                     f"t*p={mp} needs {_gb(need)} > {_gb(cluster.gpu_memory)} per GPU.")
    elif smaller:
        s0 = smaller[0]
        lines.append(f"  rule 2: smaller t*p also fit but are slower (best with t*p={s0.layout.t * s0.layout.p}: "
                     f"{s0.time.total:.2f} s per step).")
    else:
        lines.append(f"  rule 2: t*p={L.t * L.p} is the smallest model-parallel size for {n_gpus} GPUs.")
    lines.append(f"  the rest is data parallelism: d={L.d}, one gradient reduction per step "
                 f"({comm['dp'].wire / GB:.1f} GB over {links['dp']} links, {T.dp:.2f} s).")
    if L.p > 1:
        M = n_microbatches(spec, L)
        lines.append(f"  pipeline: p={L.p}, v={L.v}, M={M}: bubble (p-1)/(v M) = {(L.p - 1) / (L.v * M):.3f} of the "
                     f"compute ({T.bubble:.2f} s); {comm['pp'].ops.get('send', (0, 0))[0]} stage-boundary messages "
                     f"per rank, {'b s h / t each (Megatron scatter/gather)' if L.t > 1 else 'b s h each'} "
                     f"({T.pp:.2f} s).")
    r = top.rank
    lines.append(f"  memory of the most loaded GPU (pipeline rank {r.pp_rank}): params {_gb(r.params)}, grads "
                 f"{_gb(r.grads)}, optimizer {_gb(r.optimizer)}, activations {_gb(r.activations)} "
                 f"(recompute={L.recompute}); total {_gb(r.total)} of {_gb(cluster.gpu_memory)} "
                 f"({grad_convention(L)}).")
    lines.append(f"  predicted step {T.total:.2f} s (compute {T.compute:.2f} s, of it recompute {T.recompute:.2f} s), "
                 f"MFU {T.mfu * 100:.1f} %, HFU {T.hfu * 100:.1f} % (Korthikanti et al. 2022 eq. 7 / 8; GEMM "
                 f"efficiency {cluster.compute_efficiency:g}).")
    if len(entries) > 1:
        ru = entries[1]
        diffs = {k: getattr(ru.time, k) - getattr(T, k) for k in ("compute", "bubble", "tp", "pp", "dp", "ep")}
        k = max(diffs, key=diffs.get)
        lines.append(f"  runner-up {ru.layout.describe()}: {ru.time.total:.2f} s, mostly "
                     f"{'more ' + k if diffs[k] > 0 else 'no single term'} (+{max(diffs[k], 0):.2f} s).")
    return "\n".join(lines)
