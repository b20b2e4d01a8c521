"""The backward of one stage in two parts: input gradient now (I), weight gradients later (W).

Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", sec. 2) split a layer's backward
``y = x A`` into B: ``dL/dx = dL/dy A^T`` (what the previous stage waits for) and W:
``dL/dA = x^T dL/dy`` (needed only by the optimizer step). For a whole stage we find, in its
autograd graph, the *boundary* between the part of the graph that leads to the stage input
and the part that leads only to parameters:

* a node is "parameter-only" when every path from it down the graph ends at a parameter of
  the stage (e.g. ``TBackward`` of a Linear weight, or a weight's ``AccumulateGrad``);
* the boundary nodes are the other nodes with a parameter-only child (``AddmmBackward`` of
  a Linear, ``NativeLayerNormBackward``): the gradient that flows *into* a boundary node is
  all that its weight gradient needs.

:func:`backward_input` (I) asks autograd for the input gradient and, in the same pass, for
the gradients flowing into the boundary nodes (passed as ``GradientEdge`` inputs), keeping
the graph (``retain_graph=True``): autograd then runs only the nodes on the way to the input
and skips the weight-gradient products. :func:`backward_weight` (W) runs the rest of the
graph from the boundary with those gradients and accumulates ``.grad`` of the parameters,
then frees the graph. A stage whose output does not depend on a differentiable input (the
first stage: token ids) has nothing for I to do; its W is the whole backward.

The sum of the two equals the unsplit ``torch.autograd.backward`` (tests compare every
parameter gradient with a single device and with torch's zero-bubble schedules).
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_input", "backward_weight", "PendingWeightGrad", "w_only_saved_bytes"]


PONLY = frozenset("p")


class PendingWeightGrad:
    """What I keeps for W, one entry per boundary node: its ``GradientEdge`` list, the
    gradients flowing into them, and the parameters below it to accumulate into."""

    def __init__(self, edges, grads, params):
        self.edges, self.grads, self.params = edges, grads, params

    @property
    def nbytes(self) -> int:
        """Bytes of the gradients kept for W (the output gradients of the boundary nodes);
        the activations W needs are kept too, and counted with the forward's stash."""
        return sum(g.numel() * g.element_size() for gs in (self.grads or []) for g in gs)


def _classify(roots, param_nodes: set):
    """For every node reachable from ``roots``: does it lead to an input ('o') and/or to
    parameters ('p')? Iterative post-order walk; returns {node: frozenset}."""
    lead: dict = {}
    stack = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if node in lead:
            continue
        if node in param_nodes:
            lead[node] = PONLY
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not children:
            # a leaf that is not a parameter (a stage input's AccumulateGrad) leads to "o"
            lead[node] = frozenset("o") if type(node).__name__ == "AccumulateGrad" else frozenset()
            continue
        if expanded:
            acc = frozenset()
            for c in children:
                acc |= lead.get(c, frozenset())
            lead[node] = acc
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in lead)
    return lead


