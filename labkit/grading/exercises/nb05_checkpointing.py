"""Exercises of notebook 05_checkpointing: activation checkpointing (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost").

A chain of n layers cut into k segments keeps only the k segment inputs during forward and
recomputes one segment at a time in backward: at the peak about ``k * a + ceil(n / k) * s`` bytes
are saved (a = bytes of one segment input, s = bytes one layer saves for backward), minimised
near ``k = sqrt(n s / a)`` (sec. 3 and 4.1). The recomputation must draw the same dropout masks
as the first forward: the RNG state is saved before the forward and restored for the
recomputation, without disturbing the RNG stream of the rest of training.
"""
from __future__ import annotations

import math

import torch

from ..kernelside.nb05_checkpointing import _ckpt_outputs, _net, _run  # noqa: F401 - run in the kernel
from ..registry import (
    CheckFailure,
    as_int,
    exercise,
    expect_close,
    expect_equal,
    expect_raises,
    type_name,
)

NOTEBOOK = "05_checkpointing"

# ----------------------------------------------------------------------------- 5.1
ex51 = exercise(
    "5.1", title="segment boundaries", notebook=NOTEBOOK, points=2,
    hint=("Section 2: the boundaries start at 0, end at n and grow, and every segment has one of the lengths the "
          "docstring allows. Can you compute boundary j directly from j, n and k, as an integer?"))
ex51.hint2 = ("Try n=10, k=4: which segment lengths are allowed, and where would the boundaries fall if a segment "
              "could hold a fraction of a layer? Which integer next to each keeps every segment balanced? Raise "
              "ValueError for a k outside 1..n.")
ex51.hint_review = ("leads: asks for a closed form and points at the fractional boundary; the rounding is the "
                    "learner's choice; reviewed 2026-12-06")


def _check_bounds(got, n: int, k: int) -> None:
    what = f"segment_boundaries(n={n}, k={k})"
    if not isinstance(got, (list, tuple, range)):
        raise CheckFailure(f"{what}: expected a list of k+1 = {k + 1} ints, got {type(got).__name__}")
    got = list(got)
    if len(got) != k + 1:
        raise CheckFailure(f"{what}: expected k+1 = {k + 1} boundaries (k segments), got {len(got)}: {got}")
    bad = [b for b in got if as_int(b) is None]
    if bad:
        raise CheckFailure(f"{what}: boundaries must be ints, got {type_name(bad[0])} among them")
    got = [as_int(b) for b in got]
    if got[0] != 0 or got[-1] != n:
        raise CheckFailure(f"{what}: the boundaries must start at 0 and end at n={n}, got {got}")
    sizes = [b - a for a, b in zip(got[:-1], got[1:])]
    if min(sizes) < 1:
        raise CheckFailure(f"{what}: every segment needs at least one layer, got segment sizes {sizes}")
    if max(sizes) - min(sizes) > 1:
        raise CheckFailure(f"{what}: segments must be balanced (sizes {n // k} or {-(-n // k)}), got sizes {sizes} "
                           f"from boundaries {got}")


def _bounds_case(n: int, k: int):
    def case(segment_boundaries):
        _check_bounds(segment_boundaries(n, k), n, k)
    return case


ex51.case("n=12, k=3")(_bounds_case(12, 3))
ex51.case("n=10, k=4 (uneven)")(_bounds_case(10, 4))


@ex51.case("k=1 and k=n")
def _(segment_boundaries):
    _bounds_case(7, 1)(segment_boundaries)
    _bounds_case(7, 7)(segment_boundaries)


@ex51.case("k outside 1..n: ValueError")
def _(segment_boundaries):
    expect_raises(ValueError, segment_boundaries, 5, 0, what="segment_boundaries(n=5, k=0)")
    expect_raises(ValueError, segment_boundaries, 5, 6, what="segment_boundaries(n=5, k=6)")


@ex51.case("every n <= 24 and k <= n", hidden=True)
def _(segment_boundaries):
    for n in range(1, 25):
        for k in range(1, n + 1):
            _check_bounds(segment_boundaries(n, k), n, k)


# ----------------------------------------------------------------------------- 5.2
ex52 = exercise(
    "5.2", title="the segment count with the smallest peak", notebook=NOTEBOOK, points=2,
    hint=("Section 2: the peak with k segments is the formula above the exercise. The square-root rule is only "
          "approximate: can you be sure of the best k without looking at every allowed one?"))
