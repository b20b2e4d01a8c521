"""Exercises of notebook 06_megatron_ffn: the Megatron-LM MLP split and its operators f and g.

Shoeybi et al. 2019, "Megatron-LM", sec. 3, eq. 3 and Fig. 3a: with A split by columns and B
by rows, ``GeLU(X A) B = sum_i GeLU(X A_i) B_i``, so each of the t ranks computes one partial
output with no communication and ONE all-reduce (the operator g) sums them. The conjugate
operator f in front of the block is the identity forward and an all-reduce of dL/dX backward.
Exercise 6.4: a row-parallel layer adds its bias once, after the all-reduce (before it, the sum
holds the bias t times).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..kernelside.nb06_megatron_ffn import _operator_outputs, _row_outputs, _row_run, _torch_gelu, _tp_mlp_run  # noqa: F401 - run in the kernel
from ..registry import CheckFailure, exercise, expect_close, expect_raises
from . import kernel_side

NOTEBOOK = "06_megatron_ffn"


def gelu(x):
    """GeLU, tanh approximation (Hendrycks & Gimpel 2016), the same formula as the notebook's."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


# ----------------------------------------------------------------------------- 6.1
ex61 = exercise(
    "6.1", title="partial outputs of the column/row split MLP", notebook=NOTEBOOK, points=2,
    hint=("Section 1 (the column split): rank i holds a block of columns of A and the rows of B with the same "
          "indices. Why can rank i apply GeLU without talking to the others, and what must the t partial outputs add "
          "up to?"))
ex61.hint2 = ("Check the invariant on t=2 against the unsplit MLP's output: does your list add up to it, and does "
              "every rank's block of A line up with its block of B?")
ex61.hint_review = ("leads: names the column/row pairing and the invariant the partials satisfy; the slicing is the "
                    "learner's; reviewed 2026-12-06")


_ONLY_F = (("Only the FFN width F (the columns of A, the rows of B) is split; the hidden size H is not. So which of "
            "the two must t divide, and which need not?"))


