"""Exercises of notebook 00_distributed_primer: collectives and a ring all-reduce.

The ring all-reduce (Patarasuk & Yuan 2009; used by Horovod and NCCL) runs a reduce-scatter
(N-1 steps) then an all-gather (N-1 steps) around a ring of N ranks, so each rank sends
2(N-1)/N of the tensor, independent of N.

0.2's ranks have no process group: their send/recv go through a relay this (the grader's)
process runs (:mod:`labkit.grading.relay`), and the cases judge its log: each message a chunk
of partial sums sent to a ring neighbour, what each rank received enough for its sum, and (the
traffic cases) 2(N-1)/N of the tensor per rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...dist import launch
from ..kernelside.nb00_distributed_primer import RING_TIMEOUT, _run_ring  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, exercise, expect_close, expect_equal
from ..relay import Relay
from . import kernel_side

# ----------------------------------------------------------------------------- 0.1
ex01 = exercise(
    "0.1", title="what each rank holds after reduce-scatter", notebook="00_distributed_primer", points=2,
    hint=("Section 4 (Collectives), the table of who holds what: after a reduce-scatter, does a rank hold all of the "
          "reduced result or only part of it? Which part is rank i's, and which ranks' inputs contribute to it?"))
ex01.hint2 = ("Compare your list with the table for N=2 ranks and c=1: which positions of which inputs end up in rank "
              "0's output, and which in rank 1's?")
ex01.hint_review = ("leads: asks which part of the reduced result each rank holds and checks it against the section 4 "
                    "table; names no operation; reviewed 2026-12-06")


def _rs_inputs(N: int, c: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, (N * c,), generator=g).float() for _ in range(N)]


def _gloo_reduce_scatter(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Ground truth: the real collective on len(inputs) gloo ranks."""
    N = len(inputs)

    def body(ctx, inputs):
        out = torch.empty(inputs[ctx.rank].numel() // N)
        dist.reduce_scatter_tensor(out, inputs[ctx.rank].clone(), group=ctx.group)
        return out

    return launch(body, N, inputs, timeout=10)


def _rs_case(N: int, c: int, seed: int):
    def case(reduce_scatter_by_hand):
        inputs = _rs_inputs(N, c, seed)
        given = [x.clone() for x in inputs]
        got = reduce_scatter_by_hand(given)
        expected = _gloo_reduce_scatter(inputs)
        expect_equal(type(got) in (list, tuple), True, f"reduce_scatter_by_hand(N={N}) returns a list")
        expect_close(list(got), expected, f"reduce_scatter_by_hand(inputs of {N} ranks x {N * c} elements)")
    return case


ex01.case("N=2 ranks, 3 elements per chunk", timeout=20)(_rs_case(2, 3, 0))
ex01.case("N=4 ranks, 2 elements per chunk", timeout=20)(_rs_case(4, 2, 1))
ex01.case("N=3 ranks, 1 element per chunk", hidden=True, timeout=20)(_rs_case(3, 1, 2))
ex01.case("N=1 rank", hidden=True, timeout=20)(_rs_case(1, 5, 3))


# ----------------------------------------------------------------------------- 0.2
ex02 = exercise(
    "0.2", title="ring all-reduce from send/recv", notebook="00_distributed_primer", points=4,
    hint=("Section 5: the ring runs a reduce-scatter phase and then an all-gather phase, N-1 steps each, and every "
          "step moves one chunk to the right neighbour. After the first phase, which chunk is complete on rank r?"))
ex02.hint2 = ("Write out N=3 on paper, step by step: which chunk index does rank r send, which does it receive, and "
              "must the received values be combined with what rank r holds or take its place? Is the answer the same "
              "in both phases?")
ex02.hint_review = ("leads: names the ring's two phases (the notebook's own description) and asks which chunk index "
                    "moves and what happens to it; the learner derives the index arithmetic; reviewed 2026-12-06")

CASE_TIMEOUT = 20.0  # seconds per case (up to 5 ranks, within RING_TIMEOUT)


def _ring_inputs(N: int, numel: int, seed: int) -> list[torch.Tensor]:
    """Rank r's tensor (the grader makes them; the kernel only receives them)."""
    out = []
    for r in range(N):
        torch.manual_seed(seed + r)
        out.append(torch.randn(numel))
    return out


def _ring_results(answer, N: int, numel: int, seed: int):
    """Run the learner's ring with every send/recv going through this process's relay: each
    rank's output, the messages the relay delivered, the inputs and the sum."""
    inputs = _ring_inputs(N, numel, seed)
    with Relay(N) as relay:
        try:
            outputs = kernel_side(answer, _run_ring, inputs, relay.address())
        except Exception:
            if relay.problems:  # the relay's own account (a deadlock, a mismatched message) is the cause
                raise CheckFailure(relay.problems[0]) from None
            raise
    if relay.problems:
        raise CheckFailure(relay.problems[0])
    reference = torch.stack(inputs).double().sum(0).float()  # what all_reduce gives every rank
    return outputs, relay.sent, inputs, reference


def _sources(message, inputs: list[torch.Tensor]) -> tuple[int, int] | None:
    """(ranks, start) when the message's values are the sum of the inputs of the ranks in the
    bit mask ``ranks`` over elements start .. start + len - 1 (what a ring step sends: one
    chunk, summed over the ranks it has passed), else None."""
    N, n = len(inputs), inputs[0].numel()
    v = message.tensor.reshape(-1).double()
    L = v.numel()
    if L == 0 or L > n:
        return None
    masks = torch.arange(1, 2 ** N)
    member = ((masks[:, None] >> torch.arange(N)) & 1).double()          # [2^N - 1, N]
    partial = member @ torch.stack(inputs).double()                       # [2^N - 1, n]
    windows = partial.unfold(1, L, 1)                                     # [2^N - 1, n - L + 1, L]
    hit = torch.isclose(windows, v, rtol=1e-5, atol=1e-5).all(-1).nonzero()
    return None if len(hit) == 0 else (int(masks[hit[0, 0]]), int(hit[0, 1]))


def _judge_messages(sent, inputs: list[torch.Tensor], what: str) -> None:
    """Judge the relay's log: every message goes to a ring neighbour and is a chunk of partial
    sums, and what rank r received (with its own tensor) covers every rank's input at every
    element, so its output can only come from send/recv."""
    N, n = len(inputs), inputs[0].numel()
    sent = sorted(sent, key=lambda m: m.src)   # per sender in send order: the same text whatever the arrival order
    reached = [torch.full((n,), 1 << r, dtype=torch.int64) for r in range(N)]  # bit k: rank k's input arrived
    for k, m in enumerate(sent):
        where = f"{what}: message {k + 1} (rank {m.src} to rank {m.dst})"
        if N > 2 and m.dst not in ((m.src + 1) % N, (m.src - 1) % N):
            raise CheckFailure(f"{where} skips the ring: rank r sends only to its neighbour r+1 (and receives "
                               f"from r-1)")
        if m.tensor.numel() == 0:
            continue
        found = _sources(m, inputs)
        if found is None:
            raise CheckFailure(f"{where}: its {m.tensor.numel()} values are not a piece of the ranks' tensors "
                               f"summed over some ranks, which is all a ring step can send")
        ranks, start = found
        reached[m.dst][start:start + m.tensor.numel()] |= ranks
    full = (1 << N) - 1
    for r in range(N):
        short = (reached[r] != full).nonzero()
        if len(short):
            j = int(short[0])
            missing = [k for k in range(N) if not int(reached[r][j]) >> k & 1]
            raise CheckFailure(f"{what}: element {j} of rank {r}'s sum needs the tensors of rank(s) {missing}, "
                               f"but nothing that rank {r} received by send/recv carried them")


def _ranks_in(mask: int, N: int) -> list[int]:
    return [k for k in range(N) if mask >> k & 1]


def _diagnose(outputs, sent, inputs: list[torch.Tensor], reference: torch.Tensor, what: str) -> None:
    """When some rank's output is wrong, name the ring's invariant that failed (the first found):
    in the reduce-scatter phase the chunk a rank sends at step s (1..N-1) is summed over s ranks;
    at the end every chunk of every rank counts each rank's tensor exactly once. Raises CheckFailure,
    or returns (then the values are compared)."""
    import itertools

    N, n = len(inputs), inputs[0].numel()
    if any(not isinstance(o, torch.Tensor) or o.shape != reference.shape for o in outputs):
        return
    if all(torch.allclose(o, reference, rtol=1e-5, atol=1e-5) for o in outputs):
        return
    for r in range(N):
        mine = [m for m in sent if m.src == r][:N - 1]
        for s, m in enumerate(mine):
            found = _sources(m, inputs) if m.tensor.numel() else None
            if found is None:
                continue
            ranks = _ranks_in(found[0], N)
            if len(ranks) != s + 1:
                raise CheckFailure(
                    f"{what}: in the reduce-scatter phase, the chunk rank {r} sends at step {s + 1} should be summed "
                    f"over {s + 1} rank(s)' tensors (each step adds one more rank's part), but it holds the sum over "
                    f"rank(s) {ranks}: is it the chunk rank {r} added the received values into at the step before?")
    stacked = torch.stack(inputs).double()
    spans = [(j, int(c[0]), int(c[-1]) + 1) for j, c in enumerate(torch.tensor_split(torch.arange(n), N)) if len(c)]
    coeffs = list(itertools.product(range(3), repeat=N))
    for r in range(N):
        def match(got, a, b):
            return next((c for c in coeffs if torch.allclose(torch.tensor(c).double() @ stacked[:, a:b], got,
                                                             rtol=1e-5, atol=1e-5)), None)
        counted = {}
        for j, a, b in spans:
            got = outputs[r][a:b].double()
            counted[j] = match(got, a, b)
            if counted[j] is None or not any(counted[j]):
                for i, a2, b2 in spans:
                    if i != j and b2 - a2 == b - a and any(c := match(got, a2, b2) or (0,)):
                        raise CheckFailure(
                            f"{what}: rank {r}'s chunk {j} ends holding values of chunk {i} (summed over rank(s) "
                            f"{[k for k in range(N) if c[k]]}): some step sent, or received into, another chunk than "
                            f"the one the ring moves at that step. Which chunk index does rank r send at step s, "
                            f"and which does it receive into?")
                if counted[j] is None:
                    raise CheckFailure(
                        f"{what}: rank {r}'s chunk {j} is not a sum of the ranks' chunk {j} (nor of any other single "
                        f"chunk): parts of different chunks were added together, so some step received into another "
                        f"chunk than the one its neighbour sent. Which chunk index does rank r send at step s, and "
                        f"which does it receive into?")
        if any(c is None for c in counted.values()):
            continue
        for j, c in counted.items():
            twice = [k for k in range(N) if c[k] > 1]
            if twice:
                raise CheckFailure(
                    f"{what}: rank {r}'s chunk {j} counts the tensor(s) of rank(s) {twice} twice (a value counted "
                    f"twice): once a chunk holds the complete sum, what must happen to it when it arrives again?")
        complete = [j for j, c in counted.items() if all(x == 1 for x in c)]
        partial = [(j, c) for j, c in counted.items() if j not in complete]
        if partial:
            j, c = partial[0]
            have = [k for k in range(N) if c[k]]
            if len(complete) == 1 and N > 1:
                raise CheckFailure(
                    f"{what}: rank {r} ends with the complete sum in one chunk only (chunk {complete[0]}); its "
                    f"chunk {j} holds the sum over rank(s) {have} only. That is where the reduce-scatter phase "
                    f"leaves a rank: the all-gather phase, which passes each complete chunk round the ring, is "
                    f"missing or does not reach chunk {j}")
            raise CheckFailure(
                f"{what}: rank {r}'s chunk {j} holds the sum over rank(s) {have} only, without rank(s) "
                f"{[k for k in range(N) if not c[k]]}: which ring step should have carried their part into it?")


def _ring_case(N: int, numel: int, seed: int):
    def case(ring_all_reduce):
        outputs, sent, inputs, reference = _ring_results(ring_all_reduce, N, numel, seed)
        _diagnose(outputs, sent, inputs, reference, f"N={N}, {numel} elements")
        for r in range(N):
            expect_close(outputs[r], reference,
                         f"rank {r} of N={N}, {numel} elements (compared with all_reduce)", rtol=1e-5, atol=1e-5)
        _judge_messages(sent, inputs, f"N={N}, {numel} elements")
    return case


def _traffic_case(N: int, numel: int, seed: int):
    def case(ring_all_reduce):
        outputs, sent, inputs, _ = _ring_results(ring_all_reduce, N, numel, seed)
        limit = 2 * (N - 1) * numel // N
        for r in range(N):
            sent_r = sum(m.tensor.numel() for m in sent if m.src == r)
            if sent_r > limit:
                whole = f"; that is {sent_r / numel:g} whole tensors" if sent_r % numel == 0 else ""
                raise CheckFailure(f"rank {r} sent {sent_r} elements{whole}, but a ring all-reduce of {numel} "
                                   f"elements on N={N} ranks sends 2(N-1) chunks of {numel}/N: "
                                   f"2(N-1)/N x {numel} = {limit}")
        what = f"N={N}, {numel} elements"
        chunk = -(-numel // N)
        for k, m in enumerate(sorted(sent, key=lambda m: m.src)):
            if m.tensor.numel() > chunk:
                raise CheckFailure(f"{what}: message {k + 1} (rank {m.src} to rank {m.dst}) holds "
                                   f"{m.tensor.numel()} elements; a ring step sends one chunk of {numel}/N")
        _judge_messages(sent, inputs, what)
    return case


ex02.case("N=2 ranks, 6 elements", timeout=CASE_TIMEOUT)(_ring_case(2, 6, 10))
ex02.case("each rank sends 2(N-1)/N of the tensor (N=4, 16 elements)", timeout=CASE_TIMEOUT,
          hint=("The ring's point is that each step moves one N-th of the tensor: does any step of yours send more "
                "than one chunk, or the whole tensor?"))(
    _traffic_case(4, 16, 70))
ex02.case("each rank sends 2(N-1)/N of the tensor (N=3, 12 elements)", hidden=True,
          timeout=CASE_TIMEOUT)(_traffic_case(3, 12, 80))
ex02.case("N=3 ranks, 7 elements (uneven chunks)", timeout=CASE_TIMEOUT)(_ring_case(3, 7, 20))
ex02.case("N=4 ranks, 16 elements", timeout=CASE_TIMEOUT)(_ring_case(4, 16, 30))
ex02.case("N=4 ranks, 3 elements (an empty chunk)", hidden=True, timeout=CASE_TIMEOUT)(_ring_case(4, 3, 40))
ex02.case("N=5 ranks, 11 elements", hidden=True, timeout=CASE_TIMEOUT)(_ring_case(5, 11, 50))
ex02.case("N=1 rank", hidden=True, timeout=CASE_TIMEOUT)(_ring_case(1, 4, 60))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402

fresh_case(ex01, "random N, chunk size and values", lambda r: (r.randint(1, 4), r.randint(1, 4), seed(r)),
           _rs_case, n=2)
fresh_case(ex02, "random N, length and values", lambda r: (r.randint(2, 4), r.randint(1, 12), seed(r)), _ring_case,
           n=2)
