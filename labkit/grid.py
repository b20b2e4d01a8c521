"""The process grid: N ranks as a named mesh, and the only rank arithmetic in labkit.

Megatron-LM (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters", sec. 3) splits N = t x p x d GPUs into a grid: tensor-parallel degree t, pipeline
degree p, data-parallel degree d. Megatron-Core's ``parallel_state`` orders the axes
``tp-cp-ep-dp-pp`` from the innermost: TP on neighbouring ranks (the fastest links, inside a
node), then context parallelism (CP), then DP, PP outermost. Here the mesh is

    torch.arange(N).view(pp, dp, cp, tp)          # AXES, outermost first

so ``rank = ((pp_rank * d + dp_rank) * cp + cp_rank) * t + tp_rank``. The group of an axis holds
the ranks that differ only in that axis' coordinate (a row of the view along that axis).
``cp`` is 1 unless asked for.

Expert parallelism is folded onto the data ranks, Megatron-Core's "parallel folding" (Liu et al.
2025, "MoE Parallel Folding"): the experts of an MoE layer are sharded over ``ep`` ranks of the
DP group (expert tensor parallelism = t: the MoE input is replicated over TP, so the t ranks of
a TP group hold the same experts), and ``edp = d / ep`` groups of EP ranks hold the same experts
(expert data parallelism). By default ``ep = d``: the EP group is the DP group.

:class:`ProcessGrid` without a ``ctx`` is pure arithmetic (no process needed: layouts, plots,
tests); :func:`make_grid` (or :meth:`ProcessGrid.build`) also creates the process groups, a
collective call.
"""
from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch

__all__ = ["AXES", "Mesh", "ProcessGrid", "even_part", "make_grid"]

AXES = ("pp", "dp", "cp", "tp")  # outermost first; Megatron-Core's order read from the outside


