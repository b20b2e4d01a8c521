"""``python -m labkit lab moe --eplb``: balance the GPUs, not the experts.

1. Trains the MoE GPT on one device without balancing for ``--balance-steps`` steps and
   measures the load of every expert (token-slots routed to it, last ``WINDOW`` steps).
2. EPLB (:func:`labkit.moe.eplb.rebalance_experts`) replicates the heaviest experts into
   R = E + ``--redundant-experts`` physical experts and places them on the P GPUs
   (``--gpus-per-node`` g: N = P/g nodes; hierarchical policy when the ``--expert-groups``
   divide over the nodes, else global).
3. Runs that placement for real: the trained model continues for ``--steps`` steps on P ranks
   with :class:`labkit.moe.replicas.ReplicatedExpertParallelMoE` (tokens split among the
   copies, copy gradients summed), judged at every step by the labs' verdict
   (:mod:`labkit.labs.verdict`: loss and every gradient against the single-device model at the
   same parameters; exit code 1 otherwise), and the tokens each rank's copies processed are counted.
4. For comparison, trains with DeepSeek-V2's device-level balance loss and with DeepSeek-V3's
   aux-loss-free bias (one copy per expert, E/P per GPU) and measures their GPU loads.
5. Prints max/mean tokens per GPU for all of them, and, for the first MoE layer of the trained
   model on the lab's batch, the bytes per level of the flat and the hierarchical all-to-all
   (with node-limited routing to M = 1 .. N nodes), whose outputs must equal each other.
Plots: ``gpu_load.png`` (tokens per GPU, every mode and MoE layer).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, replace

import torch

from ..dist import in_torchrun
from ..grid import Mesh
from ..model import GPTConfig
from ..moe.eplb import contiguous_gpu_loads, gpu_loads, imbalance, rebalance_experts
from ..moe.expert_parallel import all_reduce_loads, sync_replicated_grads
from ..moe.hierarchical import HierarchicalExpertParallelMoE, make_node_groups
from ..moe.model import MoEGPT, moe_config_for, total_aux_loss
from ..moe.replicas import sync_replica_grads, to_replicated_expert_parallel
from . import out_folder
from .harness import Lab, Launch, Report, lockstep, run
from .moe_common import bad_args, bad_eplb_args, build_parser, resolve, train_single
from .replay import replayed_routing
from .verdict import report

WINDOW = 10          # steps over which loads are measured
RUN = "EP={P} with EPLB replicas"


@dataclass
class RankResult:
    """One rank of the replica run: ``tokens`` ``[steps, L_moe]`` token rows its copies processed,
    ``loads`` ``[steps, L_moe, E]`` the logical loads (all ranks), ``verdict`` (rank 0)."""
    tokens: torch.Tensor
    loads: torch.Tensor
    verdict: object = None


def _model(a, mode: str, groups: int):
    cfg = GPTConfig(block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, ffn_mult=2)
    # no capacity limit: EPLB places what the router asks for (as at inference), and the tokens a GPU
    # processes are then exactly the loads that EPLB balances
    moe = moe_config_for(cfg, n_routed_experts=a.experts, n_activated_experts=a.top_k,
                         capacity_factor=None, token_groups=groups,
                         device_loss_coeff=a.device_coeff if mode == "device" else 0.0, n_devices=a.ep,
                         expert_bias=mode == "aux_free", bias_update_rate=a.gamma)
    return MoEGPT(cfg, moe, a.moe_every, seed=a.seed)


def _trained(a, mode: str, steps: int, corpus):
    """Single-device training (routing in P token groups, as EP routes per rank): the trained model."""
    ref, _ = train_single(_model(a, mode, a.ep), a, steps, corpus)
    return ref.model


@torch.no_grad()
def _measure(a, model, start: int, n: int, corpus) -> torch.Tensor:
    """Loads [L_moe, E] of ``model`` (no training) summed over the batches start .. start+n-1."""
    total = 0
    for step in range(start, start + n):
        x, _ = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        _, stats = model(x)
        total = total + torch.stack([s.tokens_per_expert for s in stats]).double()
    return total


def _expert_name(name: str, logical: dict) -> str:
    """A replica layer's parameter name -> the single-device name (copy i -> its logical expert)."""
    if ".moe.experts." not in name:
        return name
    head, tail = name.split(".moe.experts.")
    i, rest = tail.split(".", 1)
    return f"{head}.moe.experts.{logical[int(head.split('.')[1])][int(i)]}.{rest}"


