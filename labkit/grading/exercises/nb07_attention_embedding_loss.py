"""Exercises of notebook 07_attention_embedding_loss: heads split across ranks, the vocab-parallel
embedding's mask and the vocab-parallel cross-entropy (Shoeybi et al. 2019, "Megatron-LM", sec. 3).

* Attention (Fig. 3b): rank r owns the contiguous block of heads ``[r*h/t, (r+1)*h/t)``.
* Input embedding: rank r owns vocabulary rows ``[r*V/t, (r+1)*V/t)``; ids outside give zero rows,
  and one all-reduce sums the t partial lookups.
* Cross-entropy on logits split by vocabulary: three all-reduces of N values (max, target
  logit, sum of exponentials) instead of gathering N*V logits. Its ranks have no process
  group: their all-reduces go through a relay this (the grader's) process runs
  (:mod:`labkit.grading.relay`), which computes them and counts them for the cases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernelside.nb07_attention_embedding_loss import _OFFSET_HINT, _call_emb, _emb_grad, _run_ce  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, as_int, exercise, expect_close, expect_equal, expect_raises, type_name
from ..relay import Relay

NOTEBOOK = "07_attention_embedding_loss"

# ----------------------------------------------------------------------------- 7.1
ex71 = exercise(
    "7.1", title="which heads each rank owns", notebook=NOTEBOOK, points=2,
    hint=("Section 1: the heads form t contiguous blocks of the same size, block r on rank r. Where does block r "
          "start, and how long is it? Reject a t that does not divide n_head and a rank outside the group."))
ex71.hint2 = "Try n_head=8, t=4: which heads does rank 1 own? Check your answer on ranks 0 and 3 too."
ex71.hint_review = ("leads: asks where block r starts and how long it is; the range is the learner's; reviewed "
                    "2026-12-06")


def _heads(n_head, t, rank):
    w = n_head // t
    return list(range(rank * w, (rank + 1) * w))


def _heads_case(n_head: int, t: int):
    def case(heads_of_rank):
        for r in range(t):
            got = heads_of_rank(n_head, t, r)
            if not isinstance(got, (list, tuple, range)):
                raise CheckFailure(f"heads_of_rank(n_head={n_head}, t={t}, rank={r}): expected a list of ints, "
                                   f"got {type(got).__name__}")
            bad = [h for h in got if as_int(h) is None]
            if bad:  # int() would truncate 0.5 to a right-looking 0
                raise CheckFailure(f"heads_of_rank(n_head={n_head}, t={t}, rank={r}): head ids are ints, got "
                                   f"{type_name(bad[0])}")
            expect_equal([as_int(h) for h in got], _heads(n_head, t, r),
                         f"heads_of_rank(n_head={n_head}, t={t}, rank={r})")
    return case


ex71.case("h=4 heads, t=2")(_heads_case(4, 2))
ex71.case("h=8 heads, t=4")(_heads_case(8, 4))
ex71.case("t=1 owns every head")(_heads_case(6, 1))


@ex71.case("t=4 does not divide h=6: ValueError")
def _(heads_of_rank):
    expect_raises(ValueError, heads_of_rank, 6, 4, 0, what="heads_of_rank(n_head=6, t=4, rank=0)")


ex71.case("h=12 heads, t=3", hidden=True)(_heads_case(12, 3))
ex71.case("h=32 heads, t=8", hidden=True)(_heads_case(32, 8))


@ex71.case("rank outside 0..t-1: ValueError", hidden=True)
def _(heads_of_rank):
    expect_raises(ValueError, heads_of_rank, 8, 2, 2, what="heads_of_rank(n_head=8, t=2, rank=2)")
    expect_raises(ValueError, heads_of_rank, 8, 2, -1, what="heads_of_rank(n_head=8, t=2, rank=-1)")


# ----------------------------------------------------------------------------- 7.2
ex72 = exercise(
    "7.2", title="the vocab-parallel embedding mask", notebook=NOTEBOOK, points=3,
    hint=("Section 2: each rank holds one block of rows of the table. Which ids does this rank own, at which row of "
          "its shard does an owned id sit, and what must it contribute for an id it does not own?"))
ex72.hint2 = ("Two invariants: no lookup may index beyond the shard, and an id another rank owns must give no value "
              "and no gradient here. Which of the two does your function break?")
ex72.hint_review = ("leads: asks which ids are owned and what the others contribute; states the two invariants, names "
                    "no operation; reviewed 2026-12-06")


def _emb_data(V: int, D: int, shape: tuple, seed: int):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, shape, generator=g)
    return W, ids


def _shards(W, t):
    n = W.shape[0] // t
    return [(W[r * n:(r + 1) * n].clone(), r * n) for r in range(t)]


def _name_unmasked(got, expected, ids, shard, start, what) -> None:
    """Fail naming the mistake when the only wrong rows are those of ids below the block and they hold the
    rows that a negative local index wraps around to (``shard[id - vocab_start]`` counts from the end)."""
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return
    n = shard.shape[0]
    below = ids < start
    wrong = ~torch.isclose(got.detach().float(), expected, rtol=1e-5, atol=1e-6).all(-1)
    if not wrong.any() or not below.any() or bool((wrong & ~below).any()):
        return
    local = (ids - start).clamp(min=-n)
    wrapped = shard[local.masked_fill(~below, 0)]
    if torch.allclose(got.detach().float()[below], wrapped[below], rtol=1e-5, atol=1e-6):
        raise CheckFailure(f"{what}: the rows of ids below vocab_start={start} are not zero: they hold rows counted "
                           f"from the end of the shard, where a negative local index lands; ids below the block "
                           f"belong to an earlier rank's block and are outside too")


def _emb_sum_case(V: int, D: int, t: int, shape: tuple, seed: int):
    def case(partial_embedding):
        W, ids = _emb_data(V, D, shape, seed)
        full = F.embedding(ids, W)
        total = torch.zeros_like(full)
        for r, (shard, start) in enumerate(_shards(W, t)):
            what = f"partial_embedding(ids {list(ids.shape)}, weight_shard [{V // t}, {D}], vocab_start={start})"
            got = _call_emb(partial_embedding, ids, shard, start, what)
            mine = (ids >= start) & (ids < start + V // t)
            expected = torch.where(mine.unsqueeze(-1), full, torch.zeros_like(full))
            _name_unmasked(got, expected, ids, shard, start, what)
            expect_close(got, expected, f"{what} (rank {r} of t={t}; rows of ids it does not own must be 0)")
            total = total + got
        expect_close(total, full, f"sum over the t={t} ranks of partial_embedding (the all-reduce) vs F.embedding")
    return case


ex72.case("V=16, t=2, ids [3, 5]")(_emb_sum_case(16, 4, 2, (3, 5), 0))
ex72.case("V=12, t=4, ids [10]")(_emb_sum_case(12, 3, 4, (10,), 1))


@ex72.case("gradient reaches only this rank's rows")
def _(partial_embedding):
    V, D, t = 16, 4, 2
    W, ids = _emb_data(V, D, (4, 6), 2)
    G = torch.randn(4, 6, D, generator=torch.Generator().manual_seed(3))
    Wf = W.clone().requires_grad_(True)
    (F.embedding(ids, Wf) * G).sum().backward()
    for r, (shard, start) in enumerate(_shards(W, t)):
        what = f"partial_embedding(ids [4, 6], weight_shard [{V // t}, {D}], vocab_start={start})"
        grad = partial_embedding.run(_emb_grad, ids, shard, start, G, what)
        expect_close(grad, Wf.grad[start:start + V // t],
                     f"gradient of weight_shard on rank {r} (vs the rows {start}..{start + V // t - 1} of one "
                     f"device's gradient; rows of ids the rank does not own must get none)")


@ex72.case("block edges: ids vocab_start-1, vocab_start, vocab_end-1, vocab_end", hidden=True)
def _(partial_embedding):
    V, D, t = 16, 2, 4
    W, _ = _emb_data(V, D, (1,), 4)
    for _r, (shard, start) in enumerate(_shards(W, t)):
        end = start + V // t
        ids = torch.tensor([i for i in (start - 1, start, end - 1, end) if 0 <= i < V])
        got = _call_emb(partial_embedding, ids, shard, start,
                        f"partial_embedding(ids {ids.tolist()}, vocab_start={start})")
        mine = (ids >= start) & (ids < end)
        expected = torch.where(mine.unsqueeze(-1), F.embedding(ids, W), torch.zeros(len(ids), D))
        expect_close(got, expected, f"partial_embedding(ids {ids.tolist()}, vocab_start={start})")


@ex72.case("no id in this rank's block: all zeros", hidden=True)
def _(partial_embedding):
    W, _ = _emb_data(8, 3, (1,), 5)
    shard, start = _shards(W, 2)[1]
    ids = torch.tensor([[0, 1, 2, 3]])
    got = _call_emb(partial_embedding, ids, shard, start, "partial_embedding(ids [[0, 1, 2, 3]], vocab_start=4)")
    expect_close(got, torch.zeros(1, 4, 3), "partial_embedding(ids [[0, 1, 2, 3]], vocab_start=4)")


ex72.case("V=32, t=8, ids [2, 3, 4]", hidden=True)(_emb_sum_case(32, 5, 8, (2, 3, 4), 6))


# ----------------------------------------------------------------------------- 7.3
ex73 = exercise(
    "7.3", title="vocab-parallel cross-entropy", notebook=NOTEBOOK, points=4,
    hint=("Section 3: write the cross-entropy of one token from its full row of logits. Which of the quantities in it "
          "need values from every rank, and how do the ranks' contributions combine into each?"))
ex73.hint2 = ("Stability and ownership: the stabilising shift must be the same on every rank, and only one rank holds "
              "the target's logit. What do the other ranks contribute to it? labkit's collectives work in place.")
ex73.hint_review = ("leads: asks which quantities need every rank and how they combine; names no reduction operation "
                    "or sequence; reviewed 2026-12-06")


def _ce_data(N: int, V: int, seed: int, offset: float, scale: float, target_block=None, t=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g) * scale + offset
    if target_block is None:
        target = torch.randint(0, V, (N,), generator=g)
    else:
        n = V // t
        target = torch.randint(target_block * n, (target_block + 1) * n, (N,), generator=g)
    return logits, target


def _why_not_finite(relay, r: int, logits, t: int) -> str:
    """Why a rank's loss overflowed, from the grader's own log of its all-reduces: no rank max at all, or the
    rank maxima reduced with an operation other than MAX (issue 36: a SUM of the maxima was told no max was
    subtracted)."""
    n = logits.shape[1] // t
    local_max = logits[:, r * n:(r + 1) * n].max(-1).values
    maxes = [it for it in relay.reduced if it.rank == r and tuple(it.tensor.shape) == tuple(local_max.shape)
             and torch.allclose(it.tensor.double(), local_max.double())]
    if maxes and all(it.op != "max" for it in maxes):
        return (f"because each rank's max was all-reduced with {maxes[0].op.upper()}: that gives the {maxes[0].op} "
                f"of the t maxima, not the largest logit, so exp of (logit - that) leaves the safe range; the "
                f"global maximum needs another reduction")
    if maxes:
        return "although a global max was all-reduced: is it subtracted from the logits before exp, on every rank?"
    return "which happens when no global max was subtracted before exp"


def _ce_case(t: int, N: int, V: int, seed: int, offset: float = 0.0, scale: float = 2.0, target_block=None,
             max_all_reduces: int | None = None):
    def case(vocab_parallel_ce):
        logits, target = _ce_data(N, V, seed, offset, scale, target_block, t)
        with Relay(t) as relay:
            res = vocab_parallel_ce.run(_run_ce, t, logits, target, relay.address())
        if relay.problems:
            raise CheckFailure(relay.problems[0])
        expected = F.cross_entropy(logits.double(), target, reduction="none").float()
        desc = f"t={t}, N={N} tokens, V={V}" + (f", logits around {offset:g}" if offset else "")
        for r, got in enumerate(res):
            if got.shape != expected.shape:
                raise CheckFailure(f"{desc}: rank {r} returned a loss of shape {tuple(got.shape)}; expected one "
                                   f"loss per token, shape {tuple(expected.shape)} (no mean)")
            if not torch.isfinite(got).all():
                raise CheckFailure(f"{desc}: rank {r} returned {got[~torch.isfinite(got)][:3].tolist()}: exp "
                                   f"overflowed (or underflowed to 0) on logits this large, "
                                   + _why_not_finite(relay, r, logits, t))
            expect_close(got, expected, f"{desc}: per-token loss on rank {r} (vs F.cross_entropy on the full logits)",
                         rtol=1e-5, atol=1e-5)
            n = [item.tensor.numel() for item in relay.reduced if item.rank == r]  # the grader's own count
            if t > 1 and not n:
                raise CheckFailure(f"{desc}: rank {r} made no all-reduce, yet its logits alone cannot give the "
                                   f"loss: what it needs from the other ranks must come through all-reduce")
            if max_all_reduces is not None:
                if len(n) > max_all_reduces:
                    raise CheckFailure(f"{desc}: rank {r} issued {len(n)} all-reduces (counted by the grader), "
                                       f"more than the loss needs: section 3 counts them")
                if any(k > N for k in n):
                    raise CheckFailure(f"{desc}: rank {r} all-reduced a tensor of {max(n)} values, more than one "
                                       f"per token (N={N}): that moves logits, not per-token numbers")
    return case


ex73.case("t=2 ranks, N=6, V=16", timeout=20)(_ce_case(2, 6, 16, 0))
ex73.case("t=4 ranks, N=5, V=32", timeout=25)(_ce_case(4, 5, 32, 1))
ex73.case("t=2, large logits (around 1000)", timeout=20)(_ce_case(2, 4, 8, 2, offset=1000.0))
ex73.case("t=4: at most 3 all-reduces of N values, no gather", hidden=True, timeout=25)(
    _ce_case(4, 6, 16, 3, max_all_reduces=3))
ex73.case("t=1 rank", hidden=True, timeout=20)(_ce_case(1, 3, 8, 4))
ex73.case("t=2, every target on rank 1", hidden=True, timeout=20)(_ce_case(2, 5, 10, 5, target_block=1))
ex73.case("t=2, very negative logits", hidden=True, timeout=20)(_ce_case(2, 4, 8, 6, offset=-500.0, scale=30.0))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402

fresh_case(ex71, "random heads and t", lambda r: (lambda t: (t * r.randint(1, 6), t))(r.choice((1, 2, 4, 8))),
           _heads_case)


def _draw_emb(r):
    t = r.randint(1, 4)
    return t * r.randint(1, 6), r.randint(1, 5), t, tuple(r.randint(1, 4) for _ in range(r.randint(1, 3))), seed(r)


def _draw_ce(r):
    t = r.randint(1, 3)
    offset = r.choice((0.0, r.uniform(-800.0, 800.0)))
    block = r.randrange(t) if r.random() < 0.25 else None
    return t, r.randint(1, 6), t * r.randint(1, 8), seed(r), offset, r.uniform(0.5, 20.0), block


fresh_case(ex72, "random V, t, ids and weights", _draw_emb, _emb_sum_case)
fresh_case(ex73, "random t, tokens, vocabulary and logits", _draw_ce, _ce_case, n=2)