ex52.hint2 = ("The segments are as even as in 5.1: how long is the longest one when k does not divide n? Any k with "
              "the lowest peak is accepted.")
ex52.hint_review = ("leads: questions the square-root shortcut and the length of the longest segment; the search is "
                    "the learner's; reviewed 2026-12-06")


def _cost(n, k, a, s):
    return k * a + math.ceil(n / k) * s


def _best_case(n: int, a: int, s: int):
    def case(best_segment_count):
        what = f"best_segment_count(n={n}, input_bytes={a}, layer_bytes={s})"
        got = best_segment_count(n, a, s)
        if as_int(got) is None:
            raise CheckFailure(f"{what}: expected an int k, got {type_name(got)}")
        got = as_int(got)
        if not 1 <= got <= n:
            raise CheckFailure(f"{what}: k must be between 1 and n={n}, got {got}")
        best = min(range(1, n + 1), key=lambda k: (_cost(n, k, a, s), k))
        if _cost(n, got, a, s) != _cost(n, best, a, s) and got == max(1, round(math.sqrt(n))) and a != s:
            raise CheckFailure(f"{what}: k={got} (sqrt(n)) has a peak of {_cost(n, got, a, s)} bytes, but k={best} "
                               f"has {_cost(n, best, a, s)}: sqrt(n) is the best k only when a layer saves as much "
                               f"as a segment's input")
        smooth = math.sqrt(n * s / a)
        if _cost(n, got, a, s) != _cost(n, best, a, s) and got in (math.floor(smooth), math.ceil(smooth)):
            raise CheckFailure(f"{what}: k={got} (the smooth optimum sqrt(n s / a) rounded) has a peak of "
                               f"{_cost(n, got, a, s)} bytes, but k={best} has {_cost(n, best, a, s)}: ceil(n/k) "
                               f"moves in steps, so the whole k around it must be compared")
        if _cost(n, got, a, s) != _cost(n, best, a, s):
            raise CheckFailure(f"{what}: k={got} has a peak of {_cost(n, got, a, s)} bytes, but k={best} has "
                               f"{_cost(n, best, a, s)}")
    return case


ex52.case("n=16 layers, equal sizes")(_best_case(16, 1, 1))
ex52.case("n=16, a layer saves twice its input")(_best_case(16, 4096, 8192))
ex52.case("n=100, a layer saves 8x its input")(_best_case(100, 1, 8))
ex52.case("n=1")(_best_case(1, 10, 10))
ex52.case("n=48, a layer saves 17x its input (a transformer layer)", hidden=True)(_best_case(48, 2, 34))
ex52.case("n=30, inputs larger than a layer's saved tensors", hidden=True)(_best_case(30, 9, 2))


@ex52.case("grid of n and sizes", hidden=True)
def _(best_segment_count):
    for n in (2, 3, 5, 9, 17, 64, 81):
        for a, s in ((1, 1), (1, 3), (5, 2), (2, 17)):
            _best_case(n, a, s)(best_segment_count)


# ----------------------------------------------------------------------------- 5.3
ex53 = exercise(
    "5.3", title="a checkpoint that restores the RNG", notebook=NOTEBOOK, points=4,
    hint=("Section 3 (the dropout pitfall): the recomputation must draw the same dropout masks as the forward did. "
          "What does forward have to remember so that backward can reproduce its random numbers?"))
ex53.hint2 = ("Two invariants to check: the recomputation must build a graph that reaches x (autograd is off inside "
              "forward; what about backward?), and after backward the training's random stream must continue where "
              "the forward left it. Which of the two does your backward break?")
ex53.hint_review = ("leads: names the pitfall and the two invariants (graph to x, untouched random stream); no API "
                    "and no sequence of calls; reviewed 2026-12-06")


