"""Lab: train the MoE GPT with expert parallelism and watch the experts' loads.

    python -m labkit lab moe [--ep 4] [--steps 60] [--balance-steps 150] [--out DIR]
    python -m labkit lab moe --eplb [--gpus-per-node 2]     (EPLB replicas: see labkit.labs.moe_eplb)
    torchrun --nproc-per-node 4 -m labkit.labs.moe

1. Trains the MoE GPT (labkit.moe.model) on the default corpus with EP = P ranks (CPU
   processes, or one GPU per rank under torchrun) and once on a single device with the same
   weights and data (the reference routes the global batch in P groups, the capacity rule of
   EP). The verdict (labkit.labs.verdict, exit code 1 when it fails): at every step the EP
   run's loss and every gradient against the single-device model's at the same parameters,
   with the EP run's routing replayed in the reference (a choice that differs from the
   reference's own must be a near-tie, scores within TIE), so a flipped top-k choice at a
   tie cannot fail a correct run and a routing bug still does.
2. Counts the all-to-all bytes of each MoE layer (labkit.comm.CommLog) next to the formula:
   counts E*8 bytes; dispatch N_p*H*4 bytes (N_p = kept slots of rank p; combine the same in total).
3. Trains three times on one device: no balancing (watch the routing collapse onto a few
   experts), the Switch auxiliary loss, DeepSeek-V3's aux-loss-free bias; prints the
   imbalance MaxVio = max_i load_i / mean load - 1 (Wang et al. 2024) and plots the load of
   every expert in every MoE layer, the dropped-token fraction and the balance loss.
PNGs go to a run folder (printed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ..cliparse import Parser
from ..comm import CommLog
from ..data import Corpus
from ..dist import in_torchrun, launch
from ..model import GPTConfig
from ..moe.expert_parallel import all_reduce_loads, sync_replicated_grads, to_expert_parallel
from ..moe.losses import switch_aux_loss
from ..moe.model import MoEGPT, moe_config_for, total_aux_loss
from . import (
    HelpFormatter,
    bad_lr,
    bad_memory,
    bad_number,
    bad_out,
    bad_seed,
    error,
    is_main_rank,
    moe_eplb,
    out_folder,
)
from .replay import replayed_routing
from .verdict import add_tolerance_option, verdict_exit

BALANCE_MODES = ("none", "aux", "aux_free")
SMOOTH = 10  # steps of the moving average in expert_load.png


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m labkit lab moe", description=__doc__.split("\n")[0],
               formatter_class=HelpFormatter)
    p.add_argument("--ep", "--world-size", dest="ep", type=int, default=None,
                   help="expert-parallel ranks P (unset: 4; under torchrun always WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=40, help="steps of the EP vs single-device comparison")
    p.add_argument("--balance-steps", type=int, default=150, help="steps of each balancing run")
    p.add_argument("--experts", type=int, default=8, help="routed experts E")
    p.add_argument("--top-k", type=int, default=2, help="experts k activated per token")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="expert capacity C = factor * k * T / E")
    p.add_argument("--n-layer", "--layers", dest="n_layer", type=int, default=4, help="transformer blocks L")
    p.add_argument("--moe-every", type=int, default=2, help="1: every block is MoE; 2: every other (GShard)")
    p.add_argument("--n-embd", "--embd", dest="n_embd", type=int, default=64, help="hidden size H")
    p.add_argument("--n-head", "--heads", dest="n_head", type=int, default=4, help="attention heads")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), divisible by P")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--aux-coeff", type=float, default=0.1,
                   help="Switch aux loss alpha (Switch used 1e-2 over long runs; a 150-step run needs more)")
    p.add_argument("--gamma", type=float, default=1e-2, help="aux-loss-free bias update speed")
    p.add_argument("--compare-mode", default="aux_free", choices=BALANCE_MODES,
                   help="balancing used in the EP vs single-device comparison")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    p.add_argument("--data", default=None, help="text file or folder (unset: the Python standard library)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help="torch.distributed backend")
    p.add_argument("--out", default=None, help="run folder (unset: runs/moe-<time>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    add_tolerance_option(p)
    moe_eplb.add_arguments(p)
    return p


def _configs(a, balance: str, groups: int):
    cfg = GPTConfig(block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, ffn_mult=2)
    moe = moe_config_for(cfg, n_routed_experts=a.experts, n_activated_experts=a.top_k,
                         capacity_factor=a.capacity_factor, token_groups=groups,
                         aux_loss_coeff=a.aux_coeff if balance == "aux" else 0.0,
                         expert_bias=balance == "aux_free", bias_update_rate=a.gamma)
    return cfg, moe


def _bad_args(a) -> str | None:
    """The first rule the options break, as a message naming the values; None if all are fine."""
    for flag, value in (("--ep", a.ep), ("--steps", a.steps), ("--balance-steps", a.balance_steps),
                        ("--experts", a.experts), ("--n-layer", a.n_layer), ("--moe-every", a.moe_every),
                        ("--n-embd", a.n_embd), ("--n-head", a.n_head), ("--seq", a.seq), ("--batch", a.batch)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if not 1 <= a.top_k <= a.experts:
        return f"--top-k {a.top_k} must be in [1, --experts {a.experts}]"
    if a.moe_every > a.n_layer:
        return f"--moe-every {a.moe_every} > --n-layer {a.n_layer} leaves no MoE layer"
    bad = (bad_number("--capacity-factor", a.capacity_factor) or bad_lr(a.lr)
           or bad_number("--aux-coeff", a.aux_coeff, strict=False) or bad_number("--gamma", a.gamma, strict=False)
           or bad_number("--tolerance", a.tolerance) or bad_seed(a.seed) or bad_out(a.out))
    if bad:
        return bad
    if a.batch % a.ep:
        return f"--batch {a.batch} must be divisible by --ep {a.ep} (each rank gets batch/P sequences)"
    if a.experts % a.ep:
        return f"--experts {a.experts} must be divisible by --ep {a.ep} (each rank holds E/P experts)"
    try:
        for mode in BALANCE_MODES:
            cfg, moe = _configs(a, mode, a.ep)
    except ValueError as e:  # e.g. n_embd=64 must be divisible by n_head=3
        return f"{e} (--n-embd {a.n_embd}, --n-head {a.n_head})"
    from dataclasses import replace

    from ..plan.spec import Layout, ModelSpec
    # the planner's bytes: EP folded onto the P data-parallel ranks
    spec = replace(ModelSpec.from_gpt_config(cfg, seq_len=a.seq, global_batch=a.batch), n_routed_experts=a.experts,
                   n_activated_experts=a.top_k, moe_ffn=moe.moe_ffn_dim, moe_layer_freq=a.moe_every)
    return bad_memory(spec, Layout(d=a.ep, ep=a.ep, b=a.batch // a.ep, M=1, precision="fp32"),
                      f"--experts {a.experts} --n-embd {a.n_embd} --n-layer {a.n_layer} --seq {a.seq} "
                      f"--batch {a.batch} (P={a.ep})")


def _global_name(name: str, rank: int, n_local: int) -> str:
    """An EP rank's parameter name in the single-device model: local expert i -> rank*E/P + i."""
    if ".experts." not in name:
        return name
    head, tail = name.split(".experts.")
    i, rest = tail.split(".", 1)
    return f"{head}.experts.{rank * n_local + int(i)}.{rest}"


