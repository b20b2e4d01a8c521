"""The same 3D-parallel GPT with PyTorch's own APIs only, composed in torchtitan's order.

:class:`labkit.parallel.ParallelGPT` writes every axis out (labkit's TP layers, pipeline runtime,
DDP/FSDP). This module builds the same model (the same single-device :class:`labkit.model.GPT`
weights, the same batches) from ``torch.distributed`` alone, in the order torchtitan applies
them (``torchtitan/models/llama3/infra/parallelize.py``, ``pipeline.py``):

1. **mesh**: ``init_device_mesh("cpu"|"cuda", (p, d, t), mesh_dim_names=("pp", "dp", "tp"))``,
   row-major, so rank = pp_rank * d t + dp_rank * t + tp_rank, labkit's grid order
   (:class:`labkit.grid.ProcessGrid`: TP innermost on neighbouring ranks, PP outermost). HSDP
   (``hsdp=R``): ``(pp, dp_replicate, dp_shard, tp)`` with R x d/R, and DDP (``zero=0``) the same
   mesh with R = d (a shard group of one rank: FSDP2 then only all-reduces, as torchtitan's
   ``dp_replicate``);
2. **pipeline split**: stage s of the p v stages holds blocks ``stage_layers(L, p v, s)`` (and the
   embedding on stage 0, the head on the last), on pipeline rank s % p (loop placement, what
   ``ScheduleInterleaved1F1B`` expects);
3. **TP (+ SP)**: ``parallelize_module`` over ``mesh["tp"]`` with the plan :func:`tp_plan`
   (a table: ``ColwiseParallel`` q, k, v and fc1; ``RowwiseParallel`` out_proj and fc2;
   ``PrepareModuleInput`` on attn and mlp so that q, k, v share one input gradient all-reduce, as
   Megatron's f; with SP ``SequenceParallel`` on the LayerNorms and the row-parallel outputs
   ``Shard(1)``); the head's output stays vocab-sharded and the loss runs under ``loss_parallel``
   (vocab-parallel cross-entropy);
4. **FSDP2**: ``fully_shard`` per embedding, block and head over the dp mesh (2-D for HSDP), then
   the stage root (torchtitan's units; ``reshard_after_forward`` True = ZeRO-3, False = ZeRO-2);
5. **schedule**: ``torch.distributed.pipelining`` ``PipelineStage`` per stage over
   ``mesh["pp"]`` and ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B``.

Gradients: the loss is the mean over every valid target of the step (targets of -100 left out, as
one device's ``F.cross_entropy``), as in labkit (:mod:`labkit.parallel.loss`): the last stage's
ranks count the step's valid targets before the first backward (one all-reduce of 8 bytes over
the d DP ranks, the "loss" axis), each microbatch's loss is the SUM of its valid token losses
times M d / N, the schedule divides the gradients by M (``scale_grads``) and FSDP2 averages them
over d, so they are the global token mean's whatever the shards hold. A step without a valid
target gives zero gradients and a warning; the reported loss is the step's (8 more bytes).

Refused (one line, :func:`check_torch_layout`): context parallelism (torch's ``context_parallel``
shards ``F.scaled_dot_product_attention``, which has no sharding rule for the CPU kernel: it does
not run on gloo CPU ranks, and labkit's GPT writes attention out); tied embeddings, MoE,
recompute, ZeRO-1 and the zero-bubble schedules (not composed here).

Counting torch's communication: :class:`TorchCommLog` (a ``TorchDispatchMode``) records every
``c10d`` and functional collective and every send and receive this rank issues inside it, as
:class:`labkit.comm.CommRecord` (payload convention of :mod:`labkit.comm`), so
:meth:`TorchNativeGPT.comm_by_axis` returns the same per-axis table as
:meth:`labkit.parallel.ParallelGPT.comm_by_axis`.
"""
from __future__ import annotations

import logging
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..comm import CommRecord, count_by_axis, wire_bytes_by_axis
from ..grid import Mesh
from ..model import GPT
from ..pipeline.stages import stage_layers
from .loss import StepTokenCount

__all__ = ["TORCH_SCHEDULES", "CP_REFUSAL", "check_torch_layout", "tp_plan", "plan_table", "build_mesh",
           "TorchNativeGPT", "TorchCommLog"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}

