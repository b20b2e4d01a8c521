"""Load-balancing losses for MoE routers.

Every loss here takes the router LOGITS z [T, E] (not probabilities) and applies the score
function exactly once itself. Symbols: T tokens, E routed experts, k experts per token,
``indices`` [T, k] the experts each token was routed to (chosen before capacity dropping).

Loads are normalised so that PERFECTLY UNIFORM routing gives ``f_i = 1/E`` (Switch form,
multiplied by E in the loss) or ``f_i = 1`` (DeepSeek form, which puts E/k inside f); either
way every balance loss below equals its coefficient alpha under uniform routing.
"""
from __future__ import annotations

import torch

__all__ = ["switch_aux_loss", "z_loss", "expert_balance_loss", "device_balance_loss",
           "comm_balance_loss", "sequence_balance_loss", "expert_fraction", "router_probs"]


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be [T, E], got shape {tuple(logits.shape)}")
    with torch.no_grad():
        if logits.numel() and bool((logits >= 0).all()) and torch.allclose(
                logits.sum(-1), torch.ones(logits.shape[0], dtype=logits.dtype, device=logits.device), atol=1e-5):
            raise ValueError("the balance losses take router LOGITS, but these rows are non-negative and sum "
                             "to 1 (probabilities); pass the logits so softmax is applied exactly once")


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