def _lockstep(ctx, a, balance: str, corpus):
    """The verdict's Lockstep of an EP run (rank 0 holds the single-device reference)."""
    from .verdict import Lockstep
    ref = None
    if ctx.rank == 0:
        cfg, moe = _configs(a, balance, ctx.world_size)
        ref = MoEGPT(cfg, moe, a.moe_every, seed=a.seed).to(ctx.device)

    def ref_loss(model, step, extras):
        x, y = (t.to(ctx.device) for t in corpus.get_batch("train", a.batch, a.seq, step, a.seed))
        problems: list = []
        undo = replayed_routing(model, extras, problems)
        try:
            lm, stats = model(x, y)
        finally:
            undo()
        return lm + total_aux_loss(stats).to(ctx.device), "; ".join(dict.fromkeys(problems)) or None
    return Lockstep(ctx.group, ctx.rank, ref, ref_loss, rtol=a.tolerance, atol=a.tolerance / 10)


def train(ctx, a, balance: str, steps: int, ep: bool, progress: bool = True) -> dict:
    """One training run. ``ep=True``: this rank of an EP run over ``ctx.group``, judged at every
    step by the verdict (:mod:`labkit.labs.verdict`, rank 0's ``hist["verdict"]``); else single
    device (routing in ``a.ep`` token groups, like the EP run). Returns per-step histories."""
    from tqdm.auto import tqdm

    from .verdict import module_pieces

    P = ctx.world_size if ep else 1
    rank = ctx.rank if ep else 0
    device = ctx.device if ctx is not None else torch.device("cpu")
    cfg, moe = _configs(a, balance, 1 if ep else a.ep)
    model = MoEGPT(cfg, moe, a.moe_every, seed=a.seed)
    if ep:
        to_expert_parallel(model, ctx.group, rank, P)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=True)
    corpus = Corpus.load(a.data)
    check = _lockstep(ctx, a, balance, corpus) if ep else None
    rows = a.batch // P
    hist = {"loss": [], "lm": [], "loads": [], "dropped": [], "balance": [], "bytes": []}
    # disable=None: no bar when stderr is not a terminal (logs); else one bar (rank 0) cleared when done
    bar = tqdm(range(steps), desc=f"{'EP=%d' % P if ep else 'single'} {balance}", disable=None if progress else True,
               leave=False, file=sys.stderr)
    for step in bar:
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        x, y = x[rank * rows:(rank + 1) * rows].to(device), y[rank * rows:(rank + 1) * rows].to(device)
        with CommLog() as fwd_log:
            lm, stats = model(x, y)
        aux = total_aux_loss(stats).to(device)
        with CommLog() as bwd_log:
            ((lm + aux) / P).backward()
        if ep:
            sync_replicated_grads(model, ctx.group)
            n_local = a.experts // P
            check.step(step, module_pieces(model, lambda n: _global_name(n, rank, n_local)), (lm + aux).item(),
                       extra=[(s.router.indices.cpu(), s.router.keep.cpu()) for s in stats])
        loads = torch.stack([s.tokens_per_expert for s in stats])              # [L_moe, E]
        if ep:
            loads = all_reduce_loads(loads, ctx.group)
        for layer, load in zip(model.moe_layers(), loads):
            layer.update_bias(load)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            diag = [float(switch_aux_loss(s.router.logits.float(), s.router.indices, 1.0, from_logits=True))
                    for s in stats]
        a2a_f = [r.nbytes for r in fwd_log.of("all_to_all")]
        hist["loss"].append((lm + aux).item())
        hist["lm"].append(lm.item())
        hist["loads"].append(loads.cpu())
        hist["dropped"].append([s.dropped_fraction for s in stats])
        hist["balance"].append(diag)
        hist["bytes"].append({"forward": a2a_f, "backward": [r.nbytes for r in bwd_log.of("all_to_all")]})
        bar.set_postfix(loss=f"{hist['lm'][-1]:.3f}")
    hist["params"] = {n: p.detach().cpu() for n, p in model.state_dict().items()}
    hist["verdict"] = check.result() if ep else None
    return hist


