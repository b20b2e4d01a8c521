"""Exercise 0.2 (ring all-reduce): a ring that passes the whole tensor round the ring gives the
right sum, and now fails a PUBLIC case that counts what each rank sends, with the numbers."""
import torch

from labkit import comm
from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_public_case_fails


def ring_whole_tensor(ctx, tensor):
    """Wrong (but the right sum): N-1 steps, each passing a whole tensor to the right."""
    n, r = ctx.world_size, ctx.rank
    total, passing = tensor.clone(), tensor.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(passing)
        req = comm.isend(passing, (r + 1) % n)
        comm.recv(incoming, (r - 1) % n)
        req.wait()
        total += incoming
        passing = incoming
    tensor.copy_(total)
    return tensor


def test_ring_sending_the_whole_tensor_fails_a_public_case_with_the_count():
    assert_public_case_fails(
        "0.2", ring_whole_tensor, "each rank sends 2(N-1)/N of the tensor",
        contains="rank 0 sent 48 elements; that is 3 whole tensors, but a ring all-reduce of 16 elements on N=4 "
                 "ranks sends 2(N-1) chunks of 16/N: 2(N-1)/N x 16 = 24",
        hint="does any step of yours send more than one chunk")


def test_a_hidden_traffic_case_remains_for_other_sizes():
    cases = get_exercise("0.2").cases
    assert any(c.hidden and c.name.startswith("each rank sends") for c in cases)
