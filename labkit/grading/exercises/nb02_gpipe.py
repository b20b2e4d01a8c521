"""Exercises of notebook 02_gpipe: the GPipe schedule as data (Huang et al. 2019, sec. 2.2).

GPipe runs the forwards of all M microbatches through the K stages, then all the backwards,
so every stage keeps the activations of all M microbatches at its peak. The checks judge a
learner's action list with the validator, then run it on real gloo ranks and compare every
parameter gradient with the single-device model. Exercise 2.3 (gradient accumulation) checks
the 1/M scaling of each microbatch's loss with plain SGD, which shows a gradient M times too
large where Adam, scale-invariant, would hide it; its model's loss has a term in its batch's
mean activation (as BatchNorm's statistics), so the gradients themselves show whether the batch
was cut into M microbatches. Exercise 2.4 (ignored targets) asks for the loss each microbatch of
each DP rank backpropagates when the targets of -100 fall unevenly over the d x M pieces of a
step: judged against the step's token mean (one device's ``F.cross_entropy``), with a piece and a
whole rank that hold no valid target; the mean of microbatch means, the per-rank count, the extra
division by M, the missing DP factor d and a sum over the ignored positions are each named. Its
token losses require grad in the kernel, which returns the values and the gradient each [r, m]
sends back (data): losses that carry no gradient (floats, ``.detach()``, ``.tolist()``), a NaN
gradient on an empty step and a gradient that is not the values' are each named too.

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
from ..kernelside.nb02_gpipe import (  # noqa: F401 - run in the kernel
    ACC_BATCH,
    ACC_CFG,
    ACC_LR,
    ACC_SEQ,
    _acc_batch,
    _accumulate_run,
    _sgd_run,
    _step_loss_run,
)
from ..registry import CheckFailure, _shown, exercise, expect_close, expect_equal
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
    hint=("Section 2: GPipe runs all forwards, then all backwards. On each rank, what must arrive before a forward "
          "can run and what must leave after it, and the same for a backward? Which ranks have no neighbour on one "
          "side?"))
ex21.hint2 = ("Write K=2, M=1 by hand, rank 0 and rank 1; the validator's message names the first action that cannot "
              "run. The backwards may run in microbatch order or in reverse order: both are GPipe.")
ex21.hint_review = ("leads: asks what each compute action needs before and after it; the order itself is the "
                    "notebook's numbered prompt, the hint adds only questions and the validator; reviewed 2026-12-06")


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
    hint=("Section 5: a microbatch is in flight on a stage from its forward until its backward. As you read one "
          "rank's actions in order, how does the number in flight on a stage change at each action, and which moment "
          "does the exercise ask about?"))
ex22.hint2 = ("Do sends and receives hold a microbatch? And how many entries must the result have when one rank holds "
              "several stages (see Action.stage)?")
ex22.hint_review = ("leads: restates the definition of in flight and asks how each action changes it; counting and "
                    "keeping the peak are the learner's; reviewed 2026-12-06")

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
          hint=("Count per STAGE, not per rank: with interleaving a rank holds several stages. How many stages does "
                "this schedule have, and how many entries has your result?"))(
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
    hint=("The full batch's loss is the MEAN over its samples, and each microbatch's loss is a mean over fewer: how "
          "must a microbatch's contribution be weighted so that the M backwards, which accumulate in .grad, give the "
          "full batch's gradient? And what does .grad hold after two backward calls in a row: what must the "
          "microbatch loop have left there when it ends?"))
ex23.hint2 = ("Check two things: that the loop makes M microbatches of equal size (print their shapes), and that the "
              "gradients you accumulate are weighted so that they make the batch's mean, not M times it.")
ex23.hint_review = ("leads: asks how a microbatch's contribution must be weighted, and what .grad holds after two "
                    "backward calls and must hold after the loop (the invariant, not an instruction on .grad); "
                    "names M times too large without the operation; "
                    "reviewed 2026-12-06")


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
          hint=("Plain SGD (not Adam, which divides by the gradient's size) shows a gradient that is a "
                "constant factor off: by what factor does your microbatch loss differ from its share of the "
                "batch's loss?"))(_accumulate_case(4, 3, 1))
ex23.case("M=1 is the full batch")(_accumulate_case(1, 1, 2))
ex23.case("M=8 (one sequence per microbatch), 2 SGD steps", hidden=True)(_accumulate_case(8, 2, 3))
ex23.case("M=2, 3 SGD steps", hidden=True)(_accumulate_case(2, 3, 4))


# ----------------------------------------------------------------------------- 2.4
ex24 = exercise(
    "2.4", title="the step loss with ignored targets", notebook="02_gpipe", points=2,
    hint="Section 7: one device divides the sum over ALL the step's valid targets by their number. Each "
         "microbatch of each rank can only add its own share of that sum: which count must every share be "
         "divided by, and what does DP's averaging over the d ranks do to what each rank backpropagates?")
ex24.hint2 = ("Pick one valid target in a sparse microbatch and one in a dense microbatch of another rank: with "
              "what weight does each reach the gradient on one device, and with what weight under your pieces, "
              "once each rank's M backwards have added up and DP has averaged the ranks? Make them agree. And "
              "what should a piece with nothing to learn from contribute?")
ex24.hint_review = ("leads: asks which count every share is divided by and what DP's averaging does to a piece, then "
                    "to compare one target's weight with one device's (an invariant, not a sequence of steps); the "
                    "denominator's scope, the factor, the masking and the empty case stay the learner's; reviewed "
                    "2026-12-06")

_IGNORED = 7.0    # what token_losses holds where the target is ignored (any value: it must not count)


def _step_inputs(seed: int, d: int, M: int, b: int, S: int, empty=()):
    """Per-token losses [d, M, b, S] (float64, values like cross-entropies; _IGNORED + noise where
    ignored) and the valid mask: each piece keeps its own random share of its targets; ``empty``:
    (r, m) pieces with none, m None for the whole rank r."""
    g = torch.Generator().manual_seed(seed)
    losses = torch.rand(d, M, b, S, generator=g, dtype=torch.float64) * 5 + 0.2
    share = torch.rand(d, M, 1, 1, generator=g, dtype=torch.float64) * 0.85 + 0.1
    valid = torch.rand(d, M, b, S, generator=g, dtype=torch.float64) < share
    for r, m in empty:
        if m is None:
            valid[r] = False
        else:
            valid[r, m] = False
    losses = torch.where(valid, losses, _IGNORED + torch.rand(d, M, b, S, generator=g, dtype=torch.float64))
    return losses, valid


def _shares(losses, valid) -> dict:
    """The right answer and the wrong ones a learner would write, [d, M] each (NaN where they divide 0 by 0)."""
    d, M = losses.shape[:2]
    sums = (losses * valid).sum((2, 3))
    n_piece = valid.sum((2, 3)).double()
    n_rank = n_piece.sum(1, keepdim=True).expand(d, M)
    N = float(valid.sum())
    nan = float("nan")
    return {
        "right": sums * d / N if N else torch.zeros(d, M, dtype=torch.float64),
        "mean of means": sums / n_piece / M,
        "per-rank count": sums / n_rank,
        "divided by M": sums * d / N / M if N else torch.full((d, M), nan, dtype=torch.float64),
        "no factor d": sums / N if N else torch.full((d, M), nan, dtype=torch.float64),
        "ignored summed": losses.sum((2, 3)) * d / N if N else torch.full((d, M), nan, dtype=torch.float64),
        "every position": sums * d / valid.numel(),
    }


def _why(name: str, d: int, M: int, n_piece, n_rank) -> str:
    return {
        "mean of means": f"each microbatch's own token mean divided by M (the mean of means): exercise 2.3's 1/M rule "
                         f"holds for microbatches of equal weight, but these pieces hold {n_piece} valid targets, so "
                         f"a target in a sparse piece counts for more than one device gives it",
        "per-rank count": f"each rank divided by its own count of valid targets (a per-rank count): the d={d} ranks' "
                          f"average then weighs every rank alike, but they hold {n_rank} valid targets",
        "divided by M": f"M={M} times too small: divided by M on top of the step's count, which already covers "
                        f"all M microbatches",
        "no factor d": f"d={d} times too small: the d ranks' gradients are AVERAGED (divided by d) after the "
                       f"backward, and nothing here makes up for it",
        "ignored summed": "the ignored positions were added in: token_losses holds arbitrary values where valid is "
                          "False, and they must not count",
        "every position": "divided by every position, ignored ones included: one device counts only the valid "
                          "targets",
    }[name]


def _step_loss_case(seed: int, d: int, M: int, b: int, S: int, empty=(), label: str = ""):
    def case(microbatch_losses):
        losses, valid = _step_inputs(seed, d, M, b, S, empty)
        what = f"microbatch_losses(token_losses [{d}, {M}, {b}, {S}], valid){label}"
        # run next to the learner's code on token_losses that require grad: what comes back is data,
        # the values and, for each [r, m], the gradient its backward sends to token_losses
        ran = kernel_side(microbatch_losses, _step_loss_run, losses.clone(), valid.clone())
        if not (isinstance(ran, tuple) and len(ran) == 2):
            raise CheckFailure(f"the check's kernel-side code returned {type(ran).__name__}, not (result, gradients)")
        got, jac = ran
        if isinstance(got, (list, tuple)):
            raise CheckFailure(f"{what}: expected a tensor of shape [d, M] = [{d}, {M}], got a "
                               f"{type(got).__name__}: the backward needs a tensor computed from token_losses")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (d, M):
            shape = f"shape {list(got.shape)}" if isinstance(got, torch.Tensor) else _shown(got)
            raise CheckFailure(f"{what}: expected a tensor of shape [d, M] = [{d}, {M}], one loss per rank and "
                               f"microbatch, got {shape}")
        got = got.detach().double()
        shares = _shares(losses, valid)
        n_piece = valid.sum((2, 3)).tolist()
        n_rank = valid.sum((1, 2, 3)).tolist()
        N = int(valid.sum())

        def same(a, w):
            return torch.equal(torch.isfinite(a), torch.isfinite(w)) and torch.allclose(
                a[torch.isfinite(a)], w[torch.isfinite(w)], rtol=1e-6, atol=1e-9)
        if not same(got, shares["right"]):
            _wrong_values(what, got, shares, same, d, M, N, n_piece, n_rank, losses, valid)
        _judge_gradient(what, jac, valid, d, M, N)
    return case


def _wrong_values(what, got, shares, same, d, M, N, n_piece, n_rank, losses, valid):
    """Raise the CheckFailure that names why the values ``got`` [d, M] are not the expected ones."""
    named = next((k for k, w in shares.items()
                  if k != "right" and bool(torch.isfinite(w).any()) and same(got, w)), None)
    bad = ~torch.isfinite(got)
    if named is None and bool(bad.any()):
        if N == 0:   # the whole step is empty: name NaN, not a piece (nor any input of a hidden case)
            raise CheckFailure(f"{what}: returned NaN when the step has no valid target (0/0 with a count of 0). "
                               f"A step with nothing to learn from must not put NaN into the gradients")
        r, m = (int(i) for i in bad.nonzero()[0])
        empty_here = n_piece[r][m] == 0
        raise CheckFailure(f"{what}: the loss of rank {r}'s microbatch {m} is {float(got[r, m])}"
                           + (" and that piece has no valid target: 0/0. A piece with nothing to learn from "
                              "must add nothing (and a step with no valid target at all must not give NaN "
                              "either)" if empty_here else ""))
    if named is not None:
        nan_note = (" (and it gives NaN where a piece or a rank has no valid target: 0/0)"
                    if bool(bad.any()) else "")
        raise CheckFailure(f"{what}: {_why(named, d, M, n_piece, n_rank)}{nan_note}")
    step = float(got.sum() / d)
    want = float((losses * valid).sum() / N) if N else 0.0
    raise CheckFailure(f"{what}: the d={d} ranks' average of your accumulated losses is {step:.6g}, but one "
                       f"device's loss (the mean over the step's {N} valid targets) is {want:.6g}; the pieces "
                       f"differ from the expected ones by up to {float((got - shares['right']).abs().max()):.3g}")


def _judge_gradient(what, jac, valid, d, M, N):
    """The values are right: judge the gradient each [r, m] sends to token_losses ([d, M, d, M, b, S]
    from the kernel side, or None when the returned tensor does not require grad)."""
    no_grad = (f"{what}: your losses carry no gradient: the values are right, but nothing flows back from them "
               f"to token_losses (which requires grad here), so the M backwards would leave .grad untouched. "
               f"float(), .item(), .tolist(), .detach() or torch.tensor(...) of a value cuts the graph: "
               f"compute the losses from token_losses with tensor operations")
    if jac is None:
        if N:
            raise CheckFailure(no_grad)
        return   # nothing to learn from: no gradient is the right gradient
    if not isinstance(jac, torch.Tensor) or tuple(jac.shape) != (d, M, *valid.shape):
        raise CheckFailure(f"the check's kernel-side code returned gradients of {_shown(jac)}, not [d, M, d, M, b, S]")
    jac = jac.double()
    if not bool(torch.isfinite(jac).all()):
        raise CheckFailure(f"{what}: the values are right, but the gradient that flows back to token_losses holds "
                           f"NaN or inf" + (" when the step has no valid target" if N == 0 else "")
                           + ": a branch that is not taken (torch.where) or a value multiplied by 0 still "
                             "passes its 0/0 or inf into the backward")
    own = torch.zeros_like(jac, dtype=torch.bool)
    for r in range(d):
        for m in range(M):
            own[r, m, r, m] = True
    if N and not bool(jac.ne(0).any()):
        raise CheckFailure(no_grad)
    if bool(jac[~own].ne(0).any()):
        r, m, r2, m2 = (int(i) for i in jac.ne(0).logical_and(~own).nonzero()[0][:4])
        raise CheckFailure(f"{what}: the loss of rank {r}'s microbatch {m} sends gradient to the tokens of rank "
                           f"{r2}'s microbatch {m2}: each microbatch's backward runs through its own tokens only")
    mask = valid.unsqueeze(0).unsqueeze(0).expand_as(jac) & own
    if bool(jac[own & ~mask].ne(0).any()):
        raise CheckFailure(f"{what}: the values are right, but gradient flows into ignored positions of "
                           f"token_losses: an ignored target must not reach the gradient at all")
    want = d / N if N else 0.0
    off = (jac[mask] - want).abs()
    if off.numel() and float(off.max()) > 1e-9 + 1e-6 * want:
        got_w = float(jac[mask][int(off.argmax())])
        raise CheckFailure(f"{what}: the values are right, but the gradient that flows back is not theirs: a valid "
                           f"target's loss gets weight {got_w:.6g} in the backward, where the values you return "
                           f"weigh it differently; return losses whose graph is the computation of their values")


ex24.case("d=2, M=3: uneven valid targets")(_step_loss_case(241, 2, 3, 2, 8))
ex24.case("d=3, M=2: one microbatch with no valid target")(
    _step_loss_case(242, 3, 2, 2, 8, empty=[(0, 1)], label=" with rank 0's microbatch 1 empty"))
ex24.case("d=2, M=4: one rank with no valid target")(
    _step_loss_case(243, 2, 4, 2, 6, empty=[(1, None)], label=" with rank 1 empty"))
ex24.case("d=1, M=1 is one device's mean")(_step_loss_case(244, 1, 1, 4, 8))
ex24.case("d=4, M=2, pieces of one sequence", hidden=True)(_step_loss_case(245, 4, 2, 1, 16, empty=[(1, 0)]))
ex24.case("no valid target in the whole step", hidden=True)(
    _step_loss_case(246, 2, 2, 2, 4, empty=[(0, None), (1, None)], label=" with every target ignored"))


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
fresh_case(ex24, "random d, M and masks", lambda r: (r.randint(0, 10 ** 6), r.randint(2, 4), r.randint(2, 4),
                                                   r.randint(1, 3), r.randint(2, 12),
                                                   [(r.randrange(2), r.choice((None, 0, 1)))]), _step_loss_case)
fresh_case(ex23, "random M, steps and weights", lambda r: (r.choice((2, 4, 8)), r.randint(1, 2), r.randint(5, 10 ** 6)),
           _accumulate_case)
