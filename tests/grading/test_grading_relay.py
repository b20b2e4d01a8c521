"""The relay the grader runs for communication exercises (labkit.grading.relay): ranks join with the
case's token only, once each; it delivers sends in order, computes all-reduces itself and logs both;
a deadlock is an error naming the ranks; a hostile kernel cannot make it hold unbounded memory."""
import socket

import pytest
import torch

from labkit.dist import RankError
from labkit.grading.relay import MAX_TOTAL, Relay, _read, _write, run_ranks


def _join(relay, rank, token=None):
    host, port, tok = relay.address()
    s = socket.create_connection((host, port))
    _write(s, {"token": tok if token is None else token, "rank": rank})
    return s, _read(s)


def test_only_the_cases_ranks_join_once_each():
    with Relay(2) as relay:
        _, ok = _join(relay, 0)
        assert ok == {"ok": True}
        assert _join(relay, 0)[1] is None           # rank 0 again: closed
        assert _join(relay, 1, token="guess")[1] is None  # without the token: closed
        assert _join(relay, 2)[1] is None           # no such rank


def test_sends_recvs_and_all_reduces_are_delivered_computed_and_logged():
    def body(ctx):
        import torch.distributed as dist

        x = torch.full((3,), float(ctx.rank + 1))
        other = torch.empty(3)
        req = dist.isend(x, (ctx.rank + 1) % 2)
        dist.recv(other, (ctx.rank + 1) % 2)
        req.wait()
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return other, x, dist.get_rank(), dist.get_world_size()

    with Relay(2) as relay:
        out = run_ranks(body, 2, relay.address(), allowed=("send", "recv", "isend", "irecv", "all_reduce"))
    assert [o[0].tolist() for o in out] == [[2.0] * 3, [1.0] * 3]
    assert all(o[1].tolist() == [2.0] * 3 and o[3] == 2 for o in out) and [o[2] for o in out] == [0, 1]
    assert sorted((m.src, m.dst) for m in relay.sent) == [(0, 1), (1, 0)]
    assert sorted((r.rank, r.op) for r in relay.reduced) == [(0, "max"), (1, "max")]


def test_a_deadlock_names_the_ranks_and_other_collectives_refuse():
    def stuck(ctx):
        import torch.distributed as dist

        dist.recv(torch.empty(1), 1 - ctx.rank)  # both wait: nobody sends

    with Relay(2) as relay:
        with pytest.raises(RankError, match=r"deadlock: no rank can go on: rank 0 waits in a recv from rank 1 "
                                            r"\(message 1 from rank 1 to rank 0\), which rank 1 has not sent"):
            run_ranks(stuck, 2, relay.address(), timeout=10)
    assert relay.problems[0].startswith("deadlock")

    def gathers(ctx):
        import torch.distributed as dist

        dist.all_gather([torch.empty(1)] * 2, torch.ones(1))

    with Relay(2) as relay:
        with pytest.raises(RankError, match="all_gather is not available on these ranks"):
            run_ranks(gathers, 2, relay.address(), timeout=10)


def test_a_flood_is_refused_before_the_grader_holds_it():
    with Relay(2) as relay:
        s, _ = _join(relay, 0)
        big = torch.zeros(2 ** 20 - 64)  # just under 4 MiB a message
        replies = []
        for _ in range(MAX_TOTAL // (4 * 2 ** 20) + 2):
            _write(s, {"op": "send", "dst": 1, "tensor": big, "wait": False})  # an isend: rank 1 never joins
            replies.append(_read(s))
        assert "error" in replies[-1] and "MiB in all" in replies[-1]["error"]
        assert sum(m.tensor.numel() * 4 for m in relay.sent) <= MAX_TOTAL


def test_a_slow_rank_is_waited_for_and_only_a_deadlock_times_out():
    # a loaded machine: rank 1 starts its all-reduce and its send long after the relay's timeout; while it
    # computes, the others' waits are not a deadlock (CI saw a 4-rank case fail on a rank that started late)
    def slow(ctx):
        import time

        import torch.distributed as dist

        if ctx.rank == 1:
            time.sleep(1.5)
        x = torch.ones(2) * ctx.rank
        dist.all_reduce(x)
        if ctx.rank == 1:
            time.sleep(1.5)
            dist.send(x, 0)
        elif ctx.rank == 0:
            dist.recv(x, 1)
        return x

    with Relay(3) as relay:
        out = run_ranks(slow, 3, relay.address(), allowed=("send", "recv", "all_reduce"), timeout=20)
    assert [o.tolist() for o in out] == [[3.0, 3.0]] * 3

    def mismatched(ctx):
        import torch.distributed as dist

        if ctx.rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never makes this all-reduce: a deadlock
        else:
            dist.recv(torch.empty(1), 0)

    with Relay(2) as relay:
        with pytest.raises(RankError, match=r"rank 0 waits in its all-reduce number 1, which rank\(s\) \[1\] never "
                                            r"made; rank 1 waits in a recv from rank 0"):
            run_ranks(mismatched, 2, relay.address(), allowed=("recv", "all_reduce"), timeout=10)


def test_a_blocking_send_waits_for_the_matching_recv_as_on_gloo():
    # gloo's dist.send returns only once the receiver has posted its recv: two ranks that both send first
    # deadlock there (checked: "Timed out waiting ... for send operation to complete", even for 1 element),
    # so they deadlock here too, reported at once as a state; posting the irecv first, or isend, does not
    import time

    def both_send_first(ctx):
        import torch.distributed as dist

        dist.send(torch.ones(1), 1 - ctx.rank)
        dist.recv(torch.empty(1), 1 - ctx.rank)

    t0 = time.monotonic()
    with Relay(2) as relay:
        with pytest.raises(RankError, match=r"deadlock: every rank still running is blocked in a send \(rank 0 to "
                                            r"rank 1, rank 1 to rank 0\) and none is receiving"):
            run_ranks(both_send_first, 2, relay.address(), timeout=30)
    assert time.monotonic() - t0 < 10

    def recv_posted_first(ctx):
        import torch.distributed as dist

        got, peer = torch.empty(2), 1 - ctx.rank
        req = dist.irecv(got, peer)
        dist.send(torch.full((2,), float(ctx.rank)), peer)
        req.wait()
        out = dist.isend(got + 10, peer)
        assert out.is_completed() in (True, False)  # asks the relay without blocking
        again = torch.empty(2)
        dist.recv(again, peer)
        out.wait()
        return again

    with Relay(2) as relay:
        out = run_ranks(recv_posted_first, 2, relay.address(), timeout=30)
    assert [o.tolist() for o in out] == [[10.0, 10.0], [11.0, 11.0]]
