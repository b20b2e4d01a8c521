"""The labs' verdict (labkit.labs.verdict): correct runs pass, bugs injected on purpose fail.

Each lab's rank function is launched directly (tiny model, 2 ranks, 2-3 steps) and rank 0's
LockstepResult is read; the bugs are monkeypatched in before the fork, so every rank has them
(the reference model on rank 0 never runs the patched parallel code paths).
"""
import math

import pytest
import torch

from labkit.data import Corpus
from labkit.dist import launch
from labkit.labs import moe as moe_lab
from labkit.labs import pipeline as pipe_lab
from labkit.labs import tensor as tensor_lab
from labkit.labs.replay import replayed_routing
from labkit.labs.verdict import Lockstep, LockstepResult, Piece, StepRecord, report

CORPUS = Corpus.load()
PIPE = ["--steps", "3", "--microbatches", "2", "--batch", "4", "--seq", "8", "--layers", "2", "--embd", "16",
        "--heads", "2"]
TP = ["--steps", "2", "--batch", "2", "--seq", "8", "--layers", "1", "--embd", "16", "--heads", "2"]
MOE = ["--steps", "2", "--batch", "2", "--seq", "8", "--layers", "2", "--embd", "16", "--heads", "2",
       "--experts", "4", "--ep", "2"]


def _pipeline(kind="1f1b", extra=(), K=2):
    a = pipe_lab._parser().parse_args(PIPE + list(extra))
    return launch(pipe_lab._rank_train, K, a, kind, CORPUS, timeout=20)[0].verdict


def _tensor(extra=(), t=2):
    a = tensor_lab.parse_args(TP + list(extra))
    return launch(tensor_lab._tp_worker, t, a, CORPUS, timeout=20)[0].verdict


def _moe(extra=()):
    a = moe_lab.build_parser().parse_args(MOE + list(extra))
    return launch(moe_lab._ep_worker, a.ep, a, CORPUS, timeout=20)[0].verdict


def _fails(res: LockstepResult, step: int, words: str):
    bad = res.first_failure()
    assert not res.ok and bad is not None and bad.step == step, res.records
    ok, text = report({"run": res})
    assert not ok and "FAIL run  step %d" % step in text and words in text, text


def test_correct_runs_pass_any_seed_grid_and_schedule():
    res = _pipeline("interleaved", ["--seed", "1", "--layers", "4", "--steps", "2"])
    assert res.ok and len(res.records) == 2, res.records
    assert max(max(r.grad_err, r.loss_err) for r in res.records) < 0.5
    assert _tensor(t=1).ok  # --tp 1 is handled: a group of one
    res = _moe(["--seed", "3"])
    assert res.ok and len(res.records) == 2


def test_pipeline_gradient_scaled_by_M_fails(monkeypatch):
    from labkit.pipeline.runtime import PipelineSchedule
    orig = PipelineSchedule._do_backward

    def no_division_by_M(self, a, st):  # the bug: the last stage backpropagates loss, not loss / M
        if self._by_index[a.stage].is_last:
            st.outputs[(a.stage, a.microbatch)] = st.outputs[(a.stage, a.microbatch)] * self.n_microbatches
        return orig(self, a, st)
    monkeypatch.setattr(PipelineSchedule, "_do_backward", no_division_by_M)
    _fails(_pipeline(extra=["--steps", "1"]), 0, "gradient of")


def test_pipeline_dropped_microbatch_fails(monkeypatch):
    from labkit.pipeline.runtime import PipelineSchedule
    orig = PipelineSchedule._do_backward

    def drop_last(self, a, st):  # the bug: the last microbatch contributes no gradient
        if self._by_index[a.stage].is_last and a.microbatch == self.n_microbatches - 1:
            st.outputs[(a.stage, a.microbatch)] = st.outputs[(a.stage, a.microbatch)] * 0
        return orig(self, a, st)
    monkeypatch.setattr(PipelineSchedule, "_do_backward", drop_last)
    _fails(_pipeline("gpipe", ["--steps", "1"]), 0, "gradient of")


