"""Benchmark: sort-based dispatch against GShard's dense one-hot dispatch.

    python -m labkit bench moe [--tokens 1024 8192] [--experts 8 64] [--hidden 64] [--top-k 2]

For each T (tokens) and E (experts): route T random tokens top-k with capacity factor 1.25,
then time dispatch + combine only (experts are the identity, so what is measured is moving
tokens), and count the bytes of the tensors each method builds:

* sort:  permuted rows [N, H] + their source-token and slot indices (int64) + output [T, H];
* dense: dispatch and combine [T, E, C] + expert input [E, C, H] + output [T, H].

N = kept slots <= k*T; C = ceil(k*T/E*capacity_factor), so T*E*C = k*T^2*capacity_factor grows
with T^2 whatever E is. Times are medians of ``--repeat`` runs (seconds); ratios dense/sort.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..cliparse import Parser
from ..moe.dispatch import dense_dispatch_tensors, permute, unpermute
from ..moe.router import capacity_mask, compute_capacity, route
from . import median_time


def bench_one(T: int, E: int, H: int, k: int, capacity_factor: float, repeat: int, seed: int = 0) -> dict:
    """Time (s) and dispatch-tensor bytes of both methods for one (T, E); checks they agree."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    weights, indices, _ = route(torch.randn(T, E, generator=g), k)
    C = compute_capacity(T, E, k, capacity_factor)
    keep = capacity_mask(indices, weights, E, C, "probs")
    weights = weights * keep

    def sort_based():
        rows, perm = permute(x, indices, keep, E)
        return unpermute(rows, perm, weights), rows, perm          # identity experts

    def dense():
        dispatch, combine, C_ = dense_dispatch_tensors(weights, indices, keep, E, C)
        expert_in = torch.einsum("tec,th->ech", dispatch, x)
        return torch.einsum("tec,ech->th", combine, expert_in), dispatch, combine, expert_in

    t_sort, (y_sort, rows, perm) = median_time(sort_based, repeat)
    t_dense, (y_dense, dispatch, combine, expert_in) = median_time(dense, repeat)
    torch.testing.assert_close(y_sort, y_dense, rtol=1e-4, atol=1e-5)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    b_sort = nbytes(rows, perm.token_index, perm.slot, y_sort)
    b_dense = nbytes(dispatch, combine, expert_in, y_dense)
    del dispatch, combine, expert_in
    return {"T": T, "E": E, "C": C, "kept": int(keep.sum()), "t_sort": t_sort, "t_dense": t_dense,
            "bytes_sort": b_sort, "bytes_dense": b_dense}


def _bad_args(a) -> str | None:
    """The first rule the options break, as a message naming the values; None if all are fine."""
    import math

    from ..cliparse import too_small
    bad = too_small(*[("--tokens", T, 1) for T in a.tokens], *[("--experts", E, 1) for E in a.experts],
                    ("--hidden", a.hidden, 1), ("--top-k", a.top_k, 1), ("--repeat", a.repeat, 1),
                    ("--threads", a.threads, 1))
    if bad:
        return bad
    if a.top_k > min(a.experts):
        return f"--top-k {a.top_k} must be in [1, --experts {min(a.experts)}] (each token picks k distinct experts)"
    if not (math.isfinite(a.capacity_factor) and a.capacity_factor > 0):
        return f"--capacity-factor must be a finite number > 0, got {a.capacity_factor}"
    from ..labs import _gib, available_memory
    limit = available_memory()
    for T in a.tokens:
        for E in a.experts:
            need = memory_needed(T, E, a.hidden, a.top_k, a.capacity_factor)
            if limit is not None and need > limit:
                C = math.ceil(a.top_k * T / E * a.capacity_factor)
                return (f"--tokens {T} --experts {E} --hidden {a.hidden}: one measurement needs about {_gib(need)} of "
                        f"memory (the dense dispatch and combine tensors alone 2 T E C x 4 bytes = "
                        f"{_gib(8 * T * E * C)}, C = {C}), more than the {_gib(limit)} available; use fewer tokens")
    return None


def memory_needed(T: int, E: int, H: int, k: int, capacity_factor: float) -> int:
    """Bytes :func:`bench_one` holds at its peak for (T, E) (fp32 values, int64 indices): the tokens
    x [T, H], the router's logits [T, E] and choices [T, k]; the sort side's rows [kT, H], their
    indices and its output; the dense side's dispatch and combine [T, E, C], expert input [E, C, H]
    and output (both sides' results are alive together, for the comparison)."""
    import math
    C = math.ceil(k * T / E * capacity_factor)
    routing = 4 * T * H + 4 * T * E + k * T * (4 + 8 + 1)
    sort = 4 * k * T * H + 16 * k * T + 4 * T * H
    dense = 2 * 4 * T * E * C + 4 * E * C * H + 4 * T * H
    return routing + sort + dense


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m labkit bench moe", description=__doc__.split("\n")[0],
               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192], help="token counts T to time")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="expert counts E to time")
    p.add_argument("--hidden", type=int, default=64, help="hidden size H")
    p.add_argument("--top-k", type=int, default=2, help="experts k per token")
    p.add_argument("--capacity-factor", type=float, default=1.25, help="capacity C = factor * k * T / E")
    p.add_argument("--repeat", type=int, default=5, help="timed runs (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    a = p.parse_args(argv)
    bad = _bad_args(a)
    if bad:
        from ..labs import error
        return error(bad)
    torch.set_num_threads(a.threads)
    print(f"dispatch + combine, H={a.hidden}, k={a.top_k}, capacity factor {a.capacity_factor}, fp32, "
          f"{torch.get_num_threads()} threads; identity experts")
    print(f"{'T':>6} {'E':>4} {'C':>5} | {'sort ms':>8} {'dense ms':>9} {'ratio':>7} | "
          f"{'sort MiB':>9} {'dense MiB':>10} {'ratio':>7}")
    for T in a.tokens:
        for E in a.experts:
            r = bench_one(T, E, a.hidden, a.top_k, a.capacity_factor, a.repeat)
            print(f"{T:>6} {E:>4} {r['C']:>5} | {r['t_sort'] * 1e3:8.2f} {r['t_dense'] * 1e3:9.2f} "
                  f"{r['t_dense'] / r['t_sort']:6.1f}x | {r['bytes_sort'] / 2**20:9.2f} "
                  f"{r['bytes_dense'] / 2**20:10.2f} {r['bytes_dense'] / r['bytes_sort']:6.1f}x")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
