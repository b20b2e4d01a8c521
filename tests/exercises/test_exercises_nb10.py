"""Exercises of notebook 10_balance_losses: the solutions pass, plausible wrong answers fail with
a message that says what was expected and what came back."""
import pytest
import torch

from labkit.grading.testing import assert_check_fails, assert_check_passes


def _f_P(logits, indices):
    T, E = logits.shape
    counts = torch.bincount(indices.reshape(-1), minlength=E).to(logits.dtype)
    return counts / (T * indices.shape[1]), logits.softmax(dim=-1).mean(dim=0)


def switch_aux_loss(logits, indices, alpha=0.01):
    f, P = _f_P(logits, indices)
    return alpha * logits.shape[1] * (f * P).sum()


def aux_soft_f(logits, indices, alpha=0.01):
    """Wrong: uses the probabilities for f too (P . P), not the hard choices."""
    P = logits.softmax(dim=-1).mean(dim=0)
    return alpha * logits.shape[1] * (P * P).sum()


def aux_without_E(logits, indices, alpha=0.01):
    """Wrong: forgets the factor E (uniform routing then gives alpha / E)."""
    f, P = _f_P(logits, indices)
    return alpha * (f * P).sum()


def aux_f_not_per_slot(logits, indices, alpha=0.01):
    """Wrong: divides the counts by T instead of T*k (f sums to k)."""
    f, P = _f_P(logits, indices)
    return alpha * logits.shape[1] * (f * indices.shape[1] * P).sum()


def device_balance_loss(logits, indices, n_devices, alpha2=0.05):
    T, E = logits.shape
    f, P = _f_P(logits, indices)
    f = f * E
    return alpha2 * (f.view(n_devices, -1).mean(1) * P.view(n_devices, -1).sum(1)).sum()


def device_loss_sum_f(logits, indices, n_devices, alpha2=0.05):
    """Wrong: sums f over the device's experts instead of averaging."""
    T, E = logits.shape
    f, P = _f_P(logits, indices)
    f = f * E
    return alpha2 * (f.view(n_devices, -1).sum(1) * P.view(n_devices, -1).sum(1)).sum()


def device_loss_no_k(logits, indices, n_devices, alpha2=0.05):
    """Wrong: f normalised by T, not T k (issue 36: the same line as two other mistakes)."""
    return indices.shape[1] * device_balance_loss(logits, indices, n_devices, alpha2)


def device_loss_extra_D(logits, indices, n_devices, alpha2=0.05):
    return n_devices * device_balance_loss(logits, indices, n_devices, alpha2)


def device_loss_f_fraction(logits, indices, n_devices, alpha2=0.05):
    return device_balance_loss(logits, indices, n_devices, alpha2) / logits.shape[1]


def device_loss_P_mean(logits, indices, n_devices, alpha2=0.05):
    T, E = logits.shape
    f, P = _f_P(logits, indices)
    return alpha2 * ((f * E).view(n_devices, -1).mean(1) * P.view(n_devices, -1).mean(1)).sum()


def device_loss_strided(logits, indices, n_devices, alpha2=0.05):
    """Wrong: device d holds experts d, d+D, d+2D, ... (strided, not consecutive)."""
    T, E = logits.shape
    f, P = _f_P(logits, indices)
    f = f * E
    return alpha2 * (f.view(-1, n_devices).mean(0) * P.view(-1, n_devices).sum(0)).sum()


def update_bias(bias, loads, gamma):
    loads = loads.to(bias.dtype)
    return bias + gamma * torch.sign(loads.mean() - loads)


def bias_wrong_sign(bias, loads, gamma):
    """Wrong: makes overloaded experts even more attractive."""
    loads = loads.to(bias.dtype)
    return bias + gamma * torch.sign(loads - loads.mean())


def bias_proportional(bias, loads, gamma):
    """Wrong: a step proportional to the imbalance instead of its sign."""
    loads = loads.to(bias.dtype)
    return bias + gamma * (loads.mean() - loads)


def test_solutions_pass():
    for ex, answer in (("10.1", switch_aux_loss), ("10.2", device_balance_loss), ("10.3", update_bias)):
        assert_check_passes(ex, answer)


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "aux_with_soft_f": ("10.1", aux_soft_f,
                        {"contains": "switch_aux_loss(T=16, E=4, k=1, alpha=0.1): value: expected"}),
    "aux_without_E": ("10.1", aux_without_E,
                      {"contains": "expected 0.01, got 0.0025"}),
    "aux_f_not_normalised_by_k": ("10.1", aux_f_not_per_slot,
                                  {"contains": "T=16, E=8, k=2"}),
    "device_loss_sum_of_f": ("10.2", device_loss_sum_f,
                             {"contains": "expected 0.05, got 0.1 (f'_d summed over the device's experts"}),
    "device_loss_k_forgotten": ("10.2", device_loss_no_k, {"contains": "expected 0.05, got 0.1 (f was counted per "
                                                                       "token, not per one of the T k routed slots"}),
    "device_loss_extra_D": ("10.2", device_loss_extra_D, {"contains": "expected 0.05, got 0.1 (an extra factor D"}),
    "device_loss_f_fraction": ("10.2", device_loss_f_fraction, {"contains": "f left a fraction of the slots"}),
    "device_loss_P_mean": ("10.2", device_loss_P_mean, {"contains": "P'_d averaged over the device's experts"}),
    "device_loss_strided_experts": ("10.2", device_loss_strided,
                                    {"contains": "device_balance_loss(T=16, E=8, k=2, D=4): value"}),
    "bias_wrong_sign": ("10.3", bias_wrong_sign,
                        {"contains": "expected tensor([-0.001, 0.001, 0.001, -0.001])"}),
    "bias_proportional": ("10.3", bias_proportional,
                          {"contains": "update_bias(0, loads [10, 2, 4, 8], 1e-3)"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


def test_learner_round_mistakes_are_named():
    """Issue 36's learner round: 10.1 with k forgotten, 10.3 moving only the overloaded experts or using the median."""
    from labkit.grading.testing import assert_public_case_fails
    assert_public_case_fails("10.1", lambda l, i, alpha=0.01: switch_aux_loss(l, i, alpha) * i.shape[1],
                             "T=16, E=8, k=2", contains="f was counted per token")
    assert_public_case_fails("10.3", lambda b, loads, g: b - g * (loads.float() > loads.float().mean()).float(),
                             "loads [10, 2, 4, 8]", contains="only the overloaded experts moved")
    assert_public_case_fails("10.3", lambda b, loads, g: b - g * torch.sign(loads.float() - loads.float().median()),
                             "loads [10, 2, 4, 8]", contains="compared with their median")
    assert_public_case_fails("10.3", lambda b, loads, g: b + g * torch.sign(loads.float() - loads.float().mean()),
                             "loads [10, 2, 4, 8]", contains="every step has the wrong direction")


def aux_f_divided_by_k_twice(logits, indices, alpha=0.01):
    """Wrong: f divided by k once more (f sums to 1/k)."""
    f, P = _f_P(logits, indices)
    return alpha * logits.shape[1] * (f / indices.shape[1] * P).sum()


@pytest.mark.parametrize("wrong, contains", [
    (aux_without_E, "the scale E left out: a uniform routing must give alpha"),
    (aux_f_divided_by_k_twice, "divided by k once too often"),
])
def test_every_named_aux_loss_mistake_is_triggered(wrong, contains):
    """Issue 36's audit: each named mistake of 10.1 has a wrong answer whose line names it."""
    assert_check_fails("10.1", wrong, contains=contains)
