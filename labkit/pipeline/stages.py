"""Cut the reference GPT into pipeline stages by layers.

With L blocks and ``n_stages = K * v`` stages, stage ``i`` holds blocks
``i * L / n_stages .. (i + 1) * L / n_stages - 1``; the embedding goes on stage 0 and the
final LayerNorm + output projection (the head) on the last stage. Each stage is a deep copy
of the single-device model's modules, so the pipeline starts from the same weights.
With looped placement (stage i on rank i % K) and L = 16, K = 4, v = 2, rank 0 holds
stage 0 = blocks 0-1 (and the embedding) and stage 4 = blocks 8-9.
"""
from __future__ import annotations

import numbers

from ..model import GPT, lm_loss
from .schedules import ScheduleError, stage_rank

__all__ = ["GPTStage", "split_gpt", "stage_layers", "gpt_stages_for_rank", "gpt_param_name", "lm_loss",
           "step_torch_schedule"]


def stage_layers(n_layer: int, n_stages: int, stage: int) -> range:
    """Block indices of ``stage`` (L blocks over ``n_stages`` stages; L % n_stages == 0).

    Raises ScheduleError (a ValueError) when a size is not an integer (n_layer >= 1,
    n_stages >= 1), the layers do not divide evenly, or ``stage`` is outside 0..n_stages-1."""
    for name, value in (("n_layer", n_layer), ("n_stages", n_stages), ("stage", stage)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ScheduleError(f"stage_layers: {name} must be an integer, got {value!r}")
    if n_layer < 1 or n_stages < 1:
        raise ScheduleError(f"stage_layers: n_layer={n_layer} and n_stages={n_stages} must both be >= 1")
    if n_layer % n_stages:
        raise ScheduleError(f"n_layer={n_layer} layers cannot be split evenly into K*v={n_stages} stages "
                            f"(the number of layers must be a multiple of K*v)")
    if not 0 <= stage < n_stages:
        raise ScheduleError(f"stage={stage} is outside 0..n_stages-1 = 0..{n_stages - 1}")
    per = n_layer // n_stages
    return range(stage * per, (stage + 1) * per)


GPTStage = GPT   # a pipeline stage is a slice of the reference GPT (:meth:`labkit.model.GPT.slice`)


def split_gpt(model: GPT, n_stages: int, stages=None) -> list[GPT]:
    """Deep copies of ``model``'s parts as ``n_stages`` slices (:meth:`labkit.model.GPT.slice`; only the
    indices in ``stages`` when given, else all). Raises ScheduleError when
    ``model.cfg.n_layer`` is not a multiple of ``n_stages``."""
    L = model.cfg.n_layer
    stage_layers(L, n_stages, 0)  # validates
    if getattr(model.cfg, "share_embeddings_and_output_weights", False) and n_stages > 1:
        raise ScheduleError("a GPT with tied embeddings cannot be cut into separate stage copies here: the first "
                            "and last stage must all-reduce the shared matrix's gradient (use labkit.parallel."
                            "ParallelGPT, which does)")
    return [model.slice(stage_layers(L, n_stages, i), i == 0, i == n_stages - 1)
            for i in (range(n_stages) if stages is None else stages)]


def gpt_stages_for_rank(model: GPT, K: int, v: int, rank: int) -> list[GPT]:
    """The v stages that rank ``rank`` holds with looped placement (stages rank, rank+K, ...)."""
    n = K * v
    return split_gpt(model, n, [s for s in range(n) if stage_rank(s, K) == rank])


def gpt_param_name(stage: GPT, name: str) -> str:
    """Name in the single-device GPT of a stage parameter: ``blocks.0.x`` -> ``blocks.<global>.x``."""
    return stage.reference_name(name)


def step_torch_schedule(schedule, rank: int, K: int, x, target) -> None:
    """One step of a ``torch.distributed.pipelining`` schedule, with its calling convention
    (the reference that labkit's runtime is compared with): rank 0 passes the input ``x``
    [B, S], rank K-1 the ``target`` [B, S], one rank holding every stage passes both, and
    the ranks between pass neither."""
    if rank == 0:
        schedule.step(x, target=target if K == 1 else None)
    elif rank == K - 1:
        schedule.step(target=target)
    else:
        schedule.step()
