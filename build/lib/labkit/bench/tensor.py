"""Benchmark: labkit's tensor parallelism against PyTorch's own, side by side.

    python -m labkit bench tensor [--tp 2] [--iters 20] [--n-embd 128] ...

Both run on the same gloo ranks, the same reference weights and the same input:

* labkit: :class:`labkit.tensor_parallel.ParallelBlock` / :class:`TensorParallelGPT`
  (vocab-parallel embedding and cross-entropy);
* PyTorch: ``torch.distributed.tensor.parallel.parallelize_module`` on a copy of the
  reference module over ``DeviceMesh("cpu", ...)``: ``ColwiseParallel`` for q/k/v and
  A (fc1), ``RowwiseParallel`` for the attention output and B (fc2), ``RowwiseParallel``
  on the token embedding (vocab-parallel), ``ColwiseParallel`` (sharded output) on the output
  layer and ``loss_parallel`` for the cross-entropy.

Printed: median seconds per training step (forward + backward) of each, the ratio
labkit / PyTorch (below 1: labkit faster), and the loss of each (they must agree).
"""
from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F

from ..cliparse import Parser
from ..dist import launch
from ..model import GPT, GPTConfig
from ..tensor_parallel import ParallelBlock, TensorParallelGPT
from . import median_time


def _torch_tp_gpt(ref: GPT, mesh, t: int):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = copy.deepcopy(ref)
    plan = {"embedding.wte": RowwiseParallel(input_layouts=Replicate()),
            "head.lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.out_proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
        # the module reshapes by its head counts: they become the local ones (PyTorch's TP tutorial does this)
        block.attn.n_head //= t
        block.attn.n_kv_head //= t
    return parallelize_module(model, mesh, plan)


def _torch_tp_block(ref_block, mesh, t: int):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    block = copy.deepcopy(ref_block)
    block.attn.n_head //= t
    block.attn.n_kv_head //= t
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.out_proj": RowwiseParallel(), "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    return parallelize_module(block, mesh, plan)


def _worker(ctx, args):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import loss_parallel

    t, g = ctx.world_size, ctx.group
    mesh = DeviceMesh("cpu", list(range(t)))
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq_len)
    ref = GPT(cfg, seed=0)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
    tgt = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len), generator=gen)
    x = torch.randn(args.batch_size, args.seq_len, cfg.n_embd, generator=gen, requires_grad=True)
    results = {}

    # one transformer block
    ours_b, theirs_b = ParallelBlock(ref.blocks[0], g), _torch_tp_block(ref.blocks[0], mesh, t)

    def block_step(m):
        def step():
            m.zero_grad(set_to_none=True)
            y = m(x)
            y.square().mean().backward()
            return y.detach().square().mean().item()
        return step

    for name, m in (("labkit", ours_b), ("pytorch", theirs_b)):
        results[("block", name)] = median_time(block_step(m), args.iters, args.warmup)

    # the whole GPT with vocab-parallel embedding and loss
    ours, theirs = TensorParallelGPT.from_reference(ref, g), _torch_tp_gpt(ref, mesh, t)

    def ours_step():
        ours.zero_grad(set_to_none=True)
        loss = ours(idx, tgt)
        loss.backward()
        return loss.item()

    def theirs_step():
        theirs.zero_grad(set_to_none=True)
        logits = theirs(idx)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten())
            loss.backward()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    results[("gpt", "labkit")] = median_time(ours_step, args.iters, args.warmup)
    results[("gpt", "pytorch")] = median_time(theirs_step, args.iters, args.warmup)
    results[("gpt", "reference loss")] = (float("nan"), ref(idx, tgt).item())
    return results


def parse_args(argv):
    p = Parser(prog="python -m labkit bench tensor", description=__doc__.split("\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", "--world-size", dest="tp", type=int, default=2, help="TP degree t (gloo ranks)")
    p.add_argument("--iters", type=int, default=20, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step B")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence S")
    p.add_argument("--n-layer", type=int, default=2, help="transformer blocks L")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=128, help="hidden size H")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.n_head % args.tp or 256 % args.tp:
        print(f"error: --tp {args.tp} must divide n_head={args.n_head} and the vocabulary (256)", file=sys.stderr)
        return 2
    res = launch(_worker, args.tp, args, backend="gloo", timeout=120)[0]
    print(f"Tensor parallelism on {args.tp} gloo CPU ranks: labkit vs torch.distributed.tensor.parallel "
          f"(L={args.n_layer}, H={args.n_embd}, heads={args.n_head}, batch {args.batch_size}x{args.seq_len}); "
          f"median of {args.iters} steps (forward + backward)")
    print(f"{'what':<34}{'labkit ms':>11}{'PyTorch ms':>12}{'ratio':>8}")
    for what, label in (("block", "one transformer block"), ("gpt", "GPT step (embedding..loss)")):
        a, b = res[(what, "labkit")][0], res[(what, "pytorch")][0]
        print(f"{label:<34}{a * 1e3:>11.2f}{b * 1e3:>12.2f}{a / b:>8.2f}")
    la, lb, lr = res[("gpt", "labkit")][1], res[("gpt", "pytorch")][1], res[("gpt", "reference loss")][1]
    print(f"loss: labkit {la:.6f}, PyTorch {lb:.6f}, single device {lr:.6f}")
    print("ratio = labkit / PyTorch (below 1: labkit faster)")
    if abs(la - lr) > 1e-4 or abs(lb - lr) > 1e-4:
        print("FAIL: the losses differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