def even_part(n: int, size: int, index: int) -> slice:
    """The ``index``-th of ``size`` equal consecutive parts of ``n`` items:
    ``slice(index n/size, (index+1) n/size)``. What a rank holds of anything split evenly over an
    axis: the rows of a TP-split weight, a vocabulary shard, a DP rank's micro-batch rows, the
    experts ``expert_offset .. expert_offset + E/ep - 1`` of an EP rank (Megatron-Core's
    ``local_expert_indices``). Raises ValueError when ``size`` does not divide ``n`` or ``index``
    is outside ``0 .. size-1``."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or n % size:
        raise ValueError(f"{n} items cannot be split evenly into {size!r} parts")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise ValueError(f"part {index!r} is outside 0..{size - 1}")
    return slice(index * (n // size), (index + 1) * (n // size))


class Mesh:
    """Ranks ``0 .. N-1`` laid out as ``torch.arange(N).view(*sizes)``, one named axis per
    dimension, outermost first (the last axis holds neighbouring ranks). The arithmetic that every
    layout in labkit shares: :class:`ProcessGrid` is one, the N nodes x g GPUs of
    :mod:`labkit.moe.hierarchical` (``Mesh(node=N, local=g)``) another.

    Raises ValueError when a size is not an integer >= 1."""

    def __init__(self, **sizes: int):
        for axis, n in sizes.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{axis}={n!r}: every degree of the grid must be an integer >= 1")
        self.axes, self.sizes = tuple(sizes), dict(sizes)
        self.mesh = torch.arange(math.prod(sizes.values())).view(*sizes.values())
        self.world = self.mesh.numel()

    def coords(self, rank: int) -> dict:
        """``{axis: coordinate}`` of ``rank``; ValueError outside ``0 .. N-1``."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank {rank!r} is outside the grid's ranks 0..{self.world - 1}")
        return dict(zip(self.axes, (self.mesh == rank).nonzero()[0].tolist(), strict=True))

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (an axis left out is 0). Raises ValueError for an
        unknown axis or a coordinate outside ``0 .. size-1``."""
        for axis, c in coords.items():
            if axis not in self.sizes:
                raise ValueError(f"unknown axis {axis!r}; the grid's axes are {', '.join(self.axes)}")
            if not 0 <= c < self.sizes[axis]:
                raise ValueError(f"{axis}={c} is outside 0..{self.sizes[axis] - 1}")
        return int(self.mesh[tuple(coords.get(a, 0) for a in self.axes)])

    def all_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (the ranks that differ only in that coordinate, in coordinate
        order), in the order every rank must create them: the other axes' indices in mesh order."""
        if axis not in self.sizes:
            raise ValueError(f"unknown axis {axis!r}; the grid's axes are {', '.join(self.axes)}")
        dim = self.axes.index(axis)
        return self.mesh.movedim(dim, -1).reshape(-1, self.mesh.shape[dim]).tolist()

    def ranks(self, axis: str, rank: int) -> list[int]:
        """The ranks of the group along ``axis`` that holds ``rank``."""
        return next(g for g in self.all_ranks(axis) if rank in g)

    def part(self, n: int, axis: str, rank: int, dim: int = 0) -> slice:
        """Which of ``n`` items ``rank`` holds when they are split into equal consecutive parts
        over ``axis``: ``slice(c n/size, (c+1) n/size)`` for coordinate c. Raises ValueError for
        an unknown axis or when the axis size does not divide n (``dim`` only names it)."""
        if axis not in self.sizes:
            raise ValueError(f"unknown axis {axis!r}; the grid's axes are {', '.join(self.axes)}")
        size = self.sizes[axis]
        if n % size:
            raise ValueError(f"{n} rows along dim {dim} cannot be split evenly over {axis}={size} ranks")
        return even_part(n, size, self.coords(rank)[axis])

    def shard(self, t: torch.Tensor, axis: str, rank: int, dim: int = 0) -> torch.Tensor:
        """The part of ``t`` along ``dim`` that ``rank`` holds (:meth:`part`; a view)."""
        sl = self.part(t.shape[dim], axis, rank, dim)
        return t.narrow(dim, sl.start, sl.stop - sl.start)

    def new_groups(self, ctx, axis: str):
        """Create every group along ``axis`` on the launch ``ctx`` (collective: every rank, same
        order; a group spanning the world is the world group) and return this rank's."""
        mine = None
        for ranks in self.all_ranks(axis):
            g = ctx.group if len(ranks) == ctx.world_size else _new_group(ctx, ranks)
            if ctx.rank in ranks:
                mine = g
        return mine


