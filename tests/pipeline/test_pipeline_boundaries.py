"""Pipeline stage boundaries that carry several tensors (activations, an integer mask, a
float tensor computed from the data without parameters), a parameter-free stage, and a frozen
first stage: the runtime trains them and equals single-device training (outputs, losses,
every parameter gradient, parameters after plain-SGD steps), and only tensors that require
grad get a gradient back (both sides of each boundary agree, counted with CommLog)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.comm import CommLog
from labkit.dist import launch
from labkit.pipeline import PipelineSchedule, PipelineStage, ScheduleError, ScheduleInterleaved1F1B, runtime

V, H, S, B, M = 11, 8, 5, 8, 2
RTOL, ATOL = 1e-5, 1e-6


class Embed(nn.Module):
    """First stage: tokens [b, S] -> (h [b, S, H] float, mask [b, S] long, pos [b, S, H] float
    from the data only: it needs no gradient)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, H))

    def forward(self, idx):
        return self.emb(idx), (idx % 3 != 0).long(), torch.sin(idx.float()[..., None] * self.freq)


class Mix(nn.Module):
    """A parameter-free stage: (h, mask, pos) -> (h', mask, pos)."""

    def forward(self, h, mask, pos):
        return F.gelu(h) * mask[..., None] + 0.1 * pos, mask, pos


