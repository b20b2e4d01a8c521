"""Load-balancing losses for MoE routers.

What the first argument means is stated by the caller, never guessed from its values: the
balance losses take ``scores`` [T, E] together with the keyword-only ``from_logits``:

* ``from_logits=True``: ``scores`` are the router LOGITS z (``RouterOutput.logits``); the
  loss applies the score function (softmax, or sigmoid where ``score_func`` says so) once;
* ``from_logits=False``: ``scores`` are already probabilities / affinities s
  (``RouterOutput.scores``) and are used as given (they must lie in [0, 1]).

Logits of [1, 0, 0, 0] and probabilities of [1, 0, 0, 0] are both valid and mean different
things, which is why the keyword has no default. The z-loss is defined on logits only
(probabilities have lost the scale it penalises), so :func:`z_loss` takes ``logits``.

Symbols: T tokens, E routed experts, k experts per token, ``indices`` [T, k] the experts each
token was routed to (chosen before capacity dropping). ``mask`` [T] (1 = real token, 0 =
padding): padded tokens count in neither f nor P.

Loads are normalised so that PERFECTLY UNIFORM routing gives ``f_i = 1/E`` (Switch form,
multiplied by E in the loss) or ``f_i = 1`` (DeepSeek form, which puts E/k inside f); either
way every balance loss below equals its coefficient alpha under uniform routing.

Normalization, and why it is not the LM loss's: each balance loss is normalised as its paper
does, over the T tokens its router saw in one token group (Switch and GShard: the tokens of a
group/batch, eqs. 4-6 and 3; ST-MoE's z-loss: the mean over those tokens; DeepSeek-V2's
expert, device and communication losses: over the T tokens of the group; DeepSeek-V3's
sequence-wise loss: per sequence, then the mean over sequences). A token whose TARGET is ignored
(-100) is still routed and still counts here: the router never sees targets, and only ``mask``
(padding) removes a token. So the valid-target normalization of the LM loss
(:mod:`labkit.parallel.loss`: the sum over the step's valid targets divided by their number) does
not apply to them; a parallel step averages each group's balance loss over the d M groups
(``MoEConfig.token_groups``), exactly as the single-device model does.
"""
from __future__ import annotations

import torch

__all__ = ["switch_aux_loss", "z_loss", "expert_balance_loss", "device_balance_loss",
           "comm_balance_loss", "sequence_balance_loss", "expert_fraction", "router_probs"]


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be [T, E], got shape {tuple(t.shape)}")


def _affinities(scores: torch.Tensor, from_logits, score_func: str = "softmax") -> torch.Tensor:
    """s [T, E] from what the caller says ``scores`` are (see the module docstring)."""
    _check_2d(scores, "scores")
    if not isinstance(from_logits, bool):
        raise ValueError(f"from_logits must be True (scores are router logits) or False (scores are "
                         f"probabilities), got {from_logits!r}")
    if from_logits:
        return router_probs(scores, score_func)
    router_probs(scores[:0], score_func)                    # validates score_func
    with torch.no_grad():
        if scores.numel() and not bool(((scores >= 0) & (scores <= 1)).all()):
            raise ValueError(f"from_logits=False says scores are probabilities, but they range over "
                             f"[{float(scores.min()):.4g}, {float(scores.max()):.4g}], outside [0, 1]; "
                             f"pass from_logits=True for logits")
    return scores


def router_probs(logits: torch.Tensor, score_func: str = "softmax") -> torch.Tensor:
    """Affinities s [T, E]: softmax over all E experts, or sigmoid (DeepSeek-V3 eq. 15)."""
    if score_func == "softmax":
        return logits.softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")


def _mask(mask, T, device, dtype=torch.float32):
    if mask is None:
        return torch.ones(T, dtype=dtype, device=device)
    mask = mask.reshape(-1).to(dtype=dtype, device=device)
    if mask.numel() != T:
        raise ValueError(f"token mask has {mask.numel()} entries for T={T} tokens")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("token mask must hold 0 (padding) or 1 (real token) only")
    if mask.sum() == 0:
        raise ValueError("token mask keeps no token")
    return mask


