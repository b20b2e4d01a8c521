"""Exercise 0.2 (ring all-reduce): a ring that passes the whole tensor round the ring gives the
right sum, and now fails a PUBLIC case that counts what each rank sends, with the numbers. The
ranks talk only through the grader's relay: a real collective finds no process group, and a sum
moved by other means (files) or messages that are not what a ring sends fail on the relay's log."""
import os
import time

import torch

from labkit import comm
from labkit.grading.registry import get_exercise
from labkit.grading.testing import assert_check_fails, assert_check_passes, assert_public_case_fails


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


def ring_solution(ctx, tensor):
    """The notebook's ring (reduce-scatter, then all-gather, one chunk per step)."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        req = comm.isend(chunks[(r - s) % n], (r + 1) % n)
        comm.recv(incoming, (r - 1) % n)
        req.wait()
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):
        req = comm.isend(chunks[(r + 1 - s) % n], (r + 1) % n)
        comm.recv(chunks[(r - s) % n], (r - 1) % n)
        req.wait()
    return tensor


def test_the_ring_passes_every_case():
    assert_check_passes("0.2", ring_solution)


_real_all_reduce = torch.distributed.all_reduce  # an alias bound before the case runs


def ring_through_an_alias(ctx, tensor):
    """Wrong: a real collective through an alias made before the check (no process group exists)."""
    _real_all_reduce(tensor)
    return tensor


def test_a_collective_through_an_alias_finds_no_process_group():
    res = assert_check_fails("0.2", ring_through_an_alias)
    assert res.passed == 0, res.message
    assert "rank" in res.message and "process group" in res.message, res.message


def test_a_sum_moved_outside_send_recv_fails_on_what_the_relay_saw(tmp_path):
    def by_files(ctx, tensor):  # every rank writes its tensor to a file and sums the others' files
        # written under another name, then renamed (atomic on one file system): a "*.pt" file another
        # rank sees is always complete, whatever the load (a sleep before reading was a race)
        part = tmp_path / f"{ctx.rank}.part"
        torch.save(tensor, part)
        os.replace(part, tmp_path / f"{ctx.rank}.pt")
        while len(list(tmp_path.glob("*.pt"))) < ctx.world_size:
            time.sleep(0.01)
        return sum(torch.load(tmp_path / f"{k}.pt") for k in range(ctx.world_size))

    def by_files_once(ctx, tensor):
        for p in tmp_path.glob("*.pt"):
            if int(p.stem) >= ctx.world_size:
                p.unlink(missing_ok=True)
        return by_files(ctx, tensor)

    res = assert_public_case_fails("0.2", by_files_once, "N=2 ranks",
                                   contains="but nothing that rank 0 received by send/recv carried them")
    assert res.passed == 0


def test_a_message_that_is_no_partial_sum_fails():
    def doubled(ctx, tensor):  # right sum, but what it sends is not what a ring step sends
        n, r = ctx.world_size, ctx.rank
        incoming = torch.empty_like(tensor)
        req = comm.isend(2 * tensor, (r + 1) % n)
        comm.recv(incoming, (r - 1) % n)
        req.wait()
        return tensor + incoming / 2

    assert_public_case_fails("0.2", doubled, "N=2 ranks", contains="message 1 (rank 0 to rank 1): its 6 values are "
                             "not a piece of the ranks' tensors summed over some ranks")


def ring_blocking_send_first(ctx, tensor):
    """Wrong: every rank calls a blocking send before its recv in both phases. The right indices and
    sum, but on gloo dist.send waits for the matching recv, so no rank ever receives: a deadlock."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        comm.send(chunks[(r - s) % n], (r + 1) % n)
        comm.recv(incoming, (r - 1) % n)
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):
        comm.send(chunks[(r + 1 - s) % n], (r + 1) % n)
        comm.recv(chunks[(r - s) % n], (r - 1) % n)
    return tensor


def test_every_rank_sending_first_with_blocking_sends_is_a_deadlock_named_as_such():
    t0 = time.monotonic()
    res = assert_public_case_fails(
        "0.2", ring_blocking_send_first, "N=2 ranks",
        contains="deadlock: every rank still running is blocked in a send (rank 0 to rank 1, rank 1 to rank 0) "
                 "and none is receiving")
    assert res.passed == 0, res.message
    assert time.monotonic() - t0 < 60  # a state the relay sees, not a timeout per case


