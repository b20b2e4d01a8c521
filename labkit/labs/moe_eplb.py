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

import math
import os
import sys
import time
from dataclasses import replace

import torch

from ..data import Corpus
from ..dist import launch
from ..model import GPTConfig
from ..moe.eplb import contiguous_gpu_loads, gpu_loads, imbalance, rebalance_experts
from ..moe.expert_parallel import all_reduce_loads, sync_replicated_grads
from ..moe.hierarchical import HierarchicalExpertParallelMoE, make_node_groups
from ..moe.model import MoEGPT, moe_config_for, total_aux_loss
from ..moe.replicas import sync_replica_grads, to_replicated_expert_parallel
from . import out_folder
from .replay import replayed_routing
from .verdict import report

WINDOW = 10          # steps over which loads are measured


def add_arguments(p) -> None:
    """The options of ``--eplb`` (added to the moe lab's parser)."""
    p.add_argument("--eplb", action="store_true",
                   help="instead of the standard lab: measure expert loads, rebalance with EPLB (replicas), run "
                        "the replicas on P ranks, compare tokens per GPU with the device-level loss and the aux-free bias")
    p.add_argument("--redundant-experts", type=int, default=None,
                   help="--eplb: extra physical experts R - E (unset: P, one more per GPU)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="--eplb: GPUs per node g, CPU ranks grouped into P/g nodes (unset: P, one node)")
    p.add_argument("--expert-groups", type=int, default=None,
                   help="--eplb: expert groups for EPLB's hierarchical policy (unset: the number of nodes)")
    p.add_argument("--device-coeff", type=float, default=None,
                   help=f"--eplb: device-level balance loss alpha2 (unset: {DEVICE_COEFF})")


DEVICE_COEFF = 0.05  # alpha2 of the device-level balance loss (DeepSeek-V2 sec. 2.2.3 trains with 0.05)
EPLB_OPTIONS = ("redundant_experts", "gpus_per_node", "expert_groups", "device_coeff")


def ignored_without_eplb(a) -> str | None:
    """The message for an --eplb option given without --eplb (it would be silently ignored), or None."""
    for name in EPLB_OPTIONS:
        if not a.eplb and getattr(a, name) is not None:
            flag = "--" + name.replace("_", "-")
            return f"{flag} {getattr(a, name)} is an --eplb option: add --eplb, or leave {flag} out"
    return None


def bad_args(a) -> str | None:
    """The first rule the --eplb options break (None: fine). Called after the lab's own checks."""
    P, E = a.ep, a.experts
    g = P if a.gpus_per_node is None else a.gpus_per_node
    if g < 1 or P % g:
        return f"--gpus-per-node {g} must divide --ep {P} into whole nodes"
    nodes = P // g
    red = P if a.redundant_experts is None else a.redundant_experts
    if red < 0 or (E + red) % P:
        return f"--redundant-experts {red}: E + redundant = {E + red} physical experts must be a multiple of --ep {P}"
    groups = nodes if a.expert_groups is None else a.expert_groups
    if groups < 1 or E % groups:
        return f"--expert-groups {groups} must divide --experts {E}"
    if a.device_coeff is None:
        a.device_coeff = DEVICE_COEFF
    if not (math.isfinite(a.device_coeff) and a.device_coeff > 0):
        return f"--device-coeff must be a finite number > 0, got {a.device_coeff}"
    return None


def _model(a, mode: str, groups: int):
    cfg = GPTConfig(block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, ffn_mult=2)
    # no capacity limit: EPLB places what the router asks for (as at inference), and the tokens a GPU
    # processes are then exactly the loads that EPLB balances
    moe = moe_config_for(cfg, n_routed_experts=a.experts, n_activated_experts=a.top_k,
                         capacity_factor=None, token_groups=groups,
                         device_loss_coeff=a.device_coeff if mode == "device" else 0.0, n_devices=a.ep,
                         expert_bias=mode == "aux_free", bias_update_rate=a.gamma)
    return MoEGPT(cfg, moe, a.moe_every, seed=a.seed)


def _train_single(a, mode: str, steps: int):
    """Single-device training (routing in P token groups, as EP routes per rank). Returns
    (model, losses, loads [steps, L_moe, E])."""
    model = _model(a, mode, a.ep)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=True)
    corpus = Corpus.load(a.data)
    losses, loads = [], []
    for step in range(steps):
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        lm, stats = model(x, y)
        loss = lm + total_aux_loss(stats)
        loss.backward()
        load = torch.stack([s.tokens_per_expert for s in stats])
        for layer, l in zip(model.moe_layers(), load):
            layer.update_bias(l)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        loads.append(load)
    return model, losses, torch.stack(loads)