class ProcessGrid:
    """N = p x d x cp x t ranks as a named mesh (module docstring); optionally this rank's groups.

    Args:
        tp, pp, dp, cp: the degrees t, p, d and the context-parallel degree (integers >= 1).
        ep: expert-parallel degree, folded onto DP; must divide ``dp``; default ``dp``.
        rank: this process's global rank, or None for a grid used only for arithmetic.
        ctx: the :class:`labkit.dist.DistContext` of the launch (set by :meth:`build`).

    Attributes: ``world`` (N), ``sizes`` (``{axis: size}``), ``mesh`` (the ``[p, d, cp, t]``
    tensor of global ranks), and for this rank ``tp_rank``, ``dp_rank``, ``cp_rank``, ``pp_rank``,
    ``ep_rank``; after :meth:`build` the groups ``tp_group``, ``dp_group``, ``pp_group``
    (``cp_group``: None while cp = 1; ``ep_group``, ``edp_group``) and ``pp_ranks`` (the global ranks of this rank's
    pipeline, in stage order).

    Raises ValueError when a degree is not an integer >= 1, ``ep`` does not divide ``dp``, or
    ``rank`` is outside ``0 .. N-1``.
    """

    def __init__(self, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, ep: int | None = None,
                 rank: int | None = None, ctx: Any = None):
        self._mesh = Mesh(pp=pp, dp=dp, cp=cp, tp=tp)
        sizes = self._mesh.sizes
        ep = dp if ep is None else ep
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or dp % ep:
            raise ValueError(f"ep={ep!r} must be an integer >= 1 that divides dp={dp} (EP is folded onto DP)")
        self.sizes = sizes
        self.ep = ep
        self.mesh, self.world = self._mesh.mesh, self._mesh.world
        if rank is not None and not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the grid's ranks 0..{self.world - 1}")
        self.rank, self.ctx = rank, ctx
        self._groups: dict[str, Any] = {}

    # ------------------------------------------------------------------ degrees and this rank

    tp = property(lambda self: self.sizes["tp"], doc="TP degree t")
    pp = property(lambda self: self.sizes["pp"], doc="PP degree p")
    dp = property(lambda self: self.sizes["dp"], doc="DP degree d")
    cp = property(lambda self: self.sizes["cp"], doc="CP degree")
    edp = property(lambda self: self.dp // self.ep, doc="expert data-parallel degree d / ep")

    def _own(self, axis: str) -> int:
        if self.rank is None:
            raise ValueError("this grid has no rank (rank=None): pass one, or use coords(rank)")
        return self.coords(self.rank)[axis]

    tp_rank = property(lambda self: self._own("tp"))
    dp_rank = property(lambda self: self._own("dp"))
    cp_rank = property(lambda self: self._own("cp"))
    pp_rank = property(lambda self: self._own("pp"))
    ep_rank = property(lambda self: self._own("dp") % self.ep, doc="index in this rank's EP group")

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={self.sizes[a]}" for a in AXES)
        return f"ProcessGrid({sizes}, ep={self.ep}, rank={self.rank})"

    # ------------------------------------------------------------------ arithmetic

    def coords(self, rank: int) -> dict:
        """``{"pp": .., "dp": .., "cp": .., "tp": ..}`` of global ``rank``; ValueError outside the grid."""
        return self._mesh.coords(rank)

    def rank_of(self, **coords: int) -> int:
        """The global rank at the given coordinates (``pp=, dp=, cp=, tp=``; an axis left out is 0).
        Raises ValueError for an unknown axis or a coordinate outside ``0 .. size-1``."""
        return self._mesh.rank_of(**coords)

    def all_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` as a list of global ranks (``"pp"``, ``"dp"``, ``"cp"``,
        ``"tp"``, ``"ep"``, ``"edp"``), in the order every rank creates them: the other axes' indices
        in mesh order. A group's ranks are in coordinate order (a pipeline's in stage order)."""
        if axis in ("ep", "edp"):
            # split the DP coordinate into (edp, ep), ep innermost: EP groups are ep consecutive DP ranks
            return Mesh(pp=self.pp, edp=self.edp, ep=self.ep, cp=self.cp, tp=self.tp).all_ranks(axis)
        if axis not in self.sizes:
            raise ValueError(f"unknown axis {axis!r}; the grid's axes are {', '.join(AXES)}, ep, edp")
        return self._mesh.all_ranks(axis)

    def ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """The global ranks of the group along ``axis`` that holds ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        if rank is None:
            raise ValueError("this grid has no rank (rank=None): pass ranks(axis, rank)")
        return next(g for g in self.all_ranks(axis) if rank in g)

    def shard(self, t: torch.Tensor, axis: str, rank: int | None = None, dim: int = 0) -> torch.Tensor:
        """:meth:`Mesh.shard` of ``t`` over ``axis`` (``"pp"``, ``"dp"``, ``"cp"``, ``"tp"``) for
        ``rank`` (default: this rank), e.g. this DP rank's slice of the global batch."""
        return self._mesh.shard(t, axis, self._rank_or(rank, "shard(t, axis, rank)"), dim)

    def part(self, n: int, axis: str, rank: int | None = None) -> slice:
        """:meth:`Mesh.part` over ``axis`` for ``rank`` (default: this rank): e.g. the columns of a
        TP-split matrix that this TP rank holds."""
        return self._mesh.part(n, axis, self._rank_or(rank, "part(n, axis, rank)"))

    def _rank_or(self, rank, call: str) -> int:
        rank = self.rank if rank is None else rank
        if rank is None:
            raise ValueError(f"this grid has no rank (rank=None): pass {call}")
        return rank

    def group(self, axis: str):
        """This rank's process group along ``axis`` (after :meth:`build`)."""
        if axis not in self._groups:
            raise ValueError(f"no {axis!r} group on this grid: groups exist after ProcessGrid.build(ctx, ...) "
                             f"for {', '.join(self._groups) or 'no axis'}")
        return self._groups[axis]

    # ------------------------------------------------------------------ groups

    @classmethod
    def build(cls, ctx, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
              ep: int | None = None) -> "ProcessGrid":
        """This rank's grid with its process groups, on the launch ``ctx`` (collective: every rank
        calls it with the same degrees). ``dp`` None: ``world / (t p cp)``.

        Raises ValueError (before any communication) when the degrees do not multiply to the world
        size. The groups of every axis are created by every rank in the same order (a torch rule):
        tp, dp, pp, then cp (only when cp > 1) and ep, edp (only when ep differs from d); a group that
        spans the world is the world group itself.
        """
        world = ctx.world_size
        if dp is None:
            if tp < 1 or pp < 1 or cp < 1 or world % (tp * pp * cp):
                raise ValueError(f"tp={tp} * pp={pp}" + (f" * cp={cp}" if cp != 1 else "")
                                 + f" must divide world_size={world}")
            dp = world // (tp * pp * cp)
        if min(tp, dp, pp, cp) < 1 or tp * dp * pp * cp != world:
            cps = f" * cp={cp}" if cp != 1 else ""
            raise ValueError(f"tp={tp} * dp={dp} * pp={pp}{cps} = {tp * dp * pp * cp} must equal "
                             f"world_size={world}")
        grid = cls(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, rank=ctx.rank, ctx=ctx)
        axes = ["tp", "dp", "pp"] + (["cp"] if cp > 1 else []) + (["ep", "edp"] if grid.ep != dp else [])
        whole = list(range(world))
        for axis in axes:
            for ranks in grid.all_ranks(axis):   # every rank creates every group, in the same order
                g = ctx.group if ranks == whole else _new_group(ctx, ranks)
                if ctx.rank in ranks:
                    grid._groups[axis] = g
        if grid.ep == dp:
            grid._groups["ep"] = grid._groups["dp"]
        return grid

    tp_group = property(lambda self: self._groups.get("tp"))
    dp_group = property(lambda self: self._groups.get("dp"))
    pp_group = property(lambda self: self._groups.get("pp"))
    cp_group = property(lambda self: self._groups.get("cp"))
    ep_group = property(lambda self: self._groups.get("ep"))
    edp_group = property(lambda self: self._groups.get("edp"))
    pp_ranks = property(lambda self: self.ranks("pp"), doc="global ranks of this rank's pipeline, stage order")


def _new_group(ctx, ranks):
    new_group = getattr(ctx, "new_group", None)
    if new_group is not None:
        return new_group(ranks)
    import torch.distributed as dist
    return dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=ctx.timeout))


def make_grid(ctx, tp: int = 1, pp: int = 1, dp: int | None = None, cp: int = 1,
              ep: int | None = None) -> ProcessGrid:
    """:meth:`ProcessGrid.build`: this rank's grid with ``tp * dp * pp (* cp) == ctx.world_size`` and
    its process groups (collective). Raises ValueError before any communication when the degrees do
    not multiply to the world size."""
    return ProcessGrid.build(ctx, tp=tp, pp=pp, dp=dp, cp=cp, ep=ep)
