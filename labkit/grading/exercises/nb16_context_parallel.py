"""Exercises of notebook 16_context_parallel: the log-sum-exp merge and the causal chunk placement.

* 16.1 merge two partial attention results over disjoint key blocks, ``(out, lse)`` each, into
  full attention's: checked against attention over all keys (the merge is exact, so every row of
  the output and of the log-sum-exp must match). Plausible wrong merges are named: the outputs
  averaged or added (each was normalised by its own block's sum), weights from the log-sum-exps
  themselves, and the overflow of an unshifted ``exp(lse)``; a block whose keys are all masked
  (``lse = -inf``) must contribute nothing.
* 16.2 the chunk placement of the sequence over cp ranks, 2 cp chunks: every chunk held once, two
  per rank, the causal work (unmasked query-key pairs) equal on every rank. Any placement with
  equal work passes; the contiguous pairs and the pairs (i, i + cp) are named.

Ground truth: :mod:`labkit.context_parallel.blockwise`, :mod:`labkit.context_parallel.sharding`.
"""
from __future__ import annotations

import torch

from ...context_parallel.blockwise import block_attention
from ..registry import CheckFailure, as_int, exercise, type_name

# ----------------------------------------------------------------------------- 16.1
ex161 = exercise(
    "16.1", title="the log-sum-exp merge of two partial softmaxes", notebook="16_context_parallel", points=3,
    hint=("Section 2: each block's output is normalised by its own block's sum of exponentials. What share of the "
          "total sum does each block hold, and how do you get it from the two log-sum-exps without leaving the log "
          "domain?"))
ex161.hint2 = ("Write each block's output as its unnormalised sum divided by its own normaliser: what must the merged "
               "result be divided by instead, and how do you get that quantity from the two log-sum-exps without ever "
               "computing an exponential that can overflow? What should a block with no visible key contribute?")
ex161.hint_review = ("leads: asks for each block's share and how to stay in the log domain; no function and no "
                     "weights given; reviewed 2026-12-06")