CP_REFUSAL = ("context parallelism is not available with --impl torch: torch's context_parallel shards "
              "F.scaled_dot_product_attention, which has no sharding rule for the CPU kernel (it does not run on "
              "gloo CPU ranks); use --impl labkit for --cp")


def check_torch_layout(cfg, tp: int, pp: int, dp: int, v: int = 1, n_microbatches: int = 1,
                       global_batch: int | None = None, schedule: str = "1f1b", zero: int = 3, hsdp: int = 1,
                       sequence_parallel: bool = False, seq_len: int | None = None, cp: int = 1,
                       recompute: str = "none", moe: bool = False) -> None:
    """Raise ValueError (one line naming the values and the rule) when the torch-native build cannot
    run this layout; no communication. labkit's rules (:func:`labkit.parallel.check_layout`) apply,
    and: cp = 1 (:data:`CP_REFUSAL`); schedule gpipe | 1f1b | interleaved (torch's classes in
    :data:`TORCH_SCHEDULES`); zero 0 (DDP as FSDP2 over a replicate mesh), 2 or 3 (FSDP2
    ``reshard_after_forward`` False / True); no tied embeddings, MoE or recompute; t divides the
    FFN width and the vocabulary; sequence parallelism needs t | S."""
    if cp != 1:
        raise ValueError(CP_REFUSAL)
    if schedule not in TORCH_SCHEDULES:
        raise ValueError(f"--impl torch runs the schedules {', '.join(TORCH_SCHEDULES)} (torch.distributed."
                         f"pipelining's {', '.join(TORCH_SCHEDULES.values())}); got {schedule!r}")
    if zero not in (0, 2, 3):
        raise ValueError(f"--impl torch: ZeRO-{zero} has no torch counterpart for DTensor parameters (torch's "
                         f"ZeroRedundancyOptimizer needs torch's DDP); use --zero 0 (DDP), 2 or 3 (FSDP2)")
    if getattr(cfg, "share_embeddings_and_output_weights", False):
        raise ValueError("--impl torch does not tie embeddings (the two copies' all-reduce over the embedding "
                         "group has no torch API); drop --tied or use --impl labkit")
    if moe:
        raise ValueError("--impl torch builds the dense GPT only; use --impl labkit for --moe")
    if recompute != "none":
        raise ValueError(f"--impl torch runs without recomputation; got --recompute {recompute}")
    from .gpt import check_layout
    check_layout(cfg, tp * pp * dp, tp, pp, dp, v, n_microbatches, global_batch, schedule, zero=zero,
                 sequence_parallel=sequence_parallel, seq_len=seq_len, hsdp=hsdp if zero == 3 else 1)