def test_pipeline_wrong_schedule_never_says_ok(monkeypatch, capsys):
    """A schedule that loses microbatch 1's backward on stage 0: refused, the lab ends in an error."""
    from labkit.pipeline import schedule_classes, schedules

    def wrong(K, M):
        acts = schedules.one_f_one_b_schedule(K, M)
        acts[0] = [x for x in acts[0] if not (x.kind == "B" and x.microbatch == 1)]
        return acts
    monkeypatch.setattr(schedule_classes.Schedule1F1B, "_builder", staticmethod(wrong))
    from labkit.__main__ import main
    rc = main(["lab", "pipeline", "--world-size", "2", "--schedule", "1f1b", *PIPE])
    out, err = capsys.readouterr()
    assert rc == 1 and "OK" not in out
    assert err.count("\n") == 1 and err.startswith("error: rank ") and "Traceback" not in err, err


def test_nan_is_always_a_fail(monkeypatch):
    # --lr inf, as a library user could set it (the CLI refuses it): step 0 fine, then NaN parameters
    res = _pipeline(extra=["--lr", "inf", "--steps", "2"])
    assert res.records[0].ok and not res.ok
    _fails(res, 1, "NaN")
    # a NaN in the parallel loss, with the gradients left intact, is a FAIL too
    orig = tensor_lab.TensorParallelGPT.forward
    monkeypatch.setattr(tensor_lab.TensorParallelGPT, "forward", lambda self, *a, **k: orig(self, *a, **k) + math.nan)
    _fails(_tensor(), 0, "loss is nan")


def test_tensor_missing_all_reduce_fails(monkeypatch):
    from labkit.tensor_parallel import mappings
    # the bug: f's backward (copy_to_tensor_model_parallel_region) forgets its all-reduce
    monkeypatch.setattr(mappings._CopyToModelParallelRegion, "backward", staticmethod(lambda ctx, g: (g, None)))
    _fails(_tensor(), 0, "gradient of")


def test_tensor_gradient_scaled_by_t_fails(monkeypatch):
    from labkit import comm
    from labkit.tensor_parallel import mappings
    # the bug: g's backward all-reduces the (identical) gradients instead of passing them: t times too large
    monkeypatch.setattr(mappings._ReduceFromModelParallelRegion, "backward",
                        staticmethod(lambda ctx, g: (comm.all_reduce(g.contiguous().clone()), None)))
    _fails(_tensor(), 0, "gradient of")


def test_moe_missing_gradient_sync_fails(monkeypatch):
    monkeypatch.setattr(moe_lab, "sync_replicated_grads", lambda model, group: None)
    _fails(_moe(), 0, "gradient of")


def _replay(model, x, y, recorded):
    """Run the reference with the EP run's recorded routing (2 ranks x 8 tokens); the problems."""
    problems = []
    keep = [torch.ones_like(r, dtype=torch.bool) for r in recorded]
    undo = replayed_routing(model, [[(recorded[0], keep[0])], [(recorded[1], keep[1])]], problems)
    try:
        model(x, y)
    finally:
        undo()
    router = model.moe_layers()[0].router
    assert router.replay is None and not router._forward_hooks  # the replay is undone
    return problems


def test_moe_flipped_top_k_choice():
    """The reference replays the EP run's routing. A choice that differs from the reference's own
    is accepted at a near-tie (scores within TIE: a correct run whose sums ran in another order)
    and reported otherwise (a routing bug)."""
    a = moe_lab.build_parser().parse_args(MOE + ["--capacity-factor", "8"])  # no drops
    cfg, moe = moe_lab.configs(a, "aux_free", 2)
    model = moe_lab.MoEGPT(cfg, moe, a.moe_every, seed=0)
    x, y = CORPUS.get_batch("train", 2, 8, 0, 0)
    router = model.moe_layers()[0].router
    sel = model(x, y)[1][0].router.scores.detach()
    order = sel[3].argsort(descending=True)
    kth, nxt, last = order[1], order[2], order[-1]
    with torch.no_grad():  # bias so that token 3's k-th and (k+1)-th experts score within 1e-8
        router.expert_bias[nxt] += float(sel[3, kth] - sel[3, nxt]) - 1e-8
    own = model(x, y)[1][0].router.indices
    assert kth in own[3] and nxt not in own[3]
    assert _replay(model, x, y, [own[:8].clone(), own[8:].clone()]) == []       # same routing
    near = own[:8].clone()
    near[3][near[3] == kth] = nxt
    assert _replay(model, x, y, [near, own[8:].clone()]) == []                  # a near-tie flip: fine
    far = own[:8].clone()
    far[3][far[3] == kth] = last
    problems = _replay(model, x, y, [far, own[8:].clone()])                     # a real difference
    assert problems and "routed 1 token(s) to experts that score" in problems[0]