def _replica_worker(ctx, a, state, phy2log, start, corpus) -> RankResult:
    """Continue training the trained model with the EPLB placement on P ranks, judged at every
    step by the labs' verdict (:mod:`labkit.labs.verdict`): rank 0 loads every rank's parameters
    (each copy under its logical expert's name: the copies must agree) into the single-device
    model, which routes the same tokens to the same experts and backpropagates the whole batch."""
    from .verdict import module_pieces

    P, r = ctx.world_size, ctx.rank
    model = _model(a, "none", 1)
    model.load_state_dict(state)
    to_replicated_expert_parallel(model, phy2log, ctx.group, r, P)
    logical = {i: b.moe.local_logical() for i, b in enumerate(model.blocks) if hasattr(b, "moe")}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=True)

    def ref_loss(m, step, extras):
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        problems: list = []
        undo = replayed_routing(m, extras, problems)
        try:
            lm, stats = m(x, y)
        finally:
            undo()
        return lm + total_aux_loss(stats), "; ".join(dict.fromkeys(problems)) or None

    check = lockstep(ctx, a, lambda: _model(a, "none", P), ref_loss)
    ep = Mesh(ep=P)                    # every rank one EP rank: its slice of the global batch
    per_gpu, loads = [], []
    for step in range(start, start + a.steps):
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        lm, stats = model(ep.shard(x, "ep", r), ep.shard(y, "ep", r))
        loss = lm + total_aux_loss(stats)
        (loss / P).backward()
        sync_replicated_grads(model, ctx.group)
        sync_replica_grads(model, ctx.group)
        check.step(step, module_pieces(model, lambda n: _expert_name(n, logical), buffers=False), loss.item(),
                   extra=[(s.router.indices.cpu(), s.router.keep.cpu()) for s in stats])
        opt.step()
        opt.zero_grad(set_to_none=True)
        per_gpu.append(torch.stack([b.moe.last_recv_counts.sum() for b in model.blocks if hasattr(b, "moe")]))
        loads.append(all_reduce_loads(torch.stack([s.tokens_per_expert for s in stats]), ctx.group))
    return RankResult(torch.stack(per_gpu), torch.stack(loads), check.result())


