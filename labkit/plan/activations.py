"""Activation memory of one transformer layer: the paper's formulas and labkit's exact count.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
sec. 4 (eq. 1-2, Table 2) count the bytes a GPT layer keeps for backward, with 16-bit
activations (2 bytes) and 1-byte dropout masks; s sequence, b microbatch, h hidden, a heads,
t TP degree:

=========================================  =============================
no parallelism                             ``sbh (34 + 5 a s / h)``
tensor parallel (TP)                       ``sbh (10 + 24/t + 5 a s/(h t))``
TP + sequence parallel (SP)                ``sbh (34 + 5 a s / h) / t``
TP + SP + selective recompute              ``34 sbh / t``
full recompute                             ``2 sbh`` (the layer input only)
=========================================  =============================

Where the numbers come from (per layer, in tensor elements; ``e`` bytes per element, ``m``
bytes per dropout-mask element): the two LayerNorm inputs, the attention input and the MLP
input (4 sbh elements, replicated under TP: ``4e``), the two residual dropout masks (``2m``);
q, k, v and the output-projection input (4 sbh), the GeLU input and the second linear's input
(4 sbh each, ffn = 4h), all split by t: ``12e``; the softmax output, the attention dropout
mask and its output (``a s^2 b (2e + m)``). :func:`korthikanti_layer_activation_bytes`
writes exactly that with ``e`` and ``m`` as arguments, so fp32 (``e = 4``) is the same
count "adjusted to the element size".

labkit's layer (:class:`labkit.tensor_parallel.ParallelTransformerLayer`, the reference
:class:`labkit.model.Block`) keeps a little more or less than the paper, for reasons one can
see in the code; :func:`layer_activation_bytes` is its exact count (what
``saved_tensors_hooks`` sees):

* LayerNorm also saves its per-token mean and 1/std: ``2 sb`` values per LayerNorm
  (``ln_stat_bytes`` each: the activation dtype on CPU, fp32 on CUDA);
* the causal mask is built as an ``[s, s]`` bool tensor that ``masked_fill`` keeps
  (``s^2`` bytes, no b, not split); a fused attention kernel keeps neither it nor the scores;
* dropout masks: CPU torch multiplies by a mask of the activation dtype (``m = e``); the
  fused CUDA kernel keeps a bool mask (``m = 1``); with dropout 0 nothing is kept;
* GeLU is the exact (erf) GeLU as in the paper; the FFN width f is a parameter (paper: 4h);
* grouped-query attention (a_kv < a key/value heads): the attention core repeats k and v
  to a heads, and the matmuls keep the repeated copies (as many bytes as for a_kv = a);
  selective recompute keeps the un-repeated k and v (``a_kv/a`` of them);
* sequence parallel without the backward re-gather keeps the all-gathered attention and MLP
  inputs (full ``sbh``) instead of their shards.
"""
from __future__ import annotations

__all__ = ["korthikanti_layer_activation_bytes", "layer_activation_bytes", "torch_saved_bytes_per_element",
           "moe_layer_activation_bytes", "moe_row_bytes", "selective_bytes_before_core", "RECOMPUTE"]

RECOMPUTE = ("none", "selective", "full")


def _check(t: int, recompute: str, s: int, sequence_parallel: bool) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if t < 1:
        raise ValueError(f"tensor-parallel degree t must be >= 1, got {t}")
    if sequence_parallel and s % t:
        raise ValueError(f"sequence parallelism needs t={t} to divide the sequence length s={s}")


def korthikanti_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                       recompute: str = "none", bytes_per_element: int = 2,
                                       mask_bytes: int = 1) -> float:
    """Bytes of activations one layer keeps for backward, Korthikanti et al. 2022 eq. 1-2 /
    Table 2, with the element size ``e = bytes_per_element`` and the dropout-mask size
    ``m = mask_bytes`` as arguments (the paper: e = 2, m = 1).

    ``sbh (4e + 2m) + 12 e sbh / t + a s^2 b (2e + m) / t`` (TP; t = 1: no parallelism);
    with ``sequence_parallel`` every term is divided by t; ``recompute="selective"`` drops
    the ``a s^2 b`` term; ``"full"`` keeps only the layer input ``e sbh`` (divided by t with
    sequence parallelism). Returns bytes (a float: t need not divide everything).
    Raises ValueError for an unknown ``recompute`` or t < 1.
    """
    _check(t, recompute, s, False)
    e, m = bytes_per_element, mask_bytes
    sbh = s * b * h
    ts = t if sequence_parallel else 1
    if recompute == "full":
        return e * sbh / ts
    replicated = sbh * (4 * e + 2 * m) / ts
    split = sbh * 12 * e / t
    attn = a * s * s * b * (2 * e + m) / t
    return replicated + split + (0 if recompute == "selective" else attn)