def _ep_worker(ctx, a):
    return train(ctx, a, a.compare_mode, a.steps, ep=True, progress=ctx.rank == 0)


def max_vio(loads: torch.Tensor) -> float:
    """MaxVio = max_i load_i / mean(load) - 1 (Wang et al. 2024, "Auxiliary-loss-free load balancing")."""
    loads = loads.float()
    return float(loads.max() / loads.mean() - 1)


def _plots(out, runs, ep_hist, a):
    import matplotlib

    from . import save_figure
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # expert_load.png: share of the token-slots of every expert, moving average over SMOOTH steps
    # (loads summed over the window, then normalised), stacked so the bands add up to 1; the
    # dotted lines mark the uniform split 1/E, 2/E, ... A collapse shows as a few wide bands.
    n_moe = len(runs["none"]["loads"][0])
    E = a.experts
    window = min(SMOOTH, len(runs["none"]["loads"]))
    titles = {"none": "no balancing", "aux": f"Switch aux loss (alpha={a.aux_coeff:g})",
              "aux_free": f"aux-loss-free bias (gamma={a.gamma:g})"}
    colors = plt.get_cmap("tab10" if E <= 10 else "tab20")
    fig, axes = plt.subplots(len(runs), n_moe, figsize=(4.8 * n_moe, 2.9 * len(runs) + 0.8), squeeze=False,
                             sharex=True, sharey=True, layout="constrained")
    for i, (mode, h) in enumerate(runs.items()):
        loads = torch.stack(h["loads"]).double()                                 # [steps, L, E]
        csum = torch.cat([torch.zeros_like(loads[:1]), loads.cumsum(0)])
        start = (torch.arange(len(loads)) + 1 - window).clamp(min=0)
        smooth = csum[1:] - csum[start]                                          # trailing window sums
        frac = smooth / smooth.sum(-1, keepdim=True)
        last = torch.stack(h["loads"][-window:]).sum(0).float()                  # [L, E]
        for layer in range(n_moe):
            ax = axes[i][layer]
            ax.stackplot(range(1, len(frac) + 1), frac[:, layer].T.numpy(),
                         colors=[colors(e % colors.N) for e in range(E)], labels=[f"expert {e}" for e in range(E)])
            for j in range(1, E):
                ax.axhline(j / E, color="white", linewidth=0.6, linestyle=":")
            ax.set_title(f"{titles[mode]}\nMoE layer {layer}: MaxVio {max_vio(last[layer]):.2f} "
                         f"(last {window} steps)", fontsize=10)
            ax.set_ylim(0, 1)
            ax.set_xlim(1, len(frac))
            if layer == 0:
                ax.set_ylabel("share of token-slots")
            if i == len(runs) - 1:
                ax.set_xlabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"Expert load per MoE layer ({window}-step moving average; dotted lines: uniform 1/E, E={E})",
                 fontsize=11)
    fig.legend(handles, labels, loc="outside lower center", ncol=min(E, 8), fontsize=9, frameon=False)
    save_figure(fig, os.path.join(out, "expert_load.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(1, 3, figsize=(14, 3.5))
    for mode, h in runs.items():
        ax[0].plot([sum(d) / len(d) for d in h["dropped"]], label=mode)
        ax[1].plot([sum(b) / len(b) for b in h["balance"]], label=mode)
        ax[2].plot(h["lm"], label=mode)
    ax[0].set_title(f"dropped fraction (capacity factor {a.capacity_factor})")
    ax[1].set_title("balance loss E*sum f_i P_i (1 = uniform)")
    ax[2].set_title("LM loss (nats/token)")
    for x in ax:
        x.set_xlabel("step")
        x.legend()
    fig.tight_layout()
    save_figure(fig, os.path.join(out, "balance.png"), dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    per_rank = [sum(h["bytes"][0]["forward"]) + sum(h["bytes"][0]["backward"]) for h in ep_hist]
    ax.bar([f"rank {r}" for r in range(len(per_rank))], [b / 1024 for b in per_rank])
    ax.set_ylabel("KiB sent, step 0 (fwd + bwd)")
    ax.set_title("all-to-all bytes per rank")
    fig.tight_layout()
    save_figure(fig, os.path.join(out, "all_to_all_bytes.png"), dpi=100)
    plt.close(fig)



def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if in_torchrun():
        ws = int(os.environ["WORLD_SIZE"])
        if a.ep not in (None, ws) and is_main_rank():
            print(f"note: --ep {a.ep} ignored under torchrun: P = WORLD_SIZE = {ws}", file=sys.stderr)
        a.ep = ws
    elif a.ep is None:
        a.ep = 4
    bad = _bad_args(a) or moe_eplb.ignored_without_eplb(a)  # every size error before any process starts
    if bad:
        return error(bad)
    if a.eplb:
        bad = "--eplb starts its own ranks: run it with python -m labkit lab moe --eplb" if in_torchrun() \
            else moe_eplb.bad_args(a)
        if bad:
            return error(bad)
    try:  # a bad --data path: a clear message before any process starts
        Corpus.load(a.data, block_size=a.seq)
    except (OSError, ValueError) as e:
        return error(str(e))
    torch.manual_seed(a.seed)
    if not in_torchrun():
        torch.set_num_threads(1)     # tiny kernels: one thread is faster and keeps the forked ranks fair
    if a.eplb:
        return moe_eplb.main(a)
    t0 = time.perf_counter()
    ep_hist = launch(_ep_worker, a.ep, a, backend=a.backend, timeout=120)
    if not is_main_rank():
        return 0                                              # rank 0 runs the references and reports
    H, E, k = a.n_embd, a.experts, a.top_k
    t_ep = time.perf_counter() - t0
    ref = train(None, a, a.compare_mode, a.steps, ep=False)

    # 1. EP == single device: the verdict (every step, at the same parameters); the curve gap is shown only
    ep_loss = [sum(h["loss"][s] for h in ep_hist) / a.ep for s in range(a.steps)]
    gap = max(abs(x - y) for x, y in zip(ep_loss, ref["loss"]))
    print(f"MoE GPT: {a.n_layer} layers (MoE every {a.moe_every}), H={H}, E={E}, k={k}, "
          f"capacity factor {a.capacity_factor}, batch {a.batch}x{a.seq} tokens, balance={a.compare_mode}")
    print(f"EP={a.ep} vs single device, {a.steps} AdamW steps (EP run {t_ep:.1f} s): largest gap between the two "
          f"separate trainings' loss curves {gap:.2e} (shown, not judged; the verdict is at the end)")

    # 2. all-to-all bytes, step 0, next to the formula
    n_moe = len(ep_hist[0]["loads"][0])
    print(f"\nall-to-all bytes per MoE layer, forward of step 0 (sent by each rank; fp32, H={H}):")
    head = (f"{'rank':>4}  {'layer':>5}  {'counts':>6} {'(E*8)':>6}  {'dispatch':>8} {'(N_p*H*4)':>9}  "
            f"{'combine':>7}  {'N_p':>5}")
    print(head)
    print("-" * len(head))
    for r, h in enumerate(ep_hist):
        fwd, bwd = h["bytes"][0]["forward"], h["bytes"][0]["backward"]
        kept = [round((1 - d) * (a.batch // a.ep) * a.seq * k) for d in h["dropped"][0]]
        for layer in range(n_moe):
            c, d, cb = fwd[3 * layer: 3 * layer + 3]
            print(f"{r:>4}  {layer:>5}  {c:>6} {E * 8:>6}  {d:>8} {kept[layer] * H * 4:>9}  {cb:>7}  {kept[layer]:>5}")
        print(f"{'':>4}  backward, all layers: {sum(bwd)} bytes (= dispatch + combine, reversed)")
    print(f"(...) = formula. counts: all-to-all #0 sends the E={E} per-expert slot counts (int64, E*8 bytes), so\n"
          f"every rank knows how many rows it will receive. dispatch: the N_p kept token-slots of the rank (of\n"
          f"k*T_p = {k * (a.batch // a.ep) * a.seq}) go to their experts' ranks, N_p*H*4 bytes. combine: the "
          f"expert outputs go back, i.e. the rows\nthis rank's experts processed (differs per rank; the totals "
          f"over ranks equal dispatch's).")

    # 3. balancing runs
    runs = {}
    for mode in BALANCE_MODES:
        runs[mode] = train(None, a, mode, a.balance_steps, ep=False)
    n = min(10, a.balance_steps)
    print(f"\nbalancing, {a.balance_steps} steps on one device (averages over the last {n} steps):")
    print(f"{'mode':>9}  {'LM loss':>7}  {'MaxVio per layer':>18}  {'dropped':>7}  {'balance loss':>12}  busiest expert share")
    for mode, h in runs.items():
        last = torch.stack(h["loads"][-n:]).sum(0)                              # [L, E]
        vio = " ".join(f"{max_vio(l):.2f}" for l in last)
        share = " ".join(f"{float(l.max() / l.sum()):.2f}" for l in last)
        dropped = sum(sum(d) / len(d) for d in h["dropped"][-n:]) / n
        bal = sum(sum(b) / len(b) for b in h["balance"][-n:]) / n
        print(f"{mode:>9}  {sum(h['lm'][-n:]) / n:7.3f}  {vio:>18}  {dropped:7.3f}  {bal:12.3f}  {share}")
    print(f"\nshare of token-slots per expert (last {n} steps; uniform = {1 / E:.3f}):")
    for mode, h in runs.items():
        last = torch.stack(h["loads"][-n:]).sum(0).float()
        for layer, l in enumerate(last):
            print(f"{mode:>9} layer {layer}: " + " ".join(f"{float(v):.3f}" for v in l / l.sum()))
    print(f"total time {time.perf_counter() - t0:.1f} s")
    rc = verdict_exit({f"EP={a.ep} ({a.compare_mode})": ep_hist[0]["verdict"]}, reference_losses=ref["loss"])
    if not a.no_plots:  # the files last: a full disk cannot hide the table and the verdict
        out = out_folder(a.out, "moe")
        _plots(out, runs, ep_hist, a)
        names = ("expert_load.png", "balance.png", "all_to_all_bytes.png")
        print("\nplots: " + ", ".join(os.path.join(out, f) for f in names))
        print(f"run folder: {out}")
    return rc



if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
