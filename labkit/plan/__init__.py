"""Memory, communication and time per GPU for a layout (t, p, d, ...): formulas, presets, planner.

* :mod:`.activations`: activation bytes of one layer: Korthikanti et al. 2022's formulas and
  labkit's exact count;
* :mod:`.spec`: :class:`ModelSpec` (GPT / MoE / MLA sizes, parameter counts), :class:`Layout`
  (t, p, d, v, M, schedule, ZeRO, SP, recompute, precision, ep), :class:`Cluster`, the presets;
* :mod:`.params`: total and active parameters (:func:`count_parameters`), the decode cost;
* :mod:`.memory`: parameters, gradients, optimizer state and activations of every pipeline rank;
* :mod:`.comm`: communication per step, per axis, and the link each axis uses;
* :mod:`.planner`: the time model and MFU, the search over layouts with Megatron's rules, the
  explanation of the winner, the error naming the smallest memory that would work;
* :mod:`.cli`: ``python -m labkit plan``.

Every count is labkit's own (what its runs hold and send), so a run can print the planner's
figure next to the measured one.
"""
from .activations import korthikanti_layer_activation_bytes, layer_activation_bytes, torch_saved_bytes_per_element
from .comm import AxisComm, axis_links, comm_per_rank
from .memory import RankMemory, check_layout, memory_per_rank, most_loaded_rank
from .params import DecodeCost, ParamCount, count_parameters, decode_cost, expected_experts_touched
from .planner import PlanEntry, PlanError, StepTime, explain, plan, step_time
from .spec import PRESETS, PUBLISHED, Cluster, Layout, ModelSpec, load_model_json, preset

__all__ = ["korthikanti_layer_activation_bytes", "layer_activation_bytes", "torch_saved_bytes_per_element",
           "AxisComm", "axis_links", "comm_per_rank", "RankMemory", "check_layout", "memory_per_rank",
           "most_loaded_rank", "PlanEntry", "PlanError", "StepTime", "explain", "plan", "step_time",
           "DecodeCost", "ParamCount", "count_parameters", "decode_cost", "expected_experts_touched",
           "PRESETS", "PUBLISHED", "Cluster", "Layout", "ModelSpec", "load_model_json", "preset"]