class _NoRestore(torch.autograd.Function):
    """5.3's mistake: the recomputation draws from whatever the RNG state is in backward."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


class _SavedAfter(torch.autograd.Function):
    """5.3's mistake: the RNG state saved after the forward computation drew its masks, and restored."""

    @staticmethod
    def forward(ctx, run, x):
        ctx.run = run
        ctx.save_for_backward(x)
        with torch.no_grad():
            y = run(x)
        ctx.rng = torch.get_rng_state()
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng():
            torch.set_rng_state(ctx.rng)
            with torch.enable_grad():
                x = x.detach().requires_grad_(True)
                y = ctx.run(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


_RNG_MISTAKES = ((_NoRestore, "the recomputation drew new dropout masks: the RNG state was not set back to the one "
                              "the forward used"),
                 (_SavedAfter, "the recomputation drew other masks than the forward: the RNG state was saved after "
                               "the forward had already drawn its masks"))


def _rng_mistake(answer, p, seed, segments, x, G, got_dx) -> str:
    """Name the RNG mistake whose gradients the answer's are (issue 36: both gave one line). With one
    segment the two give the same numbers (nothing draws between forward and backward), so the answer is
    asked once more with two segments, where they differ."""
    def matches(segs, dx):
        found = []
        for cls, text in _RNG_MISTAKES:
            def ckpt(net, x, cls=cls):
                for _ in range(segs):
                    x = cls.apply(net, x)
                return x
            ref = _run(_net(seed, p), x, G, seed + 2, ckpt)
            if torch.allclose(dx, ref[1], rtol=1e-5, atol=1e-6):
                found.append(text)
        return found

    found = matches(segments, got_dx)
    if len(found) > 1:
        again = answer.run(_ckpt_outputs, p, seed, 2, x, G)
        found = [t for t in matches(2, again[1]) if t in found] if isinstance(again[1], torch.Tensor) else []
    return found[0] if len(found) == 1 else ""


def _compare(answer, p: float, seed: int, segments: int, check_stream: bool, label: str):
    net = _net(seed, p)
    g = torch.Generator().manual_seed(seed + 1)
    x, G = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def plain(net, x):
        for _ in range(segments):
            x = net(x)
        return x

    ref = _run(net, x, G, seed + 2, plain)
    got = answer.run(_ckpt_outputs, p, seed, segments, x, G)
    expect_close(got[0], ref[0], f"{label}: output y")
    if got[1] is None:
        raise CheckFailure(f"{label}: x.grad is None: backward returned no gradient for the input x")
    if p > 0 and isinstance(got[1], torch.Tensor) and got[1].shape == ref[1].shape and not torch.allclose(
            got[1], ref[1], rtol=1e-5, atol=1e-6):
        why = _rng_mistake(answer, p, seed, segments, x, G, got[1])
        if why:
            raise CheckFailure(f"{label}: dL/dx differs from backprop without checkpointing ({why})")
    expect_close(got[1], ref[1], f"{label}: dL/dx (vs backprop without checkpointing)")
    for name, gref in ref[2].items():
        if got[2][name] is None:
            raise CheckFailure(f"{label}: parameter {name} got no gradient: nothing in backward "
                               f"backpropagated through a graph that holds it")
        expect_close(got[2][name], gref, f"{label}: gradient of parameter {name}")
    if check_stream:
        expect_equal(got[3], ref[3], f"{label}: torch.rand(3) right after backward (the RNG stream of the rest "
                                     f"of training must not be rewound by the recomputation)")


def _ckpt_case(p, seed, segments=1, check_stream=False, label=""):
    def case(answer):
        _compare(answer, p, seed, segments, check_stream, label)
    return case


ex53.case("no dropout: output and every gradient equal plain backprop")(
    _ckpt_case(0.0, 0, label="no dropout"))
ex53.case("dropout p=0.5: the recomputation draws the same masks")(
    _ckpt_case(0.5, 1, label="dropout p=0.5"))
ex53.case("the RNG stream after backward is the one without checkpointing",
          hint=("Restoring an old state rewinds the global random stream: every later draw would repeat old numbers. "
                "How can backward use the old state and still leave the training stream where it was?"))(
    _ckpt_case(0.5, 3, segments=2, check_stream=True, label="RNG stream"))
ex53.case("three checkpointed segments in a row, dropout", hidden=True)(
    _ckpt_case(0.3, 2, segments=3, label="3 segments, dropout p=0.3"))
ex53.case("the RNG stream after three segments", hidden=True)(
    _ckpt_case(0.2, 4, segments=3, check_stream=True, label="RNG stream, 3 segments"))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402

fresh_case(ex51, "random n, k", lambda r: (lambda n: (n, r.randint(1, n)))(r.randint(1, 300)), _bounds_case)
fresh_case(ex52, "random n and sizes", lambda r: (r.randint(1, 300), r.randint(1, 10 ** 4), r.randint(1, 10 ** 4)),
           _best_case)


def _draw_ckpt(r):
    segments, stream = r.randint(1, 3), r.random() < 0.5
    return r.choice((0.0, 0.1, 0.3, 0.5, 0.7)), seed(r), segments, stream, f"random draw, {segments} segment(s)"


fresh_case(ex53, "random dropout, weights and segments", _draw_ckpt, _ckpt_case, n=2)
