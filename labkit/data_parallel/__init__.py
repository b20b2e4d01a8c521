"""Data parallelism: the third axis of 3D parallelism.

* :mod:`.ddp`: :class:`DistributedDataParallel` (bucketed all-reduces started from gradient
  hooks while backward runs, broadcast at construction, ``no_sync()``), ``assign_buckets`` (the bucket rule);
* :mod:`.zero`: :class:`ZeroRedundancyOptimizer`, ZeRO stage 1 (reduce-scatter the gradients,
  each rank steps its 1/d of the optimizer state, all-gather the parameters).

All use the DP process group passed in (``ProcessGrid.dp_group``); all communication goes
through :mod:`labkit.comm` and is counted.
"""
from .ddp import DistributedDataParallel, assign_buckets, broadcast_parameters, overlap_share
from .fsdp import FullyShardedDataParallel, default_units, expected_fsdp, fully_shard
from .zero import ZeroRedundancyOptimizer, optimizer_state_bytes
from .zero2 import ZeroStage2, expected_zero2

__all__ = ["DistributedDataParallel", "broadcast_parameters", "assign_buckets", "overlap_share",
           "ZeroRedundancyOptimizer", "optimizer_state_bytes", "ZeroStage2", "expected_zero2",
           "FullyShardedDataParallel", "fully_shard", "default_units", "expected_fsdp"]
