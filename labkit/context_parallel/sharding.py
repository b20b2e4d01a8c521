"""The sequence split over the context-parallel (CP) group, and the causal work it leaves each rank.

A sequence of S tokens is cut into chunks along the sequence dimension. Two placements:

* contiguous (``load_balance=False``): rank i holds tokens [i S/cp, (i+1) S/cp).
* load-balanced (``load_balance=True``, the default): the sequence is cut into 2 cp chunks of
  S/(2 cp) tokens and rank i holds chunks i and 2cp-1-i (Megatron-Core context parallelism;
  Llama 3 paper sec. 3.3.2). Under a causal mask a query at position p attends to p+1 keys, so
  the contiguous split gives the last rank about 2 cp - 1 times the first rank's work; pairing
  an early chunk with a late one gives every rank the same work (:func:`causal_work`).

Every function here is local arithmetic (no communication) except :func:`gather_sequence`.
"""
from __future__ import annotations

import numbers

import torch

from .. import comm


def check_sequence_split(S: int, cp: int, load_balance: bool = True) -> None:
    """Raise ValueError (one line naming S, cp and the rule) unless S splits evenly:
    S % cp == 0, or S % (2 cp) == 0 with ``load_balance``."""
    for name, value in (("S", S), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    n = 2 * cp if load_balance else cp
    if S % n:
        rule = "2 * cp (two chunks per rank, load_balance=True)" if load_balance else "cp"
        raise ValueError(f"sequence length S={S} must be divisible by {rule} = {n} (cp={cp})")


def chunk_placement(cp: int, load_balance: bool = True) -> list[tuple[int, ...]]:
    """The chunks each rank holds: ``[(i, 2cp-1-i) for i in range(cp)]`` when load-balanced
    (2 cp chunks), ``[(i,) for i in range(cp)]`` otherwise (cp chunks)."""
    check_sequence_split(2 * cp, cp, load_balance)
    if load_balance:
        return [(i, 2 * cp - 1 - i) for i in range(cp)]
    return [(i,) for i in range(cp)]


def sequence_positions(S: int, rank: int, cp: int, load_balance: bool = True) -> torch.Tensor:
    """Global positions (long tensor [S/cp], increasing) of the tokens rank ``rank`` holds."""
    check_sequence_split(S, cp, load_balance)
    chunks = chunk_placement(cp, load_balance)[rank]
    m = S // (2 * cp if load_balance else cp)
    return torch.cat([torch.arange(c * m, (c + 1) * m) for c in chunks])


def shard_sequence(x: torch.Tensor, dim: int, rank: int, cp: int, load_balance: bool = True) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (size S there -> S/cp), a copy."""
    pos = sequence_positions(x.shape[dim], rank, cp, load_balance).to(x.device)
    return x.index_select(dim, pos).contiguous()


def unshard_sequence(parts: list[torch.Tensor], dim: int, load_balance: bool = True) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full tensor from every rank's part (rank order)."""
    cp = len(parts)
    S = parts[0].shape[dim] * cp
    pos = torch.cat([sequence_positions(S, r, cp, load_balance) for r in range(cp)])
    cat = torch.cat(parts, dim)
    out = torch.empty_like(cat)
    out.index_copy_(dim, pos.to(cat.device), cat)
    return out


def gather_sequence(x: torch.Tensor, dim: int, group, load_balance: bool = True) -> torch.Tensor:
    """All-gather every rank's ``x`` over the CP ``group`` and return the full sequence along
    ``dim`` (no autograd: for checking results)."""
    cp = comm._group_size(group)
    xt = x.detach().movedim(dim, 0).contiguous()
    out = torch.empty((cp * xt.shape[0], *xt.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, xt, group)
    parts = [p.movedim(0, dim) for p in out.chunk(cp, 0)]
    return unshard_sequence(parts, dim, load_balance)


def causal_work(S: int, cp: int, load_balance: bool = True) -> list[int]:
    """Per rank, the number of (query, key) pairs a causal mask leaves unmasked for the
    queries it holds: the attention work (score entries; x B x heads x 4d FLOPs each).

    Contiguous: rank i has i c^2 + c (c+1)/2 with c = S/cp (about i + 1/2 units of c^2).
    Balanced: (2cp - 1) m^2 + m (m+1) with m = S/(2cp) on every rank."""
    work = []
    for r in range(cp):
        pos = sequence_positions(S, r, cp, load_balance)
        work.append(int((pos + 1).sum()))
    return work


def attention_work(S: int, cp: int, attention: str, heads: int, load_balance: bool = True) -> list[int]:
    """Per CP rank, the unmasked (query, key) pairs per sequence its attention computes, summed
    over the heads it computes them for, in a layer of ``heads`` heads (per TP rank).

    ring, allgather: every rank computes all ``heads`` heads for its own queries on every key:
    ``heads * causal_work(S, cp, load_balance)[r]`` (balanced only with the 2 cp chunks).
    ulysses: every rank computes ``heads / cp`` heads for all S queries: ``heads / cp * S (S+1) / 2``
    on every rank, whatever the placement (the head split balances it; Jacobs et al. 2023 sec. 3).
    Raises ValueError for an unknown ``attention`` or, for Ulysses, cp not dividing ``heads``."""
    check_sequence_split(S, cp, load_balance)
    if attention in ("ring", "allgather"):
        return [heads * w for w in causal_work(S, cp, load_balance)]
    if attention != "ulysses":
        raise ValueError(f"attention must be one of ring | allgather | ulysses, got {attention!r}")
    if isinstance(heads, bool) or not isinstance(heads, numbers.Integral) or heads < 1 or heads % cp:
        raise ValueError(f"Ulysses splits the heads over the CP group: heads={heads!r} must be divisible by cp={cp}")
    return [heads // cp * S * (S + 1) // 2] * cp