def expert_fraction(indices: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """f [E]: fraction of token-slots routed to each expert, ``count_i / (T * k)`` over
    unmasked tokens (sums to 1; uniform routing gives 1/E). No gradient (it comes from top-k)."""
    T, k = indices.shape
    m = _mask(mask, T, indices.device, dtype)
    onehot = torch.zeros(T, num_experts, device=indices.device, dtype=dtype).scatter_add_(
        1, indices, torch.ones(T, k, device=indices.device, dtype=dtype))
    return (onehot * m[:, None]).sum(0) / (m.sum() * k)


def _masked_mean(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Mean over the real tokens of s [T, E] (m [T] float 0/1) -> [E]."""
    return (s * m[:, None]).sum(0) / m.sum()


def switch_aux_loss(scores: torch.Tensor, indices: torch.Tensor, alpha: float = 1e-2,
                    mask: torch.Tensor | None = None, *, from_logits: bool) -> torch.Tensor:
    """Switch Transformer auxiliary loss (Fedus et al. 2021, sec. 2.2, eq. 4-6; GShard eq. 3):

        loss = alpha * E * sum_i f_i * P_i
        f_i  = (1 / (T k)) * #{(t, j): indices[t, j] = i}     fraction of token-slots to expert i
        P_i  = (1 / T) * sum_t p_{t,i},  p_t = softmax(z_t)    mean router probability (full softmax)

    Switch uses k = 1; for k > 1 we normalise f by T*k so it sums to 1 and uniform routing
    (f_i = P_i = 1/E) gives exactly ``alpha``. The gradient flows through P only.
    ``scores`` [T, E]: logits z (``from_logits=True``) or the probabilities p
    (``from_logits=False``); ``indices`` [T, k]; ``mask`` [T] (1 = real token, 0 = padding):
    f and P are averaged over real tokens only (normalization: per token group, Switch's;
    ignored targets do not change it). Returns a 0-d tensor. Raises ValueError for a
    bad shape, a mask that keeps no token, or ``from_logits=False`` with values outside [0, 1].
    """
    p = _affinities(scores, from_logits)
    T, E = p.shape
    m = _mask(mask, T, p.device, p.dtype)
    f = expert_fraction(indices, E, mask, p.dtype)
    return alpha * E * (f * _masked_mean(p, m)).sum()


def z_loss(logits: torch.Tensor, coeff: float = 1e-3, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE, Zoph et al. 2022, sec. 3.1 eq. 5):
    ``coeff * (1/T) * sum_t (log sum_j exp z_{t,j})^2`` over real tokens (``mask`` [T], 1 =
    real), computed with logsumexp (stable for large logits). ``logits`` [T, E] are the router
    logits z, whatever their values (there is no probability form: softmax is shift-invariant,
    so probabilities have lost what the z-loss penalises). Uniform zero logits give
    ``coeff * (log E)^2``. Normalization: the mean over the group's routed tokens (ST-MoE's),
    ignored targets included. Returns a 0-d tensor."""
    _check_2d(logits, "logits")
    T = logits.shape[0]
    m = _mask(mask, T, logits.device, logits.dtype)
    return coeff * (torch.logsumexp(logits, dim=-1).square() * m).sum() / m.sum()


def expert_balance_loss(scores: torch.Tensor, indices: torch.Tensor, alpha1: float = 3e-3,
                        score_func: str = "softmax", mask: torch.Tensor | None = None, *,
                        from_logits: bool) -> torch.Tensor:
    """DeepSeek-V2 expert-level balance loss (DeepSeek-V2 report sec. 2.2.3, eqs. 12-14):

        L_ExpBal = alpha1 * sum_{i=1}^{N'} f_i P_i
        f_i = N' / (K' T) * sum_t 1(token t selects expert i)
        P_i = (1 / T) * sum_t s_{i,t}

    N' = E routed experts, K' = k routed per token, s the affinities (softmax in V2; with
    ``from_logits=True`` computed here with ``score_func``, else ``scores`` are s). T counts
    real tokens only (``mask``; ignored targets count: normalization per token group, as in the
    paper). Equals ``switch_aux_loss`` with alpha = alpha1 for softmax; uniform routing gives alpha1.
    """
    s = _affinities(scores, from_logits, score_func)
    T, E = s.shape
    m = _mask(mask, T, s.device, s.dtype)
    f = expert_fraction(indices, E, mask, s.dtype) * E          # N'/(K'T) * count
    return alpha1 * (f * _masked_mean(s, m)).sum()


def _device_groups(E: int, n_devices: int):
    if n_devices < 1 or E % n_devices:
        raise ValueError(f"n_routed_experts={E} must be divisible by n_devices={n_devices}")
    return E // n_devices


def device_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_devices: int, alpha2: float = 5e-2,
                        score_func: str = "softmax", mask: torch.Tensor | None = None, *,
                        from_logits: bool) -> torch.Tensor:
    """DeepSeek-V2 device-level balance loss (sec. 2.2.3, eqs. 15-17). Experts are split into
    D = ``n_devices`` groups E_1..E_D of E/D consecutive experts (the experts one device holds):

        L_DevBal = alpha2 * sum_{i=1}^{D} f'_i P'_i
        f'_i = (1 / |E_i|) * sum_{j in E_i} f_j        (mean of the expert-level f of eq. 13)
        P'_i = sum_{j in E_i} P_j                       (sum of the expert-level P of eq. 14)

    ``scores``/``from_logits``/``mask`` as in :func:`expert_balance_loss` (normalization per
    token group, V2's). Uniform routing: f'_i = 1, P'_i = 1/D, loss = alpha2.
    """
    s = _affinities(scores, from_logits, score_func)
    T, E = s.shape
    g = _device_groups(E, n_devices)
    m = _mask(mask, T, s.device, s.dtype)
    f = expert_fraction(indices, E, mask, s.dtype) * E
    P = _masked_mean(s, m)
    return alpha2 * (f.view(n_devices, g).mean(1) * P.view(n_devices, g).sum(1)).sum()


def comm_balance_loss(scores: torch.Tensor, indices: torch.Tensor, n_devices: int, max_devices: int,
                      alpha3: float = 2e-2, score_func: str = "softmax", mask: torch.Tensor | None = None, *,
                      from_logits: bool) -> torch.Tensor:
    """DeepSeek-V2 communication balance loss (sec. 2.2.3, eqs. 18-20):

        L_CommBal = alpha3 * sum_{i=1}^{D} f''_i P''_i
        f''_i = D / (M T) * sum_t 1(token t is sent to device i)
        P''_i = sum_{j in E_i} P_j

    M = ``max_devices`` each token may be sent to (device-limited routing). A token counts
    once per device however many of its k experts live there. ``scores``/``from_logits``/
    ``mask`` as in :func:`expert_balance_loss` (T counts real tokens; normalization per token
    group, V2's). Uniform routing with
    every token reaching M devices: f''_i = 1, P''_i = 1/D, loss = alpha3.
    """
    s = _affinities(scores, from_logits, score_func)
    T, E = s.shape
    g = _device_groups(E, n_devices)
    m = _mask(mask, T, s.device, s.dtype)
    dev = indices // g                                                    # [T, k] device of each slot
    sent = torch.zeros(T, n_devices, device=s.device, dtype=s.dtype).scatter_(1, dev, 1.0)
    f2 = n_devices / (max_devices * m.sum()) * (sent * m[:, None]).sum(0)
    P = _masked_mean(s, m)
    return alpha3 * (f2 * P.view(n_devices, g).sum(1)).sum()


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, seq_len: int, alpha: float = 1e-4,
                          score_func: str = "sigmoid", mask: torch.Tensor | None = None, *,
                          from_logits: bool) -> torch.Tensor:
    """DeepSeek-V3 complementary sequence-wise balance loss (V3 report sec. 2.1.2, eqs. 17-20),
    computed for each sequence of T = ``seq_len`` tokens and averaged over sequences:

        L_Bal = alpha * sum_{i=1}^{N_r} f_i P_i
        f_i   = N_r / (K_r T) * sum_t 1(expert i in the top-K_r of token t)
        s'_{i,t} = s_{i,t} / sum_j s_{j,t}              (affinities normalised per token)
        P_i   = (1 / T) * sum_t s'_{i,t}

    ``scores`` [B*T, E] in sequence-major order (logits with ``from_logits=True``, affinities s
    otherwise), ``indices`` [B*T, K_r] the experts actually selected (with the bias, as in V3's
    code). ``mask`` [B*T]: T of each sequence counts its real tokens only, and sequences with no
    real token are left out of the mean (normalization per sequence, V3's; ignored targets do not
    change it). Uniform routing gives alpha.
    """
    s = _affinities(scores, from_logits, score_func)
    N, E = s.shape
    if seq_len < 1 or N % seq_len:
        raise ValueError(f"{N} tokens are not a whole number of sequences of seq_len={seq_len}")
    B, k = N // seq_len, indices.shape[1]
    m = _mask(mask, N, s.device, s.dtype).view(B, seq_len, 1)
    n = m.sum(1)                                                          # [B, 1] real tokens per sequence
    s = s / s.sum(-1, keepdim=True)
    real = n.squeeze(1) > 0
    n = n.clamp(min=1)
    P = (s.view(B, seq_len, E) * m).sum(1) / n                           # [B, E]
    counts = torch.zeros(N, E, device=s.device, dtype=s.dtype).scatter_add_(
        1, indices, torch.ones_like(indices, dtype=s.dtype))
    f = (counts.view(B, seq_len, E) * m).sum(1) * E / (k * n)            # [B, E]
    return alpha * (f * P).sum(1)[real].mean()
