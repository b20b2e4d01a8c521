"""The runtime's split backward (I, then W later) gives the gradients of the unsplit backward:
every new schedule at K = 2 and 4 against a single device (gradients, and parameters after
plain-SGD steps) and against torch's ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble /
ScheduleDualPipeV on the same model, inputs and gloo ranks."""
import copy

import pytest
import torch
from compare import assert_all_close, merge_disjoint  # noqa: E402
from torch.distributed import pipelining as tpp

from labkit.dist import launch
from labkit.model import GPT, GPTConfig, lm_loss
from labkit.pipeline import PipelineStage, ScheduleDualPipeV, ScheduleZBH1, ScheduleZBVZeroBubble, split_backward
from labkit.pipeline.split_backward import backward_input, backward_weight
from labkit.pipeline.stages import gpt_param_name, split_gpt

CFG = GPTConfig(n_layer=8, n_embd=16, n_head=2, block_size=8)
BATCH, SEQ, M = 8, 8, 8
RTOL, ATOL = 1e-5, 1e-6
SCHEDULES = {  # name -> (labkit class, torch class, V placement?)
    "zb-h1": (ScheduleZBH1, tpp.ScheduleInterleavedZeroBubble, False),
    "zbv": (ScheduleZBVZeroBubble, tpp.ScheduleZBVZeroBubble, True),
    "dualpipev": (ScheduleDualPipeV, tpp.ScheduleDualPipeV, True),
}


def _batch(i):
    g = torch.Generator().manual_seed(200 + i)
    return torch.randint(0, 256, (BATCH, SEQ), generator=g), torch.randint(0, 256, (BATCH, SEQ), generator=g)


def _my_stages(K, r, v_shape):
    return [r, 2 * K - 1 - r] if v_shape else [r]


def _named(mods, what):
    def val(p):  # a missing gradient reads as zeros, so a comparison (not a crash) catches it
        return (p.grad if p.grad is not None else torch.zeros_like(p)) if what == "grad" else p.detach()
    return {gpt_param_name(m, n): val(p).clone() for m in mods for n, p in m.named_parameters()}


def _rank(ctx, name, steps):
    K, r = ctx.world_size, ctx.rank
    cls, tcls, v_shape = SCHEDULES[name]
    S = 2 * K if v_shape else K
    ids = _my_stages(K, r, v_shape)
    model = GPT(CFG, seed=0)
    out = {}
    # labkit: one step -> gradients; then `steps` plain-SGD steps -> parameters
    mods = split_gpt(model, S, ids)
    stages = [PipelineStage(m, s, S, group=ctx.group) for m, s in zip(mods, ids)]
    sched = cls(stages if v_shape else stages[0], M, lm_loss)
    x, y = _batch(0)
    sched.step(x, target=y)
    out["grads"] = _named(mods, "grad")
    out["kinds"] = sorted({a.kind for a in sched.actions[r]})
    out["peak_w"] = dict(sched.peak_waiting_for_w)
    out["peak"] = dict(sched.peak_in_flight)
    out["w_bytes"] = dict(sched.w_grads_peak_bytes)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.5)
    opt.step()
    opt.zero_grad()
    for i in range(1, steps):
        sched.step(*_batch(i)[:1], target=_batch(i)[1])
        opt.step()
        opt.zero_grad()
    out["params"] = _named(mods, "param")
    # torch.distributed.pipelining's schedule on the same model and input
    mods = split_gpt(model, S, ids)
    tst = [tpp.PipelineStage(m, s, S, torch.device("cpu"), group=ctx.group) for m, s in zip(mods, ids)]
    tsched = tcls(tst, n_microbatches=M, loss_fn=lm_loss)
    holds_first, holds_last = 0 in ids, S - 1 in ids
    args = (x,) if holds_first else ()
    tsched.step(*args, **({"target": y} if holds_last else {}))
    out["grads_torch"] = _named(mods, "grad")
    return out


