"""Every collective and point-to-point operation labkit issues goes through this module,
so that it can be counted.

Usage::

    from labkit.comm import CommLog
    with CommLog() as log:
        y = layer(x)          # any labkit code
        y.sum().backward()
    log.count("all_reduce")   # number of all-reduces this rank issued
    log.bytes("all_reduce")   # their payload in bytes (numel * element_size of this rank's tensor)
    log.summary()             # {(kind, group_size): (count, bytes)}

What is counted is the payload of this rank's tensor argument: for ``all_reduce`` the
reduced tensor, for ``all_gather_into_tensor`` the local input shard, for
``reduce_scatter_tensor`` the full input, for ``all_to_all_single`` the bytes this rank
sends, for ``send``/``recv`` the tensor. The ring algorithm moves about
2(t-1)/t of an all-reduce's payload per rank (Megatron-LM paper, sec. 3); the formulas
in the labs state which of the two they compare.

Logs nest: every active log records each operation. Logs are per process, i.e. per rank.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .wire import ring_bytes  # the ring formula's one home (a leaf module; the planner uses it too)

_ACTIVE: list["CommLog"] = []
# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (old names warn)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CommRecord:
    """One operation: ``kind`` (e.g. "all_reduce"), ``group_size`` (ranks in the group),
    ``nbytes`` (payload in bytes), ``shape`` and ``dtype`` of the tensor, ``peer``
    (global rank for send/recv, else None) and ``ranks`` (the group's global ranks)."""

    kind: str
    group_size: int
    nbytes: int
    shape: tuple
    dtype: str
    peer: Optional[int] = None
    ranks: Optional[tuple] = None   # global ranks of the group (tells the TP/DP/PP axes apart)


class CommLog:
    """Context manager that records every labkit communication issued inside it."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def __enter__(self) -> "CommLog":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)

    def of(self, kind: str) -> list[CommRecord]:
        return [r for r in self.records if r.kind == kind]

    def count(self, kind: str | None = None) -> int:
        """Number of operations of ``kind`` (all kinds when None)."""
        return len(self.records) if kind is None else len(self.of(kind))

    def bytes(self, kind: str | None = None) -> int:
        """Total payload bytes of ``kind`` (all kinds when None)."""
        recs = self.records if kind is None else self.of(kind)
        return sum(r.nbytes for r in recs)

    def wire_bytes(self, kind: str | None = None) -> int:
        """Bytes this rank sends over the wire for ``kind`` (all kinds when None) under the
        ring algorithms: see :func:`ring_wire_bytes`."""
        recs = self.records if kind is None else self.of(kind)
        return sum(ring_wire_bytes(r) for r in recs)

    def summary(self) -> dict:
        """``{(kind, group_size): (count, bytes)}``."""
        out: dict = defaultdict(lambda: [0, 0])
        for r in self.records:
            out[(r.kind, r.group_size)][0] += 1
            out[(r.kind, r.group_size)][1] += r.nbytes
        return {k: tuple(v) for k, v in out.items()}

    def clear(self) -> None:
        self.records.clear()


def ring_wire_bytes(rec: CommRecord) -> int:
    """Bytes one rank sends for ``rec`` under the ring algorithms (:func:`ring_bytes`)."""
    return ring_bytes(rec.kind, rec.nbytes, rec.group_size)


def count_by_axis(records, axis_of) -> dict:
    """``{axis: {kind: (count, bytes)}}`` of one rank's ``records`` (:class:`CommRecord`), each under
    ``axis_of(record)``: the model's name for the group it ran on (tp, pp, dp, ep, ...)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        c = out[axis_of(r)][r.kind]
        c[0] += 1
        c[1] += r.nbytes
    return {a: {k: tuple(v) for k, v in kinds.items()} for a, kinds in out.items()}


def wire_bytes_by_axis(records, axis_of) -> dict:
    """``{axis: bytes}`` one rank sends for ``records`` under the ring algorithms (:func:`ring_wire_bytes`:
    an all-reduce of P bytes over d ranks sends 2(d-1)/d * P, a receive nothing), each under ``axis_of(record)``."""
    out: dict = defaultdict(int)
    for r in records:
        out[axis_of(r)] += ring_wire_bytes(r)
    return dict(out)


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _record(kind: str, tensor: torch.Tensor, group=None, peer=None, nbytes=None) -> None:
    if not _ACTIVE:
        return
    rec = CommRecord(
        kind,
        _group_size(group),
        int(tensor.numel() * tensor.element_size()) if nbytes is None else int(nbytes),
        tuple(tensor.shape),
        str(tensor.dtype).replace("torch.", ""),
        peer,
        tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)),
    )
    for log in _ACTIVE:
        log.records.append(rec)


