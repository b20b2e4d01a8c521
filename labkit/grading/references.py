"""Which of labkit's own functions each exercise asks the learner to write.

The graded kernel does without each of these, and without every kit function from which one
can be reached, until its exercise is graded (:mod:`labkit.grading.withhold`); the interactive
``check`` says so with :func:`reference_message` (:mod:`labkit.grading.kernel`).

The table lists, per exercise id, ``"module:qualname"`` of functions or classes (a class
stands for every function defined in its body). Exercise modules may add more with
``exercise(..., references=[fn, ...])``. Functions that merely *use* an exercise's concept are
not listed (3.1 may call ``add_communication``: the check adds the sends itself). An answer
that copies labkit's source text is for the instructor's integrity report, never the score.
"""
from __future__ import annotations

__all__ = ["REFERENCES", "NOTHING_TO_WITHHOLD", "reference_message", "references_for"]

_SCHED = "labkit.pipeline.schedules"
_SIM = "labkit.pipeline.simulate"
_EXPLORER = "labkit.pipeline.explorer"
_TPM = "labkit.tensor_parallel.mappings"
_ZB = "labkit.pipeline.zero_bubble"
_EX = "labkit.grading.exercises"

REFERENCES: dict[str, list[str]] = {
    "0.1": [f"{_EX}.nb00_distributed_primer:_gloo_reduce_scatter", "labkit.comm:reduce_scatter_tensor"],
    "0.2": [],  # collectives are refused by the case itself (send/recv only)
    "1.1": [f"{_SIM}:bubble_formula", f"{_SIM}:bubble_fraction", f"{_SIM}:simulate",
            f"{_EX}.nb01_pipeline_bubble:_bubble", f"{_ZB}:bubble_time_formula", "labkit.plan.timing:step_time"],
    "1.2": [f"{_EX}.nb01_pipeline_bubble:_smallest"],
    "2.1": [f"{_SCHED}:gpipe_schedule", f"{_SCHED}:add_communication"],
    "2.3": [],  # the runtime scales the loss too, but inside PipelineSchedule; nothing to call directly
    # the step loss with ignored targets; StepTokenCount (ParallelGPT's) computes it too
    "2.4": ["labkit.parallel.loss:microbatch_losses", "labkit.parallel.loss:loss_scale",
            "labkit.parallel.loss:StepTokenCount"],
    "2.2": [f"{_SIM}:peak_in_flight", f"{_EXPLORER}:peak_in_flight_per_rank", f"{_SIM}:simulate"],
    "3.1": [f"{_SCHED}:one_f_one_b_schedule", f"{_SCHED}:interleaved_schedule", f"{_SCHED}:_interleaved_order"],
    "3.2": [f"{_SIM}:peak_in_flight", f"{_EXPLORER}:peak_in_flight_per_rank", f"{_SIM}:simulate",
            f"{_SCHED}:one_f_one_b_schedule"],
    "4.1": ["labkit.pipeline.stages:stage_layers", "labkit.pipeline.stages:gpt_stages_for_rank",
            f"{_EX}.nb04_interleaved:_code_layers", "labkit.plan.memory:rank_chunks",
            "labkit.plan.memory:rank_layer_chunks", "labkit.plan.memory:rank_stages"],
    "4.2": [f"{_SIM}:bubble_formula", f"{_SIM}:bubble_fraction", f"{_SIM}:simulate", f"{_ZB}:bubble_time_formula",
            "labkit.plan.timing:step_time"],
    "4.3": [f"{_EXPLORER}:count_sends", f"{_SCHED}:interleaved_schedule", f"{_SCHED}:add_communication"],
    "5.1": ["labkit.checkpoint:checkpoint_sequential"],
    "5.2": [f"{_EX}.nb05_checkpointing:_cost", "labkit.checkpoint:memory_table"],
    "5.3": ["labkit.checkpoint:CheckpointFunction", "labkit.checkpoint:checkpoint",
            "labkit.checkpoint:checkpoint_sequential"],
    "6.1": [f"{_EX}.nb06_megatron_ffn:_expected_partials"],
    "6.2": [f"{_TPM}:_CopyToModelParallelRegion", f"{_TPM}:copy_to_tensor_model_parallel_region"],
    "6.3": [f"{_TPM}:_ReduceFromModelParallelRegion", f"{_TPM}:reduce_from_tensor_model_parallel_region"],
    "6.4": ["labkit.tensor_parallel.layers:RowParallelLinear"],
    "7.1": [f"{_EX}.nb07_attention_embedding_loss:_heads"],
    "7.2": ["labkit.tensor_parallel.layers:VocabParallelEmbedding"],
    "7.3": ["labkit.tensor_parallel.cross_entropy:vocab_parallel_cross_entropy",
            "labkit.tensor_parallel.cross_entropy:_VocabParallelCrossEntropy"],
    "8.1": ["labkit.grid:ProcessGrid", "labkit.grid:make_grid", "labkit.grid:Mesh"],
    "8.2": ["labkit.grid:ProcessGrid", "labkit.grid:make_grid", "labkit.grid:Mesh"],
    "8.3": ["labkit.plan.memory:rank_param_counts"],
    "8.4": ["labkit.plan.activations:korthikanti_layer_activation_bytes",
            "labkit.plan.activations:layer_activation_bytes"],
    "8.5": ["labkit.plan.planner:plan", "labkit.plan.planner:candidates", "labkit.plan.planner:smallest_memory"],
    "8.6": ["labkit.plan.comm:comm_per_rank"],
    "9.1": ["labkit.moe.router:route", "labkit.moe.router:TopKRouter"],
    "9.2": ["labkit.moe.router:compute_capacity", "labkit.moe.router:capacity_mask", "labkit.moe.router:route"],
    "9.3": ["labkit.plan.params:count_parameters"],
    "10.1": ["labkit.moe.losses:switch_aux_loss", "labkit.moe.losses:expert_fraction"],
    "10.2": ["labkit.moe.losses:device_balance_loss", "labkit.moe.losses:expert_balance_loss",
             "labkit.moe.losses:_device_groups"],
    "10.3": ["labkit.moe.router:update_expert_bias"],
    "11.1": [f"{_EX}.nb11_expert_parallelism:_true_splits", "labkit.moe.expert_parallel:exchange_splits"],
    "11.2": [],
    "12.1": [],
    "12.2": ["labkit.moe.router:route", "labkit.moe.router:TopKRouter"],
    "12.3": [],
    "12.4": [],
    "13.1": ["labkit.pipeline.split_backward:backward_input", "labkit.pipeline.split_backward:backward_weight"],
    "13.2": ["labkit.pipeline.zero_bubble:zb_h1_schedule"],
    "13.3": [f"{_SIM}:simulate", f"{_ZB}:zb_h1_schedule", f"{_ZB}:zbv_schedule", f"{_ZB}:bubble_time_formula",
             f"{_ZB}:zbv_bubble_terms"],
    "14.1": ["labkit.moe.eplb:balanced_packing"],
    "14.2": ["labkit.moe.eplb:replicate_experts"],
    "14.3": ["labkit.moe.hierarchical:inter_node_rows"],
    "14.4": ["labkit.plan.params:decode_cost", "labkit.plan.params:expected_experts_touched"],
    # a red team's: labkit functions that compute these answers without calling the ones above
    "15.1": ["labkit.data_parallel.flat:padded_numel", "labkit.data_parallel.flat:flatten"],
    "15.2": ["labkit.plan.memory:memory_per_rank", "labkit.plan.memory:most_loaded_rank",
             "labkit.plan.memory:bytes_per_param", "labkit.plan.memory:_zero_shard"],
    "15.3": ["labkit.data_parallel.zero2:expected_zero2", "labkit.data_parallel.fsdp:expected_fsdp",
             "labkit.plan.comm:comm_per_rank"],
    "15.4": ["labkit.data_parallel.fsdp:expected_fsdp", "labkit.plan.memory:zero3_split_gathered_peak"],
    "16.1": ["labkit.context_parallel.blockwise:merge_partials"],
    "17.2": ["labkit.parallel.torch_native:plan_table"],
    "17.3": ["labkit.grid:Mesh"],
    "17.5": ["labkit.pipeline.schedules:one_f_one_b_schedule"],
    "16.2": ["labkit.context_parallel.sharding:chunk_placement", "labkit.context_parallel.sharding:sequence_positions",
             "labkit.context_parallel.sharding:causal_work", "labkit.context_parallel.sharding:shard_sequence"],
}


