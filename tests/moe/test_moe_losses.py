"""Every balance loss against a direct computation from its formula (plain loops)."""
import math

import pytest
import torch

from labkit.moe import (
    comm_balance_loss,
    device_balance_loss,
    expert_balance_loss,
    route,
    sequence_balance_loss,
    switch_aux_loss,
    z_loss,
)


def _softmax(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [v / sum(e) for v in e]


def _sigmoid(row):
    return [1 / (1 + math.exp(-v)) for v in row]


def _random_routing(seed, T=16, E=4, k=2):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    _, idx, _ = route(logits, k)
    return logits, idx


def _loop_switch(logits, idx, alpha, mask=None):
    T, E = logits.shape
    k = idx.shape[1]
    keep = [True] * T if mask is None else [bool(m) for m in mask]
    n = sum(keep)
    f = [0.0] * E
    P = [0.0] * E
    for t in range(T):
        if not keep[t]:
            continue
        for j in range(k):
            f[idx[t, j]] += 1 / (n * k)
        p = _softmax(logits[t].tolist())
        for i in range(E):
            P[i] += p[i] / n
    return alpha * E * sum(f[i] * P[i] for i in range(E))


def test_switch_aux_matches_formula_and_mask():
    logits, idx = _random_routing(0)
    want = _loop_switch(logits, idx, 0.01)
    assert switch_aux_loss(logits, idx, 0.01, from_logits=True).item() == pytest.approx(want, rel=1e-12)
    mask = torch.tensor([1] * 10 + [0] * 6)
    got = switch_aux_loss(logits, idx, 0.01, mask=mask, from_logits=True).item()
    assert got == pytest.approx(_loop_switch(logits, idx, 0.01, mask.tolist()), rel=1e-12)
    assert got == pytest.approx(switch_aux_loss(logits[:10], idx[:10], 0.01, from_logits=True).item(), rel=1e-12)


def _wrong_aux(logits, idx, alpha):
    """The bug: P from softmax over the k selected logits, averaged (always 1/k), not the full softmax."""
    E = logits.shape[1]
    topk_weights = logits.gather(1, idx).softmax(-1)
    f = torch.bincount(idx.flatten(), minlength=E).double() / idx.numel()
    return alpha * E * (f * topk_weights.mean()).sum()


def test_switch_aux_depends_on_routing_wrong_version_is_constant():
    right = {round(switch_aux_loss(*_random_routing(s), 1.0, from_logits=True).item(), 10) for s in (0, 1, 2)}
    wrong = {round(_wrong_aux(*_random_routing(s), 1.0).item(), 10) for s in (0, 1, 2)}
    assert len(right) == 3
    assert wrong == {2.0}                                      # alpha * E / k for every seed


def test_uniform_routing_gives_alpha():
    T, E = 8, 4
    logits = torch.zeros(T, E)
    idx = torch.tensor([[0, 1], [2, 3]] * 4)
    assert switch_aux_loss(logits, idx, 0.3, from_logits=True).item() == pytest.approx(0.3)
    assert expert_balance_loss(logits, idx, 0.3, from_logits=True).item() == pytest.approx(0.3)
    assert device_balance_loss(logits, idx, 2, 0.3, from_logits=True).item() == pytest.approx(0.3)
    # each token on one device
    assert comm_balance_loss(logits, idx, 2, 1, 0.3, from_logits=True).item() == pytest.approx(0.3)
    assert sequence_balance_loss(logits, idx, 4, 0.3, from_logits=True).item() == pytest.approx(0.3)
    assert z_loss(logits, 0.1).item() == pytest.approx(0.1 * math.log(4) ** 2)


LOSSES = {   # name -> (loss, positional args after (scores, indices)) for T=16, E=4 (2 devices), sequences of 4
    "switch": (switch_aux_loss, (0.3,)),
    "expert": (expert_balance_loss, (0.3, "softmax")),
    "device": (device_balance_loss, (2, 0.3, "softmax")),
    "comm": (comm_balance_loss, (2, 1, 0.3, "softmax")),
    "sequence": (sequence_balance_loss, (4, 0.3, "softmax")),
}


def _loss(name):
    fn, args = LOSSES[name]
    return lambda z, i, m, fl: fn(z, i, *args, mask=m, from_logits=fl)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_meaning_of_scores_is_stated_never_guessed(name):
    """Logits that are non-negative and sum to 1 per row are valid logits (a top-1 gate with
    logits [1, 0, 0, 0]); the caller says what the tensor is, and both forms give one value."""
    loss = _loss(name)
    z = torch.tensor([[1.0, 0, 0, 0]] * 10 + [[0, 1.0, 0, 0]] * 4 + [[0, 0, 0, 1.0]] * 2, dtype=torch.float64)
    idx = z.argmax(-1, keepdim=True)                      # a top-1 gate
    as_logits = loss(z, idx, None, True)
    p = z.softmax(-1)                                   # [e, 1, 1, 1] / (e + 3): not one-hot
    assert as_logits.item() == pytest.approx(loss(p, idx, None, False).item(), rel=1e-12)
    # the same tensor read as probabilities is a different (also valid) input: one-hot gates
    as_probs = loss(z, idx, None, False)
    assert as_probs.item() != pytest.approx(as_logits.item(), rel=1e-3)
    fn, args = LOSSES[name]
    with pytest.raises(TypeError, match="from_logits"):      # no default: the meaning must be stated
        fn(z, idx, *args)
    with pytest.raises(ValueError, match=r"from_logits=False says scores are probabilities.*outside \[0, 1\]"):
        loss(z * 3 - 1, idx, None, False)
    with pytest.raises(ValueError, match="from_logits must be True .* or False"):
        loss(z, idx, None, "logits")


def test_z_loss_takes_any_logits():
    z = torch.tensor([[1.0, 0, 0, 0]] * 4)                 # non-negative, rows sum to 1: still logits
    want = 1e-3 * math.log(math.e + 3) ** 2
    assert z_loss(z, 1e-3).item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_mask_drops_padded_tokens_from_f_and_P(name):
    """With a padding mask each loss equals the loss on the real tokens alone (sequence loss:
    per sequence, over its real tokens), value and gradient; padded rows get zero gradient."""
    loss = _loss(name)
    logits, idx = _random_routing(3)                       # T=16, E=4, k=2, float64
    mask = torch.ones(16, dtype=torch.bool)
    mask[[2, 3, 9, 13, 14, 15]] = False                    # the last sequence: real token 12 only
    z = logits.clone().requires_grad_(True)
    got = loss(z, idx, mask, True)
    got.backward()
    if name == "sequence":
        parts = [(z_b[m_b], i_b[m_b])
                 for z_b, i_b, m_b in zip(logits.view(4, 4, 4), idx.view(4, 4, 2), mask.view(4, 4))]
        ref_z = [p.clone().requires_grad_(True) for p, _ in parts]
        want = torch.stack([sequence_balance_loss(rz, i, len(i), 0.3, "softmax", from_logits=True)
                            for rz, (_, i) in zip(ref_z, parts)]).mean()
        want.backward()
        ref_grad = torch.zeros_like(logits)
        ref_grad[mask] = torch.cat([rz.grad for rz in ref_z])
    else:
        rz = logits[mask].clone().requires_grad_(True)
        want = loss(rz, idx[mask], None, True)
        want.backward()
        ref_grad = torch.zeros_like(logits)
        ref_grad[mask] = rz.grad
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(z.grad, ref_grad, rtol=1e-12, atol=1e-15)
    # a bug that ignores the mask changes the value
    assert loss(logits, idx, None, True).item() != pytest.approx(got.item(), rel=1e-6)
    with pytest.raises(ValueError, match="keeps no token"):
        loss(logits, idx, torch.zeros(16), True)


def test_aux_gradient_flows_through_P_only():
    logits, idx = _random_routing(1)
    logits.requires_grad_(True)
    switch_aux_loss(logits, idx, 1.0, from_logits=True).backward()
    T, E = logits.shape
    f = torch.bincount(idx.flatten(), minlength=E).double() / idx.numel()
    p = logits.detach().softmax(-1)
    # d/dz_t of E/T * sum_i f_i p_ti = E/T * p_t * (f - <f, p_t>)
    want = E / T * p * (f - (p * f).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, want)


def test_z_loss_formula_and_stability():
    logits, _ = _random_routing(0)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / logits.shape[0]
    assert z_loss(logits, 1e-3).item() == pytest.approx(1e-3 * want, rel=1e-12)
    big = torch.tensor([[1e4, 0.0, -1e4]])
    assert z_loss(big, 1.0).item() == pytest.approx(1e8)         # logsumexp, no overflow


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_deepseek_v2_expert_level(score_func):
    logits, idx = _random_routing(4, T=12, E=8, k=3)
    T, E, k = 12, 8, 3
    s = [(_softmax if score_func == "softmax" else _sigmoid)(r) for r in logits.tolist()]
    f = [E / (k * T) * sum(1 for t in range(T) if i in idx[t].tolist()) for i in range(E)]
    P = [sum(s[t][i] for t in range(T)) / T for i in range(E)]
    want = 0.003 * sum(f[i] * P[i] for i in range(E))
    got = expert_balance_loss(logits, idx, 0.003, score_func, from_logits=True)
    assert got.item() == pytest.approx(want, rel=1e-12)


def test_deepseek_v2_device_level():
    logits, idx = _random_routing(5, T=12, E=8, k=3)
    T, E, k, D = 12, 8, 3, 4
    s = [_softmax(r) for r in logits.tolist()]
    f = [E / (k * T) * sum(1 for t in range(T) if i in idx[t].tolist()) for i in range(E)]
    P = [sum(s[t][i] for t in range(T)) / T for i in range(E)]
    groups = [list(range(d * 2, d * 2 + 2)) for d in range(D)]
    want = 0.05 * sum((sum(f[j] for j in g) / len(g)) * sum(P[j] for j in g) for g in groups)
    assert device_balance_loss(logits, idx, D, 0.05, from_logits=True).item() == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="n_routed_experts=8 must be divisible by n_devices=3"):
        device_balance_loss(logits, idx, 3, from_logits=True)


