"""The assignment, pinned by the grader: which function each exercise is graded from, and when.

``python -m labkit grade --assignment 02_gpipe sub.ipynb`` grades exactly the exercises of
notebook ``02_gpipe``, whatever the submission's metadata, file name or ``check`` calls say.
Each exercise is graded from the function (or class) the learner notebook asks for, by the
name in :data:`ANSWERS` (the name the stub defines and the solution's ``check`` passes), at its
grading point (:func:`grading_points`): right after the last cell that calls
``check("N.k", ...)``; when the submission has no such cell, right after the last top-level cell
that defines the name. The grader then registers that name itself, so an exercise whose
``check`` cell was deleted is still graded, and what a ``check`` call registered never stands
for another exercise's answer. An exercise whose name no cell defines is "not attempted".
"""
from __future__ import annotations

import ast
import re

__all__ = ["ANSWERS", "answer_name", "grading_points", "defines", "register_code", "cell_python"]

# exercise id -> the name the learner notebook defines for it (the solutions' check(...) argument)
ANSWERS: dict[str, str] = {
    "0.1": "reduce_scatter_by_hand", "0.2": "ring_all_reduce",
    "1.1": "bubble_fraction", "1.2": "smallest_microbatches",
    "2.1": "gpipe_actions", "2.2": "count_in_flight", "2.3": "accumulate_microbatches", "2.4": "microbatch_losses",
    "3.1": "one_f_one_b_order", "3.2": "in_flight_1f1b",
    "4.1": "layers_of_rank", "4.2": "interleaved_bubble", "4.3": "p2p_sends",
    "5.1": "segment_boundaries", "5.2": "best_segment_count", "5.3": "MyCheckpoint",
    "6.1": "mlp_partials", "6.2": "CopyToRegion", "6.3": "ReduceFromRegion", "6.4": "row_parallel_linear",
    "7.1": "heads_of_rank", "7.2": "partial_embedding", "7.3": "vocab_parallel_ce",
    "8.1": "rank_coords", "8.2": "rank_groups", "8.3": "model_state_bytes",
    "8.4": "first_stage_activation_bytes", "8.5": "choose_layout", "8.6": "axis_bytes",
    "9.1": "top_k_gate", "9.2": "capacity_keep", "9.3": "moe_param_count",
    "10.1": "switch_aux_loss", "10.2": "device_balance_loss_mine", "10.3": "update_bias",
    "11.1": "dispatch_splits", "11.2": "a2a_bytes",
    "12.1": "n_combinations", "12.2": "group_limited_topk", "12.3": "gate_lines", "12.4": "deepseek_v3_gate",
    "13.1": "split_linear_backward", "13.2": "zb_h1_order", "13.3": "bubble_time",
    "14.1": "pack_groups", "14.2": "replica_counts", "14.3": "inter_node_bytes", "14.4": "decode_bound",
    "15.1": "shard_flat", "15.2": "zero_memory", "15.3": "comm_volume", "15.4": "gathered_peak",
    "15.5": "unshard_flat",
    "16.1": "merge_attention_partials", "16.2": "causal_chunk_placement",
    "17.1": "redistribute_collective", "17.2": "block_plan", "17.3": "submesh_ranks", "17.4": "fsdp2_local_numel",
    "17.5": "torch_1f1b_actions",
}


def _check_pattern(ex_id: str):
    return re.compile(r"""\bcheck\(\s*["']""" + re.escape(ex_id) + r"""["']""")


def cell_python(src: str) -> str:
    """A notebook cell's source as the Python IPython runs, line numbers kept: each magic, ``!`` line
    and ``name?`` becomes the call IPython makes of it; a cell magic's body (``%%time``,
    ``%%capture``, ``%%writefile x.py``, ...) is read as the cell's own code below a blank first
    line (IPython runs it in the kernel's namespace, or writes it to a module the notebook imports).
    Every reader of a learner's cells goes through here, so a habit never hides code from the
    grader. The raw text when IPython is missing or cannot transform the cell."""
    lines = src.splitlines(keepends=True)
    lead = 0
    while lead < len(lines) and not lines[lead].strip():
        lead += 1
    if lead < len(lines) and lines[lead].startswith("%%"):
        return "\n" * (lead + 1) + cell_python("".join(lines[lead + 1:]))
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        return TransformerManager().transform_cell(src)
    except Exception:  # noqa: BLE001 - IPython missing or a cell it cannot transform: the raw text
        return src


def defines(src: str, name: str) -> bool:
    """Whether the cell's top level binds ``name`` (def, class, assignment, import), read as
    :func:`cell_python` reads it (a magic beside the ``def`` hides nothing)."""
    try:
        tree = ast.parse(cell_python(src))
    except (SyntaxError, ValueError):
        return False
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
            return True
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store) and sub.id == name:
                return True
            if isinstance(sub, (ast.Import, ast.ImportFrom)) and any(
                    (a.asname or a.name.split(".")[0]) == name for a in sub.names):
                return True
    return False


def answer_name(ex_id: str, cells) -> str:
    """The name exercise ``ex_id`` is graded from: :data:`ANSWERS`, else (an instructor's own
    exercise) the plain name its last ``check`` call passes; "" when there is none."""
    if ex_id in ANSWERS:
        return ANSWERS[ex_id]
    pat = re.compile(r"""\bcheck\(\s*["']""" + re.escape(ex_id) + r"""["']\s*,\s*([A-Za-z_]\w*)\s*\)""")
    found = [m.group(1) for _, src in cells for m in pat.finditer(src)]
    return found[-1] if found else ""


def grading_points(cells, exercise_ids) -> dict[str, int | None]:
    """{exercise id: position in ``cells`` after which it is graded, or None (never defined)}.

    ``cells`` is ``[(index, source), ...]`` (the notebook's code cells in order). The point is the
    last cell with ``check("N.k", ...)`` (a repeated check: the last counts), else the last cell
    whose top level defines the exercise's name (:func:`answer_name`)."""
    out: dict[str, int | None] = {}
    for ex_id in exercise_ids:
        pat, name = _check_pattern(ex_id), answer_name(ex_id, cells)
        found = [k for k, (_, src) in enumerate(cells) if pat.search(src)]
        if not found and name:
            found = [k for k, (_, src) in enumerate(cells) if defines(src, name)]
        out[ex_id] = found[-1] if found else None
    return out


def register_code(ex_id: str, name: str) -> str:
    """The code the grader runs in the kernel to register ``name`` as the answer to ``ex_id``
    ("" when there is no name: what the notebook's own check registered is graded)."""
    if not name:
        return ""
    return (f"import labkit.grading.kernel as __labkit_kernel\n"
            f"__labkit_kernel.register({ex_id!r}, {name})\n"
            f"del __labkit_kernel\n")
