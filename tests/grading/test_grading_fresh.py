"""Fresh inputs (labkit.grading.fresh): every exercise of labkit's notebooks that takes inputs has a hidden case
drawing them in the grader, so a lookup table of the shipped inputs fails it."""
import copy
import importlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from labkit.grading.fresh import EXEMPT, MARK, has_fresh_case
from labkit.grading.registry import all_exercises, get_exercise, load_all
from labkit.grading.runner import run_case

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")}


def _shipped_exercises():
    load_all()
    return [ex for ex in all_exercises() if ex.notebook in NOTEBOOKS]


def test_every_exercise_has_a_fresh_case_or_an_exemption():
    exercises = _shipped_exercises()
    assert len({ex.notebook for ex in exercises}) == len(NOTEBOOKS) == 18  # notebooks 00-17, all loaded
    missing = [ex.id for ex in exercises if not has_fresh_case(ex) and ex.id not in EXEMPT]
    assert not missing, f"exercises without a fresh case (add fresh_case(...) or an EXEMPT entry): {missing}"


def test_the_exemptions_name_real_exercises_without_inputs_and_say_why():
    ids = {ex.id for ex in _shipped_exercises()}
    for ex_id, why in EXEMPT.items():
        assert ex_id in ids, f"EXEMPT names {ex_id}, which is no exercise"
        assert not has_fresh_case(get_exercise(ex_id)), f"{ex_id} has a fresh case: drop its EXEMPT entry"
        assert why.startswith("no inputs"), why


def test_a_fresh_case_is_hidden_and_keeps_the_number_of_cases():
    for ex in _shipped_exercises():
        fresh = [c for c in ex.cases if c.name.endswith(MARK)]
        assert len(fresh) <= 1 and all(c.hidden for c in fresh), (ex.id, [c.name for c in fresh])


# ----------------------------------------------------------------------------- lookup tables fail


def _key(x):
    """A hashable key of a call's arguments (tensors and arrays by value)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), str(x.dtype), tuple(x.reshape(-1).tolist()))
    if isinstance(x, np.ndarray):
        return ("array", x.shape, x.tobytes())
    if isinstance(x, dict):
        return ("dict", tuple(sorted((repr(k), _key(v)) for k, v in x.items())))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(v) for v in x))
    return repr(x)


def _solution(nb: str, name: str):
    sys.path.insert(0, str(ROOT / "tests" / "exercises"))
    try:
        return getattr(importlib.import_module(f"test_exercises_nb{nb}"), name)
    finally:
        sys.path.remove(str(ROOT / "tests" / "exercises"))


# exercise -> the tests' solution (module number, name): plain functions of their arguments
LOOKUP = {"2.2": ("02", "count_in_flight"), "5.1": ("05", "segment_boundaries"),
          "5.2": ("05", "best_segment_count"), "6.1": ("06", "mlp_partials"), "8.5": ("08", "choose_layout"),
          "9.2": ("09", "capacity_keep"), "9.3": ("09", "moe_param_count"), "12.2": ("12", "group_limited_topk"),
          "13.3": ("13", "bubble_time"), "14.1": ("14", "pack_groups"), "14.2": ("14", "replica_counts"),
          "14.3": ("14", "inter_node_bytes"), "14.4": ("14", "decode_bound")}


@pytest.mark.parametrize("ex_id", LOOKUP)
def test_a_lookup_table_of_every_input_it_was_asked_passes_the_fixed_cases_and_fails_the_fresh_one(ex_id):
    """The red-team's answer (D5a: 8.5, D5b: 14.4): a table of the right answers for the inputs it has seen,
    built here from one run of every case (the fresh one included: even a table of one run's draws is no use
    for the next run's)."""
    solution, table = _solution(*LOOKUP[ex_id]), {}
    ex = get_exercise(ex_id)

    def record(*args):
        try:
            out = solution(*copy.deepcopy(args))
        except ValueError as e:     # a case that expects ValueError: the table raises it too
            table[_key(args)] = e
            raise
        table[_key(args)] = copy.deepcopy(out)
        return out

    def lookup(*args):
        out = table.get(_key(args))   # None (a wrong answer, not a ValueError) when not seen
        if isinstance(out, ValueError):
            raise out
        return copy.deepcopy(out)

    for case in ex.cases:          # in this process, so the table fills (run_case forks)
        case.fn(record)
    results = {c.name: run_case(c, lookup, ex) for c in ex.cases}
    fresh = next(name for name in results if name.endswith(MARK))
    fixed = {n: r.status for n, r in results.items() if n != fresh}
    assert set(fixed.values()) == {"passed"}, fixed                # every shipped input is in the table ...
    assert results[fresh].status == "failed", results[fresh]      # ... the fresh draws are not
    assert run_case(ex.cases[[c.name for c in ex.cases].index(fresh)], solution, ex).status == "passed"
