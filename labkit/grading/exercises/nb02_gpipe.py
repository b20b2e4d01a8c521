"""Exercises of notebook 02_gpipe: the GPipe schedule as data (Huang et al. 2019, sec. 2.2).

GPipe runs the forwards of all M microbatches through the K stages, then all the backwards,
so every stage keeps the activations of all M microbatches at its peak. The checks judge a
learner's action list with the validator, then run it on real gloo ranks and compare every
parameter gradient with the single-device model. Exercise 2.3 (gradient accumulation) checks
the 1/M scaling of each microbatch's loss with plain SGD, which shows a gradient M times too
large where Adam, scale-invariant, would hide it; its model's loss has a term in its batch's
mean activation (as BatchNorm's statistics), so the gradients themselves show whether the batch
was cut into M microbatches.

The helpers here (a tiny GPT on K ranks, the single-device reference) are shared with the
exercises of notebooks 03 and 04.
"""
from __future__ import annotations

import torch

from ...comm import CommLog
from ...dist import launch
from ...model import GPT, GPTConfig, lm_loss
from ...pipeline import (
    COMPUTE,
    Action,
    PipelineSchedule,
    PipelineStage,
    ScheduleError,
    add_communication,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    parse_actions,
    peak_in_flight,
    validate_schedule,
)
from ...pipeline.stages import gpt_param_name, gpt_stages_for_rank
from ..kernelside.nb02_gpipe import ACC_BATCH, ACC_CFG, ACC_LR, ACC_SEQ, _acc_batch, _accumulate_run, _sgd_run  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, exercise, expect_close, expect_equal
from . import kernel_side

# A tiny GPT: 8 layers split over K*v stages (K=4, v=2 at most), 8 sequences of 16 tokens.
CFG = GPTConfig(n_layer=8, n_embd=32, n_head=2, block_size=16)
BATCH, SEQ = 8, 16


def batch(seed: int = 0):
    """Token ids ``(x, y)``, each [BATCH, SEQ] int64, the same for every rank."""
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def _as_actions(schedule, what: str) -> dict:
    """A learner's ``{rank: [Action]}`` as Actions; CheckFailure when it is not that shape."""
    if not isinstance(schedule, dict):
        raise CheckFailure(f"{what}: expected a dict {{rank: [Action, ...]}}, got {type(schedule).__name__}")
    out = {}
    for r, acts in schedule.items():
        try:
            out[r] = [Action(*a) for a in acts]
        except TypeError:
            raise CheckFailure(f"{what}: rank {r}'s list must hold Action(kind, stage, microbatch) items") from None
    return out


def validated(schedule, what: str, M: int, n_stages: int, fill_communication: bool = False) -> dict:
    """Run the validator; turn its ScheduleError into a CheckFailure that quotes it.

    With ``fill_communication`` a compute-only schedule (F and B actions only) gets its
    sends/receives from :func:`add_communication` first."""
    acts = _as_actions(schedule, what)
    if fill_communication and all(a.kind in COMPUTE for r in acts for a in acts[r]):
        try:
            acts = add_communication(acts, n_stages)
        except ScheduleError as e:
            raise CheckFailure(f"{what}: {e}") from None
    try:
        return validate_schedule(acts, n_microbatches=M, n_stages=n_stages)
    except ScheduleError as e:
        raise CheckFailure(f"{what}: the validator says: {e}") from None


def _pipeline_rank(ctx, actions, M, v, count_sends):
    """One rank: build its stages of the tiny GPT, run one step of ``actions`` (and a
    second, counted with CommLog, when ``count_sends``); return what it measured."""
    K = ctx.world_size
    mods = gpt_stages_for_rank(GPT(CFG, seed=0), K, v, ctx.rank)
    ids = [s for s in range(K * v) if s % K == ctx.rank]
    stages = [PipelineStage(m, s, K * v, group=ctx.group) for m, s in zip(mods, ids)]
    sched = PipelineSchedule(stages, M, lm_loss, actions=actions)
    x, y = batch()
    sched.step(x, target=y)
    out = {"grads": {gpt_param_name(m, n): p.grad.clone() for m in mods for n, p in m.named_parameters()},
           "peak": dict(sched.peak_in_flight), "stash": dict(sched.stash_peak_bytes),
           "timeline": {ctx.rank: list(sched.timeline)}}
    if count_sends:  # the first step also sends shape metadata; count a second one
        with CommLog() as log:
            sched.step(x, target=y)
        out["sends"] = log.count("send")
        out["send_bytes"] = log.bytes("send")
    return out


