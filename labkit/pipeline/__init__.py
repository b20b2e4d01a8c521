"""Pipeline parallelism: schedules as data, a validator, a simulator, a runtime, a plot.

* :mod:`.schedules`: ``Action(kind, stage, microbatch)``, the :class:`Schedule` object (actions
  per rank, K, M, n_stages, placement; ``message``/``needs``/``produces``) and the builders
  ``gpipe_schedule(K, M)``, ``one_f_one_b_schedule(K, M)``, ``interleaved_schedule(K, M, v)``;
  ``add_communication`` inserts sends/receives into a compute-only schedule.
* :mod:`.zero_bubble`: the backward split into I and W: ``zb_h1_schedule``, ``zbv_schedule``,
  ``dualpipev_schedule`` and their bubble formulas (``bubble_time_formula``).
* :mod:`.registry`: the one table of schedule names (builder, placement, runtime class, bubble
  formula, label, accepted spellings) that the labs, the planner and the explorer read.
* :mod:`.symbolic`: the one symbolic executor (deadlock check, hang diagnosis, simulator clock).
* :mod:`.rules`: the validity pass (dependencies, pairing, deadlock, ...) that the validator
  and the simulator both run; :mod:`.validate`: ``validate_schedule``, its public entry point
  (raises ``ScheduleError`` naming rank and action).
* :mod:`.simulate`: ``simulate`` (timeline, bubble fraction, peak in flight), ``bubble_formula``.
* :mod:`.runtime`: the interpreter, ``PipelineStage`` and ``PipelineSchedule`` (any schedule
  data) on torch.distributed; it executes actions and emits events, from which :mod:`.stats`
  derives in-flight, stash and W-memory figures; :mod:`.hang` explains a step that hung.
* :mod:`.schedule_classes`: the named schedules ``ScheduleGPipe``, ``Schedule1F1B``,
  ``ScheduleInterleaved1F1B``, ``ScheduleZBH1``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``.
* :mod:`.stages`: cut the reference GPT into stages by layers.
* :mod:`.trace`: ``write_chrome_trace`` (timelines as Chrome trace-event JSON for Perfetto).
* :mod:`.plot`: ``plot_timeline`` (Gantt chart of a simulated or measured timeline).

The torch parts (runtime, schedule classes, stages) are imported on first use, so that the
schedule data, the registry and the simulator load without torch (the planner reads the registry).
"""
from .registry import REGISTRY, ScheduleInfo, canonical, lookup
from .schedules import (
    COMM,
    COMPUTE,
    KINDS,
    PLACEMENTS,
    Action,
    Message,
    Schedule,
    ScheduleError,
    add_communication,
    check_pipeline_sizes,
    format_schedule,
    gpipe_schedule,
    infer_placement,
    interleaved_schedule,
    one_f_one_b_schedule,
    parse_actions,
    stage_rank,
)
from .simulate import (
    SimResult,
    TimedAction,
    bubble_formula,
    bubble_fraction,
    peak_in_flight,
    peak_waiting_for_w,
    simulate,
)
from .trace import chrome_trace, trace_problems, write_chrome_trace
from .validate import validate_schedule
from .zero_bubble import (
    bubble_time_formula,
    dualpipev_overlapped,
    dualpipev_schedule,
    zb_h1_schedule,
    zbv_bubble_terms,
    zbv_schedule,
)

__all__ = [
    "Action", "ScheduleError", "COMPUTE", "COMM", "KINDS", "stage_rank", "parse_actions",
    "format_schedule", "add_communication", "check_pipeline_sizes", "gpipe_schedule",
    "one_f_one_b_schedule", "interleaved_schedule", "validate_schedule", "simulate", "SimResult",
    "TimedAction", "bubble_formula", "bubble_fraction", "peak_in_flight",
    "PLACEMENTS", "infer_placement", "peak_waiting_for_w", "zb_h1_schedule", "zbv_schedule", "dualpipev_schedule",
    "dualpipev_overlapped", "bubble_time_formula", "zbv_bubble_terms",
    "Schedule", "Message", "REGISTRY", "ScheduleInfo", "lookup", "canonical",
]
_LAZY = {  # name -> module (imports torch)
    **{n: "runtime" for n in ("PipelineSchedule", "PipelineStage")},
    **{n: "schedule_classes" for n in ("Schedule1F1B", "ScheduleDualPipeV", "ScheduleGPipe", "ScheduleInterleaved1F1B",
                                       "ScheduleZBH1", "ScheduleZBVZeroBubble")},
    **{n: "stages" for n in ("GPTStage", "gpt_stages_for_rank", "split_gpt")},
}
__all__ += ["PipelineStage", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
            "ScheduleZBH1", "ScheduleZBVZeroBubble", "ScheduleDualPipeV",
            "GPTStage", "split_gpt", "gpt_stages_for_rank"]
__all__ += ["chrome_trace", "write_chrome_trace", "trace_problems"]


def __getattr__(name):
    """The torch parts, imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
