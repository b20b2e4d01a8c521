"""Exercises of notebook 10_balance_losses: keeping the experts evenly loaded.

* 10.1 the Switch auxiliary loss ``alpha * E * sum_i f_i P_i`` (Fedus et al. 2021, sec. 2.2,
  eq. 4-6): f from the hard top-k choices (no gradient), P the mean full-softmax probability.
* 10.2 DeepSeek-V2's device-level balance loss (DeepSeek-V2 report sec. 2.2.3, eq. 15-17).
* 10.3 DeepSeek-V3's aux-loss-free bias update ``b_i += gamma * sign(mean load - load_i)``
  (V3 report sec. 2.1.2).

Ground truth: :mod:`labkit.moe.losses` and :func:`labkit.moe.router.update_expert_bias`.
"""
from __future__ import annotations

import torch

from ...moe.losses import device_balance_loss, switch_aux_loss
from ...moe.router import update_expert_bias
from ..kernelside.nb10_balance_losses import _bias_update, _loss_with_grad  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, _shown, exercise, expect_close


def _routing(T: int, E: int, k: int, seed: int, scale: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * scale
    indices = logits.topk(k, dim=-1).indices
    return logits, indices


def _scalar(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise CheckFailure(f"{what}: expected a 0-d tensor (so it can be backpropagated), got {type(x).__name__}")
    if x.numel() != 1:
        raise CheckFailure(f"{what}: expected a scalar (0-d tensor), got shape {tuple(x.shape)}")
    return x.reshape(())


def _device_factors(E: int, k: int, D: int) -> list:
    """10.2's mistakes that scale the whole loss, with the factor each gives (DeepSeek-V2 eq. 15-17)."""
    return [(k, "f was counted per token, not per one of the T k routed slots (k forgotten)"),
            (E / D, "f'_d summed over the device's experts instead of averaged"),
            (D, "an extra factor D: f'_d already carries the scale that makes a uniform routing give 1"),
            (1 / E, "f left a fraction of the slots: in eq. 16 it is scaled so that a uniform routing gives 1 per "
                    "expert"),
            (D / E, "P'_d averaged over the device's experts instead of summed")]


_DEVICE_PROBE = (12, 12, 2, 3)  # T, E, k, D: every factor above differs (k=2, E/D=4, D=3, 1/E, D/E)


def _named_factor(answer, got: float, want: float, factors, probe=None) -> str:
    """The mistake whose factor ``got / want`` is, when exactly one matches; when several match (the case's
    shapes make two factors equal) the answer is asked once more on ``probe`` (T, E, k, D), where they differ."""
    if not want or not got:
        return ""
    ratio = got / want
    found = [text for f, text in factors if abs(ratio - f) <= 1e-4 * abs(f)]
    if len(found) > 1 and probe is not None:
        T, E, k, D = probe
        logits, indices = _routing(T, E, k, 120)
        again, _ = answer.run(_loss_with_grad, logits, indices, (D, 1.0))
        ref = float(device_balance_loss(logits, indices, D, 1.0, from_logits=True))
        if isinstance(again, torch.Tensor) and again.numel() == 1 and ref:
            r2 = float(again.reshape(())) / ref
            found = [text for f, text in _device_factors(E, k, D) if text in found and abs(r2 - f) <= 1e-4 * abs(f)]
    return f" ({found[0]})" if len(found) == 1 else ""


def _loss_case(reference, logits, indices, extra: tuple, what: str, grad: bool = True, factors=None,
               probe=_DEVICE_PROBE):
    """Compare value and d loss / d logits with labkit's ``reference(logits, indices, *extra)``;
    ``factors`` (a list of (factor, mistake)) names a value that is that factor times the right one."""
    def case(answer):
        got, got_grad = answer.run(_loss_with_grad, logits, indices, tuple(extra))
        got = _scalar(got, what)
        ref_x = logits.clone().requires_grad_(True)
        want = reference(ref_x, indices, *extra, from_logits=True)
        if factors is not None and not torch.isclose(got.detach().double(), want.detach().double(),
                                                     rtol=1e-5, atol=1e-6):
            why = _named_factor(answer, float(got), float(want), factors, probe)
            if why:
                raise CheckFailure(f"{what}: value: expected {float(want):.6g}, got {float(got):.6g}{why}")
        expect_close(got.detach(), want.detach(), f"{what}: value")
        if grad:
            if not got.requires_grad or got_grad is None:
                raise CheckFailure(f"{what}: the loss has no gradient w.r.t. the logits (it must flow through P)")
            want.backward()
            expect_close(got_grad, ref_x.grad, f"{what}: gradient w.r.t. the logits (only P carries it; f has none)")
    return case


# ----------------------------------------------------------------------------- 10.1
ex101 = exercise(
    "10.1", title="Switch auxiliary loss", notebook="10_balance_losses", points=3,
    hint=("Section 2 (Switch, eq. 4-6): of the two factors per expert, which one is counted from the choices and "
          "which comes from the router? Which of them must carry the gradient?"))
ex101.hint2 = ("Check the invariant the section states for uniform routing: what value must your loss take then, and "
               "does yours? Are the logits turned into probabilities first?")
ex101.hint_review = ("leads: asks which factor is counted and which is differentiable, and checks the uniform-routing "
                     "value; reviewed 2026-12-06")

_L0 = torch.zeros(4, 4)
_I0 = torch.tensor([[0], [1], [2], [3]])
ex101.case("uniform routing gives alpha")(
    _loss_case(switch_aux_loss, _L0, _I0, (0.01,), "switch_aux_loss(uniform, alpha=0.01)",
               factors=[(1 / 4, "the scale E left out: a uniform routing must give alpha")], probe=None))
ex101.case("T=16, E=4, k=1 (Switch), value and gradient")(
    _loss_case(switch_aux_loss, *_routing(16, 4, 1, 101), (0.1,), "switch_aux_loss(T=16, E=4, k=1, alpha=0.1)"))
ex101.case("T=16, E=8, k=2 (f normalised by T*k)")(
    _loss_case(switch_aux_loss, *_routing(16, 8, 2, 102), (1.0,), "switch_aux_loss(T=16, E=8, k=2, alpha=1.0)",
               factors=[(2, "f was counted per token, not per one of the T k routed slots (k forgotten)"),
                        (1 / 8, "the scale E left out: a uniform routing must give alpha"),
                        (0.5, "divided by k once too often")], probe=None))
ex101.case("all tokens on one expert", hidden=True)(
    _loss_case(switch_aux_loss, torch.tensor([[5.0, 0, 0, 0]] * 6), torch.zeros(6, 1, dtype=torch.long), (0.01,),
               "switch_aux_loss(collapsed)"))
ex101.case("T=64, E=16, k=4", hidden=True)(
    _loss_case(switch_aux_loss, *_routing(64, 16, 4, 103), (0.02,), "switch_aux_loss(T=64, E=16, k=4)"))


# ----------------------------------------------------------------------------- 10.2
ex102 = exercise(
    "10.2", title="device-level balance loss", notebook="10_balance_losses", points=3,
    hint=("Section 3 (DeepSeek-V2 eq. 15-17): the expert-level quantities are grouped by the device that holds each "
          "expert. Do f' and P' combine a device's experts in the same way?"))
ex102.hint2 = ("Check the normalisation: under uniform routing, what is f_j here (not a fraction), what are f' and P' "
               "of a device, and what is the loss? The section states all four.")
ex102.hint_review = ("leads: asks how each device-level quantity combines its experts and checks the uniform values; "
                     "reviewed 2026-12-06")

ex102.case("uniform routing gives alpha2")(
    _loss_case(device_balance_loss, torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), (2, 0.05),
               "device_balance_loss(uniform, D=2, alpha2=0.05)", factors=_device_factors(4, 2, 2)))
ex102.case("T=16, E=8, k=2, D=4")(
    _loss_case(device_balance_loss, *_routing(16, 8, 2, 111), (4, 1.0), "device_balance_loss(T=16, E=8, k=2, D=4)",
               factors=_device_factors(8, 2, 4)))
ex102.case("T=12, E=12, k=2, D=3")(
    _loss_case(device_balance_loss, *_routing(12, 12, 2, 115), (3, 1.0), "device_balance_loss(T=12, E=12, k=2, D=3)",
               factors=_device_factors(12, 2, 3)))
ex102.case("D=1: one device is always balanced")(
    _loss_case(device_balance_loss, *_routing(8, 4, 2, 112), (1, 1.0), "device_balance_loss(T=8, E=4, k=2, D=1)"))
ex102.case("D=E equals the expert-level loss", hidden=True)(
    _loss_case(device_balance_loss, *_routing(24, 6, 2, 113), (6, 0.5), "device_balance_loss(T=24, E=6, k=2, D=6)"))
ex102.case("T=48, E=16, k=3, D=4", hidden=True)(
    _loss_case(device_balance_loss, *_routing(48, 16, 3, 114), (4, 0.05), "device_balance_loss(T=48, E=16, k=3, D=4)"))


# ----------------------------------------------------------------------------- 10.3
ex103 = exercise(
    "10.3", title="aux-loss-free bias update", notebook="10_balance_losses", points=2,
    hint=("Section 4: the bias is a feedback controller with a fixed step gamma. Which experts must become less "
          "attractive, which more, and what happens to one exactly at the mean load?"))
ex103.hint2 = ("Does the size of an expert's imbalance change its step? Check an overloaded expert: does its bias "
               "move so that it is chosen less often?")
ex103.hint_review = ("leads: asks which experts move which way and whether the size matters; no function named; "
                     "reviewed 2026-12-06")


def _bias_case(bias, loads, gamma, what):
    def case(update_bias):
        got = update_bias.run(_bias_update, bias, loads, gamma)
        if not isinstance(got, torch.Tensor):
            raise CheckFailure(f"{what}: expected the new bias tensor, got {type(got).__name__}")
        want = update_expert_bias(bias.clone(), loads, gamma)
        if got.shape == want.shape and not torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-9):
            step = (got.double() - bias.double())
            dev = loads.double() - loads.double().mean()
            over, under = dev > 0, dev < 0
            why = ""
            if torch.allclose(step[over], -gamma * torch.ones(int(over.sum()), dtype=torch.float64)) and \
                    under.any() and torch.allclose(step[under], torch.zeros(int(under.sum()), dtype=torch.float64)):
                why = "only the overloaded experts moved: an underloaded one must become more attractive too"
            elif torch.allclose(step, gamma * torch.sign(dev), rtol=1e-6, atol=1e-12):
                why = "every step has the wrong direction: an overloaded expert became more attractive"
            elif torch.allclose(step, -gamma * torch.sign(loads.double() - loads.double().median()), atol=1e-12):
                why = "the loads compared with their median: the bias follows the deviation from the mean load"
            if why:
                raise CheckFailure(f"{what}: expected {_shown(want)}, got {_shown(got)} ({why})")
        expect_close(got, want, what, rtol=1e-6, atol=1e-9)
    return case