def test_lockstep_rules_on_one_rank():
    """No process group: the rules themselves (coverage, copies, NaN, tolerance) on a tiny model."""
    ref = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)

    def loss_fn(m, step, extras):
        return m(x).square().mean()

    par = torch.nn.Linear(3, 2)
    par.load_state_dict(ref.state_dict())
    par(x).square().mean().backward()
    good = [Piece("weight", par.weight.detach(), par.weight.grad), Piece("bias", par.bias.detach(), par.bias.grad)]
    check = Lockstep(None, 0, ref, loss_fn)
    check.step(0, good, par(x).square().mean())
    check.step(1, good[:1])                                                        # bias missing
    check.step(2, [good[0], Piece("bias", par.bias.detach(), par.bias.grad * 1.001)])  # 1e-3 off
    check.step(3, [good[0], Piece("bias", par.bias.detach(), par.bias.grad + math.nan)])
    check.step(4, good, float("inf"))
    r = check.result().records
    assert [s.ok for s in r] == [True, False, False, False, False]
    assert "no rank holds" in r[1].problem and r[2].grad_err > 1 and "NaN" in r[3].problem and "inf" in r[4].problem
    with pytest.raises(ValueError, match="--tolerance|rtol"):
        Lockstep(None, 0, ref, loss_fn, rtol=float("nan"))
    ok, text = report({"a": LockstepResult(1e-5, 1e-6, [StepRecord(0, 1.0, 1.0, 0.0, 0.1, 1e-8, 1e-6, "w")])})
    assert ok and "AT THE SAME PARAMETERS" in text and "drift" in text and "rtol=1e-05" in text


def test_an_exact_match_says_so_instead_of_a_largest_error_of_zero():
    exact = [StepRecord(i, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, "") for i in range(2)]
    ok, text = report({"ep=1": LockstepResult(1e-5, 1e-6, exact)})
    line = text.splitlines()[-1]
    assert ok and line.startswith("OK") and "exactly" in line, line
    assert "largest error" not in line and "gradient of -" not in line and "allowed 0.0e+00" not in line, line
    ok, text = report({"a": LockstepResult(1e-5, 1e-6, [StepRecord(0, 1.0, 1.0, 0.0, 0.1, 1e-8, 1e-6, "w")])})
    assert ok and "largest error 0.1 of the tolerance" in text.splitlines()[-1] and "exactly" not in text


def test_diverged_training_is_one_short_fail_line(capsys):
    """--lr too large: the verdict is FAIL, and says in one short line that training diverged on the
    single device too (not a list of every parameter); a NaN in the parallel run alone still says NaN."""
    from labkit.labs.verdict import DIVERGED, verdict_exit
    res = _pipeline(extra=["--lr", "inf", "--steps", "2"])
    assert verdict_exit({"1f1b": res}, reference_losses=[5.5, math.nan]) == 1
    out, err = capsys.readouterr()
    fail = [l for l in out.splitlines() if l.startswith("FAIL")]
    assert fail == [f"FAIL 1f1b  step 1 (first of 1 failing of 2): {DIVERGED}"], fail
    assert err == f"FAIL: {DIVERGED}\n" and "lower --lr" in err
    # the single device trained fine: not "diverged"; the parameters are listed, first few only
    assert verdict_exit({"1f1b": res}, reference_losses=[5.5, 5.4]) == 1
    out, err = capsys.readouterr()
    fail = [l for l in out.splitlines() if l.startswith("FAIL")][0]
    assert "diverged" not in out + err and "NaN" in fail and " more" in fail and len(fail) < 400, fail
    assert err == "FAIL: 1f1b differ from single-device training (see the lines above)\n"
    # the reference NaN at finite parameters: diverged, whatever the lab passes
    ref = torch.nn.Linear(3, 2)
    check = Lockstep(None, 0, ref, lambda m, step, extras: m(torch.full((1, 3), math.inf)).sum())
    check.step(0, [Piece(n, p.detach().clone(), torch.zeros_like(p)) for n, p in ref.named_parameters()], 1.0)
    rec = check.result().records[0]
    assert not rec.ok and rec.diverged and rec.problem == DIVERGED


def test_the_labs_refuse_an_absurd_lr(capsys):
    from labkit.labs.pipeline import main
    assert main(["--lr", "1e308", "--steps", "2", "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lr must be a finite number in (0, 10]") and err.count("\n") == 1, err
