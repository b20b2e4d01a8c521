"""Benchmark: labkit's data parallelism against PyTorch's, side by side.

    python -m labkit bench dp [--dp 2] [--iters 15] [--bucket-cap-mb 0.25] [--layers 4] [--embd 64] ...

On the same gloo ranks, the same reference weights, the same batches and the same bucket size:

* DDP: :class:`labkit.data_parallel.DistributedDataParallel` against
  ``torch.nn.parallel.DistributedDataParallel`` (forward + backward + SGD step);
* ZeRO-1: :class:`labkit.data_parallel.ZeroRedundancyOptimizer` (reduce-scatter, 1/d of Adam,
  all-gather) against ``torch.distributed.optim.ZeroRedundancyOptimizer`` with Adam on top of
  torch's DDP (all-reduce, 1/d of Adam by whole parameters, broadcast), forward + backward + step.

* ZeRO-2: :class:`labkit.data_parallel.ZeroStage2` (bucketed reduce-scatter during backward,
  1/d of gradients and Adam, all-gather after the step) against torch FSDP2 ``fully_shard`` with
  ``reshard_after_forward=False`` on every unit (its ZeRO-2-like mode: parameters gathered once
  per step and kept through backward), Adam;
* ZeRO-3: :class:`labkit.data_parallel.FullyShardedDataParallel` (units = embedding, blocks,
  head; resharded after forward, next unit prefetched) against torch FSDP2 ``fully_shard`` on
  the same units and the root, ``reshard_after_forward=True``, Adam.

* 3D (t x p x d, 1F1B): :class:`labkit.parallel.ParallelGPT` (labkit TP layers in labkit pipeline
  stages, labkit DDP across) against PyTorch's own composition on the same gloo ranks: a 3-D
  ``DeviceMesh("cpu", (p, d, t))``, ``parallelize_module`` (``ColwiseParallel`` /
  ``RowwiseParallel``, as in ``bench tensor``, the output layer gathered) on each stage cut by
  :func:`labkit.pipeline.stages.split_gpt`, ``torch.distributed.pipelining`` ``PipelineStage`` +
  ``Schedule1F1B`` over the pp group, and FSDP2 ``fully_shard(reshard_after_forward=False)``
  over the dp group (torch's DDP does not take DTensor parameters); forward + backward + SGD step.

The two sides alternate step by step (a noisy shared machine slows both alike) and the median
step time of each is printed with the ratio labkit / PyTorch (below 1: labkit faster), and the
largest parameter difference between the two after the timed steps (they train the same model).
"""
from __future__ import annotations

