"""Exercises of notebook 02_gpipe: the solutions pass, plausible wrong answers fail with a message
that says what was wrong (the validator's words, or expected/got)."""
import pytest

from labkit.grading.registry import get_exercise
from labkit.grading.runner import run_case
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails
from labkit.pipeline import Action


def gpipe_actions(K, M):
    actions = {}
    for r in range(K):
        acts = []
        for m in range(M):
            acts += ([Action("RECV_F", r, m)] if r > 0 else []) + [Action("F", r, m)] \
                + ([Action("SEND_F", r, m)] if r < K - 1 else [])
        for m in range(M):
            acts += ([Action("RECV_B", r, m)] if r < K - 1 else []) + [Action("B", r, m)] \
                + ([Action("SEND_B", r, m)] if r > 0 else [])
        actions[r] = acts
    return actions


def gpipe_without_receives(K, M):
    """Wrong: sends but never posts the matching receives."""
    return {r: [a for a in acts if not a.kind.startswith("RECV")] for r, acts in gpipe_actions(K, M).items()}


def gpipe_receive_on_rank0(K, M):
    """Wrong: rank 0 also 'receives' its input (stage 0 has no stage before it)."""
    out = gpipe_actions(K, M)
    out[0] = [Action("RECV_F", 0, 0)] + out[0]
    return out


def naive_one_at_a_time(K, M):
    """Valid but not GPipe: each microbatch goes forward and backward before the next starts."""
    actions = {}
    for r in range(K):
        acts = []
        for m in range(M):
            acts += ([Action("RECV_F", r, m)] if r > 0 else []) + [Action("F", r, m)] \
                + ([Action("SEND_F", r, m)] if r < K - 1 else [])
            acts += ([Action("RECV_B", r, m)] if r < K - 1 else []) + [Action("B", r, m)] \
                + ([Action("SEND_B", r, m)] if r > 0 else [])
        actions[r] = acts
    return actions


def count_in_flight(schedule):
    n = 1 + max(a.stage for acts in schedule.values() for a in acts)
    live, peak = [0] * n, [0] * n
    for acts in schedule.values():
        for a in acts:
            if a.kind in ("F", "B"):
                live[a.stage] += 1 if a.kind == "F" else -1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
    return peak


def count_forwards(schedule):
    """Wrong: counts every forward and never subtracts the backwards (right for GPipe only)."""
    n = 1 + max(a.stage for acts in schedule.values() for a in acts)
    out = [0] * n
    for acts in schedule.values():
        for a in acts:
            out[a.stage] += a.kind == "F"
    return out


def count_per_rank(schedule):
    """Wrong: one number per rank (sums a rank's stages), not per stage."""
    out = []
    for acts in schedule.values():
        live = peak = 0
        for a in acts:
            if a.kind in ("F", "B"):
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
        out.append(peak)
    return out


def test_gpipe_solution_passes():
    assert_check_passes("2.1", gpipe_actions)


def test_count_in_flight_solution_passes():
    assert_check_passes("2.2", count_in_flight)


def test_counting_per_rank_fails_with_several_stages_per_rank():
    res = assert_check_fails("2.2", count_per_rank)
    assert res.passed >= 3  # the one-stage-per-rank cases pass; the interleaved one (hidden) fails


# ----------------------------------------------------------------------------- feedback (issue 13)


def test_counting_per_rank_fails_a_public_interleaved_case():
    assert_public_case_fails("2.2", count_per_rank, "interleaved K=2, M=4, v=2",
                             contains="expected 4 numbers, one per stage ([4, 3, 2, 1]), got 2, one per rank",
                             hint="Count per STAGE, not per rank")
    assert any(c.hidden and c.name.startswith("interleaved") for c in get_exercise("2.2").cases)


def accumulate(model, x, y, M):
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        (model(xm, ym) / M).backward()


def accumulate_unscaled(model, x, y, M):
    """Wrong: every microbatch's mean loss backpropagated as it is: gradients M times too large."""
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        model(xm, ym).backward()


def accumulate_zeroing(model, x, y, M):
    """Wrong: zeroes the gradients before each microbatch, so only the last one is left."""
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        model.zero_grad()
        (model(xm, ym) / M).backward()


def test_accumulation_solution_passes():
    assert_check_passes("2.3", accumulate)


def test_unscaled_loss_is_also_caught_by_the_plain_sgd_case():
    """The SGD case alone (Adam would hide the factor M; plain SGD does not)."""
    case = next(c for c in get_exercise("2.3").cases if "SGD steps" in c.name and not c.hidden)
    assert run_case(case, accumulate).status == "passed"
    res = run_case(case, accumulate_unscaled)
    assert res.status == "failed" and "M=4 times the expected gradient" in res.message


