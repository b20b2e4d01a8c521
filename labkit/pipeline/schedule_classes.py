"""The named pipeline schedules, torch.distributed.pipelining's classes: thin subclasses of
:class:`~.runtime.PipelineSchedule` that build their action lists from the registry's builders.

* one stage per rank: :class:`ScheduleGPipe`, :class:`Schedule1F1B`, :class:`ScheduleZBH1`;
* v stages per rank, looped placement (stage i on rank i % K): :class:`ScheduleInterleaved1F1B`;
* two stages per rank, V placement (rank r holds stages r and 2K-1-r):
  :class:`ScheduleZBVZeroBubble`, :class:`ScheduleDualPipeV`.

Each checks its sizes (``check_pipeline_sizes``) and its stages per rank before it builds; the
interpreter in :mod:`.runtime` runs what it built.
"""
from __future__ import annotations

from typing import Sequence

from .runtime import PipelineSchedule, PipelineStage
from .schedules import ScheduleError, check_pipeline_sizes, gpipe_schedule, interleaved_schedule, one_f_one_b_schedule
from .zero_bubble import dualpipev_schedule, zb_h1_schedule, zbv_schedule

__all__ = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBH1", "ScheduleZBVZeroBubble",
           "ScheduleDualPipeV"]


class _OneStagePerRank(PipelineSchedule):
    """A named schedule with one stage per rank, built by ``_builder(K, M)``."""

    _builder = None

    def _build(self, K, M, v):
        check_pipeline_sizes(K, M)
        if v != 1 or self.num_stages != K:
            raise ScheduleError(f"{type(self).__name__} needs one stage per rank: num_stages={self.num_stages}, "
                                f"world size K={K}, {v} stage(s) on this rank")
        return self._builder(K, M)


class ScheduleGPipe(_OneStagePerRank):
    """GPipe: all forwards, then all backwards (:func:`~.schedules.gpipe_schedule`).
    ``ScheduleGPipe(stage, n_microbatches, loss_fn, recompute=False)``; K = group size."""

    _builder = staticmethod(gpipe_schedule)


class Schedule1F1B(_OneStagePerRank):
    """1F1B / PipeDream-Flush (:func:`~.schedules.one_f_one_b_schedule`).
    ``Schedule1F1B(stage, n_microbatches, loss_fn, recompute=False)``; K = group size."""

    _builder = staticmethod(one_f_one_b_schedule)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B with v = len(stages) chunks per rank
    (:func:`~.schedules.interleaved_schedule`; M in equal rounds, torch's rule, when v >= 2)."""

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches, loss_fn=None, **kw):
        super().__init__(list(stages) if isinstance(stages, (list, tuple)) else [stages],
                         n_microbatches, loss_fn, **kw)

    def _build(self, K, M, v):
        check_pipeline_sizes(K, M, v)
        if self.num_stages != K * v:
            raise ScheduleError(f"ScheduleInterleaved1F1B: num_stages={self.num_stages} must equal K*v = "
                                f"{K}*{v} (world size times stages per rank)")
        return interleaved_schedule(K, M, v)


# ----------------------------------------------------------------------------- zero-bubble schedules


class ScheduleZBH1(_OneStagePerRank):
    """ZB-H1 (Qi et al. 2024, sec. 2.1; :func:`~.zero_bubble.zb_h1_schedule`): 1F1B with each
    backward split into I (input gradient) and W (weight gradients), W delayed on the first
    ranks. ``ScheduleZBH1(stage, n_microbatches, loss_fn, recompute=False)``; K = group size.
    torch's nearest is ``ScheduleInterleavedZeroBubble`` with one stage per rank."""

    _builder = staticmethod(zb_h1_schedule)


class _TwoStagesV(PipelineSchedule):
    """A named schedule with two stages per rank in V placement (rank r: stages r, 2K-1-r)."""

    _builder = None

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches, loss_fn=None, **kw):
        super().__init__(list(stages) if isinstance(stages, (list, tuple)) else [stages],
                         n_microbatches, loss_fn, **kw)

    def _build(self, K, M, v):
        check_pipeline_sizes(K, M)
        if v != 2 or self.num_stages != 2 * K:
            raise ScheduleError(f"{type(self).__name__} needs exactly 2 stages per rank (V placement: rank r holds "
                                f"stages r and 2K-1-r): got {v} stage(s) on this rank, num_stages="
                                f"{self.num_stages}, K={K}")
        return type(self)._builder(K, M)


class ScheduleZBVZeroBubble(_TwoStagesV):
    """ZB-V (Qi et al. 2024, sec. 6; :func:`~.zero_bubble.zbv_schedule`), torch's name and
    order. ``ScheduleZBVZeroBubble([stage_r, stage_2K-1-r], n_microbatches, loss_fn)``."""

    _builder = staticmethod(zbv_schedule)


class ScheduleDualPipeV(_TwoStagesV):
    """DualPipeV (DualPipe README; :func:`~.zero_bubble.dualpipev_schedule`), torch's name
    and order; M >= 2K. The overlapped F&B pairs run one after the other here (one compute
    stream; the overlap of communication with compute is DualPipe's point on GPUs).
    ``ScheduleDualPipeV([stage_r, stage_2K-1-r], n_microbatches, loss_fn)``."""

    _builder = staticmethod(dualpipev_schedule)