class Project(nn.Module):
    """(h, mask, pos) -> (h', mask): a linear layer; the mask goes on, pos is used up."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, h, mask, pos):
        return self.fc(h) * mask[..., None] + pos, mask


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(H, V)

    def forward(self, h, mask):
        return self.out(h + mask[..., None])


# the single-device runs here use one thread, as each rank does (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread")


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def make_stages(frozen_first: bool):
    torch.manual_seed(0)
    mods = [Embed(), Mix(), Project(), Head()]
    if frozen_first:
        mods[0].requires_grad_(False)
    return mods


def batch(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)


def reference(frozen_first, steps=3, lr=0.5):
    """Single device: the four modules one after the other, the same SGD steps."""
    mods = make_stages(frozen_first)
    out = []
    for step in range(steps):
        x, y = batch(step)
        h = mods[0](x)
        for m in mods[1:]:
            h = m(*h)
        loss = loss_fn(h, y)
        loss.backward()
        out.append({"logits": h.detach(), "loss": loss.detach(), "grads": _grads(mods, range(4))})
        _sgd(mods, lr)
    return out, _params(mods, range(4))


@torch.no_grad()
def _sgd(mods, lr):
    """Plain SGD (p -= lr * grad), then zero the gradients (torch.optim would import
    torch._dynamo in every forked rank: seconds)."""
    for m in mods:
        for p in m.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


def _grads(mods, ids):
    return {f"s{s}.{n}": (None if p.grad is None else p.grad.clone()) for m, s in zip(mods, ids)
            for n, p in m.named_parameters()}


def _params(mods, ids):
    return {f"s{s}.{n}": p.detach().clone() for m, s in zip(mods, ids) for n, p in m.named_parameters()}


def pipeline_run(rank, K, group, frozen_first, steps=3, lr=0.5, recompute=False):
    """Interleaved 1F1B, 4 stages over K ranks (stage s on rank s % K)."""
    ids = [s for s in range(4) if s % K == rank]
    mods = [copy.deepcopy(make_stages(frozen_first)[s]) for s in ids]
    sched = ScheduleInterleaved1F1B([PipelineStage(m, s, 4, group=group) for m, s in zip(mods, ids)], M, loss_fn,
                                     recompute=recompute)
    out = []
    for step in range(steps):
        x, y = batch(step)
        losses = []
        with CommLog() as log:
            logits = sched.step(x, target=y, losses=losses)
        sends = {}
        for r in log.records:
            if r.kind in ("send", "recv"):
                sends[(r.kind, r.peer)] = sends.get((r.kind, r.peer), 0) + 1
        out.append({"logits": logits, "losses": losses, "grads": _grads(mods, ids), "p2p": sends})
        _sgd(mods, lr)
    return out, _params(mods, ids)


def _worker(ctx, frozen_first):
    return pipeline_run(ctx.rank, ctx.world_size, ctx.group, frozen_first)


def _check(runs, ref, frozen_first):
    """runs: [(steps, params)] per rank. Equality with the single device at every step."""
    ref_steps, ref_params = ref
    K = len(runs)
    for step, want in enumerate(ref_steps):
        last = runs[(4 - 1) % K][0][step]
        torch.testing.assert_close(last["logits"], want["logits"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(torch.stack(last["losses"]).mean(), want["loss"], rtol=RTOL, atol=ATOL)
        got = {n: g for steps, _ in runs for n, g in steps[step]["grads"].items()}
        assert set(got) == set(want["grads"])
        for n, g in want["grads"].items():
            if g is None:
                assert got[n] is None, f"step {step} {n}: frozen, but it got a gradient"
            else:
                assert got[n] is not None, f"step {step} {n}: no gradient"
                torch.testing.assert_close(got[n], g, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {n}: {m}")
    got = {n: p for _, params in runs for n, p in params.items()}
    for n, p in ref_params.items():
        torch.testing.assert_close(got[n], p, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n} after SGD: {m}")
    assert frozen_first == all(g is None for n, g in ref_steps[0]["grads"].items() if n.startswith("s0."))


@pytest.mark.parametrize("frozen_first", [False, True], ids=["trained", "frozen_first_stage"])
def test_tuple_boundaries_equal_single_device_on_two_ranks(frozen_first):
    runs = launch(_worker, 2, frozen_first, timeout=30)
    _check(runs, reference(frozen_first), frozen_first)
    # messages per step and direction (from step 2 on: the first step also sends shapes).
    # Forward: s0 -> s1 (h, mask, pos), s1 -> s2 (h, mask, pos), s2 -> s3 (h, mask) per microbatch.
    # Backward: only the tensors that require grad: h of s3's input (from s2) always; h of s1's
    # and s2's inputs only when the first stage trains (frozen: h needs no gradient until s2).
    p2p0, p2p1 = runs[0][0][1]["p2p"], runs[1][0][1]["p2p"]
    b = 0 if frozen_first else 1
    assert p2p0[("send", 1)] == M * (3 + 2 + b)          # rank 0 holds s0 and s2
    assert p2p1[("send", 0)] == M * (3 + b + 1)          # rank 1 holds s1 and s3
    assert p2p0[("send", 1)] == p2p1[("recv", 0)] and p2p1[("send", 0)] == p2p0[("recv", 1)]   # both sides agree


def test_tuple_boundaries_on_one_rank_and_a_bug_the_check_catches(monkeypatch):
    """K = 1 (all four stages on this process; neighbours pass tensors locally), both variants,
    with and without recompute; then the bug on purpose: the gradient sent back across a
    boundary doubled -> the check fails."""
    for frozen_first in (False, True):
        for recompute in (False, True):
            _check([pipeline_run(0, 1, None, frozen_first, recompute=recompute)], reference(frozen_first), frozen_first)

    backward = PipelineSchedule._do_backward

    def doubled_input_grads(self, a, st):   # the gradient sent back across a boundary, times 2
        backward(self, a, st)
        key = (a.stage, a.microbatch)
        if key in st.grads:
            st.grads[key] = tuple(2 * g for g in st.grads[key])
    monkeypatch.setattr(PipelineSchedule, "_do_backward", doubled_input_grads)
    with pytest.raises(AssertionError, match="step 0 s"):
        _check([pipeline_run(0, 1, None, False)], reference(False), False)


def test_a_stage_output_that_is_not_tensors_is_refused_clearly():
    class Bad(nn.Module):
        def forward(self, x):
            return {"h": x.float()}
    stages = [PipelineStage(Bad(), 0, 2), PipelineStage(Head(), 1, 2)]
    sched = ScheduleInterleaved1F1B(stages, 1, loss_fn)
    with pytest.raises(ScheduleError, match=r"the output of stage 0 \(sent to stage 1\) must be a tensor or a "
                                            r"non-empty tuple of tensors, got dict"):
        sched.step(torch.zeros(2, S, dtype=torch.long), target=torch.zeros(2, S, dtype=torch.long))
    assert runtime._as_tuple((torch.zeros(1), torch.ones(1, dtype=torch.long)), "x")[1].dtype == torch.long
