"""What crosses a stage boundary: tensor metadata, the shape message, and RNG replay.

Before the first step the two sides of every boundary agree on the tensors that cross it
(:func:`exchange_metadata`): each stage runs once on zeros and sends, per output, its shape,
dtype and whether it requires grad. Only outputs that require grad get a gradient back, so an
integer mask, or the output of a frozen stage, travels forward only.

Recompute (GPipe's re-materialisation, Huang et al. 2019, sec. 2.3) replays the forward with
the RNG state it had (:func:`rng_state`, :class:`replay_rng`), so dropout draws the same masks.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import comm
from .schedules import ScheduleError

__all__ = ["TensorMeta", "DTYPES", "MAX_DIMS", "as_tuple", "nbytes", "rng_state", "replay_rng", "exchange_metadata"]

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.long, torch.int32, torch.bool,
           torch.int8, torch.uint8, torch.int16]
MAX_DIMS = 6


class TensorMeta(NamedTuple):
    """One tensor crossing a stage boundary: shape, dtype, and whether it carries a gradient."""

    shape: tuple
    dtype: torch.dtype
    requires_grad: bool


def as_tuple(value, what: str) -> tuple:
    """A stage's input or output as a tuple of tensors (a single tensor -> a 1-tuple)."""
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and value and all(isinstance(t, torch.Tensor) for t in value):
        return tuple(value)
    raise ScheduleError(f"{what} must be a tensor or a non-empty tuple of tensors, got "
                        f"{type(value).__name__}" + (f" of {[type(t).__name__ for t in value]}"
                                                     if isinstance(value, (tuple, list)) else ""))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rng_state(device: torch.device):
    """RNG state(s) that a stage forward on ``device`` draws from (CPU, plus CUDA on GPU)."""
    cpu = torch.get_rng_state()
    return (cpu, torch.cuda.get_rng_state(device)) if device.type == "cuda" else (cpu, None)


class replay_rng:
    """Run a block with the RNG state saved by :func:`rng_state`, then restore the current
    one: the recomputed forward draws the same dropout masks as the original."""

    def __init__(self, device, state):
        self.device, self.state = device, state

    def __enter__(self):
        self.saved = rng_state(self.device)
        torch.set_rng_state(self.state[0])
        if self.state[1] is not None:
            torch.cuda.set_rng_state(self.state[1], self.device)

    def __exit__(self, *exc):
        torch.set_rng_state(self.saved[0])
        if self.saved[1] is not None:
            torch.cuda.set_rng_state(self.saved[1], self.device)


def exchange_metadata(stages: dict, num_stages: int, rank_of, rank: int, peer, group, x_mb) -> dict:
    """Boundary metadata of every stage on this rank: ``{stage: (inputs, outputs)}``, each a
    tuple of :class:`TensorMeta`. ``stages``: stage index -> :class:`~.runtime.PipelineStage` of this
    rank; ``rank_of(stage)``: its pipeline rank; ``peer(stage)``: the global rank to talk to;
    ``x_mb``: stage 0's first microbatch (a tuple of tensors; None when not on this rank). Runs
    each stage once on zeros (autograd on, RNG restored, in
    stage order) and passes the output metadata down the pipeline: a count message, then
    9 int64 per tensor (ndim, 6 sizes, dtype, requires_grad). The receiver marks exactly
    the inputs whose sender output requires grad, so both sides agree which gradients
    travel back."""
    metas, prev_out = {}, None
    for s in sorted(stages):
        st = stages[s]
        if s == 0:
            ins = tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in x_mb)
        elif rank_of(s - 1) == rank:
            ins = prev_out
        else:
            count = torch.zeros(1, dtype=torch.long, device=st.device)
            comm.recv(count, peer(s - 1), group)
            block = torch.zeros(9 * int(count), dtype=torch.long, device=st.device)
            comm.recv(block, peer(s - 1), group)
            ins = tuple(TensorMeta(tuple(row[1:1 + row[0]]), DTYPES[row[7]], bool(row[8]))
                        for row in block.view(-1, 9).tolist())
        zeros = tuple(torch.zeros(m.shape, dtype=m.dtype, device=st.device).requires_grad_(m.requires_grad)
                      for m in ins)
        # autograd on (to learn which outputs require grad), the RNG left as it was
        with torch.enable_grad(), replay_rng(st.device, rng_state(st.device)):
            raw = st.submod(*zeros)
        outs = ()   # the last stage's output goes to loss_fn only: any type
        if s < num_stages - 1:
            outs = tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
                         for t in as_tuple(raw, f"the output of stage {s} (sent to stage {s + 1})"))
        del raw, zeros
        metas[s] = (ins, outs)
        prev_out = outs
        if s < num_stages - 1 and rank_of(s + 1) != rank:
            block = torch.zeros(len(outs), 9, dtype=torch.long, device=st.device)
            for i, m in enumerate(outs):
                if len(m.shape) > MAX_DIMS:
                    raise ScheduleError(f"stage {s} output {i} has {len(m.shape)} dims; at most {MAX_DIMS} "
                                        f"are supported")
                if m.dtype not in DTYPES:
                    raise ScheduleError(f"stage {s} output {i} has dtype {m.dtype}; supported: {DTYPES}")
                block[i, 0] = len(m.shape)
                block[i, 1:1 + len(m.shape)] = torch.tensor(m.shape, dtype=torch.long)
                block[i, 7], block[i, 8] = DTYPES.index(m.dtype), int(m.requires_grad)
            comm.send(torch.tensor([len(outs)], dtype=torch.long, device=st.device), peer(s + 1), group)
            comm.send(block.flatten(), peer(s + 1), group)
    return metas
