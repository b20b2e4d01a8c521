"""What the planner plans for: a model (:class:`ModelSpec`), a layout (:class:`Layout`), a
cluster (:class:`Cluster`), and the published models as presets.

Parameter counts are exact for labkit's GPT (:class:`labkit.model.GPT`: pre-LN, learned
positions, biases, GeLU MLP, untied output layer) and follow the published architectures
otherwise: SwiGLU MLPs (three matrices), RMSNorm (one vector), rotary positions (no table),
grouped-query attention, Mixture-of-Experts layers (E routed experts of width ``moe_ffn``,
``n_shared_experts``, a router ``E x h``), DeepSeek-V3's multi-head latent attention (MLA,
low-rank q and kv projections) and its first dense layers.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from dataclasses import replace as dataclasses_replace

from ..pipeline.registry import names

__all__ = ["ModelSpec", "Layout", "Cluster", "PRESETS", "PUBLISHED", "CLUSTERS", "preset", "load_model_json",
           "SCHEDULES", "PRECISIONS", "LLAMA3_405B_ASSUMED", "llama3_405b_layouts"]

SCHEDULES = names(runs=None, planned=True)   # gpipe 1f1b interleaved dualpipe (labkit.pipeline.registry)
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. Symbols: L layers, h hidden, a heads, a_kv key/value heads,
    f FFN width, V vocabulary, s sequence length (tokens per sample).

    ``norm``: "layernorm" (weight + bias) | "rmsnorm" (weight); ``mlp``: "gelu" (2 matrices,
    labkit and GPT) | "swiglu" (3); ``position``: "learned" (a ``max_position x h`` table) |
    "rope" | "alibi" (no table); ``bias``: biases on every linear layer except the output layer (GPT-2 style);
    ``tied_embeddings``: the output layer reuses the input embedding. MoE: ``n_routed_experts``
    E (0: dense), ``n_activated_experts`` k, ``n_shared_experts``, ``moe_ffn`` (each expert's
    width), ``first_dense_layers`` (DeepSeek: the first layers keep a dense MLP of width f),
    ``moe_layer_freq`` (Megatron-Core's: layer i is MoE when ``i % freq == freq - 1``; 2 is
    GShard's "every other FFN layer", labkit's ``MoEGPT`` default).
    MLA (DeepSeek-V2/V3): ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim`` (0: ordinary attention). ``router_bias``: DeepSeek-V3's
    aux-loss-free routing bias (a buffer of E numbers per MoE layer, counted as a parameter, as
    the released checkpoint stores it); ``n_mtp_modules``: DeepSeek-V3's multi-token-prediction
    modules (sec. 2.2; counted only by :func:`~.params.count_parameters` with ``include_mtp``).
    ``dropout`` (probability; > 0: the masks are kept for backward).
    ``global_batch`` (sequences per step) is what the published run used; the planner needs it
    for the number of microbatches.
    """

    name: str
    n_layer: int
    hidden: int
    n_head: int
    vocab_size: int
    seq_len: int
    n_kv_head: int | None = None
    ffn: int | None = None
    norm: str = "layernorm"
    mlp: str = "gelu"
    position: str = "learned"
    max_position: int | None = None
    bias: bool = True
    tied_embeddings: bool = False
    n_routed_experts: int = 0
    n_activated_experts: int = 0
    n_shared_experts: int = 0
    moe_ffn: int | None = None
    first_dense_layers: int = 0
    moe_layer_freq: int = 1
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_bias: bool = False
    n_mtp_modules: int = 0
    dropout: float = 0.1
    global_batch: int = 1
    source: str = ""

    def __post_init__(self):
        for n in ("n_layer", "hidden", "n_head", "vocab_size", "seq_len", "global_batch", "moe_layer_freq"):
            if getattr(self, n) < 1:
                raise ValueError(f"model {self.name!r}: {n} must be >= 1, got {getattr(self, n)}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model {self.name!r}: norm must be 'layernorm' or 'rmsnorm', got {self.norm!r}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"model {self.name!r}: mlp must be 'gelu' or 'swiglu', got {self.mlp!r}")
        if self.position not in ("learned", "rope", "alibi"):
            raise ValueError(f"model {self.name!r}: position must be 'learned', 'rope' or 'alibi', "
                             f"got {self.position!r}")
        if not self.is_mla and self.hidden % self.n_head:
            raise ValueError(f"model {self.name!r}: hidden={self.hidden} must be divisible by n_head={self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"model {self.name!r}: n_head={self.n_head} must be divisible by "
                             f"n_kv_head={self.kv_heads}")
        if self.n_routed_experts and not 1 <= self.n_activated_experts <= self.n_routed_experts:
            raise ValueError(f"model {self.name!r}: need 1 <= n_activated_experts <= n_routed_experts="
                             f"{self.n_routed_experts}, got {self.n_activated_experts}")

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_head

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def is_moe(self) -> bool:
        return self.n_routed_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` (0-based) has an MoE MLP."""
        f = self.moe_layer_freq
        return self.is_moe and i >= self.first_dense_layers and i % f == f - 1

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layer))

    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def mlp_params(self, width: int) -> tuple[int, int]:
        """(split by t, replicated) parameters of one MLP of ``width``: matrices and their biases
        are column/row split; the row-parallel (output) bias is replicated."""
        h, nmat = self.hidden, (2 if self.mlp == "gelu" else 3)
        split = nmat * h * width + (width * (nmat - 1) if self.bias else 0)
        return split, (h if self.bias else 0)

    def attention_params(self) -> tuple[int, int]:
        """(split by t, replicated) parameters of one attention block.

        Ordinary / GQA: q, k, v column-parallel (weights and biases), output row-parallel
        (weight split, bias replicated). MLA: every projection counted as split by t (the
        low-rank down-projections and their norms are small; Megatron replicates them), the
        two low-rank norms replicated."""
        h, a = self.hidden, self.n_head
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (h * self.q_lora_rank + self.q_lora_rank * a * qk) if self.q_lora_rank else h * a * qk
            kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * a * (
                self.qk_nope_head_dim + self.v_head_dim)
            o = a * self.v_head_dim * h
            return q + kv + o, self.q_lora_rank + self.kv_lora_rank
        d, akv = self.head_dim, self.kv_heads
        qkv = h * (a + 2 * akv) * d + ((a + 2 * akv) * d if self.bias else 0)
        return qkv + a * d * h, (h if self.bias else 0)

    def layer_params(self, moe: bool) -> dict:
        """Parameters of one layer: ``{"split": n, "replicated": n, "expert": n_per_expert,
        "experts": E, "active_expert": k + shared}`` (experts are counted separately: they are
        split over the expert-parallel ranks)."""
        a_split, a_rep = self.attention_params()
        rep = a_rep + 2 * self.norm_params()
        if moe:
            e_split, e_rep = self.mlp_params(self.moe_ffn or self.ffn_hidden)
            shared = self.n_shared_experts
            router = self.n_routed_experts * (self.hidden + (1 if self.router_bias else 0))
            return {"split": a_split + shared * e_split, "replicated": rep + shared * e_rep + router,
                    "expert": e_split + e_rep, "experts": self.n_routed_experts}
        m_split, m_rep = self.mlp_params(self.ffn_hidden)
        return {"split": a_split + m_split, "replicated": rep + m_rep, "expert": 0, "experts": 0}

    def embedding_params(self) -> tuple[int, int]:
        """(vocabulary-split, replicated) parameters of the input embedding: ``V h`` and the
        learned position table ``max_position h``."""
        pos = (self.max_position or self.seq_len) * self.hidden if self.position == "learned" else 0
        return self.vocab_size * self.hidden, pos

    def head_params(self) -> tuple[int, int]:
        """(vocabulary-split, replicated) parameters of the final norm and output layer
        (``V h`` unless tied to the input embedding)."""
        return (0 if self.tied_embeddings else self.vocab_size * self.hidden), self.norm_params()

    def total_params(self) -> int:
        """All parameters (the tied output layer counted once)."""
        total = sum(self.embedding_params()) + sum(self.head_params())
        for i in range(self.n_layer):
            lp = self.layer_params(self.is_moe_layer(i))
            total += lp["split"] + lp["replicated"] + lp["expert"] * lp["experts"]
        return total

    def active_params(self) -> int:
        """Parameters one token passes through (k routed experts instead of E): the N of the
        6 N tokens FLOP count. The input embedding is a lookup but is counted, as in the papers'
        totals (Kaplan et al. 2020 leave it out; the difference is < 1 % for these models)."""
        total = sum(self.embedding_params()) + sum(self.head_params())
        for i in range(self.n_layer):
            lp = self.layer_params(self.is_moe_layer(i))
            total += lp["split"] + lp["replicated"] + lp["expert"] * min(lp["experts"], self.n_activated_experts)
        return total

    @classmethod
    def from_gpt_config(cls, cfg, seq_len: int | None = None, global_batch: int = 1,
                        name: str = "labkit-gpt") -> "ModelSpec":
        """The spec of labkit's reference GPT for a :class:`labkit.model.GPTConfig` (learned
        positions of ``block_size``, LayerNorm, GeLU MLP of ``ffn_mult * n_embd``, untied head)."""
        return cls(name=name, n_layer=cfg.n_layer, hidden=cfg.n_embd, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                   ffn=cfg.ffn_mult * cfg.n_embd, vocab_size=cfg.vocab_size, seq_len=seq_len or cfg.block_size,
                   max_position=cfg.block_size, bias=cfg.bias, dropout=cfg.dropout, global_batch=global_batch,
                   tied_embeddings=bool(getattr(cfg, "share_embeddings_and_output_weights", False)),
                   source="labkit.model.GPT")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True)
class Layout:
    """How the model is split: TP degree ``t``, PP degree ``p``, DP degree ``d``, virtual
    chunks per pipeline rank ``v`` (interleaved 1F1B), microbatch size ``b`` (sequences),
    microbatches per step ``M`` (None: global_batch / (b d)), ``schedule`` ("gpipe" |
    "1f1b" | "interleaved" | "dualpipe": DeepSeek-V3's, two stages per rank, 2x parameters,
    p + 1 activations), ``zero`` stage 0-3 over the DP group (Rajbhandari et al. 2020),
    ``sequence_parallel``, ``recompute`` ("none" | "selective" | "full"), ``precision``
    ("fp32": 4-byte parameters and gradients, Adam moments 8 bytes; "bf16": mixed precision,
    2 + 2 bytes and 12 bytes of fp32 master weights and moments, ZeRO's K = 12), expert
    parallel degree ``ep`` (folded onto the DP group: it must divide d and E),
    ``fused_attention`` (a flash-attention kernel: no ``s^2`` activations), ``fp32_grads``
    (bf16 only: gradients accumulated and reduced in fp32, 4 bytes, Megatron-LM's
    ``accumulate_allreduce_grads_in_fp32`` and its theoretical-memory convention: 18 bytes per
    parameter, ``6 + 12/d`` with the distributed optimizer; off: labkit's 16 bytes, ``4 + 12/d``),
    ``pp_scatter_gather`` (time model only: Megatron sends each pipeline message as t shards
    of ``b s h / t`` and all-gathers it inside the node, Narayanan et al. 2021 sec. 4.1),
    ``reshard_after_forward`` (ZeRO-3 only: free each unit's gathered parameters after its forward
    and gather them again for backward, FSDP2's default; False keeps them, Llama 3's choice),
    ``placement`` of the p v stages: "loop" (stage i on rank i % p) | "v" (v = 2, rank r holds
    stages r and 2p-1-r: the V-shaped zero-bubble schedules ZB-V and DualPipeV, Qi et al. 2024
    sec. 6; memory's in-flight count then follows ``schedule``);
    context-parallel degree ``cp`` (the sequence split over cp ranks, load-balanced 2 cp
    chunks; ranks ordered TP, CP, DP, PP as Megatron-Core; N_GPU = t cp p d) and
    ``cp_attention`` ("allgather": K/V all-gathered, Llama 3; "ring"; "ulysses"), see
    :mod:`labkit.context_parallel`; ``etp``: the expert tensor-parallel degree
    (Megatron-Core's ``expert_tensor_parallel_size``: each routed expert's matrices split over
    ``etp`` of the t TP ranks; None: t, Megatron-Core's default; 1: whole experts on every TP
    rank, as labkit's MoE blocks hold them); ``hsdp``: R replicas of ZeRO-3 (HSDP, Zhao et al.
    2023 sec. 3.2: the dense model states sharded over the d/R ranks of a shard group and
    replicated across the R groups; the local experts stay whole, EP = d); ``shard_experts``
    (ZeRO 1-3 with an expert-data-parallel group of d/ep cp > 1 ranks: True, Megatron-Core's
    distributed optimizer, shards the experts' states over it; False, labkit's
    :class:`labkit.parallel.ParallelGPT`, keeps the local experts whole and all-reduces their
    gradients over it)."""

    t: int = 1
    p: int = 1
    d: int = 1
    v: int = 1
    b: int = 1
    M: int | None = None
    schedule: str = "1f1b"
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    precision: str = "bf16"
    ep: int = 1
    fused_attention: bool = False
    fp32_grads: bool = False
    pp_scatter_gather: bool = True
    reshard_after_forward: bool = True
    placement: str = "loop"
    cp: int = 1
    cp_attention: str = "allgather"
    etp: int | None = None
    hsdp: int = 1
    shard_experts: bool = True

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel degree in effect: ``etp``, or t when unset."""
        return self.t if self.etp is None else self.etp

    @property
    def n_gpus(self) -> int:
        return self.t * self.cp * self.p * self.d

    def describe(self) -> str:
        extra = [f"v={self.v}"] if self.v > 1 else []
        extra += [f"ep={self.ep}"] if self.ep > 1 else []
        extra += [f"etp={self.etp}"] if self.etp is not None and self.etp != self.t else []
        extra += [f"cp={self.cp} ({self.cp_attention})"] if self.cp > 1 else []
        return (f"t={self.t} p={self.p} d={self.d}{' ' + ' '.join(extra) if extra else ''} b={self.b} "
                f"M={self.M} {self.schedule} ZeRO-{self.zero} SP={'on' if self.sequence_parallel else 'off'} "
                f"recompute={self.recompute} {self.precision}{' fp32-grads' if self.fp32_grads else ''}"
                f"{' flash' if self.fused_attention else ''}")


@dataclass(frozen=True)
class Cluster:
    """GPUs and links: ``gpus_per_node``; ``gpu_memory`` (bytes); ``peak_flops`` (per GPU, the
    precision's dense peak); ``intra_bw`` / ``inter_bw``: bytes/s one GPU can send over the
    node's fabric (NVLink) and across nodes (its share of the InfiniBand NICs);
    ``compute_efficiency``: the share of peak a large GEMM reaches (the time model's only
    free constant; 0.68 fits Korthikanti et al. 2022 Table 5, see :data:`CLUSTERS`);
    ``hbm_bw``: bytes/s of the GPU's memory (A100 80GB: 2.0e12), for the memory-bound
    element-wise work (:mod:`.timing`)."""

    gpus_per_node: int = 8
    gpu_memory: float = 80e9
    peak_flops: float = 312e12
    intra_bw: float = 300e9
    inter_bw: float = 25e9
    compute_efficiency: float = 0.68
    hbm_bw: float = 2.0e12


def _p(**kw) -> ModelSpec:
    return ModelSpec(**kw)


# Published configurations (the "seeds" of the course and the models practitioners ask about).
PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    _p(name="megatron-8.3b", n_layer=72, hidden=3072, n_head=32, vocab_size=51200, seq_len=1024, global_batch=512,
       tied_embeddings=True,
       source="Shoeybi et al. 2019, Megatron-LM, Table 1 (8.3B: 72 layers, h 3072, 32 heads, 512 GPUs, 8-way MP)"),
    _p(name="gpt3-175b", n_layer=96, hidden=12288, n_head=96, vocab_size=51200, seq_len=2048, global_batch=1536,
       tied_embeddings=True,
       source="Brown et al. 2020, Table 2.1; Narayanan et al. 2021 Table 1 (1024 GPUs, batch 1536, t=8 p=16)"),
    _p(name="mt-nlg-530b", n_layer=105, hidden=20480, n_head=128, vocab_size=51200, seq_len=2048, global_batch=1920,
       tied_embeddings=True,
       source="Smith et al. 2022, MT-NLG, sec. 2-3 (105 layers, h 20480, 128 heads; 8 x 35 x 16 = 4480 A100 80GB)"),
    _p(name="llama3-70b", n_layer=80, hidden=8192, n_head=64, n_kv_head=8, ffn=28672, vocab_size=128256, seq_len=8192,
       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, global_batch=2048,
       source="Dubey et al. 2024, The Llama 3 Herd of Models, Table 3 (80 layers, h 8192, 64/8 heads, FFN 28672)"),
    _p(name="llama3-405b", n_layer=126, hidden=16384, n_head=128, n_kv_head=8, ffn=53248, vocab_size=128000,
       seq_len=8192, norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, global_batch=2048,
       source="Dubey et al. 2024, The Llama 3 Herd of Models, Table 3 (126 layers, h 16,384, FFN 53,248, 128/8 heads, "
              "vocabulary 128,000 as the paper rounds it; the released config, llama3.1-405b below, has 128,256) and "
              "Table 4 (16M tokens per batch: 2048 sequences of 8192)"),
    _p(name="mixtral-8x7b", n_layer=32, hidden=4096, n_head=32, n_kv_head=8, ffn=14336, vocab_size=32000, seq_len=4096,
       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, n_routed_experts=8,
       n_activated_experts=2, moe_ffn=14336, global_batch=1024,
       source="Jiang et al. 2024, Mixtral of Experts, Table 1 (32 layers, 8 experts, top-2; 46.7B / 12.9B active)"),
    _p(name="deepseek-v3", n_layer=61, hidden=7168, n_head=128, ffn=18432, vocab_size=129280, seq_len=4096,
       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, n_routed_experts=256,
       n_activated_experts=8, n_shared_experts=1, moe_ffn=2048, first_dense_layers=3, q_lora_rank=1536,
       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, router_bias=True, n_mtp_modules=1,
       global_batch=15360,
       source="DeepSeek-AI 2024, DeepSeek-V3 Technical Report, sec. 4.2 (61 layers, 256+1 experts, top-8; "
              "671B / 37B active; trained with 16-way PP, 64-way EP, ZeRO-1 DP, no TP)"),
    # dense models of about the MoEs' quality (notebook 14's decode cost): Mixtral 8x7B "outperforms Llama 2 70B"
    # (Jiang et al. 2024, sec. 3); DeepSeek-V3 is compared with Llama 3.1 405B (its report, Table 3)
    _p(name="llama2-70b", n_layer=80, hidden=8192, n_head=64, n_kv_head=8, ffn=28672, vocab_size=32000, seq_len=4096,
       norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, global_batch=1024,
       source="Touvron et al. 2023, Llama 2, Table 1 and the released config (80 layers, h 8192, 64/8 heads, "
              "FFN 28672; 4M tokens per batch)"),
    _p(name="llama3.1-405b", n_layer=126, hidden=16384, n_head=128, n_kv_head=8, ffn=53248, vocab_size=128256,
       seq_len=8192, norm="rmsnorm", mlp="swiglu", position="rope", bias=False, dropout=0.0, global_batch=2048,
       source="Dubey et al. 2024, The Llama 3 Herd of Models, Table 3 (126 layers, h 16384, 128/8 heads, "
              "FFN 53248; 16M tokens per batch)"),
    _p(name="bloom-176b", n_layer=70, hidden=14336, n_head=112, vocab_size=250880, seq_len=2048, position="alibi",
       tied_embeddings=True, dropout=0.0, global_batch=2048,
       source="BigScience 2022, BLOOM, sec. 3.4-3.5 and Table 3 (70 layers, h 14336, 112 heads, V 250,880, ALiBi, "
              "tied embeddings; TP 4 x PP 12 x DP 8 on 384 A100 80GB, bf16, ZeRO-1, activation checkpointing)"),
    *[_p(name=f"korthikanti-{n}", n_layer=L, hidden=h, n_head=a, vocab_size=51200, seq_len=2048, global_batch=B,
         tied_embeddings=True, dropout=0.1,
         source=f"Korthikanti et al. 2022, Table 3 ({n}: {a} heads, h {h}, {L} layers, batch {B}, s 2048, V 51,200)")
      for n, a, h, L, B in (("22b", 64, 6144, 48, 4), ("175b", 96, 12288, 96, 64), ("530b", 128, 20480, 105, 280),
                            ("1t", 160, 25600, 128, 512))],
]}

# The clusters of the published runs. compute_efficiency (the share of peak a GEMM reaches) is
# the time model's one free constant: 0.68 puts the eight iteration times of Korthikanti et al.
# 2022 Table 5 within 10 %. Selene: DGX A100 80GB, NVLink 3
# (300 GB/s per GPU and direction), 8 HDR InfiniBand NICs per node (25 GB/s per GPU), HBM2e 2.0 TB/s.
CLUSTERS: dict[str, Cluster] = {
    "selene-a100-80gb": Cluster(gpus_per_node=8, gpu_memory=80e9, peak_flops=312e12, intra_bw=300e9, inter_bw=25e9,
                                compute_efficiency=0.68, hbm_bw=2.0e12),
    # DeepSeek-V3 report sec. 3.1: H800 nodes, 8 GPUs on NVLink/NVSwitch (160 GB/s), 8 x 400 Gb/s InfiniBand
    # (50 GB/s per GPU); 989 TFLOP/s dense bf16 (the H100's SXM figure)
    # Llama 3 (Dubey et al. 2024 sec. 3.3.1): H100 80GB (700 W, HBM3 3.35 TB/s), 8 per server on NVLink
    # (450 GB/s per direction), 400 Gb/s RoCE per GPU (50 GB/s); 989 TFLOP/s dense bf16
    "h100-80gb": Cluster(gpus_per_node=8, gpu_memory=80e9, peak_flops=989e12, intra_bw=450e9, inter_bw=50e9,
                         compute_efficiency=0.68, hbm_bw=3.35e12),
    "h800-80gb": Cluster(gpus_per_node=8, gpu_memory=80e9, peak_flops=989e12, intra_bw=160e9, inter_bw=50e9,
                         compute_efficiency=0.68, hbm_bw=3.35e12),
}


# Figures the papers publish, which the tests and notebook 08 reproduce.
PUBLISHED = {
    # total and active parameters
    "parameters": {"megatron-8.3b": (8.3e9, 8.3e9), "gpt3-175b": (175e9, 175e9), "mt-nlg-530b": (530e9, 530e9),
                   "llama3-70b": (70.6e9, 70.6e9), "llama3-405b": (405e9, 405e9), "mixtral-8x7b": (46.7e9, 12.9e9),
                   "deepseek-v3": (671e9, 37e9)},
    # Shoeybi et al. 2019, abstract and sec. 5.1: 15.1 PFLOP/s over 512 GPUs, 76 % scaling
    # efficiency against one GPU's 39 TFLOP/s (30 % of the V100's peak)
    "megatron-8.3b": {"gpus": 512, "tflops_one_gpu": 39, "scaling": 0.76, "pflops": 15.1, "t": 8, "d": 64},
    # Smith et al. 2022, sec. 3: 8-way TP x 35-way PP x 16-way DP on 4480 A100 80GB,
    # 126 TFLOP/s per GPU (against 312 peak bf16), ~1.4 EFLOP/s peak for the cluster
    "mt-nlg-530b": {"t": 8, "p": 35, "d": 16, "gpus": 4480, "tflops_per_gpu": 126, "peak_tflops": 312,
                    "peak_eflops": 1.4, "gpu_memory_gb": 80},
    # Narayanan et al. 2021, Table 1: GPT-3 175B on 1024 A100, t=8, p=16, batch 1536, 140 TFLOP/s per GPU
    "gpt3-175b": {"t": 8, "p": 16, "gpus": 1024, "tflops_per_gpu": 140, "peak_tflops": 312},
    # Korthikanti et al. 2022, Table 3 (layouts: t = 8, microbatch b, pipeline p, v interleaved chunks as
    # sec. 6 states for 175B and 530B) and Table 5 (iteration seconds with full recompute and with
    # SP + selective recompute; MFU and HFU of the latter, %), on Selene (A100 80GB, 312 TFLOP/s bf16)
    "korthikanti-table5": {
        "korthikanti-22b": {"t": 8, "p": 1, "gpus": 8, "b": 4, "v": 1, "full": 1.42, "selective_sp": 1.10,
                            "mfu": 41.5, "hfu": 43.7},
        "korthikanti-175b": {"t": 8, "p": 8, "gpus": 64, "b": 1, "v": 3, "full": 18.13, "selective_sp": 13.75,
                             "mfu": 51.4, "hfu": 52.8},
        "korthikanti-530b": {"t": 8, "p": 35, "gpus": 280, "b": 1, "v": 3, "full": 49.05, "selective_sp": 37.83,
                             "mfu": 56.0, "hfu": 57.0},
        "korthikanti-1t": {"t": 8, "p": 64, "gpus": 512, "b": 1, "v": 1, "full": 94.42, "selective_sp": 71.49,
                           "mfu": 56.3, "hfu": 57.0}},
    # Korthikanti et al. 2022, Table 4: one 22B layer (t = 8, b = 4), forward / backward ms
    "korthikanti-table4": {"none": (7.7, 11.9), "sp": (7.2, 11.8), "full": (7.7, 19.5), "selective": (7.7, 13.2),
                           "selective_sp": (7.2, 13.1)},
    # BigScience 2022 (BLOOM) sec. 3.5: 384 A100 80GB, TP 4 x PP 12 x DP 8, bf16, ZeRO-1, checkpointing
    "bloom-176b": {"t": 4, "p": 12, "d": 8, "gpus": 384, "b": 2, "gpu_memory_gb": 80},
    # Dubey et al. 2024 (Llama 3), Table 4: the three 405B layouts on H100 80GB (989 TFLOP/s dense bf16),
    # 16M tokens per batch, TFLOP/s per GPU and BF16 MFU (%); ranks ordered [TP, CP, PP, DP] (sec. 3.3.2),
    # DP = FSDP without resharding after forward, K/V all-gathered for CP
    "llama3-405b": [
        {"gpus": 8192, "t": 8, "cp": 1, "p": 16, "d": 64, "seq_len": 8192, "batch_per_dp": 32,
         "tflops_per_gpu": 430, "mfu": 43},
        {"gpus": 16384, "t": 8, "cp": 1, "p": 16, "d": 128, "seq_len": 8192, "batch_per_dp": 16,
         "tflops_per_gpu": 400, "mfu": 41},
        {"gpus": 16384, "t": 8, "cp": 16, "p": 16, "d": 8, "seq_len": 131072, "batch_per_dp": 16,
         "tflops_per_gpu": 380, "mfu": 38}],
    # DeepSeek-V3 report sec. 3.2: 2048 H800 80GB, PP 16 x EP 64 (8 nodes) x ZeRO-1 DP, no TP, DualPipe
    "deepseek-v3": {"t": 1, "p": 16, "ep": 64, "gpus": 2048, "gpu_memory_gb": 80},
}


# What the Llama 3 paper leaves open, the planner assumes for its three 405B layouts: one sequence
# per microbatch, bf16, sequence parallelism with TP, a fused (flash) attention kernel, FSDP without
# resharding after forward as ZeRO-2 (gradients and optimizer state sharded, parameters kept),
# interleaved 1F1B with v = 7 chunks per rank (126 layers on 112 stages, uneven) and full activation
# recompute: without recompute rank 0 needs about 94 GB (tests/plan/test_plan_published.py).
LLAMA3_405B_ASSUMED = dict(b=1, zero=2, sequence_parallel=True, fused_attention=True, recompute="full",
                           schedule="interleaved", v=7)


def llama3_405b_layouts() -> list[tuple[ModelSpec, Layout, dict]]:
    """The three published Llama 3 405B layouts (Dubey et al. 2024, Table 4) as
    ``(spec at that sequence length and batch, Layout, published row)``, with
    :data:`LLAMA3_405B_ASSUMED` for what the paper does not state."""
    out = []
    for row in PUBLISHED["llama3-405b"]:
        spec = dataclasses_replace(PRESETS["llama3-405b"], seq_len=row["seq_len"],
                                   global_batch=row["d"] * row["batch_per_dp"])
        lay = Layout(t=row["t"], cp=row["cp"], p=row["p"], d=row["d"], **LLAMA3_405B_ASSUMED)
        out.append((spec, lay, row))
    return out


def preset(name: str) -> ModelSpec:
    """The preset called ``name``; ValueError listing the presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or give a JSON file)")
    return PRESETS[name]


def load_model_json(path: str, overrides: dict | None = None) -> ModelSpec:
    """A :class:`ModelSpec` from a JSON object with its field names (``name`` optional;
    ``overrides``: fields given elsewhere, e.g. on the command line, which win). ``global_batch``
    is required (here or in ``overrides``): the planner's microbatch count depends on it.
    Raises ValueError naming unknown or missing fields."""
    try:
        with open(path) as fh:
            obj = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model JSON {path!r}: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"model JSON {path!r} must hold an object, got {type(obj).__name__}")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"model JSON {path!r}: unknown fields {unknown}; known: {sorted(known)}")
    obj.setdefault("name", path)
    obj.update(overrides or {})
    required = [f.name for f in fields(ModelSpec) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required + ["global_batch"] if n not in obj]
    if missing:
        raise ValueError(f"model JSON {path!r}: missing field{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)} (required: {', '.join(n for n in required if n != 'name')} and "
                         f"global_batch, sequences per step, which --global-batch also sets)")
    try:
        return ModelSpec(**obj)
    except TypeError as e:
        raise ValueError(f"model JSON {path!r}: {e}") from None