def tp_plan(sequence_parallel: bool = False, embedding: bool = True, n_blocks: int = 1, head: bool = True) -> dict:
    """The TP (+ SP) plan of a stage for ``parallelize_module``: ``{module name: ParallelStyle}``
    (torchtitan's table for its Llama; Megatron-LM sec. 3, Korthikanti et al. 2022 sec. 4.2.2).

    Per block: ``attn`` and ``mlp`` take their input through ``PrepareModuleInput`` (replicated;
    with SP all-gathered from ``Shard(1)``) and keep it a DTensor, so q, k and v (or fc1) add
    their input gradients before the one all-reduce (SP: reduce-scatter) of Megatron's f;
    q, k, v and fc1 ``ColwiseParallel`` (local output ``[b, S, n/t]``), out_proj and fc2
    ``RowwiseParallel`` (all-reduce: Megatron's g; SP: reduce-scatter to ``Shard(1)``); with SP
    the LayerNorms ``SequenceParallel`` (their weights replicated DTensors, gradients summed over
    TP). Embedding: the token table ``RowwiseParallel`` (vocab-parallel; SP: its output
    reduce-scattered to ``Shard(1)``, the position table's output a replicated DTensor added to it,
    the embedding's output a local ``[b, S/t, H]``). Head: ``lm_head`` ``ColwiseParallel`` with
    the logits left ``Shard(-1)`` (vocab-parallel, for ``loss_parallel``); SP: ``ln_f``
    ``SequenceParallel`` and the input all-gathered from ``Shard(1)``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )
    sp = bool(sequence_parallel)
    act = Shard(1) if sp else Replicate()    # the layout of the residual stream between the blocks
    plan = {}
    if embedding:
        plan["embedding.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act,
                                                use_local_output=not sp)
        if sp:
            plan["embedding.wpe"] = PrepareModuleOutput(output_layouts=Replicate(),
                                                        desired_output_layouts=Replicate(), use_local_output=False)
            plan["embedding"] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Shard(1),
                                                    use_local_output=True)
    for i in range(n_blocks):
        b = f"blocks.{i}"
        if sp:
            plan[f"{b}.ln1"] = SequenceParallel()
            plan[f"{b}.ln2"] = SequenceParallel()
        plan[f"{b}.attn"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"{b}.attn.{name}"] = ColwiseParallel()
        plan[f"{b}.attn.out_proj"] = RowwiseParallel(output_layouts=act)
        plan[f"{b}.mlp"] = PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),))
        plan[f"{b}.mlp.fc1"] = ColwiseParallel()
        plan[f"{b}.mlp.fc2"] = RowwiseParallel(output_layouts=act)
    if head:
        if sp:
            plan["head.ln_f"] = SequenceParallel()
        plan["head.lm_head"] = ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)
    return plan


def plan_table(sequence_parallel: bool = False) -> list[tuple[str, str, str]]:
    """:func:`tp_plan` of one block with the embedding and the head as rows ``(module, style, what
    it leaves)``: the table a learner reads (block index ``i``)."""
    rows = []
    for name, style in tp_plan(sequence_parallel).items():
        name = name.replace("blocks.0", "blocks.i")
        kind = type(style).__name__
        if kind == "SequenceParallel":
            out = style.sequence_sharding
        else:
            out = getattr(style, "output_layouts", None) or getattr(style, "desired_input_layouts", None)
        rows.append((name, kind, repr(out[0] if isinstance(out, tuple) else out)))
    return rows


def build_mesh(tp: int, pp: int, dp: int, zero: int = 3, hsdp: int = 1, device_type: str = "cpu"):
    """The DeviceMesh of the layout, labkit's grid order (PP outermost, TP innermost):
    ``(pp, dp, tp)``; with HSDP (``zero=3, hsdp=R>1``) or DDP (``zero=0``, R = d)
    ``(pp, dp_replicate, dp_shard, tp)``. Collective over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    R = dp if zero == 0 else hsdp
    if R > 1:
        return init_device_mesh(device_type, (pp, R, dp // R, tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class TorchNativeGPT:
    """This rank's part of the GPT parallelized with torch's APIs on ``mesh`` (:func:`build_mesh`).

    Args:
        reference: the single-device :class:`labkit.model.GPT` (same seed on every rank; not modified).
        mesh: the DeviceMesh ``(pp, dp, tp)`` or ``(pp, dp_replicate, dp_shard, tp)``.
        schedule: "gpipe" | "1f1b" | "interleaved" (``v`` stages per rank, loop placement).
        n_microbatches: M per step and DP rank.
        zero: 0 (FSDP2 over a replicate-only mesh: DDP), 2 or 3 (FSDP2 ``reshard_after_forward``
            False / True; HSDP with the 4-D mesh).
        sequence_parallel: the SP plan (t > 1).
        plan: a stage's plan override ``fn(stage) -> {name: ParallelStyle}`` (default :func:`tp_plan`).
        fsdp_units: override of the FSDP units ``fn(stage) -> [module names]`` ("" = the root;
            default: embedding, every block, head, then the root).

    :meth:`train_step` ``(x [B, S], y [B, S])``: forward and backward of the global batch (every rank
    passes the same; each DP rank takes its B/d rows and splits them into M microbatches); returns
    the step's loss (the mean over its valid targets, one device's number) on the last pipeline stage,
    else None. Raises ValueError as
    :func:`check_torch_layout` (call it first: no communication).
    """

    def __init__(self, reference: GPT, mesh, schedule: str = "1f1b", n_microbatches: int = 1, v: int = 1,
                 zero: int = 3, sequence_parallel: bool = False, plan=None, fsdp_units=None):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as torch_schedules
        from torch.distributed.tensor.parallel import parallelize_module

        warnings.filterwarnings("ignore", category=UserWarning)   # DTensor/FSDP2 warn on every step
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)   # 2-D full_tensor
        self.cfg, self.mesh, self.M, self.v, self.zero = reference.cfg, mesh, n_microbatches, v, zero
        names = mesh.mesh_dim_names
        self.t, self.p = mesh["tp"].size(), mesh["pp"].size()
        self.dp_dims = ("dp_replicate", "dp_shard") if "dp_shard" in names else ("dp",)
        self.d = 1
        for n in self.dp_dims:
            self.d *= mesh[n].size()
        self.pp_rank, self.tp_rank = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
        self.dp_rank = 0
        for n in self.dp_dims:
            self.dp_rank = self.dp_rank * mesh[n].size() + mesh[n].get_local_rank()
        self.sequence_parallel = bool(sequence_parallel) and self.t > 1
        n = self.p * v
        self.n_stages = n
        self.stage_ids = [s for s in range(n) if s % self.p == self.pp_rank]
        dp_mesh = mesh[self.dp_dims] if len(self.dp_dims) == 2 else mesh["dp"]
        self.modules: list[nn.Module] = []
        for s in self.stage_ids:
            stage = reference.slice(stage_layers(reference.cfg.n_layer, n, s), s == 0, s == n - 1)   # split
            if self.t > 1:                                                                              # TP (+SP)
                for block in stage.blocks:     # the module reshapes by its head counts: the local ones
                    block.attn.n_head //= self.t
                    block.attn.n_kv_head //= self.t
                table = plan(stage) if plan is not None else tp_plan(
                    self.sequence_parallel, stage.embedding is not None, len(stage.blocks), stage.head is not None)
                parallelize_module(stage, mesh["tp"], table)
            if self.d > 1:                                                                              # FSDP2
                units = fsdp_units(stage) if fsdp_units is not None else (
                    [u for u in ("embedding",) if stage.embedding is not None]
                    + [f"blocks.{i}" for i in range(len(stage.blocks))]
                    + [u for u in ("head",) if stage.head is not None] + [""])
                for u in units:
                    fully_shard(stage.get_submodule(u) if u else stage, mesh=dp_mesh,
                                reshard_after_forward=zero == 3)
            self.modules.append(stage)
        device = torch.device(mesh.device_type if mesh.device_type != "cuda" else f"cuda:{torch.cuda.current_device()}")
        pp_group = mesh["pp"].get_group()
        stages = [PipelineStage(m, s, n, device, group=pp_group) for m, s in zip(self.modules, self.stage_ids)]
        cls = getattr(torch_schedules, TORCH_SCHEDULES[schedule])
        self.schedule = cls(stages if schedule == "interleaved" else stages[0], n_microbatches, loss_fn=self._loss)
        self.optimizer = None
        self.last_loss_parallel = self.t > 1
        self.tokens = StepTokenCount(n_microbatches, self.d)      # the step's valid targets N
        self._count_group = self._dp_group() if self.d > 1 else None

    def _dp_group(self):
        """The process group of this rank's d DP ranks (HSDP's replicate x shard ranks flattened; every
        rank creates every group, in the same order)."""
        import torch.distributed as dist
        if len(self.dp_dims) == 1:
            return self.mesh["dp"].get_group()
        full, mine = self.mesh.mesh, None
        for pp in range(full.shape[0]):
            for tt in range(full.shape[-1]):
                ranks = [int(r) for r in full[pp, ..., tt].flatten().tolist()]
                g = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    mine = g
        return mine

    def _loss(self, logits, targets):
        """One microbatch's loss: the sum of its valid token losses times M d / N
        (:class:`labkit.parallel.loss.StepTokenCount`); logits ``[b, S, V]`` (under TP a DTensor sharded
        over the vocabulary: ``loss_parallel`` computes it without gathering the logits)."""
        return self.tokens.piece_loss(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def parameters(self) -> list:
        seen, out = set(), []
        for m in self.modules:
            for q in m.parameters():
                if id(q) not in seen:
                    seen.add(id(q))
                    out.append(q)
        return out

    def make_optimizer(self, name: str = "sgd", lr: float = 0.1, **kw):
        """``torch.optim.SGD`` or ``Adam`` over this rank's (DTensor) parameters (``foreach=False``:
        DTensor runs them parameter by parameter)."""
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]
        self.optimizer = cls(self.parameters(), lr=lr, foreach=False, **kw)
        return self.optimizer

    def zero_grad(self) -> None:
        for q in self.parameters():
            q.grad = None

    def train_step(self, x: torch.Tensor, y: torch.Tensor):
        """Forward and backward of the global batch ``x, y [B, S]`` (this DP rank's B/d rows, M
        microbatches); gradients reduce-scattered (FSDP2) or all-reduced (DDP mesh) in the last
        microbatch's backward. Returns the step's loss (the mean over its valid targets) on the last stage,
        else None."""
        from torch.distributed.tensor.parallel import loss_parallel
        B = x.shape[0]
        if B % (self.d * self.M):
            raise ValueError(f"global batch B={B} must be divisible by d*M = {self.d}*{self.M}")
        rows = Mesh(dp=self.d)
        x, y = rows.shard(x, "dp", self.dp_rank), rows.shard(y, "dp", self.dp_rank)
        dev = next(iter(self.parameters())).device
        x, y = x.to(dev), y.to(dev)
        losses: list = []
        first, last = 0 in self.stage_ids, self.has_last_stage
        if last:      # N: one all-reduce of this DP rank's count before the first backward
            self.tokens.count(y, self._count_group)
            if self.tokens.n == 0:
                warnings.warn("TorchNativeGPT.train_step: no valid target in this step (every target is -100): "
                              "the loss is 0 and its gradients are zero", RuntimeWarning, stacklevel=2)
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        with loss_parallel() if self.t > 1 else _null():
            self.schedule.step(*args, **kwargs)
        if losses:   # the step's token mean, the number one device reports
            mine = torch.tensor(sum(float(_full(v.detach())) for v in losses) / (self.M * self.d), dtype=torch.float64,
                                device=dev)
            if self._count_group is not None:
                import torch.distributed as dist
                dist.all_reduce(mine, group=self._count_group)
            return float(mine)
        return None

    # ---------------------------------------------------------------- inspection

    @torch.no_grad()
    def full_tensors(self, what: str = "grad") -> list[tuple[str, torch.Tensor]]:
        """``[(reference name, full tensor)]`` of this rank's stages' parameters (``what``: "grad" or
        "param"): each DTensor's ``full_tensor()`` (collective over its mesh: every rank of this
        pipeline rank calls it in the same order). A missing gradient is zeros."""
        out = []
        for m in self.modules:
            for name, q in m.named_parameters():
                t = q if what == "param" else q.grad
                full = torch.zeros(q.shape, dtype=q.dtype) if t is None else _full(t.detach())
                out.append((m.reference_name(name), full.cpu().clone()))
        return out

    def memory(self) -> dict:
        """Bytes held on this rank: ``params`` (local shards), ``grads`` (their ``.grad``), ``optimizer``
        (per-element state of the optimizer's local tensors)."""
        ps = self.parameters()
        opt = 0
        if self.optimizer is not None:
            for st in self.optimizer.state.values():
                for v in st.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        v = _local(v)
                        opt += v.numel() * v.element_size()
        return {"params": sum(_local(q).numel() * q.element_size() for q in ps),
                "grads": sum(_local(q.grad).numel() * q.element_size() for q in ps if q.grad is not None),
                "optimizer": opt}

    def axis_ranks(self) -> dict:
        """``{axis: set of global ranks}`` of this rank's groups: tp, pp, dp (and dp_shard,
        dp_replicate with the 4-D mesh)."""
        out = {}
        for name in ("tp", "pp") + self.dp_dims:
            out[name] = frozenset(int(r) for r in _group_ranks(self.mesh[name]))
        if len(self.dp_dims) == 2:
            out["dp"] = frozenset(int(r) for r in self.mesh[self.dp_dims].mesh.flatten().tolist())
        return out

    def axis_of(self, rec: CommRecord) -> str:
        """Which axis a record belongs to (labkit's names): tp, pp, dp (HSDP's shard and replicate
        groups too) or other."""
        ranks = frozenset(rec.ranks or ())
        ax = self.axis_ranks()
        if rec.kind in ("send", "recv"):
            return "pp"
        if rec.kind == "all_reduce" and tuple(rec.shape) == () and len(ranks) > 1 and ranks == ax["dp"]:
            return "loss"     # the step's valid-target count and its reported loss (0-d)
        if self.t > 1 and ranks == ax["tp"]:
            return "tp"
        if ranks and (ranks == ax["dp"] or any(ranks == ax.get(n) for n in self.dp_dims)) and len(ranks) > 1:
            return "dp"
        return "other"

    def comm_by_axis(self, records) -> dict:
        """``{axis: {kind: (count, bytes)}}`` of :class:`TorchCommLog` records (this rank's;
        :func:`labkit.comm.count_by_axis`)."""
        return count_by_axis(records, self.axis_of)

    def wire_by_axis(self, records) -> dict:
        """``{axis: bytes}`` this rank sends under the ring algorithms (:func:`labkit.comm.wire_bytes_by_axis`)."""
        return wire_bytes_by_axis(records, self.axis_of)


def _group_ranks(submesh) -> list:
    import torch.distributed as dist
    return dist.get_process_group_ranks(submesh.get_group())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# c10d (eager ProcessGroup) and functional (DTensor) collectives -> labkit's kind and which argument
# holds this rank's payload (labkit.comm's convention: all-reduce the tensor, all-gather the local
# input, reduce-scatter the full input, send/recv the tensor)
_KINDS = {
    "c10d.allreduce_": ("all_reduce", 0), "_c10d_functional.all_reduce": ("all_reduce", 0),
    "_c10d_functional.all_reduce_": ("all_reduce", 0),
    "c10d._allgather_base_": ("all_gather", 1), "c10d.allgather_": ("all_gather", 1),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 1),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1), "c10d.reduce_scatter_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "c10d.send": ("send", 0), "c10d.recv_": ("recv", 0),
    "c10d.broadcast_": ("broadcast", 0), "_c10d_functional.broadcast": ("broadcast", 0),
    "c10d.scatter_": ("scatter", 1), "c10d.alltoall_base_": ("all_to_all", 1),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for t in x:
            f = _first_tensor(t)
            if f is not None:
                return f
    return None


