"""Lab: train the GPT with pipeline parallelism and compare with one device.

``python -m labkit lab pipeline`` (what ``make lab`` runs) trains the reference GPT on the
default corpus once on a single device and then on K ranks (4 gloo CPU processes by
default) with each schedule: GPipe, 1F1B and interleaved 1F1B (v chunks per rank), with
the same seed, data and optimizer. It prints one table:

* final train and validation loss, and the gap between the parallel and the single-device
  loss curves (two separate trainings: shown, not judged);
* the verdict (:mod:`labkit.labs.verdict`): at every step, the loss and every parameter
  gradient against the single-device model's at the same parameters (exit status 1 if any
  schedule fails);
* the bubble fraction measured from the runtime's timeline, the formula's
  (K-1)/(vM+K-1), and the simulator's from the measured per-stage F/B times;
* the measured peak number of microbatches in flight per stage; tokens per second.

``--schedule zero-bubble`` runs 1F1B, ZB-H1, ZB-V and DualPipeV (the backward split into I
and W, :mod:`labkit.pipeline.zero_bubble`; ZB-V and DualPipeV hold stages r and 2K-1-r on
rank r); their formula column is the zero-bubble formula from the measured mean T_F, T_I,
T_W (nan where it is not exact for them). ``--cost-model F,I,W`` (milliseconds) makes every
action last at least that long by sleeping without holding a core, so that on fewer cores
than ranks the measured bubble shows the schedule (the output says which measurement it is);
``--trace`` also writes each measured timeline as Chrome trace-event JSON for Perfetto
(``trace-NAME.json``) and, for several schedules, all of them side by side (``trace-all.json``).

Gantt charts of the measured timelines and the loss curves are saved under
``runs/pipeline-YYYYmmdd-HHMMSS/``. The same module runs under
``torchrun --nproc-per-node K -m labkit.labs.pipeline`` (only rank 0 prints and saves).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..cliparse import Parser
from ..pipeline.registry import lookup, names
from ..pipeline.stats import mean_times
from . import HelpFormatter, bad_lr, bad_memory, bad_number, bad_out, bad_seed, is_main_rank, loss_change, schedule_name
from .harness import Lab, Launch, Reference, Report, add_shared_options, lockstep, run, train_reference

SCHEDULES = names(zero_bubble=False)   # gpipe 1f1b interleaved (labkit.pipeline.registry)
ZERO_BUBBLE = names(zero_bubble=True)  # zb-h1 zbv dualpipev: backward split into I and W
GROUPS = {"all": SCHEDULES, "zero-bubble": ("1f1b",) + ZERO_BUBBLE}


LAUNCH_TIMEOUT = 60.0  # seconds a rank waits for a peer before the run fails (labkit.dist.launch)


def _parser():
    p = Parser(prog="python -m labkit lab pipeline", formatter_class=HelpFormatter,
               description="Train the GPT with GPipe, 1F1B and interleaved 1F1B on K ranks.")
    p.add_argument("--world-size", type=int, default=None,
                   help="K pipeline ranks (unset: 4; under torchrun always WORLD_SIZE)")
    p.add_argument("--schedule", nargs="+", default=["all"], choices=tuple(GROUPS) + SCHEDULES + ZERO_BUBBLE,
                   type=schedule_name,
                   help="schedules to run; 'all' = gpipe 1f1b interleaved, 'zero-bubble' = 1f1b zb-h1 zbv dualpipev "
                        "(aliases: zbh1 = zb-h1, zb-v = zbv)")
    p.add_argument("--cost-model", default=None, metavar="F,I,W",
                   help="milliseconds each forward, input-gradient and weight-gradient pass takes at least "
                        "(B = I + W): ranks sleep the rest without holding a core, so the measured bubble shows "
                        "the schedule's, not core sharing (unset: real compute only)")
    p.add_argument("--trace", action="store_true",
                   help="also write each schedule's measured timeline as Chrome trace JSON (open in ui.perfetto.dev)")
    p.add_argument("--microbatches", type=int, default=8, help="M microbatches per step")
    p.add_argument("--chunks", type=int, default=2, help="v model chunks per rank for interleaved 1F1B")
    p.add_argument("--steps", type=int, default=30, help="Adam steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks L")
    p.add_argument("--embd", type=int, default=64, help="hidden size H")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    add_shared_options(p, plots=True)
    p.needs("--chunks", lambda a: "interleaved" in _expanded(a.schedule),
            "--schedule interleaved (or all; got --schedule {schedule})", "--schedule interleaved")
    return p


def _expanded(schedules) -> list[str]:
    """The schedules a --schedule list runs (the groups all and zero-bubble expanded)."""
    return [s for name in schedules for s in GROUPS.get(name, (name,))]


def _bad_args(a, K) -> str | None:
    """The first rule the options break, as a message naming the values; None if all are fine."""
    for flag, value in (("--world-size", K), ("--steps", a.steps), ("--microbatches", a.microbatches),
                        ("--chunks", a.chunks), ("--batch", a.batch), ("--seq", a.seq), ("--layers", a.layers),
                        ("--embd", a.embd), ("--heads", a.heads)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    bad = (bad_lr(a.lr) or bad_number("--tolerance", a.tolerance) or bad_seed(a.seed)
           or bad_out(a.out))
    if bad:
        return bad
    if a.cost_model is not None:
        try:
            cost = _cost_model(a)
        except ValueError:
            return (f"--cost-model takes three numbers >= 0 in milliseconds, finite, F,I,W (e.g. 20,20,20), "
                    f"got {a.cost_model!r}")
        # a rank waits for its peer at most about one step: (v M + K - 1) passes of F + I + W each
        v = max([lookup(s).v(a.chunks)
                 for name in a.schedule for s in GROUPS.get(name, (name,))], default=1)
        step = (v * a.microbatches + K - 1) * (cost["F"] + cost["B"])
        if step > LAUNCH_TIMEOUT / 2:
            return (f"--cost-model {a.cost_model}: one step would last at least (v M + K - 1)(F + I + W) = "
                    f"({v}*{a.microbatches} + {K} - 1) x {(cost['F'] + cost['B']) * 1e3:g} ms = {step:.3g} s, "
                    f"more than half the {LAUNCH_TIMEOUT:g} s a rank waits for a peer; use smaller costs")
    try:
        _config(a)
    except ValueError as e:  # e.g. n_embd=64 must be divisible by n_head=3
        return f"{e} (--embd {a.embd}, --heads {a.heads})"
    return None


def _bad_memory(a, K) -> str | None:
    """The memory estimate's refusal (after the structural rules: they name the real problem)."""
    from ..plan.spec import Layout, ModelSpec
    # the planner's bytes; GPipe keeps the most activations of any schedule (all M in flight)
    spec = ModelSpec.from_gpt_config(_config(a), seq_len=a.seq, global_batch=a.batch)
    lay = Layout(p=K, b=max(1, a.batch // a.microbatches), M=a.microbatches, schedule="gpipe", precision="fp32")
    return bad_memory(spec, lay, f"--layers {a.layers} --embd {a.embd} --seq {a.seq} --batch {a.batch} (K={K})")


def _cost_model(a):
    """--cost-model "F,I,W" (ms) -> runtime cost_model in seconds (B = I + W), or None."""
    if a.cost_model is None:
        return None
    parts = [float(x) for x in a.cost_model.split(",")]
    if len(parts) != 3 or any(not (math.isfinite(x) and x >= 0) for x in parts):
        raise ValueError(a.cost_model)
    f, i, w = (x / 1000 for x in parts)
    return {"F": f, "I": i, "W": w, "B": i + w}


def _stage_ids(kind, K, rank, v):
    """Stages of ``rank``: r and 2K-1-r for the V-shaped schedules, else looped r, r+K, ..."""
    if lookup(kind).v_shaped:
        return [rank, 2 * K - 1 - rank]
    return [s for s in range(K * v) if s % K == rank]


def _n_stages(kind, K, a):
    return lookup(kind).n_stages(K, a.chunks)


def _config(a):
    from ..model import GPTConfig
    return GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq)


def _reference(a, corpus, device) -> Reference:
    """Adam on one device (where the ranks run: CPU for gloo, the first GPU for NCCL): the loss of
    every step; the trained model gives the validation loss."""
    from ..model import GPT

    def step_loss(model, step):
        return model(*(t.to(device) for t in corpus.get_batch("train", a.batch, a.seq, step, a.seed)))
    return train_reference(GPT(_config(a), seed=a.seed).to(device), a.steps, step_loss, a.lr,
                           progress="single device")


@dataclass
class RankResult:
    """One pipeline rank's run: ``losses`` per step (ranks holding the last stage; else empty),
    ``val`` (validation loss, last stage; else None), ``timelines`` (the measured ``(action, start,
    end)`` of the last few steps), ``peak`` (measured peak microbatches in flight per stage),
    ``step_time`` (seconds of the ``timed_steps`` steps 1..), ``verdict`` (rank 0's
    :class:`labkit.labs.verdict.LockstepResult`)."""
    losses: list
    val: float | None
    timelines: list
    peak: dict
    step_time: float
    timed_steps: int
    verdict: object = None


@dataclass
class Row:
    """One schedule's table row: final ``train`` and ``val`` loss, ``curve`` (largest |loss gap| to
    the single-device training: shown, not judged), ``bubble`` (measured, mean of the last steps),
    ``formula`` and ``sim`` (simulator) bubble fractions, ``peak`` in flight per stage,
    ``tokens_per_s``, the last measured ``timeline`` and the ``losses``."""
    schedule: str
    train: float
    val: float
    curve: float
    verdict: object
    bubble: float
    formula: float
    sim: float
    peak: list
    tokens_per_s: float
    timeline: dict
    losses: list


def _rank_train(ctx, a, kind, corpus):
    """One rank of a pipeline run. Returns losses (last stage), timelines, peaks, timing."""
    from tqdm import tqdm

    from ..model import GPT, lm_loss
    from ..pipeline import PipelineStage
    from ..pipeline.stages import gpt_param_name, split_gpt
    from .verdict import module_pieces

    K = ctx.world_size
    v = a.chunks if lookup(kind).chunks is None else 1
    ids = _stage_ids(kind, K, ctx.rank, v)
    S = _n_stages(kind, K, a)
    mods = [m.to(ctx.device) for m in split_gpt(GPT(_config(a), seed=a.seed), S, ids)]
    stages = [PipelineStage(m, s, S, ctx.device, group=ctx.group) for m, s in zip(mods, ids)]
    info = lookup(kind)
    multi = info.chunks != 1
    sched = info.runtime_class(stages if multi else stages[0], a.microbatches, lm_loss, cost_model=_cost_model(a))
    opt = torch.optim.Adam([p for m in mods for p in m.parameters()], lr=a.lr)

    def ref_loss(model, step, extras):  # the reference's loss on step's whole batch (rank 0)
        return model(*(t.to(ctx.device) for t in corpus.get_batch("train", a.batch, a.seq, step, a.seed)))
    check = lockstep(ctx, a, lambda: GPT(_config(a), seed=a.seed), ref_loss)
    losses, timelines, step_time = [], [], 0.0
    # rank 0 only, and only on a terminal (disable=None: tqdm turns itself off when stderr is not a TTY)
    bar = tqdm(range(a.steps), desc=f"{kind} K={K}", leave=False, disable=None if ctx.rank == 0 else True)
    for step in bar:
        x, y = (t.to(ctx.device) for t in corpus.get_batch("train", a.batch, a.seq, step, a.seed))
        mb_losses: list = []
        t0 = time.perf_counter()
        sched.step(x, target=y, losses=mb_losses)
        elapsed = time.perf_counter() - t0
        loss = torch.stack(mb_losses).mean().item() if mb_losses else None
        # the verdict: loss and gradients against the reference at these parameters (not timed)
        check.step(step, [p for m in mods for p in module_pieces(m, lambda n, m=m: gpt_param_name(m, n))], loss)
        t0 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step > 0:  # the first step also infers the activation shapes
            step_time += elapsed + time.perf_counter() - t0
        if loss is not None:
            losses.append(loss)
        if step >= min(max(1, a.steps - 5), a.steps - 1):  # step 0 only when it is the only one
            timelines.append([tuple(t) for t in sched.timeline])
    val_losses: list = []
    x, y = (t.to(ctx.device) for t in corpus.get_batch("val", a.batch, a.seq, 0, a.seed))
    sched.step(x, target=y, losses=val_losses, forward_only=True)
    return RankResult(losses, torch.stack(val_losses).mean().item() if val_losses else None, timelines,
                      dict(sched.peak_in_flight), step_time, a.steps - 1, check.result())


def _analyse(a, kind, K, results, single):
    """Numbers for one schedule's table row, from the per-rank results."""
    from ..pipeline import TimedAction, bubble_fraction, simulate
    from ..pipeline.schedules import Action
    if kind in ZERO_BUBBLE:
        return _analyse_zero_bubble(a, kind, K, results, single)
    v = a.chunks if lookup(kind).chunks is None else 1
    M = a.microbatches
    last = results[K - 1]
    n_tl = len(results[0].timelines)
    measured, tls = [], []
    for i in range(n_tl):
        tl = {r: [TimedAction(Action(*act), s, e) for act, s, e in results[r].timelines[i]] for r in range(K)}
        tls.append(tl)
        measured.append(float(bubble_fraction(tl, K)))
    # mean measured F and B time per stage, then simulate the schedule with them
    times = mean_times(tls, K * v)
    sim = simulate(lookup(kind).schedule(K, M, v), forward=times["F"], backward=times["B"])
    peak = {}
    for r in results:
        peak.update(r.peak)
    curve = max(abs(p - q) for p, q in zip(last.losses, single.losses))  # drifts: shown, not judged
    tokens = results[0].timed_steps * a.batch * a.seq
    return Row(kind if v == 1 else f"{kind} v={v}", last.losses[-1], last.val, curve, results[0].verdict,
               sum(measured) / len(measured), float(lookup(kind).bubble_fraction(K, M, v)), float(sim.bubble_fraction),
               [peak[s] for s in sorted(peak)],
               tokens / results[0].step_time if tokens else float("nan"),  # nan: no timed step
               tls[-1], last.losses)


def _analyse_zero_bubble(a, kind, K, results, single):
    """The table row of a zero-bubble schedule: measured bubble; the formula's, from the
    measured mean T_F, T_I, T_W (where the formula is exact for them, else nan); the
    simulator's with the measured per-stage times."""
    from ..pipeline import TimedAction, bubble_fraction, simulate
    from ..pipeline.schedules import Action
    info = lookup(kind)
    M, S = a.microbatches, _n_stages(kind, K, a)
    last = results[0] if info.v_shaped else results[K - 1]  # V: the last stage is on rank 0
    tls = [{r: [TimedAction(Action(*act), s, e) for act, s, e in results[r].timelines[i]] for r in range(K)}
           for i in range(len(results[0].timelines))]
    measured = [float(bubble_fraction(tl, K)) for tl in tls]
    times = mean_times(tls, S)
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    f, i, w = mean["F"], mean.get("I", 0.0), mean.get("W", 0.0)
    sim = simulate(info.schedule(K, M), forward=times["F"], backward=times.get("B", [i + w] * S),
                   backward_input=times.get("I"), backward_weight=times.get("W"),
                   overlapped=info.overlapped(K, M))
    chunks = info.v()
    work = chunks * M * (f + i + w)
    exact = {"zb-h1": lambda: w <= min(f, i) * 1.15, "zbv": lambda: M >= 2 * K - 1,  # zbv: exact for any costs
             "dualpipev": lambda: abs(f - i) <= 0.15 * max(f, i) and w <= i * 1.15}[kind]()
    if exact:
        name = kind
        fi = (f + i) / 2 if kind == "dualpipev" else None
        t = lookup(name).bubble_time(K, fi or f, fi or i, w)
        formula = t / (work + t)
    else:
        formula = float("nan")
    peak = {}
    for r in results:
        peak.update(r.peak)
    curve = max(abs(p - q) for p, q in zip(last.losses, single.losses))  # drifts: shown, not judged
    tokens = results[0].timed_steps * a.batch * a.seq
    return Row(kind, last.losses[-1], last.val, curve, results[0].verdict, sum(measured) / len(measured), formula,
               float(sim.bubble_fraction), [peak[s] for s in sorted(peak)],
               tokens / results[0].step_time if tokens else float("nan"), tls[-1], last.losses)


def _save_plots(folder: Path, rows, single, K):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..pipeline.plot import plot_timeline
    from . import save_figure
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 2.2 * len(rows) + 0.5), squeeze=False)
    for ax, row in zip(axes[:, 0], rows):
        plot_timeline(row.timeline, ax=ax, title=f"{row.schedule} (measured, K={K}), last step",
                      note=f"table: mean of the last steps {row.bubble:.1%}", unit="s")
    fig.tight_layout()
    save_figure(fig, folder / "timelines.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(single.losses, label="single device", linewidth=3, alpha=0.4, color="black")
    for row in rows:
        ax.plot(row.losses, label=row.schedule, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, folder / "loss_curves.png", dpi=110)
    plt.close(fig)


def _kinds(a) -> list[str]:
    """The schedules ``--schedule`` names, groups expanded, each once."""
    return list(dict.fromkeys(k for name in a.schedule for k in GROUPS.get(name, (name,))))


class PipelineLab(Lab):
    """``python -m labkit lab pipeline``: one run per schedule on K ranks."""
    name = "pipeline"

    def parser(self):
        return _parser()

    def resolve(self, a, world):
        if world is not None:
            if a.world_size not in (None, world) and is_main_rank():
                print(f"note: --world-size {a.world_size} ignored under torchrun: K = WORLD_SIZE = {world}",
                      file=sys.stderr)
            a.world_size = world
        elif a.world_size is None:
            a.world_size = 4
        return None

    def check(self, a):
        from ..dist import choose_backend
        from ..pipeline import ScheduleError, check_pipeline_sizes
        from ..pipeline.stages import stage_layers
        K = a.world_size
        bad = _bad_args(a, K)
        if bad:
            return bad
        try:  # every size error before any process starts
            for kind in _kinds(a):
                v = a.chunks if lookup(kind).chunks is None else 1
                check_pipeline_sizes(K, a.microbatches, v)
                stage_layers(a.layers, _n_stages(kind, K, a), 0)
                if kind in ZERO_BUBBLE:  # their own rules, e.g. DualPipeV's M >= 2K
                    lookup(kind).schedule(K, a.microbatches)
            if a.batch % a.microbatches:
                raise ScheduleError(f"--batch {a.batch} is not divisible by --microbatches {a.microbatches}")
        except ScheduleError as e:
            return str(e)
        bad = _bad_memory(a, K)
        if bad:
            return bad
        try:
            self.backend = choose_backend(K, a.backend)
        except ValueError as e:
            return str(e)
        return None

    def load_corpus(self, a):
        from ..data import Corpus
        return Corpus.load(a.data, block_size=a.seq)

    def start(self, a, corpus):
        if is_main_rank():
            print(f"pipeline lab: GPT L={a.layers} H={a.embd}, batch {a.batch}x{a.seq} tokens, {a.steps} Adam steps "
                  f"(lr {a.lr}), K={a.world_size} ranks, M={a.microbatches}, data: {corpus.source}")

    def runs(self, a, corpus):
        return [Launch(kind, a.world_size, _rank_train, (a, kind, corpus), timeout=LAUNCH_TIMEOUT)
                for kind in _kinds(a)]

    def reference(self, a, corpus):
        # the reference runs where the ranks run: CPU for gloo, the first GPU for NCCL
        device = torch.device("cuda", 0) if self.backend == "nccl" else torch.device("cpu")
        ref = _reference(a, corpus, device)
        with torch.no_grad():
            self.val = ref.model(*(t.to(device) for t in corpus.get_batch("val", a.batch, a.seq, 0, a.seed))).item()
        return ref

    def report(self, a, outcome):
        K, single = a.world_size, outcome.reference
        rows = self.rows = [_analyse(a, kind, K, results, single) for kind, results in outcome.results.items()]
        head = (f"{'schedule':<16} {'train':>7} {'val':>7} {'curve gap':>10} {'bubble':>7} {'formula':>8} "
                f"{'sim':>6} {'peak in flight/stage':<24} {'tokens/s':>9}")
        print(head)
        print("-" * len(head))
        print(f"{'single device':<16} {single.losses[-1]:>7.4f} {self.val:>7.4f} {'-':>10} {'':>7} {'':>8} "
              f"{'':>6} {'':<24} {single.tokens_per_s(a.batch * a.seq):>9.0f}")
        for r in rows:
            print(f"{r.schedule:<16} {r.train:>7.4f} {r.val:>7.4f} {r.curve:>10.1e} {r.bubble:>7.1%} "
                  f"{r.formula:>8.1%} {r.sim:>6.1%} {str(r.peak):<24} {r.tokens_per_s:>9.0f}")
        if a.cost_model is not None:
            print(f"cost model: every F, I, W lasts at least {a.cost_model} ms (B = I + W), sleeping the rest; the "
                  f"bubble then shows the schedule rather than ranks waiting for a core. Run without --cost-model for "
                  f"the real-compute measurement.")
        else:
            print("real compute: the times are what the ranks measured (no cost model).")
        if any(r.schedule in ZERO_BUBBLE for r in rows):
            print("zero-bubble formulas: zb-h1 (K-1)(T_F+T_I-T_W), zbv (K-1)T_F for T_F=T_I=T_W and for any costs "
                  "the maximum of labkit.pipeline.zbv_bubble_terms (M >= 2K-1), dualpipev (K-1)(F&B+B-3W) with "
                  "F&B=F+B, from the measured mean T_F, T_I, T_W (nan: not exact for them).")
        print(f"\ntrain loss {loss_change(single.losses[0], single.losses[-1])}. "
              f"curve gap: largest |loss difference| between the two separate trainings (shown, not judged). "
              f"bubble: measured from the runtime's timeline (mean of the last steps); formula (K-1)/(vM+K-1); "
              f"sim = simulator with the measured mean F/B time per stage and free communication.")
        cores = os.cpu_count() or 1
        if self.backend == "gloo" and K > cores:
            print(f"note: {K} ranks share {cores} CPU cores, so a rank often waits for a core; the measured bubble "
                  f"and F/B times include that wait.")
        return Report({r.schedule: r.verdict for r in rows})

    def files(self, a, outcome, folder):
        if not a.no_plots:
            _save_plots(folder, self.rows, outcome.reference, a.world_size)
            print(f"plots: {folder / 'timelines.png'}, {folder / 'loss_curves.png'}")
        if a.trace:
            _write_traces(folder, self.rows)


LAB = PipelineLab()


def main(argv=None) -> int:
    """``python -m labkit lab pipeline``: the exit code (see :func:`labkit.labs.harness.run`)."""
    return run(LAB, argv).rc


def _write_traces(folder: Path, rows) -> None:
    """Each schedule's measured timeline as Chrome trace JSON, written all or nothing."""
    import tempfile

    from ..pipeline.trace import write_chrome_trace
    from . import _output_error, write_bytes_atomic
    files = [(folder / f"trace-{row.schedule.replace(' ', '')}.json",
              {f"{row.schedule} (measured, last step)": row.timeline}) for row in rows]
    if len(rows) > 1:  # every schedule side by side, one Perfetto process each
        files.append((folder / "trace-all.json",
                      {f"{row.schedule} (measured, last step)": row.timeline for row in rows}))
    for path, timelines in files:
        try:  # rendered aside, then written atomically
            with tempfile.TemporaryDirectory() as tmp:
                made = write_chrome_trace(Path(tmp) / path.name, timelines)
                data = Path(made).read_bytes()
        except OSError as e:
            raise _output_error(path, e) from None
        write_bytes_atomic(path, data)
        print(f"trace (open in https://ui.perfetto.dev): {path}")


if __name__ == "__main__":
    from . import run_cli
    sys.exit(run_cli(main))
