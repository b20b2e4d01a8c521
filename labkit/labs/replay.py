"""The MoE labs' verdict routes the single-device reference as the EP run did.

Routing the reference its own way could pick another expert where two scores are within
roundoff (a flipped top-k choice: the EP run summed in another order), and the gradients would
then differ although nothing is wrong. So the reference replays the EP run's routing
(:attr:`labkit.moe.router.TopKRouter.replay`), and every choice of the EP run that differs from
the reference's own must be such a near-tie: scores within :data:`TIE` (and a capacity drop
that differs must be a tie of gating weights at the C-th place). Anything else is a routing
bug and is reported.
"""
from __future__ import annotations

import torch

from ..moe.router import capacity_mask, route

TIE = 1e-5  # routing scores closer than this are a near-tie: either choice is correct


def replayed_routing(model, extras: list, problems: list):
    """Make ``model`` (the single-device reference, an MoE GPT with ``moe_layers()``) route the
    coming forward as the EP run did: ``extras[rank][layer] = (indices [T_p, k], keep [T_p, k])``,
    the EP ranks' routings in rank order (the reference routes its batch in the same P groups).
    Each choice that differs from the reference's own and is not a near-tie appends a message to
    ``problems``. Returns a function that undoes it (no recorded routing left, no check hook)."""
    hooks, routers = [], [layer.router for layer in model.moe_layers()]
    for layer, router in enumerate(routers):
        router.replay = [ex[layer] for ex in extras]
        hooks.append(router.register_forward_hook(
            lambda r, args, out, layer=layer: _check_near_ties(r, out, layer, problems)))

    def undo():
        for router, hook in zip(routers, hooks):
            router.replay = None
            hook.remove()
    return undo


@torch.no_grad()
def _check_near_ties(r, out, layer: int, problems: list) -> None:
    """Append a message to ``problems`` where the replayed routing ``out`` (a RouterOutput) of
    router ``r`` is not the reference's own choice up to near-ties (scores within TIE)."""
    logits, indices, keep, C = out.logits, out.indices, out.keep, out.capacity
    _, own, _ = route(logits, r.top_k, r.score_func, r.renormalize, r.n_expert_groups,
                                r.n_limited_groups, r.route_scale, r.expert_bias)
    sel = out.scores + (0 if r.expert_bias is None else r.expert_bias)
    differs = (own.sort(1).values != indices.sort(1).values).any(1)
    if bool(differs.any()):
        gaps = sel.gather(1, own).min(1).values - sel.gather(1, indices).min(1).values
        gap = float(gaps[differs].max())
        if gap > TIE:
            problems.append(f"MoE layer {layer}: the EP run routed {int(differs.sum())} token(s) to "
                            f"experts that score {gap:.2g} below the reference's choice")
    force = torch.zeros_like(logits).scatter_(1, indices, 1e4)  # the gating weights before dropping
    weights, _, _ = route(logits, r.top_k, r.score_func, r.renormalize, r.n_expert_groups, r.n_limited_groups,
                          r.route_scale, force if r.expert_bias is None else r.expert_bias + force)
    own_keep = capacity_mask(indices, weights, r.n_routed_experts, C, r.drop_policy)
    for t, j in (own_keep != keep).nonzero().tolist():
        e = indices[t, j]
        w = weights[indices == e].sort(descending=True).values
        if r.drop_policy != "probs" or len(w) <= C or float(w[C - 1] - w[C]) > TIE:
            problems.append(f"MoE layer {layer}: the EP run's capacity drops differ from the "
                            f"reference's (expert {int(e)}, C={C})")
            break
