"""Kernel side of notebook 07_attention_embedding_loss's exercises, whose cases are in
:mod:`labkit.grading.exercises.nb07_attention_embedding_loss` (what runs here: :mod:`labkit.grading.kernelside`).

7.3's ranks have no process group: their all-reduces reach the grader's
:class:`~labkit.grading.relay.Relay`, which counts them.
"""
from __future__ import annotations

import torch

from ..registry import CheckFailure, explain_index_errors
from ..relay import run_ranks

_OFFSET_HINT = ("the shard holds rows vocab_start .. vocab_start + V/t - 1 of the full table as ITS rows "
                "0 .. V/t - 1: a global id is not a row number of the shard")


_BELOW_HINT = ("ids below vocab_start belong to an earlier rank's block: after the offset is subtracted they are "
               "negative local rows, which must be masked like the ids past the end of the block")
_ABOVE_HINT = ("ids at or past vocab_start + V/t belong to a later rank's block: after the offset is subtracted they "
               "are rows past the end of the shard, which must be masked like the ids below the block")


def _index_error(fn, *args) -> bool:
    """Whether ``fn(*args)`` raises the IndexError that :func:`explain_index_errors` explains."""
    try:
        with explain_index_errors("", ""):
            fn(*args)
    except CheckFailure:
        return True
    except Exception:  # noqa: BLE001 - another error is not the one being explained
        return False
    return False


def _index_hint(partial_embedding, ids, shard, start) -> str:
    """Which ids the lookup cannot index (issue 36: negative local ids left unmasked were told to subtract
    vocab_start, which they did): the learner's function is called again on the ids inside the block, then
    on those below it, then on those above it; the first set that raises names the mistake. Only the message
    depends on it: the case has already failed."""
    n = shard.shape[0]
    flat = ids.reshape(-1)
    for sel, hint in (((flat >= start) & (flat < start + n), _OFFSET_HINT), (flat < start, _BELOW_HINT),
                      (flat >= start + n, _ABOVE_HINT)):
        part = flat[sel]
        if part.numel() and _index_error(partial_embedding, part.clone(), shard, start):
            return hint
    return _OFFSET_HINT


def _call_emb(partial_embedding, ids, shard, start, what):
    try:
        with explain_index_errors(what, "<hint>"):
            got = partial_embedding(ids.clone(), shard, start)
    except CheckFailure as e:
        raise CheckFailure(str(e).replace("<hint>", _index_hint(partial_embedding, ids, shard, start))) from None
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
