"""Benchmark: labkit's data parallelism against PyTorch's, side by side.

    python -m labkit bench dp [--dp 2] [--iters 15] [--bucket-cap-mb 0.25] [--layers 4] [--embd 64] ...

On the same gloo ranks, the same reference weights, the same batches and the same bucket size:

* DDP: :class:`labkit.data_parallel.DistributedDataParallel` against
  ``torch.nn.parallel.DistributedDataParallel`` (forward + backward + SGD step);
* ZeRO-1: :class:`labkit.data_parallel.ZeroRedundancyOptimizer` (reduce-scatter, 1/d of Adam,
  all-gather) against ``torch.distributed.optim.ZeroRedundancyOptimizer`` with Adam on top of
  torch's DDP (all-reduce, 1/d of Adam by whole parameters, broadcast), forward + backward + step.

The two sides alternate step by step (a noisy shared machine slows both alike) and the median
step time of each is printed with the ratio labkit / PyTorch (below 1: labkit faster), and the
largest parameter difference between the two after the timed steps (they train the same model).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..dist import launch
from ..model import GPT, GPTConfig
from . import median_time  # noqa: F401  (the shared helper; the alternating loop below is this bench's)


def _pairs(step_a, step_b, iters: int, warmup: int = 2):
    """Alternate ``step_a(i)`` and ``step_b(i)``; barrier before each; return the per-step times."""
    ta, tb = [], []
    for i in range(warmup + iters):
        for fn, out in ((step_a, ta), (step_b, tb)):
            dist.barrier()
            t0 = time.perf_counter()
            fn(i)
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return ta, tb


def _worker(ctx, a):
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from ..data_parallel import DistributedDataParallel, ZeroRedundancyOptimizer

    d, r = ctx.world_size, ctx.rank
    cfg = GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq)
    ref = GPT(cfg, seed=0)
    g = torch.Generator().manual_seed(r)
    data = [(torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g),
             torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)) for _ in range(4)]

    def trainer(model, opt):
        def step(i):
            x, y = data[i % len(data)]
            opt.zero_grad(set_to_none=True)
            model(x, y).backward()
            opt.step()
        return step

    def max_diff(m1, m2):
        return max(float((p - q).detach().abs().max()) for p, q in zip(m1.parameters(), m2.parameters()))

    out = {}
    # DDP vs DDP (plain SGD)
    lk = DistributedDataParallel(copy.deepcopy(ref), bucket_cap_mb=a.bucket_cap_mb)
    th = TorchDDP(copy.deepcopy(ref), bucket_cap_mb=a.bucket_cap_mb)
    ta, tb = _pairs(trainer(lk, torch.optim.SGD(lk.parameters(), lr=0.01)),
                    trainer(th, torch.optim.SGD(th.parameters(), lr=0.01)), a.iters)
    out["ddp"] = (statistics.median(ta), statistics.median(tb), max_diff(lk.module, th.module), len(lk.buckets))
    # ZeRO-1 vs ZeRO-1 (Adam)
    m1, m2 = copy.deepcopy(ref), TorchDDP(copy.deepcopy(ref), bucket_cap_mb=a.bucket_cap_mb)
    z1 = ZeroRedundancyOptimizer(m1.parameters(), torch.optim.Adam, lr=1e-3)
    z2 = TorchZero(m2.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    ta, tb = _pairs(trainer(m1, z1), trainer(m2, z2), a.iters)
    out["zero"] = (statistics.median(ta), statistics.median(tb), max_diff(m1, m2.module), 0)
    return out if r == 0 else None


def parse_args(argv):
    from ..labs import HelpFormatter
    p = argparse.ArgumentParser(prog="python -m labkit bench dp", formatter_class=HelpFormatter,
                                description="labkit DDP and ZeRO-1 against torch's, side by side.")
    p.add_argument("--dp", "--world-size", dest="dp", type=int, default=2, help="data-parallel ranks d")
    p.add_argument("--iters", type=int, default=15, help="timed steps of each side")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="bucket size of both DDPs (MiB)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks L")
    p.add_argument("--embd", type=int, default=64, help="hidden size H")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ..labs import error
    a = parse_args(sys.argv[1:] if argv is None else argv)
    for flag, v in (("--dp", a.dp), ("--iters", a.iters), ("--layers", a.layers), ("--embd", a.embd),
                    ("--heads", a.heads), ("--seq", a.seq), ("--batch", a.batch)):
        if v < 1:
            return error(f"{flag} must be >= 1, got {v}")
    if a.dp < 2:
        return error(f"--dp must be >= 2 (data parallelism needs two ranks), got {a.dp}")
    if not a.bucket_cap_mb > 0:
        return error(f"--bucket-cap-mb must be > 0, got {a.bucket_cap_mb}")
    if a.embd % a.heads:
        return error(f"--embd {a.embd} must be divisible by --heads {a.heads}")
    res = launch(_worker, a.dp, a, backend="gloo", timeout=300)[0]
    if res is None:
        return 0
    print(f"GPT L={a.layers} H={a.embd} S={a.seq}, {a.batch} sequences per rank, d={a.dp} gloo ranks, "
          f"buckets of {a.bucket_cap_mb:g} MiB; median of {a.iters} alternating steps")
    head = f"{'':<34}{'labkit s':>10}{'torch s':>10}{'ratio':>8}{'max |dparam|':>14}"
    print(head)
    print("-" * len(head))
    for key, name in (("ddp", f"DDP, SGD ({res['ddp'][3]} buckets)"), ("zero", "ZeRO-1, Adam")):
        lk, th, diff, _ = res[key]
        print(f"{name:<34}{lk:>10.4f}{th:>10.4f}{lk / th:>8.2f}{diff:>14.1e}")
    print("ratio = labkit / torch (below 1: labkit faster). torch's ZeRO runs on top of torch's DDP "
          "(all-reduce + broadcast of whole parameters); labkit's reduce-scatters and all-gathers one flat buffer.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