def _partials(seed, B=2, h=3, Sq=5, Sk=(4, 6), d=4, scale=1.0, causal_block=None):
    """Queries and two key blocks; returns (q, blocks as (k, v, k_pos), q_pos, full out, full lse)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, h, Sq, d, generator=g, dtype=torch.float64) * scale
    ks = [torch.randn(B, h, n, d, generator=g, dtype=torch.float64) * scale for n in Sk]
    vs = [torch.randn(B, h, n, d, generator=g, dtype=torch.float64) for n in Sk]
    n_a = Sk[0]
    k_pos = torch.arange(sum(Sk))
    if causal_block == "b":           # block b's keys all lie after every query: fully masked
        q_pos = torch.arange(n_a - Sq, n_a)
    elif causal_block == "both":      # the first two queries come before every key: no key at all
        q_pos = torch.arange(-2, Sq - 2)
    else:
        q_pos = torch.arange(sum(Sk) - Sq, sum(Sk))
    causal = causal_block is not None
    parts = [block_attention(q, k, v, q_pos, p, causal) for k, v, p in
             ((ks[0], vs[0], k_pos[:n_a]), (ks[1], vs[1], k_pos[n_a:]))]
    full = block_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), q_pos, k_pos, causal)
    return parts, full


def _wrong_merges(oa, la, ob, lb):
    """What plausible wrong merges return, to name the mistake."""
    out = {}
    out["averaged"] = ((oa + ob) / 2, None)
    out["added"] = (oa + ob, None)
    s = la + lb
    out["lse weights"] = (la[..., None] / s[..., None] * oa + lb[..., None] / s[..., None] * ob, None)
    za, zb = la.nan_to_num(neginf=0.0), lb.nan_to_num(neginf=0.0)
    z = torch.logaddexp(za, zb)
    out["-inf as 0"] = (torch.exp(za - z)[..., None] * oa + torch.exp(zb - z)[..., None] * ob, None)
    out["unnormalised"] = (la.exp()[..., None] * oa + lb.exp()[..., None] * ob, None)
    lse = torch.logaddexp(la, lb)
    out["inverted"] = (torch.exp(lse - la)[..., None] * oa + torch.exp(lse - lb)[..., None] * ob, None)
    return out


def _merge_case(seed, what, **kw):
    def case(merge):
        (oa, la), (ob, lb) = (p for p in _partials(seed, **kw)[0])
        out_full, lse_full = _partials(seed, **kw)[1]
        got = merge(oa.clone(), la.clone(), ob.clone(), lb.clone())
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(f"{what}: expected a pair (out, lse), got {type(got).__name__}")
        out, lse = got
        for name, t, ref in (("out", out, out_full), ("lse", lse, lse_full)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape):
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckFailure(f"{what}: {name} must be a tensor of shape {tuple(ref.shape)}, got {shape}")
        out, lse = out.double(), lse.double()
        if not torch.isfinite(out).all():
            masked = bool(torch.isinf(lb).any())
            nothing = bool((torch.isinf(la) & torch.isinf(lb)).any())
            why = (" (some rows see no key in either block: what is a weighted sum over no keys, and what does "
                   "exp(-inf - (-inf)) give?)" if nothing else
                   " (block b has no visible key for some rows, lse_b = -inf: it must weigh nothing, and "
                   "-inf minus -inf is not a number)" if masked else
                   " (the scores are large here: exp of a log-sum-exp overflows; only differences of "
                   "log-sum-exps are safe to exponentiate)")
            raise CheckFailure(f"{what}: out has {int((~torch.isfinite(out)).sum())} non-finite values{why}")
        if not torch.allclose(out, out_full, rtol=1e-6, atol=1e-9):
            why = ""
            for name, (w, _) in _wrong_merges(oa, la, ob, lb).items():
                if torch.allclose(out, w, rtol=1e-6, atol=1e-9):
                    why = {"averaged": " (the two outputs were averaged: each is normalised by its own block's "
                                       "sum, so equal weights are right only when both blocks hold the same "
                                       "total weight)",
                           "added": " (the two outputs were added: the weights of all keys then sum to 2, not 1)",
                           "lse weights": " (the weights were lse_a / (lse_a + lse_b): log-sum-exps are logarithms, "
                                          "a block's share of the total is not their ratio)",
                           "-inf as 0": " (lse_b = -inf was treated as 0: a block with no visible key must weigh "
                                        "nothing)",
                           "unnormalised": " (each block's output weighted by its own sum of exponentials, with "
                                           "nothing dividing by the total: the weights do not add up to 1)",
                           "inverted": " (each block weighted by the total over its own sum: the inverse of its "
                                       "share, so the weights add up to more than 1)"}[name]
            err = float((out - out_full).abs().max())
            raise CheckFailure(f"{what}: out differs from attention over all keys by up to {err:.3g}{why}")
        finite = torch.isfinite(lse_full)
        if not torch.equal(torch.isfinite(lse), finite) or not torch.allclose(lse[finite], lse_full[finite],
                                                                              rtol=1e-6, atol=1e-9):
            why = ""
            if torch.allclose(lse, torch.maximum(la, lb), rtol=1e-6, atol=1e-9):
                why = " (this is the larger of the two: the merged lse is the log of BOTH blocks' sums)"
            elif torch.allclose(lse, la + lb, rtol=1e-6, atol=1e-9):
                why = " (this is lse_a + lse_b, the log of a product of sums, not of their sum)"
            raise CheckFailure(f"{what}: lse differs from the log-sum-exp over all keys{why}")
    return case


ex161.case("two blocks of keys, 4 and 6")(_merge_case(1610, "merge(block of 4 keys, block of 6 keys)"))
ex161.case("blocks of unequal weight (4 and 12 keys)")(
    _merge_case(1611, "merge(block of 4 keys, block of 12 keys)", Sk=(4, 12)))
ex161.case("large scores (lse up to about 1000)")(
    _merge_case(1612, "merge(scores scaled by 20)", scale=20.0))
ex161.case("causal: block b fully masked for every query")(
    _merge_case(1613, "merge(causal, block b after every query)", Sq=4, Sk=(6, 5), causal_block="b"))
ex161.case("causal: two rows see no key in either block")(
    _merge_case(1616, "merge(causal, two rows before every key)", Sq=4, Sk=(4, 4), causal_block="both"))
ex161.case("one query row, 1 and 9 keys", hidden=True)(
    _merge_case(1614, "merge(1 query, blocks of 1 and 9 keys)", Sq=1, Sk=(1, 9)))
ex161.case("causal rows over both blocks", hidden=True)(
    _merge_case(1615, "merge(causal, rows over both blocks)", Sq=6, Sk=(5, 6), causal_block="a"))


# ----------------------------------------------------------------------------- 16.2
ex162 = exercise(
    "16.2", title="the causal chunk placement", notebook="16_context_parallel", points=3,
    hint=("Section 4: under a causal mask a chunk's work grows with its position in the sequence. With two chunks per "
          "rank, how can every rank get the same total, whatever cp is?"))
ex162.hint2 = ("Compute the causal work of each of the 2cp chunks for cp = 2 (it grows with the chunk's index). Which "
               "pairs of chunks give every rank the same total?")
ex162.hint_review = ("leads: asks how to pair chunks for equal work and suggests the cp = 2 case; the pairing rule is "
                     "the learner's; reviewed 2026-12-06")


def _chunk_work(c: int, m: int) -> int:
    """Unmasked query-key pairs of the m queries of chunk c (keys up to each query's position)."""
    return c * m * m + m * (m + 1) // 2


def _placement_case(cp, what, m=4):
    def case(placement):
        got = placement(cp)
        if isinstance(got, torch.Tensor) or type(got).__module__ == "numpy":
            got = got.tolist()
        want_shape = f"expected a list of {cp} pairs of chunk ids (two chunks per rank)"
        if not isinstance(got, (list, tuple)):
            raise CheckFailure(f"{what}: {want_shape}, got {type_name(got)}")
        if len(got) != cp:
            raise CheckFailure(f"{what}: {want_shape}, got {len(got)} items (one pair per rank: cp = {cp})")
        pairs = []
        for i, r in enumerate(got):
            if isinstance(r, torch.Tensor) or type(r).__module__ == "numpy" and hasattr(r, "tolist"):
                r = r.tolist() if getattr(r, "ndim", getattr(r, "dim", lambda: 0)) != 0 else r
            if not isinstance(r, (list, tuple)) or len(r) != 2:
                raise CheckFailure(f"{what}: {want_shape}; item {i} (rank {i}) is "
                                   + (f"a {type(r).__name__} of {len(r)} chunk ids" if isinstance(r, (list, tuple))
                                      else type_name(r)))
            for c in r:
                if as_int(c) is None:
                    raise CheckFailure(f"{what}: chunk ids are ints; rank {i}'s pair holds {type_name(c)}")
            pairs.append(tuple(as_int(c) for c in r))
        got = pairs
        flat = sorted(c for r in got for c in r)
        if flat != list(range(2 * cp)):
            twice = sorted({c for c in flat if flat.count(c) > 1})
            missing = sorted(set(range(2 * cp)) - set(flat))
            raise CheckFailure(f"{what}: every chunk 0..{2 * cp - 1} must be held by exactly one rank; "
                               f"held twice {twice}, held by nobody {missing} (placement {got})")
        work = [sum(_chunk_work(c, m) for c in r) for r in got]
        if len(set(work)) > 1:
            why = ""
            if [sorted(r) for r in got] == [[2 * i, 2 * i + 1] for i in range(cp)]:
                why = (" (neighbouring chunks on each rank: this is the contiguous split again, the last rank "
                       "still does the most)")
            elif [sorted(r) for r in got] == [[i, i + cp] for i in range(cp)]:
                why = (" (chunk i with chunk i + cp: every rank gets one early and one late chunk, but the later "
                       "rank's pair is still later in both)")
            raise CheckFailure(f"{what}: causal work per rank (query-key pairs, {m} tokens per chunk) is {work}: "
                               f"not equal{why}")
    return case


ex162.case("cp = 2")(_placement_case(2, "placement(2)"))
ex162.case("cp = 4")(_placement_case(4, "placement(4)"))
ex162.case("cp = 1")(_placement_case(1, "placement(1)"))
ex162.case("cp = 16 (Llama 3's long-context layout)", hidden=True)(_placement_case(16, "placement(16)"))
ex162.case("cp = 3", hidden=True)(_placement_case(3, "placement(3)"))


# ----------------------------------------------------------------------------- fresh inputs (labkit.grading.fresh)
from ..fresh import fresh_case, seed  # noqa: E402


def _merge_draw(r):
    Sq, n_a, n_b = r.randint(1, 6), r.randint(1, 8), r.randint(1, 8)
    causal = r.choice([None, "a"]) if n_a + n_b >= Sq else None
    return seed(r), "merge(random blocks)", dict(Sq=Sq, Sk=(n_a, n_b), scale=r.choice([1.0, 5.0]),
                                                 causal_block=causal)


fresh_case(ex161, "random block sizes and scales", _merge_draw, lambda s, what, kw: _merge_case(s, what, **kw))
fresh_case(ex162, "random cp", lambda r: (r.randint(1, 32), "placement(random cp)"), _placement_case)