import copy
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ..cliparse import Parser
from ..dist import launch
from ..grid import Mesh
from ..model import GPT, GPTConfig


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

    _quiet()
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
    # ZeRO-2 and ZeRO-3 vs torch FSDP2 (Adam): fully_shard on each unit, then the root
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from ..data_parallel import FullyShardedDataParallel, ZeroStage2, default_units
    mesh = init_device_mesh("cpu", (d,))

    def torch_fsdp(reshard):
        m = copy.deepcopy(ref)
        for name in default_units(m):
            torch_fully_shard(m.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
        torch_fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        return m

    def full_params_diff(lk_full: dict, th_model):
        return max(float((lk_full[n] - p.full_tensor()).abs().max()) for n, p in th_model.named_parameters())

    z2 = ZeroStage2(copy.deepcopy(ref), torch.optim.Adam, bucket_cap_mb=a.bucket_cap_mb, lr=1e-3)
    t2 = torch_fsdp(False)
    ta, tb = _pairs(trainer(z2, z2), trainer(t2, torch.optim.Adam(t2.parameters(), lr=1e-3)), a.iters)
    lk_full = dict(z2.module.named_parameters())
    out["zero2"] = (statistics.median(ta), statistics.median(tb), full_params_diff(lk_full, t2), len(z2.buckets))
    f3 = FullyShardedDataParallel(copy.deepcopy(ref), reshard_after_forward=True)
    t3 = torch_fsdp(True)
    ta, tb = _pairs(trainer(f3, torch.optim.Adam(f3.parameters(), lr=1e-3)),
                    trainer(t3, torch.optim.Adam(t3.parameters(), lr=1e-3)), a.iters)
    out["zero3"] = (statistics.median(ta), statistics.median(tb), full_params_diff(f3.full_tensors(), t3),
                    len(f3.units))
    return out if r == 0 else None


def _quiet():
    import warnings  # torch's FSDP2 / DTensor warn about views and scalars on every step; not ours
    warnings.filterwarnings("ignore", category=UserWarning)


def _worker_3d(ctx, a):
    _quiet()
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B as TorchSchedule
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ..grid import ProcessGrid
    from ..parallel import ParallelGPT
    from ..pipeline.stages import split_gpt

    t, p, d, M = a.tp, a.pp, a.dp3, a.microbatches
    cfg = GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq)
    ref = GPT(cfg, seed=0)
    B = a.batch * d
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (B, a.seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, a.seq), generator=g)
    # labkit
    grid = ProcessGrid.build(ctx, tp=t, pp=p, dp=d)
    lk = ParallelGPT(ref, grid, "1f1b", M, bucket_cap_mb=a.bucket_cap_mb)
    lk_opt = lk.make_optimizer("sgd", 0.01)
    lk_loss = []

    def lk_step(i):
        lk.zero_grad()
        loss = lk.train_step(x, y)
        lk_opt.step()
        lk_loss.append(loss)
    # torch
    mesh = init_device_mesh("cpu", (p, d, t), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stage = split_gpt(ref, p, [pp_rank])[0]
    plan = {}
    if stage.embedding is not None:
        plan["embedding.wte"] = RowwiseParallel(input_layouts=Replicate())
    if stage.head is not None:
        plan["head.lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i, block in enumerate(stage.blocks):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.out_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
        block.attn.n_head //= t          # the module reshapes by its local head counts
        block.attn.n_kv_head //= t
    if t > 1:
        stage = parallelize_module(stage, mesh["tp"], plan)
    if d > 1:
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
    sched = TorchSchedule(TorchStage(stage, pp_rank, p, torch.device("cpu"), group=mesh["pp"].get_group()), M,
                          loss_fn=lambda out, tgt: F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1)))
    th_opt = torch.optim.SGD(stage.parameters(), lr=0.01)
    th_loss = []
    dp_mesh = Mesh(dp=d)                       # this DP rank's a.batch sequences of the d * a.batch
    xs, ys = dp_mesh.shard(x, "dp", dp_rank), dp_mesh.shard(y, "dp", dp_rank)

    def th_step(i):
        th_opt.zero_grad()
        losses = []
        if pp_rank == 0 and p > 1:
            sched.step(xs)
        elif pp_rank == p - 1 and p > 1:
            sched.step(target=ys, losses=losses)
        else:
            sched.step(xs, target=ys, losses=losses)
        th_opt.step()
        if losses:
            th_loss.append(float(sum(float(v.detach()) for v in losses) / len(losses)))
    ta, tb = _pairs(lk_step, th_step, a.iters3d, warmup=2)
    last = lk.has_last_stage and grid.dp_rank == 0 and grid.tp_rank == 0
    if th_loss and d > 1:      # labkit reports the step's loss (over the d ranks): torch's DP ranks' mean
        mean = torch.tensor(th_loss[0], dtype=torch.float64)
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        th_loss[0] = float(mean) / d
    return (statistics.median(ta), statistics.median(tb), abs(lk_loss[0] - th_loss[0])) if last else None