def _reference(steps):
    model = GPT(CFG, seed=0)
    model(*_batch(0)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for i in range(steps):
        if i:
            model(*_batch(i)).backward()
        opt.step()
        opt.zero_grad()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _close(got, want, what):
    assert_all_close(got, want, what, RTOL, ATOL)


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_split_backward_equals_single_device_and_torch(name, K):
    steps = 2
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grads, params = _reference(steps)
    finally:
        torch.set_num_threads(n)
    res = launch(_rank, K, name, steps, backend="gloo", timeout=60)
    assert "I" in res[0]["kinds"] and "W" in res[0]["kinds"]
    # measured in flight (F to W) and between I and W equal what the schedule data says
    from labkit.pipeline import dualpipev_schedule, peak_in_flight, peak_waiting_for_w, zb_h1_schedule, zbv_schedule
    data = {"zb-h1": zb_h1_schedule, "zbv": zbv_schedule, "dualpipev": dualpipev_schedule}[name](K, M)
    assert [merge_disjoint(res, "peak")[s] for s in sorted(merge_disjoint(res, "peak"))] == peak_in_flight(data)
    assert [merge_disjoint(res, "peak_w")[s] for s in sorted(merge_disjoint(res, "peak_w"))] == peak_waiting_for_w(data)
    assert all(v > 0 for v in merge_disjoint(res, "w_bytes").values()) or name == "dualpipev"
    _close(merge_disjoint(res, "grads"), grads, f"{name} K={K} grad")
    _close(merge_disjoint(res, "grads_torch"), grads, f"torch {name} K={K} grad")
    _close(merge_disjoint(res, "grads"), merge_disjoint(res, "grads_torch"), f"{name} K={K} vs torch grad")
    _close(merge_disjoint(res, "params"), params, f"{name} K={K} params after {steps} SGD steps")


def _stage_case():
    model = GPT(CFG, seed=0)
    first, last = split_gpt(model, 2)
    x, y = _batch(0)
    return first, last, x, y


def test_split_equals_unsplit_bitwise_and_catches_a_double_count(monkeypatch):
    """On one stage, I + W equal autograd.backward exactly; W that runs from the boundary nodes
    with all parameters as inputs (the double-count bug: the way down to the input is taken
    again) is caught by the same comparison."""
    first, last, x, y = _stage_case()
    h = first(x).detach()
    ref = copy.deepcopy(last)
    hr = h.clone().requires_grad_(True)
    lm_loss(ref(hr), y).backward()
    hs = h.clone().requires_grad_(True)
    gin, pending = backward_input(lm_loss(last(hs), y), hs, None, last.parameters())
    assert all(p.grad is None for p in last.parameters())  # I computed no weight gradient
    assert torch.equal(gin, hr.grad)
    backward_weight(pending)
    for (n, p), q in zip(ref.named_parameters(), last.parameters()):
        assert torch.equal(p.grad, q.grad), n

    def buggy(pending):
        params = [p for ps in pending.params for p in ps]
        edges = [e for es in pending.edges for e in es]
        grads = [g for gs in pending.grads for g in gs]
        torch.autograd.backward(edges, grad_tensors=grads, inputs=params)

    bad = copy.deepcopy(ref)
    bad.zero_grad()
    hb = h.clone().requires_grad_(True)
    _, pending = backward_input(lm_loss(bad(hb), y), hb, None, bad.parameters())
    monkeypatch.setattr(split_backward, "backward_weight", buggy)
    split_backward.backward_weight(pending)
    assert any(not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL)
               for p, q in zip(ref.parameters(), bad.parameters()))


def test_first_stage_has_no_input_gradient_and_w_does_it_all():
    first, _, x, _ = _stage_case()
    ref = copy.deepcopy(first)
    g = torch.randn(BATCH, SEQ, CFG.n_embd, generator=torch.Generator().manual_seed(0))
    ref(x).backward(g)
    gin, pending = backward_input(first(x), None, g, first.parameters())
    assert gin is None and all(p.grad is None for p in first.parameters())
    backward_weight(pending)
    for p, q in zip(ref.parameters(), first.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_the_comparison_catches_a_runtime_that_drops_w(monkeypatch):
    """The same launch and check with W doing nothing (a runtime bug) fails."""
    from labkit.pipeline import runtime
    monkeypatch.setattr(runtime, "backward_weight", lambda pending: None)
    grads, _ = _reference(1)
    res = launch(_rank, 2, "zb-h1", 1, backend="gloo", timeout=60)
    with pytest.raises(AssertionError):
        _close(merge_disjoint(res, "grads"), grads, "zb-h1 without W")
