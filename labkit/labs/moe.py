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

import os
import sys
import time
from dataclasses import dataclass

import torch

from ..comm import CommLog
from ..dist import in_torchrun
from ..grid import even_part
from ..moe.expert_parallel import all_reduce_loads, sync_replicated_grads, to_expert_parallel
from ..moe.model import MoEGPT, total_aux_loss
from . import out_folder
from .harness import Lab, Launch, Report, lockstep, run
from .moe_common import (
    BALANCE_MODES,
    History,
    bad_args,
    build_parser,
    configs,
    global_name,
    model_expert_offset,
    resolve,
    train_single,
)
from .replay import replayed_routing

__all__ = ["BALANCE_MODES", "build_parser", "main", "max_vio", "LAB"]

SMOOTH = 10  # steps of the moving average in expert_load.png


@dataclass
class RankResult:
    """One EP rank's training: its :class:`~labkit.labs.moe_common.History` (``bytes``: the
    all-to-all bytes it sent per step), its final ``params`` and, on rank 0, the ``verdict``."""
    history: History
    params: dict
    verdict: object = None


def _ep_worker(ctx, a, corpus) -> RankResult:
    """One rank of the EP run over ``ctx.group``, judged at every step by the verdict: rank 0's
    reference replays this run's routing (:mod:`labkit.labs.replay`)."""
    from tqdm.auto import tqdm

    from .verdict import module_pieces

    P, rank, device = ctx.world_size, ctx.rank, ctx.device
    cfg, moe = configs(a, a.compare_mode, 1)
    model = MoEGPT(cfg, moe, a.moe_every, seed=a.seed)
    to_expert_parallel(model, ctx.group, rank, P)
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=True)

    def ref_loss(m, step, extras):
        x, y = (t.to(device) for t in corpus.get_batch("train", a.batch, a.seq, step, a.seed))
        problems: list = []
        undo = replayed_routing(m, extras, problems)
        try:
            lm, stats = m(x, y)
        finally:
            undo()
        return lm + total_aux_loss(stats).to(device), "; ".join(dict.fromkeys(problems)) or None
    ref_cfg, ref_moe = configs(a, a.compare_mode, P)
    check = lockstep(ctx, a, lambda: MoEGPT(ref_cfg, ref_moe, a.moe_every, seed=a.seed), ref_loss)
    rows, offset = even_part(a.batch, P, rank), model_expert_offset(model)
    hist = History()
    # disable=None: no bar when stderr is not a terminal (logs); else one bar (rank 0) cleared when done
    bar = tqdm(range(a.steps), desc=f"EP={P} {a.compare_mode}", disable=None if rank == 0 else True,
               leave=False, file=sys.stderr)
    for step in bar:
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        x, y = x[rows].to(device), y[rows].to(device)
        with CommLog() as fwd_log:
            lm, stats = model(x, y)
        aux = total_aux_loss(stats).to(device)
        with CommLog() as bwd_log:
            ((lm + aux) / P).backward()
        sync_replicated_grads(model, ctx.group)
        check.step(step, module_pieces(model, lambda n: global_name(n, offset)), (lm + aux).item(),
                   extra=[(s.router.indices.cpu(), s.router.keep.cpu()) for s in stats])
        loads = all_reduce_loads(torch.stack([s.tokens_per_expert for s in stats]), ctx.group)  # [L_moe, E]
        for layer, load in zip(model.moe_layers(), loads):
            layer.update_bias(load)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.record(lm, aux, loads, stats)
        hist.bytes.append({"forward": [r.nbytes for r in fwd_log.of("all_to_all")],
                           "backward": [r.nbytes for r in bwd_log.of("all_to_all")]})
        bar.set_postfix(loss=f"{hist.lm[-1]:.3f}")
    return RankResult(hist, {n: p.detach().cpu() for n, p in model.state_dict().items()}, check.result())


def _reference_run(a, balance: str, steps: int, corpus):
    """The single-device training with ``balance`` (routing in ``a.ep`` token groups, like the EP
    run): ``(Reference, History)``."""
    cfg, moe = configs(a, balance, a.ep)
    return train_single(MoEGPT(cfg, moe, a.moe_every, seed=a.seed), a, steps, corpus)


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