# exercises whose answer no kit function hands over, and why (the evidence is data the grader judges, or the
# exercise asks about the kit itself); tests/grading/test_grading_absent.py requires a reason for each
NOTHING_TO_WITHHOLD: dict[str, str] = {
    "0.2": "the ranks have no process group: every send/recv goes through the grader's relay, which judges the "
           "messages step by step; labkit's collectives cannot run there",
    "2.3": "the gradients returned are judged against one device's; labkit's runtime accumulates inside "
           "PipelineSchedule, which takes a schedule, not the microbatch loop asked for",
    "11.2": "a count of bytes from the sizes given (arithmetic on the three all-to-alls); no kit function returns it",
    "12.1": "a binomial coefficient: math.comb is knowledge, like numpy",
    "12.3": "the exercise asks where each concept lives in labkit's gate: reading the kit is the exercise",
    "12.4": "the exercise asks for labkit's own MoEConfig fields: using the kit's names is the exercise",
    "17.1": "a table of which collective torch's DTensor redistribute issues: torch's own behaviour is knowledge, "
            "and no kit function returns it",
    "17.4": "torch.chunk's split of dim 0 (FSDP2's rule): torch is knowledge, like numpy",
}


def references_for(exercise_id: str) -> list[str]:
    """The ``"module:qualname"`` names listed for ``exercise_id`` (empty when none)."""
    return list(REFERENCES.get(str(exercise_id), ()))


def _name_of(label: str) -> tuple[str, str]:
    """("gpipe_schedule", "labkit.pipeline.schedules") from "labkit.pipeline.schedules:gpipe_schedule"."""
    mod, _, qual = str(label).partition(":")
    return (qual, mod) if qual else (mod, "")


def reference_message(label: str) -> str:
    """What a learner's ``check`` says when the answer called ``label``, which the graded kernel lacks
    while the exercise is graded (:func:`labkit.grading.withhold.withheld_calls`)."""
    qual, mod = _name_of(label)
    where = f" ({mod})" if mod else ""
    return (f"your answer calls labkit's {qual}{where}, which is not available when the notebook is graded (it is, "
            f"or runs, an implementation an exercise asks you to write): write it yourself")
