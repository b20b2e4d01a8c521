"""Exercises of notebook 08_3d_parallelism: the solutions pass, plausible wrong answers fail with a
message that says what was expected and what came back; the expected values agree with the planner."""
import pytest

from labkit.grading.exercises import nb08_3d_parallelism as nb08
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails
from labkit.plan.comm import comm_per_rank
from labkit.plan.memory import memory_per_rank
from labkit.plan.spec import Layout, ModelSpec


def rank_coords(rank, t, p, d):
    if not 0 <= rank < t * p * d:
        raise ValueError("rank outside the grid")
    return rank % t, rank // (t * d), (rank // t) % d


def coords_pp_inner(rank, t, p, d):
    """Wrong: PP next to TP (rank = dp*(p t) + pp*t + tp)."""
    if not 0 <= rank < t * p * d:
        raise ValueError("rank outside the grid")
    return rank % t, (rank // t) % p, rank // (t * p)


def rank_groups(rank, t, p, d):
    tp, pp, dp = rank_coords(rank, t, p, d)
    return {"tp": [pp * d * t + dp * t + i for i in range(t)], "dp": [pp * d * t + j * t + tp for j in range(d)],
            "pp": [k * d * t + dp * t + tp for k in range(p)]}


def groups_dp_stride_wrong(rank, t, p, d):
    """Wrong: the DP group as consecutive ranks after the TP block."""
    g = rank_groups(rank, t, p, d)
    base = (rank // (t * d)) * t * d
    g["dp"] = [base + j for j in range(d)]
    return g


def groups_pp_stride_t(rank, t, p, d):
    """Wrong: the PP group's ranks t apart (one TP block), not t d (issue 36: one line with the DP stride)."""
    g = rank_groups(rank, t, p, d)
    tp, pp, dp = rank_coords(rank, t, p, d)
    g["pp"] = [dp * t + tp + k * t for k in range(p)]
    return g


def groups_without_self(rank, t, p, d):
    """Wrong: the TP group lists the other ranks only."""
    g = rank_groups(rank, t, p, d)
    g["tp"] = [x for x in g["tp"] if x != rank]
    return g


BYTES = {"bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def model_state_bytes(P, t, p, d, zero, precision):
    pb, gb, ob = BYTES[precision]
    n = P / (t * p)
    return {"params": pb * n / (d if zero >= 3 else 1), "grads": gb * n / (d if zero >= 2 else 1),
            "optimizer": ob * n / (d if zero >= 1 else 1)}


def states_adam_fp16_moments(P, t, p, d, zero, precision):
    """Wrong: optimizer 8 bytes in bf16 (forgets the fp32 master copy)."""
    out = model_state_bytes(P, t, p, d, zero, precision)
    if precision == "bf16":
        out["optimizer"] *= 8 / 12
    return out


def states_zero_all(P, t, p, d, zero, precision):
    """Wrong: any ZeRO stage shards everything."""
    out = model_state_bytes(P, t, p, d, 0, precision)
    return {k: v / (d if zero else 1) for k, v in out.items()}


def first_stage_activation_bytes(s, b, h, a, L, t, p, M, sequence_parallel, recompute):
    sbh = s * b * h
    ts = t if sequence_parallel else 1
    if recompute == "full":
        per = 2 * sbh / ts
    elif sequence_parallel:
        per = sbh * (34 + (0 if recompute == "selective" else 5 * a * s / h)) / t
    else:
        per = sbh * (10 + 24 / t + (0 if recompute == "selective" else 5 * a * s / (h * t)))
    return min(p, M) * (L / p) * per


def act_p_always(s, b, h, a, L, t, p, M, sequence_parallel, recompute):
    """Wrong: p microbatches in flight even when M < p."""
    return first_stage_activation_bytes(s, b, h, a, L, t, p, max(M, p), sequence_parallel, recompute)


def act_sp_ignored(s, b, h, a, L, t, p, M, sequence_parallel, recompute):
    """Wrong: sequence parallelism changes nothing."""
    return first_stage_activation_bytes(s, b, h, a, L, t, p, M, False, recompute)


def act_selective_needs_sp(s, b, h, a, L, t, p, M, sequence_parallel, recompute):
    """Wrong: selective recompute only counted with sequence parallelism."""
    rec = recompute if sequence_parallel or recompute == "full" else "none"
    return first_stage_activation_bytes(s, b, h, a, L, t, p, M, sequence_parallel, rec)


def act_full_ignores_sp(s, b, h, a, L, t, p, M, sequence_parallel, recompute):
    """Wrong: with full recompute the stored layer input is left whole under sequence parallelism."""
    sp = sequence_parallel and recompute != "full"
    return first_stage_activation_bytes(s, b, h, a, L, t, p, M, sp, recompute)


def choose_layout(n_gpus, gpus_per_node, gpu_memory, memory):
    ok = [(t, p) for (t, p), need in memory.items() if t <= gpus_per_node and n_gpus % (t * p) == 0
          and need <= gpu_memory]
    if not ok:
        raise ValueError("no layout fits")
    t, p = min(ok, key=lambda tp: (tp[0] * tp[1], -tp[0]))
    return t, p, n_gpus // (t * p)


def choose_pp_first(n_gpus, gpus_per_node, gpu_memory, memory):
    """Wrong: for the same t*p prefers the deeper pipeline."""
    ok = [(t, p) for (t, p), need in memory.items() if t <= gpus_per_node and need <= gpu_memory]
    if not ok:
        raise ValueError("no layout fits")
    t, p = min(ok, key=lambda tp: (tp[0] * tp[1], tp[0]))
    return t, p, n_gpus // (t * p)


def choose_ignores_memory(n_gpus, gpus_per_node, gpu_memory, memory):
    """Wrong: the smallest t*p, fitting or not."""
    t, p = min(memory, key=lambda tp: (tp[0] * tp[1], -tp[0]))
    return t, p, n_gpus // (t * p)


def choose_without_divisibility(n_gpus, gpus_per_node, gpu_memory, memory):
    """Wrong: forgets that t*p must divide the number of GPUs."""
    ok = [(t, p) for (t, p), need in memory.items() if t <= gpus_per_node and need <= gpu_memory]
    if not ok:
        raise ValueError("no layout fits")
    t, p = min(ok, key=lambda tp: (tp[0] * tp[1], -tp[0]))
    return t, p, n_gpus // (t * p)


def coords_reordered(rank, t, p, d):
    """Wrong: the right coordinates returned as (tp, dp, pp)."""
    tp, pp, dp = rank_coords(rank, t, p, d)
    return tp, dp, pp


def coords_pp_wrong(rank, t, p, d):
    """Wrong: pp from the wrong stride, the rest right."""
    tp, pp, dp = rank_coords(rank, t, p, d)
    return tp, rank // t % p, dp


def coords_pp_stride_tp(rank, t, p, d):
    """Wrong (a malformed ordering): pp steps every t*p ranks, the rest right."""
    tp, pp, dp = rank_coords(rank, t, p, d)
    return tp, rank // (t * p), dp


def coords_dp_stride_tp(rank, t, p, d):
    """Wrong (two orders mixed): dp as in a TP, PP, DP grid, pp as in this notebook's."""
    tp, pp, dp = rank_coords(rank, t, p, d)
    return tp, pp, rank // (t * p) % d


def axis_bytes(s, b, h, L, t, p, d, M, n_params, e):
    act = s * b * h * e
    return {"tp": 4 * (L // p) * M * 2 * (t - 1) / t * act, "pp": 2 * M * act, "dp": 2 * (d - 1) / d * n_params * e}


def axis_payload_not_ring(s, b, h, L, t, p, d, M, n_params, e):
    """Wrong: payload instead of ring bytes for TP and DP."""
    out = axis_bytes(s, b, h, L, t, p, d, M, n_params, e)
    act = s * b * h * e
    return {**out, "tp": 4 * (L // p) * M * act if t > 1 else 0.0, "dp": n_params * e if d > 1 else 0.0}


@pytest.mark.parametrize("ex,answer", [("8.1", rank_coords), ("8.2", rank_groups), ("8.3", model_state_bytes),
                                       ("8.4", first_stage_activation_bytes), ("8.5", choose_layout),
                                       ("8.6", axis_bytes)])
def test_solutions_pass(ex, answer):
    assert_check_passes(ex, answer)


@pytest.mark.parametrize("ex,wrong,contains", [
    ("8.1", coords_pp_inner, "a grid ordered TP innermost, then PP, DP outermost"),
    ("8.2", groups_dp_stride_wrong, "['dp']: expected [0, 2], got [0, 1] (these ranks differ from rank 0 in tp: a DP "
                                    "group's ranks share every coordinate but dp)"),
    ("8.2", groups_pp_stride_t, "['pp']: expected [0, 4], got [0, 2] (these ranks differ from rank 0 in dp: a PP "
                                "group's ranks share every coordinate but pp)"),
    ("8.2", groups_without_self, "rank 0 itself is not in its own group"),
    ("8.3", states_adam_fp16_moments, "['optimizer']"),
    ("8.3", states_zero_all, "['params']"),
    ("8.4", act_p_always, "M=2"),
    ("8.4", act_sp_ignored, "sequence_parallel=True"),
    ("8.5", choose_pp_first, "expected"),
    ("8.5", choose_ignores_memory, "GB >"),
    ("8.6", axis_payload_not_ring, "['tp']"),
])
def test_wrong_answers_fail(ex, wrong, contains):
    assert_check_fails(ex, wrong, contains=contains)


@pytest.mark.parametrize("ex, wrong, case, contains", [
    ("8.4", act_selective_needs_sp, "t=8, TP only (no SP), selective recompute", "sequence_parallel=False, "
     "recompute='selective')"),
    ("8.4", act_full_ignores_sp, "t=8, SP + full recompute", "sequence_parallel=True, recompute='full') (bytes)"),
    ("8.5", choose_without_divisibility, "a table that also lists",
     "expected (4, 3, 1), got (4, 2, 1) (t*p=8 does not divide 12 GPUs"),
    ("8.1", coords_reordered, "t=2, p=3, d=2", "t=2, p=3, d=2: these are the right coordinates in the wrong order "
     "(your tuple reads (tp, dp, pp); return (tp, pp, dp))."),
    ("8.1", coords_pp_inner, "t=2, p=3, d=2", "t=2, p=3, d=2: these are the coordinates of a grid ordered TP "
     "innermost, then PP, DP outermost, not the grid of this notebook"),
    ("8.1", coords_pp_wrong, "t=2, p=3, d=2", "rank_coords(2, t=2, p=3, d=2): coordinate pp (item 1 of (tp, pp, dp)): "
     "expected 0, got 1; your pp changes every 2 ranks, as dp does on this grid: two axes stepping together is no "
     "ordering of the axes"),
    ("8.1", coords_pp_stride_tp, "t=2, p=3, d=2", "your pp changes every 6 ranks: no ordering of the axes gives pp "
     "that stride"),
    ("8.1", coords_dp_stride_tp, "t=2, p=3, d=2", "your dp changes every 6 ranks, as in a grid ordered TP, PP, DP "
     "(innermost first), while your other coordinates follow another order; ranks 0 and 2 both get (0, 0, 0)"),
])
def test_wrong_answers_fail_a_public_case_naming_the_mistake(ex, wrong, case, contains):
    assert_public_case_fails(ex, wrong, case, contains=contains)


def test_on_a_grid_with_p_equal_to_d_both_readings_are_named():
    """t=2, p=2, d=2 cannot tell (tp, dp, pp) from DP outermost: the message says both (the public case
    t=2, p=3, d=2, which runs first, tells them apart)."""
    from labkit.grading.exercises.nb08_3d_parallelism import _explain_coords
    t, p, d = 2, 2, 2
    got = [coords_reordered(r, t, p, d) for r in range(t * p * d)]
    assert got == [coords_pp_inner(r, t, p, d) for r in range(t * p * d)]
    assert _explain_coords(got, t, p, d) == (
        "these are the right coordinates in the wrong order (your tuple reads (tp, dp, pp); return (tp, pp, dp)) "
        "or the coordinates of a grid ordered TP innermost, then PP, DP outermost, not the grid of this notebook "
        "(which axis talks in every layer, and which only once per microbatch?) (on this grid both look the same)")


def test_stub_is_not_attempted():
    def stub(*a):
        raise NotImplementedError
    for ex in ("8.1", "8.2", "8.3", "8.4", "8.5", "8.6"):
        assert_check_fails(ex, stub, status="not_attempted")


def test_expected_values_agree_with_the_planner():
    spec = ModelSpec(name="x", n_layer=16, hidden=1024, n_head=16, vocab_size=1000, seq_len=512, dropout=0.1,
                     global_batch=64)
    lay = Layout(t=2, p=4, d=4, b=2, M=8)
    c = comm_per_rank(spec, lay, pp_rank=1)                      # a middle stage
    n_params = memory_per_rank(spec, lay)[1].param_count
    want = nb08._axis(512, 2, 1024, 16, 2, 4, 4, 8, n_params, 2)
    assert c["tp"].wire == want["tp"] and c["pp"].wire == want["pp"] and c["dp"].wire == int(want["dp"])
    # 8.4 is the planner's first-stage count with the paper's 16-bit layer (no embedding / head, no LN stats)
    assert nb08._act(512, 2, 1024, 16, 16, 2, 4, 8, True, "selective") == 4 * 4 * 512 * 2 * 1024 * 34 / 2


@pytest.mark.parametrize("wrong, case, contains", [
    (lambda P, t, p, d, z, pr: model_state_bytes(P, t, 1, d, z, pr), "GPT-3 175B",
     "not divided by p: a pipeline stage holds 1/p of the layers"),
    (lambda P, t, p, d, z, pr: model_state_bytes(P, t, p, d, min(3, z + 1), pr), "GPT-3 175B", "that is ZeRO-1's"),
    (lambda *a: dict(axis_bytes(*a), pp=axis_bytes(*a)["pp"] / 2), "GPT-3 middle stage",
     "forward only: the gradients come back across the boundary"),
    (lambda *a: dict(axis_bytes(*a), tp=axis_bytes(*a)["tp"] * a[5]), "GPT-3 middle stage",
     "all L layers: this stage holds L/p of them"),
    (lambda *a: dict(axis_bytes(*a), dp=axis_bytes(*a)["dp"] * a[6] / (a[6] - 1) if a[6] > 1 else 0.0),
     "GPT-3 middle stage", "the whole gradient: a ring all-reduce sends"),
])
def test_learner_round_mistakes_are_named(wrong, case, contains):
    """Issue 36's learner round: each new wrong answer of 8.3 and 8.6 is named."""
    ex = "8.3" if "stage holds 1/p" in contains or "ZeRO-1" in contains else "8.6"
    assert_public_case_fails(ex, wrong, case, contains=contains)


def test_float_coordinates_are_named_not_truncated():
    """Issue 36's learner round: int() in the check truncated 1.5 to a right-looking 1 (a wrong answer passed)."""
    assert_public_case_fails("8.1", lambda r, t, p, d: tuple(float(c) + 0.5 for c in rank_coords(r, t, p, d)),
                             "t=2, p=3, d=2", contains="coordinates are ints, got float 0.5")
    from labkit.grading.testing import with_ints_as
    assert_check_passes("8.1", with_ints_as("numpy", lambda r, t, p, d: list(rank_coords(r, t, p, d))))


def test_float_degrees_of_a_layout_are_named():
    assert_check_fails("8.5", lambda *a: tuple(x + 0.5 for x in choose_layout(*a)), contains="t, p and d are ints")


def _states_with(n_of):
    def f(P, t, p, d, zero, precision):
        pb, gb, ob = nb08.BYTES[precision]
        n = n_of(P, t, p)
        return {"params": pb * n / (d if zero >= 3 else 1), "grads": gb * n / (d if zero >= 2 else 1),
                "optimizer": ob * n / (d if zero >= 1 else 1)}
    return f


def _axis_with(**change):
    def f(s, b, h, L, t, p, d, M, n_params, e):
        out = axis_bytes(s, b, h, L, t, p, d, M, n_params, e)
        return {k: change[k](out[k], t, d, M) if k in change else v for k, v in out.items()}
    return f


def choose_smaller_t_first(n_gpus, gpus_per_node, gpu_memory, memory):
    """Wrong: the smallest t*p, but among equal sizes the smaller t (PP before TP)."""
    ok = [(t, p) for (t, p), need in memory.items() if t <= gpus_per_node and n_gpus % (t * p) == 0
          and need <= gpu_memory]
    if not ok:
        raise ValueError("no layout fits")
    t, p = min(ok, key=lambda tp: (tp[0] * tp[1], tp[0]))
    return t, p, n_gpus // (t * p)


@pytest.mark.parametrize("ex, wrong, contains", [
    ("8.3", _states_with(lambda P, t, p: P / p), "not divided by t: a tensor-parallel rank holds 1/t"),
    ("8.3", _states_with(lambda P, t, p: P), "the whole model's: t and p each split it"),
    ("8.5", choose_smaller_t_first, "but a smaller t: for that size TP goes before PP"),
    ("8.6", _axis_with(tp=lambda v, t, d, M: v / 2), "forward only: backward all-reduces as often"),
    ("8.6", _axis_with(tp=lambda v, t, d, M: v * t / (t - 1) if t > 1 else v),
     "the whole payload per all-reduce: a ring sends 2 (t-1)/t of it"),
    ("8.6", _axis_with(pp=lambda v, t, d, M: v / M), "one microbatch: all M cross the boundary"),
    ("8.6", _axis_with(dp=lambda v, t, d, M: v * M), "an all-reduce per microbatch: the gradients are reduced once"),
])
def test_every_named_mistake_is_triggered(ex, wrong, contains):
    """Issue 36's audit: each named mistake of 8.3, 8.5 and 8.6 has a wrong answer whose line names it."""
    assert_check_fails(ex, wrong, contains=contains)


def _choose_by(key, fits=lambda t, p, g, n, need, mem: t <= g and n % (t * p) == 0 and need <= mem,
               d_of=lambda n, t, p: n // (t * p)):
    def f(n_gpus, gpus_per_node, gpu_memory, memory):
        ok = [(t, p) for (t, p), need in memory.items() if fits(t, p, gpus_per_node, n_gpus, need, gpu_memory)]
        if not ok:
            raise ValueError("no layout fits")
        t, p = min(ok, key=key)
        return t, p, d_of(n_gpus, t, p)
    return f


_SMALLEST_TP = lambda tp: (tp[0] * tp[1], -tp[0])  # noqa: E731


@pytest.mark.parametrize("wrong, contains", [
    (choose_ignores_memory, "GB: it does not fit"),
    (_choose_by(_SMALLEST_TP, fits=lambda t, p, g, n, need, mem: n % (t * p) == 0 and need <= mem),
     "GPUs per node breaks rule 1: TP stays inside a node"),
    (_choose_by(_SMALLEST_TP, d_of=lambda n, t, p: n // t), "(t*p*d = 2048, not the 1024 GPUs there are)"),
    (_choose_by(lambda tp: (-tp[0] * tp[1], -tp[0])), "is larger than needed: rule 2"),
])
def test_every_rule_a_wrong_choice_breaks_is_named(wrong, contains):
    """Issue 36's audit: each rule 8.5's line names has a wrong choice that breaks it."""
    assert_check_fails("8.5", wrong, contains=contains)
