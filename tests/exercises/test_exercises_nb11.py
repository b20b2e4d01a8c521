"""Exercises of notebook 11_expert_parallelism: the solutions pass, plausible wrong answers fail
with a message that says what was expected and what came back."""
import pytest

from labkit.grading.testing import assert_check_fails, assert_check_passes


def _send_counts(indices_per_rank, destination):
    P = len(indices_per_rank)
    return [[int((destination(idx).reshape(-1) == q).sum()) for q in range(P)] for idx in indices_per_rank]


def dispatch_splits(indices_per_rank, experts_per_rank):
    send = _send_counts(indices_per_rank, lambda idx: idx // experts_per_rank)
    P = len(send)
    return [(send[p], [send[s][p] for s in range(P)]) for p in range(P)]


def splits_receive_what_it_sends(indices_per_rank, experts_per_rank):
    """Wrong: output_split_sizes = input_split_sizes (what it sends, not what it receives)."""
    return [(i, list(i)) for i, _ in dispatch_splits(indices_per_rank, experts_per_rank)]


def splits_round_robin(indices_per_rank, experts_per_rank):
    """Wrong: expert e placed on rank e % P (labkit places consecutive experts on a rank)."""
    P = len(indices_per_rank)
    send = _send_counts(indices_per_rank, lambda idx: idx % P)
    return [(send[p], [send[s][p] for s in range(P)]) for p in range(P)]


def a2a_bytes(input_split_sizes, output_split_sizes, n_experts, hidden, elem_bytes=4):
    return {"counts": 8 * n_experts, "dispatch": sum(input_split_sizes) * hidden * elem_bytes,
            "combine": sum(output_split_sizes) * hidden * elem_bytes}


def bytes_combine_same_as_dispatch(input_split_sizes, output_split_sizes, n_experts, hidden, elem_bytes=4):
    """Wrong: the combine sends back what this rank dispatched, not what its experts computed."""
    return dict(a2a_bytes(input_split_sizes, output_split_sizes, n_experts, hidden, elem_bytes),
                combine=sum(input_split_sizes) * hidden * elem_bytes)


def bytes_counts_int32(input_split_sizes, output_split_sizes, n_experts, hidden, elem_bytes=4):
    """Wrong: counts as 4-byte ints."""
    return dict(a2a_bytes(input_split_sizes, output_split_sizes, n_experts, hidden, elem_bytes), counts=4 * n_experts)


def test_solutions_pass():
    assert_check_passes("11.1", dispatch_splits)
    assert_check_passes("11.2", a2a_bytes)


# a plausible wrong answer fails with a message that names the mistake
# test id: (exercise, answer, assert_check_fails's keywords)
WRONG = {
    "output_splits_equal_to_input_splits": ("11.1", splits_receive_what_it_sends,
                                            {"contains": "output_split_sizes (slots it RECEIVES from ranks "
                                                         "0..P-1)[1]: expected 2, got 1"}),
    "round_robin_expert_placement": ("11.1", splits_round_robin,
                                     {"contains": "input_split_sizes (slots it SENDS to ranks 0..P-1)[0]: expected "
                                                  "2, got 1"}),
    "combine_bytes_of_the_dispatch": ("11.2", bytes_combine_same_as_dispatch,
                                      {"contains": "(the rows this rank dispatched: the combine returns"}),
    "counts_as_int32": ("11.2", bytes_counts_int32,
                        {"contains": "counts bytes (measured by CommLog): expected 64, got 32 (the counts were taken "
                                     "as 4-byte ints"}),
    "counts_one_per_rank": ("11.2", lambda i, o, E, H, b=4: dict(a2a_bytes(i, o, E, H, b), counts=8 * len(i)),
                            {"contains": "expected 64, got 32 (one count per rank"}),
    "dispatch_in_values": ("11.2", lambda i, o, E, H, b=4: dict(a2a_bytes(i, o, E, H, b), dispatch=sum(i) * H),
                           {"contains": "(a number of values, not bytes"}),
    "dispatch_in_bf16": ("11.2", lambda i, o, E, H, b=4: dict(a2a_bytes(i, o, E, H, b), dispatch=sum(i) * H * 2),
                         {"contains": "(2 bytes per value"}),
    "counts_of_all_ranks": ("11.2", lambda i, o, E, H, b=4: dict(a2a_bytes(i, o, E, H, b), counts=8 * E * len(i)),
                            {"contains": "(the counts of all P ranks"}),
}


@pytest.mark.parametrize("exercise,answer,kw", WRONG.values(), ids=WRONG)
def test_wrong_answer_fails(exercise, answer, kw):
    assert_check_fails(exercise, answer, **kw)


def test_integers_of_any_kind_are_accepted():
    """Issue 36: split sizes and byte counts as NumPy ints or 0-d int tensors are ints."""
    from labkit.grading.testing import with_ints_as
    for kind in ("numpy", "tensor"):
        assert_check_passes("11.1", with_ints_as(kind, dispatch_splits))
        assert_check_passes("11.2", with_ints_as(kind, a2a_bytes))
