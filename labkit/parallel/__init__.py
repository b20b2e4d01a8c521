"""Composition of the axes: TP x PP x DP (3D parallelism), and EP folded onto DP for MoE.

The one place that builds a model on a :class:`labkit.grid.ProcessGrid` from the axes; it imports
:mod:`labkit.pipeline`, :mod:`labkit.tensor_parallel`, :mod:`labkit.data_parallel` and
:mod:`labkit.moe`, and none of them imports it.

* :mod:`.gpt`: :class:`ParallelGPT` (dense GPT, any t, p, d, any schedule, DDP or ZeRO-1, tied
  embeddings), :func:`check_layout`, :func:`layout`;
* :mod:`.moe`: :class:`ParallelMoEGPT` (attention TP over t, experts over EP = the DP group).
"""
from .gpt import SCHEDULES, ParallelGPT, check_layout, layout
from .moe import ParallelMoEGPT

__all__ = ["SCHEDULES", "ParallelGPT", "ParallelMoEGPT", "check_layout", "layout"]
