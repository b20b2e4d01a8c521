"""Interleaved 1F1B beyond Megatron-LM's M % K == 0, as torch's ScheduleInterleaved1F1B runs it
(rounds of M / max(1, M // K) microbatches), and today's warm-up at M = K (Megatron-Core, torch):
on real gloo ranks, equal to one device and to torch.distributed.pipelining, with the peak in
flight per rank and per stage measured by the runtime and equal to the simulator and the planner."""
import pytest
import torch
from torch.distributed import pipelining as tpp

from labkit.dist import launch
from labkit.model import GPT, GPTConfig, lm_loss
from labkit.pipeline import PipelineStage, ScheduleInterleaved1F1B, interleaved_schedule, simulate
from labkit.pipeline.schedules import ScheduleError, interleaved_group, interleaved_warmup
from labkit.pipeline.stages import gpt_param_name, gpt_stages_for_rank, step_torch_schedule
from labkit.plan import memory as plan_memory
from labkit.plan.spec import Layout

BATCH, SEQ = 12, 8
RTOL, ATOL = 1e-5, 1e-6


def _cfg(n_layer):
    return GPTConfig(n_layer=n_layer, n_embd=16, n_head=2, block_size=SEQ)


def _batch(i):
    g = torch.Generator().manual_seed(300 + i)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def _grads(mods):
    return {gpt_param_name(m, n): p.grad.clone() for m in mods for n, p in m.named_parameters()}


def _rank(ctx, M, v, n_layer):
    K = ctx.world_size
    ids = [s for s in range(K * v) if s % K == ctx.rank]
    model = GPT(_cfg(n_layer), seed=0)
    mods = gpt_stages_for_rank(model, K, v, ctx.rank)
    sched = ScheduleInterleaved1F1B([PipelineStage(m, s, K * v, group=ctx.group) for m, s in zip(mods, ids)],
                                    M, lm_loss)
    x, y = _batch(0)
    sched.step(x, target=y)
    out = {"grads": _grads(mods), "peak_stage": dict(sched.peak_in_flight)}
    live = top = 0                          # peak per rank, from the order the runtime ran
    for e in sched.timeline:
        live += (e.action.kind == "F") - (e.action.kind == "B")
        top = max(top, live)
    out["peak_rank"] = top
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.5)
    opt.step()
    opt.zero_grad()
    for i in (1, 2):                        # two more plain-SGD steps
        sched.step(_batch(i)[0], target=_batch(i)[1])
        opt.step()
        opt.zero_grad()
    out["params"] = {gpt_param_name(m, n): p.detach().clone() for m in mods for n, p in m.named_parameters()}
    tmods = gpt_stages_for_rank(GPT(_cfg(n_layer), seed=0), K, v, ctx.rank)
    stages = [tpp.PipelineStage(m, s, K * v, torch.device("cpu"), group=ctx.group) for m, s in zip(tmods, ids)]
    step_torch_schedule(tpp.ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=lm_loss), ctx.rank, K, x, y)
    out["grads_torch"] = _grads(tmods)
    return out


