"""Lab: train the GPT with Megatron-LM tensor parallelism and prove it equals one device.

    python -m labkit lab tensor [--tp 2 4] [--steps N] [--data PATH] [--backend auto|gloo|nccl]
    torchrun --nproc-per-node N -m labkit.labs.tensor [--steps N]

For each TP degree t the GPT is built from the same reference weights (same seed), each
rank keeps its shard (:class:`labkit.tensor_parallel.TensorParallelGPT`) and trains on the
same batches as a single-device run. Printed per run: final training loss, the largest
gap between the two loss curves (separate trainings: shown, not judged), the verdict of
:mod:`labkit.labs.verdict` (at every step, loss and every gradient against the single-device
model at the same parameters; exit status 1 when it fails), counted all-reduces and bytes per step next to the formula
(Megatron-LM sec. 3: 2 all-reduces per layer forward and 2 backward, plus embedding,
output layer and the 3 small ones of the vocab-parallel cross-entropy), and tokens per
second. The loss curves are saved as a PNG under a run folder whose path is printed.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..cliparse import Parser
from ..comm import CommLog
from ..data import Corpus
from ..grid import ProcessGrid
from ..model import GPT, GPTConfig
from ..plan.comm import comm_per_rank
from ..plan.spec import Layout, ModelSpec
from ..tensor_parallel import TensorParallelGPT
from . import (
    HelpFormatter,
    bad_lr,
    bad_memory,
    bad_number,
    bad_out,
    bad_seed,
    is_main_rank,
    run_folder,
    save_figure,
    write_bytes_atomic,
)
from .harness import Lab, Launch, Reference, Report, add_shared_options, lockstep, run, train_reference
from .verdict import sharded_pieces


def _config(args) -> GPTConfig:
    return GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.seq_len)


@dataclass
class RankResult:
    """One TP rank's training: ``losses`` per step; ``comm``: ``{kind: (count, bytes)}`` counted by
    :class:`labkit.comm.CommLog` over all steps; ``seconds``: wall time of steps 1.. (NaN with one
    step); ``verdict``: rank 0's :class:`labkit.labs.verdict.LockstepResult` (None elsewhere)."""
    losses: list
    comm: dict
    seconds: float
    verdict: object = None


def _tp_worker(ctx, args, corpus) -> RankResult:
    grid = ProcessGrid.build(ctx, tp=ctx.world_size)
    torch.manual_seed(args.seed)
    cfg = _config(args)
    model = TensorParallelGPT.from_reference(GPT(cfg, seed=args.seed), grid.tp_group).to(ctx.device)

    def batch(step):
        x, y = corpus.get_batch("train", args.batch_size, args.seq_len, step=step, seed=args.seed)
        return x.to(ctx.device), y.to(ctx.device)

    check = lockstep(ctx, args, lambda: GPT(cfg, seed=args.seed), lambda m, step, extras: m(*batch(step)))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses, log, seconds = [], CommLog(), 0.0
    # rank 0 only, and only on a terminal (disable=None: tqdm turns itself off when stderr is not a TTY)
    bar = tqdm(range(args.steps), desc=f"TP={ctx.world_size}", unit="step", file=sys.stderr, leave=False,
               dynamic_ncols=True, disable=None if ctx.rank == 0 else True)
    for step in bar:
        t0 = time.perf_counter()
        with log:
            loss = model(*batch(step))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        elapsed = time.perf_counter() - t0
        # the verdict: every rank's shards and their gradients, at the parameters they came from (not timed)
        check.step(step, sharded_pieces(model, grid.tp_rank, grid.tp), loss)
        t0 = time.perf_counter()
        with log:
            opt.step()
        if step > 0:  # step 0 is warm-up, not timed
            seconds += elapsed + time.perf_counter() - t0
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    counts = {kind: (log.count(kind), log.bytes(kind)) for kind in sorted({r.kind for r in log.records})}
    return RankResult(losses, counts, seconds if args.steps > 1 else float("nan"), check.result())