ex103.case("loads [10, 2, 4, 8], gamma 1e-3, from 0")(
    _bias_case(torch.zeros(4), torch.tensor([10, 2, 4, 8]), 1e-3, "update_bias(0, loads [10, 2, 4, 8], 1e-3)"))
ex103.case("an expert at the mean load keeps its bias")(
    _bias_case(torch.tensor([0.1, -0.2, 0.0]), torch.tensor([3, 6, 9]), 0.01,
               "update_bias([0.1, -0.2, 0], loads [3, 6, 9], 0.01)"))
ex103.case("random loads over 16 experts", hidden=True)(
    _bias_case(torch.randn(16, generator=torch.Generator().manual_seed(7)) * 0.01,
               torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(8)), 0.002,
               "update_bias(16 experts)"))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402


def _draw_switch(r):
    T, E = r.randint(1, 64), r.randint(1, 16)
    k = r.randint(1, E)
    alpha = r.choice((0.001, 0.01, 0.1, 1.0))
    return switch_aux_loss, *_routing(T, E, k, seed(r)), (alpha,), f"switch_aux_loss(T={T}, E={E}, k={k})"


def _draw_device(r):
    D = r.randint(1, 4)
    E = D * r.randint(1, 4)
    T, k = r.randint(1, 48), r.randint(1, E)
    return (device_balance_loss, *_routing(T, E, k, seed(r)), (D, r.choice((0.01, 0.05, 1.0))),
            f"device_balance_loss(T={T}, E={E}, k={k}, D={D})")


def _draw_bias(r):
    E = r.randint(1, 32)
    g = torch.Generator().manual_seed(seed(r))
    return (torch.randn(E, generator=g) * 0.01, torch.randint(0, 60, (E,), generator=g), r.choice((1e-3, 2e-3, 0.01)),
            f"update_bias({E} experts)")


fresh_case(ex101, "random routing and alpha", _draw_switch, _loss_case)
fresh_case(ex102, "random routing, devices and alpha2", _draw_device, _loss_case)
fresh_case(ex103, "random bias, loads and gamma", _draw_bias, _bias_case)