def accumulate_full_batch(model, x, y, M):
    """Wrong: one call on the whole batch, M ignored (labkit's GPT would give the same gradient; the check's
    model has a batch-statistic term, so the gradients show it)."""
    model(x, y).backward()


def test_full_batch_ignoring_M_fails_on_the_gradients_naming_the_missing_split():
    assert_public_case_fails("2.3", accumulate_full_batch, "M=4: every parameter gradient",
                             contains="the batch was not split into M=4 microbatches")
    fresh = next(c for c in get_exercise("2.3").cases if c.name.endswith("(fresh inputs)"))
    assert fresh.hidden and run_case(fresh, accumulate).status == "passed"
    res = run_case(fresh, accumulate_full_batch)
    assert res.status == "failed" and "not split into M=" in res.message


def accumulate_split_by_M(model, x, y, M):
    """Wrong: x.split(M) cuts pieces of M rows (B/M pieces), not M pieces."""
    for xm, ym in zip(x.split(M), y.split(M)):
        (model(xm, ym) / M).backward()


def test_split_instead_of_M_pieces_is_told_by_the_model_calls():
    res = assert_public_case_fails("2.3", accumulate_split_by_M, "M=4: every parameter gradient",
                                   contains="in one step the model was called 2 time(s) with batch sizes [4, 4], "
                                            "but M=4 microbatches of 8/4 = 2 sequences each make [2, 2, 2, 2]")
    assert "0.5 times" not in res.message


def gpipe_backwards_reversed(K, M):
    """Also GPipe (the paper's Fig. 2c): the backwards from microbatch M-1 down to 0, on every rank."""
    out = {}
    for r, acts in gpipe_actions(K, M).items():
        n_f = next(i for i, a in enumerate(acts) if a.kind in ("RECV_B", "B"))
        back = [Action(a.kind, a.stage, M - 1 - a.microbatch) for a in acts[n_f:]]
        out[r] = acts[:n_f] + back
    return out