def ring_by_parity(ctx, tensor):
    """Right: blocking send/recv, even ranks send first and odd ranks receive first."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))

    def exchange(out, into):
        if r % 2 == 0:
            comm.send(out, (r + 1) % n)
            comm.recv(into, (r - 1) % n)
        else:
            tmp = torch.empty_like(into)
            comm.recv(tmp, (r - 1) % n)
            comm.send(out, (r + 1) % n)
            into.copy_(tmp)

    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        exchange(chunks[(r - s) % n].clone(), incoming)
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):
        exchange(chunks[(r + 1 - s) % n].clone(), chunks[(r - s) % n])
    return tensor


def ring_irecv_first(ctx, tensor):
    """Right: post the irecv, then a blocking send, then wait (a sendrecv)."""
    n, r = ctx.world_size, ctx.rank
    chunks = list(torch.tensor_split(tensor, n))
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        req = comm.irecv(incoming, (r - 1) % n)
        comm.send(chunks[(r - s) % n], (r + 1) % n)
        req.wait()
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):
        req = comm.irecv(chunks[(r - s) % n], (r - 1) % n)
        comm.send(chunks[(r + 1 - s) % n], (r + 1) % n)
        req.wait()
    return tensor


def test_rings_that_do_not_deadlock_on_gloo_pass():
    assert_check_passes("0.2", ring_by_parity)
    assert_check_passes("0.2", ring_irecv_first)


def _ring_with(rs_send, rs_recv, ag_send, ag_recv, add_in_gather=False, gather=True):
    def ring(ctx, tensor):
        n, r = ctx.world_size, ctx.rank
        chunks = list(torch.tensor_split(tensor, n))
        for s in range(n - 1):
            incoming = torch.empty_like(chunks[rs_recv(r, s, n)])
            req = comm.isend(chunks[rs_send(r, s, n)].clone(), (r + 1) % n)
            comm.recv(incoming, (r - 1) % n)
            req.wait()
            chunks[rs_recv(r, s, n)] += incoming
        for s in range(n - 1 if gather else 0):
            incoming = torch.empty_like(chunks[ag_recv(r, s, n)])
            req = comm.isend(chunks[ag_send(r, s, n)].clone(), (r + 1) % n)
            comm.recv(incoming, (r - 1) % n)
            req.wait()
            if add_in_gather:
                chunks[ag_recv(r, s, n)] += incoming
            else:
                chunks[ag_recv(r, s, n)].copy_(incoming)
        return tensor
    return ring


RS_SEND, RS_RECV = (lambda r, s, n: (r - s) % n), (lambda r, s, n: (r - s - 1) % n)
AG_SEND, AG_RECV = (lambda r, s, n: (r + 1 - s) % n), (lambda r, s, n: (r - s) % n)


def test_the_ring_helper_is_right_as_written():
    assert_check_passes("0.2", _ring_with(RS_SEND, RS_RECV, AG_SEND, AG_RECV))


def test_an_off_by_one_chunk_index_names_the_chunk_invariant_that_fails():
    off = _ring_with(lambda r, s, n: (r - s - 1) % n, RS_RECV, AG_SEND, AG_RECV)  # reduce-scatter sends one too far
    assert_public_case_fails("0.2", off, "N=2 ranks", contains="rank 0's chunk 0 is not a sum of the ranks' chunk 0 "
                             "(nor of any other single chunk): parts of different chunks were added together")
    off = _ring_with(RS_SEND, RS_RECV, lambda r, s, n: (r - s) % n, AG_RECV)  # the all-gather sends one too few
    assert_public_case_fails("0.2", off, "N=2 ranks", contains="rank 0's chunk 0 ends holding values of chunk 1")


def test_a_missing_all_gather_is_named():
    half = _ring_with(RS_SEND, RS_RECV, AG_SEND, AG_RECV, gather=False)
    res = assert_public_case_fails("0.2", half, "N=2 ranks", contains="ends with the complete sum in one chunk only")
    assert "the all-gather phase, which passes each complete chunk round the ring, is missing" in res.message


def test_adding_in_the_all_gather_names_a_value_counted_twice():
    added = _ring_with(RS_SEND, RS_RECV, AG_SEND, AG_RECV, add_in_gather=True)
    assert_public_case_fails("0.2", added, "N=2 ranks", contains="twice (a value counted twice)")