def _ranks_of(args) -> tuple:
    """The global ranks of the process group among a collective's arguments (a ProcessGroup object,
    or a functional collective's group name)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    for a in args:
        pg = None
        if isinstance(a, str):
            try:
                pg = _resolve_process_group(a)
            except Exception:
                continue
        elif isinstance(a, torch.ScriptObject) or type(a).__name__ == "ProcessGroup":
            try:
                pg = dist.ProcessGroup.unbox(a) if isinstance(a, torch.ScriptObject) else a
            except Exception:
                continue
        if pg is not None:
            return tuple(dist.get_process_group_ranks(pg))
    return ()


def _dtensor_class():
    from torch.distributed.tensor import DTensor
    return DTensor


class TorchCommLog(TorchDispatchMode):
    """Records every collective and send/receive torch issues on this rank while active (FSDP2's
    eager c10d calls, DTensor's functional collectives, the pipelining schedule's P2P), as
    :class:`labkit.comm.CommRecord` in ``records``: kind, group size, payload bytes (labkit.comm's
    convention), shape, dtype, the group's global ranks. Use as ``with TorchCommLog() as log: ...``."""

    def __init__(self):
        super().__init__()
        self.records: list[CommRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is _dtensor_class() for t in types):
            return NotImplemented     # let DTensor run first: the collectives it issues come back here
        key = f"{func.namespace}.{func._opname}"
        if key in _KINDS:
            kind, i = _KINDS[key]
            payload = args[i] if i < len(args) else None
            t = _first_tensor(payload)
            ranks = _ranks_of(list(args) + list(kwargs.values()))
            if t is not None:
                self.records.append(CommRecord(kind, len(ranks), _nbytes(payload), tuple(t.shape),
                                               str(t.dtype).replace("torch.", ""), None, ranks))
        return func(*args, **kwargs)