def _reference(n_layer):
    torch.set_num_threads(1)
    model = GPT(_cfg(n_layer), seed=0)
    model(*_batch(0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()
    opt.zero_grad()
    for i in (1, 2):
        model(*_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(got, want, what):
    assert set(got) == set(want), what
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {n}: {m}")


# (K, M, v, n_layer): M % K != 0 above K (one round of 3, of 4, of 6), M < K, and M = K
CASES = [(2, 3, 2, 4), (3, 4, 2, 6), (4, 6, 2, 8), (4, 2, 2, 8), (4, 4, 2, 8)]


@pytest.mark.parametrize("K, M, v, n_layer", CASES)
def test_interleaved_equals_one_device_and_torch_with_measured_peaks(K, M, v, n_layer):
    res = launch(_rank, K, M, v, n_layer, timeout=90)
    ref_grads, ref_params = _reference(n_layer)
    merge = lambda key: {k: t for r in res for k, t in r[key].items()}  # noqa: E731
    _close(merge("grads"), ref_grads, f"K={K} M={M} v={v} grad")
    _close(merge("grads_torch"), ref_grads, f"torch K={K} M={M} v={v} grad")
    _close(merge("params"), ref_params, f"K={K} M={M} v={v} params after 3 SGD steps")
    sched = interleaved_schedule(K, M, v)
    sim = simulate(sched)
    peak_stage = {s: p for r in res for s, p in r["peak_stage"].items()}
    assert [peak_stage[s] for s in range(K * v)] == sim.peak_in_flight
    lay = Layout(p=K, v=v, M=M, schedule="interleaved")
    measured = [r["peak_rank"] for r in res]
    assert measured == [plan_memory.in_flight_units(lay, M, r) for r in range(K)]
    assert measured == [min(interleaved_warmup(K, M, v, r) + 1, v * M) for r in range(K)]
    assert (peak_stage[0], peak_stage[K * v - 1]) == (plan_memory.stage_in_flight(lay, M, "first"),
                                                       plan_memory.stage_in_flight(lay, M, "last"))
    if M == K:   # today's rule: the last rank holds K + 1 chunks, not all 2K (Megatron-LM v2)
        assert measured[K - 1] == K + 1 < v * M


def test_torch_rule_for_rounds_and_warmup():
    """torch's ScheduleInterleaved1F1B: rounds = max(1, M // K) must divide M; warm-up
    (v-1) g + 2 (K-1-r) with g = M / rounds. For K = 2..5 and M < 3K it accepts these M % K != 0."""
    ok = {K: [M for M in range(1, 3 * K) if M % K and not M % max(1, M // K)] for K in range(2, 6)}
    assert ok == {2: [1, 3], 3: [1, 2, 4, 5, 8], 4: [1, 2, 3, 5, 6, 7, 10], 5: [1, 2, 3, 4, 6, 7, 8, 9, 12, 14]}
    for K, Ms in ok.items():
        for M in range(1, 3 * K):
            if M in Ms or M % K == 0:
                assert len(interleaved_schedule(K, M, 2)[0]) > 0
            else:
                with pytest.raises(ScheduleError, match=f"got M={M}"):
                    interleaved_schedule(K, M, 2)
    assert interleaved_group(4, 6) == 6 and interleaved_group(3, 8) == 4 and interleaved_group(4, 8) == 4
    assert [interleaved_warmup(4, 4, 2, r) for r in range(4)] == [8, 8, 6, 4]
    assert [interleaved_warmup(3, 8, 2, r) for r in range(3)] == [8, 6, 4]


def _torch_orders(K, v, Ms):
    """torch's ScheduleInterleaved1F1B compute order of every rank, built in this process on a
    fake process group of K ranks (torch computes all ranks' orders on each rank)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=K)
    try:
        stages = [tpp.PipelineStage(torch.nn.Linear(2, 2), s, K * v, torch.device("cpu")) for s in range(0, K * v, K)]
        out = {}
        for M in Ms:
            order = tpp.ScheduleInterleaved1F1B(stages, n_microbatches=M, loss_fn=lm_loss).pipeline_order
            out[M] = {r: [(a.computation_type.name, a.stage_index, a.microbatch_index)
                          for a in order[r] if a is not None] for r in range(K)}
        return out
    finally:
        dist.destroy_process_group()


def test_compute_order_equals_torch_scheduleinterleaved1f1b():
    """labkit's F/B order on every rank is torch's, action by action, wherever torch accepts
    the sizes (M % K != 0, M < K and M = K included)."""
    kind = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    for K in (2, 3, 4, 5):
        for v in (2, 3):
            Ms = [M for M in range(1, 3 * K + 1) if not M % max(1, M // K)]
            for M, order in _torch_orders(K, v, Ms).items():
                ours = interleaved_schedule(K, M, v)
                for r in range(K):
                    mine = [(a.kind, a.stage, a.microbatch) for a in ours[r] if a.kind in ("F", "B")]
                    assert mine == [(kind[k], s, m) for k, s, m in order[r]], (K, M, v, r)
