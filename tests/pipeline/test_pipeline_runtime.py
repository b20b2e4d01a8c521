"""The pipeline runtime on real gloo ranks equals single-device training and
torch.distributed.pipelining; measurements match the simulator; failures end quickly."""
import os
import time

import pytest
import torch
from compare import assert_all_close, merge_disjoint  # noqa: E402
from procs import live_processes
from torch.distributed import pipelining as tpp

from labkit.dist import RankError, launch
from labkit.model import GPT, GPTConfig, lm_loss
from labkit.pipeline import (
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleError,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    parse_actions,
    simulate,
    validate_schedule,
)
from labkit.pipeline.stages import gpt_param_name, gpt_stages_for_rank, split_gpt, step_torch_schedule

CFG = GPTConfig(n_layer=8, n_embd=32, n_head=2, block_size=16)
BATCH, SEQ = 16, 16
RTOL, ATOL = 1e-5, 1e-6
SCHEDULES = {"gpipe": (ScheduleGPipe, tpp.ScheduleGPipe, 1), "1f1b": (Schedule1F1B, tpp.Schedule1F1B, 1),
             "interleaved": (ScheduleInterleaved1F1B, tpp.ScheduleInterleaved1F1B, 2)}


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def _children_alive():
    return live_processes(ppid=os.getpid())


def _named_grads(mods):
    return {gpt_param_name(m, n): p.grad.clone() for m in mods for n, p in m.named_parameters()}


def _named_params(mods):
    return {gpt_param_name(m, n): p.detach().clone() for m in mods for n, p in m.named_parameters()}


def _labkit_sched(ctx, name, M, mods, ids, **kw):
    cls, _, v = SCHEDULES[name]
    stages = [PipelineStage(m, s, ctx.world_size * v, group=ctx.group) for m, s in zip(mods, ids)]
    return cls(stages if v > 1 else stages[0], M, lm_loss, **kw)


def _run_all(ctx, name, M):
    """One launch per (schedule, K): grads, torch's grads, recompute, SGD with accumulation."""
    K = ctx.world_size
    v = SCHEDULES[name][2]
    ids = [s for s in range(K * v) if s % K == ctx.rank]
    model = GPT(CFG, seed=0)
    out = {}
    # 1. one step: gradients, measured in-flight, stash bytes
    mods = gpt_stages_for_rank(model, K, v, ctx.rank)
    sched = _labkit_sched(ctx, name, M, mods, ids)
    x, y = _batch(0)
    losses = []
    sched.step(x, target=y, losses=losses)
    out["grads"] = _named_grads(mods)
    out["losses"] = [float(l) for l in losses]
    out["peak"] = dict(sched.peak_in_flight)
    out["stash"] = dict(sched.stash_peak_bytes)
    # 2. continue into 3 SGD steps, each accumulating 2 minibatches
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.5)
    for step in range(3):
        for j in range(2):
            if step or j:
                sched.step(*_batch(2 * step + j)[:1], target=_batch(2 * step + j)[1])
        opt.step()
        opt.zero_grad()
    out["params"] = _named_params(mods)
    # 3. recompute: same gradients, less stashed
    mods = gpt_stages_for_rank(model, K, v, ctx.rank)
    sched = _labkit_sched(ctx, name, M, mods, ids, recompute=True)
    sched.step(x, target=y)
    out["grads_recompute"] = _named_grads(mods)
    out["stash_recompute"] = dict(sched.stash_peak_bytes)
    # 4. torch.distributed.pipelining on the same model and input
    mods = gpt_stages_for_rank(model, K, v, ctx.rank)
    stages = [tpp.PipelineStage(m, s, K * v, torch.device("cpu"), group=ctx.group) for m, s in zip(mods, ids)]
    tsched = SCHEDULES[name][1](stages if v > 1 else stages[0], n_microbatches=M, loss_fn=lm_loss)
    step_torch_schedule(tsched, ctx.rank, K, x, y)
    out["grads_torch"] = _named_grads(mods)
    return out


