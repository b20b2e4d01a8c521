"""Benchmark: labkit's pipeline schedules against torch.distributed.pipelining.

``python -m labkit bench pipeline`` runs GPipe, 1F1B and interleaved 1F1B (v=2) (and, with
``--schedule zb-h1 zbv dualpipev``, the zero-bubble ones against torch's
ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV) from
labkit and the matching ``torch.distributed.pipelining`` schedules on the same GPT stages,
input and ranks (4 gloo CPU ranks by default), alternating labkit and torch step by step
so that both see the same machine load, and prints the median step time of each and the
ratio labkit/torch (below 1.0: labkit is faster).

Each timed step starts and ends with a barrier, so it measures the whole pipeline.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..cliparse import Parser
from ..pipeline.registry import lookup, names

__all__ = ["main", "bench"]

KINDS = names(zero_bubble=False)      # gpipe 1f1b interleaved
ZERO_BUBBLE = names(zero_bubble=True)  # zb-h1 zbv dualpipev, each against torch's class of the registry's torch_name


def _worker(ctx, a):
    from torch.distributed import pipelining as tpp

    from ..model import GPT, GPTConfig, lm_loss
    from ..pipeline import PipelineStage
    from ..pipeline.stages import gpt_stages_for_rank, split_gpt, step_torch_schedule

    K = ctx.world_size
    cfg = GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq)
    model = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (a.batch, a.seq), generator=g).to(ctx.device)
    y = torch.randint(0, 256, (a.batch, a.seq), generator=g).to(ctx.device)
    runs = {}
    for kind in a.kinds:
        info = lookup(kind)
        lk_cls, tc_cls, v = info.runtime_class, getattr(tpp, info.torch_name), info.v(a.chunks)
        if info.v_shaped:  # V placement: rank r holds stages r and 2K-1-r
            ids, S = [ctx.rank, 2 * K - 1 - ctx.rank], 2 * K
            mods = [m.to(ctx.device) for m in split_gpt(model, S, ids)]
            lk = lk_cls([PipelineStage(m, s, S, ctx.device, group=ctx.group) for m, s in zip(mods, ids)],
                        a.microbatches, lm_loss)
            tmods = [m.to(ctx.device) for m in split_gpt(model, S, ids)]
            tc = tc_cls([tpp.PipelineStage(m, s, S, ctx.device, group=ctx.group) for m, s in zip(tmods, ids)],
                        n_microbatches=a.microbatches, loss_fn=lm_loss)

            def lk_step(lk=lk):
                lk.step(x, target=y)

            def tc_step(tc=tc, first=0 in ids, last=S - 1 in ids):
                tc.step(*((x,) if first else ()), **({"target": y} if last else {}))
            runs[kind] = (lk_step, tc_step, mods + tmods)
            continue
        ids = [s for s in range(K * v) if s % K == ctx.rank]
        mods = [m.to(ctx.device) for m in gpt_stages_for_rank(model, K, v, ctx.rank)]
        st = [PipelineStage(m, s, K * v, ctx.device, group=ctx.group) for m, s in zip(mods, ids)]
        lk = lk_cls(st if v > 1 else st[0], a.microbatches, lm_loss)
        tmods = [m.to(ctx.device) for m in gpt_stages_for_rank(model, K, v, ctx.rank)]
        tst = [tpp.PipelineStage(m, s, K * v, ctx.device, group=ctx.group) for m, s in zip(tmods, ids)]
        tc = tc_cls(tst if v > 1 or info.zero_bubble else tst[0], n_microbatches=a.microbatches, loss_fn=lm_loss)

        def lk_step(lk=lk):
            lk.step(x, target=y)

        def tc_step(tc=tc):
            step_torch_schedule(tc, ctx.rank, K, x, y)
        runs[kind] = (lk_step, tc_step, mods + tmods)
    times = {(k, w): [] for k in runs for w in ("labkit", "torch")}
    for i in range(a.warmup + a.steps):
        for kind, (lk_step, tc_step, mods) in runs.items():
            order = [("labkit", lk_step), ("torch", tc_step)]
            if i % 2:
                order.reverse()
            for who, fn in order:
                for m in mods:
                    m.zero_grad(set_to_none=True)
                dist.barrier(group=ctx.group)
                t0 = time.perf_counter()
                fn()
                dist.barrier(group=ctx.group)
                if i >= a.warmup:
                    times[(kind, who)].append(time.perf_counter() - t0)
    return times


def bench(a) -> dict:
    """Run the benchmark; returns ``{kind: (labkit median s, torch median s, ratio)}``."""
    from ..dist import launch
    res = launch(_worker, a.world_size, a, backend=a.backend, timeout=120)
    times = res[0]
    out = {}
    for kind in a.kinds:
        lk = statistics.median(times[(kind, "labkit")])
        tc = statistics.median(times[(kind, "torch")])
        out[kind] = (lk, tc, lk / tc)
    return out


def _bad_args(a) -> str | None:
    """The first rule the options break (before any rank starts), as a message; None if all are fine."""
    from ..cliparse import too_small
    from ..model import GPTConfig
    from ..pipeline import ScheduleError, check_pipeline_sizes
    from ..pipeline.stages import stage_layers

    bad = too_small(("--world-size", a.world_size, 1), ("--microbatches", a.microbatches, 1),
                    ("--chunks", a.chunks, 1), ("--steps", a.steps, 1), ("--warmup", a.warmup, 0),
                    ("--layers", a.layers, 1), ("--embd", a.embd, 1), ("--heads", a.heads, 1),
                    ("--seq", a.seq, 1), ("--batch", a.batch, 1))
    if bad:
        return bad
    if not a.kinds:
        return "--schedule needs at least one schedule"
    try:
        GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq)
    except ValueError as e:
        return f"{e} (--embd {a.embd}, --heads {a.heads})"
    K, M = a.world_size, a.microbatches
    try:
        for kind in a.kinds:
            info = lookup(kind)
            check_pipeline_sizes(K, M, a.chunks if info.chunks is None else 1)
            stage_layers(a.layers, info.n_stages(K, a.chunks), 0)
            if info.zero_bubble:  # their own rules, e.g. DualPipeV's M >= 2K
                info.schedule(K, M)
        if a.batch % M:
            raise ScheduleError(f"--batch {a.batch} is not divisible by --microbatches {M}")
    except (ScheduleError, ValueError) as e:
        return str(e)
    return None


def main(argv=None) -> int:
    p = Parser(prog="python -m labkit bench pipeline", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="K pipeline ranks")
    p.add_argument("--microbatches", type=int, default=8, help="M microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v for interleaved 1F1B")
    p.add_argument("--steps", type=int, default=20, help="timed steps per schedule and library")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks L")
    p.add_argument("--embd", type=int, default=128, help="hidden size H")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    from ..labs import schedule_name
    p.add_argument("--schedule", dest="kinds", nargs="*", default=list(KINDS), choices=KINDS + ZERO_BUBBLE,
                   type=schedule_name, help="schedules to time (aliases: zbh1 = zb-h1, zb-v = zbv)")
    p.add_argument("--backend", default="gloo", choices=("auto", "gloo", "nccl"), help="torch.distributed backend")
    p.needs("--chunks", lambda a: "interleaved" in a.kinds, "--schedule interleaved (got --schedule "
            "{kinds})", "--schedule interleaved")   # the one rule: labkit.cliparse.Parser.needs
    a = p.parse_args(argv)
    bad = _bad_args(a)
    if bad:
        from ..labs import error
        return error(bad)
    print(f"pipeline benchmark: K={a.world_size} ranks ({a.backend}), M={a.microbatches}, v={a.chunks}, "
          f"GPT L={a.layers} H={a.embd}, batch {a.batch}x{a.seq}, median of {a.steps} steps")
    out = bench(a)
    print(f"{'schedule':<12} {'labkit ms':>10} {'torch ms':>10} {'labkit/torch':>13}")
    for kind, (lk, tc, r) in out.items():
        print(f"{kind:<12} {lk * 1e3:>10.1f} {tc * 1e3:>10.1f} {r:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
