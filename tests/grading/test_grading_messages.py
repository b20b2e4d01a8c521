"""What a failed comparison says (labkit.grading.registry.expect_*): same-shape tensors say how
they differ (how many elements, the largest difference and where, values around it, a constant
factor), scalars are shown as numbers, and an IndexError from a missing offset gets a hint."""
import numpy as np
import pytest
import torch

from labkit.grading.registry import CheckFailure, expect_close, expect_equal, explain_index_errors


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(CheckFailure) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_same_shape_tensors_say_where_and_how_much_they_differ():
    expected = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    got = expected.clone()
    got[2, 3] += 0.5
    msg = _message(expect_close, got, expected, "out")
    assert msg.startswith("out: tensors of shape (4, 8) differ in 1 of 32 elements; largest difference 0.5 at "
                          "index [2, 3]: expected 19, got 19.5; around it: expected [..., 18, 19, 20, 21, ...], "
                          "got [..., 18, 19.5, 20, 21, ...]"), msg
    assert "expected tensor of shape" not in msg and "x the expected values" not in msg
    assert _message(expect_equal, got, expected, "out") == msg  # exact comparison: same words


def test_a_constant_factor_is_named():
    expected = torch.linspace(-1, 1, 12).reshape(3, 4)
    msg = _message(expect_close, 4 * expected, expected, "grad")
    assert "differ in 12 of 12 elements" in msg and msg.endswith("; got 4 x the expected values, everywhere"), msg


def test_nan_counts_as_a_difference():
    expected = torch.ones(10)
    got = expected.clone()
    got[7] = float("nan")
    msg = _message(expect_close, got, expected, "y")
    assert "differ in 1 of 10 elements; largest difference inf at index [7]: expected 1, got nan" in msg, msg


def test_scalars_are_numbers():
    assert _message(expect_close, torch.tensor(1.105), 1.0, "loss") == \
        "loss: expected 1, got 1.105; got 1.105 x the expected value"
    assert _message(expect_close, torch.tensor(1.105), torch.tensor(1.0), "loss") == \
        "loss: expected 1, got 1.105; got 1.105 x the expected value"
    assert _message(expect_equal, torch.tensor(3), torch.tensor(4), "n") == "n: expected 4, got 3"
    assert _message(expect_equal, np.float64(0.25), 0.5, "p") == \
        "p: expected 0.5, got 0.25; got 0.5 x the expected value"
    assert "shape=()" not in _message(expect_close, torch.tensor([1.105]).reshape(()), 2.0, "x")


@pytest.mark.parametrize("got, expected, factor", [
    (0.04, 0.01, "; got 4 x the expected value"),            # a loss not divided by M = 4
    (torch.tensor(0.5), 1.0, "; got 0.5 x the expected value"),
    (-2.0, 2.0, "; got -1 x the expected value"),            # a sign
    (24, 48, "; got 0.5 x the expected value"),              # ints: a whole factor is named
    (96, 48, "; got 2 x the expected value"),
    (3, 4, ""),                                       # ints: 0.75 says nothing
    (0.0, 1.0, ""), (1.0, 0.0, ""),                   # no factor to a zero
])
def test_scalars_name_a_constant_factor(got, expected, factor):
    msg = _message(expect_close if isinstance(expected, float) else expect_equal, got, expected, "x")
    if factor:
        assert msg.endswith(factor), msg
    else:
        assert "x the expected" not in msg, msg


def test_small_tensors_show_their_values():
    msg = _message(expect_close, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "v")
    assert msg == ("v: expected tensor([1, 3]), got tensor([1, 2]) (largest difference at index [1]: expected 3, "
                   "got 2)"), msg


def test_small_tensors_name_a_constant_factor():
    msg = _message(expect_close, torch.tensor([2.0, -4.0, 6.0]), torch.tensor([1.0, -2.0, 3.0]), "grad")
    assert msg.endswith("; got 2 x the expected values, everywhere"), msg
    assert "x the expected" not in _message(expect_close, torch.tensor([2.0, 2.0]), torch.tensor([1.0, 3.0]), "v")


def test_shape_and_dtype_mismatches_are_unchanged():
    assert _message(expect_close, torch.zeros(2, 3), torch.zeros(3, 2), "x") == \
        "x: expected shape (3, 2), got shape (2, 3)"
    assert _message(expect_equal, torch.zeros(2), torch.zeros(2, dtype=torch.float64), "x") == \
        "x: expected dtype torch.float64, got torch.float32"


def test_index_errors_get_the_hint():
    with pytest.raises(CheckFailure, match=r"^f\(ids\) raised IndexError: index 9 is out of bounds .*; subtract "
                                           r"the offset$"):
        with explain_index_errors("f(ids)", "subtract the offset"):
            torch.zeros(4)[torch.tensor([9])]
    with pytest.raises(CheckFailure, match="raised RuntimeError: index 5 is out of bounds"):
        with explain_index_errors("g", "hint"):
            torch.zeros(2, 3).gather(1, torch.tensor([[5]]))
    with pytest.raises(RuntimeError, match="other"):  # other errors pass through
        with explain_index_errors("g", "hint"):
            raise RuntimeError("other")


def test_case_names_do_not_state_an_answer():
    """Issue 36: 3.1's case names gave 3.2's answer min(M, K-s), 13.2's gave 13.3's (K-1)(T_F+T_I-T_W), 2.3's
    its own "(loss / M each)". A public case name is seen before the exercise is passed: no formula of the
    notebook's exercises (the solutions' own expressions) may appear in one."""
    from labkit.grading.registry import all_exercises

    banned = ["min(M, K-s)", "min(M, K - s)", "(K-1)(T_F+T_I-T_W)", "(K-1)/(M+K-1)", "loss / M", "2cp-1-r",
              "2 cp - 1 - r", "4 + 12/d", "2 + 14/d", "16/d", "1.5x"]
    found = [(ex.id, c.name, b) for ex in all_exercises() for c in ex.cases if not c.hidden for b in banned
             if b.replace(" ", "") in c.name.replace(" ", "")]
    assert not found, found