def _reference(n_steps=3):
    model = GPT(CFG, seed=0)
    x, y = _batch(0)
    model(x, y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(n_steps):
        for j in range(2):
            model(*_batch(2 * step + j)).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        loss0 = GPT(CFG, seed=0)(*_batch(0)).item()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, loss0


REF = None


def _ref():
    """Single-device reference, computed once per test process with one thread (as each
    rank uses): the first multi-threaded CPU kernels here take seconds to warm up."""
    global REF
    if REF is None:
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            REF = _reference()
        finally:
            torch.set_num_threads(n)
    return REF


def _assert_close(got, want, what):
    assert_all_close(got, want, what, RTOL, ATOL)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_equals_single_device_and_torch(name, K):
    M = 2 * K
    res = launch(_run_all, K, name, M, timeout=60)
    ref_grads, ref_params, _ = _ref()
    _assert_close(merge_disjoint(res, "grads"), ref_grads, f"{name} K={K} grad")
    _assert_close(merge_disjoint(res, "grads_torch"), ref_grads, f"torch {name} K={K} grad")
    _assert_close(merge_disjoint(res, "grads"), merge_disjoint(res, "grads_torch"), f"{name} K={K} vs torch grad")
    _assert_close(merge_disjoint(res, "params"), ref_params, f"{name} K={K} params after 3 SGD steps")
    # recompute: the same arithmetic, so identical gradients, and far fewer bytes stashed
    g, gr = merge_disjoint(res, "grads"), merge_disjoint(res, "grads_recompute")
    assert all(torch.equal(g[n], gr[n]) for n in g)
    stash, stash_rc = merge_disjoint(res, "stash"), merge_disjoint(res, "stash_recompute")
    mb_act = (BATCH // M) * SEQ * CFG.n_embd * 4  # one stage input [b, S, H] fp32
    peak = merge_disjoint(res, "peak")
    for s in stash:
        assert stash_rc[s] < stash[s] / 5
        assert stash_rc[s] == peak[s] * (mb_act if s > 0 else (BATCH // M) * SEQ * 8)
    # losses: last stage reports the M microbatch losses; their mean is the single-device loss
    last = res[K - 1]["losses"]
    assert len(last) == M
    assert abs(sum(last) / M - REF[2]) < 1e-5
    # measured peak in flight equals the simulator's
    v = SCHEDULES[name][2]
    sim_sched = {"gpipe": lambda: gpipe_schedule(K, M), "1f1b": lambda: one_f_one_b_schedule(K, M),
                 "interleaved": lambda: interleaved_schedule(K, M, v)}
    sim = simulate(sim_sched[name]())
    assert [peak[s] for s in range(K * v)] == sim.peak_in_flight


def _custom(ctx, actions, M, K, v=1):
    ids = [s for s in range(K * v) if s % K == ctx.rank]
    mods = gpt_stages_for_rank(GPT(CFG, seed=0), K, v, ctx.rank)
    stages = [PipelineStage(m, s, K * v, group=ctx.group) for m, s in zip(mods, ids)]
    sched = PipelineSchedule(stages, M, lm_loss, actions=actions)
    sched.step(*_batch(0)[:1], target=_batch(0)[1])
    return _named_grads(mods), dict(sched.peak_in_flight), [tuple(t) for t in sched.timeline]


def test_runtime_runs_a_hand_written_schedule_and_1f1b_with_M_below_K():
    ref_grads, _, _ = _ref()
    # a learner-style 1F1B for K=2, M=2 written as text, receives right before use
    s = {0: parse_actions("F0@s0 SEND_F0@s0 F1@s0 SEND_F1@s0 RECV_B0@s0 B0@s0 RECV_B1@s0 B1@s0"),
         1: parse_actions("RECV_F0@s1 F0@s1 B0@s1 SEND_B0@s1 RECV_F1@s1 F1@s1 B1@s1 SEND_B1@s1")}
    res = launch(_custom, 2, s, 2, 2, timeout=30)
    _assert_close({k: v for r in res for k, v in r[0].items()}, ref_grads, "hand-written")
    # timeline: every action recorded once, in order, F/B with start <= end
    for r, out in enumerate(res):
        acts = [t[0] for t in out[2]]
        assert [tuple(a) for a in acts] == [tuple(a) for a in s[r]]
        assert all(t[1] <= t[2] for t in out[2])
    # 1F1B with M=2 < K=4: warm-up capped at M, runs and is correct
    res = launch(_custom, 4, one_f_one_b_schedule(4, 2), 2, 4, timeout=30)
    _assert_close({k: v for r in res for k, v in r[0].items()}, ref_grads, "1F1B M<K")
    assert [res[r][1][r] for r in range(4)] == [2, 2, 2, 1]
    # one rank holding every stage (K = 1, v = 4) passes tensors locally
    res = launch(_custom, 1, interleaved_schedule(1, 2, 4), 2, 1, 4, timeout=30)
    _assert_close(res[0][0], ref_grads, "K=1 v=4")


HUNG = {
    # rank 1 waits for a message never sent
    "missing send": ({0: [a for a in gpipe_schedule(2, 2)[0] if repr(a) != "SEND_F1@s0"], 1: gpipe_schedule(2, 2)[1]},
                     "the first action that cannot complete is F1@s1 on rank 1 (its action 3): it needs the input "
                     "that rank 0 never sends (SEND_F1@s0 is not in rank 0's list)"),
    # both ranks wait for each other: rank 0 sends F1 only after B0, which needs rank 1's gradient of F0
    "deadlock": ({0: parse_actions("F0@s0 SEND_F0@s0 F1@s0 RECV_B0@s0 B0@s0 SEND_F1@s0 RECV_B1@s0 B1@s0"),
                  1: parse_actions("RECV_F0@s1 F0@s1 RECV_F1@s1 F1@s1 B0@s1 SEND_B0@s1 B1@s1 SEND_B1@s1")},
                 "the first action that cannot complete is B0@s0 on rank 0 (its action 4): deadlock: rank 0's B0@s0 "
                 "waits for SEND_B0@s1, which rank 1 reaches only after its own F1@s1; rank 1's F1@s1 waits for "
                 "SEND_F1@s0, which rank 0 reaches only after its own B0@s0"),
}
WAITING = {  # where each rank is stuck in each case, as the report of that rank says it
    "missing send": {0: "at B0@s0 waiting for RECV_B0@s0 (from rank 1)",
                     1: "at F1@s1 waiting for RECV_F1@s1 (from rank 0)"},
    "deadlock": {0: "at B0@s0 waiting for RECV_B0@s0 (from rank 1)",
                 1: "at F1@s1 waiting for RECV_F1@s1 (from rank 0)"},
}


def _wrong(ctx, case):
    mods = gpt_stages_for_rank(GPT(CFG, seed=0), 2, 1, ctx.rank)
    sched = PipelineSchedule(PipelineStage(mods[0], ctx.rank, 2, group=ctx.group), 2, lm_loss, actions=HUNG[case][0],
                             validate=False)
    sched.step(*_batch(0)[:1], target=_batch(0)[1])


@pytest.mark.parametrize("case", list(HUNG))
def test_wrong_schedule_fails_with_rank_error_and_leaves_no_worker(case):
    """validate=False: the first line names the first action that cannot complete (the same on
    every rank) and says which rank is reporting (the one the RankError names), and where it
    waited; no worker is left."""
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_wrong, 2, case, timeout=3)
    assert time.monotonic() - t0 < 15
    r = info.value.rank
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"rank {r} failed with RuntimeError: pipeline schedule hung: {HUNG[case][1]}; "
                            f"this error is from rank {r}, which was "
                            f"{WAITING[case][r]}"), first
    assert "validate_schedule (skipped with validate=False) reports:" in str(info.value)
    time.sleep(0.2)
    assert _children_alive() == []


def test_wrong_schedule_is_refused_by_the_validator():
    with pytest.raises(ScheduleError, match=r"rank 0, action 3 \(F1@s0\): its result is never sent "
                                            r"\(SEND_F1@s0 is missing\); rank 1 needs it"):
        validate_schedule(HUNG["missing send"][0])
    with pytest.raises(ScheduleError, match=r"deadlock with async sends"):
        validate_schedule(HUNG["deadlock"][0])


def _errors(ctx):
    """Each constructor error is raised before any communication; return the messages."""
    mods = gpt_stages_for_rank(GPT(CFG, seed=0), 2, 1, ctx.rank)
    msgs = []
    for make in [
        lambda: Schedule1F1B(PipelineStage(mods[0], ctx.rank, 2, group=ctx.group), 0, lm_loss),
        lambda: PipelineSchedule(PipelineStage(mods[0], ctx.rank, 2, group=ctx.group), 2, lm_loss,
                                 actions=gpipe_schedule(4, 2)),
        lambda: ScheduleGPipe(PipelineStage(mods[0], ctx.rank, 4, group=ctx.group), 2, lm_loss),
        lambda: ScheduleInterleaved1F1B([PipelineStage(mods[0], ctx.rank, 4, group=ctx.group),
                                         PipelineStage(mods[0], ctx.rank + 2, 4, group=ctx.group)], 5, lm_loss),
        lambda: Schedule1F1B(PipelineStage(mods[0], 1 - ctx.rank, 2, group=ctx.group), 2, lm_loss),
    ]:
        try:
            make()
            msgs.append(None)
        except ScheduleError as e:
            msgs.append(str(e))
    return msgs


def test_build_time_errors_name_values_and_rule():
    msgs = launch(_errors, 2, timeout=20)[0]
    assert "n_microbatches (M) must be an integer >= 1, got 0" in msgs[0]
    assert "the schedule has K=4 ranks but the pipeline group has world size 2" in msgs[1]
    assert "ScheduleGPipe needs one stage per rank: num_stages=4, world size K=2" in msgs[2]
    assert "K=2 ranks needs M split into equal rounds" in msgs[3] and "got M=5" in msgs[3]
    assert "rank 0 holds stages [1] but with K=2 ranks and 2 stages it must hold [0]" in msgs[4]
    with pytest.raises(ScheduleError, match=r"n_layer=8 layers cannot be split evenly into K\*v=3 stages"):
        split_gpt(GPT(CFG, seed=0), 3)


def test_stages_are_built_from_the_same_weights():
    model = GPT(CFG, seed=0)
    stages = gpt_stages_for_rank(model, 4, 2, 0)  # rank 0 of K=4, v=2 with 8 layers: blocks 0 and 4
    assert [st.layer_ids for st in stages] == [[0], [4]]
    assert stages[0].embedding is not None and stages[0].head is None and stages[1].head is None
    ref = dict(model.named_parameters())
    for st in stages:
        for n, p in st.named_parameters():
            assert torch.equal(p, ref[gpt_param_name(st, n)])
    x, _ = _batch(0)
    h = x
    for st in split_gpt(model, 8):
        h = st(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)


def _dropout_recompute(ctx):
    cfg = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16, dropout=0.2)
    out = []
    for recompute in (False, True):
        mods = gpt_stages_for_rank(GPT(cfg, seed=0), 2, 1, ctx.rank)
        sched = Schedule1F1B(PipelineStage(mods[0], ctx.rank, 2, group=ctx.group), 4, lm_loss, recompute=recompute)
        torch.manual_seed(1234 + ctx.rank)
        sched.step(*_batch(0)[:1], target=_batch(0)[1])
        out.append(_named_grads(mods))
    return out


def test_recompute_replays_dropout_masks():
    """With dropout, the recomputed forward must draw the same masks as the first one."""
    for no_rc, rc in launch(_dropout_recompute, 2, timeout=30):
        assert all(torch.equal(no_rc[n], rc[n]) for n in no_rc)


def test_a_hang_inside_a_grid_names_global_ranks():
    """A pipeline group of global ranks [2, 6] (p = 2 inside a larger grid): the report names the
    rank by its global rank too (the one a launch or torchrun names), and says how to read the
    pipeline ranks of the diagnosis."""
    from labkit.pipeline.runtime import explain_hang
    from labkit.pipeline.schedules import Action, Schedule
    sched = Schedule.of(HUNG["missing send"][0])
    msg = explain_hang(sched, 1, Action("F", 1, 1), Action("RECV_F", 1, 1), RuntimeError("Timed out"), [2, 6])
    assert msg.splitlines()[0] == (
        f"pipeline schedule hung: {HUNG['missing send'][1].replace('on rank 1', 'on pipeline rank 1 (global rank 6)')}"
        " (ranks in this sentence are the pipeline group's: global ranks [2, 6]); this error is from pipeline rank 1 "
        "(global rank 6), which was at F1@s1 waiting for RECV_F1@s1 (from pipeline rank 0 (global rank 2))")
    assert "RankError header" not in msg


def _wrong_in_grid(ctx, case="hang"):
    """Two pipelines of p = 2 on 4 ranks (t = 2: pipelines [0, 2] and [1, 3]), the same hung schedule
    (or, ``case="stages"``, global rank 3 holding the wrong stage)."""
    from labkit.grid import ProcessGrid
    grid = ProcessGrid.build(ctx, tp=2, pp=2)
    stage = 1 - grid.pp_rank if case == "stages" and ctx.rank == 3 else grid.pp_rank
    mods = gpt_stages_for_rank(GPT(CFG, seed=0), 2, 1, stage)
    sched = PipelineSchedule(PipelineStage(mods[0], stage, 2, group=grid.pp_group), 2, lm_loss,
                             actions=HUNG["missing send"][0], validate=False)
    sched.step(*_batch(0)[:1], target=_batch(0)[1])


def test_a_hang_in_a_launched_grid_is_reported_by_global_rank():
    with pytest.raises(RankError) as info:
        launch(_wrong_in_grid, 4, timeout=3)
    r = info.value.rank
    pr = r // 2
    peer = 1 - pr
    assert f"this error is from pipeline rank {pr} (global rank {r}), which was " in str(info.value).splitlines()[0]
    assert f"(global rank {peer * 2 + r % 2}))" in str(info.value).splitlines()[0]
    with pytest.raises(RankError, match=r"rank 3 failed with ScheduleError: pipeline rank 1 \(global rank 3\) "
                                        r"holds stages \[0\] but"):
        launch(_wrong_in_grid, 4, "stages", timeout=3)