@torch.no_grad()
def _measure(a, model, start: int, n: int) -> torch.Tensor:
    """Loads [L_moe, E] of ``model`` (no training) summed over the batches start .. start+n-1."""
    corpus, total = Corpus.load(a.data), 0
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


def _replica_worker(ctx, a, state, phy2log, start):
    """Continue training the trained model with the EPLB placement on P ranks, judged at every
    step by the labs' verdict (:mod:`labkit.labs.verdict`): rank 0 loads every rank's parameters
    (each copy under its logical expert's name: the copies must agree) into the single-device
    model, which routes the same tokens to the same experts and backpropagates the whole batch."""
    from .verdict import Lockstep, module_pieces

    P, r = ctx.world_size, ctx.rank
    model = _model(a, "none", 1)
    model.load_state_dict(state)
    to_replicated_expert_parallel(model, phy2log, ctx.group, r, P)
    logical = {i: b.moe.local_logical() for i, b in enumerate(model.blocks) if hasattr(b, "moe")}
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, foreach=True)
    corpus = Corpus.load(a.data)
    ref = _model(a, "none", P) if r == 0 else None

    def ref_loss(m, step, extras):
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        problems: list = []
        undo = replayed_routing(m, extras, problems)
        try:
            lm, stats = m(x, y)
        finally:
            undo()
        return lm + total_aux_loss(stats), "; ".join(dict.fromkeys(problems)) or None

    check = Lockstep(ctx.group, r, ref, ref_loss, rtol=a.tolerance, atol=a.tolerance / 10)
    rows = a.batch // P
    per_gpu, loads = [], []
    for step in range(start, start + a.steps):
        x, y = corpus.get_batch("train", a.batch, a.seq, step, a.seed)
        lm, stats = model(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
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
    return {"tokens": torch.stack(per_gpu), "loads": torch.stack(loads), "verdict": check.result()}


def _a2a_worker(ctx, a, layer, x, g):
    """One MoE layer forward, flat and hierarchical, with node-limited routing to M = 1..N nodes
    (and without a limit): outputs and bytes per level of this rank."""
    nodes = make_node_groups(ctx, g)
    N, r = ctx.world_size // g, ctx.rank
    rows = x.shape[0] // ctx.world_size
    mine = x[r * rows:(r + 1) * rows]
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


def main(a) -> int:
    """The --eplb lab (options already validated). Returns the exit code."""
    t0 = time.perf_counter()
    P, E = a.ep, a.experts
    g = P if a.gpus_per_node is None else a.gpus_per_node
    N = P // g
    R = E + (P if a.redundant_experts is None else a.redundant_experts)
    groups = N if a.expert_groups is None else a.expert_groups
    policy = "hierarchical" if groups % N == 0 else "global"
    n = min(WINDOW, a.balance_steps)

    # 1. train without balancing, then measure the loads of the trained model on the last n batches
    trained, _, _ = _train_single(a, "none", a.balance_steps)
    weight = _measure(a, trained, a.balance_steps - n, n)                   # [L_moe, E]
    # 2. EPLB
    phy2log, log2phy, logcnt = rebalance_experts(weight, R, groups, N, P)
    # 3. the replicas on P ranks, continuing from the trained weights, judged at every step
    state = {k: v.clone() for k, v in trained.state_dict().items()}
    ranks = launch(_replica_worker, P, a, state, phy2log, a.balance_steps, backend=a.backend, timeout=120)
    n_r = min(WINDOW, a.steps)
    # the first n_r steps after the rebalance (training moves the loads on; EPLB re-runs periodically)
    measured = torch.stack([rk["tokens"][:n_r].sum(0) for rk in ranks], dim=1).double()    # [L_moe, P]
    # the same steps' logical loads, as EPLB predicts them for this placement
    w_after = ranks[0]["loads"][:n_r].sum(0).double()
    # 4. the alternatives: balance losses and bias, one copy per expert
    results = {"no balancing, 1 copy per expert": contiguous_gpu_loads(weight, P),
               f"no balancing + EPLB, R={R} copies (predicted)": gpu_loads(weight, phy2log, logcnt, P)}
    alt = {}
    for mode, label in (("device", f"device-level loss (alpha2={a.device_coeff:g})"),
                        ("aux_free", f"aux-loss-free bias (gamma={a.gamma:g})")):
        m, _, _ = _train_single(a, mode, a.balance_steps)
        alt[label] = contiguous_gpu_loads(_measure(a, m, a.balance_steps - n, n), P)
    results.update(alt)

    print(f"MoE GPT: {a.n_layer} layers (MoE every {a.moe_every}), H={a.n_embd}, E={E}, k={a.top_k}, "
          f"no capacity limit (--capacity-factor is not used by --eplb), batch {a.batch}x{a.seq}; P={P} GPUs as {N} node(s) x {g}")
    print(f"EPLB: {policy} policy (num_groups={groups}, num_nodes={N}), R={R} physical experts, {R // P} per GPU")
    for layer in range(len(weight)):
        print(f"  MoE layer {layer}: load {weight[layer].long().tolist()} -> copies {logcnt[layer].tolist()}")
    print(f"\nmax/mean tokens per GPU (1.00 = balanced) after {a.balance_steps} training steps, loads measured on "
          f"the last {n} batches:")
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
          f"placement;\n{'':<{width}}  the hierarchical policy also keeps each group on one node: try --expert-groups 1.)")

    # 5. hierarchical all-to-all on the first MoE layer's input
    captured = {}
    moe0 = trained.moe_layers()[0]

    def grab(module, inputs, output):
        captured.setdefault("x", inputs[0].detach().reshape(-1, a.n_embd))

    hook = moe0.register_forward_hook(grab)
    x, _ = Corpus.load(a.data).get_batch("train", a.batch, a.seq, 0, a.seed)
    with torch.no_grad():
        trained(x)
    hook.remove()
    a2a = launch(_a2a_worker, P, a, moe0, captured["x"], g, backend=a.backend, timeout=120)
    a2a_ok = all(torch.allclose(rk[M][True][0], rk[M][False][0], rtol=1e-5, atol=1e-6) for rk in a2a for M in rk)
    T = captured["x"].shape[0]
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
    print(f"hierarchical output equals flat: {'yes' if a2a_ok else 'NO'}")

    print(f"total time {time.perf_counter() - t0:.1f} s")
    ok, text = report({f"EP={P} with EPLB replicas": ranks[0]["verdict"]})
    print("\n" + text)
    if not (ok and a2a_ok):
        why = [] if ok else ["the replicas differ from single-device training (see above)"]
        why += [] if a2a_ok else ["the hierarchical all-to-all's output differs from the flat one's"]
        print(f"FAIL: {'; '.join(why)}", file=sys.stderr)
    else:
        print("OK: the replicated experts train like the single-device model at every step; the hierarchical "
              "all-to-all computes what the flat one does")
    if not a.no_plots:  # the files last: a full disk cannot hide the table and the verdict
        out = out_folder(a.out, "moe-eplb")
        _plot(out, results, measured, a)
        print(f"\nplot: {os.path.join(out, 'gpu_load.png')}")
        print(f"run folder: {out}")
    return 0 if ok and a2a_ok else 1


def _plot(out, results, measured, a):
    from . import save_figure
    import matplotlib
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