def switch_aux_loss(logits: torch.Tensor, indices: torch.Tensor, alpha: float = 1e-2,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer auxiliary loss (Fedus et al. 2021, sec. 2.2, eq. 4-6; GShard eq. 3):

        loss = alpha * E * sum_i f_i * P_i
        f_i  = (1 / (T k)) * #{(t, j): indices[t, j] = i}     fraction of token-slots to expert i
        P_i  = (1 / T) * sum_t softmax(z_t)_i                  mean router probability (full softmax)

    Switch uses k = 1; for k > 1 we normalise f by T*k so it sums to 1 and uniform routing
    (f_i = P_i = 1/E) gives exactly ``alpha``. The gradient flows through P only.
    ``logits`` [T, E] (raising ValueError if they look like probabilities), ``indices`` [T, k],
    ``mask`` [T] (1 = real token, 0 = padding): f and P are averaged over real tokens only.
    Returns a 0-d tensor.
    """
    _check_logits(logits)
    T, E = logits.shape
    m = _mask(mask, T, logits.device, logits.dtype)
    P = (logits.softmax(-1) * m[:, None]).sum(0) / m.sum()
    f = expert_fraction(indices, E, mask, logits.dtype)
    return alpha * E * (f * P).sum()


def z_loss(logits: torch.Tensor, coeff: float = 1e-3, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Router z-loss (ST-MoE, Zoph et al. 2022, sec. 3.1 eq. 5):
    ``coeff * (1/T) * sum_t (log sum_j exp z_{t,j})^2``, computed with logsumexp (stable for
    large logits). Uniform zero logits give ``coeff * (log E)^2``. Returns a 0-d tensor."""
    _check_logits(logits)
    T = logits.shape[0]
    m = _mask(mask, T, logits.device, logits.dtype)
    return coeff * (torch.logsumexp(logits, dim=-1).square() * m).sum() / m.sum()


def expert_balance_loss(logits: torch.Tensor, indices: torch.Tensor, alpha1: float = 3e-3,
                        score_func: str = "softmax") -> torch.Tensor:
    """DeepSeek-V2 expert-level balance loss (DeepSeek-V2 report sec. 2.2.3, eqs. 12-14):

        L_ExpBal = alpha1 * sum_{i=1}^{N'} f_i P_i
        f_i = N' / (K' T) * sum_t 1(token t selects expert i)
        P_i = (1 / T) * sum_t s_{i,t}

    N' = E routed experts, K' = k routed per token, s the affinities (softmax in V2).
    Equals ``switch_aux_loss`` with alpha = alpha1 for softmax; uniform routing gives alpha1.
    """
    _check_logits(logits)
    T, E = logits.shape
    s = router_probs(logits, score_func)
    f = expert_fraction(indices, E, dtype=logits.dtype) * E          # N'/(K'T) * count
    P = s.mean(0)
    return alpha1 * (f * P).sum()


def _device_groups(E: int, n_devices: int):
    if n_devices < 1 or E % n_devices:
        raise ValueError(f"n_routed_experts={E} must be divisible by n_devices={n_devices}")
    return E // n_devices


def device_balance_loss(logits: torch.Tensor, indices: torch.Tensor, n_devices: int, alpha2: float = 5e-2,
                        score_func: str = "softmax") -> torch.Tensor:
    """DeepSeek-V2 device-level balance loss (sec. 2.2.3, eqs. 15-17). Experts are split into
    D = ``n_devices`` groups E_1..E_D of E/D consecutive experts (the experts one device holds):

        L_DevBal = alpha2 * sum_{i=1}^{D} f'_i P'_i
        f'_i = (1 / |E_i|) * sum_{j in E_i} f_j        (mean of the expert-level f of eq. 13)
        P'_i = sum_{j in E_i} P_j                       (sum of the expert-level P of eq. 14)

    Uniform routing: f'_i = 1, P'_i = 1/D, loss = alpha2.
    """
    _check_logits(logits)
    T, E = logits.shape
    g = _device_groups(E, n_devices)
    f = expert_fraction(indices, E, dtype=logits.dtype) * E
    P = router_probs(logits, score_func).mean(0)
    return alpha2 * (f.view(n_devices, g).mean(1) * P.view(n_devices, g).sum(1)).sum()


def comm_balance_loss(logits: torch.Tensor, indices: torch.Tensor, n_devices: int, max_devices: int,
                      alpha3: float = 2e-2, score_func: str = "softmax") -> torch.Tensor:
    """DeepSeek-V2 communication balance loss (sec. 2.2.3, eqs. 18-20):

        L_CommBal = alpha3 * sum_{i=1}^{D} f''_i P''_i
        f''_i = D / (M T) * sum_t 1(token t is sent to device i)
        P''_i = sum_{j in E_i} P_j

    M = ``max_devices`` each token may be sent to (device-limited routing). A token counts
    once per device however many of its k experts live there. Uniform routing with every token
    reaching M devices: f''_i = 1, P''_i = 1/D, loss = alpha3.
    """
    _check_logits(logits)
    T, E = logits.shape
    g = _device_groups(E, n_devices)
    dev = indices // g                                                    # [T, k] device of each slot
    sent = torch.zeros(T, n_devices, device=logits.device, dtype=logits.dtype).scatter_(1, dev, 1.0)
    f2 = n_devices / (max_devices * T) * sent.sum(0)
    P = router_probs(logits, score_func).mean(0)
    return alpha3 * (f2 * P.view(n_devices, g).sum(1)).sum()


def sequence_balance_loss(logits: torch.Tensor, indices: torch.Tensor, seq_len: int, alpha: float = 1e-4,
                          score_func: str = "sigmoid") -> torch.Tensor:
    """DeepSeek-V3 complementary sequence-wise balance loss (V3 report sec. 2.1.2, eqs. 17-20),
    computed for each sequence of T = ``seq_len`` tokens and averaged over sequences:

        L_Bal = alpha * sum_{i=1}^{N_r} f_i P_i
        f_i   = N_r / (K_r T) * sum_t 1(expert i in the top-K_r of token t)
        s'_{i,t} = s_{i,t} / sum_j s_{j,t}              (affinities normalised per token)
        P_i   = (1 / T) * sum_t s'_{i,t}

    ``logits`` [B*T, E] in sequence-major order, ``indices`` [B*T, K_r] the experts actually
    selected (with the bias, as in V3's code). Uniform routing gives alpha.
    """
    _check_logits(logits)
    N, E = logits.shape
    if seq_len < 1 or N % seq_len:
        raise ValueError(f"{N} tokens are not a whole number of sequences of seq_len={seq_len}")
    B, k = N // seq_len, indices.shape[1]
    s = router_probs(logits, score_func)
    s = s / s.sum(-1, keepdim=True)
    P = s.view(B, seq_len, E).mean(1)                                     # [B, E]
    counts = torch.zeros(N, E, device=logits.device, dtype=s.dtype).scatter_add_(1, indices, torch.ones_like(indices, dtype=s.dtype))
    f = counts.view(B, seq_len, E).sum(1) * E / (k * seq_len)             # [B, E]
    return alpha * (f * P).sum(1).mean()
