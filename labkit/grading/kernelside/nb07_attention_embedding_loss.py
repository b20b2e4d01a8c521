"""Kernel side of notebook 07_attention_embedding_loss's exercises: the code that runs next to the learner's
code (``answer.run(fn, ...)`` in the cases of :mod:`labkit.grading.exercises.nb07_attention_embedding_loss`).

It lives outside ``labkit.grading.exercises`` because the graded kernel cannot read that
package (:mod:`labkit.grading.session`); nothing here computes an expected value. 7.3's ranks
have no process group: their all-reduces reach the grader's
:class:`~labkit.grading.relay.Relay`, which counts them.
"""
from __future__ import annotations

import torch

from ..registry import CheckFailure, explain_index_errors
from ..relay import run_ranks

_OFFSET_HINT = ("the shard holds rows vocab_start .. vocab_start + V/t - 1 of the full table as ITS rows "
                "0 .. V/t - 1: a global id is not a row number of the shard")


def _call_emb(partial_embedding, ids, shard, start, what):
    with explain_index_errors(what, _OFFSET_HINT):
        got = partial_embedding(ids.clone(), shard, start)
    if not isinstance(got, torch.Tensor):
        raise CheckFailure(f"{what}: expected a tensor, got {type(got).__name__}")
    return got


def _emb_grad(partial_embedding, ids, shard, start, G, what):
    """Kernel side: the learner's lookup on a shard that requires grad, backpropagated with G;
    returns the shard's gradient."""
    shard = shard.clone().requires_grad_(True)
    got = _call_emb(partial_embedding, ids, shard, start, what)
    if not got.requires_grad:
        raise CheckFailure(f"{what}: the result does not depend on weight_shard (no gradient can flow)")
    (got * G).sum().backward()
    return shard.grad


def _gather_refused(name: str) -> CheckFailure:
    return CheckFailure(f"vocab_parallel_ce must use only all-reduces of N values, but it called {name} "
                        f"(gathering the logits costs N*V values)")


def _run_ce(vocab_parallel_ce, t, logits, target, relay_address):
    """Kernel side: the learner's loss on t ranks (rank r gets its vocabulary block), whose
    all-reduces go through the grader's relay at ``relay_address`` (no process group: any other
    collective raises); per rank its loss. The relay, not this code, counts the all-reduces."""
    V = logits.shape[1]

    def body(ctx):
        n = V // t
        local = logits[:, ctx.rank * n:(ctx.rank + 1) * n].clone()
        with explain_index_errors(
                f"vocab_parallel_ce on rank {ctx.rank} (logits of ids {ctx.rank * n}..{(ctx.rank + 1) * n - 1})",
                "local_logits holds the columns of ids r*V/t .. (r+1)*V/t - 1 as its columns 0 .. V/t - 1: "
                "a global target id is not a column number of this rank's block"):
            loss = vocab_parallel_ce(local, target.clone(), ctx.group)
        if not isinstance(loss, torch.Tensor):
            raise CheckFailure(f"vocab_parallel_ce returned {type(loss).__name__}, not a tensor")
        return loss.detach().clone()

    return run_ranks(body, t, relay_address, allowed=("all_reduce",), refuse=_gather_refused, timeout=16)
