"""What one ``lab 3d`` run trains, shared by labkit's implementation (:mod:`labkit.labs.threed`) and
PyTorch's (:mod:`labkit.labs.threed_torch`): the single-device model and its loss, the batches (with
``--ignore-frac``, padded documents), the chunks per rank, and what every rank reports
(:class:`RankMeasures`). Neither of those modules imports the other."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pipeline.registry import lookup

__all__ = ["RankMeasures", "padded_documents"]


@dataclass
class RankMeasures:
    """What every rank of a ``lab 3d`` run reports, whichever implementation trained it: its place on the
    grid (``rank``, ``tp_rank``, ``dp_rank``, ``pp_rank``; ``last``: it holds the last stage), ``losses``
    (this DP rank's per step, on the last stage; else None), and per step ``comm``
    (``{axis: {kind: (count, bytes)}}``) and ``wire`` (``{axis: bytes sent}`` under the ring algorithms)."""
    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int
    last: bool
    losses: list
    comm: list
    wire: list


def _v(a) -> int:
    """Chunks per rank (the registry's rule): --chunks for interleaved (unset: 2), 2 for the
    V-shaped schedules, else 1."""
    return lookup(a.schedule).v(a.chunks)


def _config(a):
    from ..model import GPTConfig
    return GPTConfig(n_layer=a.layers, n_embd=a.embd, n_head=a.heads, block_size=a.seq,
                     share_embeddings_and_output_weights=a.tied)


def _moe_config(a):
    """The MoE layers' config (--moe): E experts, top-k, each the dense MLP's width, Switch aux loss
    1e-2, routed in d*M groups (one per microbatch and DP rank, what one rank routes together)."""
    from ..moe.model import moe_config_for
    return moe_config_for(_config(a), n_routed_experts=a.experts, n_activated_experts=a.topk,
                          aux_loss_coeff=1e-2, token_groups=a.dp * a.microbatches)


def _model(a):
    """The single-device model of this run: labkit's GPT, or with --moe its MoE variant."""
    from ..model import GPT
    from ..moe.model import MoEGPT
    if a.moe:
        return MoEGPT(_config(a), _moe_config(a), moe_layer_freq=2, seed=a.seed)
    return GPT(_config(a), seed=a.seed)


def _loss(model, x, y):
    """The training loss of the single-device model: LM loss (+ the MoE balance losses)."""
    from ..moe.model import total_aux_loss
    if getattr(model, "moe_cfg", None) is None:
        return model(x, y)
    loss, stats = model(x, y)
    return loss + total_aux_loss(stats).to(loss.device)


def _batch(a, corpus, step):
    x, y = corpus.get_batch("train", a.batch, a.seq, step=step, seed=a.seed)
    return x, padded_documents(y, getattr(a, "ignore_frac", 0.0), seed=a.seed * 1_000_003 + step)


def padded_documents(y, frac: float, seed: int = 0, ignore_index: int = -100):
    """Targets ``y`` [B, S] as B documents of random length padded to S: sequence i keeps its first
    S - n_i targets and the last n_i become ``ignore_index``, n_i = floor(min(1, 2 F u_i) S) with
    u_i uniform in [0, 1) from ``seed`` (about F of the targets for F <= 1/2; some sequences keep
    all, some none). The first target of the last sequence always stays, so the step has one valid
    target at least (one device's mean is then defined). ``frac`` 0: ``y`` unchanged."""
    if frac <= 0:
        return y
    B, S = y.shape
    u = torch.rand(B, generator=torch.Generator().manual_seed(seed))
    n = ((2 * frac * u).clamp(max=1.0) * S).floor().long()
    n[-1] = n[-1].clamp(max=S - 1)
    padded = torch.arange(S).unsqueeze(0) >= (S - n).unsqueeze(1)
    return y.masked_fill(padded, ignore_index)