def test_deepseek_v2_comm_balance():
    logits, idx = _random_routing(6, T=12, E=8, k=3)
    T, D, M = 12, 4, 3
    s = [_softmax(r) for r in logits.tolist()]
    P = [sum(s[t][i] for t in range(T)) / T for i in range(8)]
    f2 = [D / (M * T) * sum(1 for t in range(T) if any(e // 2 == d for e in idx[t].tolist())) for d in range(D)]
    want = 0.02 * sum(f2[d] * (P[2 * d] + P[2 * d + 1]) for d in range(D))
    assert comm_balance_loss(logits, idx, D, M, 0.02, from_logits=True).item() == pytest.approx(want, rel=1e-12)


def test_deepseek_v3_sequence_wise():
    logits, _ = _random_routing(7, T=12, E=8, k=2)
    _, idx, _ = route(logits, 2, "sigmoid")
    S, E, k = 4, 8, 2
    total = 0.0
    for b in range(3):
        rows = range(b * S, (b + 1) * S)
        sp = []
        for t in rows:
            s = _sigmoid(logits[t].tolist())
            sp.append([v / sum(s) for v in s])
        f = [E / (k * S) * sum(1 for t in rows if i in idx[t].tolist()) for i in range(E)]
        P = [sum(sp[n][i] for n in range(S)) / S for i in range(E)]
        total += 1e-4 * sum(f[i] * P[i] for i in range(E))
    assert sequence_balance_loss(logits, idx, S, 1e-4, from_logits=True).item() == pytest.approx(total / 3, rel=1e-12)
    with pytest.raises(ValueError, match="not a whole number of sequences of seq_len=5"):
        sequence_balance_loss(logits, idx, 5, from_logits=True)
