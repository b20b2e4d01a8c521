"""Composition of the axes: TP x PP x DP (3D parallelism), and EP folded onto DP for MoE.

The one place that builds a model on a :class:`labkit.grid.ProcessGrid` from the axes; it imports
:mod:`labkit.pipeline`, :mod:`labkit.tensor_parallel`, :mod:`labkit.data_parallel` and
:mod:`labkit.moe`, and none of them imports it.

* :mod:`.gpt`: :class:`ParallelGPT` (dense GPT, any t, p, d, any schedule, DDP or ZeRO-1, tied
  embeddings, sequence parallelism, recompute none | selective | full), :func:`check_layout`,
  :func:`layout`; each stage: slice -> parallelize -> data-parallel wrapper -> pipeline stage;
* :mod:`.moe`: :class:`ParallelMoEGPT` (attention TP over t, experts over EP = the DP group);
* :mod:`.moe_pipeline`: the MoE GPT cut into pipeline stages (MoE x PP);
* :mod:`.expert_slicing`: expert slicing with tensor-parallel non-expert layers (DeepSpeed-MoE);
* :mod:`.torch_native`: the same dense 3D GPT with PyTorch's own APIs only (DeviceMesh, parallelize_module,
  FSDP2, torch.distributed.pipelining; ``lab 3d --impl torch|both``, notebook 17), imported on demand.
* :mod:`.loss`: the loss of a step with ignored targets, the mean over every valid target of the
  step on every axis (the count, one all-reduce before the backward; what each microbatch hands
  the runtime), used by :class:`ParallelGPT`, :class:`ParallelMoEGPT` and the torch-native GPT.
"""
from .gpt import SCHEDULES, ParallelGPT, check_layout, layout
from .moe import ParallelMoEGPT

__all__ = ["SCHEDULES", "ParallelGPT", "ParallelMoEGPT", "check_layout", "layout"]
