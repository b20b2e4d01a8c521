"""What ``lab moe`` and ``lab moe --eplb`` share: one parser, the MoE GPT's configuration, the
size rules, the single-device training with its routing histories, and the EP parameter names.

Two labs over one router (:mod:`labkit.labs.moe`: EP against one device and the balancing
runs; :mod:`labkit.labs.moe_eplb`: EPLB replicas). Both import this module and not each other;
``python -m labkit lab moe`` picks one by ``--eplb`` (:func:`wants_eplb`).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch

from ..cliparse import Parser
from ..model import GPTConfig
from ..moe.losses import switch_aux_loss
from ..moe.model import moe_config_for, total_aux_loss
from . import HelpFormatter, bad_lr, bad_memory, bad_number, bad_out, bad_seed
from .harness import add_shared_options

BALANCE_MODES = ("none", "aux", "aux_free")
DEVICE_COEFF = 0.05  # alpha2 of the device-level balance loss (DeepSeek-V2 sec. 2.2.3 trains with 0.05)
EPLB_OPTIONS = ("redundant_experts", "gpus_per_node", "expert_groups", "device_coeff")

DESCRIPTION = "Train the MoE GPT with expert parallelism and watch the experts' loads."


def build_parser() -> argparse.ArgumentParser:
    """The options of ``python -m labkit lab moe`` (with and without ``--eplb``)."""
    p = Parser(prog="python -m labkit lab moe", description=DESCRIPTION, formatter_class=HelpFormatter)
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
    add_shared_options(p, out_default=None, out_help="run folder (unset: runs/moe-<time>)", plots=True)
    p.add_argument("--eplb", action="store_true",
                   help="instead of the standard lab: measure expert loads, rebalance with EPLB (replicas), run "
                        "the replicas on P ranks, compare tokens per GPU with the device-level loss and the aux-free "
                        "bias")
    p.add_argument("--redundant-experts", type=int, default=None,
                   help="--eplb: extra physical experts R - E (unset: P, one more per GPU)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="--eplb: GPUs per node g, CPU ranks grouped into P/g nodes (unset: P, one node)")
    p.add_argument("--expert-groups", type=int, default=None,
                   help="--eplb: expert groups for EPLB's hierarchical policy (unset: the number of nodes)")
    p.add_argument("--device-coeff", type=float, default=None,
                   help=f"--eplb: device-level balance loss alpha2 (unset: {DEVICE_COEFF})")
    for name in EPLB_OPTIONS:   # the one rule for options without effect (labkit.cliparse.Parser.needs)
        p.needs("--" + name.replace("_", "-"), lambda a: a.eplb, "--eplb", "--eplb")
    for opt, why in (("--capacity-factor", "--eplb routes without a capacity limit"),
                     ("--aux-coeff", "--eplb trains no aux-loss run"),
                     ("--compare-mode", "--eplb compares with the unbalanced model")):
        p.needs(opt, lambda a: not a.eplb, f"the standard lab ({why})", "no --eplb")
    return p


def wants_eplb(argv) -> bool:
    """True when ``argv`` (the moe lab's arguments) asks for ``--eplb`` (or an abbreviation of it)."""
    p = build_parser()
    p.defer_needs = True   # only a look: the lab's parse applies the rules
    a, _ = p.parse_known_args(list(argv))
    return a.eplb


def resolve(a, world: int | None) -> None:
    """P: WORLD_SIZE under torchrun (a note when ``--ep`` said otherwise), else ``--ep`` or 4."""
    import sys

    from . import is_main_rank
    if world is not None:
        if a.ep not in (None, world) and is_main_rank():
            print(f"note: --ep {a.ep} ignored under torchrun: P = WORLD_SIZE = {world}", file=sys.stderr)
        a.ep = world
    elif a.ep is None:
        a.ep = 4


def configs(a, balance: str, groups: int):
    """``(GPTConfig, MoEConfig)`` of the lab's MoE GPT with balancing ``balance`` (none | aux |
    aux_free), routing in ``groups`` token groups (the EP run routes each rank's tokens alone)."""
    cfg = GPTConfig(block_size=a.seq, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, ffn_mult=2)
    moe = moe_config_for(cfg, n_routed_experts=a.experts, n_activated_experts=a.top_k,
                         capacity_factor=a.capacity_factor, token_groups=groups,
                         aux_loss_coeff=a.aux_coeff if balance == "aux" else 0.0,
                         expert_bias=balance == "aux_free", bias_update_rate=a.gamma)
    return cfg, moe


def bad_args(a) -> str | None:
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
            cfg, moe = configs(a, mode, a.ep)
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


def bad_eplb_args(a) -> str | None:
    """The first rule the --eplb options break (None: fine); sets ``a.device_coeff``'s default."""
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


@dataclass
class History:
    """Per-step records of one MoE training: ``loss`` (LM + balance loss), ``lm`` (LM loss, nats
    per token), ``loads`` (``[L_moe, E]`` token-slots per expert), ``dropped`` (fraction per MoE
    layer), ``balance`` (the Switch balance loss E * sum f_i P_i per layer, 1 = uniform),
    ``bytes`` (EP runs: the all-to-all bytes ``{"forward": [...], "backward": [...]}``).
    ``h["loads"]`` reads a field by name, as the plotting code does."""
    loss: list = field(default_factory=list)
    lm: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    dropped: list = field(default_factory=list)
    balance: list = field(default_factory=list)
    bytes: list = field(default_factory=list)

    def __getitem__(self, name: str):
        return getattr(self, name)

    def record(self, lm, aux, loads, stats) -> None:
        """Append one step: the losses, the loads and the routers' dropped fraction and balance loss."""
        with torch.no_grad():
            diag = [float(switch_aux_loss(s.router.logits.float(), s.router.indices, 1.0, from_logits=True))
                    for s in stats]
        self.loss.append((lm + aux).item())
        self.lm.append(lm.item())
        self.loads.append(loads.cpu())
        self.dropped.append([s.dropped_fraction for s in stats])
        self.balance.append(diag)


def train_single(model, a, steps: int, corpus, start: int = 0):
    """Train the MoE GPT ``model`` on one device with AdamW for ``steps`` steps from batch
    ``start`` (routing in the groups its config says, the capacity rule of EP), updating the
    aux-loss-free bias from each step's loads. Returns ``(Reference, History)``."""
    from .harness import train_reference
    hist = History()

    def step_loss(m, step):
        x, y = corpus.get_batch("train", a.batch, a.seq, start + step, a.seed)
        lm, stats = m(x, y)
        aux = total_aux_loss(stats)
        loads = torch.stack([s.tokens_per_expert for s in stats])              # [L_moe, E]
        hist.record(lm, aux, loads, stats)
        return lm + aux, loads

    def update_bias(m, loads):
        for layer, load in zip(m.moe_layers(), loads):
            layer.update_bias(load)
    return train_reference(model, steps, step_loss, a.lr, optimizer="adamw", after_backward=update_bias), hist


def model_expert_offset(model) -> int:
    """The global id of this EP rank's first local expert (every MoE layer of the model holds the
    same ones: its ``expert_offset``)."""
    offsets = {m.expert_offset for m in model.modules() if hasattr(m, "expert_offset")}
    if len(offsets) != 1:
        raise ValueError(f"the model's MoE layers hold experts from different offsets {sorted(offsets)}")
    return offsets.pop()


def global_name(name: str, expert_offset: int) -> str:
    """An EP rank's parameter name in the single-device model: local expert i -> expert_offset + i."""
    if ".experts." not in name:
        return name
    head, tail = name.split(".experts.")
    i, rest = tail.split(".", 1)
    return f"{head}.experts.{expert_offset + int(i)}.{rest}"