def _reference(args, corpus) -> Reference:
    """The same training on one device (one CPU thread, like each rank, so tokens/s compare)."""
    torch.manual_seed(args.seed)
    return train_reference(
        GPT(_config(args), seed=args.seed), args.steps,
        lambda m, step: m(*corpus.get_batch("train", args.batch_size, args.seq_len, step=step, seed=args.seed)),
        args.lr, progress="single device")


def _plot(curves: dict, path: Path):
    """Save the loss curves (x: step 0, 1, ..., as in losses.csv) to ``path``; returns the Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, losses) in enumerate(curves.items()):
        ax.plot(range(len(losses)), losses, label=name, linestyle=["-", "--", ":", "-."][i % 4])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("Tensor parallelism vs one device: same loss curve")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    return fig


def _parser():
    p = Parser(prog="python -m labkit lab tensor", description=__doc__.split("\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("--tp", "--world-size", dest="tp", type=int, nargs="+", default=None,
                   help="tensor-parallel degrees t to run (unset: 2 4; under torchrun always WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=100, help="training steps (Adam)")
    p.add_argument("--batch-size", "--batch", dest="batch_size", type=int, default=8, help="sequences per step B")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=64, help="tokens per sequence S")
    p.add_argument("--n-layer", "--layers", dest="n_layer", type=int, default=2, help="transformer blocks L")
    p.add_argument("--n-head", "--heads", dest="n_head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", "--embd", dest="n_embd", type=int, default=64, help="hidden size H")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    add_shared_options(p, out=("--runs-dir", "--out"), out_dest="runs_dir", plots=True)
    return p


def parse_args(argv):
    return _parser().parse_args(argv)


def _bad_args(args, degrees) -> str | None:
    """The first rule the options break, as a message naming the values; None if all are fine."""
    for flag, value in (("--steps", args.steps), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                        ("--n-layer", args.n_layer), ("--n-head", args.n_head), ("--n-embd", args.n_embd)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    bad = (bad_lr(args.lr) or bad_number("--tolerance", args.tolerance) or bad_seed(args.seed)
           or bad_out(args.runs_dir, "--out"))
    if bad:
        return bad
    try:
        cfg = _config(args)
    except ValueError as e:  # e.g. n_embd=64 must be divisible by n_head=3
        return f"{e} (--n-embd {args.n_embd}, --n-head {args.n_head})"
    for t in degrees:
        if t < 1:
            return f"TP degree t={t} must be >= 1 (--tp {' '.join(map(str, degrees))})"
        for what, n in (("vocab_size", cfg.vocab_size), ("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head),
                        ("ffn width", cfg.ffn_mult * cfg.n_embd)):
            if n % t:
                return f"TP degree t={t} must divide {what}={n}"
    t = max(degrees)                                  # the largest run, as the planner counts it
    spec = ModelSpec.from_gpt_config(cfg, seq_len=args.seq_len, global_batch=args.batch_size)
    return bad_memory(spec, Layout(t=t, b=args.batch_size, M=1, precision="fp32"),
                      f"--n-layer {cfg.n_layer} --n-embd {cfg.n_embd} --seq-len {args.seq_len} "
                      f"--batch-size {args.batch_size} (t={t})")



class TensorLab(Lab):
    """``python -m labkit lab tensor``: one run per TP degree t."""
    name = "tensor"

    def parser(self):
        return _parser()

    def resolve(self, args, world):
        if world is not None:
            if args.tp not in (None, [world]) and is_main_rank():
                print(f"note: --tp {' '.join(map(str, args.tp))} ignored under torchrun: t = WORLD_SIZE = {world}",
                      file=sys.stderr)
            args.tp = [world]
        elif args.tp is None:
            args.tp = [2, 4]
        return None

    def check(self, args):  # bad sizes: a clear message before any process starts
        return _bad_args(args, args.tp)

    def load_corpus(self, args):
        return Corpus.load(args.data, block_size=args.seq_len)

    def runs(self, args, corpus):
        return [Launch(f"TP={t}", t, _tp_worker, (args, corpus)) for t in args.tp]

    def reference(self, args, corpus):
        return _reference(args, corpus)

    def report(self, args, outcome):
        cfg = _config(args)
        single = outcome.reference
        runs = {name: ranks[0] for name, ranks in outcome.results.items()}
        tokens = args.batch_size * args.seq_len
        spec = ModelSpec.from_gpt_config(cfg, seq_len=args.seq_len, global_batch=args.batch_size)

        def expected(t):          # the planner's all-reduces (count, bytes) of one step; t=1 communicates nothing
            lay = Layout(t=t, b=args.batch_size, M=1, precision="fp32")
            return comm_per_rank(spec, lay, act_bytes=4)["tp"].ops.get("all_reduce", (0, 0))
        print(f"\nTensor-parallel GPT (L={cfg.n_layer}, H={cfg.n_embd}, heads={cfg.n_head}, V={cfg.vocab_size}), "
              f"{args.steps} Adam steps of {args.batch_size}x{args.seq_len} tokens, seed {args.seed}")
        header = (f"{'run':<14}{'final loss':>11}{'max |dloss|':>13}{'all-reduces/step':>18}{'(formula)':>10}"
                  f"{'MiB/step':>10}{'(formula)':>10}{'tokens/s':>10}")
        print(header)
        print("-" * len(header))
        timed = args.steps - 1  # step 0 is warm-up; with --steps 1 there is no timed step (tokens/s nan)

        def tok_s(seconds):
            return tokens * timed / seconds if timed else float("nan")
        print(f"{'single device':<14}{single.losses[-1]:>11.4f}{'-':>13}{'-':>18}{'-':>10}{'-':>10}{'-':>10}"
              f"{tok_s(single.seconds):>10.0f}")
        comm_ok = True
        for name, r in runs.items():
            gap = max(abs(a - b) for a, b in zip(r.losses, single.losses))
            n_ar, b_ar = r.comm.get("all_reduce", (0, 0))
            e = expected(int(name.split("=")[1]))
            print(f"{name:<14}{r.losses[-1]:>11.4f}{gap:>13.2e}{n_ar / args.steps:>18.1f}{e[0]:>10d}"
                  f"{b_ar / args.steps / 2**20:>10.3f}{e[1] / 2**20:>10.3f}{tok_s(r.seconds):>10.0f}")
            comm_ok = comm_ok and (n_ar, b_ar) == (e[0] * args.steps, e[1] * args.steps)
        print(f"\nformula per step: forward 2L+1 = {2 * cfg.n_layer + 1} all-reduces of B*S*H and 3 of B*S "
              f"(cross-entropy), backward 2L+1 = {2 * cfg.n_layer + 1} of B*S*H (bytes = payload per rank; a ring "
              f"moves 2(t-1)/t of it; t=1 communicates nothing). max |dloss|: largest gap between the two separate "
              f"trainings' loss curves (shown, not judged). Every rank ran on one CPU thread.")
        failures = [] if comm_ok else ["FAIL: the counted all-reduces differ from the formula (table above)"]
        return Report({name: r.verdict for name, r in runs.items()}, failures)

    def folder(self, args):
        return run_folder(args.runs_dir, "tensor")

    def files(self, args, outcome, folder):
        curves = {"single device": outcome.reference.losses,
                  **{n: ranks[0].losses for n, ranks in outcome.results.items()}}
        rows = ["step," + ",".join(curves)] + [f"{i}," + ",".join(f"{c[i]:.7f}" for c in curves.values())
                                              for i in range(args.steps)]
        write_bytes_atomic(folder / "losses.csv", ("\n".join(rows) + "\n").encode())
        if args.no_plots:
            print(f"losses: {folder / 'losses.csv'}")
        else:
            _plot(curves, folder / "loss_curves.png")
            print(f"plots: {folder / 'loss_curves.png'}, {folder / 'losses.csv'}")


LAB = TensorLab()


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit lab tensor``: the exit code (see :func:`labkit.labs.harness.run`)."""
    return run(LAB, argv).rc


if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