def _as_list(x):
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def backward_input(outputs, inputs, grads, params):
    """I: the gradient of ``outputs`` (tensor or list; output gradients ``grads``, None for a
    scalar loss) with respect to the stage ``inputs`` only (tensor, list, or None).

    Returns (input gradients: a list with one entry per input, None where it gets none, or a
    single tensor/None when ``inputs`` was a tensor/None; :class:`PendingWeightGrad` for
    :func:`backward_weight`). The autograd graph is kept (``retain_graph=True``)."""
    single = inputs is None or isinstance(inputs, torch.Tensor)
    outs, ins = _as_list(outputs), [t for t in _as_list(inputs)]
    gouts = [None] * len(outs) if grads is None else (_as_list(grads) if not isinstance(grads, torch.Tensor)
                                                       else [grads])
    params = [p for p in params if p.requires_grad]

    def result(gins):
        return (gins[0] if ins else None) if single else gins

    if not outs:
        return result([None] * len(ins)), PendingWeightGrad([], [], [])
    param_nodes = {get_gradient_edge(p).node: p for p in params}
    roots = [get_gradient_edge(o).node for o in outs]
    lead = _classify(roots, set(param_nodes))
    used = [param_nodes[n] for n in lead if n in param_nodes]
    to_input = [t for t in ins if t.requires_grad]
    whole = [[get_gradient_edge(o) for o in outs]], [[g if g is not None else torch.ones_like(o)
                                                      for o, g in zip(outs, gouts)]], [used]
    if not to_input or not any("o" in lead[r] for r in roots):
        # nothing flows to an input: W is the whole backward, from the outputs
        return result([None] * len(ins)), PendingWeightGrad(*whole)
    # boundary nodes and, for each, the parameters below it through parameter-only nodes
    groups = []  # (boundary node, [params], the parameter-only nodes below it)
    for node, ld in lead.items():
        if "o" not in ld:
            continue
        below, stack, seen = [], [c for c, _ in node.next_functions if c is not None and lead.get(c) == PONLY], set()
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            if c in param_nodes:
                below.append(param_nodes[c])
            stack.extend(x for x, _ in c.next_functions if x is not None)
        if below:
            groups.append((node, below, seen))
    owner: dict = {}
    shared = False
    for node, _, seen in groups:
        for c in seen:
            if owner.setdefault(c, node) is not node:
                shared = True  # a parameter reached from two boundary nodes (e.g. a weight used twice)
    edges = [GradientEdge(n, k) for n, _, _ in groups for k in range(len(n._input_metadata))]
    res = torch.autograd.grad(outs, to_input + edges, grad_outputs=gouts, retain_graph=True, allow_unused=True)
    by_input = dict(zip(map(id, to_input), res[:len(to_input)]))
    gins = [by_input.get(id(t)) for t in ins]
    if shared:  # correct but slower: W runs the whole backward again, for the parameters only
        return result(gins), PendingWeightGrad(*whole)
    it = iter(res[len(to_input):])
    e_groups, g_groups, p_groups = [], [], []
    for n, below, _ in groups:
        pairs = [(GradientEdge(n, k), next(it)) for k in range(len(n._input_metadata))]
        pairs = [(e, g) for e, g in pairs if g is not None]
        if pairs:
            e_groups.append([e for e, _ in pairs])
            g_groups.append([g for _, g in pairs])
            p_groups.append(below)
    return result(gins), PendingWeightGrad(e_groups, g_groups, p_groups)


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the parameter gradients (``.grad``) from what :func:`backward_input`
    kept, then free the graph."""
    # one call per boundary node, restricted to the parameters below it: autograd then runs
    # only that node's weight-gradient outputs, not its way down to the input again
    for edges, grads, params in zip(pending.edges, pending.grads, pending.params):
        if edges and params:
            torch.autograd.backward(edges, grad_tensors=grads, inputs=params)
    pending.edges = pending.grads = pending.params = None


def w_only_saved_bytes(fn, inputs, grads=None, params=None, seed: int = 0) -> dict:
    """Measure, for one stage forward ``fn(*inputs)``, the bytes of *activations* (tensors
    autograd saves for backward, parameters excluded) that only W needs: the memory a
    microbatch holds between its I and its W beyond what I itself needs (the issue's
    "activations needed only for W"; Qi et al. 2024, sec. 2 and Table 1, count them per pass).

    ``inputs``: the stage inputs (tensors; copied, those with a floating dtype get
    ``requires_grad``); ``grads``: the output gradient(s) (None for a scalar loss);
    ``params``: default ``fn.parameters()`` when ``fn`` is a module.

    How: one forward under ``saved_tensors_hooks`` records every saved tensor. I
    (:func:`backward_input`) runs once as the reference; then, for each storage of saved
    activations, I runs again with that storage's tensors replaced by NaNs and by random
    values: if neither changes I's results (input gradients and the gradients kept for W),
    I does not need those values. W (:func:`backward_weight`) then runs with the real
    values, and the hooks record which storages it reads (an autograd node reads all its
    saved tensors when it runs, so a Linear's input, which W uses for ``x^T dy`` and I only
    for its shape, is read by both). Returns bytes (ints): ``saved`` (all saved
    activations, counted once per storage), ``read_by_w`` (those W reads) and ``w_only``
    (read by W, values not needed by I). A stage whose input is not differentiable (token
    ids) has no I work: everything W reads is W-only."""
    params = list(fn.parameters()) if params is None else list(params)
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    saved: list = []                 # (tensor, storage ptr) of saved activations
    state = {"poison": None, "mode": None, "read": set()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in param_ptrs:
            return ("param", t)
        saved.append((t, ptr))
        return ("act", len(saved) - 1)

    def unpack(h):
        kind, x = h
        if kind == "param":
            return x
        t, ptr = saved[x]
        state["read"].add(ptr)
        if state["poison"] is not None and ptr == state["poison"][0]:
            return state["poison"][1](t)
        return t

    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn(*ins)
    outs = [o for o in _as_list(out) if o.requires_grad]
    wants = [t for t in ins if t.requires_grad]

    def run_i():
        gins, pending = backward_input(outs, wants, grads, params)
        return [g for g in _as_list(gins) if g is not None] + [g for gs in pending.grads for g in gs], pending

    ref, pending = run_i()
    gen = torch.Generator().manual_seed(seed)
    # two replacements per storage (NaN and random values; integer and bool tensors: all zeros
    # and all ones), so that a value I needs cannot survive both by chance
    poisons = (lambda t: torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t),
               lambda t: (torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) if t.is_floating_point()
                          else torch.ones_like(t)))
    needed_by_i = set()
    sizes = {}
    for t, ptr in saved:
        sizes[ptr] = t.untyped_storage().nbytes()
    for ptr in sizes:
        for poison in poisons:
            state["poison"] = (ptr, poison)
            got, _ = run_i()
            if len(got) != len(ref) or not all(torch.equal(a, b) for a, b in zip(got, ref)):
                needed_by_i.add(ptr)
                break
    state["poison"] = None
    state["read"] = set()
    kept = [p.grad for p in params]  # W accumulates into .grad: leave the caller's gradients as they were
    for p in params:
        p.grad = None
    backward_weight(pending)
    for p, g in zip(params, kept):
        p.grad = g
    read_by_w = state["read"]
    return {"saved": sum(sizes.values()), "read_by_w": sum(sizes[p] for p in read_by_w),
            "w_only": sum(sizes[p] for p in read_by_w if p not in needed_by_i)}