class MoELab(Lab):
    """``python -m labkit lab moe``: the EP run against one device, then the balancing runs."""
    name = "moe"

    def parser(self):
        return build_parser()

    def resolve(self, a, world):
        resolve(a, world)

    def check(self, a):  # every size error before any process starts
        bad = bad_args(a)
        if bad is None and a.eplb:
            bad = ("--eplb starts its own ranks: run it with python -m labkit lab moe --eplb" if in_torchrun()
                   else "--eplb is the EPLB lab: run it with python -m labkit lab moe --eplb")
        return bad

    def load_corpus(self, a):
        from ..data import Corpus
        return Corpus.load(a.data, block_size=a.seq)

    def start(self, a, corpus):
        torch.manual_seed(a.seed)
        if not in_torchrun():
            torch.set_num_threads(1)     # tiny kernels: one thread is faster and keeps the forked ranks fair
        self.t0 = time.perf_counter()

    def runs(self, a, corpus):
        return [Launch(f"EP={a.ep} ({a.compare_mode})", a.ep, _ep_worker, (a, corpus))]

    def reference(self, a, corpus):
        ref, self.ref_hist = _reference_run(a, a.compare_mode, a.steps, corpus)
        return ref

    @staticmethod
    def _a2a_table(a, ep_hist, n_moe) -> None:
        """The all-to-all bytes per MoE layer of step 0, per rank, next to the formula (EP > 1)."""
        H, E, k = a.n_embd, a.experts, a.top_k
        print(f"\nall-to-all bytes per MoE layer, forward of step 0 (sent by each rank; fp32, H={H}):")
        head = (f"{'rank':>4}  {'layer':>5}  {'counts':>6} {'(E*8)':>6}  {'dispatch':>8} {'(N_p*H*4)':>9}  "
                f"{'combine':>7}  {'N_p':>5}")
        print(head)
        print("-" * len(head))
        for r, h in enumerate(ep_hist):
            fwd, bwd = h.bytes[0]["forward"], h.bytes[0]["backward"]
            kept = [round((1 - d) * (a.batch // a.ep) * a.seq * k) for d in h.dropped[0]]
            for layer in range(n_moe):
                c, d, cb = fwd[3 * layer: 3 * layer + 3]
                print(f"{r:>4}  {layer:>5}  {c:>6} {E * 8:>6}  {d:>8} {kept[layer] * H * 4:>9}  {cb:>7}  "
                      f"{kept[layer]:>5}")
            print(f"{'':>4}  backward, all layers: {sum(bwd)} bytes (= dispatch + combine, reversed)")
        print(f"(...) = formula. counts: all-to-all #0 sends the E={E} per-expert slot counts (int64, E*8 bytes), "
              f"so\nevery rank knows how many rows it will receive. dispatch: the N_p kept token-slots of the rank "
              f"(of\nk*T_p = {k * (a.batch // a.ep) * a.seq}) go to their experts' ranks, N_p*H*4 bytes. combine: "
              f"the expert outputs go back, i.e. the rows\nthis rank's experts processed (differs per rank; the "
              f"totals over ranks equal dispatch's).")

    def report(self, a, outcome):
        H, E, k = a.n_embd, a.experts, a.top_k
        name = f"EP={a.ep} ({a.compare_mode})"
        ranks = outcome.results[name]
        ep_hist = [r.history for r in ranks]
        t_ep = outcome.seconds
        ref = self.ref_hist

        # 1. EP == single device: the verdict (every step, at the same parameters); the curve gap is shown only
        ep_loss = [sum(h.loss[s] for h in ep_hist) / a.ep for s in range(a.steps)]
        gap = max(abs(x - y) for x, y in zip(ep_loss, ref.loss))
        print(f"MoE GPT: {a.n_layer} layers (MoE every {a.moe_every}), H={H}, E={E}, k={k}, "
              f"capacity factor {a.capacity_factor}, batch {a.batch}x{a.seq} tokens, balance={a.compare_mode}")
        print(f"EP={a.ep} vs single device, {a.steps} AdamW steps (EP run {t_ep:.1f} s): largest gap between the "
              f"two separate trainings' loss curves {gap:.2e} (shown, not judged; the verdict is at the end)")

        # 2. all-to-all bytes, step 0, next to the formula
        n_moe = len(ep_hist[0].loads[0])
        if a.ep == 1:   # every expert on the one rank: no all-to-all is sent
            print(f"\nall-to-all bytes: none (--ep 1: all E={E} experts on the one rank, tokens never leave it)")
        else:
            self._a2a_table(a, ep_hist, n_moe)

        # 3. balancing runs
        runs = self.balance_runs = {mode: _reference_run(a, mode, a.balance_steps, outcome.corpus)[1]
                                    for mode in BALANCE_MODES}
        n = min(10, a.balance_steps)
        print(f"\nbalancing, {a.balance_steps} steps on one device (averages over the last {n} steps):")
        print(f"{'mode':>9}  {'LM loss':>7}  {'MaxVio per layer':>18}  {'dropped':>7}  {'balance loss':>12}  "
              f"busiest expert share")
        for mode, h in runs.items():
            last = torch.stack(h.loads[-n:]).sum(0)                              # [L, E]
            vio = " ".join(f"{max_vio(l):.2f}" for l in last)
            share = " ".join(f"{float(l.max() / l.sum()):.2f}" for l in last)
            dropped = sum(sum(d) / len(d) for d in h.dropped[-n:]) / n
            bal = sum(sum(b) / len(b) for b in h.balance[-n:]) / n
            print(f"{mode:>9}  {sum(h.lm[-n:]) / n:7.3f}  {vio:>18}  {dropped:7.3f}  {bal:12.3f}  {share}")
        print(f"\nshare of token-slots per expert (last {n} steps; uniform = {1 / E:.3f}):")
        for mode, h in runs.items():
            last = torch.stack(h.loads[-n:]).sum(0).float()
            for layer, l in enumerate(last):
                print(f"{mode:>9} layer {layer}: " + " ".join(f"{float(v):.3f}" for v in l / l.sum()))
        print(f"total time {time.perf_counter() - self.t0:.1f} s")
        return Report({name: ranks[0].verdict})

    def folder(self, a):
        return None if a.no_plots else out_folder(a.out, "moe")

    def files(self, a, outcome, folder):
        ep_hist = [r.history for r in outcome.results[f"EP={a.ep} ({a.compare_mode})"]]
        _plots(folder, self.balance_runs, ep_hist, a)
        names = ("expert_load.png", "balance.png", "all_to_all_bytes.png")
        print("\nplots: " + ", ".join(os.path.join(folder, f) for f in names))
        print(f"run folder: {folder}")


LAB = MoELab()


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit lab moe`` (without ``--eplb``): the exit code (:func:`labkit.labs.harness.run`)."""
    return run(LAB, argv).rc


if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
