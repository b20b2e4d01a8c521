"""A NaN compares false with everything, so a check written ``if abs(got - want) > tol: fail``
passes it (a red team scored 15.2, 15.3 and 9.3 in full with ``return float('nan')``). Every
case of every exercise is run here with answers that return NaN as a number and as a pair: none may
pass a single case (a tensor's NaN goes through ``expect_close``/``expect_equal``, where NaN always
differs)."""
import pytest

from labkit.grading.assignments import ANSWERS as PINNED
from labkit.grading.runner import evaluate

NAN = float("nan")
ANSWERS = {
    "a NaN": lambda *a, **k: NAN,
    "a pair of NaNs": lambda *a, **k: (NAN, NAN),
}


IDS = sorted(PINNED, key=lambda i: tuple(map(int, i.split("."))))  # the course's exercises (tests add others)


@pytest.mark.usefixtures("references_imported")
@pytest.mark.parametrize("exercise_id", IDS)
def test_a_nan_answer_passes_no_case(exercise_id):
    for what, answer in ANSWERS.items():
        res = evaluate(exercise_id, answer)
        passed = [c.name for c in res.cases if c.status == "passed"]
        assert not passed, f"exercise {exercise_id}: {what} passes {passed}"