def run_pipeline(actions: dict, M: int, v: int = 1, count_sends: bool = False, timeout: float = 15) -> dict:
    """Run ``actions`` (``{rank: [Action]}``, K = its number of ranks) for one step of the
    tiny GPT on K forked gloo ranks. Returns ``grads`` (by single-device parameter name),
    ``peak`` and ``stash`` (stage -> measured peak microbatches in flight / bytes stashed),
    ``timeline`` (rank -> [TimedAction]) and, with ``count_sends``, ``sends`` (point-to-point
    sends of one step, all ranks)."""
    res = launch(_pipeline_rank, len(actions), actions, M, v, count_sends, timeout=timeout)
    out = {"grads": {}, "peak": {}, "stash": {}, "timeline": {}, "sends": 0, "send_bytes": 0}
    for r in res:
        for key in ("grads", "peak", "stash", "timeline"):
            out[key].update(r[key])
        out["sends"] += r.get("sends", 0)
        out["send_bytes"] += r.get("send_bytes", 0)
    return out


def reference_grads() -> dict:
    """Parameter gradients of the single-device GPT on :func:`batch` (mean loss)."""
    model = GPT(CFG, seed=0)
    x, y = batch()
    model(x, y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def expect_same_grads(got: dict, what: str) -> None:
    """Every parameter gradient equals the single-device one (fp32 rtol=1e-5, atol=1e-6)."""
    want = reference_grads()
    missing = sorted(set(want) - set(got))
    if missing:
        raise CheckFailure(f"{what}: no gradient for {missing[0]} (and {len(missing) - 1} more)")
    for name in want:
        expect_close(got[name], want[name], f"{what}: gradient of {name} vs single device")


# ----------------------------------------------------------------------------- 2.1
ex21 = exercise(
    "2.1", title="the GPipe action list", notebook="02_gpipe", points=3,
    hint="Section 2: GPipe runs all forwards, then all backwards. On each rank, what must arrive before a "
         "forward can run and what must leave after it, and the same for a backward? Which ranks have no "
         "neighbour on one side?")
ex21.hint2 = ("Write K=2, M=1 by hand, rank 0 and rank 1; the validator's message names the first action that "
              "cannot run. The backwards may run in microbatch order or in reverse order: both are GPipe.")


def _gpipe_shape(sched: dict, K: int, M: int, what: str) -> None:
    """GPipe: on every rank all M forwards come before the first backward."""
    for r in range(K):
        comp = [a for a in sched[r] if a.kind in COMPUTE]
        first_b = next((i for i, a in enumerate(comp) if a.kind == "B"), len(comp))
        late_f = next((a for a in comp[first_b:] if a.kind == "F"), None)
        if late_f is not None:
            raise CheckFailure(f"{what}: rank {r} runs {comp[first_b]!r} before {late_f!r}; GPipe runs all M "
                               f"forwards before the first backward")
    peaks = peak_in_flight(sched, K)
    expect_equal(peaks, [M] * K, f"{what}: peak microbatches in flight per stage")


def _gpipe_case(K: int, M: int):
    def case(gpipe_actions):
        what = f"gpipe_actions(K={K}, M={M})"
        sched = validated(gpipe_actions(K, M), what, M, K)
        expect_equal(sorted(sched), list(range(K)), f"{what}: ranks")
        _gpipe_shape(sched, K, M, what)
    return case


ex21.case("K=2, M=3: valid and GPipe-shaped")(_gpipe_case(2, 3))
ex21.case("K=4, M=8: valid and GPipe-shaped")(_gpipe_case(4, 8))


@ex21.case("K=4, M=4 on 4 real ranks: gradients equal single device", timeout=40)
def _(gpipe_actions):
    what = "gpipe_actions(K=4, M=4) run on 4 ranks"
    sched = validated(gpipe_actions(4, 4), what, 4, 4)
    expect_same_grads(run_pipeline(sched, 4, timeout=15)["grads"], what)


ex21.case("K=1 (no communication)", hidden=True)(_gpipe_case(1, 3))
ex21.case("K=3, M=5", hidden=True)(_gpipe_case(3, 5))
ex21.case("M=1", hidden=True)(_gpipe_case(4, 1))


@ex21.case("K=2, M=2 on 2 real ranks", hidden=True, timeout=30)
def _(gpipe_actions):
    what = "gpipe_actions(K=2, M=2) run on 2 ranks"
    sched = validated(gpipe_actions(2, 2), what, 2, 2)
    expect_same_grads(run_pipeline(sched, 2, timeout=15)["grads"], what)


# ----------------------------------------------------------------------------- 2.2
ex22 = exercise(
    "2.2", title="peak microbatches in flight per stage", notebook="02_gpipe", points=2,
    hint="Section 5: a microbatch is in flight on a stage from its forward until its backward. Walk the lists "
         "and keep a running count per stage: what is the largest value each count reaches?")
ex22.hint2 = ("Only compute actions change the count; sends and receives move data but hold nothing new. The "
              "answer has one number per stage (Action.stage), which is not always one per rank.")

_HAND_1F1B = {0: "F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 F2@s0 SEND_F2@s0 RECV_B1@s0 B1@s0 "
                 "RECV_B2@s0 B2@s0",
              1: "RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1 RECV_F2@s1 F2@s1 B2@s1 "
                 "SEND_B2@s1"}


def _count_case(make, n_stages: int, label: str):
    def case(count_in_flight):
        sched = make()
        got = count_in_flight(sched)
        if isinstance(got, tuple):
            got = list(got)
        want = peak_in_flight(sched, n_stages)
        n_ranks = len(sched)
        if isinstance(got, list) and len(got) == n_ranks != n_stages:
            raise CheckFailure(f"count_in_flight({label}): expected {n_stages} numbers, one per stage ({want}), "
                               f"got {n_ranks}, one per rank ({got}): rank r holds stages r, r+{n_ranks} and so on")
        expect_equal(got, want, f"count_in_flight({label})")
    return case


ex22.case("a hand-written K=2, M=3 schedule")(
    _count_case(lambda: {r: parse_actions(t) for r, t in _HAND_1F1B.items()}, 2, "hand-written 1F1B, K=2, M=3"))
ex22.case("interleaved K=2, M=4, v=2 (two stages per rank, 4 stages)",
          hint="Count per STAGE, not per rank: with interleaving a rank holds several stages, so the list has "
               "one entry per stage (Action.stage). How many stages does this schedule have?")(
    _count_case(lambda: interleaved_schedule(2, 4, 2), 4, "interleaved K=2, M=4, v=2"))


@ex22.case("GPipe K=4, M=8: measured on 4 real ranks", timeout=40)
def _(count_in_flight):
    sched = gpipe_schedule(4, 8)
    measured = run_pipeline(sched, 8, timeout=15)["peak"]
    got = count_in_flight(sched)
    expect_equal(list(got) if isinstance(got, tuple) else got, [measured[s] for s in range(4)],
                 "count_in_flight(GPipe K=4, M=8) vs the peak measured by the runtime")


ex22.case("1F1B K=4, M=6", hidden=True)(_count_case(lambda: one_f_one_b_schedule(4, 6), 4, "1F1B K=4, M=6"))
ex22.case("interleaved K=3, M=6, v=2", hidden=True)(
    _count_case(lambda: interleaved_schedule(3, 6, 2), 6, "interleaved K=3, M=6, v=2"))
ex22.case("GPipe K=1, M=5", hidden=True)(_count_case(lambda: gpipe_schedule(1, 5), 1, "GPipe K=1, M=5"))


# ----------------------------------------------------------------------------- 2.3
ex23 = exercise(
    "2.3", title="accumulate M microbatch gradients", notebook="02_gpipe", points=2,
    hint="The full batch's loss is the MEAN over its samples, and each microbatch's loss is a mean over fewer: "
         "how must a microbatch's loss be weighted so that the M backwards, which add up in .grad, give the "
         "full batch's gradient? Do not zero .grad inside the loop.")
ex23.hint2 = ("Check two things: that the loop makes M microbatches of equal size (print their shapes), and "
              "that the gradients you add up are weighted so that their sum is the batch's mean, not M times "
              "it.")


def _microbatched(M: int):
    """The accumulation the exercise asks for: M chunks, each loss scaled by 1/M (run in the grader)."""
    def step(model, x, y):
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (model(xm, ym) / M).backward()
    return step


def _full_batch(model, x, y):
    model(x, y).backward()


def _scale_hint(got: torch.Tensor, want: torch.Tensor, M: int) -> str:
    """' (... M times ...)' when ``got`` is ``want`` times a constant that is M or 1/M."""
    denom = float((want * want).sum())
    if denom == 0:
        return ""
    ratio = float((got * want).sum()) / denom
    if not torch.allclose(got, ratio * want, rtol=1e-4, atol=1e-7):
        return ""
    if abs(ratio - M) < 1e-3 * M:
        return (f"; it is exactly M={M} times the expected gradient: the M microbatch losses were added up "
                f"as they are, but the batch loss is their MEAN")
    if M > 1 and abs(ratio - 1 / M) < 1e-3 / M:
        return f"; it is 1/M = 1/{M} of the expected gradient: the loss was divided by M twice"
    return f"; it is {ratio:.4g} times the expected gradient"


def _calls_message(calls, M: int) -> str:
    """'; the model was called ...' when the microbatches were not M pieces of BATCH/M sequences."""
    want = [ACC_BATCH // M] * M
    if not isinstance(calls, list) or calls == want or not calls:
        return ""
    return (f"; in one step the model was called {len(calls)} time(s) with batch sizes {calls}, but M={M} "
            f"microbatches of {ACC_BATCH}/{M} = {ACC_BATCH // M} sequences each make {want}: check how x and y are "
            "cut into microbatches")


def _same_grads(got_g: dict, want_g: dict) -> bool:
    return all(isinstance(got_g.get(n), torch.Tensor) and got_g[n].shape == w.shape
               and torch.allclose(got_g[n], w, rtol=1e-5, atol=1e-6) for n, w in want_g.items())


def _accumulate_case(M: int, steps: int, seed: int):
    """The learner's accumulation on :class:`~labkit.grading.kernelside.nb02_gpipe.BatchStatGPT` (its loss has a
    term in its batch's mean activation, so one full-batch call and M microbatch calls give different
    gradients), judged against M chunks of loss L_m / M computed here: the gradients (data) show the split."""
    def case(accumulate_microbatches):
        what = f"accumulate_microbatches(model, x [{ACC_BATCH}, {ACC_SEQ}], y, M={M})"
        got = kernel_side(accumulate_microbatches, _accumulate_run, M, steps, seed)
        if not isinstance(got, (tuple, list)) or len(got) != 3 or not isinstance(got[0], dict):
            raise CheckFailure(f"{what}: the run did not return gradients and parameters")
        got_g, got_p, calls = got
        want_g, want_p = _sgd_run(_microbatched(M), steps, seed)
        if M > 1 and not _same_grads(got_g, want_g) and _same_grads(got_g, _sgd_run(_full_batch, 1, seed)[0]):
            raise CheckFailure(f"{what}: these are the gradients of ONE call of the model on the whole batch: the "
                               f"batch was not split into M={M} microbatches (this model's loss depends on the "
                               "statistics of the batch it is called on, as with BatchNorm, so the split shows in "
                               "the gradients)")
        if not _same_grads(got_g, want_g) and _calls_message(calls, M):
            raise CheckFailure(f"{what}: the accumulated gradients differ from those of M={M} microbatches"
                               + _calls_message(calls, M))
        for name, w in want_g.items():
            g = got_g.get(name)
            if g is None:
                raise CheckFailure(f"{what}: parameter {name} has no gradient afterwards; call loss.backward() "
                                   f"for every microbatch")
            if not torch.allclose(g, w, rtol=1e-5, atol=1e-6) and _scale_hint(g, w, M):
                raise CheckFailure(f"{what}: the accumulated gradient of {name} differs from the expected one"
                                   + _scale_hint(g, w, M))
            expect_close(g, w, f"{what}: the accumulated gradient of {name} vs the full batch's gradient")
        if steps > 1:
            for name, w in want_p.items():
                expect_close(got_p[name], w, f"{what}: parameter {name} after {steps} plain SGD steps "
                                             f"(lr={ACC_LR}) vs training on M={M} microbatches")
    return case


ex23.case("M=4: every parameter gradient equals the full batch's")(_accumulate_case(4, 1, 0))
ex23.case("M=4, 3 plain SGD steps: parameters equal training on M microbatches",
          hint="Plain SGD (not Adam, which divides by the gradient's size) shows a gradient that is a constant "
               "factor off: by what factor does your microbatch loss differ from its share of the batch's "
               "loss?")(_accumulate_case(4, 3, 1))
ex23.case("M=1 is the full batch")(_accumulate_case(1, 1, 2))
ex23.case("M=8 (one sequence per microbatch), 2 SGD steps", hidden=True)(_accumulate_case(8, 2, 3))
ex23.case("M=2, 3 SGD steps", hidden=True)(_accumulate_case(2, 3, 4))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case  # noqa: E402

fresh_case(ex21, "random K, M", lambda r: (r.randint(1, 6), r.randint(1, 10)), _gpipe_case)


def _draw_schedule(r):
    """A random GPipe, 1F1B or interleaved schedule (K, M small), as _count_case's arguments."""
    K = r.randint(1, 4)
    kind = r.choice(("gpipe", "1f1b", "interleaved"))
    if kind == "interleaved":
        v, M = r.randint(2, 3), K * r.randint(1, 3)
        return (lambda: interleaved_schedule(K, M, v)), K * v, f"interleaved K={K}, M={M}, v={v}"
    M = r.randint(1, 8)
    make = gpipe_schedule if kind == "gpipe" else one_f_one_b_schedule
    return (lambda: make(K, M)), K, f"{kind} K={K}, M={M}"


fresh_case(ex22, "random GPipe, 1F1B or interleaved schedule", _draw_schedule, _count_case)
fresh_case(ex23, "random M, steps and weights", lambda r: (r.choice((2, 4, 8)), r.randint(1, 2), r.randint(5, 10 ** 6)),
           _accumulate_case)