def parse_args(argv):
    from ..labs import HelpFormatter
    p = Parser(prog="python -m labkit bench dp", formatter_class=HelpFormatter,
               description="labkit DDP and ZeRO-1/2/3 against torch's (DDP, ZeroRedundancyOptimizer, FSDP2), "
                        "side by side.")
    p.add_argument("--dp", "--world-size", dest="dp", type=int, default=2, help="data-parallel ranks d")
    p.add_argument("--iters", type=int, default=15, help="timed steps of each side")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="bucket size of both DDPs (MiB)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks L")
    p.add_argument("--embd", type=int, default=64, help="hidden size H")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per (DP) rank")
    p.add_argument("--tp", type=int, default=2, help="3D comparison: t")
    p.add_argument("--pp", type=int, default=2, help="3D comparison: p")
    p.add_argument("--dp3", type=int, default=2, help="3D comparison: d")
    p.add_argument("--microbatches", type=int, default=4, help="3D comparison: M per DP rank")
    p.add_argument("--iters3d", type=int, default=5, help="timed steps of each side in the 3D comparison (0: skip it)")
    for opt in ("--tp", "--pp", "--dp3", "--microbatches"):   # the one rule: labkit.cliparse.Parser.needs
        p.needs(opt, lambda a: a.iters3d > 0, "the 3D comparison (got --iters3d {iters3d}, which skips it)",
                "--iters3d > 0")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from ..labs import error
    a = parse_args(sys.argv[1:] if argv is None else argv)
    from ..cliparse import too_small
    bad = too_small(("--dp", a.dp, 1), ("--iters", a.iters, 1), ("--layers", a.layers, 1), ("--embd", a.embd, 1),
                    ("--heads", a.heads, 1), ("--seq", a.seq, 1), ("--batch", a.batch, 1),
                    ("--iters3d", a.iters3d, 0))
    if bad:
        return error(bad)
    if a.iters3d:
        bad = too_small(("--tp", a.tp, 1), ("--pp", a.pp, 1), ("--dp3", a.dp3, 1),
                        ("--microbatches", a.microbatches, 1))
        if bad:
            return error(bad)
    if a.dp < 2:
        return error(f"--dp must be >= 2 (data parallelism needs two ranks), got {a.dp}")
    if not (a.bucket_cap_mb > 0 and math.isfinite(a.bucket_cap_mb)):
        return error(f"--bucket-cap-mb must be a finite number > 0, got {a.bucket_cap_mb}")
    if a.embd % a.heads:
        return error(f"--embd {a.embd} must be divisible by --heads {a.heads}")
    if a.iters3d:
        from ..parallel import check_layout
        try:
            check_layout(GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq),
                         a.tp * a.pp * a.dp3, a.tp, a.pp, a.dp3, 1, a.microbatches, a.batch * a.dp3)
        except ValueError as e:
            return error(str(e))
    res = launch(_worker, a.dp, a, backend="gloo", timeout=300)[0]
    res3 = None
    if a.iters3d:
        res3 = next(r for r in launch(_worker_3d, a.tp * a.pp * a.dp3, a, backend="gloo", timeout=300)
                    if r is not None)
    print(f"GPT L={a.layers} H={a.embd} S={a.seq}, {a.batch} sequences per rank, d={a.dp} gloo ranks, "
          f"buckets of {a.bucket_cap_mb:g} MiB; median of {a.iters} alternating steps")
    head = f"{'':<34}{'labkit s':>10}{'torch s':>10}{'ratio':>8}{'max |dparam|':>14}"
    print(head)
    print("-" * len(head))
    for key, name in (("ddp", f"DDP, SGD ({res['ddp'][3]} buckets)"), ("zero", "ZeRO-1, Adam"),
                      ("zero2", f"ZeRO-2, Adam ({res['zero2'][3]} buckets)"),
                      ("zero3", f"ZeRO-3 / FSDP, Adam ({res['zero3'][3]} units)")):
        lk, th, diff, _ = res[key]
        print(f"{name:<34}{lk:>10.4f}{th:>10.4f}{lk / th:>8.2f}{diff:>14.1e}")
    if res3 is not None:
        lk, th, dloss = res3
        print(f"{f'3D t{a.tp} p{a.pp} d{a.dp3} 1F1B M={a.microbatches}':<34}{lk:>10.4f}{th:>10.4f}{lk / th:>8.2f}"
              f"{dloss:>14.1e}  (|dloss| of step 1; median of {a.iters3d})")
    print("ratio = labkit / torch (below 1: labkit faster). torch's ZeRO runs on top of torch's DDP "
          "(all-reduce + broadcast of whole parameters); labkit's reduce-scatters and all-gathers one flat buffer. "
          "ZeRO-2/3: torch = FSDP2 fully_shard per unit (reshard_after_forward False / True); max |dparam| "
          "compares the full parameters.")
    if res3 is not None:
        print("3D: torch = DeviceMesh + parallelize_module inside torch.distributed.pipelining stages + FSDP2 "
              "(reshard_after_forward=False) over dp; labkit = labkit.parallel.ParallelGPT with DDP.")
    return 0


if __name__ == "__main__":
    from ..labs import run_cli
    sys.exit(run_cli(main))