def torch_saved_bytes_per_element(bytes_per_element: int, device: str = "cpu") -> dict:
    """What torch 2.x keeps besides the activations, by device: ``{"mask": m, "ln_stat": bytes}``.

    CPU: dropout multiplies by a mask of the activation dtype (m = e), LayerNorm keeps its mean
    and 1/std in the activation dtype. CUDA: the fused dropout keeps a bool mask (m = 1),
    LayerNorm keeps fp32 statistics (4 bytes).
    """
    if device == "cpu":
        return {"mask": bytes_per_element, "ln_stat": bytes_per_element}
    if device == "cuda":
        return {"mask": 1, "ln_stat": 4}
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", bytes_per_element: int = 4, ffn: int | None = None,
                           kv_heads: int | None = None, dropout: bool = False, mask_bytes: int | None = None,
                           ln_stat_bytes: int | None = None, regather_in_backward: bool = True,
                           fused_attention: bool = False) -> int:
    """labkit's exact count: bytes one :class:`labkit.tensor_parallel.ParallelTransformerLayer`
    (or :class:`labkit.model.Block` for t = 1) keeps for backward, per rank.

    Args: sequence length ``s``, microbatch ``b``, hidden ``h``, heads ``a``, TP degree ``t``,
    ``sequence_parallel``, ``recompute`` ("none" | "selective" | "full"), element size in
    bytes, FFN width ``ffn`` (default 4h), key/value heads ``kv_heads`` (default a),
    ``dropout`` (p > 0: masks are kept), ``mask_bytes`` and ``ln_stat_bytes`` (default: CPU
    torch, both = ``bytes_per_element``; see :func:`torch_saved_bytes_per_element`),
    ``regather_in_backward`` (see the layer), ``fused_attention`` (a flash-attention kernel, as
    in Megatron-Core with Transformer Engine: no ``s^2`` terms; it keeps the output and a
    per-row fp32 log-sum-exp ``[b, a/t, s]``; not labkit's layer). Returns an int (bytes).

    Term by term (N = s b tokens, e bytes, ts = t with SP else 1; see the module docstring
    for how it differs from the paper): LayerNorm inputs ``2 N h e / ts`` and statistics
    ``4 N ln_stat / ts``; attention and MLP inputs ``2 N h e / ts`` (``/ 1`` under TP, or SP
    without re-gather); q, k, v, output-projection input ``4 N h e / t``; causal mask ``s^2``;
    softmax ``a s^2 b e / t``; GeLU input and second-linear input ``2 N f e / t``; with
    dropout the masks ``(2 N h / ts + a s^2 b / t) m`` and the dropped scores ``a s^2 b e / t``.
    Raises ValueError for an unknown ``recompute``, t < 1, or SP with t not dividing s.
    """
    _check(t, recompute, s, sequence_parallel)
    e = bytes_per_element
    f = 4 * h if ffn is None else ffn
    a_kv = a if kv_heads is None else kv_heads
    m = e if mask_bytes is None else mask_bytes
    st = e if ln_stat_bytes is None else ln_stat_bytes
    N = s * b
    ts = t if sequence_parallel else 1
    if recompute == "full":
        return N * h * e // ts                                    # the layer input
    tin = ts if (sequence_parallel and regather_in_backward) else 1
    total = 2 * N * h * e // ts + 2 * 2 * N * st // ts           # LN1, LN2: input + mean, 1/std
    total += 2 * N * h * e // tin                                 # attention and MLP inputs
    total += 2 * N * f * e // t                                   # GeLU input, fc2 input
    total += N * h * e // t                                       # output-projection input
    if dropout:
        total += 2 * N * h * m // ts                              # residual dropout masks
    if recompute == "selective":                                  # keep q, k, v; no s^2 term
        return total + N * (a + 2 * a_kv) * (h // a) * e // t
    if fused_attention:                                           # q, k, v, output, log-sum-exp
        return total + N * (2 * a + 2 * a_kv) * (h // a) * e // t + N * a * 4 // t
    total += 3 * N * h * e // t                                   # q, k, v (k, v repeated for GQA)
    total += s * s                                                # causal mask (bool)
    total += a * s * s * b * e // t                               # softmax output
    if dropout:
        total += a * s * s * b * (m + e) // t                     # dropout mask + dropped scores
    return total


def selective_bytes_before_core(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                                bytes_per_element: int = 4, kv_heads: int | None = None,
                                ln_stat_bytes: int | None = None, regather_in_backward: bool = True) -> int:
    """Of the stash :func:`layer_activation_bytes` counts for ``recompute="selective"``, the bytes
    still held when the layer's backward reaches its checkpointed attention core: LN1's input and
    statistics ``N h e/ts + 2 N ln_stat/ts``, the attention input ``N h e/tin`` and the
    checkpoint's q, k, v ``N (a + 2 a_kv)(h/a) e/t`` (arguments and notation as there). The rest
    (LN2, the MLP, the output-projection input, the residual dropout masks) is freed by then:
    torch's autograd engine runs the nodes made later in forward first, and frees each node's
    saved tensors once it ran."""
    _check(t, "selective", s, sequence_parallel)
    e, N = bytes_per_element, s * b
    a_kv = a if kv_heads is None else kv_heads
    st = e if ln_stat_bytes is None else ln_stat_bytes
    ts = t if sequence_parallel else 1
    tin = ts if (sequence_parallel and regather_in_backward) else 1
    return N * h * e // ts + 2 * N * st // ts + N * h * e // tin + N * (a + 2 * a_kv) * (h // a) * e // t


def moe_row_bytes(h: int, ffn: int, bytes_per_element: int = 4, glu: bool = False, expert_tp: int = 1) -> int:
    """Bytes one routed row keeps in the experts of the rank that received it (labkit's
    :class:`labkit.moe.expert_parallel.ExpertParallelMoE`): the expert's input row ``h e`` (the
    received rows, regrouped by local expert: one storage), its hidden activations (GeLU: the GeLU
    input and the second linear's input, ``2 f e``; SwiGLU: w1's output, SiLU's output, w3's output
    and their product, ``4 f e``; divided by ``expert_tp`` when each expert's width is split), and
    the two int64 orderings of the received rows (by local expert and back): 16 bytes."""
    hidden = (4 if glu else 2) * ffn * bytes_per_element // expert_tp
    return h * bytes_per_element + hidden + 16


def moe_layer_activation_bytes(tokens: int, h: int, n_experts: int, top_k: int, ffn: int,
                               bytes_per_element: int = 4, received_rows: int | None = None, glu: bool = False,
                               expert_tp: int = 1, aux_loss: bool = True, loss_tokens: int | None = None) -> int:
    """labkit's exact count: bytes one MoE layer (:class:`labkit.moe.expert_parallel.ExpertParallelMoE`,
    sort-based dispatch, softmax scores, no capacity dropping, no padding mask) keeps for backward
    on one rank for one microbatch of ``tokens`` N tokens, besides its input (the router's and the
    shared experts' input, the block's MLP input) and besides the shared experts. Returns bytes.

    The part that follows from N alone (every token sends its k slots out and gets them back):
    router scores (softmax) ``N E e``, the top-k indices of the gather ``8 N k``, the capacity mask
    ``N k`` (bool), the Switch aux loss (``aux_loss``: its own softmax ``N' E e``, the token mask
    ``N' e`` and its sum, the fractions ``E e``, over the N' = ``loss_tokens`` tokens it sees,
    default N; under sequence parallelism the whole group's b S, whose logits are all-gathered
    over TP, :class:`labkit.parallel.moe_pipeline.ParallelMoEBlock`), the permutation's token
    index and slot ``2 x 8 N k``,
    the gating weights of the slots ``N k e``, the returned rows and their weighted copy
    ``2 N k h e``. The part that follows the routing: :func:`moe_row_bytes` per row this rank
    RECEIVED (``received_rows``; which experts a rank holds and what the tokens chose decide it:
    ``None`` takes the balanced ``N k``, the mean over the EP group, exact for its sum).
    Source: the code of :mod:`labkit.moe` (router, losses, dispatch, expert_parallel), measured
    with ``saved_tensors_hooks`` in tests/plan/test_plan_moe_activations.py."""
    e, N, k = bytes_per_element, tokens, top_k
    rows = N * k if received_rows is None else received_rows
    routing = N * n_experts * e + 8 * N * k + N * k                     # scores, gather index, keep mask
    if aux_loss:
        Nl = N if loss_tokens is None else loss_tokens
        routing += Nl * n_experts * e + Nl * e + 4 + n_experts * e        # aux softmax, mask and its sum, f
    slots = 2 * 8 * N * k + N * k * e + 2 * N * k * h * e                 # token index, slot, weights, rows
    return routing + slots + rows * moe_row_bytes(h, ffn, e, glu, expert_tp)