def test_gpipe_backwards_in_reverse_order_are_accepted_as_the_notebook_says():
    """Decision (notebook 02, exercise 2.1): backwards in microbatch order or in reverse both pass."""
    assert_check_passes("2.1", gpipe_backwards_reversed)


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "gpipe_missing_receives_fails_with_validator_message":
        ("2.1", gpipe_without_receives,
         {"contains": "the validator says: rank 0, action 6 (B0@s0): no RECV_B0@s0 before it"}),
    "gpipe_receive_on_first_stage": ("2.1", gpipe_receive_on_rank0,
                                     {"contains": "stage 0 has no stage -1 to receive from"}),
    "one_microbatch_at_a_time_is_not_gpipe":
        ("2.1", naive_one_at_a_time,
         {"contains": "rank 0 runs B0@s0 before F1@s0; GPipe runs all M forwards before the first backward"}),
    "counting_forwards_only_fails_on_1f1b":
        ("2.2", count_forwards,
         {"contains": "count_in_flight(hand-written 1F1B, K=2, M=3)[0]: expected 2, got 3"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


# a plausible wrong answer fails this public case first, with the message (and hint) shown
# test id: (exercise, answer, case, assert_public_case_fails's keywords)
WRONG_PUBLIC = {
    "unscaled_microbatch_loss_fails_naming_the_factor_M":
        ("2.3", accumulate_unscaled, "M=4: every parameter gradient",
         {"contains": "it is exactly M=4 times the expected gradient: the M microbatch losses were added up as "
                      "they are, but the batch loss is their MEAN"}),
    "zeroing_inside_the_loop_fails_with_the_difference":
        ("2.3", accumulate_zeroing, "M=4: every parameter gradient",
         {"contains": "embedding.wte.weight vs the full batch's gradient: tensors of shape (256, 16) differ in"}),
}


@pytest.mark.parametrize("exercise,answer,case,kw", WRONG_PUBLIC.values(), ids=WRONG_PUBLIC)
def test_wrong_answer_fails_public_case(exercise, answer, case, kw):
    assert_public_case_fails(exercise, answer, case, **kw)


# ----------------------------------------------------------------------------- 2.4: ignored targets
import torch  # noqa: E402


def step_losses(token_losses, valid):
    d = token_losses.shape[0]
    n = valid.sum()
    sums = token_losses.masked_fill(~valid, 0).sum((2, 3))
    return sums * d / n if n else torch.zeros_like(sums)


def mean_of_means(token_losses, valid):
    """Wrong: each microbatch's token mean divided by M (exercise 2.3's rule on uneven pieces)."""
    M = token_losses.shape[1]
    return token_losses.masked_fill(~valid, 0).sum((2, 3)) / valid.sum((2, 3)) / M


def mean_of_means_guarded(token_losses, valid):
    """Wrong: the mean of means, with 0 instead of NaN for an empty piece."""
    return mean_of_means(token_losses, valid).nan_to_num(0.0)


def per_rank_count(token_losses, valid):
    """Wrong: each rank divides by its own valid targets (the gradient-accumulation fix without DP)."""
    return token_losses.masked_fill(~valid, 0).sum((2, 3)) / valid.sum((1, 2, 3)).unsqueeze(1)


def divided_by_m(token_losses, valid):
    """Wrong: the step's count, and then 1/M again."""
    return step_losses(token_losses, valid) / token_losses.shape[1]


def no_factor_d(token_losses, valid):
    """Wrong: the step's count, forgetting that DP averages the d ranks' gradients."""
    return step_losses(token_losses, valid) / token_losses.shape[0]


def ignored_summed(token_losses, valid):
    """Wrong: sums every position, ignored ones included."""
    return token_losses.sum((2, 3)) * token_losses.shape[0] / valid.sum()


def nan_when_empty(token_losses, valid):
    """Wrong: right except that a step without any valid target gives 0/0."""
    d = token_losses.shape[0]
    return token_losses.masked_fill(~valid, 0).sum((2, 3)) * d / valid.sum()


def test_step_loss_solution_passes():
    assert_check_passes("2.4", step_losses)


def test_labkit_s_reference_is_refused():
    from labkit.grading.references import reference_message
    from labkit.parallel.loss import microbatch_losses
    assert_check_fails("2.4", microbatch_losses, contains=reference_message("labkit.parallel.loss:microbatch_losses"))


@pytest.mark.parametrize("answer,case,contains", [
    (mean_of_means, "d=2, M=3", "each microbatch's own token mean divided by M (the mean of means)"),
    (mean_of_means_guarded, "d=2, M=3", "(the mean of means)"),
    (per_rank_count, "d=2, M=3", "each rank divided by its own count of valid targets (a per-rank count)"),
    (divided_by_m, "d=2, M=3", "M=3 times too small: divided by M on top of the step's count"),
    (no_factor_d, "d=2, M=3", "d=2 times too small: the d ranks' gradients are AVERAGED"),
    (ignored_summed, "d=2, M=3", "the ignored positions were added in"),
], ids=["mean of means", "mean of means, 0 for empty", "per-rank count", "dividing by M", "no factor d",
        "ignored summed"])
def test_step_loss_wrong_answers_are_named(answer, case, contains):
    assert_public_case_fails("2.4", answer, case, contains=contains)


def test_step_loss_empty_shards_are_public_and_named():
    names = [c.name for c in get_exercise("2.4").cases if not c.hidden]
    assert any("no valid target" in n and "microbatch" in n for n in names)
    assert any("no valid target" in n and "rank" in n for n in names)
    # the mean of means that avoids NaN still fails on the uneven pieces; the per-rank count's NaN is named too
    res = assert_check_fails("2.4", per_rank_count)
    assert "a per-rank count" in res.message
    res = assert_check_fails("2.4", nan_when_empty)          # passes the public cases, fails the hidden one
    bad = [c for c in res.cases if c.status == "failed"]
    assert len(bad) == 1 and bad[0].name.startswith("no valid target in the whole step"), res.message
    case = next(c for c in get_exercise("2.4").cases if c.name == bad[0].name)
    out = run_case(case, nan_when_empty)                     # what the instructor's report shows
    assert "returned NaN when the step has no valid target" in out.message, out.message
    assert "rank 0" not in out.message and "[2, 2, 2, 4]" not in out.message.split(")", 1)[1], out.message


def test_step_loss_hidden_case_names_do_not_state_the_answer():
    for c in get_exercise("2.4").cases:                      # Gradescope shows every case's name
        if c.hidden:
            assert "NaN" not in c.name and "zero" not in c.name.lower(), c.name


def float_values(token_losses, valid):
    """Wrong: the right numbers, rebuilt from Python floats (no graph)."""
    d, M = token_losses.shape[:2]
    N = int(valid.sum())
    return torch.tensor([[float(token_losses[r, m][valid[r, m]].sum()) * d / N for m in range(M)]
                         for r in range(d)], dtype=token_losses.dtype)


def detached(token_losses, valid):
    """Wrong: the right values, detached from the graph."""
    return step_losses(token_losses, valid).detach()


def as_list(token_losses, valid):
    """Wrong: the right values as nested Python lists."""
    return step_losses(token_losses, valid).tolist()


def where_zero(token_losses, valid):
    """Wrong: right values everywhere, but torch.where's untaken 0/0 branch puts NaN into the backward."""
    d = token_losses.shape[0]
    n = valid.sum()
    sums = (token_losses * valid).sum((2, 3))
    return torch.where(n > 0, sums * d / n, torch.zeros_like(sums))


def detached_plus_own(token_losses, valid):
    """Wrong: the right values, with a graph whose weight is 1 (a detached correction added)."""
    sums = token_losses.masked_fill(~valid, 0).sum((2, 3))
    return sums + (step_losses(token_losses, valid) - sums).detach()


@pytest.mark.parametrize("answer,contains", [
    (float_values, "your losses carry no gradient"),
    (detached, "your losses carry no gradient"),
    (as_list, "expected a tensor of shape [d, M] = [2, 3], got a list"),
    (detached_plus_own, "the gradient that flows back is not theirs"),
], ids=["float()", ".detach()", ".tolist()", "detached correction"])
def test_step_loss_without_its_gradient_fails(answer, contains):
    assert_public_case_fails("2.4", answer, "d=2, M=3", contains=contains)


def test_step_loss_nan_gradient_on_an_empty_step_is_named():
    res = assert_check_fails("2.4", where_zero)              # right values: only the hidden empty step fails
    bad = [c for c in res.cases if c.status == "failed"]
    assert len(bad) == 1 and bad[0].name.startswith("no valid target in the whole step"), res.message
    out = run_case(next(c for c in get_exercise("2.4").cases if c.name == bad[0].name), where_zero)
    assert "holds NaN or inf when the step has no valid target" in out.message, out.message


def test_step_loss_cases_are_fresh_each_run():
    fresh = next(c for c in get_exercise("2.4").cases if c.name.endswith("(fresh inputs)"))
    assert fresh.hidden
    assert run_case(fresh, step_losses).status == "passed"
    assert run_case(fresh, per_rank_count).status == "failed"


def test_step_loss_hints_do_not_give_the_answer():
    ex = get_exercise("2.4")
    for text in (ex.hint, ex.hint2):
        assert "* d / N" not in text and "d / N" not in text and "sum(" not in text


def test_labkit_s_microbatch_losses_is_the_step_token_mean():
    from labkit.grading.exercises.nb02_gpipe import _step_inputs
    from labkit.parallel.loss import microbatch_losses
    for seed, d, M, empty in ((1, 2, 3, [(0, 1)]), (2, 3, 2, [(1, None)]), (3, 2, 2, [(0, None), (1, None)])):
        losses, valid = _step_inputs(seed, d, M, 2, 8, empty)
        got = microbatch_losses(losses, valid)
        assert torch.allclose(got, step_losses(losses, valid), rtol=1e-12, atol=0)
        want = losses[valid].mean() if valid.any() else torch.tensor(0.0, dtype=torch.float64)
        assert torch.allclose(got.sum() / d, want, rtol=1e-12, atol=0)


def test_step_loss_reference_is_withheld_from_the_graded_kernel():
    from labkit.grading.withhold import withheld
    held = withheld("02_gpipe")
    for name in ("labkit.parallel.loss:microbatch_losses", "labkit.parallel.loss:loss_scale",
                 "labkit.parallel.loss:StepTokenCount", "labkit.parallel.gpt:ParallelGPT"):   # and what reaches them
        assert "2.4" in held.get(name, ()), sorted(k for k in held if "parallel" in k)   # (ParallelGPT: 2.1's too)


def test_notebook_02_exercises_read_in_order_and_hints_name_their_sections():
    import json
    import re
    from pathlib import Path
    nb = json.loads((Path(__file__).resolve().parents[2] / "solutions" / "02_gpipe.ipynb").read_text())
    order = [tuple(int(i) for i in m.groups()) for c in nb["cells"] if c["cell_type"] == "code"
             for m in re.finditer(r'check\("(\d+)\.(\d+)"', "".join(c["source"]))]
    assert order == sorted(order) and len(order) == len(set(order)) == 4, order
    sections = {m.group(2): int(m.group(1)) for c in nb["cells"] if c["cell_type"] == "markdown"
                for m in re.finditer(r"^## (\d+)\. (.*)$", "".join(c["source"]), re.M)}
    ignored = next(n for title, n in sections.items() if title.startswith("Ignored targets"))
    assert get_exercise("2.4").hint.startswith(f"Section {ignored}:"), (get_exercise("2.4").hint, sections)
