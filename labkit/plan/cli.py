"""``python -m labkit plan``: memory, communication and step time per GPU, and the best layouts.

Examples::

    python -m labkit plan --model gpt3-175b --gpus 1024 --gpus-per-node 8 --gpu-memory 80
    python -m labkit plan --model mt-nlg-530b --gpus 4480 --layout t=8,p=35,d=16 --recompute full
    python -m labkit plan --model my_model.json --gpus 64
    python -m labkit plan --layers 24 --hidden 2048 --heads 16 --vocab 50304 --seq 2048 --global-batch 512 --gpus 64
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import fields

from ..cliparse import Parser
from .comm import comm_per_rank
from .memory import grad_convention, memory_per_rank
from .planner import GB, PlanError, explain, plan, step_time
from .spec import PRESETS, Cluster, Layout, ModelSpec, load_model_json, preset

__all__ = ["main", "build_parser"]


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The examples as written; every option's default shown, except None (the help says what unset means)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m labkit plan", description=__doc__, formatter_class=_HelpFormatter)
    m = p.add_argument_group("model (a preset, a JSON file, or the sizes)")
    m.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a JSON file with ModelSpec fields "
                                     "(global_batch required there, or give --global-batch)")
    for flag, kw in [("--layers", {"type": int}), ("--hidden", {"type": int}), ("--heads", {"type": int}),
                     ("--kv-heads", {"type": int}), ("--ffn", {"type": int}), ("--vocab", {"type": int}),
                     ("--seq", {"type": int}), ("--global-batch", {"type": int}), ("--experts", {"type": int}),
                     ("--top-k", {"type": int}), ("--shared-experts", {"type": int}), ("--moe-ffn", {"type": int})]:
        m.add_argument(flag, help="override / set this size", **kw)
    m.add_argument("--tied", action="store_true", help="tied input and output embeddings")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, required=True, help="number of GPUs n = t p d")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (TP stays inside one)")
    c.add_argument("--gpu-memory", type=float, default=80, help="GB per GPU")
    c.add_argument("--peak-tflops", type=float, default=312, help="dense peak TFLOP/s per GPU (A100 bf16: 312)")
    c.add_argument("--intra-bw", type=float, default=300, help="GB/s per GPU inside a node (NVLink)")
    c.add_argument("--inter-bw", type=float, default=25, help="GB/s per GPU across nodes (InfiniBand)")
    c.add_argument("--efficiency", type=float, default=0.68,
                   help="share of peak a GEMM reaches (0.68 fits Korthikanti et al. 2022 Table 5)")
    lay = p.add_argument_group("layout")
    lay.add_argument("--layout", help="evaluate this layout, e.g. t=8,p=35,d=16[,v=2,ep=8] (default: search)")
    lay.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage over the DP group")
    lay.add_argument("--precision", default="bf16", choices=["bf16", "fp32"], help="training precision")
    lay.add_argument("--micro-batch", type=int, default=1, help="microbatch size b (sequences)")
    lay.add_argument("--recompute", default=None, choices=["none", "selective", "full"],
                     help="with --layout (default none); the search tries all three")
    lay.add_argument("--no-sp", action="store_true", help="with --layout: sequence parallelism off")
    lay.add_argument("--flash-attention", action="store_true", help="fused attention: no s^2 activations")
    lay.add_argument("--fp32-grads", action="store_true",
                     help="Megatron-LM's convention: fp32 gradients, 18 bytes/param (6 + 12/d with ZeRO-1); "
                          "default labkit's bf16 gradients, 16 bytes/param")
    p.add_argument("--top", type=int, default=8, help="how many layouts to list (the search, without --layout)")
    # the one rule (labkit.cliparse.Parser.needs): an option that changes nothing here is refused
    p.needs("--recompute", lambda a: a.layout is not None, "--layout (the search tries all three)", "--layout")
    p.needs("--no-sp", lambda a: a.layout is not None, "--layout (the search turns SP on with TP)", "--layout")
    p.needs("--top", lambda a: a.layout is None, "the search, which --layout {layout} replaces",
            "no --layout")
    return p


FLAGS = {"n_layer": "--layers", "hidden": "--hidden", "n_head": "--heads", "n_kv_head": "--kv-heads", "ffn": "--ffn",
         "vocab_size": "--vocab", "seq_len": "--seq", "global_batch": "--global-batch",
         "n_routed_experts": "--experts", "n_activated_experts": "--top-k", "n_shared_experts": "--shared-experts",
         "moe_ffn": "--moe-ffn"}
AT_LEAST_ONE = ("n_layer", "hidden", "n_head", "vocab_size", "seq_len", "global_batch",
                "n_kv_head", "ffn", "max_position", "moe_ffn")  # (the optional ones: None or >= 1)
MAX_LAYERS = 10_000  # the search tries every pipeline degree p <= L; published models have < 200 layers
MAX_SIZE = 10**9     # any other size: far beyond a real model


def _bad_field(name: str, value, where: str) -> str | None:
    """Why ``value`` cannot be the ModelSpec field ``name`` (``where`` names its source: a flag
    or ``'model JSON FILE: field NAME'``), or None. Checked before ModelSpec is built, whose
    arithmetic assumes the declared types (``n_layer: true`` would be 1 layer, ``24.5`` a
    TypeError deep in the formulas)."""
    kind = {f.name: str(f.type) for f in fields(ModelSpec)}[name]
    if kind.startswith("int"):
        low = 1 if name in AT_LEAST_ONE else 0
        high = MAX_LAYERS if name == "n_layer" else MAX_SIZE
        if value is None and "None" in kind:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            return f"{where} must be an integer >= {low}, got {json.dumps(value, default=str)}"
        if value > high:
            return f"{where} must be at most {high:,}, got {value:,}"
    elif kind == "float":  # dropout, a probability
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            return f"{where} must be a probability in [0, 1), got {json.dumps(value, default=str)}"
    elif kind == "bool" and not isinstance(value, bool):
        return f"{where} must be true or false, got {json.dumps(value, default=str)}"
    elif kind == "str" and not isinstance(value, str):
        return f"{where} must be a string, got {json.dumps(value, default=str)}"
    return None


def _read_model_json(path: str) -> dict:
    """The JSON object of ``--model FILE``, every field checked (:func:`_bad_field`); raises
    ValueError naming the file (and the field, or the byte that is not text)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise ValueError(f"cannot read model JSON {path!r}: {e.strerror or e}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"--model {path}: not a JSON text file (byte {raw[e.start]:#04x} at offset {e.start} "
                         f"is not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ValueError(f"--model {path}: JSON nested too deeply (a model file is one flat object of "
                         f"ModelSpec fields)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--model {path}: must hold a JSON object of ModelSpec fields, got {type(obj).__name__}")
    known = {f.name for f in fields(ModelSpec)}
    for name, value in obj.items():
        bad = name in known and _bad_field(name, value, f"--model {path}: field {name}")
        if bad:
            raise ValueError(bad)
    return obj


def _model(a) -> ModelSpec:
    sizes = {"n_layer": a.layers, "hidden": a.hidden, "n_head": a.heads, "n_kv_head": a.kv_heads, "ffn": a.ffn,
             "vocab_size": a.vocab, "seq_len": a.seq, "global_batch": a.global_batch, "n_routed_experts": a.experts,
             "n_activated_experts": a.top_k, "n_shared_experts": a.shared_experts, "moe_ffn": a.moe_ffn}
    given = {k: v for k, v in sizes.items() if v is not None}
    for k, v in given.items():
        bad = _bad_field(k, v, FLAGS[k])
        if bad:
            raise ValueError(bad)
    if a.tied:
        given["tied_embeddings"] = True
    if a.model:
        if a.model.endswith(".json") or os.path.exists(a.model):
            _read_model_json(a.model)  # every field's type and range, naming the file and the field
            return load_model_json(a.model, given)
        base = preset(a.model)
        return ModelSpec(**{**base.__dict__, **given}) if given else base
    missing = [f for f, k in (("--layers", "n_layer"), ("--hidden", "hidden"), ("--heads", "n_head"),
                              ("--vocab", "vocab_size"), ("--seq", "seq_len"), ("--global-batch", "global_batch"))
               if k not in given]
    if missing:
        raise ValueError(f"give --model (a preset or JSON file) or the sizes; missing {', '.join(missing)}")
    return ModelSpec(name="custom", **given)


def _parse_layout(text: str, a, spec: ModelSpec) -> Layout:
    kv = {}
    for part in text.split(","):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in ("t", "p", "d", "v", "ep", "M"):
            raise ValueError(f"--layout wants t=..,p=..,d=..[,v=..,ep=..,M=..], got {text!r}")
        try:
            kv[k.strip()] = int(v)
        except ValueError:
            raise ValueError(f"--layout: {k}={v!r} is not an integer") from None
    for k, val in kv.items():
        if val < 1:
            raise ValueError(f"--layout {k}={val} must be >= 1")
    t, p, d = kv.get("t", 1), kv.get("p", 1), kv.get("d", 1)
    if t * p * d != a.gpus:
        raise ValueError(f"--layout t*p*d = {t}*{p}*{d} = {t * p * d} must equal --gpus {a.gpus}")
    v = kv.get("v", 1)
    if v > 1 and spec.n_layer % (p * v):
        raise ValueError(f"--layout p={p}, v={v}: interleaving needs L={spec.n_layer} layers split into p*v = "
                         f"{p * v} equal chunks (Megatron-LM), and {p * v} does not divide {spec.n_layer}")
    M = kv.get("M")
    if M is None and spec.global_batch % (a.micro_batch * d) == 0:
        M = spec.global_batch // (a.micro_batch * d)
    return Layout(t=t, p=p, d=d, v=v, b=a.micro_batch, M=M, schedule="interleaved" if v > 1 else "1f1b",
                  zero=a.zero, sequence_parallel=t > 1 and not a.no_sp, recompute=a.recompute or "none",
                  precision=a.precision, ep=kv.get("ep", 1), fused_attention=a.flash_attention,
                  fp32_grads=a.fp32_grads)


def _row(i, e) -> str:
    L, r, T = e.layout, e.rank, e.time
    return (f"{i:>3} {L.t:>3} {L.p:>3} {L.d:>5} {L.v:>2} {L.ep:>3} {L.M:>5} {L.recompute:>9} "
            f"{r.params / GB:>7.1f} {r.grads / GB:>6.1f} {r.optimizer / GB:>6.1f} {r.activations / GB:>6.1f} "
            f"{e.memory / GB:>7.1f} {T.total:>8.2f} {T.mfu * 100:>5.1f} {T.hfu * 100:>5.1f}")


HEADER = (f"{'#':>3} {'t':>3} {'p':>3} {'d':>5} {'v':>2} {'ep':>3} {'M':>5} {'recompute':>9} "
          f"{'params':>7} {'grads':>6} {'optim':>6} {'activ':>6} {'GB/GPU':>7} {'step s':>8} {'MFU%':>5} {'HFU%':>5}")


def _comm_lines(spec, lay, cluster) -> list[str]:
    out = ["communication per step, pipeline rank 0 (payload as labkit's CommLog counts it; wire = ring bytes sent):"]
    for k, ax in comm_per_rank(spec, lay, cluster, 0).items():
        if not ax.ops:
            continue
        ops = ", ".join(f"{n} x {kind}" for kind, (n, _) in sorted(ax.ops.items()))
        out.append(f"  {k:>2} (group {ax.group}, {ax.link}): {ops}; payload {ax.payload / GB:.2f} GB, "
                   f"wire {ax.wire / GB:.2f} GB")
    from .memory import holds_last
    last = next(r for r in range(lay.p) if holds_last(lay, r))
    loss = comm_per_rank(spec, lay, cluster, last)["loss"]
    if loss.ops:     # the last stage's: the step's valid-target count (before backward) and its reported loss
        n, nbytes = loss.ops["all_reduce"]
        out.append(f"  loss (group {loss.group}, {loss.link}, pipeline rank {last}): {n} x all_reduce of "
                   f"{nbytes // n} B (the step's valid-target count before backward, its loss after)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        for name in ("gpus", "gpus_per_node", "micro_batch", "top"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
        for name in ("gpu_memory", "peak_tflops", "intra_bw", "inter_bw", "efficiency"):
            if not (math.isfinite(getattr(a, name)) and getattr(a, name) > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {getattr(a, name)}")
        if a.efficiency > 1:
            raise ValueError(f"--efficiency is the share of peak a GEMM reaches, in (0, 1], got {a.efficiency}")
        spec = _model(a)
        cluster = Cluster(a.gpus_per_node, a.gpu_memory * GB, a.peak_tflops * 1e12, a.intra_bw * GB,
                          a.inter_bw * GB, a.efficiency)
        header = (f"{spec.name}: {spec.total_params() / 1e9:.1f}B parameters ({spec.active_params() / 1e9:.1f}B "
                  f"active), L={spec.n_layer} h={spec.hidden} a={spec.n_head} s={spec.seq_len} global batch "
                  f"{spec.global_batch}; {a.gpus} GPUs, {a.gpus_per_node} per node, {a.gpu_memory:g} GB each")
        if a.layout is not None:  # every error before the first line of output ("" is an empty layout, refused)
            lay = _parse_layout(a.layout, a, spec)
            ranks = memory_per_rank(spec, lay)
            T = step_time(spec, lay, cluster)
            comm = _comm_lines(spec, lay, cluster)
            print(header)
            print(f"layout {lay.describe()}")
            print(f"memory per GPU by pipeline rank (GB): params grads optimizer activations = total "
                  f"({grad_convention(lay)})")
            for r in ranks:
                flag = "" if r.total <= cluster.gpu_memory else "  > GPU memory"
                print(f"  rank {r.pp_rank:>3}: {r.params / GB:6.1f} {r.grads / GB:6.1f} {r.optimizer / GB:6.1f} "
                      f"{r.activations / GB:7.1f} = {r.total / GB:7.1f}{flag}")
            for line in comm:
                print(line)
            opt = T.total - (T.compute + T.bubble + T.pp + T.dp + T.ep)  # the parts add up to the step
            print(f"predicted step {T.total:.2f} s = compute {T.compute:.2f} (of it TP {T.tp:.2f}, recompute "
                  f"{T.recompute:.2f}) + bubble {T.bubble:.2f} + PP {T.pp:.2f} + DP {T.dp:.2f} + EP {T.ep:.2f} + "
                  f"optimizer {opt:.2f}; "
                  f"MFU {T.mfu * 100:.1f} %, HFU {T.hfu * 100:.1f} % (Korthikanti et al. 2022 eq. 7 / 8, "
                  f"GEMM efficiency {cluster.compute_efficiency:g})")
            return 0
        entries = plan(spec, a.gpus, cluster, zero=a.zero, precision=a.precision, b=a.micro_batch,
                       fused_attention=a.flash_attention, fp32_grads=a.fp32_grads)
        why = explain(spec, entries, cluster, a.gpus)
        comm = _comm_lines(spec, entries[0].layout, cluster)
        print(header)
        print(f"{len(entries)} feasible layouts (TP inside a node, SP on with TP, ZeRO-{a.zero}, {a.precision}; "
              f"{grad_convention(entries[0].layout)}; GEMM efficiency {a.efficiency:g}); fastest first:")
        print(HEADER)
        for i, e in enumerate(entries[:a.top], 1):
            print(_row(i, e))
        print(why)
        for line in comm:
            print(line)
        return 0
    except (ValueError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
