"""MoE GPT with attention split over t and experts spread over the DP axis (EP = DP).

DeepSpeed-MoE (Rajbhandari et al. 2022, sec. 5.2: "expert slicing + tensor slicing, data
parallelism on top") and Megatron-Core's "parallel folding" (Liu et al. 2025): the E experts
of every MoE layer are sharded over the d ranks of the DP group (rank r holds experts
r*E/d .. (r+1)*E/d - 1), which also trains on d different slices of the batch; tokens reach
their expert by all-to-all over that group (:class:`labkit.moe.expert_parallel.ExpertParallelMoE`).
Attention, embedding and head are Megatron's TP layers over the TP group; the MoE layer's input
is replicated over TP, so the t ranks of a TP group hold the same experts and compute the same
thing (as for a LayerNorm).

Gradients: the replicated parameters (attention shards, LayerNorms, router, embedding, head) are
averaged over the DP group by :class:`labkit.data_parallel.DistributedDataParallel`; the experts
are NOT all-reduced (each DP rank holds different ones): their gradient already sums every
rank's tokens through the backward all-to-all, and DDP only scales it by 1/d (``expert_params``).

The single-device reference is :class:`labkit.moe.MoEGPT` whose MoE layers route the global batch
in ``token_groups = d * M`` groups: one GShard group per microbatch of each DP rank, the tokens
that one rank routes together here. No pipeline (p = 1).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from .. import comm
from ..data_parallel import DistributedDataParallel
from ..moe.expert_parallel import expert_param_names
from ..tensor_parallel import gpt_plan, parallelize
from ..tensor_parallel.mappings import all_gather_along_dim
from .gpt import check_layout
from .loss import StepTokenCount
from .moe_pipeline import moe_block_rule, split_moe_gpt

__all__ = ["ParallelMoEGPT"]


class ParallelMoEGPT:
    """This rank's part of an :class:`labkit.moe.MoEGPT` on a grid (t, p=1, d), EP = DP: the model as
    one stage (:func:`labkit.parallel.moe_pipeline.split_moe_gpt`) parallelized with the MoE block
    rule (:func:`labkit.tensor_parallel.parallelize`), like :class:`labkit.parallel.ParallelGPT`'s stages.

    ``train_step(x [B, S], y [B, S])``: this DP rank's slice in M microbatches (gradient
    accumulation under ``no_sync`` but the last); the loss of a microbatch is its LM loss (the sum
    of its valid token losses times M d / N, N the step's valid targets counted over DP before the
    first backward: :mod:`labkit.parallel.loss`) plus the MoE balance losses (per token group,
    :mod:`labkit.moe.losses`), scaled by 1/M. Returns the step's token loss (the number one device
    reports; 0.0 with a RuntimeWarning when no target is valid) plus this DP rank's balance losses
    averaged over its M microbatches. Raises ValueError
    (no communication) for p != 1, E not divisible by d, or the rules of
    :func:`labkit.parallel.check_layout`.
    """

    def __init__(self, reference: nn.Module, grid, n_microbatches: int = 1, bucket_cap_mb: float = 25.0):
        E = reference.moe_cfg.n_routed_experts
        if grid.pp != 1:
            raise ValueError(f"the MoE composition runs without a pipeline: p must be 1, got p={grid.pp}")
        if getattr(grid, "ep", grid.dp) != grid.dp:
            raise ValueError(f"ParallelMoEGPT shards the experts over the whole DP group: build the grid with "
                             f"ep = dp = {grid.dp}, got ep={grid.ep}")
        check_layout(reference.cfg, grid.ctx.world_size, grid.tp, 1, grid.dp, 1, n_microbatches, n_experts=E)
        if reference.moe_cfg.token_groups != grid.dp * n_microbatches:
            raise ValueError(f"the reference must route in token_groups = d*M = {grid.dp * n_microbatches} groups "
                             f"(one per microbatch and DP rank), got {reference.moe_cfg.token_groups}")
        self.grid, self.M, self.E = grid, n_microbatches, E
        # slice (the whole model, one stage whose MoE layers attach their balance losses, scaled 1/M)
        # -> parallelize (TP attention, embedding and head; experts over EP)
        tpg = grid.tp_group if grid.tp > 1 else None
        plan = gpt_plan() if tpg else {}
        plan = {**plan, "blocks.*": moe_block_rule(grid.ep_group, grid.ep_rank, grid.ep, plan.get("blocks.*"))}
        (stage,) = split_moe_gpt(reference, 1, n_microbatches)
        self.model = parallelize(stage, tpg, plan).to(grid.ctx.device)
        self.experts = expert_param_names(self.model)
        self.ddp = DistributedDataParallel(self.model, grid.dp_group, bucket_cap_mb, expert_params=self.experts) \
            if grid.dp > 1 else None
        self.loss_fn = self.model.head.loss
        self.tokens = StepTokenCount(n_microbatches, grid.dp)
        self.optimizer = None

    def make_optimizer(self, name: str = "sgd", lr: float = 0.1, **kw):
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]
        self.optimizer = cls(self.model.parameters(), lr=lr, **kw)
        return self.optimizer

    def zero_grad(self) -> None:
        for q in self.model.parameters():
            q.grad = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        B, d, M = x.shape[0], self.grid.dp, self.M
        if B % (d * M):
            raise ValueError(f"global batch B={B} must be divisible by d*M = {d}*{M}")
        dev = self.grid.ctx.device
        xs = self.grid.shard(x, "dp").to(dev).chunk(M)             # this DP rank's B/d sequences
        ys = self.grid.shard(y, "dp").to(dev).chunk(M)
        run = self.ddp if self.ddp is not None else self.model
        # the step's valid targets N: one all-reduce of 8 bytes before the first backward (labkit.parallel.loss)
        self.tokens.count(torch.cat(ys), self.grid.dp_group if d > 1 else None)
        if self.tokens.n == 0:
            warnings.warn("ParallelMoEGPT.train_step: no valid target in this step (every target is -100): the "
                          "token loss is 0 and its gradients are zero", RuntimeWarning, stacklevel=2)
        total = 0.0
        for m in range(M):
            sync = m == M - 1 or self.ddp is None
            with (torch.enable_grad() if sync else self.ddp.no_sync()):
                # the sum of the valid token losses times M d / N; the balance losses ride on the activations
                loss = self.tokens.piece_loss(self.loss_fn(run(xs[m]), ys[m], reduction="sum"))
                (loss / M).backward()
            total += float(loss)
        mine = torch.tensor(total / (M * d), dtype=torch.float64, device=dev)   # the step's token mean: 8 more bytes
        if d > 1:
            comm.all_reduce(mine, self.grid.dp_group)
        aux, self.model.aux_values[:] = sum(self.model.aux_values), []   # of this step's M forwards
        return float(mine) + aux / M

    @torch.no_grad()
    def gather_full(self, what: str = "grad") -> dict:
        """``{reference name: tensor}``: TP shards all-gathered over TP (collective); this DP
        rank's experts under their global ids (``blocks.i.moe.experts.<global>.…``)."""
        out = {}
        for name, q in self.model.named_parameters():
            t = q.grad if what == "grad" else q.detach()
            if t is None:
                out[name] = None
                continue
            if getattr(q, "tensor_model_parallel", False) and self.grid.tp > 1:
                t = all_gather_along_dim(t, q.partition_dim, self.grid.tp_group)
            if name in self.experts:
                pre, rest = name.split(".experts.", 1)
                j, tail = rest.split(".", 1)
                layer = self.model.get_submodule(pre)
                name = f"{pre}.experts.{layer.expert_offset + int(j)}.{tail}"
            out[name] = t.detach().cpu().clone()
        return out
