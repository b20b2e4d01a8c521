"""Pipeline parallelism: schedules as data, a validator, a simulator, a runtime, a plot.

* :mod:`.zero_bubble`: the backward split into I and W: ``zb_h1_schedule``, ``zbv_schedule``,
  ``dualpipev_schedule`` and their bubble formulas (``bubble_time_formula``).
* :mod:`.schedules`: ``Action(kind, stage, microbatch)`` and the builders
  ``gpipe_schedule(K, M)``, ``one_f_one_b_schedule(K, M)``, ``interleaved_schedule(K, M, v)``;
  ``add_communication`` inserts sends/receives into a compute-only schedule.
* :mod:`.validate`: ``validate_schedule`` (raises ``ScheduleError`` naming rank and action).
* :mod:`.simulate`: ``simulate`` (timeline, bubble fraction, peak in flight), ``bubble_formula``.
* :mod:`.runtime`: ``PipelineStage``, ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``PipelineSchedule`` (any schedule data) on torch.distributed.
* :mod:`.stages`: cut the reference GPT into stages by layers.
* :mod:`.trace`: ``write_chrome_trace`` (timelines as Chrome trace-event JSON for Perfetto).
* :mod:`.plot`: ``plot_timeline`` (Gantt chart of a simulated or measured timeline).
"""
from .schedules import (
    COMM, COMPUTE, KINDS, PLACEMENTS, Action, ScheduleError, add_communication, check_pipeline_sizes,
    format_schedule, gpipe_schedule, infer_placement, interleaved_schedule, one_f_one_b_schedule, parse_actions,
    stage_rank,
)
from .simulate import (SimResult, TimedAction, bubble_formula, bubble_fraction, peak_in_flight, peak_waiting_for_w,
                       simulate)
from .validate import validate_schedule
from .zero_bubble import (bubble_time_formula, dualpipev_overlapped, dualpipev_schedule, zb_h1_schedule,
                          zbv_bubble_terms, zbv_schedule)

__all__ = [
    "Action", "ScheduleError", "COMPUTE", "COMM", "KINDS", "stage_rank", "parse_actions",
    "format_schedule", "add_communication", "check_pipeline_sizes", "gpipe_schedule",
    "one_f_one_b_schedule", "interleaved_schedule", "validate_schedule", "simulate", "SimResult",
    "TimedAction", "bubble_formula", "bubble_fraction", "peak_in_flight",
    "PLACEMENTS", "infer_placement", "peak_waiting_for_w", "zb_h1_schedule", "zbv_schedule", "dualpipev_schedule",
    "dualpipev_overlapped", "bubble_time_formula", "zbv_bubble_terms",
]
from .runtime import (PipelineSchedule, PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                      ScheduleInterleaved1F1B, ScheduleZBH1, ScheduleZBVZeroBubble)
from .stages import GPTStage, gpt_stages_for_rank, split_gpt
from .trace import chrome_trace, trace_problems, write_chrome_trace

__all__ += ["PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
            "ScheduleZBH1", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
            "GPTStage", "split_gpt", "gpt_stages_for_rank"]
__all__ += ["chrome_trace", "write_chrome_trace", "trace_problems"]