# --------------------------------------------------------------------------- collectives


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of ``tensor`` over ``group``; returns ``tensor``, or with
    ``async_op=True`` the ``Work`` handle (call ``.wait()`` before reading ``tensor``)."""
    _record("all_reduce", tensor, group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else tensor


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Gather every rank's ``input`` (same shape) along dim 0 into ``output``
    (shape ``[t * input.shape[0], ...]``); returns ``output``, or with ``async_op=True`` the
    ``Work`` handle (``.wait()`` before reading ``output``)."""
    _record("all_gather", input, group)
    work = _all_gather(output, input.contiguous(), group=group, async_op=async_op)
    return work if async_op else output


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``input`` (shape ``[t * n, ...]``) over ranks and keep this rank's ``n`` rows; returns
    ``output``, or with ``async_op=True`` the ``Work`` handle."""
    _record("reduce_scatter", input, group)
    work = _reduce_scatter(output, input.contiguous(), group=group, async_op=async_op)
    return work if async_op else output


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group=None,
) -> torch.Tensor:
    """``dist.all_to_all_single`` (uneven splits along dim 0 allowed, zeros included).
    Counted bytes: what this rank sends."""
    _record("all_to_all", input, group)
    dist.all_to_all_single(
        output, input.contiguous(),
        output_split_sizes=None if output_split_sizes is None else list(output_split_sizes),
        input_split_sizes=None if input_split_sizes is None else list(input_split_sizes),
        group=group,
    )
    return output


def all_gather_object(object_list: list, obj: Any, group=None) -> list:
    """``dist.all_gather_object``: every rank's picklable ``obj`` into ``object_list`` (length t,
    rank order). Counted as ``"all_gather_object"`` with 0 bytes (the pickled size is not known
    before the call). For small control messages (e.g. error text), not for tensors."""
    if _ACTIVE:
        _record("all_gather_object", torch.empty(0), group, nbytes=0)
    dist.all_gather_object(object_list, obj, group=group)
    return object_list


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    _record("broadcast", tensor, group)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


# --------------------------------------------------------------------------- point to point


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    _record("send", tensor, group, peer=dst)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    _record("recv", tensor, group, peer=src)
    dist.recv(tensor, src=src, group=group)
    return tensor


def isend(tensor: torch.Tensor, dst: int, group=None):
    _record("send", tensor, group, peer=dst)
    return dist.isend(tensor.contiguous(), dst=dst, group=group)


def irecv(tensor: torch.Tensor, src: int, group=None):
    _record("recv", tensor, group, peer=src)
    return dist.irecv(tensor, src=src, group=group)


def batch_isend_irecv(ops: list) -> list:
    """``dist.batch_isend_irecv`` on a list of ``dist.P2POp``; records each op. Returns the
    list of works to ``wait()`` on.

    Matching: several messages between the SAME PAIR of ranks are matched in order, not by
    tag (NCCL has no tags): the i-th send from rank a to rank b (counting every isend/send
    and batched op a issues to b in this group, in issue order) is received by the i-th
    receive that b posts from a. The receiver must therefore list its ``irecv`` ops from a
    given peer in the order that peer sends, each with the matching shape and dtype; a swapped
    pair of equal-sized messages is not an error, just wrong data. Messages between different
    pairs do not constrain each other.
    """
    for op in ops:
        kind = "send" if op.op in (dist.isend, getattr(dist, "send", None)) else "recv"
        _record(kind, op.tensor, op.group, peer=op.peer)
    return dist.batch_isend_irecv(ops)