def _a2a_worker(ctx, a, layer, x, g):
    """One MoE layer forward, flat and hierarchical, with node-limited routing to M = 1..N nodes
    (and without a limit): outputs and bytes per level of this rank."""
    nodes = make_node_groups(ctx, g)
    N, r = ctx.world_size // g, ctx.rank
    mine = Mesh(ep=ctx.world_size).shard(x, "ep", r)    # every rank one EP rank: its slice of the tokens
    out = {}
    E, k = layer.cfg.n_routed_experts, layer.cfg.n_activated_experts
    for M in [None] + [m for m in range(1, N + 1) if m * (E // N) >= k]:       # M nodes must hold k experts
        cfg = layer.cfg if M is None else replace(layer.cfg, n_expert_groups=N, n_limited_groups=M)
        res = {}
        for hier in (False, True):
            ep = HierarchicalExpertParallelMoE(replace(cfg, token_groups=1), nodes, hier)
            ep.router.load_state_dict(layer.router.state_dict())
            for i, e in enumerate(ep.experts):
                e.load_state_dict(layer.experts[ep.expert_offset + i].state_dict())
            with torch.no_grad():
                y, _ = ep(mine)
            res[hier] = (y, ep.last_bytes)
        out[M] = res
    return out


class EPLBLab(Lab):
    """``python -m labkit lab moe --eplb``: EPLB replicas on P ranks, against one device."""
    name = "moe-eplb"

    def parser(self):
        return build_parser()

    def resolve(self, a, world):
        resolve(a, world)

    def check(self, a):  # every size error before any process starts
        if in_torchrun():
            return "--eplb starts its own ranks: run it with python -m labkit lab moe --eplb"
        return bad_args(a) or bad_eplb_args(a)

    def load_corpus(self, a):
        from ..data import Corpus
        return Corpus.load(a.data, block_size=a.seq)

    def start(self, a, corpus):
        torch.manual_seed(a.seed)
        torch.set_num_threads(1)     # tiny kernels: one thread is faster and keeps the forked ranks fair
        self.t0 = time.perf_counter()

    def runs(self, a, corpus):
        """Train without balancing, measure the loads, place the replicas with EPLB; then the two runs
        on P ranks: the replicas continuing from the trained weights (judged at every step) and the
        flat vs hierarchical all-to-all of the first MoE layer."""
        P, E = a.ep, a.experts
        self.g = g = P if a.gpus_per_node is None else a.gpus_per_node
        self.N = N = P // g
        self.R = R = E + (P if a.redundant_experts is None else a.redundant_experts)
        self.groups = N if a.expert_groups is None else a.expert_groups
        self.n = n = min(WINDOW, a.balance_steps)
        # 1. train without balancing, then measure the loads of the trained model on the last n batches
        trained = _trained(a, "none", a.balance_steps, corpus)
        self.weight = _measure(a, trained, a.balance_steps - n, n, corpus)            # [L_moe, E]
        # 2. EPLB
        self.placement = rebalance_experts(self.weight, R, self.groups, N, P)
        state = {k: v.clone() for k, v in trained.state_dict().items()}
        # 5. (below) the hierarchical all-to-all on the first MoE layer's input
        captured = {}
        moe0 = trained.moe_layers()[0]

        def grab(module, inputs, output):  # returns None: the layer's output stays
            captured.setdefault("x", inputs[0].detach().reshape(-1, a.n_embd))
        hook = moe0.register_forward_hook(grab)
        x, _ = corpus.get_batch("train", a.batch, a.seq, 0, a.seed)
        with torch.no_grad():
            trained(x)
        hook.remove()
        self.T = captured["x"].shape[0]
        return [Launch(RUN.format(P=P), P, _replica_worker,
                       (a, state, self.placement[0], a.balance_steps, corpus)),
                Launch("all-to-all", P, _a2a_worker, (a, moe0, captured["x"], g))]

    def reference(self, a, corpus):
        return None  # each replica step is judged against the single-device model on rank 0

    def report(self, a, outcome):
        P, E, N, R, g, n = a.ep, a.experts, self.N, self.R, self.g, self.n
        weight, (phy2log, _, logcnt) = self.weight, self.placement
        policy = "hierarchical" if self.groups % N == 0 else "global"
        ranks, a2a = outcome.results[RUN.format(P=P)], outcome.results["all-to-all"]
        n_r = min(WINDOW, a.steps)
        # the first n_r steps after the rebalance (training moves the loads on; EPLB re-runs periodically)
        measured = self.measured = torch.stack([rk.tokens[:n_r].sum(0) for rk in ranks], dim=1).double()
        # the same steps' logical loads, as EPLB predicts them for this placement
        w_after = ranks[0].loads[:n_r].sum(0).double()
        # 4. the alternatives: balance losses and bias, one copy per expert
        results = {"no balancing, 1 copy per expert": contiguous_gpu_loads(weight, P),
                   f"no balancing + EPLB, R={R} copies (predicted)": gpu_loads(weight, phy2log, logcnt, P)}
        for mode, label in (("device", f"device-level loss (alpha2={a.device_coeff:g})"),
                            ("aux_free", f"aux-loss-free bias (gamma={a.gamma:g})")):
            m = _trained(a, mode, a.balance_steps, outcome.corpus)
            results[label] = contiguous_gpu_loads(_measure(a, m, a.balance_steps - n, n, outcome.corpus), P)
        self.results = results

        print(f"MoE GPT: {a.n_layer} layers (MoE every {a.moe_every}), H={a.n_embd}, E={E}, k={a.top_k}, "
              f"no capacity limit (--capacity-factor is not used by --eplb), batch {a.batch}x{a.seq}; P={P} GPUs as "
              f"{N} node(s) x {g}")
        print(f"EPLB: {policy} policy (num_groups={self.groups}, num_nodes={N}), R={R} physical experts, "
              f"{R // P} per GPU")
        for layer in range(len(weight)):
            print(f"  MoE layer {layer}: load {weight[layer].long().tolist()} -> copies {logcnt[layer].tolist()}")
        print(f"\nmax/mean tokens per GPU (1.00 = balanced) after {a.balance_steps} training steps, loads measured "
              f"on the last {n} batches:")
        width = max(len(k) for k in results) + 2
        print(f"{'':<{width}}" + "".join(f"  layer {i}" for i in range(len(weight))))
        for label, gl in results.items():
            print(f"{label:<{width}}" + "".join(f"  {float(v):7.2f}" for v in imbalance(gl)))
        label = f"EPLB measured on {P} ranks (steps +1..+{n_r})"
        pred = gpu_loads(w_after, phy2log, logcnt, P)
        print(f"{label:<{width}}" + "".join(f"  {float(v):7.2f}" for v in imbalance(measured))
              + "   (EPLB's prediction for those steps: " + " ".join(f"{float(v):.2f}" for v in imbalance(pred)) + ")")
        print(f"{'':<{width}}  tokens per GPU, layer 0 measured: {measured[0].long().tolist()}, "
              f"predicted: {[round(float(v)) for v in pred[0]]}")
        print(f"{'':<{width}}  (the placement was computed from earlier loads; training moves them on, which is why\n"
              f"{'':<{width}}  EPLB re-balances periodically. Its prediction for the same steps separates drift from "
              f"placement;\n{'':<{width}}  the hierarchical policy also keeps each group on one node: try "
              f"--expert-groups 1.)")

        self.a2a_ok = all(torch.allclose(rk[M][True][0], rk[M][False][0], rtol=1e-5, atol=1e-6)
                          for rk in a2a for M in rk)
        T = self.T
        print(f"\nall-to-all bytes of MoE layer 0, forward (dispatch + combine), summed over the {P} ranks, "
              f"{T} tokens, k={a.top_k}, H={a.n_embd} fp32:")
        print(f"{'routing':>18}  {'flat inter-node':>15}  {'hier. inter-node':>16}  {'hier. intra-node':>16}  "
              f"{'inter rows/token':>16}  {'bound M':>7}")
        for M in a2a[0]:
            tot = lambda hier, lvl: sum(rk[M][hier][1].total(lvl) for rk in a2a)           # noqa: E731
            rows = sum(rk[M][True][1].rows["dispatch"]["inter_node"] for rk in a2a) / T
            name = "no node limit" if M is None else f"at most {M} node(s)"
            print(f"{name:>18}  {tot(False, 'inter_node'):>15}  {tot(True, 'inter_node'):>16}  "
                  f"{tot(True, 'intra_node'):>16}  {rows:>16.2f}  {'-' if M is None else M:>7}")
        print("(inter rows/token: token rows a rank sends to other nodes in the dispatch, per token; node-limited "
              "routing bounds it by M.\n hierarchical: once per node over the slow link; flat: once per slot.)")
        print(f"hierarchical output equals flat: {'yes' if self.a2a_ok else 'NO'}")
        print(f"total time {time.perf_counter() - self.t0:.1f} s")
        return Report({RUN.format(P=P): ranks[0].verdict})

    def conclude(self, verdicts, reference_losses, failures) -> int:
        ok, text = report(verdicts)
        print("\n" + text)
        if not (ok and self.a2a_ok):
            why = [] if ok else ["the replicas differ from single-device training (see above)"]
            why += [] if self.a2a_ok else ["the hierarchical all-to-all's output differs from the flat one's"]
            print(f"FAIL: {'; '.join(why)}", file=sys.stderr)
            return 1
        print("OK: the replicated experts train like the single-device model at every step; the hierarchical "
              "all-to-all computes what the flat one does")
        return 0

    def folder(self, a):
        return None if a.no_plots else out_folder(a.out, "moe-eplb")

    def files(self, a, outcome, folder):
        _plot(folder, self.results, self.measured, a)
        print(f"\nplot: {os.path.join(folder, 'gpu_load.png')}")
        print(f"run folder: {folder}")


LAB = EPLBLab()


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit lab moe --eplb``: the exit code (:func:`labkit.labs.harness.run`)."""
    return run(LAB, argv).rc


def _plot(out, results, measured, a):
    import matplotlib

    from . import save_figure
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = dict(results)
    series["EPLB measured on ranks"] = measured
    L, P = measured.shape
    fig, axes = plt.subplots(1, L, figsize=(max(6 * L, 10), 4.6), squeeze=False, layout="constrained")
    width = 0.8 / len(series)
    for layer in range(L):
        ax = axes[0][layer]
        for i, (label, gl) in enumerate(series.items()):
            share = gl[layer] / gl[layer].mean()
            ax.bar([p + (i - len(series) / 2 + 0.5) * width for p in range(P)], share.numpy(), width,
                   label=label, color=f"C{i}")
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
        ax.set_xticks(range(P), [f"GPU {p}" for p in range(P)])
        ax.set_ylabel("tokens / mean tokens per GPU")
        ax.set_title(f"MoE layer {layer}: max/mean " + " / ".join(
            f"{float((gl[layer] / gl[layer].mean()).max()):.2f}" for gl in series.values()), fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Tokens per GPU (a step waits for the busiest GPU; dotted: perfect balance)", fontsize=11)
    save_figure(fig, os.path.join(out, "gpu_load.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
