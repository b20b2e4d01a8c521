"""Activation checkpointing (re-materialisation): keep only a segment's input in forward,
recompute the segment in backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": a chain of n layers
normally saves every layer's activations, O(n) memory. Cutting it into k segments and
keeping only the k segment inputs needs O(k) memory in forward plus O(n/k) while one
segment is recomputed in backward; k = sqrt(n) gives O(sqrt n) memory for the price of one
extra forward pass (sec. 3, "Algorithm 1", and sec. 4.1 for the sqrt(n) choice).

:func:`checkpoint` is written here as its own autograd Function (``torch.utils.checkpoint``
is the reference it is compared with, not what it uses). Three details matter:

1. RNG: the recomputed forward must draw the same dropout masks as the first one, so
   the RNG state is saved before the forward and restored for the recomputation (CPU, and
   CUDA only when an input lives on a GPU: CPU runs make no ``torch.cuda`` call).
   ``preserve_rng_state=False`` shows the pitfall: gradients then differ.
2. Parameters: ``Function.apply`` only records a backward when some *input* requires grad;
   a dummy input that requires grad guarantees it, so parameters inside ``function`` get
   gradients even when no real input does (e.g. the first segment after the embedding).
3. Restoring the RNG for the recomputation must not disturb the RNG stream of the rest of
   training: the recomputation runs inside ``torch.random.fork_rng``.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Sequence

import torch
import torch.nn as nn

__all__ = ["checkpoint", "checkpoint_sequential", "recomputing", "SavedTensorMeter", "memory_table",
           "format_memory_table"]

_RECOMPUTING = threading.local()


def recomputing() -> bool:
    """True while a :func:`checkpoint`'s backward re-runs its function (the re-materialisation):
    code with side effects per forward (counters, statistics) can skip them then."""
    return getattr(_RECOMPUTING, "depth", 0) > 0


def _cuda_devices(tensors) -> list:
    return sorted({t.device.index if t.device.index is not None else 0 for t in tensors if t.is_cuda})


class CheckpointFunction(torch.autograd.Function):
    """forward: run ``function`` without saving activations; backward: rerun it with grad
    enabled (RNG restored) and backpropagate through the recomputed graph."""

    @staticmethod
    def forward(ctx, function, preserve_rng_state, _dummy, *args):
        ctx.function, ctx.preserve_rng_state = function, preserve_rng_state
        tensors = [a for a in args if torch.is_tensor(a)]
        ctx.cuda_devices = _cuda_devices(tensors)
        if preserve_rng_state:
            ctx.cpu_rng_state = torch.get_rng_state()
            if ctx.cuda_devices:  # only when a GPU is in use: CPU runs make no CUDA call
                ctx.cuda_rng_states = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        ctx.tensor_index = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        ctx.save_for_backward(*tensors)  # only the segment's inputs are kept
        with torch.no_grad():
            outputs = function(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        args = list(ctx.others)
        saved = ctx.saved_tensors
        inputs = []
        for i, t in zip(ctx.tensor_index, saved):
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            args[i] = d
            inputs.append(d)
        with torch.random.fork_rng(devices=ctx.cuda_devices, enabled=True):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng_state)
                for d, s in zip(ctx.cuda_devices, getattr(ctx, "cuda_rng_states", [])):
                    torch.cuda.set_rng_state(s, d)
            _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1
            try:
                with torch.enable_grad():
                    outputs = ctx.function(*args)      # the re-materialisation
            finally:
                _RECOMPUTING.depth -= 1
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(d.grad if d.requires_grad else None for d in inputs)
        out = [None] * len(args)
        for i, g in zip(ctx.tensor_index, grads):
            out[i] = g
        return (None, None, None, *out)


def checkpoint(function: Callable, *args, preserve_rng_state: bool = True):
    """Run ``function(*args)`` saving only ``args`` for backward; recompute in backward.

    Args:
        function: any callable of tensors (e.g. an ``nn.Module`` or a segment of layers)
            returning a tensor or a tuple of tensors.
        *args: its inputs (tensors and other values).
        preserve_rng_state: restore the RNG state (CPU; CUDA when an input is on a GPU)
            before recomputing, so dropout draws the same masks. False only to show
            what goes wrong without it.

    Returns what ``function`` returns. Memory: only the tensor ``args`` are saved (bytes =
    their size) instead of every intermediate activation; cost: one extra forward of
    ``function`` during backward. Source: Chen et al. 2016, sec. 3.
    """
    dummy = torch.empty(0, requires_grad=True)  # makes apply() record a backward node
    return CheckpointFunction.apply(function, preserve_rng_state, dummy, *args)


def _run_segment(layers):
    def run(x):
        for layer in layers:
            x = layer(x)
        return x
    return run


def checkpoint_sequential(layers: Sequence[nn.Module], segments: int | None = None, x: torch.Tensor = None,
                          preserve_rng_state: bool = True) -> torch.Tensor:
    """Run ``layers`` in order on ``x``, cut into ``segments`` checkpointed segments.

    ``segments`` k defaults to ``round(sqrt(n))`` for n layers (Chen et al. 2016, sec. 4.1):
    about k + n/k activations alive at the peak instead of n. Every segment (the last one
    too) is checkpointed, so k = 1 keeps only the input and recomputes everything.
    Segments get ``ceil``/``floor`` of n/k layers. Raises ValueError unless 1 <= k <= n.
    """
    layers = list(layers)
    n = len(layers)
    if x is None:
        raise ValueError("checkpoint_sequential needs an input x")
    if n == 0:
        return x
    k = max(1, round(math.sqrt(n))) if segments is None else segments
    if not 1 <= k <= n:
        raise ValueError(f"segments must be between 1 and the number of layers n={n}, got {k}")
    bounds = [round(i * n / k) for i in range(k + 1)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        x = checkpoint(_run_segment(layers[a:b]), x, preserve_rng_state=preserve_rng_state)
    return x


# ---------------------------------------------------------------------------- measuring memory


class _Saved:
    """What the pack hook hands to autograd; its destruction tells the meter the saved
    tensor was released (autograd drops saved tensors once their node ran backward, or with
    the node when a graph kept by ``retain_graph=True`` is dropped). It holds a detached view
    (same storage): the tensor itself would carry its ``grad_fn``, and a saved *output*
    (softmax's, exp's) would then point back at its own node, a cycle through C++ that gc never
    collects (the split backward's I, which retains the graph, would leak those bytes)."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorMeter:
    """Live and peak bytes of tensors saved for backward, via
    ``torch.autograd.graph.saved_tensors_hooks`` (works on CPU).

    Tensors sharing storage are counted once; tensors in ``exclude`` (e.g. the model's
    parameters, which are not activations) are not counted. Use as a context manager around
    forward AND backward; ``peak`` (bytes) and ``live`` afterwards.
    """

    def __init__(self, exclude: Sequence[torch.Tensor] = ()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict = {}
        self.live = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or t.numel() == 0:
            return _Saved(t.detach(), None, self)
        if key in self.refs:
            self.refs[key][0] += 1
        else:
            self.refs[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return _Saved(t.detach(), key, self)

    @staticmethod
    def _unpack(s: "_Saved") -> torch.Tensor:
        return s.tensor

    def _release(self, key) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _CountingLayer(nn.Module):
    """Linear + GeLU that counts its forward calls (a stand-in for one transformer layer)."""

    def __init__(self, width: int, counter: list):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.counter = counter

    def forward(self, x):
        self.counter[0] += 1
        return torch.nn.functional.gelu(self.fc(x))


STRATEGIES = ("none", "every layer", "sqrt(n) segments", "one segment")


def _measure(n: int, strategy: str, width: int, batch: int, device: str) -> dict:
    counter = [0]
    torch.manual_seed(0)
    layers = nn.ModuleList([_CountingLayer(width, counter) for _ in range(n)]).to(device)
    x = torch.randn(batch, width, device=device)
    params = list(layers.parameters())
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with SavedTensorMeter(exclude=params) as meter:
        if strategy == "none":
            y = _run_segment(layers)(x)
        else:
            k = {"every layer": n, "sqrt(n) segments": max(1, round(math.sqrt(n))), "one segment": 1}[strategy]
            y = checkpoint_sequential(layers, k, x)
        forwards = counter[0]
        after_forward = meter.live
        y.sum().backward()
    row = {"n": n, "strategy": strategy, "saved_peak_bytes": meter.peak, "saved_after_forward_bytes": after_forward,
           "extra_forward_layers": counter[0] - forwards, "extra_forward_passes": (counter[0] - forwards) / n}
    if cuda:
        torch.cuda.synchronize()
        row["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return row


def memory_table(ns: Sequence[int] = (4, 16, 64), width: int = 256, batch: int = 64,
                 device: str | None = None) -> list:
    """Measure a stack of n Linear+GeLU layers under each checkpointing strategy.

    Returns a list of rows ``{"n", "strategy", "saved_peak_bytes", "saved_after_forward_bytes",
    "extra_forward_layers",
    "extra_forward_passes"}`` (plus ``"cuda_peak_bytes"`` from
    ``torch.cuda.max_memory_allocated`` when ``device`` is a CUDA device; ``device=None``
    picks "cuda" when CUDA is present, else "cpu"). Saved bytes are
    the peak of tensors alive in autograd's saved-tensor slots, counted with
    ``saved_tensors_hooks`` (parameters excluded); extra forwards are layer forward calls
    beyond the first n (``extra_forward_passes`` = that / n).

    Expected growth (Chen et al. 2016): none and every layer O(n) (every layer with a
    smaller constant: one input per layer), sqrt(n) segments O(sqrt n) with one extra
    forward pass, one segment O(n) at backward time (everything is recomputed at once).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return [_measure(n, s, width, batch, str(device)) for n in ns for s in STRATEGIES]


def format_memory_table(rows: list) -> str:
    """The rows of :func:`memory_table` as an aligned text table (KiB, extra forwards)."""
    cuda = any("cuda_peak_bytes" in r for r in rows)
    lines = [f"{'n':>4}  {'strategy':<18} {'after fwd KiB':>13} {'saved peak KiB':>14}  {'extra fwd passes':>16}"
             + (f"  {'CUDA peak KiB':>13}" if cuda else "")]
    for r in rows:
        lines.append(f"{r['n']:>4}  {r['strategy']:<18} {r['saved_after_forward_bytes'] / 1024:>13.0f} "
                     f"{r['saved_peak_bytes'] / 1024:>14.0f}  "
                     f"{r['extra_forward_passes']:>16.2f}"
                     + (f"  {r.get('cuda_peak_bytes', 0) / 1024:>13.0f}" if cuda else ""))
    return "\n".join(lines)


if __name__ == "__main__":  # python -m labkit.checkpoint: print the table
    print(format_memory_table(memory_table()))
