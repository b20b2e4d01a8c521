"""Exercises of notebook 13_zero_bubble: the solutions pass; a W not delayed, a backward
not split, .backward() instead of autograd.grad, and the full-backward "B" confusion fail
with messages that say so."""
import pytest
import torch

from labkit.grading.testing import assert_check_fails, assert_check_passes
from labkit.pipeline import Action


def split_linear_backward(layer, x, grad_out):
    out = layer(x)
    (gx,) = torch.autograd.grad(out, x, grad_out, retain_graph=True)
    gw, gb = torch.autograd.grad(out, [layer.weight, layer.bias], grad_out)
    return gx, gw, gb


def with_backward(layer, x, grad_out):
    layer(x).backward(grad_out)
    return x.grad, layer.weight.grad, layer.bias.grad


def zb_h1_order(K, M, delay=True, split=True, extra_warmup=0, newest_w=False):
    order = {}
    for r in range(K):
        warm = min(K - 1 - r + extra_warmup, M)
        acts = [Action("F", r, m) for m in range(warm)]
        pending, nf = [], warm
        for m in range(M):
            if nf < M:
                acts.append(Action("F", r, nf))
                nf += 1
            if not split:
                acts.append(Action("B", r, m))
                continue
            acts.append(Action("I", r, m))
            pending.append(m)
            if len(pending) > (r if delay else 0):
                acts.append(Action("W", r, pending.pop(-1 if newest_w else 0)))
        acts += [Action("W", r, m) for m in pending]
        order[r] = acts
    return order


def bubble_time(name, K, f, i, w):
    return {"1f1b": (K - 1) * (f + i + w), "zb-h1": (K - 1) * (f + i - w), "zbv": (K - 1) * f}[name]


def test_solutions_pass():
    assert_check_passes("13.1", split_linear_backward)
    assert_check_passes("13.2", zb_h1_order)
    assert_check_passes("13.3", bubble_time)


def test_wrong_weight_grad_fails():
    def wrong(layer, x, grad_out):
        gx, gw, gb = split_linear_backward(layer, x, grad_out)
        return gx, gw.t().contiguous() if gw.shape[0] == gw.shape[1] else gw * 2, gb
    assert_check_fails("13.1", wrong, contains="grad_weight vs the full backward")


def test_w_before_i_fails_with_the_validator():
    def w_first(K, M):
        order = zb_h1_order(K, M)
        acts = order[0]
        i = acts.index(Action("I", 0, 0))
        j = acts.index(Action("W", 0, 0))
        acts[i], acts[j] = acts[j], acts[i]
        return order
    assert_check_fails("13.2", w_first, contains="W before its I: I0@s0 has not run")


def test_full_backward_confusion_is_named():
    def confused(name, K, f, i, w):
        b = i + w
        return (K - 1) * (f + b - w) if name == "zb-h1" else bubble_time(name, K, f, i, w)
    res = assert_check_fails("13.3", confused, contains="DeepSeek-V3 issue #724")
    assert "input-gradient pass T_I only" in res.message

    def report_formula_with_input_grad(name, K, f, i, w):
        return (K - 1) * (f + i - 2 * w) if name == "zb-h1" else bubble_time(name, K, f, i, w)
    assert_check_fails("13.3", report_formula_with_input_grad, contains="B = the full backward T_I + T_W")

    def no_w_in_1f1b(name, K, f, i, w):
        return (K - 1) * (f + i) if name == "1f1b" else bubble_time(name, K, f, i, w)
    assert_check_fails("13.3", no_w_in_1f1b, contains="W pass is on the critical path")


def test_one_warm_up_forward_too_many_is_told_as_the_warm_up():
    res = assert_check_fails("13.2", lambda K, M: zb_h1_order(K, M, extra_warmup=1),
                             contains="rank 0 runs 3 forward(s) before its first I, 1F1B's warm-up plus one forward "
                                      "(notebook 03) is 2; the warm-up is too long")
    assert "delays too many W" not in res.message


def test_any_waiting_w_is_accepted_as_the_notebook_says():
    """Decision (notebook 13, exercise 13.2): the W that runs may be any waiting one; the memory and the
    bubble are the same, so the check does not require the oldest (labkit's schedule takes the oldest)."""
    assert_check_passes("13.2", lambda K, M: zb_h1_order(K, M, newest_w=True))


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "backward_instead_of_autograd_grad": ("13.1", with_backward,
                                          {"contains": ".grad was written"}),
    "zb_h1_without_delayed_w_fails_on_the_bubble":
        ("13.2", lambda K, M: zb_h1_order(K, M, delay=False),
         {"contains": "T_F=1, T_I=1, T_W=1; ZB-H1's is 1"}),
    "zb_h1_with_full_backward": ("13.2", lambda K, M: zb_h1_order(K, M, split=False),
                                 {"contains": "uses full backward B actions"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


def test_bubble_time_learner_round_mistakes_are_named():
    from labkit.grading.testing import assert_public_case_fails
    assert_public_case_fails("13.3", lambda n, K, f, i, w: bubble_time(n, K, f, i, w) * K / max(1, K - 1),
                             "1F1B and ZB-H1", contains="K idle stretches counted where a rank waits K - 1")
    assert_public_case_fails("13.3", lambda n, K, f, i, w: bubble_time("zb-h1", K, f, i, w) / 2 if n == "zbv"
                             else bubble_time(n, K, f, i, w), "ZB-V, K=4", contains="half of ZB-H1's")


def test_a_0d_tensor_is_a_number():
    """Issue 36: integers of any kind, a 0-d tensor too."""
    from labkit.grading.testing import assert_check_passes, with_ints_as
    assert_check_passes("13.3", with_ints_as("tensor", bubble_time))
    assert_check_passes("13.3", with_ints_as("numpy", bubble_time))