def _mlp_data(N: int, H: int, F_: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((N, H)), rng.standard_normal((H, F_)), rng.standard_normal((F_, H))


def _expected_partials(X, A, B, t):
    w = A.shape[1] // t
    return [gelu(X @ A[:, i * w:(i + 1) * w]) @ B[i * w:(i + 1) * w, :] for i in range(t)]


def _partials_case(N: int, H: int, F_: int, t: int, seed: int):
    def case(mlp_partials):
        X, A, B = _mlp_data(N, H, F_, seed)
        what = f"mlp_partials(X [{N}, {H}], A [{H}, {F_}], B [{F_}, {H}], t={t})"
        got = mlp_partials(X.copy(), A.copy(), B.copy(), t)
        if isinstance(got, np.ndarray) and got.ndim == 3:
            got = list(got)  # a stacked [t, N, H] array is fine too
        if not isinstance(got, (list, tuple)):
            raise CheckFailure(f"{what}: expected a list of {t} arrays, got {type(got).__name__}")
        if len(got) != t:
            raise CheckFailure(f"{what}: expected a list of t={t} partial outputs, got {len(got)}")
        full = gelu(X @ A) @ B
        expected = _expected_partials(X, A, B, t)
        for i, (g, e) in enumerate(zip(got, expected)):
            g = np.asarray(g)
            if g.shape != e.shape:
                raise CheckFailure(f"{what}: partial {i} should have shape {e.shape} (like Z), got {g.shape}")
            if not np.allclose(g, e, rtol=1e-7, atol=1e-9):
                summed = np.allclose(sum(np.asarray(p) for p in got), full, rtol=1e-7, atol=1e-9)
                extra = (" (the partials do sum to Z, but rank i must use the i-th block of columns of A "
                         "and the i-th block of rows of B)" if summed else
                         " and the partials do not sum to GeLU(X A) B")
                raise CheckFailure(f"{what}: partial {i} expected first row {np.round(e[0], 4).tolist()}, "
                                   f"got {np.round(g[0], 4).tolist()}{extra}")
    return case


ex61.case("t=2, X [6, 4], A [4, 16]")(_partials_case(6, 4, 16, 2, 0))
ex61.case("t=4, X [3, 8], A [8, 32]")(_partials_case(3, 8, 32, 4, 1))
ex61.case("t=1 is the unsplit MLP")(_partials_case(5, 4, 16, 1, 2))
ex61.case("t=4, X [3, 6], A [6, 24]: t divides F, not H", hint=_ONLY_F)(_partials_case(3, 6, 24, 4, 6))


@ex61.case("t=3 does not divide F=16 (H=6): ValueError", hint=_ONLY_F)
def _(mlp_partials):
    X, A, B = _mlp_data(2, 6, 16, 3)
    expect_raises(ValueError, mlp_partials, X, A, B, 3, what="mlp_partials(X [2, 6], A [6, 16], B, t=3)")


ex61.case("t=8, X [7, 5], A [5, 40]", hidden=True)(_partials_case(7, 5, 40, 8, 4))
ex61.case("t=2, one token", hidden=True)(_partials_case(1, 6, 12, 2, 5))
ex61.case("t=3, X [4, 5], A [5, 12]", hidden=True)(_partials_case(4, 5, 12, 3, 7))


@ex61.case("t=5 does not divide F=12 (H=10): ValueError", hidden=True)
def _(mlp_partials):
    X, A, B = _mlp_data(2, 10, 12, 8)
    expect_raises(ValueError, mlp_partials, X, A, B, 5, what="mlp_partials(X [2, 10], A [10, 12], B, t=5)")


def _reference(N, H, F_, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, H, generator=g).requires_grad_(True)
    A = (torch.randn(H, F_, generator=g) / H ** 0.5).requires_grad_(True)
    B = (torch.randn(F_, H, generator=g) / F_ ** 0.5).requires_grad_(True)
    W = torch.randn(N, H, generator=g)
    Z = _torch_gelu(X @ A) @ B
    (Z * W).sum().backward()
    return {"Z": Z.detach(), "dX": X.grad, "dA": A.grad, "dB": B.grad}


def _branch_share(N, H, F_, seed, r, t):
    """dL/dX through rank r's branch alone (its columns of A, rows of B): one of the t terms of dL/dX."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, H, generator=g).requires_grad_(True)
    A = torch.randn(H, F_, generator=g) / H ** 0.5
    B = torch.randn(F_, H, generator=g) / F_ ** 0.5
    W = torch.randn(N, H, generator=g)
    w = F_ // t
    ((_torch_gelu(X @ A[:, r * w:(r + 1) * w]) @ B[r * w:(r + 1) * w]) * W).sum().backward()
    return X.grad


def _operator_case(which: str, t: int, N: int, H: int, F_: int, seed: int):
    """``which`` = "f": the learner's f, the partial outputs summed here (g's forward); "g": the
    learner's g after an identity, the ranks' dL/dX shares summed here (f's backward). labkit's f
    and g never run in the kernel: they are the references of 6.2 and 6.3."""
    def case(fn_class):
        res = fn_class.run(_operator_outputs, which, t, N, H, F_, seed)
        ref = _reference(N, H, F_, seed)
        w = F_ // t
        where = f"t={t}, X [{N}, {H}]"
        if which == "f":
            expect_close(sum(out["Z"] for out in res), ref["Z"], f"{where}: the sum of the ranks' partial outputs "
                         f"(vs one device's Z)", rtol=1e-5, atol=1e-5)
        for r, out in enumerate(res):
            if which == "g":
                expect_close(out["Z"], ref["Z"], f"{where}: forward output Z on rank {r} (vs one device)",
                             rtol=1e-5, atol=1e-5)
            if out["dX"] is None:
                raise CheckFailure(f"{where}: dL/dX on rank {r} is None; backward of "
                                   f"{'f' if which == 'f' else 'g'} must return a gradient for x")
            if which == "g":
                continue  # each rank holds its branch's share: summed below
            if t > 1 and torch.allclose(out["dX"], _branch_share(N, H, F_, seed, r, t), rtol=1e-4, atol=1e-5) \
                    and not torch.allclose(out["dX"], ref["dX"], rtol=1e-5, atol=1e-5):
                raise CheckFailure(f"{where}: dL/dX on rank {r} is only the share of its own branch (the gradient "
                                   f"through rank {r}'s columns of A); the {t} shares were never summed over the "
                                   "group in backward")
            expect_close(out["dX"], ref["dX"], f"{where}: dL/dX on rank {r} (vs one device)", rtol=1e-5, atol=1e-5)
        if which == "g":
            expect_close(sum(out["dX"] for out in res), ref["dX"], f"{where}: the sum of the ranks' dL/dX shares "
                         f"(vs one device's dL/dX; g's backward must pass the gradient through unchanged)",
                         rtol=1e-5, atol=1e-5)
        for r, out in enumerate(res):
            expect_close(out["dA"], ref["dA"][:, r * w:(r + 1) * w],
                         f"{where}: dL/dA_{r} on rank {r} (vs the slice of one device's dL/dA)", rtol=1e-5, atol=1e-5)
            expect_close(out["dB"], ref["dB"][r * w:(r + 1) * w],
                         f"{where}: dL/dB_{r} on rank {r} (vs the slice of one device's dL/dB)", rtol=1e-5, atol=1e-5)
    return case


ex62 = exercise(
    "6.2", title="the operator f", notebook=NOTEBOOK, points=3,
    hint=("Section 3: f sits where every rank needs the same input X. Does f need to communicate in forward? In "
          "backward each rank holds only its own branch's share of dL/dX: what must happen so that every rank ends "
          "with the whole gradient?"))
ex62.hint2 = ("backward returns one gradient per input of forward: how many inputs does forward take? labkit's "
              "collectives work in place: which tensor should they work on?")
ex62.hint_review = ("leads: asks which direction communicates and what each rank must end with (the section's "
                    "conjugate table); the collective and the copy are the learner's; reviewed 2026-12-06")
ex62.case("t=2 ranks: output and gradients equal one device", timeout=20)(_operator_case("f", 2, 4, 6, 8, 10))
ex62.case("t=4 ranks: output and gradients equal one device", timeout=25)(_operator_case("f", 4, 3, 4, 16, 11))
ex62.case("t=1 rank", hidden=True, timeout=20)(_operator_case("f", 1, 2, 4, 8, 12))
ex62.case("t=3 ranks, other sizes", hidden=True, timeout=25)(_operator_case("f", 3, 5, 7, 12, 13))

ex63 = exercise(
    "6.3", title="the operator g", notebook=NOTEBOOK, points=3,
    hint=("Section 3: g is f's conjugate: what f does in one direction, g does in the other. Which direction of g "
          "communicates, and what does the other direction pass on?"))
ex63.hint2 = ("labkit's collective works in place: would changing the tensor autograd handed you be safe? And how "
              "many gradients does backward return?")
ex63.hint_review = ("leads: asks which direction communicates and warns about in-place work; names no collective; "
                    "reviewed 2026-12-06")
ex63.case("t=2 ranks: output and gradients equal one device", timeout=20)(_operator_case("g", 2, 4, 6, 8, 20))
ex63.case("t=4 ranks: output and gradients equal one device", timeout=25)(_operator_case("g", 4, 3, 4, 16, 21))
ex63.case("t=1 rank", hidden=True, timeout=20)(_operator_case("g", 1, 2, 4, 8, 22))
ex63.case("t=3 ranks, other sizes", hidden=True, timeout=25)(_operator_case("g", 3, 5, 7, 12, 23))


# ----------------------------------------------------------------------------- 6.4
ex64 = exercise(
    "6.4", title="the row-parallel layer's bias", notebook=NOTEBOOK, points=2,
    hint=("Section 4 (RowParallelLinear): the bias belongs to the whole layer's output, once. Where in the "
          "computation must it enter so that the output holds it exactly once and every rank's bias gets its "
          "gradient?"))
ex64.hint2 = ("Compare your output on t=2 with the single device's: a difference of one bias means it entered more "
              "than once. Is dL/dbias then set on every rank?")
ex64.hint_review = ("leads: states the invariant (bias exactly once) and asks where it must enter; the order of "
                    "operations is the learner's; reviewed 2026-12-06")


def _row_case(t: int, N: int, F_: int, H: int, seed: int):
    def case(row_parallel_linear):
        res = kernel_side(row_parallel_linear, _row_outputs, t, N, F_, H, seed)
        g = torch.Generator().manual_seed(seed)
        X = torch.randn(N, F_, generator=g).requires_grad_(True)
        W = torch.randn(H, F_, generator=g).requires_grad_(True)
        b = torch.randn(H, generator=g).requires_grad_(True)
        G = torch.randn(N, H, generator=g)
        y = F.linear(X, W, b)
        (y * G).sum().backward()
        w, where = F_ // t, f"t={t}, x [{N}, {F_}], weight [{H}, {F_}]"
        _row_mistakes(res, X.detach(), W.detach(), b.detach(), G, t, where)
        for r, out in enumerate(res):
            extra = out["y"] - y.detach()
            for k in range(2, t + 1):  # the bias added on k ranks before the sum
                if t > 1 and torch.allclose(extra, (k - 1) * b.detach().expand_as(extra), rtol=1e-4, atol=1e-5):
                    raise CheckFailure(
                        f"{where}: the output on rank {r} is the single device's plus {k - 1} x bias, i.e. it holds "
                        f"the bias {k} times: it was added to the partial products on {k} ranks before the "
                        f"all-reduce summed them; add it once, after the all-reduce")
            expect_close(out["y"], y.detach(), f"{where}: output on rank {r} (vs F.linear on one device)",
                         rtol=1e-5, atol=1e-5)
            for key, ref, name in (("dx", X.grad[:, r * w:(r + 1) * w], "dL/dx_r"),
                                   ("dW", W.grad[:, r * w:(r + 1) * w], "dL/dW_r"), ("db", b.grad, "dL/dbias")):
                if out[key] is None:
                    raise CheckFailure(f"{where}: {name} on rank {r} is None: build the output from x_shard, "
                                       f"weight_shard and bias with differentiable operations")
                expect_close(out[key], ref, f"{where}: {name} on rank {r} (vs the slice of one device's)",
                             rtol=1e-5, atol=1e-5)
    return case


def _row_mistakes(res, X, W, b, G, t, where):
    """Name the plausible mistakes of 6.4 that the plain comparison would report alike."""
    if t < 2:
        return
    w = X.shape[1] // t
    close = lambda a, e: a is not None and torch.allclose(a, e, rtol=1e-4, atol=1e-5)  # noqa: E731
    for r, out in enumerate(res):
        x_r, W_r = X[:, r * w:(r + 1) * w], W[:, r * w:(r + 1) * w]
        if close(out["y"], x_r @ W_r.t() + b):   # nothing summed over the ranks in forward
            if close(out["dx"], t * (G @ W_r)):
                raise CheckFailure(
                    f"{where}: the output on rank {r} is only its own partial product plus the bias, and dL/dx_r "
                    f"is {t} x too large: this is f (identity forward, all-reduce backward) where the layer needs "
                    "g: which of the two sums in forward?")
            raise CheckFailure(
                f"{where}: the output on rank {r} is only its own partial product x_r W_r^T plus the bias: the "
                f"{t} partial products were never summed over the group")
    have = [r for r, out in enumerate(res) if out["db"] is not None]
    if have and len(have) < t:
        r = next(r for r in range(t) if r not in have)
        raise CheckFailure(
            f"{where}: dL/dbias is None on rank {r} but set on rank(s) {have}: the bias entered the output only "
            "through some ranks' computation; every rank holds the whole bias and must end with its gradient, "
            "so on which ranks should the bias be part of the output?")


ex64.case("t=2 ranks: output and gradients equal one device", timeout=20)(_row_case(2, 4, 8, 6, 40))
ex64.case("t=4 ranks: output and gradients equal one device", timeout=25)(_row_case(4, 3, 16, 5, 41))
ex64.case("t=1 rank", hidden=True, timeout=20)(_row_case(1, 2, 4, 3, 42))
ex64.case("t=3 ranks, other sizes", hidden=True, timeout=25)(_row_case(3, 5, 12, 7, 43))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402


def _draw_mlp(r):
    t = r.randint(1, 5)
    return r.randint(1, 6), r.randint(1, 8), t * r.randint(1, 6), t, seed(r)


def _draw_operator(which):
    def draw(r):
        t = r.randint(1, 3)
        return which, t, r.randint(1, 5), r.randint(1, 6), t * r.randint(1, 4), seed(r)
    return draw


def _draw_row(r):
    t = r.randint(1, 3)
    return t, r.randint(1, 5), t * r.randint(1, 4), r.randint(1, 6), seed(r)


fresh_case(ex61, "random sizes, t and values", _draw_mlp, _partials_case)
fresh_case(ex62, "random t, sizes and values", _draw_operator("f"), _operator_case, n=2)
fresh_case(ex63, "random t, sizes and values", _draw_operator("g"), _operator_case, n=2)
fresh_case(ex64, "random t, sizes and values", _draw_row, _row_case, n=2)
